"""The TSP gated MLP: weights travel round a ring, tokens stay put (DESIGN.md 5).

Rank ``j`` of the TSP group owns rows ``F_j = [j F/D, (j+1) F/D)`` of
``gate_proj`` and ``up_proj`` (and their biases) and the matching columns of
``down_proj``, packed into one flat buffer. The MLP is a sum over ``F`` of
independent slices, so every rank can run its own tokens through every shard
in turn and sum the results locally:

forward, on rank ``r`` with local tokens ``x`` ``(B, S/D, H)``::

    y = 0; buf = own shard
    for t in 0..D-1:                 # buf holds shard (r - t) mod D
        if t < D-1: post send(buf -> r+1), recv(next <- r-1)
        y += act(x Wg^T + bg) * (x Wu^T + bu) @ Wd^T
        wait; buf = next

backward runs the same ring (``ds_tsp.parallel.ring``): the gradient accumulator of
each shard travels with it and ends, summed over every rank's tokens, on its
owner. Per rank and backward: ``D-1`` weight hops and ``D-1`` accumulator
hops (in the gradient wire dtype, ``MLPPlan.grad_wire_dtype``), no
all-reduce, no broadcast.

``down_proj.bias`` is not split (it would be added ``D`` times): it stays a
replicated parameter added once per token outside the ring; its gradient is
local and summed over the group by whoever sums replicated gradients.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ds_tsp.blocks.fused import FusedRows
from ds_tsp.blocks.packing import PackedShardMixin, PackSpec, module_reader
from ds_tsp.blocks.vocab import scaled
from ds_tsp.parallel import comm, precision
from ds_tsp.parallel.amp import autocast_backward, autocast_forward
from ds_tsp.parallel.eager import EagerFunction
from ds_tsp.parallel.precision import accumulation_dtype
from ds_tsp.parallel.ring import RingWireDtypeMixin, ring_gradients, ring_steps

# Which dim of each full Hugging Face tensor is split across the TSP group; a
# name absent from this table (down_proj.bias) is replicated.
SHARD_DIMS = {
    "gate_proj.weight": 0,
    "up_proj.weight": 0,
    "down_proj.weight": 1,
    "gate_proj.bias": 0,
    "up_proj.bias": 0,
}

DOWN_BIAS = "down_proj.bias"


def shard_spec(hidden_size, intermediate_size, tsp_size, bias, gated=True):
    """``PackSpec`` of one rank's shard (without ``gate_proj`` for an ungated
    MLP, ``down(act(up(x)))``); raises if ``F`` does not split evenly."""
    if intermediate_size % tsp_size:
        raise ValueError(
            f"intermediate_size {intermediate_size} is not divisible by tsp.size {tsp_size}: choose tsp.size "
            f"from the divisors of {intermediate_size} that divide the world size, or pad intermediate_size"
        )
    f = intermediate_size // tsp_size
    shapes = {}
    if gated:
        shapes["gate_proj.weight"] = (f, hidden_size)
    if gated and bias:
        shapes["gate_proj.bias"] = (f,)
    shapes["up_proj.weight"] = (f, hidden_size)
    if bias:
        shapes["up_proj.bias"] = (f,)
    shapes["down_proj.weight"] = (hidden_size, f)
    return PackSpec(shapes)


def shard_piece(intermediate_size, tsp_size, name, tsp_rank):
    """``(dim, start, length)`` of the full tensor ``name`` that ``tsp_rank``
    holds, or None if it is not split."""
    if name not in SHARD_DIMS:
        return None
    f = intermediate_size // tsp_size
    return SHARD_DIMS[name], tsp_rank * f, f


def shard_forward(x, w, act_fn, out=None, add=True):
    """One shard's contribution for the local tokens ``(..., H) -> (..., H)``,
    and its gate and up projections ``(..., F/D)`` for backward. With ``out``
    (``(N, H)`` for tokens ``x`` ``(N, H)``) the contribution is added to it in
    place (written, when not ``add``), and ``out`` returned for it."""
    gate = gate_projection(x, w)
    up = F.linear(x, w["up_proj.weight"], w.get("up_proj.bias"))
    h = act_fn(up) if gate is None else act_fn(gate) * up
    if out is None:
        return F.linear(h, w["down_proj.weight"]), gate, up
    return precision.add_matmul(out, h, w["down_proj.weight"].t(), add), gate, up


def gate_projection(x, w):
    """The gate projection of the tokens ``x`` by shard weights ``w``; None in an ungated MLP."""
    return F.linear(x, w["gate_proj.weight"], w.get("gate_proj.bias")) if "gate_proj.weight" in w else None


def shard_backward(x2, grad_y2, w, act_fn, gate, up, into=None, add=True):
    """Gradients of one shard's contribution for the local tokens.

    ``x2``, ``grad_y2``: ``(N, H)`` local tokens; ``gate``, ``up``: ``(N, F/D)``
    saved by the forward (local tokens of one shard, so 1/D of the full MLP's
    intermediate activations over all steps). Returns ``(dx (N, H), {name: dW})``;
    with ``into`` (``{name: accumulator}``, float32 or wider) the weight
    gradients are added into those in place instead (written, when not
    ``add``) and ``into`` is returned.
    The activation's derivative comes from autograd so any ``ACT2FN`` entry
    works. An ungated MLP (``gate`` None) differentiates ``act(up)``.
    """
    if gate is None:
        return _ungated_shard_backward(x2, grad_y2, w, act_fn, up, {} if into is None else into, add)
    with torch.enable_grad():
        gate = gate.detach().requires_grad_()
        act = act_fn(gate)
    into = {} if into is None else into
    # Weight-gradient partials stay float32 until their sum over ranks and tiles is rounded.
    # Each (N, F/D) temporary is dropped as soon as it has been read, so few are alive at once.
    into["down_proj.weight"] = precision.partial_matmul(grad_y2.t(), act.detach() * up, out=into.get("down_proj.weight"),
                                                   add=add)
    grad_h = grad_y2 @ w["down_proj.weight"]  # (N, F/D)
    grad_up = grad_h * act.detach()
    (grad_gate,) = torch.autograd.grad(act, gate, grad_h * up)
    del grad_h, act
    for name, grad in (("gate_proj.weight", grad_gate), ("up_proj.weight", grad_up)):
        into[name] = precision.partial_matmul(grad.t(), x2, out=into.get(name), add=add)
    if "gate_proj.bias" in w:
        acc = accumulation_dtype(grad_gate.dtype)
        for name, grad in (("gate_proj.bias", grad_gate), ("up_proj.bias", grad_up)):
            if name not in into:
                into[name] = grad.sum(0, dtype=acc)
            else:
                into[name].add_(grad.sum(0, dtype=acc)) if add else torch.sum(grad, 0, dtype=acc, out=into[name])
    grad_x = (grad_gate @ w["gate_proj.weight"]).addmm_(grad_up, w["up_proj.weight"])
    return grad_x, into


def _ungated_shard_backward(x2, grad_y2, w, act_fn, up, into, add):
    """``shard_backward`` of an ungated MLP's shard, ``down(act(up(x)))``."""
    with torch.enable_grad():
        up = up.detach().requires_grad_()
        act = act_fn(up)
    into["down_proj.weight"] = precision.partial_matmul(grad_y2.t(), act.detach(), out=into.get("down_proj.weight"),
                                                        add=add)
    (grad_up,) = torch.autograd.grad(act, up, grad_y2 @ w["down_proj.weight"])
    del act
    into["up_proj.weight"] = precision.partial_matmul(grad_up.t(), x2, out=into.get("up_proj.weight"), add=add)
    if "up_proj.bias" in w:
        acc = accumulation_dtype(grad_up.dtype)
        if "up_proj.bias" not in into:
            into["up_proj.bias"] = grad_up.sum(0, dtype=acc)
        else:
            into["up_proj.bias"].add_(grad_up.sum(0, dtype=acc)) if add else torch.sum(grad_up, 0, dtype=acc,
                                                                                       out=into["up_proj.bias"])
    return grad_up @ w["up_proj.weight"], into


