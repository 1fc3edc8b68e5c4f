"""When the gradients every TSP rank holds whole are summed over the TSP
group, given how DeepSpeed's engine and ZeRO stage reduce and accumulate
gradients (``schedule_replicated_grads``)."""

import functools

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

from ds_tsp.parallel import comm


def schedule_replicated_grads(engine, replicated_grads):
    """Sum the gradients of what every TSP rank holds whole (a
    ``ds_tsp.parallel.mappings.ReplicatedGrads``) where DeepSpeed's own gradient
    reduction over the data-parallel group lets it happen least often.

    * ZeRO-0 and ZeRO-1 (and pipelines, which run only those) accumulate the
      micro-steps' gradients where they live (``.grad``, ZeRO-1's fp32
      ``grad_accum``, the bf16 optimizer's fp32 buffers) and reduce them after
      the boundary micro-step's backward (``allreduce_gradients``; the
      pipeline's ``_bf16_reduce_grads``; at the end of a
      ``coalesce_grad_reduction()`` block, its flush). The sum is deferred to
      just before that: once per optimizer step, bucketed.
    * ZeRO-3 reduces every micro-step's gradient from its hooks and
      accumulates the reduced partitions: every TSP rank partitions a
      replicated parameter alike over the data-parallel group, so the
      accumulated partitions are summed just after the boundary's reduction
      epilogue, once per optimizer step, bucketed (``_sum_partitions_after``).
    * ZeRO-2 does the same into slices of flat data-parallel partitions. Each
      rank's slice of a replicated parameter (its ``_hp_mapping`` fragment)
      depends on the layout of everything the rank holds; where every rank's
      slices are the same as its TSP peers' (checked once, over the world),
      the slices are summed after the boundary reduction like ZeRO-3's
      partitions (``_sum_fragments_after``). Not with
      ``round_robin_gradients``, whose partitions DeepSpeed's fragments do not
      follow.
    * ZeRO-1 with ``overlap_comm`` reduces the accumulated gradients from its
      own post-accumulation hooks in the boundary backward: the sum runs in
      ours, which come first, in that backward only (per parameter, as the
      next hook reads each gradient at once), outside ``no_sync()`` and
      ``coalesce_grad_reduction()``, and before the latter's flush.
    * ZeRO-2 whose slices differ across TSP ranks (uneven shards, e.g.
      ``num_key_value_heads < tsp.size``), are round-robin or are offloaded
      (its reduction hooks take each gradient's norm and host copy at once),
      ZeRO-3's SuperOffload (which steps from its hooks) or NVMe optimizer
      offload (where reading one partition swaps its whole sub-group in and
      out), and ZeRO-1 moving gradients into a wider ``grad_accum`` under
      ``overlap_comm`` in the same hook: there each micro-step's gradient is
      summed before it reaches ``.grad``, as without an engine.

    On the wire the gradients take the dtype DeepSpeed reduces them in over
    data parallelism (``_wire_dtype``).
    """
    optimizer = engine.optimizer
    wire_dtype = functools.partial(_wire_dtype, engine)
    # No optimizer: ZeRO-3 holds a DeepSpeedZeRoOffload then (the Trainer's evaluation before training).
    if (optimizer is None or isinstance(optimizer, DeepSpeedZeRoOffload) or getattr(engine, "zenflow", False)
            or _steps_in_backward(engine)):
        replicated_grads.every_backward(wire_dtype)
    elif engine.zero_optimization_partition_weights() and not optimizer.swap_optimizer:
        replicated_grads.deferred(wire_dtype)
        _sum_partitions_after(engine, replicated_grads)
    elif engine.zero_optimization_partition_gradients() and _fragments_line_up(engine, replicated_grads.params):
        replicated_grads.deferred(wire_dtype)
        _sum_fragments_after(engine, replicated_grads)
    elif engine.zero_optimization_partition_gradients():  # ZeRO-3 swapping its optimizer to NVMe too
        replicated_grads.every_backward(wire_dtype)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer.overlap_comm:
        if optimizer.use_grad_accum_attribute:
            replicated_grads.every_backward(wire_dtype)
        else:
            replicated_grads.at_boundary_in_hooks(functools.partial(_reduces_in_this_backward, engine), wire_dtype)
            _sum_before_reduction(engine, replicated_grads, names=(COALESCED_REDUCTION,))
    else:
        replicated_grads.deferred(wire_dtype)
        _sum_before_reduction(engine, replicated_grads)


