"""``ds_tsp.initialize``: ``deepspeed.initialize`` with the ``tsp`` section honoured."""

import copy
import functools
import os
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.config import get_communication_data_type
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import safe_get_local_grad, safe_set_local_grad, set_z3_leaf_modules
from transformers import AutoConfig

from . import comm
from .attention import TSPAttention
from .checkpoint import from_pretrained
from .config import split_ds_config
from .inject import inject
from .mlp import TSPGatedMLP
from .model import num_targets
from .moe import TSPSparseMoE
from .offload import host_checkpoint_function
from .optimizer import ClientOptimizer
from .pipeline import build_pipeline, check_pipeline_stages
from .topology import TSPTopology
from .vocab import VocabParallelLMHead


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               mpu=None, dist_init_required=None, collate_fn=None, config=None, config_params=None, *,
               tsp_topology=None, **kwargs):
    """Same arguments and return tuple as ``deepspeed.initialize``:
    ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``model`` is a Hugging Face causal LM, or the path of a Hugging Face
    checkpoint directory, which every rank then reads shard by shard.
    The DeepSpeed config (dict, JSON/hjson path, or ``args.deepspeed_config``)
    may carry a ``tsp`` section. With ``tsp.enabled`` this builds the
    ``pp x dp x tsp`` topology, injects TSP into ``model`` and hands DeepSpeed
    an ``mpu`` whose model-parallel group is the TSP group and whose
    data-parallel group is the true replicas, so ZeRO partitions over DP only.
    With ``tsp.pipeline_stages > 1`` the model becomes a ``PipelineModule`` of
    TSP layers and the engine is DeepSpeed's ``PipelineEngine``
    (``train_batch(data_iter)``, batches of ``(input_ids, labels)``).
    Without it (or with ``enabled: false``) this is exactly ``deepspeed.initialize``.

    The optimizer may be a callable (``lambda params: torch.optim.AdamW(params)``),
    a config section, or, as for ``deepspeed.initialize``, an optimizer built
    on the unsharded model (no step taken yet): it is rebuilt with the same
    class and defaults over the sharded parameters, each in the parameter
    group of the Hugging Face tensors it holds (``model_parameters``, tensors
    or groups of the unsharded model, are mapped the same way). A packed shard
    holding tensors of groups that differ only in ``weight_decay`` (a bias next
    to its weight, under AdamW) joins the group without decay and the others'
    decay is applied to its elements alone (``ClientOptimizer``).
    ``tsp_topology`` reuses a topology already built (the Trainer builds it
    for its data loaders).
    """
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None)
    forward = dict(args=args, optimizer=optimizer, model_parameters=model_parameters, training_data=training_data,
                   lr_scheduler=lr_scheduler, dist_init_required=dist_init_required, collate_fn=collate_fn, **kwargs)
    plain = dict(model=model, mpu=mpu, config=config, config_params=config_params, **forward)
    if source is None:
        return deepspeed.initialize(**plain)
    ds_config, tsp_config = split_ds_config(source)
    if not tsp_config.enabled:
        return deepspeed.initialize(**plain)
    if mpu is not None:
        raise ValueError("ds_tsp.initialize builds the mpu from the tsp section: do not pass mpu= with tsp.enabled")

    # Every check that needs only sizes runs before any weight is touched.
    client = ClientOptimizer.capture(model, optimizer, model_parameters)
    if client.groups is not None and tsp_config.pipeline_stages > 1:
        raise TypeError("with tsp.pipeline_stages > 1, pass the optimizer as a callable or a config section: "
                        "pipeline stages rename the parameters an optimizer instance or model_parameters hold")
    _check_no_other_model_parallelism(ds_config)
    _check_activation_checkpointing(ds_config, tsp_config)
    # Joins an existing torch.distributed group if there is one.
    deepspeed.init_distributed(timeout=timedelta(minutes=tsp_config.timeout_minutes))
    tsp_config.check_world(dist.get_world_size())
    if tsp_config.pipeline_stages > 1:
        check_pipeline_stages(model_config(model), tsp_config, ds_config)
    topology = tsp_topology or TSPTopology(tsp_config.size, tsp_config.pipeline_stages, tsp_config.timeout_minutes)
    if isinstance(model, (str, os.PathLike)):
        # A Hugging Face directory: each rank reads only its own slices.
        model = from_pretrained(model, topology, tsp_config)
        model.train()
    else:
        model = inject(model, topology, tsp_config)
    replicated_grads = model.tsp_replicated_grads
    # Only a communication_data_type the config names: TSP's partial sums go in float32 otherwise.
    set_grad_wire_dtype(model, get_communication_data_type(ds_config))
    if tsp_config.pipeline_stages > 1:
        # PipelineModule brings its own grid as the mpu, with the TSP group as its model axis.
        model = build_pipeline(model, topology, tsp_config, bool(ds_config.get("activation_checkpointing")))
        mpu_for_deepspeed = None
        _no_partitioned_pipe_messages(ds_config)
    else:
        _configure_activation_checkpointing(model, ds_config, topology, tsp_config)
        mpu_for_deepspeed = topology.mpu()
    # ZeRO-3 gathers a module's own parameters around its forward and backward;
    # TSP attention also uses its per-head norms inside its backward, so all of
    # its parameters are gathered together (DeepSpeed's leaf modules, as for MoE).
    set_z3_leaf_modules(model, [TSPAttention])
    forward["optimizer"], forward["model_parameters"] = client.rebuild(model)
    if client.masks and (ds_config.get("zero_optimization") or {}).get("stage", 0) == 3:
        raise ValueError("a packed TSP shard holds tensors with and without weight decay (e.g. q/k/v biases next to "
                         "their weights), which is applied per element to the optimizer's float32 partitions of "
                         "ZeRO 0-2 only: use zero_optimization.stage <= 2, or give every tensor the same decay")
    ds_config["tsp"] = tsp_config.model_dump()
    if getattr(args, "deepspeed_config", None) is not None:
        # DeepSpeed refuses a config both in args and as config=; ours is parsed.
        forward["args"] = copy.copy(args)
        forward["args"].deepspeed_config = None
    engine, *rest = deepspeed.initialize(model=model, mpu=mpu_for_deepspeed, config=ds_config, **forward)
    engine.tsp_topology = topology
    client.attach(engine)
    if replicated_grads is not None:
        schedule_replicated_grads(engine, replicated_grads)
    return (engine, *rest)


