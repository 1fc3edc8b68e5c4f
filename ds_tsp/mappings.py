"""Collectives paired with their autograd transposes (Megatron's mappings style).

Parameters that stay whole on every TSP rank (embeddings, norms, LM head,
unsharded biases) see only the local tokens, so their gradient is the sum over
the TSP group; the loss is the sum of per-rank partial sums.
"""

import torch

from . import comm
from .amp import autocast_backward, autocast_forward


class _SumOverGroupForward(torch.autograd.Function):
    @staticmethod
    @autocast_forward(cast_inputs=False)
    def forward(ctx, tensor, group):
        return comm.all_reduce_fp32(tensor, group)

    @staticmethod
    @autocast_backward
    def backward(ctx, grad):
        return grad, None


def sum_over_group(tensor, group):
    """Forward: all-reduce (sum, in float32 or wider) over ``group``. Backward:
    identity, since each rank's summand depends on its own tokens only."""
    if comm.group_size(group) == 1:
        return tensor
    return _SumOverGroupForward.apply(tensor, group)


def sum_grads_over_group(params, group):
    """Make every parameter's gradient the sum over ``group`` of the per-rank
    gradients, exactly once per backward.

    A hook on the leaf runs on the gradient autograd has accumulated for it
    (tied weights included) before it reaches ``.grad``, so it runs ahead of
    ZeRO's post-accumulation hooks and of gradient accumulation across
    micro-steps. Every rank runs the same graph, so the all-reduces line up.
    bf16 gradients travel in bf16 and are summed in float32, rounded once.
    Frozen parameters get the hook too (it persists through ``requires_grad``
    changes), so one unfrozen later is still summed.
    """
    if comm.group_size(group) == 1:
        return

    def hook(grad):
        return comm.all_reduce_fp32(grad, group)

    seen = set()
    for param in params:
        if id(param) not in seen:
            seen.add(id(param))
            frozen = not param.requires_grad
            param.requires_grad_(True)
            param.register_hook(hook)
            param.requires_grad_(not frozen)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    @autocast_forward(cast_inputs=False)
    def forward(ctx, shard, group):
        ctx.group = group
        gathered, _ = comm.all_gather(shard, group)  # (D, *shard.shape)
        return gathered.flatten(0, 1)

    @staticmethod
    @autocast_backward
    def backward(ctx, grad):
        stacked = grad.reshape(comm.group_size(ctx.group), -1, *grad.shape[1:])
        return comm.reduce_scatter_fp32(stacked, ctx.group).to(grad.dtype), None


def gather_rows(shard, group):
    """Forward: all-gather every rank's ``shard`` along dim 0 (group-rank order).
    Backward: reduce-scatter (summed in float32 or wider), so each rank gets the
    sum over the group of the gradient of its own rows."""
    if comm.group_size(group) == 1:
        return shard
    return _GatherRows.apply(shard, group)
