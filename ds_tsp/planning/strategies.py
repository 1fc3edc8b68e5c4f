"""The planner's entry points: ``plan`` (every strategy on ``N`` devices),
``plan_autotp`` (DeepSpeed AutoTP's training layout), ``plan_alst`` (ALST's
Ulysses + ZeRO-3 with its offloads and tiles, DESIGN.md 9) and ``recommend``
(the plans that fit a device, best first). Each takes a model and the run's
sizes, checks them into a ``Setting`` (``make_setting``) and hands it to the
plans that cost it: ``tsp_plan.plan_tsp`` and ``baselines.plan_baseline``.
"""

from dataclasses import replace

from ds_tsp.planning.baselines import baseline_plans, plan_baseline
from ds_tsp.planning.communication import MOE_SCHEDULES
from ds_tsp.planning.shapes import (
    DEFAULT_DEVICES_PER_NODE,
    DEFAULT_LOGITS_TILE_MIB,
    LORA_TARGETS,
    PRECISIONS,
    TSP_ATTENTION_BACKWARDS,
    Setting,
    expert_parallel_sizes,
    model_fields,
    model_shape,
)
from ds_tsp.planning.tsp_plan import plan_tsp
from ds_tsp.planning.visual import vision_shape

# tsp.moe_schedule: a schedule, or "auto", the cheaper for the micro-batch's shape
TSP_MOE_SCHEDULES = (*MOE_SCHEDULES, "auto")


def make_setting(model, seq_len, micro_batch, devices, dtype="bf16", zero_stage=0, activation_checkpointing=False,
                 tsp_attention_backward=None, logits_tile_mib=DEFAULT_LOGITS_TILE_MIB, *, token_tile=0,
                 fp32_accumulators=True, recompute_norms=False, offload_activations=False, offload_optimizer=False,
                 prefetch_checkpoints=False, devices_per_node=DEFAULT_DEVICES_PER_NODE, lora_rank=0,
                 lora_targets=LORA_TARGETS, tsp_size=None, expert_parallel_size=None, moe_schedule="ring",
                 visual_tokens=0, frame_tokens=None):
    """A checked ``Setting`` (arguments as ``plan``'s; ``expert_parallel_size`` a number or None)."""
    if not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"lora_rank must be an integer >= 0 (0: full fine-tuning), not {lora_rank!r}")
    unknown = sorted(set(lora_targets) - set(LORA_TARGETS))
    if unknown:
        raise ValueError(f"lora_targets {unknown} are not projections ds_tsp shards adapters on: choose from "
                         f"{', '.join(LORA_TARGETS)}")
    if dtype not in PRECISIONS:
        raise ValueError(f"dtype must be one of {', '.join(PRECISIONS)}, not {dtype!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, not {zero_stage!r}")
    for label, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("devices", devices),
                         ("devices_per_node", devices_per_node)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be an integer >= 1, not {value!r}")
    if not isinstance(token_tile, int) or token_tile < 0:
        raise ValueError(f"token_tile must be an integer >= 0 (0: no tiling), not {token_tile!r}")
    if offload_activations and not activation_checkpointing:
        raise ValueError("offload_activations moves the checkpointed layer inputs to host memory: it needs "
                         "activation_checkpointing (DeepSpeed's cpu_checkpointing, likewise)")
    if prefetch_checkpoints and not offload_activations:
        raise ValueError("prefetch_checkpoints brings offloaded checkpoints back early: it needs "
                         "offload_activations (DeepSpeed's cpu_checkpointing)")
    if offload_optimizer and zero_stage < 1:
        raise ValueError("offload_optimizer is ZeRO's offload_optimizer: it needs zero_stage >= 1")
    m = model_shape(model)
    if lora_rank and m.is_hybrid:
        raise ValueError(f"lora_rank: the planner does not model LoRA on a {m.recurrent.kind} hybrid ({m.name}), "
                         f"whose recurrent layers take no adapters; plan full fine-tuning (lora_rank 0)")
    if tsp_attention_backward is None:
        tsp_attention_backward = "fused" if m.sliding_window is None and m.head_dim <= 256 else "recompute"
    if tsp_attention_backward not in TSP_ATTENTION_BACKWARDS:
        raise ValueError(f"tsp_attention_backward must be one of {TSP_ATTENTION_BACKWARDS}, "
                         f"not {tsp_attention_backward!r}")
    if not logits_tile_mib > 0:
        raise ValueError(f"logits_tile_mib must be > 0, not {logits_tile_mib!r}")
    if moe_schedule not in TSP_MOE_SCHEDULES:
        raise ValueError(f"moe_schedule must be one of {', '.join(TSP_MOE_SCHEDULES)}, not {moe_schedule!r}")
    _check_tsp_layout(m, devices, tsp_size, expert_parallel_size)
    vision, frame_tokens = _vision(model, m, seq_len, visual_tokens, frame_tokens, lora_rank)
    return Setting(m, seq_len, micro_batch, devices, dtype, zero_stage, bool(activation_checkpointing),
                   tsp_attention_backward, logits_tile_mib, token_tile, bool(fp32_accumulators),
                   bool(recompute_norms), bool(offload_activations), bool(prefetch_checkpoints),
                   bool(offload_optimizer), devices_per_node, lora_rank, tuple(lora_targets), tsp_size,
                   expert_parallel_size, moe_schedule, vision, visual_tokens, frame_tokens)


