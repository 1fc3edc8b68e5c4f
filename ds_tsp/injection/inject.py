"""``ds_tsp.inject``: rewrite a Hugging Face causal LM into a TSP model, in place."""

import torch

from ds_tsp.blocks.attention.module import TSPAttention
from ds_tsp.blocks.latent.module import TSPLatentAttention, is_latent_attention
from ds_tsp.blocks.linear.mamba2_module import TSPMamba2, is_mamba2
from ds_tsp.blocks.linear.mamba1 import TSPMamba1, is_mamba1
from ds_tsp.blocks.linear.short_conv import TSPShortConv, is_short_conv
from ds_tsp.blocks.linear.module import TSPGatedDeltaNet, is_gated_delta_net
from ds_tsp.blocks.mlp import TSPGatedMLP
from ds_tsp.blocks.moe.module import TSPSparseMoE
from ds_tsp.blocks.moe.plan import hf_sizes
from ds_tsp.blocks.tower import shard_tower
from ds_tsp.blocks.rotary import NO_ROTARY
from ds_tsp.blocks.vocab import VocabParallelEmbedding, VocabParallelLMHead, check_foldable, check_foldable_table
from ds_tsp.injection.consistency import BatchCheck, broadcast_replicated, check_same_model
from ds_tsp.injection.lora import block_adapters, check_adapter_paths, model_reader, shard_adapters, take_adapters
from ds_tsp.injection.model import TSPCausalLMMixin, TSPDecoderLayer
from ds_tsp.injection.multimodal import TSPVisionLanguageMixin
from ds_tsp.injection.policy import (VISION_TOWERS, PolicyError, decoder_path, hf_path, is_recurrent,
                                    load_balancing_loss, resolve_policy, text_config, vision_family)
from ds_tsp.injection.probe import probe_layers
from ds_tsp.parallel import comm
from ds_tsp.parallel.mappings import sum_grads_over_group
from ds_tsp.planning.communication import cheaper_moe_schedule
from ds_tsp.planning.flops import cheaper_latent_form


def inject(model, topology, tsp_config, read=None, device=None, adapter_files=None):
    """Turn ``model`` (e.g. a ``LlamaForCausalLM``) into a TSP model and return it.
    A ``PeftModel`` with a LoRA adapter (or the Hugging Face model inside one)
    becomes the TSP model of its Hugging Face model, its adapters sharded with
    their base weights (``ds_tsp.injection.lora``) and its PEFT config kept as
    ``tsp_peft_config``, for ``ds_tsp.save_pretrained`` to write PEFT's files.
    ``adapter_files`` (``checkpoint.adapters.AdapterFiles``, with ``read``)
    gives the adapters of a PEFT directory instead, the base then frozen.

    ``read(full_name, piece)`` supplies each tensor or this rank's piece of it
    (``piece = (dim, start, length)``, None for whole); by default the model's
    own parameters are sliced. The steps run in this order:

    0. a model DeepSpeed's ``zero.Init`` partitioned is gathered, layer by
       layer as it is sharded (``unpartition``);
    1. resolve the policy and check the config and every layer (and, with
       ``tsp.vocab_parallel``, the embedding and head) fit it, and that every
       rank of the TSP group holds a model of the same tensors, before any
       weight moves; a model accepted by shape only is also probed
       numerically (``ds_tsp.injection.probe``);
    2. replace every decoder layer by a TSP layer holding only this rank's
       shards (the full HF layer is dropped, freeing its weights);
    3. with ``tsp.vocab_parallel``, replace the embedding and the LM head by
       this rank's vocabulary rows (one shard for both when tied);
    4. copy replicated parameters and buffers from TSP rank 0 (a model
       object may differ between ranks in value; files read do not), keep
       1/D of a vision-language model's tower (``ds_tsp.blocks.tower``), and
       make the gradients of what stays whole sum over the TSP group once;
    5. give the model the TSP forward (HF calling convention, full sequence in).

    The TSP blocks are built from a forked random state: the caller's (what
    dropout, sampling and shuffles draw next) is as if nothing was built.

    ``device`` None builds where the model is, unless the model is on the host
    and the TSP group's backend takes no host tensor (NCCL): then on the
    accelerator's current device (``comm.group_device``), shard by shard, and
    the rest of the model follows, before any weight moves between ranks.
    """
    first = next(model.parameters(), None)
    if device is None and (first is None or first.device.type == "cpu"):
        wanted = comm.group_device(topology.tsp_group)
        device = None if wanted.type == "cpu" else wanted
    built_on = torch.device(device if device is not None else first.device if first is not None else "cpu")
    on_host = built_on.type in ("cpu", "meta")
    with torch.random.fork_rng(devices=[] if on_host else [built_on], device_type="cuda" if on_host else built_on.type):
        return _inject(model, topology, tsp_config, read, device, adapter_files)


