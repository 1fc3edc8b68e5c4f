"""``ds_tsp.initialize``: ``deepspeed.initialize`` with the ``tsp`` section honoured."""

import copy
import functools
import os
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import get_communication_data_type
from deepspeed.utils import set_z3_leaf_modules
from transformers import AutoConfig

from ds_tsp.blocks.attention.module import TSPAttention
from ds_tsp.blocks.latent.module import TSPLatentAttention
from ds_tsp.blocks.linear.streamed import StreamedMixer
from ds_tsp.blocks.linear.module import TSPGatedDeltaNet
from ds_tsp.blocks.mlp import TSPGatedMLP
from ds_tsp.blocks.moe.module import TSPSparseMoE
from ds_tsp.blocks.vocab import VocabParallelLMHead
from ds_tsp.checkpoint import from_pretrained
from ds_tsp.checkpoint.resharding import attach_layout_checks
from ds_tsp.checkpoint.universal import describe_for_universal_checkpoints, load_zero3_universal_states
from ds_tsp.config import split_ds_config
from ds_tsp.injection.inject import inject
from ds_tsp.injection.lora import holds_adapters
from ds_tsp.injection.model import num_targets
from ds_tsp.injection.pipeline import build_pipeline, check_pipeline_stages
from ds_tsp.injection.policy import text_config
from ds_tsp.parallel import comm
from ds_tsp.parallel.host_reads import host_read
from ds_tsp.parallel.topology import TSPTopology
from ds_tsp.runtime.expert_parallel import (
    check_expert_parallel_run,
    declare_expert_layers,
    expert_param_groups,
    load_experts_from_their_masters,
)
from ds_tsp.runtime.offload import HOST_CHECKPOINT_REFUSAL, host_checkpoint_function
from ds_tsp.runtime.optimizer import ClientOptimizer
from ds_tsp.runtime.prefetch import PrefetchWhenAffordable
from ds_tsp.runtime.replicated_schedule import schedule_replicated_grads


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               mpu=None, dist_init_required=None, collate_fn=None, config=None, config_params=None, *,
               tsp_topology=None, tsp_adapter=None, **kwargs):
    """``deepspeed.initialize`` with the config's ``tsp`` section honoured: same
    arguments, same ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``model`` is a Hugging Face causal LM, or a checkpoint directory that every
    rank reads shard by shard. With ``tsp.enabled`` this builds the
    ``pp x dp x tsp`` topology, injects TSP into ``model`` and hands DeepSpeed an
    ``mpu`` whose model-parallel group is the TSP group and whose data-parallel
    group is the true replicas, so ZeRO partitions over DP only. With
    ``tsp.pipeline_stages > 1`` the engine is DeepSpeed's ``PipelineEngine``
    over TSP layers: ``train_batch(data_iter)``, batches of
    ``(input_ids, labels)``. Without ``tsp.enabled`` this is
    ``deepspeed.initialize``.

    ``optimizer`` may be a callable, a config section, or an optimizer built on
    the unsharded model that has not stepped yet: that one, like
    ``model_parameters``, is rebuilt over the shards with the same class,
    defaults and parameter groups, matched by Hugging Face name
    (``ClientOptimizer``). ``tsp_topology`` reuses a topology already built,
    as the Trainer does for its data loaders. ``tsp_adapter``: a PEFT
    directory of LoRA adapters read onto the checkpoint directory ``model``,
    each rank reading only its slices.
    """
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None)
    forward = dict(args=args, optimizer=optimizer, model_parameters=model_parameters, training_data=training_data,
                   lr_scheduler=lr_scheduler, dist_init_required=dist_init_required, collate_fn=collate_fn, **kwargs)
    ds_config, tsp_config = split_ds_config(source) if source is not None else (None, None)
    if tsp_config is None or not tsp_config.enabled:
        if tsp_adapter is not None:
            raise ValueError("tsp_adapter reads PEFT adapters onto a TSP model, but the config has no tsp section "
                             "with enabled: true: enable TSP, or load the adapters with PeftModel.from_pretrained")
        return deepspeed.initialize(model=model, mpu=mpu, config=config, config_params=config_params, **forward)

    # 1. Checks first: a run that cannot work fails on every rank alike before a
    #    TSP group is built or a checkpoint is read. The client optimizer is
    #    captured here, while it still names the unsharded parameters.
    client = _check_tsp_run(model, mpu, optimizer, model_parameters, ds_config, tsp_config, tsp_adapter)
    # 2. The TSP groups, then the model on them: each rank keeps only its shards.
    topology = tsp_topology or TSPTopology.of(tsp_config)
    model, replicated_grads = _build_tsp_model(model, topology, ds_config, tsp_config, tsp_adapter)
    # 3. DeepSpeed last: ZeRO partitions the parameters it is given, which must
    #    already be the TSP shards, and TSP's hooks go onto the engine it returns.
    return _build_engine(model, topology, ds_config, tsp_config, client, replicated_grads, forward)


