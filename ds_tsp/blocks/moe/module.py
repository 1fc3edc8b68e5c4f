"""The TSP sparse mixture-of-experts block: expert shards travel round a ring
while tokens stay put (DESIGN.md 6c, the MLP's schedule of DESIGN.md 5), or
experts stay at rest while tokens go to them by all-to-all; ``tsp.moe_schedule``
picks, "auto" by the cost model per layer and micro-batch shape.

Rank ``j`` of the TSP group owns experts ``[j E/D, (j+1) E/D)``: their slices
of Hugging Face's fused ``experts.gate_up_proj`` ``(E, 2F, H)`` and
``experts.down_proj`` ``(E, H, F)`` (dim 0), and, for Qwen2-MoE, rows
``[j Fs/D, (j+1) Fs/D)`` of the dense shared expert (``mlp.SHARD_DIMS``),
packed into one flat buffer, the same under both schedules (a checkpoint does
not know which trained it). The router (``gate``) and Qwen2-MoE's
``shared_expert_gate`` are Hugging Face's own modules, replicated, run on the
local tokens: routing (softmax dtype, top-k, ``norm_topk_prob``, the weights'
dtype) is HF's by construction. The block's output is a sum of independent
pieces (each routed expert's weighted output, each slice of the shared expert
times its sigmoid gate), so every rank runs its own tokens through every shard
in turn and sums locally:

ring, forward, on rank ``r`` with local tokens ``x`` ``(N = B*S/D, H)``::

    weights, index = router(x)         # (N, k): HF's TopKRouter on local tokens
    y = 0; buf = own shard
    for t in 0..D-1:                   # buf holds experts and shared slice of rank (r - t) mod D
        if t < D-1: post send(buf -> r+1), recv(next <- r-1)
        for each expert e in buf, T = local tokens routed to e (slot s):
            y[T] += weights[T, s] * down_e(act(gate_e x[T]) * up_e x[T])
        y += sigmoid(shared_gate(x)) * shared slice(x)     # Qwen2-MoE
        wait; buf = next

all-to-all, forward (``moe_all_to_all_forward``)::

    weights, index = router(x)
    rows = x[token of each (token, slot)], sorted by expert, so by owner   # (N k, H)
    exchange the split sizes: rows for each of the owner's E/D experts     # all_to_all of (D, E/D) int64
    received = all_to_all(rows)        # every rank's rows for this rank's experts, by source then expert
    outputs[rows of e] = down_e(act(gate_e received) * up_e received)  for each own expert e
    returned = all_to_all back(outputs)                # the outputs of this rank's rows, in their order
    for e in 0..E-1: y[T_e] += weights[T_e, s] * returned[rows of e]  # HF's order: expert by expert
    y += sigmoid(shared_gate(x)) * shared expert(x)    # Qwen2-MoE: its slices on the MLP's ring

Backward is its transpose: the output rows' gradients (times the routing
weights) go to the experts' owners by the same routes, the input rows'
gradients come back by the reverse ones, the routing weights' gradients are
local (the returned outputs are kept), and each expert's weight gradient is
summed on its owner from every rank's rows, with no accumulator ring. Decoding
(``decode_share``) uses neither schedule: every rank holds the step's tokens,
runs its own experts on those routed to them and the shares are summed.

Both are dropless: every token meets exactly its top-k experts, with no
capacity. On the ring an expert no local token chose costs nothing but its
hop, and backward runs the same ring (``ds_tsp.parallel.ring.ring_gradients``): each
shard's gradient accumulator travels with it and ends, summed over every
rank's tokens, on its owner. Under both the gate and up projections are
recomputed per expert in backward (nothing ``(N, k, F)`` is kept), as the MLP
does with token tiles.

Bytes per rank and layer, with ``W = E/D * 3HF (+ 3H Fs/D)`` elements in a
rank's packed shard (``w`` bytes each; accumulators summed in float32 or
wider, ``a`` bytes each in the gradient wire dtype, ``comm.gradient_wire_dtype``):

* ring: forward ``(D-1) W w`` received (``(D-1)/D`` of the layer's expert
  weights), backward ``(D-1) W (w + a)`` (weights again, plus the
  accumulators), independent of the sequence; no all-to-all, no all-reduce.
* token all-to-all: the ``E/D`` split sizes of each other rank, then the rows
  routed to this rank's experts and the outputs of its own rows computed
  elsewhere, ``2 k N (D-1)/D`` rows of ``H`` with routing spread evenly;
  backward the same rows again (their gradients), and Qwen2-MoE's shared
  expert on the ring as above (``W`` its slice alone). It grows with the
  sequence and the ring's does not, so the all-to-all moves fewer below
  ``B*S = 1.5 E F D / k`` tokens (forward; forward and backward in bf16 with
  float32 accumulators: ``0.75 E F D (2w + a) / (k w)``) and the ring past
  it. ``ds_tsp.planning.moe_block_bytes_by_op`` holds both formulas;
  ``tsp.moe_schedule: "auto"`` hands the block a chooser
  (``ds_tsp.planning.cheaper_moe_schedule``, see ``TSPSparseMoE.schedule_for``)
  that takes the cheaper for each layer's ``N``
  (Qwen3-30B-A3B at D=8 crosses at 147,456 and 294,912 tokens per
  micro-batch; at 32K tokens the all-to-all moves about 9x fewer bytes).
  Memory: the all-to-all keeps the received rows and the returned outputs
  for backward, about ``2 k N H`` elements, where the ring keeps nothing of
  the experts beyond the local tokens.

The auxiliary load-balancing loss (``load_balancing_loss``) adds one
all-reduce of ``2E+1`` float64 values per forward.

``router_logits``: with ``output_router_logits`` passed to the forward, per
MoE layer the whole sequence's ``(B*S, E)`` as Hugging Face returns them
(``full_sequence_router_logits``: one all-gather for all layers); when only the
config turns them on (the load-balancing loss in training), the local tokens'
``(B*S/D, E)`` in this rank's token order (zigzag shard), which is all the
loss needs, so training gathers nothing.
"""

