"""One function per strategy: per-device memory, communication and FLOPs of DP,
TP, SP (Ulysses), CP (all-gather), TP+SP and TSP for a decoder LM (DESIGN.md 8),
and ALST's Ulysses + ZeRO-3 with its offloads and tiles (DESIGN.md 9).

Everything is per device and per optimizer step of one micro-batch ``B`` of
sequences of length ``S``, for a model replica spread over ``N`` devices (DP:
``N`` replicas of one device each). What each memory term holds: ``memory``.
TSP is planned twice: ``TSP(N)`` folds the vocabulary as ``tsp.vocab_parallel``
(the default) does, ``ceil(V/N)`` rows of the embedding and the LM head per
device; ``TSP(N) replicated vocab`` keeps both whole on every device.

Mixture-of-experts models (``ModelShape.layer_kinds``): each sparse layer is
planned as each strategy runs a Hugging Face MoE layer. TSP holds ``E/D``
experts per rank and moves them round the ring (``ds_tsp.blocks.moe.module``); DP, SP and
CP replicate every expert (ZeRO-3 partitions them over the sequence axis and
gathers one layer's whole at a time); TP splits each expert's ``F_e`` over
``t`` (Megatron's expert tensor parallelism: a model, no DeepSpeed anchor);
DeepSpeed's AutoTP keeps every expert whole on every rank (``plan_autotp``).
Per-layer figures are then the mean over the layers.

Communication is bytes RECEIVED per device, counted as ``communication``
counts TSP's: per step = ``L * (forward + backward [+ forward again when
checkpointing])`` plus the once-per-step syncs (embedding, LM head, replicated
gradients, ZeRO).

The bytes are also kept by kind (``StrategyPlan.comm_parts``, named by the
constants below), with the group each kind runs in, for ``timing``.

FLOPs count matmuls (2 per multiply-add) and causal attention
(``2*B*S^2*nq*d`` forward; the attention's part is also kept apart, as
``attention_flops_per_step``); backward is 2x the matmuls and 2.5x attention
(flash); TSP adds the attention forward again when its backward is not fused,
and the LM head's forward again when the vocabulary is folded (the fused loss
recomputes its logits tile by tile); a tiled MLP recomputes its tiles'
projections in backward (TSP: gate and up; ALST's TiledMLP: the whole MLP).
A sparse layer counts its router and the ``k`` experts (and shared expert)
each token uses; TSP's experts recompute their projections in backward.
"""

from dataclasses import dataclass, field

from ds_tsp.planning.communication import tsp_bytes_per_layer, tsp_step_bytes_by_op
from ds_tsp.planning.memory import (ALL_TO_ALL, CHECKPOINT_BACK, CHECKPOINTS, EMBEDDING_BACKWARD, EVERY_LAYER,
                                    FULL_KV, GRAD_X, HEAD_BACKWARD, HEAD_GROUP_LOCAL, HEAD_PHASE, KEPT_OUTSIDE,
                                    KV_GROUP, LOSS_BACKWARD, MLP_TILE, MODEL_LEVEL, RECOMPUTED, SHARDS, STATES,
                                    ZERO3_GATHERED, hf_layer_saved_per_token, hf_moe_layer_saved, host_memory,
                                    load_balancing_saved, logits_memory, lora_model_states, model_level_saved,
                                    model_states, rope_saved, tiled_loss_memory, transient_terms,
                                    tsp_block_saved_per_token, tsp_vocab_memory)
from ds_tsp.planning.shapes import (DEFAULT_DEVICES_PER_NODE, DEFAULT_LOGITS_TILE_MIB, INT64, LORA_TARGETS,
                                    PRECISIONS, TSP_ATTENTION_BACKWARDS, Setting, lora_adapter_params, model_shape, padded_length,
                                    tsp_attention_shard, tsp_name, tsp_shape_problem, vocab_rows_per_rank)


# What each strategy sends, by kind (``StrategyPlan.comm_parts``). The baselines:
TP_ACTIVATIONS = "tp_activations"  # TP all-reduces of activations and their gradients (and the vocab-parallel ends)
SP_ALL_TO_ALL = "sp_all_to_all"  # Ulysses: q, k, v in and the attention output back
CP_KV = "cp_kv"  # context parallel: the full-sequence K/V gathered, dK/dV scattered back
ZERO3_GATHER = "zero3_gather"  # ZeRO-3: every layer's parameters gathered before its forward and backward
GRAD_REDUCE = "grad_reduce"  # gradients reduced over the weight replicas (reduce-scatter under ZeRO)
PARAM_GATHER = "param_gather"  # ZeRO-1/2: the updated weights gathered after the optimizer step
# TSP, one per ``comm`` op (``communication.tsp_step_bytes_by_op``):
TSP_PARTS = {"broadcast": "tsp_weight_broadcast", "ring": "tsp_ring", "all_gather": "tsp_kv_gather",
             "reduce_scatter": "tsp_kv_grad_scatter", "reduce": "tsp_weight_grad_reduce",
             "all_to_all": "tsp_embedding_all_to_all", "all_reduce": "tsp_replicated_grads"}


