"""The sparse MoE block's token all-to-all schedule: experts stay at rest and
each routed row ``(token, expert)`` goes to the expert's owner.

Forward (``moe_all_to_all_forward``)::

    weights, index = router(x)
    rows = x[token of each (token, slot)], sorted by expert, so by owner   # (N k, H)
    exchange the split sizes: rows for each of the owner's E/D experts     # all_to_all of (D, E/D) int64
    received = all_to_all(rows)        # every rank's rows for this rank's experts, by source then expert
    outputs[rows of e] = expert_e(received[rows of e])  for each own expert e (experts.ExpertLayout)
    returned = all_to_all back(outputs)                # the outputs of this rank's rows, in their order
    for e in 0..E-1: y[T_e] += weights[T_e, s] * returned[rows of e]  # HF's order: expert by expert
    y += scale(x) * shared expert(x)    # its slices on the MLP's ring; scale: sigmoid of a gate, or 1

Where the routing weights scale the experts' inputs (Llama 4's block), the
rows sent are the tokens times their weights and the outputs come back
unweighted; backward then takes the weights' gradient from the returned input
gradients and the local tokens.

Backward is its transpose: the output rows' gradients, times the routing
weights, go to the experts' owners by the same routes, the input rows'
gradients come back by the reverse ones, the routing weights' gradients are
local (the returned outputs are kept), and each expert's weight gradient is
summed on its owner from every rank's rows, with no accumulator ring.
Dropless, as the ring: every token meets exactly its top-k experts.

Bytes per rank and layer: the ``E/D`` split sizes of each other rank, then
the rows routed to this rank's experts and the outputs of its own rows
computed elsewhere, ``2 k N (D-1)/D`` rows of ``H`` with routing spread
evenly; backward the same rows again (their gradients), and Qwen2-MoE's
shared expert on the ring. It grows with the sequence and the ring's does
not, so the all-to-all moves fewer below ``B*S = 1.5 E F D / k`` tokens
(forward; forward and backward in bf16 with float32 accumulators:
``0.75 E F D (2w + a) / (k w)``) and the ring past it; Qwen3-30B-A3B at D=8
crosses at 147,456 and 294,912 tokens per micro-batch. Memory: the received
rows and the returned outputs are kept for backward, about ``2 k N H``
elements, where the ring keeps nothing of the experts beyond the local tokens;
under both, where the local tokens fit one token tile, the experts' gate and
up projections of their rows (about ``2 k N F``), which backward otherwise
computes again.
"""

from dataclasses import dataclass

import torch

from ds_tsp.blocks.mlp import mlp_ring_backward, mlp_ring_forward
from ds_tsp.blocks.moe.plan import Routing, expert_counts, expert_rows
from ds_tsp.parallel import comm
from ds_tsp.parallel.amp import autocast_backward, autocast_forward
from ds_tsp.parallel.eager import EagerFunction
from ds_tsp.parallel.host_reads import host_copy
from ds_tsp.parallel.precision import accumulation_dtype


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
    def route(cls, index, plan):
        """``(routing, exchange)`` of the router's ``(N, k)`` expert indices:
        the split sizes exchanged (one all-to-all of ``E/D`` int64 per rank
        pair, on the tokens' device), then read on the host with this rank's
        own counts, in one host read for the layer."""
        tsp_size, per_rank, device = comm.group_size(plan.group), plan.experts_per_rank, index.device
        counts = expert_counts(index, plan.num_experts)
        incoming, _ = comm.all_to_all(counts.view(tsp_size, per_rank), plan.group)  # (D, E/D): rows rank j sends
        host_counts, host_incoming = host_copy(counts, incoming, reason="moe split sizes")
        routing = Routing.of(index, plan.num_experts, host_counts)
        local_expert = torch.arange(per_rank, device=device).repeat(tsp_size).repeat_interleave(
            incoming.reshape(-1), output_size=int(host_incoming.sum()))
        exchange = cls(tuple(host_counts.view(tsp_size, per_rank).sum(1).tolist()),
                       tuple(host_incoming.sum(1).tolist()),
                       Routing.of(local_expert.unsqueeze(-1), per_rank, host_incoming.sum(0)))
        return routing, exchange