import contextlib
import copy
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ds_tsp.parallel import comm, layout
from ds_tsp.parallel.amp import _compute_dtype, autocast_backward, autocast_forward
from ds_tsp.parallel.comm import accumulation_dtype
from ds_tsp.parallel.mappings import sum_over_group
from ds_tsp.blocks.mlp import MLPPlan, mlp_ring_backward, mlp_ring_forward
from ds_tsp.blocks.mlp import shard_backward as gated_shard_backward
from ds_tsp.blocks.mlp import shard_forward as gated_shard_forward
from ds_tsp.blocks.mlp import shard_spec as mlp_shard_spec
from ds_tsp.blocks.packing import PackedShardMixin, PackSpec, module_reader
from ds_tsp.parallel.ring import RingWireDtypeMixin, ring_gradients, ring_steps

logger = logging.getLogger("ds_tsp")
MOE_SCHEDULES = ("ring", "all_to_all")  # the two ways to meet the experts (the module docstring)

# What tsp.moe_schedule "auto" has said in the log: each choice once per shape, not once per layer.
_announced = set()

GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"
# The shared expert's tensors, with the dim each is split on (mlp.SHARD_DIMS, no biases).
SHARED = {"shared_expert.gate_proj.weight": 0, "shared_expert.up_proj.weight": 0, "shared_expert.down_proj.weight": 1}
# Which dim of each full Hugging Face tensor is split across the TSP group; the
# router and the shared expert's gate are replicated.
SHARD_DIMS = {GATE_UP: 0, DOWN: 0, **SHARED}
ROUTER, SHARED_GATE = "gate.weight", "shared_expert_gate.weight"


def shard_spec(hidden_size, num_experts, expert_size, tsp_size, shared_size=0):
    """``PackSpec`` of one rank's shard; raises if ``E`` (or the shared expert's
    intermediate size) does not split evenly."""
    if num_experts % tsp_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(f"num_experts {num_experts} is not divisible by tsp.size {tsp_size}: every TSP rank holds "
                         f"E/D whole experts; choose tsp.size from {divisors} (that also divides the world size)")
    if shared_size % tsp_size:
        raise ValueError(f"shared_expert_intermediate_size {shared_size} is not divisible by tsp.size {tsp_size}: "
                         f"choose tsp.size from the common divisors of {num_experts} and {shared_size}")
    e, f = num_experts // tsp_size, shared_size // tsp_size
    shapes = {GATE_UP: (e, 2 * expert_size, hidden_size), DOWN: (e, hidden_size, expert_size)}
    if shared_size:
        shapes.update({"shared_expert.gate_proj.weight": (f, hidden_size),
                       "shared_expert.up_proj.weight": (f, hidden_size),
                       "shared_expert.down_proj.weight": (hidden_size, f)})
    return PackSpec(shapes)


def shard_piece(num_experts, shared_size, tsp_size, name, tsp_rank):
    """``(dim, start, length)`` of the full tensor ``name`` that ``tsp_rank``
    holds, or None if it is not split."""
    if name not in SHARD_DIMS:
        return None
    length = (num_experts if name in (GATE_UP, DOWN) else shared_size) // tsp_size
    return SHARD_DIMS[name], tsp_rank * length, length


def replicated_names(hf_moe):
    """Hugging Face names of the tensors of a sparse MoE block every rank keeps whole."""
    return [ROUTER] + ([SHARED_GATE] if getattr(hf_moe, "shared_expert_gate", None) is not None else [])


def hf_sizes(hf_moe):
    """``(hidden_size, num_experts, expert_size, shared_size)`` of a Hugging Face sparse MoE block."""
    experts = hf_moe.experts
    num_experts, two_f, hidden_size = experts.gate_up_proj.shape
    shared = getattr(hf_moe, "shared_expert", None)
    return hidden_size, num_experts, two_f // 2, 0 if shared is None else shared.gate_proj.out_features