# The names transformers gives an MLP's activation module (Llama's, GLM's and Llama 4's).
ACTIVATION_NAMES = ("act_fn", "activation_fn", "activation")


class ScaledInputActivation(nn.Module):
    """``act(x * multiplier)``: an MLP's activation of its gate times a multiplier (Falcon-H1's
    ``gate_multiplier``), as Hugging Face's MLP computes it; its derivative comes from autograd."""

    def __init__(self, act, multiplier):
        super().__init__()
        self.act, self.multiplier = act, multiplier

    def forward(self, x):
        return self.act(x * self.multiplier)


def mlp_activation(mlp):
    """A Hugging Face MLP's activation module, under either of ``ACTIVATION_NAMES``, or None."""
    return next((getattr(mlp, name) for name in ACTIVATION_NAMES if hasattr(mlp, name)), None)


def input_projections(mlp, fused=None):
    """The logical projections of the Hugging Face MLP ``mlp`` before its
    activation: ``gate_proj`` and ``up_proj``, or ``up_proj`` alone in an
    ungated MLP (no gate, none fused)."""
    return ("gate_proj", "up_proj") if fused or hasattr(mlp, "gate_proj") else ("up_proj",)


def hf_rows(mlp, fused=None):
    """Where gate/up lie in the Hugging Face gated MLP ``mlp`` under the policy's
    ``fused`` table for it (``ds_tsp.blocks.fused``: gate rows, then up), and
    ``down_proj`` where the table names it otherwise (Granite-4.0-H's ``output_linear``)."""
    down = down_projection(mlp, fused)
    rows = FusedRows.of(fused or {}, {**dict.fromkeys(input_projections(mlp, fused), down.in_features),
                                      "down_proj": down.out_features})
    rows.check_rows(mlp, type(mlp).__name__)
    return rows