# The engine's reductions of ZeRO 0-1 and pipelines, after the boundary backward; the last reduces what
# ``engine.coalesce_grad_reduction()`` held back, at the end of that block.
BOUNDARY_REDUCTIONS = ("allreduce_gradients", "_bf16_reduce_grads", "_flush_coalesced_reduction_zero12")
COALESCED_REDUCTION = BOUNDARY_REDUCTIONS[-1]


def _steps_in_backward(engine):
    """ZeRO-3's SuperOffload starts the host optimizer's step on each finished
    sub-group from its reduction hooks, before any boundary sum could run."""
    return getattr(engine, "super_offload", lambda: False)()


def _reduces_in_this_backward(engine):
    """The engine reduces gradients at the end of this backward: a boundary
    micro-step outside ``no_sync()`` and ``coalesce_grad_reduction()`` (which
    hold reduction back, also at a counted boundary)."""
    return engine.is_gradient_accumulation_boundary() and not engine.inside_no_sync_ctxt


def _sum_before_reduction(engine, replicated_grads, names=BOUNDARY_REDUCTIONS):
    """Wrap the engine's boundary reductions ``names`` so that the replicated
    gradients are summed over the TSP group first, once per optimizer step."""
    grad_of = _accumulated_gradient(engine.optimizer)
    held = {id(param) for param in engine.module.parameters()}  # a pipeline stage holds some only
    params = [p for p in replicated_grads.params if id(p) in held]

    def sum_accumulated():
        grads = [(param, grad_of(param)) for param in params if param.requires_grad]
        replicated_grads.sum_now([(param, grad) for param, grad in grads if grad is not None],
                                 engine.zero_reduce_bucket_size())

    once = _once_per_boundary(engine, sum_accumulated)  # shared: the second reduction in a step must not sum
    for name in names:
        if hasattr(engine, name):
            _wrap(engine, name, before=once)


def _sum_partitions_after(engine, replicated_grads):
    """ZeRO-3: after the boundary's reduction
    (``_after_each_boundary_reduction``), sum each replicated parameter's
    accumulated gradient partition over the TSP group, once per optimizer
    step. Read and written through DeepSpeed's local-gradient API, which finds
    the partition in device or host memory and, under offload, refreshes the
    norm ZeRO keeps for it."""
    params = replicated_grads.params

    def sum_partitions():
        grads = [(param, safe_get_local_grad(param)) for param in params if param.requires_grad]
        replicated_grads.sum_now(grads, engine.zero_reduce_bucket_size())
        for param, grad in grads:
            safe_set_local_grad(param, grad)

    _after_each_boundary_reduction(engine, _once_per_boundary(engine, sum_partitions))


def _after_each_boundary_reduction(engine, once):
    """Run ``once`` after ZeRO-2/3's reduction epilogue (at the end of each
    backward, and of a ``coalesce_grad_reduction()`` block; the boundary's is
    the one where it acts) and after ``step()`` finalizes the accumulated
    gradients under ``managed_gradient_accumulation: false``."""
    _wrap(engine.optimizer, "independent_gradient_partition_epilogue", after=once)
    if hasattr(engine.optimizer, "finalize_gradient_accumulation_boundary"):
        _wrap(engine.optimizer, "finalize_gradient_accumulation_boundary", after=once)