def _vision(model, m, seq_len, visual_tokens, frame_tokens, lora_rank):
    """``(visual.VisionShape, tokens a frame)`` of a run with ``visual_tokens`` per sequence, ``(None, 0)``
    without; a text-only model, more visual tokens than the sequence holds, or LoRA, refused."""
    if not isinstance(visual_tokens, int) or visual_tokens < 0:
        raise ValueError(f"visual_tokens must be an integer >= 0 (0: text alone), not {visual_tokens!r}")
    if not visual_tokens:
        return None, 0
    if lora_rank:
        raise ValueError("visual_tokens with lora_rank: the planner does not model a vision tower under LoRA; "
                         "plan full fine-tuning (lora_rank 0)")
    vision = vision_shape(model_fields(model))
    if vision is None:
        raise ValueError(f"visual_tokens = {visual_tokens}: {m.name} has no vision tower (its config has no "
                         f"vision_config); plan a vision-language model's config, or no visual tokens")
    if visual_tokens > seq_len:
        raise ValueError(f"visual_tokens = {visual_tokens} do not fit in seq_len = {seq_len}: lengthen the "
                         f"sequence or shorten the video")
    frame_tokens = vision.frame_tokens if frame_tokens is None else frame_tokens
    if not isinstance(frame_tokens, int) or not 1 <= frame_tokens:
        raise ValueError(f"frame_tokens must be an integer >= 1, not {frame_tokens!r}")
    return vision, min(frame_tokens, visual_tokens)


def _check_tsp_layout(m, devices, tsp_size, expert_parallel_size):
    """Refuse a TSP group that does not divide the devices, and an expert-parallel size that
    ``tsp.expert_parallel_size`` would refuse: a multiple of the TSP size dividing TSP x DP and the experts."""
    if tsp_size is not None and (not isinstance(tsp_size, int) or tsp_size < 1 or devices % tsp_size):
        raise ValueError(f"tsp_size must be an integer dividing devices ({devices}), the others data-parallel "
                         f"replicas of the TSP group, not {tsp_size!r}")
    if expert_parallel_size is None:
        return
    D = tsp_size or devices
    if expert_parallel_size != D and not m.is_moe:
        raise ValueError(f"expert_parallel_size = {expert_parallel_size!r}: {m.name} has no mixture-of-experts "
                         f"layer; leave it unset")
    choices = expert_parallel_sizes(m, D, devices)
    if not isinstance(expert_parallel_size, int) or expert_parallel_size not in choices:
        fold = "" if len(choices) > 1 else \
            f" (a TSP group of all {devices} devices leaves no replica to fold the experts over: set tsp_size)"
        raise ValueError(f"expert_parallel_size = {expert_parallel_size!r} must be a multiple of tsp_size ({D}) "
                         f"dividing tsp_size x the data-parallel size ({D} x {devices // D}) and {m.name}'s "
                         f"{m.num_experts} experts a layer: choose one of {', '.join(map(str, choices))}{fold}")


