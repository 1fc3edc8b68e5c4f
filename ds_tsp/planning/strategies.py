"""The planner's entry points: ``plan`` (every strategy on ``N`` devices),
``plan_autotp`` (DeepSpeed AutoTP's training layout), ``plan_alst`` (ALST's
Ulysses + ZeRO-3 with its offloads and tiles, DESIGN.md 9) and ``recommend``
(the plans that fit a device, best first). Each takes a model and the run's
sizes, checks them into a ``Setting`` (``make_setting``) and hands it to the
plans that cost it: ``tsp_plan.plan_tsp`` and ``baselines.plan_baseline``.
"""

from ds_tsp.planning.baselines import baseline_plans, plan_baseline
from ds_tsp.planning.shapes import (
    DEFAULT_DEVICES_PER_NODE,
    DEFAULT_LOGITS_TILE_MIB,
    LORA_TARGETS,
    PRECISIONS,
    TSP_ATTENTION_BACKWARDS,
    Setting,
    model_shape,
)
from ds_tsp.planning.tsp_plan import plan_tsp


def make_setting(model, seq_len, micro_batch, devices, dtype="bf16", zero_stage=0, activation_checkpointing=False,
                 tsp_attention_backward=None, logits_tile_mib=DEFAULT_LOGITS_TILE_MIB, *, token_tile=0,
                 fp32_accumulators=True, recompute_norms=False, offload_activations=False, offload_optimizer=False,
                 prefetch_checkpoints=False, devices_per_node=DEFAULT_DEVICES_PER_NODE, lora_rank=0,
                 lora_targets=LORA_TARGETS):
    """A checked ``Setting`` (arguments as ``plan``'s)."""
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
        raise ValueError(f"lora_rank: the planner does not model LoRA on a Gated DeltaNet hybrid ({m.name}), whose "
                         f"linear layers take no adapters; plan full fine-tuning (lora_rank 0)")
    if tsp_attention_backward is None:
        tsp_attention_backward = "fused" if m.sliding_window is None and m.head_dim <= 256 else "recompute"
    if tsp_attention_backward not in TSP_ATTENTION_BACKWARDS:
        raise ValueError(f"tsp_attention_backward must be one of {TSP_ATTENTION_BACKWARDS}, "
                         f"not {tsp_attention_backward!r}")
    if not logits_tile_mib > 0:
        raise ValueError(f"logits_tile_mib must be > 0, not {logits_tile_mib!r}")
    return Setting(m, seq_len, micro_batch, devices, dtype, zero_stage, bool(activation_checkpointing),
                   tsp_attention_backward, logits_tile_mib, token_tile, bool(fp32_accumulators),
                   bool(recompute_norms), bool(offload_activations), bool(prefetch_checkpoints),
                   bool(offload_optimizer), devices_per_node, lora_rank, tuple(lora_targets))


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
    LoRA fine-tuning: the base frozen, adapters on those projections."""
    setting = make_setting(model, seq_len, micro_batch, devices, dtype, zero_stage, activation_checkpointing,
                           tsp_attention_backward, logits_tile_mib, **options)
    return baseline_plans(setting) + [plan_tsp(setting, vocab_parallel=False),
                                      plan_tsp(setting, vocab_parallel=True)]


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