def _expert(w, local, expert_size):
    """One expert's weights from an unpacked shard, under the gated MLP's names (views)."""
    gate_up = w[GATE_UP][local]
    return {"gate_proj.weight": gate_up[:expert_size], "up_proj.weight": gate_up[expert_size:],
            "down_proj.weight": w[DOWN][local]}


def _shared(w):
    return {name.removeprefix("shared_expert."): w[name] for name in SHARED}


@dataclass(frozen=True)
class Routing:
    """The local tokens grouped by expert: ``tokens[offsets[e]:offsets[e+1]]``
    chose expert ``e`` in top-k slot ``slots[...]``."""

    tokens: torch.Tensor
    slots: torch.Tensor
    offsets: tuple

    @classmethod
    def of(cls, index, num_experts):
        """From the router's ``(N, k)`` expert indices."""
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        top_k = index.shape[-1]
        return cls(order // top_k, order % top_k, (0, *counts.cumsum(0).tolist()))

    def of_expert(self, expert, tile):
        """``[(tokens, slots)]`` of ``expert``, in pieces of at most ``tile`` tokens (0: one piece)."""
        start, end = self.offsets[expert], self.offsets[expert + 1]
        size = tile or max(end - start, 1)
        return [(self.tokens[s:min(s + size, end)], self.slots[s:min(s + size, end)]) for s in range(start, end, size)]


@dataclass(frozen=True)
class MoEPlan:
    """Everything either schedule needs besides tensors."""

    spec: PackSpec
    act_fn: object
    group: object
    num_experts: int
    expert_size: int
    shared: bool = False
    overlap: bool = True
    token_tile: int = 0  # most tokens one expert (or the shared slice) computes at once (0: all)
    fp32_accumulators: bool = True
    grad_wire_dtype: object = None  # the gradient accumulators' wire dtype (comm.gradient_wire_dtype; None: float32)
    schedule: object = "ring"  # one of MOE_SCHEDULES, or a chooser per shape (TSPSparseMoE.schedule_for)

    @property
    def routed_spec(self):
        """``PackSpec`` of the routed experts alone, the head of ``spec``: what
        the all-to-all schedule keeps at rest."""
        return PackSpec({name: self.spec.shapes[name] for name in (GATE_UP, DOWN)})

    @property
    def shared_plan(self):
        """The shared expert's slice (the tail of ``spec``) as a dense MLP shard
        on the MLP's ring, for the all-to-all schedule."""
        tsp_size = comm.group_size(self.group)
        spec = mlp_shard_spec(self.spec.shapes[DOWN][1], self.spec.shapes["shared_expert.down_proj.weight"][1] *
                              tsp_size, tsp_size, bias=False)
        return MLPPlan(spec, self.act_fn, self.group, self.overlap, self.token_tile, self.fp32_accumulators,
                       self.grad_wire_dtype)

    @property
    def experts_per_rank(self):
        return self.num_experts // comm.group_size(self.group)

    def held_experts(self, t):
        """``[(local index, global expert)]`` of the shard held at ring step ``t``."""
        tsp_size = comm.group_size(self.group)
        owner = (comm.group_rank(self.group) - t) % tsp_size
        per_rank = self.num_experts // tsp_size
        return [(local, owner * per_rank + local) for local in range(per_rank)]

    def tiles(self, num_tokens):
        size = self.token_tile or num_tokens
        return [(start, min(start + size, num_tokens)) for start in range(0, num_tokens, max(size, 1))]

    def accumulator_dtype(self, dtype):
        return accumulation_dtype(dtype) if self.fp32_accumulators else dtype


def moe_ring_forward(x, weights, routing, shared_scale, packed, plan):
    """``(N, H)``: every local token's weighted outputs of its top-k experts (and
    the shared expert times ``shared_scale`` ``(N, 1)``), the shards taken
    round the ring (``ds_tsp.parallel.ring.ring_steps``)."""
    y = torch.zeros(x.shape, dtype=plan.accumulator_dtype(x.dtype), device=x.device)

    def step(t, buf):
        w = plan.spec.unpack(buf)
        for local, expert in plan.held_experts(t):
            weights_e = _expert(w, local, plan.expert_size)
            for tokens, slots in routing.of_expert(expert, plan.token_tile):
                out, _, _ = gated_shard_forward(x[tokens], weights_e, plan.act_fn)
                # HF: expert output times its routing weight (type promotion), then summed per token.
                y.index_add_(0, tokens, (out * weights[tokens, slots, None]).to(y.dtype))
        if plan.shared:
            for start, end in plan.tiles(x.shape[0]):
                out, _, _ = gated_shard_forward(x[start:end], _shared(w), plan.act_fn)
                y[start:end] += (shared_scale[start:end] * out).to(y.dtype)

    ring_steps(packed, plan.group, step, plan.overlap)
    return y.to(x.dtype)


def moe_ring_backward(grad_y, x, weights, routing, shared_scale, packed, plan):
    """``(grad_x, grad_weights, grad_shared_scale, grad_packed)``; ``grad_packed``
    is this rank's own shard's gradient summed over every rank's tokens."""
    acc_dtype = accumulation_dtype(packed.dtype)
    grad_x = torch.zeros(x.shape, dtype=plan.accumulator_dtype(x.dtype), device=x.device)
    grad_weights = torch.zeros(weights.shape, dtype=accumulation_dtype(weights.dtype), device=x.device)
    grad_scale = None if shared_scale is None else torch.zeros(
        shared_scale.shape, dtype=accumulation_dtype(shared_scale.dtype), device=x.device)

    def piece_backward(x_piece, grad_piece, scale, w, grads):
        """One expert (or shared slice) on some tokens: adds to ``grads``, returns
        ``(grad_x, <grad_y, output>)`` for the tokens."""
        gate = F.linear(x_piece, w["gate_proj.weight"])
        up = F.linear(x_piece, w["up_proj.weight"])
        out = F.linear(plan.act_fn(gate) * up, w["down_proj.weight"])
        grad_scale_piece = (grad_piece.to(acc_dtype) * out.to(acc_dtype)).sum(-1)
        grad_out = (grad_piece * scale).to(x.dtype)
        piece_grad_x, piece_grads = gated_shard_backward(x_piece, grad_out, w, plan.act_fn, gate, up)
        for name, grad in piece_grads.items():
            grads[name] += grad
        return piece_grad_x, grad_scale_piece

    def step(t, buf):
        w = plan.spec.unpack(buf)
        grad_shard = torch.zeros(packed.shape, dtype=acc_dtype, device=packed.device)
        grad_w = plan.spec.unpack(grad_shard)
        for local, expert in plan.held_experts(t):
            weights_e, grads_e = _expert(w, local, plan.expert_size), _expert(grad_w, local, plan.expert_size)
            for tokens, slots in routing.of_expert(expert, plan.token_tile):
                piece_grad_x, grad_weight = piece_backward(x[tokens], grad_y[tokens], weights[tokens, slots, None],
                                                           weights_e, grads_e)
                grad_x.index_add_(0, tokens, piece_grad_x.to(grad_x.dtype))
                grad_weights[tokens, slots] = grad_weight.to(grad_weights.dtype)
        if plan.shared:
            for start, end in plan.tiles(x.shape[0]):
                piece_grad_x, grad_s = piece_backward(x[start:end], grad_y[start:end], shared_scale[start:end],
                                                      _shared(w), _shared(grad_w))
                grad_x[start:end] += piece_grad_x
                grad_scale[start:end] += grad_s.unsqueeze(-1).to(grad_scale.dtype)
        return grad_shard

    wire = comm.gradient_wire_dtype(plan.grad_wire_dtype, packed.dtype)
    grad_packed = ring_gradients(packed, plan.group, step, plan.overlap, wire)
    return (grad_x.to(x.dtype), grad_weights.to(weights.dtype),
            None if grad_scale is None else grad_scale.to(shared_scale.dtype), grad_packed.to(packed.dtype))


class _MoERing(torch.autograd.Function):
    # Under autocast the tokens, the shard and the routing weights are cast to
    # the autocast dtype (HF keeps the routing weights float32 there).
    @staticmethod
    @autocast_forward(cast_inputs=True)
    def forward(ctx, x, weights, index, shared_scale, packed, plan):
        routing = Routing.of(index, plan.num_experts)
        y = moe_ring_forward(x, weights, routing, shared_scale, packed, plan)
        # Local tokens and this rank's own shard only: saved bytes scale as 1/D.
        ctx.save_for_backward(x, weights, shared_scale, packed, routing.tokens, routing.slots)
        ctx.plan, ctx.offsets = plan, routing.offsets
        return y

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_y):
        x, weights, shared_scale, packed, tokens, slots = ctx.saved_tensors
        routing = Routing(tokens, slots, ctx.offsets)
        grad_x, grad_weights, grad_scale, grad_packed = moe_ring_backward(grad_y, x, weights, routing, shared_scale,
                                                                          packed, ctx.plan)
        return grad_x, grad_weights, None, grad_scale, grad_packed, None


