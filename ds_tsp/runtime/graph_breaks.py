"""Where ``torch.compile`` (``engine.compile()``, or ``torch.compile`` of the model)
breaks a TSP model's graph: each decoder layer traced by
``torch._dynamo.explain`` on the inputs it received in one forward of the
model, so that a user sees how many graphs each layer becomes, and why."""

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerGraphBreaks:
    """One decoder layer under ``torch._dynamo.explain``: ``graphs`` traced, ``breaks`` between them and their
    distinct ``reasons`` (the first line of each and where it broke, in the order met: at a schedule, an
    ``EagerFunction``, the first thing in it that dynamo could not trace); ``kind`` names its blocks."""

    index: int
    kind: str
    graphs: int
    breaks: int
    reasons: tuple


def layer_kind(layer):
    """The TSP decoder layer's blocks by class: its token mixer, then its MLP (or experts); a layer of one
    block (Nemotron-H's) names that one."""
    blocks = [layer.token_mixer, getattr(layer, "mlp", None)]
    return " + ".join(type(block).__name__ for block in blocks if block is not None)


def where(stack):
    """`` at file:line < its caller`` for the two innermost frames of ``stack`` (a break's user stack) in
    ds_tsp's code (else the innermost frame), or nothing."""
    ours = [frame for frame in stack if f"{os.sep}ds_tsp{os.sep}" in frame.filename] or stack[-1:]
    return "".join(f"{' at' if i == 0 else ' <'} {os.path.basename(frame.filename)}:{frame.lineno}"
                   for i, frame in enumerate(reversed(ours[-2:])))


def layer_graph_breaks(model, **batch):
    """``LayerGraphBreaks`` of every decoder layer of the TSP ``model`` (an injected model, or the engine's
    module), each traced (forward, with autograd on) on the inputs it receives in a forward of ``model`` on
    ``batch`` (``input_ids=...``, as the model's forward takes it). Every rank of the TSP group calls it: the
    layers' collectives run."""
    layers = model.get_submodule(model.tsp_policy.layers)
    calls = {}
    handles = [layer.register_forward_pre_hook(
        lambda module, args, kwargs, index=index: calls.setdefault(index, (args, kwargs)), with_kwargs=True)
        for index, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    found = []
    for index, layer in enumerate(layers):
        (hidden, *args), kwargs = calls[index]
        explained = torch._dynamo.explain(layer)(hidden.detach().requires_grad_(), *args, **kwargs)
        reasons = dict.fromkeys(f"{cause.reason.strip().splitlines()[0]}{where(cause.user_stack)}"
                                for cause in explained.break_reasons)
        found.append(LayerGraphBreaks(index, layer_kind(layer), explained.graph_count, explained.graph_break_count,
                                      tuple(reasons)))
    return found