def _inject(model, topology, tsp_config, read, device, adapter_files):
    model, peft_config, adapters = take_adapters(model)
    if adapter_files is not None:
        peft_config, adapters = adapter_files.config, adapter_files.adapters()
        model.requires_grad_(False)  # as PEFT freezes the base
    policy = resolve_policy(model, tsp_config.policy)
    config, multimodal = text_config(model), decoder_path(model) != "model"
    layers = model.get_submodule(policy.layers)
    check_adapter_paths(adapters, policy, layers)
    if adapter_files is None:
        # The factors travel (TSP rank 0's broadcast) from where the blocks are built.
        adapters = {path: (model_reader(lora_A.to(device or lora_A.device), lora_B.to(device or lora_B.device),
                                        topology.tsp_group), scaling)
                    for path, (lora_A, lora_B, scaling) in adapters.items()}
    partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    if partitioned:  # built under zero.Init: all but the layers now, each layer when it is sharded
        unpartition(model, skip=() if policy.layer_class is None else tuple(layers))
    check_same_model(model, topology.tsp_group)
    check_expert_parallel(layers, policy, topology, tsp_config)
    if tsp_config.vocab_parallel:
        check_foldable(model.get_submodule(policy.embed_tokens), model.get_submodule(policy.lm_head),
                       type(model).__name__)
        if policy.model_inputs(model) is not None:
            check_foldable_table(model.get_submodule(policy.model_inputs(model).embed), type(model).__name__,
                                 "per-layer embedding")
            check_same_vocabulary(model.get_submodule(policy.model_inputs(model).embed),
                                  model.get_submodule(policy.embed_tokens), type(model).__name__)
    if policy.layer_class is None:  # accepted by shape only: its forward must equal the TSP layers' on a probe
        probe_layers(model, policy, topology, tsp_config, tsp_layer, device=device)
    for index, layer in enumerate(layers):
        if partitioned:
            unpartition(layer)
        prefix = f"{policy.layers}.{index}"
        layers[index] = tsp_layer(layer, config, policy, topology, tsp_config,
                                  read=_prefixed(read, prefix), device=device,
                                  adapters=block_adapters(adapters, prefix),
                                  rotary_kind=policy.rotary_kind(config, index) if policy.rotary_kind else None)
    if tsp_config.vocab_parallel:
        fold_vocabulary(model, policy, topology, tsp_config, read=read, device=device)

    if device is not None:
        model.to(device)  # what is not a TSP block: norms, rotary tables, a replicated embedding and head
    if read is None:
        broadcast_replicated(model, topology.tsp_group)
    if multimodal:  # the tower's weights 1/D per rank, as its work is (every rank now holds the same ones)
        model.tsp_vision_family = vision_family(model)
        for path in VISION_TOWERS[model.tsp_vision_family]:
            shard_tower(model, path, topology.tsp_group)
    replicated = [p for p in model.parameters() if not getattr(p, "tensor_model_parallel", False)]
    replicated_grads = sum_grads_over_group(replicated, topology.tsp_group)

    model.tsp_load_balancing = load_balancing_loss(type(model))
    model.__class__ = _tsp_class(type(model), TSPVisionLanguageMixin if multimodal else TSPCausalLMMixin)
    # A forward set on the instance (TRL's fused LM head) would hide the TSP
    # forward that injection puts in front of the model's class.
    vars(model).pop("forward", None)
    model.tsp_replicated_grads = replicated_grads  # ds_tsp.initialize schedules their sum per ZeRO stage
    model.tsp_topology, model.tsp_config, model.tsp_policy = topology, tsp_config, policy
    model.tsp_batch_check = BatchCheck(tsp_config.check_batch, topology.tsp_group)
    model.tsp_peft_config = peft_config
    if adapters:
        # Everything before the first adapter is frozen, so no block input would need
        # a gradient, and ZeRO-3 releases a block's parameters after backward reaches
        # an input that needs none, before its adapters' gradients: as PEFT asks
        # of gradient checkpointing, the embedding's output needs one.
        model.enable_input_require_grads()
    return model