@dataclass(frozen=True)
class CommPart:
    """Bytes one device receives per step in one kind of communication, and its
    group: ``group_size`` ranks ``stride`` apart (TP innermost, then SP/CP, then
    DP; a TSP group is consecutive), running ``op`` (a ``comm`` op name)."""

    nbytes: float
    group_size: int
    stride: int
    op: str


@dataclass
class StrategyPlan:
    """One strategy's per-device costs. Bytes are per device; communication is
    bytes received per device; FLOPs per device per optimizer step."""

    name: str  # e.g. "TP+SP(2x4)"
    layout: str  # e.g. "tp=2 x sp=4"
    memory: dict  # MEMORY_PARTS -> bytes
    comm_forward_per_layer: float
    comm_backward_per_layer: float
    comm_per_step: float
    flops_per_step: float
    tokens_per_device: float  # tokens whose activations this device holds (B*S/c; B*S/D for TSP)
    setting: Setting
    feasible: bool = True
    notes: str = ""
    detail: dict = field(default_factory=dict)  # named pieces of the memory terms, bytes
    terms: dict = field(default_factory=dict)  # the peak as named terms (memory.STATES, ...), summing to total
    host: dict = field(default_factory=dict)  # per node: what offloading puts in host memory, bytes
    comm_parts: dict = field(default_factory=dict)  # name -> CommPart, summing to comm_per_step
    attention_flops_per_step: float = 0.0  # the part of flops_per_step in QK^T and PV (and their backward)
    devices_per_replica: int = 1  # devices sharing one micro-batch: t*c, D for TSP (1 for DP)

    @property
    def total(self):
        return sum(self.memory.values())

    @property
    def host_total(self):
        return sum(self.host.values())


def _flops(m, setting, B, S, share, tsp, fused_head=False, ffn_recompute=None, ffn_replicas=None):
    """FLOPs per device per step, and the attention's part of them: the replica's
    total for ``B`` sequences of ``S`` times ``share``; ``fused_head``: the LM head
    + loss recomputes the logits in backward; ``ffn_recompute(sparse)``: the
    parameters of a layer's feed-forward block whose forward matmuls run again
    in backward (a tiled MLP's, a TSP expert's); ``ffn_replicas(sparse)``: how
    many ranks of a share compute the same feed-forward work (AutoTP's whole
    experts: ``t``). A sparse layer's matmuls are its active ones
    (``ModelShape.active_ffn_params``: k experts and the shared expert) and the
    router's."""
    T = B * S
    attn = 2 * B * S * S * m.num_heads * m.head_dim  # causal: half of QK^T and PV
    mm_attn = 2 * T * m.attention_params
    head = 2 * T * m.vocab_size * m.hidden_size
    forward, backward = head, (3 if fused_head else 2) * head
    attention = recompute = 0
    for sparse, layers in m.layer_kinds:
        mm_ffn = 2 * T * (m.active_ffn_params(sparse) + (m.router_params if sparse else 0))
        mm_ffn *= ffn_replicas(sparse) if ffn_replicas else 1
        forward += layers * (mm_attn + mm_ffn + attn)
        backward += layers * (2 * (mm_attn + mm_ffn) + 2.5 * attn)
        attention += layers * attn * 3.5
        if tsp and setting.tsp_attention_backward == "recompute":  # the attention forward runs again
            backward += layers * attn
            attention += layers * attn
        if ffn_recompute:
            backward += layers * 2 * T * ffn_recompute(sparse)
        if setting.activation_checkpointing:
            recompute += layers * (mm_attn + mm_ffn + attn)
            attention += layers * attn
    return (forward + backward + recompute) * share, attention * share


def _layers(setting, tokens, layer_saved):
    """Activations of the layers, and their named terms: with checkpointing every
    layer's input (one, when they are offloaded) and one layer's saved tensors
    (the larger kind's, where dense and sparse layers differ).
    ``layer_saved``: ``{sparse: bytes one layer of that kind saves}``."""
    m = setting.model
    if not setting.activation_checkpointing:
        every = sum(layers * layer_saved[sparse] for sparse, layers in m.layer_kinds)
        return every, {EVERY_LAYER: every}
    checkpoints = _checkpoints(setting, tokens)
    one = max(layer_saved.values())
    return checkpoints + one, {CHECKPOINT_BACK if setting.offload_activations else CHECKPOINTS: checkpoints,
                               RECOMPUTED: one}