@dataclass(frozen=True)
class TokenExchange:
    """Where the routed rows ``(token, expert)`` go under the all-to-all
    schedule. In routing order (by expert, so by owner) this rank sends
    ``send_counts[j]`` rows to rank ``j`` and receives ``recv_counts[j]`` from
    it, each source's rows ordered by expert; ``by_local_expert`` groups the
    received rows by this rank's local expert (a ``Routing`` over them, slots
    unused)."""

    send_counts: tuple
    recv_counts: tuple
    by_local_expert: Routing

    @classmethod
    def of(cls, routing, plan):
        """Exchanges the split sizes: every rank's row count for each of this
        rank's experts (one all-to-all of ``E/D`` int64 per rank pair, on the
        tokens' device)."""
        tsp_size, per_rank, device = comm.group_size(plan.group), plan.experts_per_rank, routing.tokens.device
        offsets = torch.tensor(routing.offsets, device=device)
        counts = (offsets[1:] - offsets[:-1]).view(tsp_size, per_rank)  # (D, E/D): rows for rank j's experts
        incoming, _ = comm.all_to_all(counts, plan.group)  # (D, E/D): rows rank j sends to each local expert
        local_expert = torch.arange(per_rank, device=device).repeat(tsp_size).repeat_interleave(incoming.reshape(-1))
        return cls(tuple(counts.sum(1).tolist()), tuple(incoming.sum(1).tolist()),
                   Routing.of(local_expert.unsqueeze(-1), per_rank))