def _check_tsp_run(model, mpu, optimizer, model_parameters, ds_config, tsp_config, tsp_adapter):
    """Check a TSP run from sizes and the config alone. Joins the default
    process group for the world size; builds no TSP group and moves no
    weight. Returns the client optimizer, captured by name."""
    if mpu is not None:
        raise ValueError("ds_tsp.initialize builds the mpu from the tsp section: do not pass mpu= with tsp.enabled")
    if tsp_adapter is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError("tsp_adapter reads a PEFT adapter directory onto the checkpoint directory given as model; "
                        "for a model object, pass PeftModel.from_pretrained(model, ADAPTER_DIR) as model instead")
    client = ClientOptimizer.capture(model, optimizer, model_parameters)
    if client.groups is not None and tsp_config.pipeline_stages > 1:
        raise TypeError("with tsp.pipeline_stages > 1, pass the optimizer as a callable or a config section: "
                        "pipeline stages rename the parameters an optimizer instance or model_parameters hold")
    _check_no_other_model_parallelism(ds_config)
    _check_activation_checkpointing(ds_config, tsp_config)
    check_expert_parallel_run(ds_config, tsp_config)
    # This rank's accelerator is the current device before the first collective: NCCL's object collectives and
    # comm.group_device use it, and DeepSpeed sets it only when it builds its engine, after injection.
    if "LOCAL_RANK" in os.environ:
        get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    # Joins an existing torch.distributed group if there is one.
    deepspeed.init_distributed(timeout=timedelta(minutes=tsp_config.timeout_minutes))
    tsp_config.expert_parallel(dist.get_world_size())
    if tsp_config.pipeline_stages > 1:
        if tsp_adapter is not None or not isinstance(model, (str, os.PathLike)) and holds_adapters(model):
            raise ValueError(f"tsp.pipeline_stages = {tsp_config.pipeline_stages} with PEFT adapters is not "
                             "supported: train LoRA with pipeline_stages 1 (TSP x DP)")
        check_pipeline_stages(model_config(model), tsp_config, ds_config,
                              None if isinstance(model, (str, os.PathLike)) else type(model))
    return client


def _build_tsp_model(model, topology, ds_config, tsp_config, tsp_adapter):
    """The TSP model on ``topology``, read from a checkpoint directory or
    injected into a model object, then cut into pipeline stages or given its
    activation checkpointing. Returns it with its replicated gradients, read
    before a pipeline wraps the model and hides them."""
    if isinstance(model, (str, os.PathLike)):
        # A Hugging Face directory: each rank reads only its own slices.
        model = from_pretrained(model, topology, tsp_config, adapter=tsp_adapter)
        model.train()
    else:
        model = inject(model, topology, tsp_config)
    replicated_grads = model.tsp_replicated_grads
    # Only a communication_data_type the config names: TSP's partial sums go in float32 otherwise.
    set_grad_wire_dtype(model, get_communication_data_type(ds_config))
    if tsp_config.pipeline_stages > 1:
        model = build_pipeline(model, topology, tsp_config, bool(ds_config.get("activation_checkpointing")))
        _no_partitioned_pipe_messages(ds_config)
    else:
        _configure_activation_checkpointing(model, ds_config, topology, tsp_config)
    return model, replicated_grads