def unpartition(module, skip=()):
    """Turn the parameters DeepSpeed's ``zero.Init`` partitioned (a Hugging Face
    ``from_pretrained`` after ``TrainingArguments(deepspeed=<ZeRO-3 config>)``)
    into whole, plain parameters, in ``module`` but not in the ``skip``
    submodules: gathered once (DeepSpeed's ``GatheredParameters``) and copied,
    each tied parameter to one copy. ZeRO-3 then partitions the TSP shards over
    the data-parallel group only, as it does a model built without ``zero.Init``."""
    import deepspeed

    skipped = {id(p) for sub in skip for p in sub.parameters()}
    owners = [(m, name, p) for m in module.modules() for name, p in m._parameters.items()
              if p is not None and hasattr(p, "ds_id") and id(p) not in skipped]
    if not owners:
        return
    copies = {}
    with deepspeed.zero.GatheredParameters(list({id(p): p for _, _, p in owners}.values())):
        for owner, name, param in owners:
            if id(param) not in copies:
                copies[id(param)] = torch.nn.Parameter(param.data.clone(), requires_grad=param.requires_grad)
            owner._parameters[name] = copies[id(param)]


def tsp_layer(layer, config, policy, topology, tsp_config, read=None, device=None, adapters=None, rotary_kind=None):
    """A ``TSPDecoderLayer`` from one Hugging Face decoder layer (norms kept as
    they are): its token mixer (``tsp_mixer``) and its MLP (``tsp_mlp``), either
    absent in a layer of one block (``DecoderPolicy.single_block``). ``adapters``:
    ``{path in the layer: (read, scaling)}`` (``ds_tsp.injection.lora.shard_adapters``),
    sharded with their blocks; ``rotary_kind``: the rotary tables the layer takes
    (``DecoderPolicy.rotary_kind``)."""
    mixer, mlp = policy.mixer(layer), policy.mlp_of(layer)
    blocks = {}
    side = policy.side_mixer(layer)
    for name in (mixer, side):
        if name is not None:
            blocks[name] = tsp_mixer(layer.get_submodule(name), config, policy, topology, tsp_config,
                                     _prefixed(read, name), device, f"{type(layer).__name__}.{name}")
    if mlp is not None:
        blocks[mlp] = tsp_mlp(layer.get_submodule(mlp), policy, topology, tsp_config, _prefixed(read, mlp), device,
                              f"{type(layer).__name__}.{mlp}")
    for where, block in blocks.items():
        shard_adapters(block, block_adapters(adapters or {}, where))
    beside = policy.beside(layer)
    experts = None if beside is None else experts_beside_mlp(layer, beside, topology, tsp_config, read, device)
    layout = policy.layout_of(layer)
    norms = [name for pair in layout.values() for name in pair if name is not None] + list(beside.norms() if beside
                                                                                           else ())
    inputs = policy.layer_inputs(layer)
    input_modules = {name: layer.get_submodule(name) for name in (*inputs.layer_parts(), inputs.activation)} \
        if inputs else {}
    streams = policy.layer_streams(layer)
    stream_modules = {name: layer.get_submodule(name) for name in streams.layer_parts()} if streams else {}
    return TSPDecoderLayer(blocks.get(mixer), blocks.get(mlp), {name: layer.get_submodule(name) for name in norms},
                           layout, tsp_config.recompute_norms, rotary_kind, mixer, mlp,
                           policy.parallel_blocks, residual_multiplier(config, layer),
                           layer._buffers.get("layer_scalar"), experts, beside, inputs, input_modules,
                           None if side is None else (side, blocks[side]), mixer_multipliers(layer), streams,
                           stream_modules)