def set_grad_wire_dtype(model, dtype):
    """The dtype every TSP block of ``model`` sends its parameter-gradient
    partial sums in (the attention's weight-gradient reduces, the MLP, MoE and
    LM-head rings' accumulators; ``comm.gradient_wire_dtype``), added in
    float32 on arrival; None keeps float32 (float64 models keep float64).

    ``initialize`` passes DeepSpeed's ``communication_data_type`` only when the
    config sets it, not DeepSpeed's default for a bf16 model (bf16): those
    partials are per-rank sums over head groups or ring steps, and rounding
    each to bf16 adds up to ``D`` roundings per weight gradient where the
    unsharded model's one matmul rounds once."""
    for module in model.modules():
        if isinstance(module, (TSPAttention, TSPGatedMLP, TSPSparseMoE, VocabParallelLMHead)):
            module.grad_wire_dtype = dtype


def schedule_replicated_grads(engine, replicated_grads):
    """Sum the gradients of what every TSP rank holds whole (a
    ``ds_tsp.mappings.ReplicatedGrads``) where DeepSpeed's own gradient
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
      ZeRO-3's SuperOffload (which steps from its hooks) and ZeRO-1 moving
      gradients into a wider ``grad_accum`` under ``overlap_comm`` in the same
      hook: there each micro-step's gradient is summed before it reaches
      ``.grad``, as without an engine.

    On the wire the gradients take the dtype DeepSpeed reduces them in over
    data parallelism (``_wire_dtype``).
    """
    optimizer = engine.optimizer
    wire_dtype = functools.partial(_wire_dtype, engine)
    if optimizer is None or getattr(engine, "zenflow", False) or _steps_in_backward(engine):
        replicated_grads.every_backward(wire_dtype)
    elif engine.zero_optimization_partition_weights():
        replicated_grads.deferred(wire_dtype)
        _sum_partitions_after(engine, replicated_grads)
    elif engine.zero_optimization_partition_gradients() and _fragments_line_up(engine, replicated_grads.params):
        replicated_grads.deferred(wire_dtype)
        _sum_fragments_after(engine, replicated_grads)
    elif engine.zero_optimization_partition_gradients():
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
    """ZeRO-3: after the boundary backward's reduction (or, under
    ``managed_gradient_accumulation: false``, after ``step()`` finalizes the
    accumulated partitions), sum each replicated parameter's accumulated
    gradient partition over the TSP group, once per optimizer step. Read and
    written through DeepSpeed's local-gradient API, which finds the partition
    in device memory, host memory or NVMe and, under offload, refreshes the
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
    boundary backward's reduction (or in ``step()`` under
    ``managed_gradient_accumulation: false``), sum each replicated parameter's
    accumulated gradient slice over the TSP group in place, where ZeRO's step
    reads it (what ``param.set_full_hp_grad`` writes), once per optimizer step."""
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