def moe_all_to_all_forward(x, weights, routing, exchange, routed_shard, plan):
    """``(y, received, returned)``: ``y`` ``(N, H)`` every local token's weighted
    outputs of its top-k experts, in the accumulator dtype, the rows sent to
    the experts' owners and the outputs sent back (``routed_shard``: this
    rank's routed experts, at rest); ``received`` ``(R, H)`` the rows this
    rank's experts computed on, ``returned`` ``(N k, H)`` the outputs of this
    rank's rows in routing order, both kept for backward."""
    received = comm.all_to_all_rows(x[routing.tokens], exchange.send_counts, exchange.recv_counts, plan.group)
    outputs = torch.empty_like(received)
    w = plan.routed_spec.unpack(routed_shard)
    for local in range(plan.experts_per_rank):
        for rows, _ in exchange.by_local_expert.of_expert(local, plan.token_tile):
            outputs[rows], _, _ = gated_shard_forward(received[rows], _expert(w, local, plan.expert_size), plan.act_fn)
    returned = comm.all_to_all_rows(outputs, exchange.recv_counts, exchange.send_counts, plan.group)
    # Each output times its routing weight, added to its token: the rows are in expert order, so each token's
    # sum runs expert by expert, as HF's loop adds them; one index_add_ for all experts.
    y = torch.zeros(x.shape, dtype=plan.accumulator_dtype(x.dtype), device=x.device)
    y.index_add_(0, routing.tokens, (returned * weights[routing.tokens, routing.slots, None]).to(y.dtype))
    return y, received, returned


def moe_all_to_all_backward(grad_y, weights, routing, exchange, received, returned, routed_shard, plan):
    """``(grad_x, grad_weights, grad_routed_shard)``: the transpose of the
    forward, ``grad_x`` in the accumulator dtype. The output gradients go to
    the experts' owners by the forward's routes, the input gradients come back
    by the reverse ones; ``grad_routed_shard`` is this rank's experts'
    gradient from every rank's rows, summed here (no ring)."""
    acc_dtype = accumulation_dtype(routed_shard.dtype)
    grad_rows = grad_y[routing.tokens]  # (N k, H) in routing order
    grad_weights = torch.zeros(weights.shape, dtype=accumulation_dtype(weights.dtype), device=grad_y.device)
    grad_weights[routing.tokens, routing.slots] = (grad_rows.to(acc_dtype) * returned.to(acc_dtype)).sum(-1).to(
        grad_weights.dtype)
    grad_outputs = (grad_rows * weights[routing.tokens, routing.slots, None]).to(received.dtype)
    grad_outputs = comm.all_to_all_rows(grad_outputs, exchange.send_counts, exchange.recv_counts, plan.group)
    grad_shard = torch.zeros(routed_shard.shape, dtype=acc_dtype, device=routed_shard.device)
    w, grad_w = plan.routed_spec.unpack(routed_shard), plan.routed_spec.unpack(grad_shard)
    grad_received = torch.empty_like(received)
    for local in range(plan.experts_per_rank):
        weights_e, grads_e = _expert(w, local, plan.expert_size), _expert(grad_w, local, plan.expert_size)
        for rows, _ in exchange.by_local_expert.of_expert(local, plan.token_tile):
            gate = F.linear(received[rows], weights_e["gate_proj.weight"])
            up = F.linear(received[rows], weights_e["up_proj.weight"])
            grad_received[rows], piece_grads = gated_shard_backward(received[rows], grad_outputs[rows], weights_e,
                                                                    plan.act_fn, gate, up)
            for name, grad in piece_grads.items():
                grads_e[name] += grad
    grad_sent = comm.all_to_all_rows(grad_received, exchange.recv_counts, exchange.send_counts, plan.group)
    grad_x = torch.zeros(grad_y.shape, dtype=plan.accumulator_dtype(grad_y.dtype), device=grad_y.device)
    grad_x.index_add_(0, routing.tokens, grad_sent.to(grad_x.dtype))
    return grad_x, grad_weights.to(weights.dtype), grad_shard.to(routed_shard.dtype)