def down_projection(mlp, fused=None):
    """The Hugging Face MLP's ``down_proj`` Linear, under the name the policy's ``fused`` table gives it."""
    name = next((holder for holder, parts in (fused or {}).items() if parts == ("down_proj",)), "down_proj")
    return mlp.get_submodule(name)


# Without a backward to come (a generation's prefill) tiles cost no
# recompute, so the ring steps take the local tokens this many at a time: the
# (tile, F/D) intermediates stay small, the matmuls large enough to run at speed.
PREFILL_TOKEN_TILE = 1024


@dataclass(frozen=True)
class MLPPlan:
    """Everything the ring needs besides tensors."""

    spec: PackSpec
    act_fn: object
    group: object
    overlap: bool = True
    token_tile: int = 0  # most local tokens one shard step computes at once (0: all)
    fp32_accumulators: bool = True  # sum the ring steps and the input gradients in float32 (or wider)
    grad_wire_dtype: object = None  # the gradient accumulators' wire dtype (gradient_wire_dtype; None: float32)

    def tiles(self, num_tokens, at_most=None):
        """``[(start, end)]`` over the ``num_tokens`` local tokens, of at most
        ``token_tile`` (and ``at_most``) tokens; at least one (empty with no
        tokens), so the first tile's writes always happen."""
        size = min(self.token_tile or num_tokens, at_most or num_tokens)
        return [(start, min(start + size, num_tokens)) for start in range(0, max(num_tokens, 1), max(size, 1))]

    def accumulator_dtype(self, dtype):
        return accumulation_dtype(dtype) if self.fp32_accumulators else dtype


def mlp_ring_forward(x, packed, plan, for_backward=True):
    """Sum of every shard's MLP over the local tokens ``x`` ``(B, S/D, H)``, in
    tiles of at most ``plan.token_tile`` tokens per shard step.

    Also returns, when the local tokens fit in one tile and ``for_backward``,
    the gate and up projections of every step, lists of ``(N, F/D)`` in ring
    order, for backward (kept as they are: stacking would copy them); with
    several tiles nothing beyond ``x``, and backward recomputes them tile by
    tile, so no ``(N, F/D)`` buffer ever exists. Without a backward to come (a
    generation's prefill) each step's are freed as the next one starts.
    """
    x2 = x.reshape(-1, x.shape[-1])  # (N, H)
    tiles = plan.tiles(x2.shape[0], PREFILL_TOKEN_TILE if not for_backward else None)
    keep = len(tiles) == 1 and for_backward
    y = torch.empty(x2.shape, dtype=plan.accumulator_dtype(x.dtype), device=x.device)
    gates, ups = [], []

    def step(t, buf):
        w = plan.spec.unpack(buf)
        for start, end in tiles:
            _, gate, up = shard_forward(x2[start:end], w, plan.act_fn, out=y[start:end], add=t > 0)
            if keep:
                gates.append(gate), ups.append(up)

    ring_steps(packed, plan.group, step, plan.overlap)
    return y.view(x.shape).to(x.dtype), gates, ups


