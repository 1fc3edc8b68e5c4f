"""Collectives paired with their autograd transposes (Megatron's mappings style).

Parameters that stay whole on every TSP rank (embeddings, norms, LM head,
unsharded biases) see only the local tokens, so their gradient is the sum over
the TSP group; the loss is the sum of per-rank partial sums.
"""

import functools
from collections import defaultdict

import torch

from ds_tsp.parallel import comm, layout, precision
from ds_tsp.parallel.amp import autocast_backward, autocast_forward
from ds_tsp.parallel.eager import EagerFunction


class _SumOverGroupForward(EagerFunction):
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
    gradients, once per optimizer step: a ``ReplicatedGrads`` over ``params``
    (duplicates dropped), summing in each backward until an engine schedules
    it otherwise; None for a group of size 1, where there is nothing to sum."""
    if comm.group_size(group) == 1:
        return None
    return ReplicatedGrads(params, group)


class ReplicatedGrads:
    """The gradients of the parameters every rank of a TSP group holds whole
    (embedding and LM head when not folded, norms, unsharded biases, Qwen3's
    q/k norms): each rank's covers its own tokens only, so the parameter's
    gradient is their sum over the group. They are summed in float32 or wider
    (``comm.all_reduce_fp32``), in ``wire_dtype(param, grad_dtype)`` on the
    wire (by default the gradient's own dtype), and rounded once.

    When the sum runs depends on who reads the gradient, and so on the engine
    (``ds_tsp.runtime.replicated_schedule`` picks per ZeRO stage):

    * ``every_backward`` (the default, and where ZeRO reduces each
      micro-step's gradient from its own hooks and the accumulated result
      cannot be summed: ZeRO-2 offloaded, or holding different slices on
      different TSP ranks): a hook on each leaf sums the gradient autograd
      has accumulated for it in this backward (tied weights included)
      before it reaches ``.grad``, so ahead of any
      post-accumulation hook (ZeRO's, DDP's), of ``torch.autograd.grad``'s
      answer and of accumulation over micro-steps. One all-reduce per
      parameter per backward, synchronous: whatever reads it next may read it
      at once.
    * ``at_boundary_in_hooks(is_boundary)`` (ZeRO-1 with ``overlap_comm``,
      which reduces the accumulated gradient from its own hook in the
      boundary micro-step's backward): a post-accumulation hook, registered
      here before any engine's, sums the accumulated ``.grad`` in place in
      that backward only. One all-reduce per parameter per optimizer step.
    * ``deferred`` (ZeRO-0, ZeRO-1, pipelines: DeepSpeed reduces after the
      boundary backward; ZeRO-2/3: the accumulated partitions line up across
      TSP ranks): no hook sums; the engine calls ``sum_now`` on the
      accumulated gradients, wherever it keeps them, just before its own
      reduction (ZeRO-2/3: on the partitions, just after it). One all-reduce
      per bucket per optimizer step.

    Every rank runs the same graph and the same schedule, so the all-reduces
    line up. Frozen parameters get the hooks too (they persist through
    ``requires_grad`` changes), so one unfrozen later is still summed.
    """

    EVERY_BACKWARD, AT_BOUNDARY_IN_HOOKS, DEFERRED = "every backward", "at the boundary, in hooks", "deferred"

    def __init__(self, params, group):
        self.group = group
        self.params = list({id(param): param for param in params}.values())
        self.every_backward()
        for param in self.params:
            frozen = not param.requires_grad
            param.requires_grad_(True)
            param.register_hook(functools.partial(self._sum_in_backward, param))
            param.register_post_accumulate_grad_hook(self._sum_accumulated_at_boundary)
            param.requires_grad_(not frozen)

    def every_backward(self, wire_dtype=None):
        self.schedule, self.is_boundary = self.EVERY_BACKWARD, None
        self.wire_dtype = wire_dtype or _own_dtype

    def at_boundary_in_hooks(self, is_boundary, wire_dtype=None):
        self.schedule, self.is_boundary = self.AT_BOUNDARY_IN_HOOKS, is_boundary
        self.wire_dtype = wire_dtype or _own_dtype

    def deferred(self, wire_dtype=None):
        self.schedule, self.is_boundary = self.DEFERRED, None
        self.wire_dtype = wire_dtype or _own_dtype

    def _sum_in_backward(self, param, grad):
        if self.schedule != self.EVERY_BACKWARD:
            return grad
        return self._summed(param, grad)

    def _sum_accumulated_at_boundary(self, param):
        if self.schedule == self.AT_BOUNDARY_IN_HOOKS and self.is_boundary():
            param.grad.copy_(self._summed(param, param.grad))

    def _summed(self, param, grad):
        return comm.all_reduce_fp32(grad.to(self.wire_dtype(param, grad.dtype)), self.group).to(grad.dtype)

    def sum_now(self, grads, bucket_numel):
        """Replace each of ``grads`` (``(param, gradient)`` pairs, in the same
        order on every rank; the gradient wherever the engine accumulates it)
        by its sum over the group, in place. The gradients travel flattened in
        buckets of at most ``bucket_numel`` elements per wire dtype, so the
        messages are the buckets, not the parameters; a gradient of
        ``ALONE_NUMEL`` elements or more (an embedding or LM head kept whole)
        travels alone, summed in place where its dtype is the wire's and the
        sum's, so no copy of it is made. Every bucket is launched before the
        first is waited on."""
        by_wire = defaultdict(list)  # wire dtype -> gradients, in order
        for param, grad in grads:
            by_wire[self.wire_dtype(param, grad.dtype)].append(grad)
        launched = [(bucket, self._launch(bucket, wire))
                    for wire, same_wire in by_wire.items() for bucket in _buckets(same_wire, bucket_numel)]
        for bucket, pending in launched:
            summed = pending.wait()
            if summed is not None:  # else summed in place
                for grad, part in zip(bucket, summed.split([g.numel() for g in bucket])):
                    grad.copy_(part.view_as(grad))

    def _launch(self, bucket, wire):
        """The sum of one bucket in flight; its ``wait()`` gives the flat sum, or
        None where the one gradient was summed in place."""
        (first, *rest) = bucket
        if not rest and first.dtype == wire == precision.accumulation_dtype(wire) and first.is_contiguous():
            return comm.Pending(comm.all_reduce(first, self.group, async_op=True), lambda: None)
        return comm.all_reduce_fp32(torch.cat([g.reshape(-1).to(wire) for g in bucket]), self.group, async_op=True)


# A replicated gradient this large goes in a message of its own (summed in place).
ALONE_NUMEL = 1 << 20


def _buckets(tensors, bucket_numel):
    """Runs of consecutive ``tensors`` of at most ``bucket_numel`` elements in
    all (a larger tensor alone), filled as DeepSpeed fills its reduce buckets;
    a tensor of ``ALONE_NUMEL`` elements or more is a bucket of its own."""
    buckets, numel = [], 0
    for tensor in tensors:
        alone = tensor.numel() >= ALONE_NUMEL
        if alone or not buckets or numel + tensor.numel() > bucket_numel:
            buckets.append([])
            numel = 0
        buckets[-1].append(tensor)
        numel = bucket_numel if alone else numel + tensor.numel()  # nothing joins a tensor that goes alone
    return buckets


def _own_dtype(param, grad_dtype):
    return grad_dtype


class _GatherRows(EagerFunction):
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


class _GatherTokens(EagerFunction):
    @staticmethod
    def forward(ctx, local, num_padding, group, layout_name):
        ctx.num_padding, ctx.group, ctx.layout_name = num_padding, group, layout_name
        return gather_sequence(local, num_padding, group, layout_name)

    @staticmethod
    def backward(ctx, grad):
        padded, _ = layout.pad_to_multiple(grad, comm.group_size(ctx.group), 0)
        return layout.shard(padded, comm.group_rank(ctx.group), comm.group_size(ctx.group), ctx.layout_name), \
            None, None, None


def gather_tokens(local, num_padding, group, layout_name):
    """``gather_sequence`` with a gradient, for values every rank of the group
    then uses alike (the same loss on every rank): backward hands each rank
    its own tokens' part of the gradient, as ``sum_over_group`` does."""
    return _GatherTokens.apply(local, num_padding, group, layout_name)


@torch.no_grad()
def gather_sequence(local, num_padding, group, layout_name):
    """Evaluation (no gradient): every rank's local tokens ``(B, S/D, ...)``
    all-gathered into the whole sequence ``(B, S, ...)`` in natural order, the
    padding TSP appended dropped."""
    gathered, _ = comm.all_gather(local.contiguous(), group)
    return layout.unpad(layout.unshard(gathered, comm.group_size(group), layout_name), num_padding)


class _ExchangeRows(EagerFunction):
    @staticmethod
    @autocast_forward(cast_inputs=False)
    def forward(ctx, rows, send_counts, recv_counts, group):
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        return comm.all_to_all_rows(rows, send_counts, recv_counts, group)

    @staticmethod
    @autocast_backward
    def backward(ctx, grad):
        return comm.all_to_all_rows(grad, ctx.recv_counts, ctx.send_counts, ctx.group), None, None, None


def exchange_rows(rows, send_counts, recv_counts, group):
    """Forward: the uneven all-to-all of ``rows`` (``comm.all_to_all_rows``:
    ``send_counts[j]`` rows to group rank ``j``, ``recv_counts[j]`` from it).
    Backward: the reverse all-to-all, each row's gradient back to its sender."""
    if comm.group_size(group) == 1:
        return rows
    return _ExchangeRows.apply(rows, list(send_counts), list(recv_counts), group)