# The TSP block of each recurrent mixer ds_tsp builds, by the test that recognises its Hugging Face module.
RECURRENT_BLOCKS = ((is_mamba2, TSPMamba2), (is_mamba1, TSPMamba1), (is_short_conv, TSPShortConv),
                    (is_gated_delta_net, TSPGatedDeltaNet))


def tsp_mixer(attention, config, policy, topology, tsp_config, read, device, where):
    """The TSP block of a Hugging Face token mixer: a recurrent mixer (``ds_tsp.blocks.linear``), a latent
    attention or an attention."""
    options = dict(layout_name=tsp_config.layout, backend=tsp_config.attention_backend, overlap=tsp_config.overlap,
                   token_tile=tsp_config.token_tile, fp32_accumulators=tsp_config.fp32_accumulators, read=read,
                   device=device)
    if is_recurrent(attention):
        recurrent = next(block for is_kind, block in RECURRENT_BLOCKS if is_kind(attention))
        block = recurrent.from_hf(attention, config, topology.tsp_group, **options)
    elif is_latent_attention(attention):
        form = cheaper_latent_form if tsp_config.latent_attention == "auto" else tsp_config.latent_attention
        block = TSPLatentAttention.from_hf(attention, config, topology.tsp_group, form=form, **options)
    else:
        block = TSPAttention.from_hf(attention, config, topology.tsp_group, fused=policy.fused.get(policy.attention),
                                     **options)
        if policy.rotary_emb is None:  # a model without a rotary embedding (NoPE): its attention takes no tables
            block.rope = NO_ROTARY
    layer_class, name = where.split(".", 1)
    keep_frozen(attention, block, layer_class, name)
    return block


def tsp_mlp(mlp, policy, topology, tsp_config, read, device, where):
    """The TSP block of a Hugging Face MLP: a ``TSPSparseMoE`` where the policy says it is sparse, else a
    ``TSPGatedMLP``."""
    sparse = policy.is_sparse(mlp)
    block = (TSPSparseMoE if sparse else TSPGatedMLP).from_hf(
        mlp, topology.tsp_group, overlap=tsp_config.overlap, token_tile=tsp_config.token_tile,
        fp32_accumulators=tsp_config.fp32_accumulators, read=read, device=device,
        **({"schedule": cheaper_moe_schedule if tsp_config.moe_schedule == "auto" else tsp_config.moe_schedule,
            "ep_group": topology.ep_group} if sparse else
           {"fused": policy.fused.get(policy.mlp), "activation": policy.activation}))
    if sparse:
        check_router(block, where)
    layer_class, name = where.split(".", 1)
    keep_frozen(mlp, block, layer_class, name)
    if sparse and block.shared_mlp_name:  # a folded block's shared expert, a TSP MLP of its own
        shared = block.shared_mlp_name
        keep_frozen(mlp.get_submodule(shared), block.get_submodule(shared), layer_class, f"{name}.{shared}")
    return block


def experts_beside_mlp(layer, beside, topology, tsp_config, read=None, device=None):
    """The TSP MoE block of the experts a Hugging Face ``layer`` holds beside its MLP (``ExpertsBesideMLP``):
    its own block (Granite-4.0-H's), or the layer itself, whose router, experts and their input norm are its
    children (Gemma 4's), so the block's tensors keep their names under the layer."""
    hf_block = beside.hf_block(layer)
    block = TSPSparseMoE.from_hf(
        hf_block, topology.tsp_group, overlap=tsp_config.overlap, token_tile=tsp_config.token_tile,
        fp32_accumulators=tsp_config.fp32_accumulators, read=_prefixed(read, beside.block) if beside.block else read,
        device=device, schedule=cheaper_moe_schedule if tsp_config.moe_schedule == "auto" else tsp_config.moe_schedule,
        ep_group=topology.ep_group, input_norm_name=beside.input_norm)
    check_router(block, f"{type(layer).__name__}.{hf_path(beside.block, beside.router)}")
    keep_frozen(hf_block, block, type(layer).__name__, hf_path(beside.block, beside.experts))
    return block


