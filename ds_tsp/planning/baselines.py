"""The baselines' plans: DP, TP, SP (Ulysses), CP (all-gather) and TP+SP, run
as Hugging Face layers with heads and ``F`` split over ``t``, tokens over
``c`` and ``dp`` replicas; with ALST's pieces (TiledMLP, a tiled loss) and
DeepSpeed AutoTP's vocabulary layout as options.

A hybrid's recurrent layers (Gated DeltaNet, KDA, Mamba-2, Mamba-1, short
convolutions) split their heads (or channels) over ``t`` as attention does;
under SP and CP each rank runs them on its own tokens with the whole weights,
which is not the model's function (``inexact_reason``). Megatron-style context
parallelism (``CP-heads``, its Mamba layers' ``MambaContextParallel``) moves
their heads by all-to-all as Ulysses moves the attention's: exact, its group
bounded by their heads; a Mamba-1 layer has no such split.

Sparse MoE layers are Hugging Face's: DP, SP and CP replicate every expert
(ZeRO-3 partitions them over the sequence axis and gathers one layer's whole
at a time); TP splits each expert's ``F_e`` over ``t`` (Megatron's expert
tensor parallelism); AutoTP keeps every expert whole on every rank.

Communication is bytes received per device: an all-reduce over ``p`` ranks
receives ``2(p-1)/p`` of the tensor, an all-gather, reduce-scatter or
all-to-all ``(p-1)/p``. Per layer: TP's activation all-reduces, Ulysses'
all-to-alls or CP's K/V gather, ZeRO-3's parameter gathers, each in forward,
backward and the recomputed forward, and the gradients' reduce over the
weight replicas; per step also the vocabulary's all-reduces and ZeRO's
embedding and parameter gathers.

A vision-language model's tower (``visual``) runs whole on every device of a
replica over all the micro-batch's patches, its states partitioned as ZeRO
partitions the decoder's (over the weight replicas), not split by ``t``.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

from ds_tsp.planning.flops import step_flops
from ds_tsp.planning.memory import (
    ALL_TO_ALL,
    CHECKPOINT_BACK,
    CHECKPOINTS,
    EVERY_LAYER,
    FULL_KV,
    GRAD_X,
    HOST_OPTIMIZER,
    LOSS_BACKWARD,
    MLP_TILE,
    MODEL_LEVEL,
    RECOMPUTED,
    STATES,
    ZERO3_GATHERED,
    checkpoints_on_device,
    hf_ffn_saved_per_token,
    hf_mixer_saved_per_token,
    hf_moe_layer_saved,
    host_memory,
    load_balancing_saved,
    logits_memory,
    lora_model_states,
    loss_backward_beyond,
    loss_backward_per_logit,
    model_level_saved,
    model_states,
    rms_norm_saved_per_call,
    tiled_loss_memory,
    transient_terms,
)
from ds_tsp.planning.plan_types import (
    CP_KV,
    GRAD_REDUCE,
    PARAM_GATHER,
    SP_ALL_TO_ALL,
    EP_ALL_TO_ALL,
    TP_ACTIVATIONS,
    VISION_GATHER,
    VISION_GRADS,
    VISION_PARAM_GATHER,
    ZERO3_GATHER,
    CommPart,
    StrategyPlan,
)
from ds_tsp.planning.shapes import lora_adapter_params
from ds_tsp.planning.visual import add_tower, tower_flops, tower_memory, tower_summary


@dataclass(frozen=True)
class _Baseline:
    """``plan_baseline``'s layout and pieces (see there)."""

    t: int
    c: int
    dp: int
    kind: str  # "none", "ulysses", "allgather" or "heads" (Ulysses with the recurrent layers too): how tokens split
    mlp_tile: int = 0
    tiled_loss: bool = False
    vocab_parallel: bool = True
    logits_kept: bool = True
    experts_split: bool = True
    expert_parallel: int = 1  # AutoEP: E / expert_parallel experts a device, carved from the replicas

    @property
    def expert_replicas(self):  # ranks holding the same experts: their gradient sync and ZeRO
        return max(self.replica_group // self.expert_parallel, 1)

    @property
    def replica_group(self):  # ranks holding the same weights: gradient sync and ZeRO
        return self.c * self.dp

    @property
    def ulysses(self):  # the attention's heads by all-to-all
        return self.kind in ("ulysses", "heads") and self.c > 1

    @property
    def gathers_kv(self):  # all-gather CP: the full-sequence K/V on every rank
        return self.kind == "allgather" and self.c > 1

    def ffn_t(self, sparse):  # the ranks splitting a layer's feed-forward block
        return self.t if self.experts_split or not sparse else 1

    def tokens(self, setting):  # the local tokens
        return setting.micro_batch * setting.seq_len / self.c

    def mlp_tiled(self, setting):
        return bool(self.mlp_tile) and self.tokens(setting) > self.mlp_tile

    def zero3(self, setting):
        return setting.zero_stage >= 3 and self.replica_group > 1


class _Params(NamedTuple):
    """The parameters one device holds."""

    mixer: dict  # {mixer kind: one layer's token mixer's, with its whole tensors}
    ffn: dict  # {sparse: the rest of one layer's: its feed-forward block, norms and routing}
    layers: float  # every layer's
    embedding: float  # the embedding's and the LM head's
    layer_experts: float = 0  # of ``ffn[True]``, the routed experts a device holds under expert parallelism
    experts: float = 0  # of ``layers``, every layer's

    @property
    def largest_layer(self):
        return max(self.mixer.values()) + max(self.ffn.values())

    def shared_by(self, b, sparse):
        """``((parameters, their replicas), ...)`` of one layer's feed-forward block: the experts (under
        expert parallelism) apart, replicated over fewer ranks."""
        experts = self.layer_experts if sparse else 0
        return ((self.ffn[sparse] - experts, b.replica_group), (experts, b.expert_replicas))


def plan_baseline(setting, name, layout, t, c, dp, kind, mlp_tile=0, tiled_loss=False, vocab_parallel=True,
                  logits_kept=True, experts_split=True, expert_parallel=1):
    """DP, TP, SP (Ulysses), CP (all-gather) and TP+SP: Hugging Face layers with
    heads and F split over ``t``, tokens over ``c``, ``dp`` replicas. ALST's
    pieces: ``mlp_tile``, TiledMLP's tokens per tile (0: the HF MLP);
    ``tiled_loss``, a loss computed in logits tiles (``memory.tiled_loss_memory``).
    ``vocab_parallel``: the embedding and LM head split by vocabulary over ``t``
    and the logits left split (Megatron); false is DeepSpeed AutoTP's training
    layout (``plan_autotp``): the embedding whole on every rank, the LM head
    split by columns with its output gathered, so every rank holds the logits
    of the whole vocabulary. ``logits_kept``: the training loop keeps the
    model's logits output through backward (false: only the loss, so the
    logits are freed once the loss has its log-probabilities).

    Sparse MoE layers are Hugging Face's (router and grouped experts, all
    replicated over the sequence and data axes: Ulysses and CP replicate the
    experts, ZeRO-3 partitions them and gathers a whole layer's at a time;
    ``t`` splits every expert's ``F_e``; ``experts_split`` false keeps a sparse
    block whole on every rank of ``t``, computing every token, with no
    all-reduce after it, as AutoTP does; ``expert_parallel``, DeepSpeed AutoEP's
    ``ep_size``, spreads the routed experts over that many of the replicas, each
    device routing its own tokens' rows to their owners by all-to-all and the
    outputs back; the experts' gradients are synchronised over the
    ``replicas / ep_size`` ranks holding the same experts). TiledMLP tiles dense MLPs only."""
    b = _Baseline(t, c, dp, kind, mlp_tile, tiled_loss, vocab_parallel, logits_kept, experts_split, expert_parallel)
    params = _baseline_params(setting.model, b)
    memory, detail, terms, host = _baseline_memory(setting, b, params)
    forward, backward, per_step, parts = _baseline_communication(setting, b, params)
    flops, attention_flops = _baseline_flops(setting, b)
    tower = {}
    if setting.vision:
        memory, terms, host, tower = _with_tower(setting, b, memory, terms, host)
        per_step += tower["comm_per_step"]
        parts = {**parts, **_baseline_tower_parts(setting, b)}
        flops, attention_flops = (total + tower_part for total, tower_part in
                                  zip((flops, attention_flops), tower_flops(setting, setting.patches)))
    problem = _baseline_problem(setting.model, t, c, kind, setting.seq_len, experts_split)
    return StrategyPlan(name, layout, memory, forward, backward, per_step, flops, b.tokens(setting), setting,
                        feasible=problem is None, notes=problem or "", inexact=inexact_reason(setting.model, c, kind),
                        detail=detail, terms=terms, host=host, comm_parts=parts,
                        attention_flops_per_step=attention_flops, devices_per_replica=t * c,
                        attention_rows=setting.seq_len // c if kind == "allgather" else setting.seq_len, tower=tower)


def inexact_reason(m, c, kind="ulysses"):
    """Why splitting the tokens over ``c`` ranks computes another model than ``m``, or "": DeepSpeed-Ulysses
    (and all-gather context parallelism) swap the attention alone, so a recurrent layer runs on each rank's
    ``S/c`` tokens from a zero state, as if the sequence restarted at every rank's first token. The plan models
    that: each rank runs the layer on its own tokens, weights whole (or gathered by ZeRO-3). Megatron-style
    context parallelism (``kind`` "heads") moves the recurrent layers' heads by all-to-all too: exact."""
    if c == 1 or not m.is_hybrid or kind == "heads":
        return ""
    return (f"its {m.linear_layers} {m.recurrent.kind} layers run on each rank's 1/{c} of the sequence alone, "
            f"their state restarting at every rank's first token")


def baseline_plans(setting):
    """DP, TP, SP (Ulysses), CP (all-gather), every TP+SP split of ``setting.devices``
    and, for a mixture of experts, DeepSpeed AutoEP (data parallel, the experts
    spread over ``gcd(E, devices)`` ranks)."""
    N = setting.devices
    plans = [plan_baseline(setting, f"DP({N})", f"dp={N}", 1, 1, N, "none"),
             plan_baseline(setting, f"TP({N})", f"tp={N}", N, 1, 1, "none"),
             plan_baseline(setting, f"SP-Ulysses({N})", f"sp={N}", 1, N, 1, "ulysses"),
             plan_baseline(setting, f"CP-allgather({N})", f"cp={N}", 1, N, 1, "allgather")]
    for t in range(2, N):
        if N % t == 0:
            plans.append(plan_baseline(setting, f"TP+SP({t}x{N // t})", f"tp={t} x sp={N // t}", t, N // t, 1,
                                        "ulysses"))
    if setting.model.is_hybrid:  # Megatron's context parallelism: the recurrent layers' heads by all-to-all too
        plans.append(plan_baseline(setting, f"CP-heads({N})", f"cp={N}, heads by all-to-all", 1, N, 1, "heads"))
    if setting.model.is_moe:
        ep = math.gcd(setting.model.num_experts, N)  # AutoEP's ep_size divides E and the world
        plans.append(plan_baseline(setting, f"AutoEP({ep})", f"dp={N}, ep={ep}", 1, 1, N, "none", expert_parallel=ep))
    return plans


def _baseline_problem(m, t, c, kind, seq_len, experts_split):
    """Why the layout cannot split this model, or None."""
    nq, nkv = m.num_heads, m.num_kv_heads
    dense = m.num_layers > m.moe_layers
    if nq % t or (nkv % t and t % nkv) or (dense and m.intermediate_size % t):
        return f"heads {nq}/{nkv} or intermediate_size {m.intermediate_size} do not split over tp={t}"
    if m.is_moe and experts_split and (m.expert_size % t or m.shared_expert_size % t):
        return f"the experts' intermediate sizes {m.expert_size}/{m.shared_expert_size} do not split over tp={t}"
    if kind == "heads" and m.is_hybrid and not m.recurrent.head_all_to_all:
        return f"no head all-to-all splits a {m.recurrent.kind} layer (its x_proj mixes every channel)"
    recurrent_ranks = t * c if kind == "heads" else t  # a head all-to-all splits the heads over c as well
    if m.is_hybrid and m.recurrent.shape_problem(recurrent_ranks, tsp=False):
        return f"tp={t}" + (f" x cp={c}" if kind == "heads" else "") + ": " + \
            m.recurrent.shape_problem(recurrent_ranks, tsp=False)
    if kind in ("ulysses", "heads") and (nq // t) % c:
        return f"{nq // t} query heads per TP rank do not split over sp={c}"
    if kind == "allgather" and seq_len % (2 * c):
        return f"seq_len {seq_len} is not a multiple of 2*cp = {2 * c}"
    return None


def _kv_heads(m, t):
    """Key/value heads per TP rank: replicated when fewer than ``t``."""
    return max(m.num_kv_heads / t, 1)


def _baseline_ffn_params(m, t, sparse, expert_parallel=1):
    """One device's feed-forward parameters under ``t``-way tensor parallelism:
    the dense MLP's ``F`` split; a sparse layer's experts split by ``F_e``
    (Megatron's expert tensor parallelism), its shared expert by ``F_s``;
    under ``expert_parallel`` the device's ``E / expert_parallel`` experts."""
    if not sparse:
        return m.mlp_params / t
    return (m.num_experts * m.expert_params / expert_parallel + m.shared_expert_params) / t


def _baseline_params(m, b):
    """``_Params``: attention heads (and a Gated DeltaNet's) and feed-forward blocks split over ``t``, norms and
    routers whole; the embedding and LM head split by vocabulary, or AutoTP's whole embedding and column-split
    head."""
    H, t = m.hidden_size, b.t

    def attention(view):  # q and o split; k and v split down to one head a device
        kv = view.kv_projections * view.num_kv_heads * view.head_dim * H
        return (view.attention_params - kv) / t + kv * _kv_heads(view, t) / view.num_kv_heads

    mixer = {kind: (view.recurrent.params / t if linear else attention(view))
             + sum(view.mixer_replicated_tensors(linear))
             for kind, (view, linear) in ((kind, m.mixer_view(kind)) for kind, _ in m.mixer_kinds)}
    ffn = {sparse: _baseline_ffn_params(m, b.ffn_t(sparse), sparse, b.expert_parallel)
           + sum(m.ffn_replicated_tensors(sparse)) for sparse, _ in m.layer_kinds}
    layers = sum(count * mixer[kind] for kind, count in m.mixer_kinds) + \
        sum(count * ffn[sparse] for sparse, count in m.layer_kinds)
    embedding = m.embedding_params / t if b.vocab_parallel else \
        m.embedding_params - (0 if m.tie_word_embeddings else m.vocab_size * H * (t - 1) / t)
    layer_experts = m.num_experts * m.expert_params / b.expert_parallel / b.ffn_t(True) if b.expert_parallel > 1 \
        else 0
    return _Params(mixer, ffn, layers, embedding, layer_experts, m.moe_layers * layer_experts)


# --- memory --------------------------------------------------------------------------------------

def _baseline_memory(setting, b, params):
    """One device's memory: ``(memory parts, detail, terms, host)``."""
    m, e, S = setting.model, setting.precision.element, setting.seq_len
    tokens = b.tokens(setting)
    states, optimizer_host = _baseline_states(setting, b, params)
    mixer_saved, ffn_saved = _baseline_layers_saved(setting, b)
    every_layer = sum(count * mixer_saved[kind] for kind, count in m.mixer_kinds) + \
        sum(count * ffn_saved[sparse] for sparse, count in m.layer_kinds)
    one_layer = max(mixer_saved.values()) + max(ffn_saved.values())  # of the larger kinds where layers differ
    # HF rotary: one row per position
    model_saved = model_level_saved(m, e, tokens, rope_rows=S / b.c) + load_balancing_saved(m, tsp=False)
    layers, layer_terms = _layer_activations(setting, tokens, every_layer, one_layer)
    logits_saved, logits_held, loss_backward = _baseline_loss(setting, b)
    detail = {
        "saved_for_backward": (model_saved + every_layer + logits_saved
                               if not setting.activation_checkpointing else None),
        "logits_output": logits_held,
        **_baseline_layer_buffers(setting, b, params),
        "loss_backward": loss_backward,
    }
    layer_pieces = {MLP_TILE: detail["mlp_grads"], GRAD_X: detail["grad_x"],
                    ALL_TO_ALL: detail["all_to_all_buffers"], FULL_KV: detail["full_kv_grads"],
                    ZERO3_GATHERED: detail["zero3_gathered_layers"]}
    layer_backward = sum(layer_pieces.values())
    # As for TSP: the loss backward runs before any gradient exists (but
    # ZeRO-3's partition) and, with checkpointing, before any layer is recomputed.
    not_live = one_layer if setting.activation_checkpointing else 0
    loss_backward_beyond_grads = max(loss_backward_beyond(setting, loss_backward, states) - not_live, 0)
    memory = {**states, "activations": model_saved + layers, "logits": logits_saved + logits_held,
              "transient": max(layer_backward, loss_backward_beyond_grads)}
    terms = {STATES: sum(states.values()), **layer_terms, MODEL_LEVEL: model_saved + logits_saved + logits_held,
             **transient_terms(layer_pieces, {LOSS_BACKWARD: loss_backward_beyond_grads})}
    return memory, detail, terms, host_memory(setting, tokens, optimizer_host)


def _baseline_states(setting, b, params):
    """One device's model states, ZeRO over the weight replicas, and its offloaded optimizer's host bytes."""
    m, p = setting.model, setting.precision
    if setting.lora_rank:  # each kind of mixer layer's adapters (its own heads), in proportion to the FFN kinds
        adapters = {(kind, sparse): lora_adapter_params(m.mixer_view(kind)[0], setting.lora_rank,
                                                        setting.lora_targets, b.t, sparse)
                    for kind, _ in m.mixer_kinds for sparse, _ in m.layer_kinds}
        total = sum(mixers * count * adapters[kind, sparse] / m.num_layers
                    for kind, mixers in m.mixer_kinds for sparse, count in m.layer_kinds)
        return lora_model_states(params.layers + params.embedding, total, p, setting.zero_stage, b.replica_group,
                                 setting.offload_optimizer, layer_adapter_params=max(adapters.values()))
    layer_params = max(params.largest_layer, m.vocab_size * m.hidden_size / b.t)
    states, host = model_states(params.layers + params.embedding - params.experts, p, setting.zero_stage,
                                b.replica_group, setting.offload_optimizer, layer_params=layer_params)
    if params.experts:  # AutoEP's experts: ZeRO over the ranks that hold the same ones
        expert_states, expert_host = model_states(params.experts, p, setting.zero_stage, b.expert_replicas,
                                                  setting.offload_optimizer, layer_params=0)
        states = {name: states[name] + expert_states[name] for name in states}
        host += expert_host
    return states, host


def _baseline_layers_saved(setting, b):
    """``({mixer kind: bytes}, {sparse: bytes})``: what one Hugging Face layer's
    token mixer of each kind, and the rest of a layer of each kind, save for
    backward. Under sequence parallelism a Gated DeltaNet layer runs on the
    local tokens alone (``inexact_reason``)."""
    m, e, B, S = setting.model, setting.precision.element, setting.micro_batch, setting.seq_len
    tokens, mlp_tiled = b.tokens(setting), b.mlp_tiled(setting)
    mixer = {}
    for kind, _ in m.mixer_kinds:
        view, linear = m.mixer_view(kind)
        mixer[kind] = tokens * hf_mixer_saved_per_token(view, e, b.t, b.ulysses, linear)
        if not linear:  # the q/k norms' once-a-call tensors; all-gather CP's full-sequence K/V for the local one
            mixer[kind] += 2 * rms_norm_saved_per_call(view, e, width=view.head_dim) if view.qk_norm else 0
            mixer[kind] += (B * S - tokens) * 2 * _kv_heads(view, b.t) * view.head_dim * e if b.gathers_kv else 0
    ffn = {sparse: tokens * hf_ffn_saved_per_token(m, e, b.t, mlp_tiled and not sparse, sparse, b.experts_split)
           + 2 * rms_norm_saved_per_call(m, e) + (hf_moe_layer_saved(m) if sparse else 0)
           for sparse, _ in m.layer_kinds}
    return mixer, ffn


def _layer_activations(setting, tokens, every_layer, one_layer):
    """Activations of the layers, and their named terms: without checkpointing
    ``every_layer``'s saved tensors; with it every layer's input (one, when
    they are offloaded) and ``one_layer``'s saved tensors."""
    if not setting.activation_checkpointing:
        return every_layer, {EVERY_LAYER: every_layer}
    checkpoints = checkpoints_on_device(setting, tokens)
    return checkpoints + one_layer, {CHECKPOINT_BACK if setting.offload_activations else CHECKPOINTS: checkpoints,
                                     RECOMPUTED: one_layer}


def _baseline_loss(setting, b):
    """``(logits saved, logits output held, loss backward)``: the dense loss's
    log-probabilities and logit gradients, or a tiled loss's labels and tiles."""
    m, p = setting.model, setting.precision
    tokens, zero3 = b.tokens(setting), b.zero3(setting)
    vocab_shards = b.t if b.vocab_parallel else 1
    if b.tiled_loss:
        logits_saved, loss_backward = tiled_loss_memory(m, p, tokens, vocab_shards, setting.logits_tile_mib, zero3)
        return logits_saved, 0, loss_backward
    logits_saved, logits_held = logits_memory(m, p, tokens, vocab_shards)
    loss_backward = tokens * m.vocab_size / vocab_shards * loss_backward_per_logit(p)
    if zero3:  # the LM head gathered whole, and its whole gradient before the reduce-scatter
        loss_backward += 2 * m.vocab_size / vocab_shards * m.hidden_size * p.element
    return logits_saved, logits_held if b.logits_kept else 0, loss_backward


def _baseline_layer_buffers(setting, b, params):
    """One layer's backward buffers (``plan_baseline``'s detail), by name."""
    m, e, B, S = setting.model, setting.precision.element, setting.micro_batch, setting.seq_len
    t = b.t
    tokens, mlp_tiled = b.tokens(setting), b.mlp_tiled(setting)
    # The attention's buffers of the largest kind of attention layer (Gemma 4's full layers: their own heads).
    views = [view for view, linear, _ in m.mixer_groups if not linear] or [m]

    def ffn_grads(sparse):
        """Gradients of the feed-forward intermediates in backward; tiled, of one
        tile, with the tile's four recomputed; a sparse layer's of every slot."""
        if not sparse:
            return (7 * b.mlp_tile if mlp_tiled else 3 * tokens) * m.intermediate_size / t * e
        return 3 * tokens * (m.experts_per_token * m.expert_size + m.shared_expert_size) / b.ffn_t(sparse) * e

    return {
        "mlp_grads": max(ffn_grads(sparse) for sparse, _ in m.layer_kinds),
        "grad_x": 2 * tokens * m.hidden_size * e,
        "all_to_all_buffers": max([tokens * (v.num_heads / t + 2 * _kv_heads(v, t)) * v.head_dim * e for v in views]
                                  + ([tokens * m.recurrent.head_all_to_all_elements(b.c) / t * e]
                                     if b.kind == "heads" and m.recurrent.head_all_to_all else []))
        if b.ulysses else 0,
        "full_kv_grads": max(2 * B * S * 2 * _kv_heads(v, t) * v.head_dim * e for v in views) if b.gathers_kv else 0,
        "zero3_gathered_layers": 2 * params.largest_layer * e if b.zero3(setting) else 0,
    }


# --- communication and FLOPs ---------------------------------------------------------------------

def _all_reduce(group, nbytes):
    return 2 * (group - 1) / group * nbytes


def _gather(group, nbytes):  # all-gather / reduce-scatter / all-to-all: (p-1)/p of the full tensor
    return (group - 1) / group * nbytes


def _baseline_communication(setting, b, params):
    """Bytes one device receives: per layer forward and backward (the mean over
    the layers), per step, and per step by kind (``CommPart``). Each layer's
    token mixer and feed-forward block count apart, each kind by its count of
    layers."""
    m, p, B, S = setting.model, setting.precision, setting.micro_batch, setting.seq_len
    e, H = p.element, m.hidden_size
    t, c, replicas, tokens = b.t, b.c, b.replica_group, b.tokens(setting)
    zero3 = b.zero3(setting)
    grad_reduce = _gather if setting.zero_stage >= 1 else _all_reduce  # reduce-scatter under ZeRO
    kinds = [(("mixer", kind), count) for kind, count in m.mixer_kinds] + \
        [(("ffn", sparse), count) for sparse, count in m.layer_kinds]
    # The parameters of each kind of block, and the replicas each part is synchronised over.
    shared = {**{("mixer", kind): ((n, replicas),) for kind, n in params.mixer.items()},
              **{("ffn", sparse): params.shared_by(b, sparse) for sparse in params.ffn}}
    # TP: after the token mixer and after a split feed-forward block
    tp = {kind: _all_reduce(t, tokens * H * e) if kind[0] == "mixer" or b.ffn_t(kind[1]) > 1 else 0
          for kind, _ in kinds}

    def sequence_parallel(view):  # Ulysses: q, k, v in and the output back; all-gather CP: the K/V
        kv_heads, d = _kv_heads(view, t), view.head_dim
        return {"ulysses": _gather(c, tokens * (2 * view.num_heads / t + 2 * kv_heads) * d * e),
                "allgather": _gather(c, B * S * 2 * kv_heads * d * e)}.get("ulysses" if b.ulysses else b.kind, 0)

    def recurrent_heads(view):  # Megatron's context parallelism: the recurrent mixer's heads by all-to-all
        r = view.recurrent
        return _gather(c, tokens * r.head_all_to_all_elements(c) / t * e) if b.kind == "heads" and \
            r.head_all_to_all else 0

    views = {("mixer", kind): m.mixer_view(kind) for kind, _ in m.mixer_kinds}
    sp = {kind: (recurrent_heads if views[kind][1] else sequence_parallel)(views[kind][0]) if kind in views else 0
          for kind, _ in kinds}
    zero3_layer = {kind: sum(_gather(group, n * e) for n, group in shared[kind]) if zero3 else 0 for kind, _ in kinds}
    # AutoEP: each routed row (token, expert) to the expert's owner and its output back, top-k rows a token
    ep = {kind: 2 * _gather(b.expert_parallel, m.experts_per_token * tokens * H * e) if kind == ("ffn", True)
          else 0 for kind, _ in kinds}
    forward = {kind: tp[kind] + sp[kind] + zero3_layer[kind] + ep[kind] for kind, _ in kinds}
    grads = {kind: sum(grad_reduce(group, n * p.grad) for n, group in shared[kind]) for kind, _ in kinds}
    passes = 3 if setting.activation_checkpointing else 2  # forward, backward (and the forward recomputed)

    def summed(value):
        return sum(count * value[kind] for kind, count in kinds)

    # input-gradient all-reduces, reversed all-to-alls, dK/dV reduce-scatter, re-gather, then the gradients
    per_step = passes * summed(forward) + summed(grads)
    vocab_tp = 2 * _all_reduce(t, tokens * H * e)  # vocab-parallel embedding output, LM-head input grad
    embedding_grads = grad_reduce(replicas, params.embedding * p.grad)
    param_gather = _gather(replicas, (params.layers + params.embedding - params.experts) * e) + \
        _gather(b.expert_replicas, params.experts * e) if setting.zero_stage in (1, 2) else 0
    zero3_embedding = 2 * _gather(replicas, params.embedding * e) if zero3 else 0
    for once_per_step in (vocab_tp, embedding_grads, param_gather, zero3_embedding):
        per_step += once_per_step
    parts = {TP_ACTIVATIONS: CommPart(passes * summed(tp) + vocab_tp, t, 1, "all_reduce"),
             SP_ALL_TO_ALL if b.ulysses else CP_KV: CommPart(
                 passes * summed(sp), c, t, "all_to_all" if b.ulysses else "all_gather"),
             ZERO3_GATHER: CommPart(passes * summed(zero3_layer) + zero3_embedding, replicas, t, "all_gather"),
             GRAD_REDUCE: CommPart(summed(grads) + embedding_grads, replicas, t,
                                   "reduce_scatter" if setting.zero_stage >= 1 else "all_reduce"),
             PARAM_GATHER: CommPart(param_gather, replicas, t, "all_gather"),
             EP_ALL_TO_ALL: CommPart(passes * summed(ep), b.expert_parallel, t * c, "all_to_all")}
    return (summed(forward) / m.num_layers, (summed(forward) + summed(grads)) / m.num_layers, per_step,
            {k: v for k, v in parts.items() if v.nbytes})


def _with_tower(setting, b, memory, terms, host):
    """``(memory, terms, host, visual.tower_summary)`` with the whole tower on the device, encoding all the
    micro-batch's patches, its states partitioned by ZeRO over the weight replicas."""
    v = setting.vision
    tower = tower_memory(setting, v.params, b.replica_group, setting.patches, gathered=b.zero3(setting))
    memory, terms = add_tower(memory, terms, tower)
    if tower.host:
        host = {**host, HOST_OPTIMIZER: host[HOST_OPTIMIZER] + setting.ranks_per_node * tower.host}
    summary = tower_summary(tower, setting.patches, v.params, _baseline_tower_parts(setting, b),
                            tower_flops(setting, setting.patches)[0])
    return memory, terms, host, summary


def _baseline_tower_parts(setting, b):
    """The tower's bytes one device receives per step, by kind: whole on every device of a replica, its
    gradients reduced over the weight replicas (reduce-scattered under ZeRO), ZeRO-3's gathers of it in
    forward, backward (and the checkpointed blocks' recompute), ZeRO-1/2's gather of the updated tower."""
    v, p, replicas = setting.vision, setting.precision, b.replica_group
    grad_reduce = _gather if setting.zero_stage >= 1 else _all_reduce
    passes = 3 if setting.activation_checkpointing else 2
    parts = {VISION_GRADS: CommPart(grad_reduce(replicas, v.params * p.grad), replicas, b.t,
                                    "reduce_scatter" if setting.zero_stage >= 1 else "all_reduce"),
             VISION_GATHER: CommPart(passes * _gather(replicas, v.params * p.element) if b.zero3(setting) else 0,
                                     replicas, b.t, "all_gather"),
             VISION_PARAM_GATHER: CommPart(_gather(replicas, v.params * p.element)
                                           if setting.zero_stage in (1, 2) else 0, replicas, b.t, "all_gather")}
    return {name: part for name, part in parts.items() if part.nbytes}


def _baseline_flops(setting, b):
    """``(FLOPs, attention FLOPs)`` per device per step: the replica's over ``t * c``."""
    m, mlp_tiled = setting.model, b.mlp_tiled(setting)

    def recomputed(sparse):  # TiledMLP runs a dense MLP's forward again in backward
        return m.mlp_params if mlp_tiled and not sparse else 0

    return step_flops(m, setting, setting.micro_batch, setting.seq_len, 1 / (b.t * b.c), tsp=False,
                      ffn_recompute=recomputed, ffn_replicas=lambda sparse: b.t // b.ffn_t(sparse))