def _build_engine(model, topology, ds_config, tsp_config, client, replicated_grads, forward):
    """``deepspeed.initialize`` over the TSP ``model`` with the TSP ``mpu`` and
    the client optimizer rebuilt over the shards, then the engine's TSP hooks."""
    # ZeRO-3 gathers a module's own parameters around its forward and backward.
    # TSP attention's backward also reads its per-head norms, and a block merges
    # its LoRA adapters into its shard: each block is a DeepSpeed leaf module,
    # gathered whole, as DeepSpeed does for MoE.
    set_z3_leaf_modules(model, [TSPAttention, TSPLatentAttention, TSPGatedDeltaNet, StreamedMixer, TSPGatedMLP])
    describe_for_universal_checkpoints(model, topology)
    declare_expert_layers(model)
    optimizer, model_parameters = client.rebuild(model, expert_param_groups)
    forward = dict(forward, optimizer=optimizer, model_parameters=model_parameters)
    ds_config["tsp"] = tsp_config.model_dump()
    if getattr(forward["args"], "deepspeed_config", None) is not None:
        # DeepSpeed refuses a config both in args and as config=; ours is parsed.
        forward["args"] = copy.copy(forward["args"])
        forward["args"].deepspeed_config = None
    # PipelineModule brings its own grid as the mpu, with the TSP group as its model axis.
    mpu = None if tsp_config.pipeline_stages > 1 else topology.mpu()
    engine, *rest = deepspeed.initialize(model=model, mpu=mpu, config=ds_config, **forward)
    engine.tsp_topology = topology
    _refuse_consolidated_state_dicts(engine)
    _refuse_unreducible_gradients(engine)
    attach_layout_checks(engine)
    load_experts_from_their_masters(engine)
    # ZeRO-3 without an optimizer (the Trainer's evaluation before training) loads no optimizer states.
    if engine.zero_optimization_partition_weights() and hasattr(engine.optimizer, "load_hp_checkpoint_state"):
        load_zero3_universal_states(engine.optimizer)
    client.attach(engine)
    if replicated_grads is not None:
        schedule_replicated_grads(engine, replicated_grads)
    return (engine, *rest)


def _refuse_consolidated_state_dicts(engine):
    """DeepSpeed's own 16-bit exports gather each parameter over the data-parallel
    group only, so on a TSP engine they would write every rank's TSP shard under
    one name: ``save_16bit_model`` and the state dicts behind it (accelerate's
    ``get_state_dict`` calls them) name the ds_tsp call instead."""
    def refuse(name):
        def refused(*args, **kwargs):
            raise NotImplementedError(
                f"engine.{name}() would gather only ZeRO's data-parallel partitions of a TSP engine, whose "
                "parameters are TSP shards: call ds_tsp.save_pretrained(engine, DIR), which writes the Hugging Face "
                "model (safetensors, every ZeRO stage, every pipeline stage)")
        return refused

    for name in ("save_16bit_model", "_zero3_consolidated_16bit_state_dict", "_consolidated_16bit_state_dict"):
        setattr(engine, name, refuse(name))