class _MoEAllToAll(torch.autograd.Function):
    """The routed experts by token all-to-all and, for Qwen2-MoE, the shared
    expert's slices on the MLP's ring, over the whole packed shard: it is
    saved as the parameter itself (no view of it), so ZeRO-3 may release it
    between forward and backward as it does for the expert ring."""

    # Under autocast as _MoERing: tokens, the shard and the routing weights in the autocast dtype.
    @staticmethod
    @autocast_forward(cast_inputs=True)
    def forward(ctx, x, weights, index, shared_scale, packed, plan):
        routing = Routing.of(index, plan.num_experts)
        exchange = TokenExchange.of(routing, plan)
        routed = plan.routed_spec.numel
        y, received, returned = moe_all_to_all_forward(x, weights, routing, exchange, packed[:routed], plan)
        shared_out, steps = None, []
        if plan.shared:  # HF: the shared expert's output times its sigmoid gate, added
            shared_out, gates, ups = mlp_ring_forward(x, packed[routed:], plan.shared_plan)
            y += (shared_scale * shared_out).to(y.dtype)
            steps = gates + ups
        # The rows routed to this rank's experts and its rows' outputs: about 2 k N H, as many as were sent.
        # The shared expert's backward needs the local tokens too, and its output for its gate's gradient.
        ctx.save_for_backward(weights, packed, routing.tokens, routing.slots, received, returned,
                              x if plan.shared else None, shared_scale, shared_out, *steps)
        ctx.plan, ctx.offsets, ctx.exchange = plan, routing.offsets, exchange
        return y.to(x.dtype)

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_y):
        weights, packed, tokens, slots, received, returned, x, shared_scale, shared_out, *steps = ctx.saved_tensors
        plan, routed = ctx.plan, ctx.plan.routed_spec.numel
        grad_x, grad_weights, grad_routed = moe_all_to_all_backward(
            grad_y, weights, Routing(tokens, slots, ctx.offsets), ctx.exchange, received, returned, packed[:routed],
            plan)
        grad_packed, grad_scale = torch.empty_like(packed), None
        grad_packed[:routed] = grad_routed
        if plan.shared:
            acc_dtype = accumulation_dtype(shared_scale.dtype)
            grad_scale = (grad_y.to(acc_dtype) * shared_out.to(acc_dtype)).sum(-1, keepdim=True).to(shared_scale.dtype)
            gates, ups = steps[:len(steps) // 2], steps[len(steps) // 2:]
            grad_shared_x, grad_packed[routed:] = mlp_ring_backward((grad_y * shared_scale).to(grad_y.dtype), x,
                                                                    packed[routed:], gates, ups, plan.shared_plan)
            grad_x += grad_shared_x
        return grad_x.to(grad_y.dtype), grad_weights, None, grad_scale, grad_packed, None


class TSPSparseMoE(RingWireDtypeMixin, PackedShardMixin, nn.Module):
    """A Hugging Face sparse MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE) over the
    local tokens, experts sharded ``E/D`` per rank, moved by a ring or met by a
    token all-to-all (``tsp.moe_schedule``, see the module docstring).

    Parameters: ``packed``, this rank's experts (and shared-expert slice) laid
    out by ``self.spec``, tagged ``tensor_model_parallel``; the replicated
    Hugging Face router ``gate`` and, for Qwen2-MoE, ``shared_expert_gate``.
    """

    def __init__(self, hidden_size, num_experts, expert_size, act_fn, router, tsp_group, shared_size=0,
                 shared_gate=None, overlap=True, token_tile=0, fp32_accumulators=True, schedule="ring", dtype=None,
                 device=None):
        super().__init__()
        if bool(shared_size) != (shared_gate is not None):
            raise ValueError("a shared expert needs its shared_expert_gate, and the gate its expert")
        self.hidden_size, self.num_experts, self.expert_size = hidden_size, num_experts, expert_size
        self.shared_size = shared_size
        self.tsp_group = tsp_group
        self.tsp_size, self.tsp_rank = comm.group_size(tsp_group), comm.group_rank(tsp_group)
        self.spec = shard_spec(hidden_size, num_experts, expert_size, self.tsp_size, shared_size)
        self.act_fn = act_fn
        self.overlap = overlap
        if not callable(schedule) and schedule not in MOE_SCHEDULES:
            raise ValueError(f"schedule must be one of {MOE_SCHEDULES} or a chooser, not {schedule!r}")
        self.plan = MoEPlan(self.spec, act_fn, tsp_group, num_experts, expert_size, bool(shared_size), overlap,
                            token_tile, fp32_accumulators, schedule=schedule)
        self.gate = router
        self.shared_expert_gate = shared_gate
        self.packed = nn.Parameter(torch.empty(self.spec.numel, dtype=dtype, device=device))
        # DeepSpeed counts a parameter on every model-parallel rank in grad norms only with this tag.
        self.packed.tensor_model_parallel = True
        self.lora = None  # no LoRA on the experts (ds_tsp.injection.lora)

    def replicated_params(self):
        """The parameters every rank holds whole, under Hugging Face names."""
        params = {ROUTER: self.gate.weight}
        if self.shared_expert_gate is not None:
            params[SHARED_GATE] = self.shared_expert_gate.weight
        return params

    def shard_piece(self, name):
        """``(dim, start, length)`` of the full tensor ``name`` this rank holds, or None if whole."""
        return shard_piece(self.num_experts, self.shared_size, self.tsp_size, name, self.tsp_rank)

    @classmethod
    def from_hf(cls, moe, tsp_group, overlap=True, token_tile=0, fp32_accumulators=True, schedule="ring", read=None,
                device=None):
        """Build from a Hugging Face sparse MoE block (``gate``: its TopKRouter,
        ``experts`` with fused 3-D ``gate_up_proj`` / ``down_proj``, and
        optionally ``shared_expert`` + ``shared_expert_gate``), keeping this
        rank's experts. The router and shared-expert gate modules are Hugging
        Face's own, copied. ``read(name, piece)`` as in ``TSPGatedMLP.from_hf``."""
        hidden_size, num_experts, expert_size, shared_size = hf_sizes(moe)
        dtype = moe.experts.gate_up_proj.dtype
        device = device or moe.experts.gate_up_proj.device

        def replica(module):
            return None if module is None else copy.deepcopy(module).to_empty(device=device)

        module = cls(hidden_size, num_experts, expert_size, moe.experts.act_fn, replica(moe.gate), tsp_group,
                     shared_size=shared_size, shared_gate=replica(getattr(moe, "shared_expert_gate", None)),
                     overlap=overlap, token_tile=token_tile, fp32_accumulators=fp32_accumulators, schedule=schedule,
                     dtype=dtype, device=device)
        read = read or module_reader(moe)
        module.load_shard({name: read(name, module.shard_piece(name)) for name in module.shard_names()})
        return module

    @torch.no_grad()
    def decode_share(self, x):
        """For tokens ``x`` ``(N, H)`` that every rank holds (decoding), this
        rank's share of the output: its own experts' weighted outputs for the
        tokens routed to them and its slice of the shared expert, no weight
        moving; the shares sum over the group to the block's output."""
        _, weights, index = self.gate(x)
        shared_scale = None if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x))
        y = torch.zeros(x.shape, dtype=self.plan.accumulator_dtype(x.dtype), device=x.device)
        routing = Routing.of(index, self.num_experts)
        w = self.spec.unpack(self.packed.detach())
        for local, expert in self.plan.held_experts(0):
            for tokens, slots in routing.of_expert(expert, 0):
                out, _, _ = gated_shard_forward(x[tokens], _expert(w, local, self.expert_size), self.plan.act_fn)
                y.index_add_(0, tokens, (out * weights[tokens, slots, None]).to(y.dtype))
        if shared_scale is not None:
            out, _, _ = gated_shard_forward(x, _shared(w), self.plan.act_fn)
            y += (shared_scale * out).to(y.dtype)
        return y.to(x.dtype)

    def forward(self, x):
        """``x``: this rank's tokens ``(B, S/D, H)``; returns ``(B, S/D, H)``."""
        x2 = x.reshape(-1, self.hidden_size)  # (N, H)
        _, weights, index = self.gate(x2)  # HF's router: softmax, top-k, normalisation and dtypes as HF
        shared_scale = None
        if self.shared_expert_gate is not None:
            shared_scale = torch.sigmoid(self.shared_expert_gate(x2))  # (N, 1)
        schedule = _MoERing if self.schedule_for(x2, index.shape[-1]) == "ring" else _MoEAllToAll
        return schedule.apply(x2, weights, index, shared_scale, self.packed, self.plan).view(x.shape)

    def schedule_for(self, x2, top_k):
        """The schedule of this forward: the block's, or its chooser's answer for
        ``x2``'s ``N`` local tokens, logged once per choice. The chooser takes
        ``(hidden_size, num_experts, expert_size, shared_size, top_k, N,
        tsp_size, element bytes, direction, grad_wire_bytes=)``, direction
        "both" in training mode and "forward" in eval mode, as
        ``ds_tsp.planning.cheaper_moe_schedule`` does (``tsp.moe_schedule: "auto"``)."""
        if not callable(self.plan.schedule):
            return self.plan.schedule
        wire = self.plan.grad_wire_dtype
        choice = self.plan.schedule(self.hidden_size, self.num_experts, self.expert_size, self.shared_size, top_k,
                                    x2.shape[0], self.tsp_size, _compute_dtype(x2).itemsize,
                                    "both" if self.training else "forward",
                                    grad_wire_bytes=None if wire is None else wire.itemsize)
        said = (choice, x2.shape[0], self.num_experts, top_k, self.tsp_size)
        if said not in _announced:
            _announced.add(said)
            if not dist.is_initialized() or dist.get_rank() == 0:
                logger.info("tsp.moe_schedule auto: %s for %d local tokens (E=%d, top-%d, D=%d)", *said)
        return choice

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, expert_size={self.expert_size}, "
                f"shared_size={self.shared_size}, tsp_size={self.tsp_size}, overlap={self.overlap}, "
                f"schedule={getattr(self.plan.schedule, '__name__', self.plan.schedule)}")