def _checkpoints(setting, tokens, prefetch=False):
    """With activation checkpointing, the layers' checkpointed inputs on the
    device: every layer's, or one when they are offloaded (the one back for
    its recompute; two with ``prefetch``, the next one coming back under its
    backward); nothing without checkpointing."""
    if not setting.activation_checkpointing:
        return 0
    kept = (2 if prefetch else 1) if setting.offload_activations else setting.model.num_layers
    return kept * tokens * setting.precision.element * setting.model.hidden_size


def _tsp_backward_phases(setting, blocks_saved, pieces, every_layer):
    """The two peaks of one TSP layer's backward, each as ``(layer saved
    tensors still live, {term: buffer bytes})``: the MLP's backward, with
    every tensor the layer saved; then the attention's, once autograd has
    freed the MLP's (and its norm's) saved tensors. The layer is the
    recomputed one under checkpointing, else the last, with every layer's
    saved tensors (``every_layer``) live."""
    layer = sum(blocks_saved.values()) if setting.activation_checkpointing else every_layer
    mlp = {GRAD_X: pieces["grad_x"], MLP_TILE: pieces["mlp_shard_intermediates"],
           SHARDS: pieces["mlp_shards_in_flight"] + pieces["mlp_accumulators"]}
    attention = {KV_GROUP: pieces["kv_head_group"], HEAD_GROUP_LOCAL: pieces["head_group_local"],
                 GRAD_X: pieces["grad_x"],
                 SHARDS: pieces["attention_shards_in_flight"] + pieces["attention_grad_reduces"]}
    return (layer, mlp), (layer - blocks_saved["mlp"], attention)


def _per_layer(m, value):
    """The mean over the layers of ``value(sparse)``: the value itself where every layer is of one kind."""
    return sum(layers * value(sparse) for sparse, layers in m.layer_kinds) / m.num_layers