def num_items_in_batch(engine, micro_batches):
    """The ``num_items_in_batch`` to pass with every micro-batch of one optimizer
    step so that the step's gradient is that of the mean loss over every target
    token of the global batch, however unevenly padding spreads them.

    Without it each micro-batch's loss is the mean over its own targets, and
    the engine averages those means over the accumulation steps and the
    data-parallel replicas: a mean of means. ``micro_batches`` are this rank's
    ``(labels, attention_mask or None)`` of the step's accumulation window. The
    result is ``N / (dp_size * gradient_accumulation_steps)``, with ``N`` the
    targets of all replicas' windows (one all-reduce over the data-parallel
    group), because the engine still divides by both; the step's losses then
    average, over the window and the replicas, to the global mean.
    """
    topology = engine.tsp_topology
    local = sum(num_targets(labels, attention_mask) for labels, attention_mask in micro_batches)
    total = torch.tensor([float(local)], dtype=torch.float64)
    comm.all_reduce(total, topology.dp_group)
    return total.item() / (topology.dp_size * engine.gradient_accumulation_steps())


def model_config(model):
    """The Hugging Face config of a model object or checkpoint directory (no weights read)."""
    if isinstance(model, (str, os.PathLike)):
        return AutoConfig.from_pretrained(model)
    return model.config


def _check_activation_checkpointing(ds_config, tsp_config):
    section = ds_config.get("activation_checkpointing") or {}
    if section.get("partition_activations"):
        raise ValueError("activation_checkpointing.partition_activations = true splits checkpointed activations over "
                         "the model-parallel group, which here is the TSP group whose activations are already split "
                         "by token: set it to false (cpu_checkpointing alone still moves checkpoints to host memory)")
    if tsp_config.prefetch_checkpoints and not section.get("cpu_checkpointing"):
        raise ValueError("tsp.prefetch_checkpoints = true brings checkpoints back from host memory early, but "
                         "activation_checkpointing.cpu_checkpointing is not set: set it to true, or set "
                         "tsp.prefetch_checkpoints to false")
    if section.get("cpu_checkpointing") and tsp_config.pipeline_stages > 1:
        raise ValueError("activation_checkpointing.cpu_checkpointing = true is not supported with "
                         f"tsp.pipeline_stages = {tsp_config.pipeline_stages}: pipeline stages checkpoint with "
                         "DeepSpeed's own function, which offloads only together with partition_activations; set "
                         "cpu_checkpointing to false, or use tsp.pipeline_stages = 1")


def _configure_activation_checkpointing(model, ds_config, topology, tsp_config):
    """With an ``activation_checkpointing`` section, every TSP layer is
    recomputed in backward by ``deepspeed.checkpointing.checkpoint``, or with
    ``cpu_checkpointing`` by ``ds_tsp.offload.host_checkpoint``, which keeps
    each layer's input in host memory (and with ``tsp.prefetch_checkpoints``
    brings the next one back early); the recompute re-issues the layer's
    collectives in the same order on every rank."""
    section = ds_config.get("activation_checkpointing")
    if not section:
        return
    model.train()
    if section.get("cpu_checkpointing"):
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=host_checkpoint_function(
            tsp_config.prefetch_checkpoints))
        return
    deepspeed.checkpointing.configure(topology.mpu(), deepspeed_config=ds_config)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=deepspeed.checkpointing.checkpoint)


def _no_partitioned_pipe_messages(ds_config):
    """DeepSpeed splits inter-stage messages over the model-parallel group by
    default, assuming tensor-parallel ranks hold the same activations; TSP ranks
    hold different tokens, so each sends its whole shard."""
    pipeline = ds_config.setdefault("pipeline", {})
    for key in ("pipe_partitioned", "grad_partitioned"):
        if pipeline.get(key):
            raise ValueError(f"pipeline.{key} = true assumes activations replicated over the model-parallel group; "
                             f"TSP ranks hold different tokens: set pipeline.{key} to false or leave it out")
        pipeline[key] = False


def _check_no_other_model_parallelism(ds_config):
    """TSP already shards the sequence and the weights over the TSP group; DeepSpeed's
    own Ulysses or AutoTP on top would shard them again over the same ranks."""
    sp_size = ds_config.get("sequence_parallel_size", 1)
    if sp_size != 1:
        raise ValueError(f"sequence_parallel_size = {sp_size} turns on DeepSpeed-Ulysses, but TSP already shards the "
                         "sequence over the TSP group: remove sequence_parallel_size (or set it to 1), or set "
                         "tsp.enabled to false to use Ulysses instead")
    autotp_size = (ds_config.get("tensor_parallel") or {}).get("autotp_size", 0)
    if autotp_size not in (0, 1):
        raise ValueError(f"tensor_parallel.autotp_size = {autotp_size} turns on DeepSpeed AutoTP, but TSP already "
                         "shards the weights over the TSP group: remove the tensor_parallel section (or set "
                         "autotp_size to 1), or set tsp.enabled to false to use AutoTP instead")