def residual_multiplier(config, layer):
    """What the Hugging Face ``layer``'s forward multiplies each block's output
    by before the residual add: Granite's ``config.residual_multiplier``, or
    the factor the layer holds (MiniCPM3's ``residual_scale``, ``scale_depth /
    sqrt(num_hidden_layers)``); 1.0 for neither. The probe checks it."""
    held = getattr(layer, "residual_scale", None)
    return getattr(config, "residual_multiplier", None) or (held if isinstance(held, float) else None) or 1.0


def mixer_multipliers(layer):
    """``(attention input, attention output, side mixer output)`` factors of a layer running a recurrent mixer
    beside its attention, as Hugging Face's layer holds them (Falcon-H1's); 1.0 where it holds none. The probe
    checks them."""
    return tuple(getattr(layer, name, 1.0) for name in ("attention_in_multiplier", "attn_out_multiplier",
                                                         "ssm_out_multiplier"))


def check_expert_parallel(layers, policy, topology, tsp_config):
    """Refuse, before any weight moves, experts folded past the TSP group
    (``tsp.expert_parallel_size``) that the model's sparse layers cannot take:
    a dense model, experts the size does not divide; and a topology built for
    another expert-parallel size than the config's."""
    expected = tsp_config.expert_parallel_size or tsp_config.size
    if topology.ep_size != expected:
        raise ValueError(f"the topology splits experts over {topology.ep_size} ranks but tsp.expert_parallel_size "
                         f"asks for {expected}: build it with TSPTopology.of(tsp_config)")
    if not tsp_config.folds_experts:
        return
    mlps = [layer.get_submodule(policy.mlp_of(layer)) for layer in layers if policy.mlp_of(layer) is not None]
    sparse = [mlp for mlp in mlps if policy.is_sparse(mlp)]
    sparse += [policy.beside(layer).hf_block(layer) for layer in layers
               if policy.beside(layer) is not None]  # experts beside the MLP (Gemma 4's, Granite-4.0-H's)
    if not sparse:
        tsp_config.check_experts(None)
    for mlp in sparse:
        tsp_config.check_experts(hf_sizes(mlp)[1])