def _refuse_unreducible_gradients(engine):
    """ZeRO-0's reduction (DeepSpeed's ``allreduce_gradients``) asserts on a
    gradient dtype the accelerator does not reduce (float64, on CPU and CUDA
    alike): name the key to change instead, before it runs. ZeRO-1 and up
    reduce through their own buffers, which take them."""
    if engine.zero_optimization() or not hasattr(engine, "allreduce_gradients"):
        return
    supported = tuple(get_accelerator().supported_dtypes())
    reduce = engine.allreduce_gradients

    @functools.wraps(reduce)
    def checked(*args, **kwargs):
        found = sorted({str(p.grad.dtype) for p in engine.module.parameters()
                        if p.grad is not None and p.grad.dtype not in supported})
        if found:
            raise ValueError(f"zero_optimization.stage 0: DeepSpeed's gradient reduction takes "
                             f"{', '.join(map(str, supported))} only, and this model's gradients are "
                             f"{', '.join(found)}: set zero_optimization.stage to 1 (its reduction takes them), "
                             "or train in float32")
        return reduce(*args, **kwargs)

    engine.allreduce_gradients = checked


def set_grad_wire_dtype(model, dtype):
    """The dtype every TSP block of ``model`` sends its parameter-gradient
    partial sums in (the attention's weight-gradient reduces, the MLP, MoE and
    LM-head rings' accumulators; ``precision.gradient_wire_dtype``), added in
    float32 on arrival; None keeps float32 (float64 models keep float64).

    ``initialize`` passes DeepSpeed's ``communication_data_type`` only when the
    config sets it, not DeepSpeed's default for a bf16 model (bf16): those
    partials are per-rank sums over head groups or ring steps, and rounding
    each to bf16 adds up to ``D`` roundings per weight gradient where the
    unsharded model's one matmul rounds once."""
    for module in model.modules():
        if isinstance(module, (TSPAttention, TSPLatentAttention, TSPGatedDeltaNet, StreamedMixer, TSPGatedMLP,
                               TSPSparseMoE, VocabParallelLMHead)):
            module.grad_wire_dtype = dtype


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
    device = comm.group_device(topology.dp_group)  # NCCL's rule: the sum travels on the accelerator
    counts = [num_targets(labels, attention_mask).to(device) for labels, attention_mask in micro_batches]
    total = torch.stack(counts).sum().to(torch.float64).view(1)
    comm.all_reduce(total, topology.dp_group)
    return host_read(total, "num_items_in_batch").item() / (topology.dp_size * engine.gradient_accumulation_steps())


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
    if tsp_config.prefetch_checkpoints is True and not section.get("cpu_checkpointing"):
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
    ``cpu_checkpointing`` by ``ds_tsp.runtime.offload.host_checkpoint``, which keeps
    each layer's input in host memory (and with ``tsp.prefetch_checkpoints``
    brings the next one back early); the recompute re-issues the layer's
    collectives in the same order on every rank."""
    section = ds_config.get("activation_checkpointing")
    if not section:
        return
    model.train()
    if section.get("cpu_checkpointing"):
        config = text_config(model)
        if getattr(config, "num_kv_shared_layers", 0) or getattr(config, "hidden_size_per_layer_input", 0):
            raise ValueError(HOST_CHECKPOINT_REFUSAL)
        prefetch = tsp_config.prefetch_checkpoints
        if prefetch == "auto":
            prefetch = PrefetchWhenAffordable(model.config, topology.tsp_size, tsp_config.vocab_parallel,
                                              planner_run(ds_config, tsp_config))
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=host_checkpoint_function(prefetch))
        return
    deepspeed.checkpointing.configure(topology.mpu(), deepspeed_config=ds_config)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=deepspeed.checkpointing.checkpoint)


def planner_run(ds_config, tsp_config):
    """The planner's description of this run (``ds_tsp.planning.plan``'s keyword
    arguments) beyond the model and the micro-batch: ZeRO's stage and optimizer
    offload, and the ``tsp`` keys the memory model reads."""
    zero = ds_config.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device") == "cpu"
    return {"zero_stage": int(zero.get("stage", 0)), "offload_optimizer": offload,
            "token_tile": tsp_config.token_tile, "fp32_accumulators": tsp_config.fp32_accumulators,
            "recompute_norms": tsp_config.recompute_norms, "logits_tile_mib": tsp_config.logits_tile_mib}


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