def moe_all_to_all_forward(x, weights, routing, exchange, routed_shard, plan, kept=None):
    """``(y, received, returned)``: ``y`` ``(N, H)`` every local token's weighted
    outputs of its top-k experts, in the accumulator dtype, the rows sent to
    the experts' owners and the outputs sent back (``routed_shard``: this
    rank's routed experts, at rest); ``received`` ``(R, H)`` the rows this
    rank's experts computed on, ``returned`` ``(N k, H)`` the outputs of this
    rank's rows in routing order, both kept for backward. ``kept``: a list
    this rank's experts' gate and up projections are appended to, expert by
    expert, for backward (None: none kept)."""
    rows = expert_rows(x[routing.tokens], weights[routing.tokens, routing.slots, None], plan)
    received = comm.all_to_all_rows(rows, exchange.send_counts, exchange.recv_counts, plan.group)
    outputs = torch.empty_like(received)
    w = plan.routed_spec.unpack(routed_shard)
    for local in range(plan.experts_per_rank):
        weights_e = plan.experts.weights(w, local)
        for rows, _ in exchange.by_local_expert.of_expert(local, plan.token_tile):
            outputs[rows] = plan.experts.forward(received[rows], weights_e, kept)
    returned = comm.all_to_all_rows(outputs, exchange.recv_counts, exchange.send_counts, plan.group)
    # Each output times its routing weight, added to its token: the rows are in expert order, so each token's
    # sum runs expert by expert, as HF's loop adds them; one index_add_ for all experts.
    # Where the weights scaled the experts' inputs (Llama 4's), the outputs are added as they are.
    y = torch.zeros(x.shape, dtype=plan.accumulator_dtype(x.dtype), device=x.device)
    weighted = returned if plan.scales_inputs else returned * weights[routing.tokens, routing.slots, None]
    y.index_add_(0, routing.tokens, weighted.to(y.dtype))
    return y, received, returned


def moe_all_to_all_backward(grad_y, x, weights, routing, exchange, received, returned, routed_shard, plan,
                            kept=()):
    """``(grad_x, grad_weights, grad_routed_shard)``: the transpose of the
    forward, ``grad_x`` in the accumulator dtype. The output gradients go to
    the experts' owners by the forward's routes, the input gradients come back
    by the reverse ones; ``grad_routed_shard`` is this rank's experts'
    gradient from every rank's rows, summed here (no ring). ``x``: the local
    tokens, read where the weights scaled the experts' inputs. ``kept``: the
    forward's gate and up projections, or empty to recompute them."""
    projections = iter(kept)
    acc_dtype = accumulation_dtype(routed_shard.dtype)
    grad_rows = grad_y[routing.tokens]  # (N k, H) in routing order
    row_weights = weights[routing.tokens, routing.slots, None]
    grad_weights = torch.zeros(weights.shape, dtype=accumulation_dtype(weights.dtype), device=grad_y.device)
    if not plan.scales_inputs:
        grad_weights[routing.tokens, routing.slots] = (grad_rows.to(acc_dtype) * returned.to(acc_dtype)).sum(-1).to(
            grad_weights.dtype)
    grad_outputs = (grad_rows if plan.scales_inputs else grad_rows * row_weights).to(received.dtype)
    grad_outputs = comm.all_to_all_rows(grad_outputs, exchange.send_counts, exchange.recv_counts, plan.group)
    grad_shard = torch.zeros(routed_shard.shape, dtype=acc_dtype, device=routed_shard.device)
    w, grad_w = plan.routed_spec.unpack(routed_shard), plan.routed_spec.unpack(grad_shard)
    grad_received = torch.empty_like(received)
    for local in range(plan.experts_per_rank):
        weights_e, grads_e = plan.experts.weights(w, local), plan.experts.weights(grad_w, local)
        for rows, _ in exchange.by_local_expert.of_expert(local, plan.token_tile):
            grad_received[rows], _ = plan.experts.backward(received[rows], grad_outputs[rows], weights_e, grads_e,
                                                           proj=next(projections, None))
    grad_sent = comm.all_to_all_rows(grad_received, exchange.recv_counts, exchange.send_counts, plan.group)
    if plan.scales_inputs:  # the rows were the tokens times their weights
        grad_weights[routing.tokens, routing.slots] = (grad_sent.to(acc_dtype) * x[routing.tokens].to(acc_dtype)).sum(
            -1).to(grad_weights.dtype)
        grad_sent = grad_sent * row_weights
    grad_x = torch.zeros(grad_y.shape, dtype=plan.accumulator_dtype(grad_y.dtype), device=grad_y.device)
    grad_x.index_add_(0, routing.tokens, grad_sent.to(grad_x.dtype))
    return grad_x, grad_weights.to(weights.dtype), grad_shard.to(routed_shard.dtype)