def check_router(block, where):
    """Refuse, at injection, a router that does not return Hugging Face's
    ``(logits, weights, indices)``, or that samples at random in training
    (PhiMoE's sparsemixer draws Gumbel noise): no sharded run reproduces
    another run's draws. Its training-mode outputs on one batch under two seeds
    are compared."""
    router = block.router_module()
    weight = next(router.parameters(), None)
    if weight is None or weight.is_meta:
        return
    tokens = torch.randn(8, block.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens = tokens.to(device=weight.device, dtype=weight.dtype)
    training, outputs = router.training, []
    router.train()
    with torch.no_grad(), torch.random.fork_rng(devices=[] if weight.device.type == "cpu" else [weight.device],
                                                device_type=weight.device.type):
        try:
            block.route(tokens)
        except TypeError as error:
            raise PolicyError(f"{where}.{block.router_name}: {error}") from error
        for seed in (0, 1):
            torch.manual_seed(seed)
            outputs.append(block.run_router(tokens))
    router.train(training)
    if any(not torch.equal(a, b) for a, b in zip(*outputs)):
        # PhiMoE's sparsemixer: with its jitter 0 the Gumbel draw can only pick the top score.
        jitter = {name: value for name, value in vars(router).items()
                  if "jitter" in name and isinstance(value, (int, float)) and value}
        named = ", ".join(f"{name} = {value}" for name, value in jitter.items())
        fix = (f"its {named} makes it sample: set config.router_jitter_noise = 0.0 (and input_jitter_noise) before "
               "ds_tsp, with which it routes as in evaluation, or leave tsp.enabled false") if jitter else \
            "ds_tsp does not support this router"
        raise PolicyError(f"{where}.{block.router_name} ({type(router).__name__}) routes at random in training (two "
                          f"seeds route one batch differently), which no sharded run can reproduce: {fix}")


def keep_frozen(hf_block, tsp_block, layer_class, where):
    """Freeze what was frozen: each TSP parameter is trainable exactly when the
    Hugging Face tensors it holds were. The packed shard holds several, which
    must then agree."""
    # A fused Hugging Face tensor (ds_tsp.blocks.fused) freezes every logical tensor in it.
    buffers = set(tsp_block.replicated_tensors()) - set(tsp_block.replicated_params())
    frozen = {name for name in tsp_block.shard_names() if name not in buffers
              and not hf_block.get_parameter(tsp_block.hf_rows.hf_name(name)).requires_grad}
    if not frozen:
        return
    holders = [(tsp_block.packed, list(tsp_block.spec.shapes))]
    holders += [(param, [name]) for name, param in tsp_block.replicated_params().items()]
    for param, names in holders:
        mixed = {name in frozen for name in names}
        if len(mixed) > 1:
            raise PolicyError(f"{layer_class}.{where}: {sorted(frozen & set(names))} are frozen (requires_grad "
                              f"False) but {sorted(set(names) - frozen)} are not; TSP packs them into one shard, "
                              "which trains all or none: freeze all of them or none before ds_tsp injects the model")
        param.requires_grad_(not mixed.pop())


def check_same_vocabulary(table, embed, model_class):
    """Refuse folding a per-layer embedding of another vocabulary than the main one: DeepSpeed's universal
    checkpoints strip one vocabulary size's padding rows from every folded matrix."""
    if table.num_embeddings != embed.num_embeddings:
        raise PolicyError(f"{model_class} has vocab_size_per_layer_input = {table.num_embeddings} beside vocab_size = "
                          f"{embed.num_embeddings}: ds_tsp folds its per-layer embedding beside the main one only "
                          "over the same vocabulary (DeepSpeed's universal checkpoints record one vocabulary size); "
                          "set tsp.vocab_parallel to false to keep both whole on every rank")


def fold_vocabulary(model, policy, topology, tsp_config, read=None, device=None):
    """Replace the embedding and the LM head by this rank's vocabulary rows
    (``ds_tsp.blocks.vocab``); a tied head shares the embedding's shard."""
    embed, lm_head = model.get_submodule(policy.embed_tokens), model.get_submodule(policy.lm_head)
    folded_embed = VocabParallelEmbedding.from_hf(embed, topology.tsp_group, read=_prefixed(read, policy.embed_tokens),
                                                  device=device)
    inputs = policy.model_inputs(model)
    if inputs is not None:  # the per-layer embedding (Gemma 4's), folded as the main one
        table = model.get_submodule(inputs.embed)
        folded_table = VocabParallelEmbedding.from_hf(table, topology.tsp_group, read=_prefixed(read, inputs.embed),
                                                      device=device)
        folded_table.weight.requires_grad_(table.weight.requires_grad)
        model.set_submodule(inputs.embed, folded_table)
    tied_to = folded_embed if lm_head.weight is embed.weight else None
    folded_head = VocabParallelLMHead.from_hf(lm_head, topology.tsp_group, tsp_config.logits_tile_mib,
                                              tsp_config.overlap, tied_to=tied_to,
                                              read=_prefixed(read, policy.lm_head), device=device)
    folded_embed.weight.requires_grad_(embed.weight.requires_grad)
    folded_head.weight.requires_grad_(lm_head.weight.requires_grad)
    model.set_submodule(policy.embed_tokens, folded_embed)
    model.set_submodule(policy.lm_head, folded_head)


def _prefixed(read, prefix):
    if read is None:
        return None
    return lambda name, piece: read(f"{prefix}.{name}", piece)


_TSP_CLASSES = {}


def _tsp_class(cls, mixin):
    """``TSP<cls>``: the HF class with the TSP forward (``mixin``'s) in front, so
    the model stays an instance of its own class (``isinstance``, ``config``, ...)."""
    if issubclass(cls, TSPCausalLMMixin):
        raise ValueError(f"{cls.__name__} is already a TSP model: inject it once")
    if cls not in _TSP_CLASSES:
        _TSP_CLASSES[cls] = type(f"TSP{cls.__name__}", (mixin, cls), {})
    return _TSP_CLASSES[cls]