def mlp_ring_backward(grad_y, x, packed, gates, ups, plan):
    """``(grad_x, grad_packed)``: ``grad_packed`` is this rank's own shard's
    gradient summed over every rank's tokens, flat like ``packed``. ``gates``,
    ``ups``: what the forward kept, or empty to recompute them per tile."""
    x2, grad_y2 = x.reshape(-1, x.shape[-1]), grad_y.reshape(-1, grad_y.shape[-1])  # (N, H)
    tiles = plan.tiles(x2.shape[0])
    acc_dtype = accumulation_dtype(packed.dtype)
    grad_x = torch.empty(x2.shape, dtype=plan.accumulator_dtype(x.dtype), device=x.device)

    def step(t, buf):
        w = plan.spec.unpack(buf)
        grad_shard = torch.empty(packed.shape, dtype=acc_dtype, device=packed.device)
        into = plan.spec.unpack(grad_shard)  # the first tile writes the weight gradients, the others add
        for start, end in tiles:
            x_tile = x2[start:end]
            if ups:
                gate, up = gates[t], ups[t]
            else:
                gate = gate_projection(x_tile, w)
                up = F.linear(x_tile, w["up_proj.weight"], w.get("up_proj.bias"))
            tile_grad_x, _ = shard_backward(x_tile, grad_y2[start:end], w, plan.act_fn, gate, up, into,
                                            add=start > 0)
            grad_x[start:end].add_(tile_grad_x) if t else grad_x[start:end].copy_(tile_grad_x)
        return grad_shard

    wire = precision.gradient_wire_dtype(plan.grad_wire_dtype, packed.dtype)
    grad_packed = ring_gradients(packed, plan.group, step, plan.overlap, wire)
    return grad_x.view(x.shape).to(x.dtype), grad_packed.to(packed.dtype)