class _MoEAllToAll(EagerFunction):
    """The routed experts by token all-to-all and, where there is one, the shared
    expert's slices on the MLP's ring, over the whole packed shard: it is
    saved as the parameter itself (no view of it), so ZeRO-3 may release it
    between forward and backward as it does for the expert ring."""

    # Under autocast as _MoERing: tokens, the shard and the routing weights in the autocast dtype.
    @staticmethod
    @autocast_forward(cast_inputs=True)
    def forward(ctx, x, weights, index, shared_scale, packed, plan, keep):
        routing, exchange = TokenExchange.route(index, plan)
        routed = plan.routed_spec.numel
        kept = [] if keep else None
        y, received, returned = moe_all_to_all_forward(x, weights, routing, exchange, packed[:routed], plan, kept)
        shared_out, steps = None, []
        if plan.shared:  # HF: the shared expert's output times its sigmoid gate, added
            shared_out, gates, ups = mlp_ring_forward(x, packed[routed:], plan.shared_plan)
            y += (shared_scale * shared_out).to(y.dtype)
            steps = gates + ups
        # The rows routed to this rank's experts and its rows' outputs: about 2 k N H, as many as were sent
        # (with ``keep`` also the experts' gate and up projections of the rows received, about 2 k N F).
        # The shared expert's backward needs the local tokens too, and its output for its gate's gradient.
        kept = kept or []
        ctx.save_for_backward(weights, packed, routing.tokens, routing.slots, received, returned,
                              x if plan.shared or plan.scales_inputs else None, shared_scale, shared_out, *kept,
                              *steps)
        ctx.plan, ctx.offsets, ctx.exchange, ctx.kept = plan, routing.offsets, exchange, len(kept)
        return y.to(x.dtype)

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_y):
        weights, packed, tokens, slots, received, returned, x, shared_scale, shared_out, *steps = ctx.saved_tensors
        kept, steps = steps[:ctx.kept], steps[ctx.kept:]
        plan, routed = ctx.plan, ctx.plan.routed_spec.numel
        grad_x, grad_weights, grad_routed = moe_all_to_all_backward(
            grad_y, x, weights, Routing(tokens, slots, ctx.offsets), ctx.exchange, received, returned,
            packed[:routed], plan, kept)
        grad_packed, grad_scale = torch.empty_like(packed), None
        grad_packed[:routed] = grad_routed
        if plan.shared:
            acc_dtype = accumulation_dtype(shared_scale.dtype)
            grad_scale = (grad_y.to(acc_dtype) * shared_out.to(acc_dtype)).sum(-1, keepdim=True).to(shared_scale.dtype)
            gates, ups = steps[:len(steps) // 2], steps[len(steps) // 2:]
            grad_shared_x, grad_packed[routed:] = mlp_ring_backward((grad_y * shared_scale).to(grad_y.dtype), x,
                                                                    packed[routed:], gates, ups, plan.shared_plan)
            grad_x += grad_shared_x
        return grad_x.to(grad_y.dtype), grad_weights, None, grad_scale, grad_packed, None, None


def moe_all_to_all(x, weights, index, shared_scale, packed, plan, keep=False):
    """The block's experts on the local tokens ``x`` ``(N, H)``. Forward: rows to
    the experts' owners and outputs back by all-to-all; backward: their gradients
    by the same routes."""
    return _MoEAllToAll.apply(x, weights, index, shared_scale, packed, plan, keep)