def _tsp_layer_transient(m, setting, D, tokens, tile, attn_shard, ffn_shard, grad_x_bytes, sparse):
    """One TSP layer's backward buffers (``plan_tsp``'s detail), by name."""
    e, acc, B = setting.precision.element, setting.precision.accumulate, setting.micro_batch
    S = tokens * D // B
    kv_heads = max(m.num_kv_heads // D, 1)
    q_heads = max(m.num_heads // D, 1)
    if sparse:
        # One expert's tokens at a time (their expected count, k N / E, at most a tile), or a tile of the
        # shared expert.
        expert_tokens = min(tile, -(-m.experts_per_token * tokens // m.num_experts))
        intermediates = 6 * max(expert_tokens * m.expert_size, tile * m.shared_expert_size / D) * e
    else:
        intermediates = (8 if tile < tokens else 6) * tile * (m.intermediate_size / D) * e
    return {
        # backward of one head group: K, V, the gather buffer, the two dK/dV
        # copies in the model dtype and their sums (fp32 with tsp.fp32_accumulators), over the full sequence
        "kv_head_group": 2 * B * S * kv_heads * m.head_dim * (4 * e + (acc if setting.fp32_accumulators else e)),
        # of the local tokens, meanwhile: the group's queries before and after rotary, their output's gradient
        # and their own; the set's keys before rotary (for its backward) and, with another group to come, its
        # keys and its K/V on their way to the gather
        "head_group_local": tokens * m.head_dim * e * (4 * q_heads + (4 if D > 1 else 1) * kv_heads),
        "attention_shards_in_flight": 2 * attn_shard * e,
        # every head group's gradient reduce stays posted until the attention's backward ends
        "attention_grad_reduces": m.attention_params * acc,
        "mlp_shards_in_flight": 2 * ffn_shard * e,
        "mlp_accumulators": 3 * ffn_shard * acc,  # travelling, arriving, own partial
        # one shard's gradients of a tile (a sparse layer: of one expert's tokens);
        # tiled, also the tile's gate and up computed again
        "mlp_shard_intermediates": intermediates,
        "grad_x": tokens * m.hidden_size * grad_x_bytes,
    }


def plan_tsp(setting, vocab_parallel):
    """TSP: ds_tsp's blocks, with the vocabulary folded (``tsp.vocab_parallel``) or
    the embedding and LM head whole on every rank. A sparse layer's experts are
    sharded ``E/D`` per rank and travel round the ring as the MLP's shards do
    (``ds_tsp.blocks.moe.module``)."""
    m, p, D = setting.model, setting.precision, setting.devices
    e, acc, B, H = p.element, p.accumulate, setting.micro_batch, m.hidden_size
    problem = tsp_shape_problem(m, D)
    S = padded_length(setting.seq_len, D)  # two zigzag chunks per rank
    tokens = B * S // D
    # tsp.token_tile: the MLP runs the local tokens in tiles once they exceed one
    tile = min(tokens, setting.token_tile) if setting.token_tile else tokens
    mlp_tiled = tile < tokens
    attn_shard = max(tsp_attention_shard(m, D, r) for r in range(D))
    ffn_shard = {sparse: m.ffn_params(sparse) / D for sparse, _ in m.layer_kinds}
    layer_params = {sparse: attn_shard + ffn_shard[sparse] + m.layer_replicated_params(sparse)
                    for sparse, _ in m.layer_kinds}
    vocab_rows = vocab_rows_per_rank(m.vocab_size, D) if vocab_parallel else m.vocab_size
    vocab = vocab_rows * H * (1 if m.tie_word_embeddings else 2)
    all_params = sum(layers * layer_params[sparse] for sparse, layers in m.layer_kinds) + H + vocab
    if setting.lora_rank:
        adapters = {sparse: lora_adapter_params(m, setting.lora_rank, setting.lora_targets, D, sparse)
                    for sparse, _ in m.layer_kinds}
        states, optimizer_host = lora_model_states(
            all_params, sum(layers * adapters[sparse] for sparse, layers in m.layer_kinds), p, setting.zero_stage, 1,
            setting.offload_optimizer, layer_adapter_params=max(adapters.values()))
    else:
        states, optimizer_host = model_states(all_params, p, setting.zero_stage, 1, setting.offload_optimizer,
                                              layer_params=max(*layer_params.values(), vocab_rows * H))

    block_saved = {sparse: {block: tokens * saved for block, saved in tsp_block_saved_per_token(
        m, e, setting.tsp_attention_backward, mlp_tiled, sparse, setting.recompute_norms).items()}
        for sparse, _ in m.layer_kinds}
    for sparse, blocks in block_saved.items():
        if setting.lora_rank:  # the merged shards W + sBA, kept from forward to backward
            blocks["attention"] += e * attn_shard
            blocks["mlp"] += e * ffn_shard[sparse]
        if setting.activation_checkpointing:
            # DeepSpeed's checkpoint keeps the recomputed layer's output through the layer's backward (ds_tsp's
            # host checkpoint frees it); with tsp.recompute_norms the first norm keeps the layer's checkpointed
            # input, already counted as such.
            blocks["attention"] += tokens * e * H * ((0 if setting.offload_activations else 1)
                                                     - (1 if setting.recompute_norms else 0))
    layer_saved = {sparse: sum(blocks.values()) for sparse, blocks in block_saved.items()}
    # cos/sin of the local tokens plus, per sequence, the row of the largest position (rotary.rotary_tables)
    model_saved = model_level_saved(m, e, tokens, rope_rows=tokens + B, recompute_norm=setting.recompute_norms)
    model_saved += load_balancing_saved(m, tsp=True)
    checkpoints = _checkpoints(setting, tokens, setting.prefetch_checkpoints)
    if vocab_parallel:  # no logits tensor: the loss saves labels and the log-sum-exp
        logits_saved, vocab_transient = tsp_vocab_memory(m, p, D, tokens, setting.logits_tile_mib)
        logits_held = 0
        # A frozen head (LoRA) keeps no gradient accumulators on its ring.
        loss_backward = sum(vocab_transient[k] for k in HEAD_BACKWARD
                            if not (setting.lora_rank and k == "head_grad_accumulators"))
        # The embedding's backward keeps its route on ctx, not as saved tensors: the ids of its own rows that
        # every rank's tokens use (N expected) and the local tokens' order, instead of the ids nn.Embedding saves.
        model_saved -= tokens * INT64
        route = 2 * tokens * INT64
    else:
        logits_saved, logits_held = logits_memory(m, p, tokens, 1)
        vocab_transient = {"loss_backward": tokens * m.vocab_size * loss_backward_per_logit(p)}
        loss_backward = vocab_transient["loss_backward"]
        route = 0
    # Outside the layers only cos/sin and the embedding's ids (its route, folded) stay through the layers'
    # backward: the final norm's, the head's and the loss's saved tensors go with their own backward, which
    # runs first, so they count in the head's phase alone.
    kept_outside = rope_saved(m, e, tokens + B) + (route if vocab_parallel else tokens * INT64)
    head_saved = model_saved + route - kept_outside + logits_saved

    # The input gradient sums head groups and ring steps in fp32 (tsp.fp32_accumulators), cast once at the end;
    # without, in the model dtype, which is then the result itself. fp32 models have nothing narrower.
    grad_x_bytes = acc + 2 * e if setting.fp32_accumulators or e >= acc else 2 * e
    transients = {sparse: _tsp_layer_transient(m, setting, D, tokens, tile, attn_shard, ffn_shard[sparse],
                                               grad_x_bytes, sparse) for sparse, _ in m.layer_kinds}
    every_layer = sum(layers * layer_saved[sparse] for sparse, layers in m.layer_kinds)
    # One layer's backward at its peak (of the larger kind where dense and sparse layers differ), the MLP's or
    # the attention's: (kind, saved tensors still live, the backward's buffers by term).
    phase = max(((sparse, live, pieces) for sparse, _ in m.layer_kinds
                 for live, pieces in _tsp_backward_phases(setting, block_saved[sparse], transients[sparse],
                                                          every_layer)),
                key=lambda found: found[1] + sum(found[2].values()))
    sparse, layers, layer_pieces = phase
    layer = transients[sparse]
    detail = {
        "saved_for_backward": (model_saved + every_layer + logits_saved
                               if not setting.activation_checkpointing else None),
        "embedding_route": route,
        "logits_output": logits_held,
        **layer,
        **vocab_transient,
    }
    # The embedding's gradient, counted among the model states, is made last, by its own backward: no layer's
    # backward holds it. Not so a tied head's, ZeRO-3's partition (one buffer made once) or an offloaded
    # optimizer's (one layer's gradients at a time); a LoRA run's frozen embedding has none.
    unmade = 0 if (m.tie_word_embeddings or setting.zero_stage >= 3 or setting.offload_optimizer
                   or setting.lora_rank) else vocab_rows * H * p.grad
    layer_backward = sum(layer_pieces.values()) - unmade
    # The head's phase, the loss's backward (folded: the head's ring) with the
    # final norm's, the head's and the loss's saved tensors, is the first thing
    # backward runs, before any parameter holds a gradient: it overlaps the
    # gradients' memory rather than adding to it. The embedding's runs last,
    # with all of them.
    head_beyond_grads = _loss_backward_beyond(setting, head_saved + loss_backward, states)
    embedding_backward = vocab_transient.get("embedding_backward", 0)
    # With checkpointing no layer is recomputed yet while the loss runs its
    # backward, and none is left when the embedding runs its: the recomputed
    # layer's saved tensors (counted in the activations) are not live then.
    # Without, every layer's are live while the loss runs its backward, those
    # the layer's attention phase has freed included.
    not_live = layers if setting.activation_checkpointing else 0
    head_phase = max(head_beyond_grads - (not_live or layers - every_layer), 0)
    embedding_backward = max(embedding_backward - not_live, 0)
    layer_terms = ({CHECKPOINT_BACK if setting.offload_activations else CHECKPOINTS: checkpoints,
                    RECOMPUTED: layers} if setting.activation_checkpointing else {EVERY_LAYER: layers})
    memory = {**states, "activations": kept_outside + checkpoints + layers, "logits": logits_held,
              "transient": max(layer_backward, head_phase, embedding_backward)}
    # Where a layer's backward sets the peak, the model states in it lack the embedding's gradient.
    layer_binds = layer_backward >= max(head_phase, embedding_backward)
    terms = {STATES: sum(states.values()) - (unmade if layer_binds else 0), **layer_terms,
             KEPT_OUTSIDE: kept_outside + logits_held,
             **({k: v for k, v in layer_pieces.items() if v} if layer_binds else
                transient_terms({}, {HEAD_PHASE: head_phase, EMBEDDING_BACKWARD: embedding_backward}))}

    if problem:
        forward = backward = per_step = float("nan")
    else:
        def per_layer(direction):
            return _per_layer(m, lambda sparse: tsp_bytes_per_layer(m, S, B, D, e, direction, sparse=sparse))

        forward, backward = per_layer("forward"), per_layer("backward")
        by_op = tsp_step_bytes_by_op(m, S, B, D, e, vocab_parallel=vocab_parallel,
                                     activation_checkpointing=setting.activation_checkpointing)
        per_step = sum(by_op.values())
    parts = {} if problem else {TSP_PARTS[op]: CommPart(nbytes, D, 1, op) for op, nbytes in by_op.items() if nbytes}
    notes = problem or ("" if S == setting.seq_len else f"sequence padded to {S}")

    def recomputed(sparse):
        # A TSP expert recomputes its gate, up and down projections in backward; a tiled MLP its gate and up.
        if sparse:
            return m.experts_per_token * m.expert_params + m.shared_expert_params
        return 2 / 3 * m.mlp_params if mlp_tiled else 0

    flops, attention_flops = _flops(m, setting, B, S, 1 / D, tsp=True, fused_head=vocab_parallel,
                                    ffn_recompute=recomputed)
    return StrategyPlan(tsp_name(D, vocab_parallel), f"tsp={D}, vocab_parallel={str(vocab_parallel).lower()}",
                        memory, forward, backward, per_step, flops, tokens, setting, feasible=problem is None,
                        notes=notes, detail=detail, terms=terms, host=host_memory(setting, tokens, optimizer_host),
                        comm_parts=parts, attention_flops_per_step=attention_flops, devices_per_replica=D)


def loss_backward_per_logit(p):
    """Bytes per logit of a dense loss's backward: the fp32 gradients of the
    NLL and of the log-softmax and, where the model's dtype is narrower, the
    logits' gradient cast back to it (an fp32 model has no such copy)."""
    return 2 * p.accumulate + (p.element if p.element < p.accumulate else 0)


def _loss_backward_beyond(setting, loss_backward, states):
    """What the loss backward adds to the peak: it runs first, when no gradient
    exists yet, except under ZeRO-3, whose gradient partition is one buffer
    allocated once for the whole run."""
    return loss_backward if setting.zero_stage >= 3 else max(loss_backward - states["grads"], 0)


def _baseline_problem(m, t, c, kind, seq_len, experts_split):
    nq, nkv = m.num_heads, m.num_kv_heads
    dense = m.num_layers > m.moe_layers
    if nq % t or (nkv % t and t % nkv) or (dense and m.intermediate_size % t):
        return f"heads {nq}/{nkv} or intermediate_size {m.intermediate_size} do not split over tp={t}"
    if m.is_moe and experts_split and (m.expert_size % t or m.shared_expert_size % t):
        return f"the experts' intermediate sizes {m.expert_size}/{m.shared_expert_size} do not split over tp={t}"
    if kind == "ulysses" and (nq // t) % c:
        return f"{nq // t} query heads per TP rank do not split over sp={c}"
    if kind == "allgather" and seq_len % (2 * c):
        return f"seq_len {seq_len} is not a multiple of 2*cp = {2 * c}"
    return None


def _baseline_ffn_params(m, t, sparse):
    """One device's feed-forward parameters under ``t``-way tensor parallelism:
    the dense MLP's ``F`` split; a sparse layer's experts split by ``F_e``
    (Megatron's expert tensor parallelism), its shared expert by ``F_s``."""
    if not sparse:
        return m.mlp_params / t
    return (m.num_experts * m.expert_params + m.shared_expert_params) / t


def plan_baseline(setting, name, layout, t, c, dp, kind, mlp_tile=0, tiled_loss=False, vocab_parallel=True,
                  logits_kept=True, experts_split=True):
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
    all-reduce after it, as AutoTP does). TiledMLP tiles dense MLPs only."""
    m, p = setting.model, setting.precision
    e, B, S, L, H = p.element, setting.micro_batch, setting.seq_len, m.num_layers, m.hidden_size
    d, nq = m.head_dim, m.num_heads
    kinds = m.layer_kinds
    kv_heads = max(m.num_kv_heads / t, 1)  # replicated when fewer than t
    tokens = B * S / c
    mlp_tiled = bool(mlp_tile) and tokens > mlp_tile
    replica_group = c * dp  # ranks holding the same weights: gradient sync and ZeRO
    attention_params = (m.attention_params - 2 * m.num_kv_heads * d * H) / t + 2 * kv_heads * d * H

    def ffn_t(sparse):  # the ranks splitting a layer's feed-forward block
        return t if experts_split or not sparse else 1

    layer_params = {sparse: attention_params + _baseline_ffn_params(m, ffn_t(sparse), sparse)
                    + m.layer_replicated_params(sparse) for sparse, _ in kinds}
    all_layers = sum(layers * layer_params[sparse] for sparse, layers in kinds)
    vocab_shards = t if vocab_parallel else 1
    embedding = m.embedding_params / t if vocab_parallel else \
        m.embedding_params - (0 if m.tie_word_embeddings else m.vocab_size * H * (t - 1) / t)
    if setting.lora_rank:
        adapters = {sparse: lora_adapter_params(m, setting.lora_rank, setting.lora_targets, t, sparse)
                    for sparse, _ in kinds}
        states, optimizer_host = lora_model_states(
            all_layers + embedding, sum(layers * adapters[sparse] for sparse, layers in kinds), p,
            setting.zero_stage, replica_group, setting.offload_optimizer, layer_adapter_params=max(adapters.values()))
    else:
        states, optimizer_host = model_states(all_layers + embedding, p, setting.zero_stage, replica_group,
                                              setting.offload_optimizer,
                                              layer_params=max(*layer_params.values(), m.vocab_size * H / t))

    ulysses = kind == "ulysses" and c > 1
    layer_saved = {}
    for sparse, _ in kinds:
        layer_saved[sparse] = tokens * hf_layer_saved_per_token(m, e, t, ulysses, mlp_tiled and not sparse, sparse,
                                                                experts_split)
        layer_saved[sparse] += hf_moe_layer_saved(m) if sparse else 0
        if kind == "allgather" and c > 1:  # the gathered full-sequence K/V replaces the local one
            layer_saved[sparse] += (B * S - tokens) * 2 * kv_heads * d * e
    # HF rotary: one row per position
    model_saved = model_level_saved(m, e, tokens, rope_rows=S / c) + load_balancing_saved(m, tsp=False)
    layers, layer_terms = _layers(setting, tokens, layer_saved)
    zero3 = setting.zero_stage >= 3 and replica_group > 1
    if tiled_loss:
        logits_saved, loss_backward = tiled_loss_memory(m, p, tokens, vocab_shards, setting.logits_tile_mib, zero3)
        logits_held = 0
    else:
        logits_saved, logits_held = logits_memory(m, p, tokens, vocab_shards)
        logits_held = logits_held if logits_kept else 0
        loss_backward = tokens * m.vocab_size / vocab_shards * loss_backward_per_logit(p)
        if zero3:  # the LM head gathered whole, and its whole gradient before the reduce-scatter
            loss_backward += 2 * m.vocab_size / vocab_shards * H * e

    def ffn_grads(sparse):
        """Gradients of the feed-forward intermediates in backward; tiled, of one
        tile, with the tile's four recomputed; a sparse layer's of every slot."""
        if not sparse:
            return (7 * mlp_tile if mlp_tiled else 3 * tokens) * m.intermediate_size / t * e
        return 3 * tokens * (m.experts_per_token * m.expert_size + m.shared_expert_size) / ffn_t(sparse) * e

    detail = {
        "saved_for_backward": (model_saved + sum(layers * layer_saved[sparse] for sparse, layers in kinds)
                               + logits_saved if not setting.activation_checkpointing else None),
        "logits_output": logits_held,
        "mlp_grads": max(ffn_grads(sparse) for sparse, _ in kinds),
        "grad_x": 2 * tokens * H * e,
        "all_to_all_buffers": tokens * (nq / t + 2 * kv_heads) * d * e if ulysses else 0,
        "full_kv_grads": 2 * B * S * 2 * kv_heads * d * e if kind == "allgather" and c > 1 else 0,
        "zero3_gathered_layers": 2 * max(layer_params.values()) * e if zero3 else 0,
        "loss_backward": loss_backward,
    }
    layer_pieces = {MLP_TILE: detail["mlp_grads"], GRAD_X: detail["grad_x"],
                    ALL_TO_ALL: detail["all_to_all_buffers"], FULL_KV: detail["full_kv_grads"],
                    ZERO3_GATHERED: detail["zero3_gathered_layers"]}
    layer_backward = sum(layer_pieces.values())
    # As for TSP: the loss backward runs before any gradient exists (but
    # ZeRO-3's partition) and, with checkpointing, before any layer is recomputed.
    not_live = max(layer_saved.values()) if setting.activation_checkpointing else 0
    loss_backward_beyond = max(_loss_backward_beyond(setting, loss_backward, states) - not_live, 0)
    memory = {**states, "activations": model_saved + layers, "logits": logits_saved + logits_held,
              "transient": max(layer_backward, loss_backward_beyond)}
    terms = {STATES: sum(states.values()), **layer_terms, MODEL_LEVEL: model_saved + logits_saved + logits_held,
             **transient_terms(layer_pieces, {LOSS_BACKWARD: loss_backward_beyond})}

    def all_reduce(group, nbytes):
        return 2 * (group - 1) / group * nbytes

    def gather(group, nbytes):  # all-gather / reduce-scatter / all-to-all: (p-1)/p of the full tensor
        return (group - 1) / group * nbytes

    grad_reduce = gather if setting.zero_stage >= 1 else all_reduce  # reduce-scatter under ZeRO

    def tp_layer(sparse):  # after attention and after a split feed-forward block
        return all_reduce(t, tokens * H * e) * (2 if ffn_t(sparse) > 1 else 1)

    sp_layer = {"ulysses": gather(c, tokens * (2 * nq / t + 2 * kv_heads) * d * e),  # q, k, v in; output back
                "allgather": gather(c, B * S * 2 * kv_heads * d * e)}.get(kind, 0)

    def zero3_layer(sparse):
        return gather(replica_group, layer_params[sparse] * e) if zero3 else 0

    def forward_layer(sparse):
        return tp_layer(sparse) + sp_layer + zero3_layer(sparse)

    def layer_grads(sparse):
        return grad_reduce(replica_group, layer_params[sparse] * p.grad)

    passes = 3 if setting.activation_checkpointing else 2  # forward, backward (and the forward recomputed)
    # input-gradient all-reduces, reversed all-to-alls, dK/dV reduce-scatter, re-gather, then the gradients
    per_step = sum(layers * (passes * forward_layer(sparse) + layer_grads(sparse)) for sparse, layers in kinds)
    vocab_tp = 2 * all_reduce(t, tokens * H * e)  # vocab-parallel embedding output, LM-head input grad
    embedding_grads = grad_reduce(replica_group, embedding * p.grad)
    param_gather = gather(replica_group, (all_layers + embedding) * e) if setting.zero_stage in (1, 2) else 0
    zero3_embedding = 2 * gather(replica_group, embedding * e) if zero3 else 0
    for once_per_step in (vocab_tp, embedding_grads, param_gather, zero3_embedding):
        per_step += once_per_step

    def summed(value):
        return sum(layers * value(sparse) for sparse, layers in kinds)

    parts = {TP_ACTIVATIONS: CommPart(passes * summed(tp_layer) + vocab_tp, t, 1, "all_reduce"),
             SP_ALL_TO_ALL if kind == "ulysses" else CP_KV: CommPart(
                 L * passes * sp_layer, c, t, "all_to_all" if kind == "ulysses" else "all_gather"),
             ZERO3_GATHER: CommPart(passes * summed(zero3_layer) + zero3_embedding, replica_group, t, "all_gather"),
             GRAD_REDUCE: CommPart(summed(layer_grads) + embedding_grads, replica_group, t,
                                   "reduce_scatter" if setting.zero_stage >= 1 else "all_reduce"),
             PARAM_GATHER: CommPart(param_gather, replica_group, t, "all_gather")}
    problem = _baseline_problem(m, t, c, kind, S, experts_split)

    def recomputed(sparse):  # TiledMLP runs a dense MLP's forward again in backward
        return m.mlp_params if mlp_tiled and not sparse else 0

    flops, attention_flops = _flops(m, setting, B, S, 1 / (t * c), tsp=False, ffn_recompute=recomputed,
                                    ffn_replicas=lambda sparse: t // ffn_t(sparse))
    return StrategyPlan(name, layout, memory, _per_layer(m, forward_layer),
                        _per_layer(m, lambda sparse: forward_layer(sparse) + layer_grads(sparse)), per_step, flops,
                        tokens, setting, feasible=problem is None, notes=problem or "", detail=detail, terms=terms,
                        host=host_memory(setting, tokens, optimizer_host),
                        comm_parts={k: v for k, v in parts.items() if v.nbytes},
                        attention_flops_per_step=attention_flops, devices_per_replica=t * c)


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


def baseline_plans(setting):
    """DP, TP, SP (Ulysses), CP (all-gather) and every TP+SP split of ``setting.devices``."""
    N = setting.devices
    plans = [plan_baseline(setting, f"DP({N})", f"dp={N}", 1, 1, N, "none"),
             plan_baseline(setting, f"TP({N})", f"tp={N}", N, 1, 1, "none"),
             plan_baseline(setting, f"SP-Ulysses({N})", f"sp={N}", 1, N, 1, "ulysses"),
             plan_baseline(setting, f"CP-allgather({N})", f"cp={N}", 1, N, 1, "allgather")]
    for t in range(2, N):
        if N % t == 0:
            plans.append(plan_baseline(setting, f"TP+SP({t}x{N // t})", f"tp={t} x sp={N // t}", t, N // t, 1,
                                        "ulysses"))
    return plans


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
    """The feasible plans whose peak fits ``memory_per_device_bytes``, best first:
    fewest bytes received per FLOP computed (the step's communication against
    its compute; one fast interconnect is assumed for all ``N`` devices, so a
    layout that would spill across nodes is not penalised), then least memory."""
    fits = [p for p in plans if p.feasible and p.total <= memory_per_device_bytes]
    return sorted(fits, key=lambda p: (p.comm_per_step / p.flops_per_step, p.total))
