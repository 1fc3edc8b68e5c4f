"""The sparse MoE block's ring schedule: expert shards travel round the TSP
group while tokens stay put (DESIGN.md 6c, the MLP's schedule of DESIGN.md 5).

The block's output is a sum of independent pieces (each routed expert's
weighted output, each slice of the shared expert times its sigmoid gate), so
every rank runs its own tokens through every shard in turn and sums locally.
Forward, on rank ``r`` with local tokens ``x`` ``(N = B*S/D, H)``::

    weights, index = router(x)         # (N, k): HF's TopKRouter on local tokens
    y = 0; buf = own shard
    for t in 0..D-1:                   # buf holds experts and shared slice of rank (r - t) mod D
        if t < D-1: post send(buf -> r+1), recv(next <- r-1)
        for each expert e in buf, T = local tokens routed to e (slot s):
            y[T] += weights[T, s] * expert_e(x[T])     # as HF's experts module (experts.ExpertLayout)
        y += scale(x) * shared slice(x)     # sigmoid of Qwen2-MoE's gate; 1 for an ungated one
        wait; buf = next

Dropless: every token meets exactly its top-k experts, with no capacity; an
expert no local token chose costs nothing but its hop. Backward runs the same
ring (``ds_tsp.parallel.ring.ring_gradients``): each shard's gradient
accumulator travels with it and ends, summed over every rank's tokens, on its
owner. Where the local tokens fit one token tile the forward keeps each
routed row's gate and up projections (``k`` rows of ``2 F`` a local token, as
the MLP keeps its gate and up); beyond, backward recomputes them per expert
and tile (nothing ``(N, k, F)`` is kept). The routing weights' gradient, each
row's output against its gradient, is read off the down projection's input
gradient, so no output is computed again.

Bytes per rank and layer, with ``W = E/D * 3HF (+ 3H Fs/D)`` elements in a
rank's packed shard (``w`` bytes each; accumulators summed in float32 or
wider, ``a`` bytes each in the gradient wire dtype, ``precision.gradient_wire_dtype``):
forward ``(D-1) W w`` received (``(D-1)/D`` of the layer's expert weights),
backward ``(D-1) W (w + a)`` (weights again, plus the accumulators),
independent of the sequence; no all-to-all, no all-reduce.
"""

import torch

from ds_tsp.blocks.mlp import shard_backward as gated_shard_backward
from ds_tsp.blocks.mlp import shard_forward as gated_shard_forward
from ds_tsp.blocks.moe.plan import Routing, expert_rows, shared_weights
from ds_tsp.parallel import precision
from ds_tsp.parallel.amp import autocast_backward, autocast_forward
from ds_tsp.parallel.eager import EagerFunction
from ds_tsp.parallel.precision import accumulation_dtype
from ds_tsp.parallel.ring import ring_gradients, ring_steps


def moe_ring_forward(x, weights, routing, shared_scale, packed, plan, kept=None):
    """``(N, H)``: every local token's weighted outputs of its top-k experts (and
    the shared expert times ``shared_scale`` ``(N, 1)``), the shards taken
    round the ring (``ds_tsp.parallel.ring.ring_steps``). ``kept``: a list the
    routed experts' gate and up projections are appended to, in ring order, for
    backward (None: none kept)."""
    y = torch.zeros(x.shape, dtype=plan.accumulator_dtype(x.dtype), device=x.device)

    def step(t, buf):
        w = plan.spec.unpack(buf)
        for local, expert in plan.held_experts(t):
            weights_e = plan.experts.weights(w, local)
            for tokens, slots in routing.of_expert(expert, plan.token_tile):
                weight = weights[tokens, slots, None]
                out = plan.experts.forward(expert_rows(x[tokens], weight, plan), weights_e, kept)
                # HF: expert output times its routing weight (type promotion), then summed per token; or, where the
                # weight scaled the expert's input (Llama 4's), the outputs summed as they are.
                y.index_add_(0, tokens, (out if plan.scales_inputs else out * weight).to(y.dtype))
        if plan.shared:
            for start, end in plan.tiles(x.shape[0]):
                out, _, _ = gated_shard_forward(x[start:end], shared_weights(w), plan.act_fn)
                y[start:end] += (shared_scale[start:end] * out).to(y.dtype)

    ring_steps(packed, plan.group, step, plan.overlap)
    return y.to(x.dtype)