def plan(model, seq_len, micro_batch, devices, dtype="bf16", zero_stage=0, activation_checkpointing=False,
         tsp_attention_backward=None, logits_tile_mib=DEFAULT_LOGITS_TILE_MIB, **options):
    """Per-device costs of every strategy on ``devices`` devices: DP, TP, SP
    (Ulysses), CP (all-gather), TP+SP for every ``t x c = devices`` with both
    above 1, and TSP with the embedding and LM head whole on every rank and
    with them folded (``tsp_name``). See ``memory`` for what is counted.

    ``tsp_attention_backward`` ("fused" or "recompute", see
    ``TSP_ATTENTION_BACKWARDS``) defaults to what ds_tsp's own kernels do:
    fused for full causal attention with ``head_dim <= 256``.
    ``logits_tile_mib`` is ``tsp.logits_tile_mib``. Keyword ``options``:
    ``token_tile`` (``tsp.token_tile``; 0, the default here, is the layer
    without tiles, ``DEFAULT_TOKEN_TILE`` the runtime's default),
    ``fp32_accumulators`` (``tsp.fp32_accumulators``, default true),
    ``recompute_norms`` (``tsp.recompute_norms``, default false),
    ``offload_activations`` (checkpoints in host memory: ``cpu_checkpointing``),
    ``prefetch_checkpoints`` (``tsp.prefetch_checkpoints``: TSP keeps one more
    offloaded layer input on the device),
    ``offload_optimizer`` (ZeRO's ``offload_optimizer: cpu``) and
    ``devices_per_node`` (ranks whose offloads share one host); the offloads
    apply to every strategy. ``lora_rank`` (> 0) and ``lora_targets`` plan
    LoRA fine-tuning: the base frozen, adapters on those projections.
    ``visual_tokens`` (> 0, a vision-language model's) of each sequence's
    ``seq_len`` tokens are visual, ``frame_tokens`` a frame (default: the
    tower's ``visual.VisionShape.frame_tokens``): every plan gains the tower's
    memory, bytes and FLOPs (``visual``).

    The TSP rows: ``tsp_size`` (``D``, dividing ``devices``; default all of
    them) ranks a TSP group, ``devices / D`` data-parallel replicas beside it
    (ZeRO-1/2 partition over them), a sparse layer's experts ``E/D`` per rank
    under ``moe_schedule`` (``tsp.moe_schedule``: "ring", the default here,
    "all_to_all" or "auto"). ``expert_parallel_size`` (``tsp.expert_parallel_size``,
    above ``D``: DESIGN.md 6k) adds the row ``TSP(D) x DP(dp), EP(ep)``, its
    experts folded across the replicas, ``E/ep`` per rank and met by the
    token all-to-all; "auto": the ``ep`` of least memory, then fewest bytes
    (``best_expert_parallel_size``)."""
    ep = options.pop("expert_parallel_size", None)
    setting = make_setting(model, seq_len, micro_batch, devices, dtype, zero_stage, activation_checkpointing,
                           tsp_attention_backward, logits_tile_mib, **options,
                           expert_parallel_size=None if ep == "auto" else ep)
    if ep == "auto":
        ep = best_expert_parallel_size(setting)
    plans = baseline_plans(setting) + [plan_tsp(replace(setting, expert_parallel_size=None), vocab_parallel)
                                       for vocab_parallel in (False, True)]
    if ep is not None and ep > setting.tsp_group_size:
        plans.append(plan_tsp(replace(setting, expert_parallel_size=ep), vocab_parallel=True))
    return plans