# ------------------------------------------------ router logits and the auxiliary loss

@contextlib.contextmanager
def recorded_router_logits(blocks):
    """Collect each ``TSPSparseMoE`` router's logits ``(N, E)`` during the
    forward inside, in layer order, as Hugging Face's ``OutputRecorder`` does
    (a forward hook on the router). Yields the list."""
    logits = []
    handles = [block.gate.register_forward_hook(lambda module, args, output: logits.append(output[0]))
               for block in blocks]
    try:
        yield logits
    finally:
        for handle in handles:
            handle.remove()


class _FullSequenceRows(torch.autograd.Function):
    """Forward: every rank's ``(..., S/D, E)`` rows (dim -2) all-gathered into
    natural order, TSP's padding dropped. Backward: each rank keeps the
    gradient of its own rows, as every rank computes the same loss from the
    same gathered rows (``sum_over_group``'s rule, not a sum over ranks)."""

    @staticmethod
    def forward(ctx, local, group, num_padding, layout_name):
        ctx.group, ctx.layout_name = group, layout_name
        dim = local.dim() - 2
        gathered, _ = comm.all_gather(local, group)  # (D, ..., S/D, E)
        return layout.unpad(layout.unshard(gathered, comm.group_size(group), layout_name, dim=dim), num_padding,
                            dim=dim)

    @staticmethod
    def backward(ctx, grad):
        tsp_size, dim = comm.group_size(ctx.group), grad.dim() - 2
        padded, _ = layout.pad_to_multiple(grad, tsp_size, 0.0, dim=dim)
        return layout.shard(padded, comm.group_rank(ctx.group), tsp_size, ctx.layout_name, dim=dim), None, None, None


