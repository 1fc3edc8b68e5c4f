"""Q/K norms over a whole projection's width (OLMo-2), whose RMS spans every
rank's head groups.

Before any head group is normed, the shards go round once more, ahead of the
attention's own round: each rank projects its local tokens through every
group's q and k rows and sums their squares, which gives each token's inverse
RMS over the full width (``ds_tsp.blocks.rotary.ProjectionNormPiece`` then
norms a group's heads alone). Backward projects again and reduces each
shard's weight gradient to its owner. Per-head norms (Qwen3, Gemma-3) need
none of this.
"""

import torch
import torch.nn.functional as F

from ds_tsp.blocks.attention.schedule import ReducesInFlight, shard_stream
from ds_tsp.parallel import comm, precision
from ds_tsp.parallel.amp import autocast_backward, autocast_forward
from ds_tsp.parallel.eager import EagerFunction


def projection_squares_forward(plan, x, packed):
    """Each local token's sum of squares over the whole q and over the whole k
    projection (every head group's; ``(B, S/D)`` each, float32 or wider), which
    norms over a projection's width need before any head group is normed
    (``ProjectionNormPiece``): the shards go round once more, ahead of the
    attention's own round."""
    acc = torch.promote_types(x.dtype, torch.float32)
    sums = {name: torch.zeros(x.shape[:2], dtype=acc, device=x.device) for name in ("q", "k")}
    for j, shard in shard_stream(plan, packed):
        w = plan.specs[j].unpack(shard)
        for name in ("q", "k") if plan.heads.holds_kv(j) else ("q",):
            projected = F.linear(x, w[f"{name}_proj.weight"], w.get(f"{name}_proj.bias"))
            sums[name] += projected.to(acc).pow(2).sum(dim=-1)  # as HF's norm: squares of the float32 (or wider) values
    return sums["q"], sums["k"]


def projection_squares_backward(plan, grad_sums, x, packed):
    """Gradients of ``projection_squares_forward`` for ``x`` and this rank's
    shard, from those of the sums (``{"q", "k"}``, ``(B, S/D)``): each group's
    projections recomputed, their weight gradients reduced to the owner."""
    acc = torch.promote_types(x.dtype, torch.float32)
    tokens = x.flatten(0, 1)  # (N, H)
    grad_x = torch.zeros(tokens.shape, dtype=acc, device=x.device)
    tsp_rank, reduces = comm.group_rank(plan.group), ReducesInFlight(plan)
    for j, shard in shard_stream(plan, packed):
        spec = plan.specs[j]
        w, grad_shard = spec.unpack(shard), torch.zeros(spec.numel, dtype=acc, device=x.device)
        if j == tsp_rank:
            own_grad = grad_shard
        into = spec.unpack(grad_shard)
        for name in ("q", "k") if plan.heads.holds_kv(j) else ("q",):
            weight, bias = f"{name}_proj.weight", f"{name}_proj.bias"
            projected = F.linear(tokens, w[weight], w.get(bias)).to(acc)
            grad = (2 * grad_sums[name].reshape(-1, 1).to(acc) * projected).to(x.dtype)  # (N, rows)
            grad_x += (grad @ w[weight]).to(acc)
            precision.partial_matmul(grad.t(), tokens, out=into[weight], add=False)
            if bias in into:
                torch.sum(grad, 0, dtype=acc, out=into[bias])
            # Only the projection's own rows travel: the rest of the shard gets no gradient here.
            start = spec.offsets[weight]
            stop = start + into[weight].numel() + (into[bias].numel() if bias in into else 0)
            reduces.start(grad_shard[start:stop], j)
    reduces.finish()
    return grad_x.view(x.shape).to(x.dtype), own_grad


class _ProjectionSquares(EagerFunction):
    @staticmethod
    @autocast_forward(cast_inputs=True)
    def forward(ctx, x, packed, plan):
        ctx.plan = plan
        ctx.save_for_backward(x, packed)
        return projection_squares_forward(plan, x, packed)

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_q, grad_k):
        x, packed = ctx.saved_tensors
        grads = {"q": grad_q, "k": grad_k}
        grads = {name: torch.zeros(x.shape[:2], device=x.device) if g is None else g for name, g in grads.items()}
        grad_x, grad_packed = projection_squares_backward(ctx.plan, grads, x, packed)
        return grad_x, grad_packed.to(packed.dtype), None


def projection_inv_rms(plan, x, packed):
    """Each local token's inverse RMS of q and of k over the whole projection
    (``{"q", "k"}``, ``(B, S/D)``) as Hugging Face's RMSNorm computes it
    (float32 or wider), from the norms ``plan.q_norm`` and ``plan.k_norm``."""
    sums = _ProjectionSquares.apply(x, packed, plan)
    return {name: torch.rsqrt(total / norm.weight.numel() + norm.variance_epsilon)
            for name, total, norm in zip(("q", "k"), sums, (plan.q_norm, plan.k_norm))}
