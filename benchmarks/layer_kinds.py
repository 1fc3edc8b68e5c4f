"""Every TSP block kind beside the Hugging Face module it replaces, at D = 1, for
``block_overhead.py``: the layers of ``compare_model``'s models (the attention
layer, the latent attention in both forms, the Gated DeltaNet layer and the
hybrid's gated attention, a Mamba-2 mixer, an expert block under both
schedules) and the folded LM head with its loss against Hugging Face's head
and loss over full logits.

Each pair is taken from one forward of the whole model: a hook records the
inputs each layer (and the head) received, and the timing calls the layer again
on them, forward and backward with the same output gradient. So the TSP layer
runs exactly as the injected model runs it (its rotary tables, its packing) and
the HF layer as Hugging Face's model runs it."""

import argparse
import copy
from dataclasses import dataclass
from unittest import mock

import torch
from transformers import AutoModelForCausalLM

import ds_tsp
import ds_tsp.injection.model as tsp_model_module
from ds_tsp.config import TSPConfig
from ds_tsp.parallel.topology import TSPTopology
from compare_model import add_model_arguments, model_config

# (kind, compare_model's model, layer index, tsp options): the layer of each kind in the model of its row.
LAYER_KINDS = (
    ("attention", "dense", 0, {}),
    ("latent attention, expanded", "mla", 0, {"latent_attention": "expanded"}),
    ("latent attention, absorbed", "mla", 0, {"latent_attention": "absorbed"}),
    ("Gated DeltaNet", "hybrid", 0, {}),
    ("gated attention (Qwen3.5)", "hybrid", 3, {}),
    ("Mamba-2 mixer", "nemotron", 0, {}),
    ("experts, ring", "moe", 0, {"moe_schedule": "ring"}),
    ("experts, all-to-all", "moe", 0, {"moe_schedule": "all_to_all"}),
)
HEAD_KIND = ("folded LM head + loss", "dense")
KINDS = tuple(kind for kind, *_ in LAYER_KINDS) + (HEAD_KIND[0],)


@dataclass
class Pair:
    """A timed pair: ``hf()`` and ``tsp()`` each run one forward + backward and
    return ``(output, input gradient)``."""

    kind: str
    hf: object
    tsp: object


def model_args(model, seq_len, vocab):
    """``compare_model``'s sizes for ``model`` (its command-line defaults); the MoE row's 8 experts of 256, top 2."""
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, vocab)
    return argparse.Namespace(**vars(parser.parse_args([])), model=model, seq_lens=[seq_len], experts=8, top_k=2,
                              expert_intermediate=256)


def build_models(model, seq_len, vocab, tsp_options, dtype=torch.float32):
    """``(hf, tsp)``: the Hugging Face model of ``compare_model`` and its TSP model at D = 1."""
    config = model_config(model_args(model, seq_len, vocab))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).to(dtype)
    tsp = ds_tsp.inject(copy.deepcopy(hf), TSPTopology(1),
                        TSPConfig(enabled=True, size=1, attention_backend="sdpa", **tsp_options))
    return hf, tsp


def recorded_inputs(layer):
    """A hook on ``layer`` that records the positional and keyword inputs of its calls."""
    calls = []
    handle = layer.register_forward_pre_hook(lambda module, args, kwargs: calls.append((args, kwargs)),
                                             with_kwargs=True)
    return calls, handle


def layers_of(model):
    return model.get_submodule(model.tsp_policy.layers) if hasattr(model, "tsp_policy") else model.model.layers


def rerun(layer, args, kwargs, grad):
    """``layer`` again on its recorded inputs, its hidden input (the first) made a leaf: ``(output, its grad)``."""
    if args:
        hidden, args = args[0].detach().requires_grad_(), args[1:]
        out = layer(hidden, *args, **kwargs)
    else:
        hidden = kwargs["hidden_states"].detach().requires_grad_()
        out = layer(**{**kwargs, "hidden_states": hidden})
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    return out.detach(), hidden.grad


def layer_pair(kind, model, index, tsp_options, seq_len, vocab):
    """``Pair`` of layer ``index`` of ``model`` and its TSP layer, on one batch's recorded inputs."""
    hf, tsp = build_models(model, seq_len, vocab, tsp_options)
    input_ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(1))
    recorded = []
    for whole in (hf, tsp):
        calls, handle = recorded_inputs(layers_of(whole)[index])
        with torch.no_grad():
            whole(input_ids=input_ids, use_cache=False)
        handle.remove()
        recorded.append(calls[0])
    hidden = recorded[0][0][0] if recorded[0][0] else recorded[0][1]["hidden_states"]
    grad = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2)).to(hidden.dtype)
    hf_layer, tsp_layer = layers_of(hf)[index], layers_of(tsp)[index]
    return Pair(kind, lambda: rerun(hf_layer, *recorded[0], grad), lambda: rerun(tsp_layer, *recorded[1], grad))


def head_pair(seq_len, vocab):
    """``Pair`` of Hugging Face's LM head and loss over the full logits (its ``loss_function``) and the TSP
    model's folded head with its loss, on the final norm's output of one batch."""
    hf, tsp = build_models(HEAD_KIND[1], seq_len, vocab, {})
    input_ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(1))
    calls, handle = recorded_inputs(hf.lm_head)
    with torch.no_grad():
        hf(input_ids=input_ids, use_cache=False)
    handle.remove()
    hidden = calls[0][0][0]
    tsp_calls = []
    original = tsp_model_module.lm_head_and_loss

    def recording(*args, **kwargs):
        tsp_calls.append((args, kwargs))
        return original(*args, **kwargs)

    with torch.no_grad(), mock.patch.object(tsp_model_module, "lm_head_and_loss", recording):
        tsp(input_ids=input_ids, labels=input_ids)
    (head, tsp_hidden, *rest), options = tsp_calls[0]

    def hf_step():
        h = hidden.detach().requires_grad_()
        loss = hf.loss_function(hf.lm_head(h), input_ids, vocab_size=vocab)
        loss.backward()
        return loss.detach().reshape(1), h.grad

    def tsp_step():
        h = tsp_hidden.detach().requires_grad_()
        loss, _ = original(head, h, *rest, **options)
        loss.backward()
        return loss.detach().reshape(1), h.grad

    return Pair(HEAD_KIND[0], hf_step, tsp_step)


def pairs(seq_len, vocab=32000, kinds=KINDS):
    """Every ``Pair`` of ``kinds`` at ``seq_len`` tokens."""
    for kind, model, index, tsp_options in LAYER_KINDS:
        if kind in kinds:
            yield layer_pair(kind, model, index, tsp_options, seq_len, vocab)
    if HEAD_KIND[0] in kinds:
        yield head_pair(seq_len, vocab)


def max_diffs(pair):
    """Max |diff| of the output and the input gradient, TSP against HF, and the larger of their scales."""
    (out, grad), (ref, ref_grad) = pair.tsp(), pair.hf()
    return {"out": (out - ref).abs().max().item(), "grad_x": (grad - ref_grad).abs().max().item(),
            "scale": max(ref.abs().max().item(), ref_grad.abs().max().item())}