def full_sequence_router_logits(router_logits, batch_size, num_padding, group, layout_name):
    """Hugging Face's layout of ``router_logits`` (per MoE layer this rank's
    ``(B*S/D, E)``): per layer ``(B*S, E)`` over the whole sequence in natural
    order, the padding TSP appends dropped. One all-gather for all layers;
    differentiable, so a loss computed from them (HF's
    ``load_balancing_loss_func``) reaches the routers as it does in HF."""
    num_experts = router_logits[0].shape[-1]
    local = torch.stack([logits.view(batch_size, -1, num_experts) for logits in router_logits])  # (L, B, S/D, E)
    natural = _FullSequenceRows.apply(local, group, num_padding, layout_name)
    return tuple(layer.reshape(-1, num_experts) for layer in natural.unbind(0))


def load_balancing_loss(router_logits, top_k, real, group):
    """Hugging Face's ``load_balancing_loss_func`` over the whole sequence.

    ``router_logits``: per MoE layer, this rank's ``(N, E)`` logits;
    ``real``: ``(N,)`` bool, this rank's real tokens (not padding, HF's or
    TSP's). HF's statistics are sums over every token of every layer
    (``routing_statistics``): each rank sums its own tokens, one all-reduce
    over the TSP group adds them, and every rank computes the same loss
    (``balance_loss``). Its gradient reaches each rank's own tokens'
    probabilities (``sum_over_group``'s identity backward), as the
    cross-entropy's does.
    """
    return balance_loss(sum(routing_statistics(logits, real, top_k) for logits in router_logits), group)


def routing_statistics(logits, real, top_k):
    """One MoE layer's share of the load-balancing statistics over this rank's
    real tokens: ``(2E+1,)`` float64, how often each expert is in a token's
    top-k, the sum of its softmax probabilities, and the number of rows.
    Summing them over layers (and pipeline stages) gives HF's statistics.

    Dtypes as HF: softmax and top-k in the logits' dtype, the probabilities
    float32. The sums run in float64 and are rounded to float32 once
    (``balance_loss``), so the result does not depend on ``D`` or the token
    order; HF rounds at every float32 add, so the two agree to float32
    rounding of the statistics.
    """
    mask = real.reshape(-1).to(device=logits.device, dtype=torch.float32)
    probs = F.softmax(logits, dim=-1)
    _, selected = torch.topk(probs, top_k, dim=-1)
    counts = torch.zeros(logits.shape[-1], dtype=torch.float64, device=logits.device)
    counts.scatter_add_(0, selected.reshape(-1), mask.repeat_interleave(top_k).double())
    prob_sum = (probs.float() * mask.unsqueeze(-1)).double().sum(0)
    return torch.cat([counts, prob_sum, mask.double().sum().view(1)])


def balance_loss(statistics, group):
    """The load-balancing loss from this rank's summed ``routing_statistics``:
    one all-reduce of ``2E+1`` float64 values over the TSP group, then HF's
    ``E * sum(fraction routed * mean probability)``."""
    num_experts = statistics.shape[0] // 2
    stats = sum_over_group(statistics, group)
    counts, prob_sum, rows = stats[:num_experts].float(), stats[num_experts:-1].float(), stats[-1].float()
    return torch.sum((counts / rows) * (prob_sum / rows).unsqueeze(0)) * num_experts