def moe_ring_backward(grad_y, x, weights, routing, shared_scale, packed, plan, kept=()):
    """``(grad_x, grad_weights, grad_shared_scale, grad_packed)``; ``grad_packed``
    is this rank's own shard's gradient summed over every rank's tokens.
    ``kept``: the forward's gate and up projections in ring order, or empty to
    recompute them."""
    projections = iter(kept)
    acc_dtype = accumulation_dtype(packed.dtype)
    grad_x = torch.zeros(x.shape, dtype=plan.accumulator_dtype(x.dtype), device=x.device)
    grad_weights = torch.zeros(weights.shape, dtype=accumulation_dtype(weights.dtype), device=x.device)
    grad_scale = None if shared_scale is None else torch.zeros(
        shared_scale.shape, dtype=accumulation_dtype(shared_scale.dtype), device=x.device)

    def piece_backward(x_piece, grad_piece, scale, w, grads):
        """One routed expert on some tokens: adds to ``grads``, returns the
        tokens' ``(grad_x, grad_weight)``: ``<grad_y, output>`` for a weighted
        output, ``<grad_input, x>`` for a weighted input (``plan.scales_inputs``)."""
        proj = next(projections, None)
        if plan.scales_inputs:
            grad_in, _ = plan.experts.backward(expert_rows(x_piece, scale, plan), grad_piece.to(x.dtype), w, grads,
                                               proj=proj)
            return grad_in * scale, (grad_in.to(acc_dtype) * x_piece.to(acc_dtype)).sum(-1)
        return plan.experts.backward(x_piece, grad_piece.to(x.dtype), w, grads, proj=proj, weights=scale)

    def shared_backward(x_piece, grad_piece, scale, w, grads):
        """The shared expert's slice on some tokens, as ``piece_backward``."""
        out, gate, up = gated_shard_forward(x_piece, w, plan.act_fn)  # gated or not
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
            weights_e, grads_e = plan.experts.weights(w, local), plan.experts.weights(grad_w, local)
            for tokens, slots in routing.of_expert(expert, plan.token_tile):
                piece_grad_x, grad_weight = piece_backward(x[tokens], grad_y[tokens], weights[tokens, slots, None],
                                                           weights_e, grads_e)
                grad_x.index_add_(0, tokens, piece_grad_x.to(grad_x.dtype))
                grad_weights[tokens, slots] = grad_weight.to(grad_weights.dtype)
        if plan.shared:
            for start, end in plan.tiles(x.shape[0]):
                piece_grad_x, grad_s = shared_backward(x[start:end], grad_y[start:end], shared_scale[start:end],
                                                       shared_weights(w), shared_weights(grad_w))
                grad_x[start:end] += piece_grad_x
                grad_scale[start:end] += grad_s.unsqueeze(-1).to(grad_scale.dtype)
        return grad_shard

    wire = precision.gradient_wire_dtype(plan.grad_wire_dtype, packed.dtype)
    grad_packed = ring_gradients(packed, plan.group, step, plan.overlap, wire)
    return (grad_x.to(x.dtype), grad_weights.to(weights.dtype),
            None if grad_scale is None else grad_scale.to(shared_scale.dtype), grad_packed.to(packed.dtype))


class _MoERing(EagerFunction):
    """Forward: the experts' shards round the ring over the local tokens.
    Backward: the same ring, each shard's gradient travelling with it to its owner."""

    # Under autocast the tokens, the shard and the routing weights are cast to
    # the autocast dtype (HF keeps the routing weights float32 there).
    @staticmethod
    @autocast_forward(cast_inputs=True)
    def forward(ctx, x, weights, index, shared_scale, packed, plan, keep):
        routing = Routing.of(index, plan.num_experts)
        kept = [] if keep else None
        y = moe_ring_forward(x, weights, routing, shared_scale, packed, plan, kept)
        # Local tokens and this rank's own shard, and with ``keep`` the local tokens' routed rows' gate and up
        # projections: saved bytes scale as 1/D.
        ctx.save_for_backward(x, weights, shared_scale, packed, routing.tokens, routing.slots, *(kept or ()))
        ctx.plan, ctx.offsets = plan, routing.offsets
        return y

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_y):
        x, weights, shared_scale, packed, tokens, slots, *kept = ctx.saved_tensors
        routing = Routing(tokens, slots, ctx.offsets)
        grad_x, grad_weights, grad_scale, grad_packed = moe_ring_backward(grad_y, x, weights, routing, shared_scale,
                                                                          packed, ctx.plan, kept)
        return grad_x, grad_weights, None, grad_scale, grad_packed, None, None


def moe_ring(x, weights, index, shared_scale, packed, plan, keep=False):
    """The block's experts on the local tokens ``x`` ``(N, H)``. Forward: the
    shards round the ring; backward: the same ring, gradients to their owners.
    ``keep``: keep the routed experts' gate and up projections for backward."""
    return _MoERing.apply(x, weights, index, shared_scale, packed, plan, keep)
