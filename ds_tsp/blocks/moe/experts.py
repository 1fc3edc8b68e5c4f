"""One routed expert as its Hugging Face experts module computes it.

transformers 5 describes every experts module by the flags its
``use_experts_implementation`` decorator sets: ``has_gate`` (a fused
``gate_up_proj``, or an ``up_proj`` alone), ``is_transposed`` (weights
``(E, in, out)`` rather than ``(E, out, in)``), ``has_bias`` (``*_bias``
tensors ``(E, out)``), and its ``_apply_gate`` (``act_fn(gate) * up`` over
the concatenated halves by default; GPT-OSS's own over interleaved columns,
clamped, with its ``alpha``). ``ExpertLayout`` reads those flags and computes
one expert the same way, with the module's own ``_apply_gate`` (or
``act_fn`` without a gate), run on a weightless copy of it::

    proj = x @ up-side weight (+ bias)      # (N, 2F) with a gate, (N, F) without
    act  = _apply_gate(proj) or act_fn(proj)
    out  = act @ down weight (+ bias)       # (N, H)

Backward is written out, the activation's derivative from autograd, and the
weight gradients' partial sums are float32 or wider until their sum over
tokens, ranks and ring steps is rounded (``precision.partial_matmul``).
"""

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ds_tsp.parallel import precision
from ds_tsp.parallel.precision import accumulation_dtype

# transformers' experts flags with the values of the plain layout (Mixtral's).
PLAIN_FLAGS = {"has_gate": True, "is_transposed": False, "has_bias": False, "is_concatenated": True,
               "has_post_expert_norm": False}


def flags_of(experts):
    """``{flag: value}`` of a Hugging Face experts module, the plain layout's
    where it sets none, but ``is_transposed`` read off the shapes of a fused
    ``gate_up_proj`` the module sets no flags for (Llama 4's ``(E, H, 2F)``
    beside ``down_proj`` ``(E, F, H)``: ``x @ W`` where others hold ``W x``)."""
    flags = {flag: getattr(experts, flag, plain) for flag, plain in PLAIN_FLAGS.items()}
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not hasattr(experts, "is_transposed") and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor):
        flags["is_transposed"] = (gate_up.dim() == down.dim() == 3 and gate_up.shape[1] == down.shape[2]
                                  and gate_up.shape[2] == 2 * down.shape[1])
    return flags