def best_expert_parallel_size(setting):
    """``expert_parallel_size: "auto"``: of the sizes above ``setting``'s TSP group that fold the experts
    across its replicas (``shapes.expert_parallel_sizes``), the one whose TSP plan (folded vocabulary) is
    feasible with the least peak memory, then the fewest bytes per step. The largest holds the fewest experts;
    its all-to-all receives ``(ep-1)/ep`` of the rows, a little more, and its expert gradients are reduced over
    fewer replicas."""
    m, D = setting.model, setting.tsp_group_size
    if not m.is_moe:
        raise ValueError(f"expert_parallel_size auto: {m.name} has no mixture-of-experts layer")
    choices = [ep for ep in expert_parallel_sizes(m, D, setting.devices) if ep > D]
    if not choices:
        raise ValueError(f"expert_parallel_size auto: no size above tsp_size {D} divides {setting.devices} devices "
                         f"and {m.name}'s {m.num_experts} experts" + (" (set tsp_size below the devices)"
                                                                        if D == setting.devices else ""))
    plans = {ep: plan_tsp(replace(setting, expert_parallel_size=ep), vocab_parallel=True) for ep in choices}
    return min(choices, key=lambda ep: (not plans[ep].feasible, plans[ep].total, plans[ep].comm_per_step))


def plan_autotp(model, seq_len, micro_batch, devices, dtype="bf16", zero_stage=0, activation_checkpointing=False,
                logits_kept=True, **options):
    """DeepSpeed AutoTP training over ``devices`` ranks (``tensor_parallel.autotp_size``):
    ``TP(N)``'s layers with the vocabulary as AutoTP lays it out, the embedding
    whole and the LM head's output gathered (``plan_baseline``'s
    ``vocab_parallel`` false). Arguments as ``plan``'s.

    AutoTP splits what the model's Hugging Face ``tp_plan`` names; the MoE
    models' plans name their attention only, so a sparse block (router,
    experts, shared expert) stays whole on every rank and computes every token."""
    setting = make_setting(model, seq_len, micro_batch, devices, dtype, zero_stage, activation_checkpointing,
                           **options)
    return plan_baseline(setting, f"AutoTP({devices})", f"autotp={devices}", devices, 1, 1, "none",
                         vocab_parallel=False, logits_kept=logits_kept, experts_split=False)


def alst_name(devices):
    return f"ALST: SP-Ulysses({devices}) + ZeRO-3"


def plan_alst(model, seq_len, devices, micro_batch=1, dtype="bf16", logits_tile_mib=DEFAULT_LOGITS_TILE_MIB,
              devices_per_node=DEFAULT_DEVICES_PER_NODE):
    """ALST as Snowflake runs it (DESIGN.md 9): DeepSpeed-Ulysses over all
    ``devices`` with ZeRO-3 on the same axis, the optimizer offloaded to the
    CPU, activation checkpoints offloaded to host memory, TiledMLP and a tiled
    loss. TiledMLP cuts the local tokens into ``ceil(tokens / H)`` shards, so
    a tile holds at most ``H`` tokens; the loss's logits tiles are as TSP's."""
    setting = make_setting(model, seq_len, micro_batch, devices, dtype, 3, True, None, logits_tile_mib,
                           offload_activations=True, offload_optimizer=True, devices_per_node=devices_per_node)
    return plan_baseline(setting, alst_name(devices), f"sp={devices}, ZeRO-3, CPU optimizer + checkpoint offload, "
                          f"tiled MLP and loss", 1, devices, 1, "ulysses", mlp_tile=setting.model.hidden_size,
                          tiled_loss=True)


def recommend(plans, memory_per_device_bytes):
    """The feasible and exact plans whose peak fits ``memory_per_device_bytes``, best first:
    fewest bytes received per FLOP computed (the step's communication against
    its compute; one fast interconnect is assumed for all ``N`` devices, so a
    layout that would spill across nodes is not penalised), then least memory."""
    fits = [p for p in plans if p.feasible and not p.inexact and p.total <= memory_per_device_bytes]
    return sorted(fits, key=lambda p: (p.comm_per_step / p.flops_per_step, p.total))