def _fragments_line_up(engine, params):
    """ZeRO-2 without offload: every rank holds the same slice of each
    replicated parameter as its TSP peers (one gather over the TSP group, one
    over the world, so that every rank picks the same schedule: a replica that
    summed before the data-parallel mean would mix summed and unsummed
    gradients in it)."""
    optimizer = engine.optimizer
    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.cpu_offload or optimizer.round_robin_gradients:
        return False  # round-robin partitions: the fragments DeepSpeed links follow the groups' original order
    trained = [param for param in params if param.requires_grad]
    held = [_fragment_address(param) for param in trained]
    linked = all(hasattr(param, "_hp_mapping") for param in trained)  # else no slice is known, and none summed
    mine = linked and all(peer == held for peer in comm.all_gather_objects(held, engine.tsp_topology.tsp_group))
    return all(comm.all_gather_objects(mine, None))


def _fragment_address(param):
    """``(start, numel)`` of the slice of ``param`` in this rank's ZeRO-1/2
    partition; ``(0, 0)`` if none."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return 0, 0
    return mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel


def _sum_fragments_after(engine, replicated_grads):
    """ZeRO-2 whose slices line up (``_fragments_line_up``): after the
    boundary's reduction (``_after_each_boundary_reduction``), sum each
    replicated parameter's accumulated gradient slice over the TSP group in
    place, where ZeRO's step reads it (what ``param.set_full_hp_grad``
    writes), once per optimizer step."""
    params = [param for param in replicated_grads.params if param.requires_grad and _fragment_address(param)[1]]

    def sum_fragments():
        grads = [(param, param._hp_mapping.get_lp_grad_fragment(param._index_in_param_group)) for param in params]
        replicated_grads.sum_now(grads, engine.zero_reduce_bucket_size())

    _after_each_boundary_reduction(engine, _once_per_boundary(engine, sum_fragments))


def _once_per_boundary(engine, action):
    """``action`` as a call that runs it at a gradient-accumulation boundary,
    at most once per step, however many reduction calls that step makes."""
    done_at = []

    def run_once():
        step = (engine.global_steps, engine.micro_steps)
        if engine.is_gradient_accumulation_boundary() and done_at != [step]:
            done_at[:] = [step]
            action()

    return run_once


def _wrap(owner, name, before=None, after=None):
    """Replace ``owner``'s method ``name`` by one that calls ``before()``, the
    method, then ``after()``."""
    method = getattr(owner, name)

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        if before is not None:
            before()
        result = method(*args, **kwargs)
        if after is not None:
            after()
        return result

    setattr(owner, name, wrapped)


def _accumulated_gradient(optimizer):
    """``param -> the tensor its micro-steps' gradients accumulate in``, where
    the optimizer reduces it from (None before any backward)."""
    if isinstance(optimizer, BF16_Optimizer):  # fp32 buffers, filled after each backward
        buffers = {id(lp): hp for lps, hps in zip(optimizer.bf16_groups, optimizer.fp32_groups_gradients)
                   for lp, hp in zip(lps, hps)}
        return lambda param: buffers.get(id(param))
    if isinstance(optimizer, DeepSpeedZeroOptimizer):  # .grad, or a wider grad_accum
        return optimizer.get_param_gradient_attribute
    return lambda param: param.grad


def _wire_dtype(engine, param, grad_dtype):
    """The dtype DeepSpeed reduces ``param``'s gradient in over data
    parallelism: ``communication_data_type`` if set, else the fp16/bf16
    model's dtype, else float32 (ZeRO's per-parameter choice under its
    ``torch_autocast``). Float64 gradients stay float64 where DeepSpeed would
    fall back to float32: a float64 model is run for its precision."""
    optimizer = engine.optimizer
    if isinstance(optimizer, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
        wire = optimizer.get_param_comm_dtype(param)
    else:  # the engine's own all-reduce (ZeRO-0, the bf16 optimizer)
        wire = engine.communication_data_type
    return grad_dtype if wire == torch.float32 and grad_dtype == torch.float64 else wire