class _MLPRing(EagerFunction):
    # Under autocast x and the shard are cast to the autocast dtype, as HF's
    # linear layers cast theirs: the ring then moves half the bytes.
    @staticmethod
    @autocast_forward(cast_inputs=True)
    def forward(ctx, x, packed, plan, for_backward):
        y, gates, ups = mlp_ring_forward(x, packed, plan, for_backward)
        # Local tokens only (x and, in one tile, each step's gate/up), plus
        # this rank's own shard: saved bytes scale as 1/D.
        ctx.save_for_backward(x, packed, *gates, *ups)
        ctx.plan = plan
        return y

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_y):
        x, packed, *steps = ctx.saved_tensors
        gates, ups = steps[:len(steps) // 2], steps[len(steps) // 2:]
        grad_x, grad_packed = mlp_ring_backward(grad_y, x, packed, gates, ups, ctx.plan)
        return grad_x, grad_packed, None, None


class TSPGatedMLP(RingWireDtypeMixin, PackedShardMixin, nn.Module):
    """``down(act(gate(x)) * up(x))`` over the local tokens, weights sharded on
    ``F`` across ``tsp_group`` and moved by a ring (see the module docstring);
    without ``gated``, ``down(act(up(x)))`` (Nemotron's, Arcee's, Jais-2's MLPs).

    Parameters: ``packed``, this rank's shard of gate/up/down (and gate/up
    biases) laid out by ``self.spec``, tagged ``tensor_model_parallel``; and,
    with ``bias``, the replicated ``down_bias``.
    """

    def __init__(self, hidden_size, intermediate_size, act_fn, tsp_group, bias=False, overlap=True, token_tile=0,
                 fp32_accumulators=True, dtype=None, device=None, gated=True, output_multiplier=1.0):
        super().__init__()
        # The output times this (Falcon-H1's down_multiplier, after down_proj and its bias).
        self.output_multiplier = output_multiplier
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.tsp_group = tsp_group
        self.tsp_size, self.tsp_rank = comm.group_size(tsp_group), comm.group_rank(tsp_group)
        self.spec = shard_spec(hidden_size, intermediate_size, self.tsp_size, bias, gated)
        self.act_fn = act_fn
        self.overlap = overlap
        self.plan = MLPPlan(self.spec, act_fn, tsp_group, overlap, token_tile, fp32_accumulators)
        factory = {"dtype": dtype, "device": device}
        self.packed = nn.Parameter(torch.empty(self.spec.numel, **factory))
        # DeepSpeed counts a parameter on every model-parallel rank in grad norms only with this tag.
        self.packed.tensor_model_parallel = True
        self.lora = None  # LoRA adapters of this rank's shard (ds_tsp.injection.lora)
        self.down_bias = nn.Parameter(torch.empty(hidden_size, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        """nn.Linear's bounds for the full layers (fan-in ``H`` for gate/up, ``F``
        for down); biases zero, so the replicated down bias starts equal on every rank."""
        with torch.no_grad():
            for name, view in self.spec.unpack(self.packed).items():
                if name.endswith("bias"):
                    view.zero_()
                else:
                    fan_in = self.intermediate_size if name == "down_proj.weight" else self.hidden_size
                    bound = 1 / math.sqrt(fan_in)
                    view.uniform_(-bound, bound)
            if self.down_bias is not None:
                self.down_bias.zero_()

    def replicated_params(self):
        """The parameters every rank holds whole, under Hugging Face names."""
        return {DOWN_BIAS: self.down_bias} if self.down_bias is not None else {}

    def shard_piece(self, name):
        """``(dim, start, length)`` of the full tensor ``name`` this rank holds, or None if whole."""
        return shard_piece(self.intermediate_size, self.tsp_size, name, self.tsp_rank)

    @classmethod
    def from_hf(cls, mlp, tsp_group, overlap=True, token_tile=0, fp32_accumulators=True, read=None, device=None,
                fused=None, activation="act_fn"):
        """Build from a HF gated MLP (``gate_proj``, ``up_proj``, ``down_proj``
        and the activation module named ``activation``; None: silu, LFM's function), keeping this rank's slice of it.

        ``read(name, piece)`` returns the tensor ``name`` cut to ``piece`` (see
        ``shard_piece``); by default it slices ``mlp``'s own parameters, and a
        checkpoint reader can pass its own (``mlp`` may then be on the meta device).
        ``fused``: the policy's fused projections of this module
        (``DecoderPolicy.fused``, Phi-3's ``gate_up_proj``), whose rows ``read``
        is then asked for under Hugging Face's names (``ds_tsp.blocks.fused``).
        """
        rows, names = hf_rows(mlp, fused), (*input_projections(mlp, fused), "down_proj")
        projections = [rows.hf_module(mlp, name) for name in names]
        biases = [proj.bias is not None for proj in projections]
        if len(set(biases)) != 1:
            raise ValueError(f"TSPGatedMLP needs biases on all of {list(names)} or none, got {biases}")
        down = projections[-1]
        act_fn = nn.SiLU() if activation is None else getattr(mlp, activation)
        if getattr(mlp, "gate_multiplier", 1.0) != 1.0:  # Falcon-H1's: act(gate(x) * gate_multiplier)
            act_fn = ScaledInputActivation(act_fn, mlp.gate_multiplier)
        module = cls(down.out_features, down.in_features, act_fn, tsp_group, bias=biases[0],
                     overlap=overlap, token_tile=token_tile, fp32_accumulators=fp32_accumulators,
                     dtype=down.weight.dtype, device=device or down.weight.device, gated="gate_proj" in names,
                     output_multiplier=getattr(mlp, "down_multiplier", 1.0))
        module.hf_rows = rows
        read = rows.reader(read or module_reader(mlp))
        module.load_shard({name: read(name, module.shard_piece(name)) for name in module.shard_names()})
        return module

    @torch.no_grad()
    def decode_share(self, x):
        """For tokens ``x`` ``(N, H)`` that every rank holds (decoding), this
        rank's share of the output from its own shard alone, no weight moving:
        the shares sum over the group to the MLP's output (``down_proj``'s bias
        included once, by rank 0), each times ``output_multiplier``."""
        y, _, _ = shard_forward(x, self.spec.unpack(self.shard_weights().detach()), self.act_fn)
        if self.down_bias is not None and self.tsp_rank == 0:
            y = y + self.down_bias
        return scaled(y, self.output_multiplier)

    def forward(self, x):
        """``x``: this rank's tokens ``(B, S/D, H)``; returns ``(B, S/D, H)``."""
        packed = self.shard_weights()
        for_backward = torch.is_grad_enabled() and (x.requires_grad or packed.requires_grad)
        y = _MLPRing.apply(x, packed, self.plan, for_backward)
        if self.down_bias is not None:
            y = y + self.down_bias
        return scaled(y, self.output_multiplier)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"tsp_size={self.tsp_size}, bias={self.down_bias is not None}, overlap={self.overlap}")