def weightless_copy(module):
    """A copy of ``module`` whose parameters and buffers are on the meta device
    (nothing copied): its attributes and methods, for its activation."""
    memo = {id(t): torch.empty_like(t, device="meta") for t in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(module, memo)


@dataclass(frozen=True, eq=False)
class ExpertLayout:
    """How the experts of one Hugging Face block are held and computed.

    ``shapes``: ``{Hugging Face name under the block: shape of ONE expert's
    slice}`` (the tensors are ``(E, *shape)``); ``up``, ``down``: the names of
    the input- and output-side weights; ``activation``: the module whose
    ``_apply_gate`` (with a gate) or ``act_fn`` computes the intermediate."""

    shapes: dict
    up: str
    down: str
    gated: bool
    transposed: bool
    biased: bool
    activation: nn.Module

    @classmethod
    def of(cls, experts, prefix="experts"):
        """The layout of Hugging Face's experts module ``experts`` (may be on the meta device)."""
        flags = flags_of(experts)
        up = f"{prefix}.{'gate_up_proj' if flags['has_gate'] else 'up_proj'}"
        down = f"{prefix}.down_proj"
        names = [up, down] + ([f"{up}_bias", f"{down}_bias"] if flags["has_bias"] else [])
        tensors = dict(experts.named_parameters())
        shapes = {name: tuple(tensors[name.rpartition(".")[2]].shape[1:]) for name in names}
        return cls(shapes, up, down, flags["has_gate"], flags["is_transposed"], flags["has_bias"],
                   weightless_copy(experts))

    @property
    def names(self):
        return tuple(self.shapes)

    @property
    def expert_size(self):
        """``F``: the intermediate size of one expert (the down weight's input side)."""
        shape = self.shapes[self.down]
        return shape[0] if self.transposed else shape[1]

    @property
    def numel(self):
        """Elements of one expert's weights (and biases)."""
        return sum(torch.Size(shape).numel() for shape in self.shapes.values())

    def weights(self, w, local):
        """Views of expert ``local``'s tensors in an unpacked shard ``w``."""
        return {name: w[name][local] for name in self.names}

    def _linear(self, x, weight, bias):
        return (x @ weight if self.transposed else F.linear(x, weight)) if bias is None else \
            (torch.addmm(bias, x, weight) if self.transposed else F.linear(x, weight, bias))

    def _activate(self, proj):
        if not self.gated:
            return self.activation.act_fn(proj)
        if hasattr(self.activation, "_apply_gate"):
            return self.activation._apply_gate(proj)
        gate, up = proj.chunk(2, dim=-1)  # a module without transformers' flags (Llama 4's): act(gate) * up
        return self.activation.act_fn(gate) * up

    def forward(self, x, w, kept=None):
        """One expert on the tokens ``x`` ``(N, H)``: ``(N, H)``. Its gate and
        up projections ``(N, up rows)`` are appended to ``kept`` (a list), if
        given, for backward."""
        proj = self._linear(x, w[self.up], w.get(f"{self.up}_bias"))
        if kept is not None:
            kept.append(proj)
        return self._linear(self._activate(proj), w[self.down], w.get(f"{self.down}_bias"))

    def backward(self, x, grad_out, w, into, proj=None, weights=None):
        """The gradient of ``x`` for the gradient ``grad_out`` ``(N, H)`` of the
        expert's output or, with ``weights`` ``(N, 1)``, of that output times
        them (each row's routing weight); then also the weights' gradient
        ``<grad_out, output>`` ``(N,)`` in float32 or wider (else None), read
        off the down projection's input gradient, so the output is never
        computed again. The expert's weights' (and biases') gradients are added
        to ``into`` (views, float32 or wider). ``proj``: the gate and up
        projections the forward kept, else they are computed again."""
        if proj is None:
            proj = self._linear(x, w[self.up], w.get(f"{self.up}_bias"))
        with torch.enable_grad():
            proj = proj.detach().requires_grad_()
            act = self._activate(proj)
        grad_act = grad_out @ (w[self.down].t() if self.transposed else w[self.down])
        grad_weights = None
        if weights is not None:
            acc = accumulation_dtype(grad_out.dtype)
            grad_weights = (grad_act.to(acc) * act.detach().to(acc)).sum(-1)
            if f"{self.down}_bias" in w:  # output = act W_down + b
                grad_weights += grad_out.to(acc) @ w[f"{self.down}_bias"].to(acc)
            grad_out, grad_act = (grad_out * weights).to(grad_out.dtype), (grad_act * weights).to(grad_act.dtype)
        self._add_weight_grad(into, self.down, act.detach(), grad_out)
        (grad_proj,) = torch.autograd.grad(act, proj, grad_act)
        del grad_act, act
        self._add_weight_grad(into, self.up, x, grad_proj)
        grad_x = grad_proj @ (w[self.up].t() if self.transposed else w[self.up])
        return grad_x, grad_weights

    def _add_weight_grad(self, into, name, inputs, grad):
        """``into[name] += dW`` for ``grad`` of ``inputs @ W``, and its bias's."""
        if self.transposed:
            precision.partial_matmul(inputs.t(), grad, out=into[name])
        else:
            precision.partial_matmul(grad.t(), inputs, out=into[name])
        if self.biased:
            into[f"{name}_bias"].add_(grad.sum(0, dtype=accumulation_dtype(grad.dtype)))
