"""Per-device memory, in bytes, as the plans (``tsp_plan``, ``baselines``) add it up:
``weights + grads + optimizer + activations + logits + transient`` (a peak
estimate), and what offloading puts in host memory instead.

* Model states: mixed precision is 16 B/param (2 bf16 weight, 2 bf16 grad, 12
  fp32 master + Adam m, v), fp32 is 4 + 4 + 8, plus 4 under ZeRO, whose
  optimizer keeps its own fp32 master partition even of an fp32 model. ZeRO partitions them over the
  axis on which weights are replicated: DP's, and also the sequence axis of
  SP/CP/TP+SP, as DeepSpeed does for Ulysses (ALST). TP and TSP spend all ``N``
  devices on one replica: nothing is left for ZeRO to partition. With
  ZeRO's ``offload_optimizer: cpu`` the fp32 master weights and Adam moments
  live in host memory, and so do the gradients, in fp32, as DeepSpeed's
  ZeRO-Offload copies each one out when backward produces it: the device keeps
  its weights and one layer's gradients at a time.
* LoRA (``lora_rank``): the base is frozen, held in the model dtype with no
  gradient, master or optimizer state (``lora_model_states``); the adapters
  of ``lora_targets`` carry the full states, split as ds_tsp splits them
  (``shapes.lora_adapter_params``; TP alike). TSP keeps each layer's merged
  shard ``W + sBA`` (``ds_tsp.injection.lora``) from forward to backward: one more
  copy of its shards, in the model dtype, among the saved tensors; its
  frozen folded head's backward ring keeps no gradient accumulators.
* Activations are the tensors autograd saves for backward, counted tensor by
  tensor (Korthikanti et al. 2022, "Reducing Activation Recomputation", method).
  Their ``S*B*H*(34 + 5*a*S/H)`` bytes per layer is for a GPT layer (LayerNorm,
  4H GeLU MLP, dropout, softmax kept); the baselines here run the Hugging Face
  Llama layer with flash/SDPA attention, so the ``S^2`` term is absent (the
  kernel keeps a log-sum-exp instead) and the count is that layer's own, per
  token, ``e`` bytes per element:

      RMSNorm x2      2 * (4H + 4 + e*H)    fp32 copy of the input, 1/rms, normalised pre-weight
      q/k/v + MLP in  2 * e*H               the norms' outputs, saved by the projections
      attention       e*(nq + 2nkv)*d + e*nq*d + 4*nq     q, k, v (rotated), output, lse
      gated MLP       4 * e*F               gate, act(gate), up, act*up

  TP divides the head and ``F`` terms by ``t`` and keeps the rest replicated
  (AutoTP/Megatron without its sequence parallelism); Ulysses divides tokens
  by ``c`` and also saves the attention output before its return all-to-all;
  all-gather CP keeps the gathered full-sequence K/V. TSP is modelled by what
  ``ds_tsp.blocks.attention.schedule`` and ``ds_tsp.blocks.mlp`` actually save: the attention's local
  ``x`` (its backward projects ``q``, ``k``, ``v`` again from it) and, with its
  fused backward, each head group's output and lse (sliding-window layers
  recompute them instead), the MLP's local ``x`` and each shard's gate and up
  projections, plus the same norms:
  ``8H + 8 + 4e*H + 2e*F [+ e*nq*d + 4*nq]`` per local token. Both counts, with the
  embedding ids, cos/sin, final norm, LM-head input and loss, equal to the
  byte what ``torch.autograd.graph.saved_tensors_hooks`` sees on CPU
  (tests/test_plan_memory.py; CPU SDPA saves the tensors flash attention does). The
  folded embedding saves no ids; the route it keeps instead (two int64 a
  token) is counted but not seen by the hooks.
  With activation checkpointing every layer keeps its input (``e*H`` per
  token, replicated over TP) and one layer is recomputed at a time; with
  ``cpu_checkpointing`` those inputs live in pinned host memory, every rank's
  of a node in that node's, and one comes back to the device at a time.
* Mixture of experts: a sparse layer saves, per token, the router's softmax,
  top-k and renormalisation tensors and the routing weights; ds_tsp's MoE
  block adds the token order by expert (two int64 a slot) and keeps no
  expert intermediate (each expert recomputes its projections in backward);
  Hugging Face's grouped experts keep, per top-k slot, the routed hidden
  state, ``4 F_e`` intermediates, the expert's output and three int64
  indices. The load-balancing loss (``output_router_logits``) adds its own
  softmax and, in ds_tsp, each layer's real-token mask. Both counts are exact
  against the saved-tensor hooks too (what autograd still holds when the
  forward returns). Under the token all-to-all (``tsp.moe_schedule``
  "all_to_all", and always where the experts fold across data-parallel
  replicas, ``expert_parallel_size > D``) the block also keeps the rows its
  experts received and the outputs returned to it, ``2 k H`` elements a local
  token (routing spread evenly), with a shared expert its output and ring
  steps; its backward holds the rows' gradients and its experts' gradient,
  summed at rest, instead of the ring's shards and accumulators.
* Hybrids of recurrent layers (Gated DeltaNet, KDA, Mamba-2, Mamba-1, short
  convolutions: ``planning.recurrent``): a TSP recurrent layer saves its
  local input alone (and its norm's tensors), and its backward holds its
  mixer's recomputed forward with its gradients (a Gated DeltaNet's or KDA's
  one head group at a time, the others every head or channel of the local
  tokens at once) and every rank's chunks' state maps and their
  initial-state gradients: no K/V. Hugging
  Face's layer saves its mixer's ``hf_saved_per_token``, an estimate of the
  kernels a training run takes (flash-linear-attention's, mamba_ssm's). The
  two kinds of mixer and of feed-forward block are counted each by its own
  count of layers (Nemotron-H's layers of one block, each kind by its own);
  where a model mixes both (a linear layer among dense and sparse ones), one
  layer's backward peak takes the larger of each.
* Token tiles (``tsp.token_tile``; ALST's TiledMLP for its baseline): when the
  local tokens exceed one tile, the MLP saves only its input and recomputes
  its intermediates tile by tile in backward, so they are bounded by the tile
  (TSP: ``2e*F`` per token leaves the saved tensors; HF: ``4e*F/t``). Query
  tiles bound the attention kernel's working set, which flash attention keeps
  below what this model resolves; the gathered K/V of one head group stays
  whole, with its gradients.
* Logits: the model output ``e*V`` and the fp32 log-probabilities the loss
  saves, per local token (``V/t`` under TP's vocab-parallel head). TSP's folded
  vocabulary has neither: its fused LM head + loss saves the labels and the
  log-sum-exp only; so does a tiled loss (ALST's).
* Transient: the larger of the loss backward (dense logit gradients: the
  NLL's and the log-softmax's in fp32 and, for a model narrower than fp32, the
  cast back; under ZeRO-3 also the LM head gathered whole with its whole
  gradient) and one
  layer's backward buffers; for TSP that is one head group's full-sequence K/V
  with its gradients, the group's local queries and keys (before and after
  rotary, with their gradients; the next group's keys on their way), the
  weight shards in flight, the fp32 gradient reduces and ring accumulators,
  one MLP tile's intermediates, and the input-gradient accumulator (fp32 with
  ``tsp.fp32_accumulators``, the default; the model dtype without). TSP's
  head's phase runs before any layer is recomputed: the final norm's, the
  head's and the loss's saved tensors count there only, with the folded loss
  backward's one fp32 logits tile (``tsp.logits_tile_mib`` at most, turned
  into ``dz`` in place; and ``dz`` cast to a narrower model dtype), the fp32
  input gradient, two received head shards and four fp32 shard-gradient
  buffers of the ring (one and two at D = 2); the folded embedding's backward
  holds its shard's gradient in fp32 and the rows exchanged. No layer's
  backward holds the embedding's gradient, made last. The forward's output
  accumulators are freed before backward's buffers exist and stay below them.
"""

from ds_tsp.planning.shapes import FLOAT32, INT64, logits_tile_tokens, vocab_rows_per_rank

MEMORY_PARTS = ("weights", "grads", "optimizer", "activations", "logits", "transient")
HEAD_BACKWARD = ("logits_tiles", "grad_hidden", "head_shards_in_flight", "head_grad_accumulators")

# Names of the terms a plan's peak is made of (``StrategyPlan.terms``), as the
# longest-sequence search reports the one that binds.
STATES = "model states"
CHECKPOINTS = "checkpointed layer inputs"
CHECKPOINT_BACK = "checkpointed input back from host"
RECOMPUTED = "saved tensors of the recomputed layer"
EVERY_LAYER = "saved tensors of every layer"
MODEL_LEVEL = "embedding, final norm, LM-head input and loss tensors"
# TSP's: what outside the layers stays live through their backward, and the
# head's phase, with the final norm's, the head's and the loss's saved tensors.
KEPT_OUTSIDE = "rotary tables, token ids and returned logits"
HEAD_PHASE = "final norm, LM head and loss backward"
KV_GROUP = "K/V of one head group"
STATE_MAPS = "gathered chunk state maps"
HEAD_GROUP_LOCAL = "local queries and keys of one head group"
RECURRENT_LOCAL = "recurrent mixer's recomputed forward (a head group's, or every head's)"
GRAD_X = "input-gradient buffers"
MLP_TILE = "MLP intermediates"
EXPERT_ROWS = "routed rows' gradients"
SHARDS = "weight shards and gradient buffers in flight"
LOSS_BACKWARD = "loss backward (logits)"
EMBEDDING_BACKWARD = "embedding backward"
ALL_TO_ALL = "Ulysses all-to-all buffers"
FULL_KV = "full-sequence K/V gradients"
ZERO3_GATHERED = "ZeRO-3 gathered layers"
HOST_CHECKPOINTS = "host memory for offloaded checkpoints"
HOST_OPTIMIZER = "host memory for the offloaded optimizer"


def router_saved_per_token(m, e):
    """Bytes a sparse layer's Hugging Face router saves per token (ds_tsp runs
    the same module): the float32 softmax, the top-k indices and, where the
    top-k weights are renormalised in place, their pre-division copy and the
    divisor; with ``output_router_logits`` also the load-balancing loss's own
    softmax (in the logits' dtype). That loss's top-k keeps nothing: its
    values are dropped, and its saved indices with them."""
    k = m.experts_per_token
    saved = FLOAT32 * m.num_experts + INT64 * k + ((FLOAT32 * k + FLOAT32) if m.renormalise_top_k else 0)
    return saved + (e * m.num_experts if m.output_router_logits else 0)


def routing_weight_bytes(m, e):
    """Bytes of one routing weight as the experts receive it: float32 (Mixtral), else the model's dtype."""
    return FLOAT32 if m.router_weights_fp32 else e


def rms_norm_saved_per_token(m, e, recompute=False, width=None):
    """Bytes an RMSNorm over ``width`` values (default: the hidden size) saves
    per token: Hugging Face's keeps its float32 copy of the input, ``1/rms``
    and the normalised value in the model's dtype (in float32 where it scales
    in float32: ``ModelShape.norm_in_float32``, ``norm_weight_in_float32``);
    recomputed in backward (``tsp.recompute_norms``) it keeps only its input."""
    width = width or m.hidden_size
    if recompute:
        return e * width
    wide = m.norm_in_float32 or m.norm_weight_in_float32
    return FLOAT32 * width + FLOAT32 + (FLOAT32 if wide else e) * width


def rms_norm_saved_per_call(m, e, recompute=False, width=None):
    """Bytes an RMSNorm saves once a call, whatever the tokens: a norm that scales by ``1 + w`` in float32 keeps
    that factor, one scaling by ``w`` in float32 its weight's float32 copy (none for a float32 weight), ``width``
    float32 values; others, or a recomputed one, nothing."""
    copied = m.norm_in_float32 or (m.norm_weight_in_float32 and e != FLOAT32)
    return FLOAT32 * (width or m.hidden_size) if copied and not recompute else 0


def tsp_block_saved_per_token(m, e, attention_backward, tiled=False, sparse=False, recompute_norms=False,
                              linear=False, all_to_all=False):
    """Bytes ds_tsp's decoder layer saves per local token, by block
    (``{"attention": ..., "mlp": ...}``), each with the RMSNorm before it
    (with ``recompute_norms`` the attention's runs inside it and saves nothing more):
    the attention's local x (and, with the fused backward, its output and
    log-sum-exp in fp32 or wider; a latent attention's down projections'
    outputs), the MLP's local x and, unless the local
    tokens run in several tiles (``tiled``), the attention's projections of
    every head group (queries with their output gates, keys and values) and
    every MLP shard's gate and up projections (``F`` values each over the D
    steps; an ungated MLP's up alone). Backward frees the MLP's before the
    attention's backward runs. A recurrent layer (``linear``, ``ds_tsp.blocks.linear``'s schedules)
    saves its local x alone in the
    attention's place; its norm runs outside it, so a recomputed one keeps
    the layer's input.

    A sparse layer (``ds_tsp.blocks.moe.module``) saves its local x, its routed rows' gate and up
    projections unless ``tiled`` (``k`` rows of ``2 F_e`` a local token, as routing spread
    evenly gives them under the all-to-all; tiled, backward recomputes them), the router's tensors
    (``router_saved_per_token``), the routing weights, the token order by
    expert and top-k slot (two int64 a slot), with a shared expert its gate's
    sigmoid and, with ``output_router_logits``, the float32 mask of real
    tokens its load-balancing statistics multiply by. Under the token
    all-to-all (``all_to_all``, ``ds_tsp.blocks.moe.all_to_all``) also the
    rows its experts received and the outputs returned, ``k`` of each a local
    token as routing spread evenly gives them (exactly so at ``D = 1``), and
    with a shared expert its output and, its tokens in one tile, its ring
    steps' gate and up projections (``2 F_s`` a token). DeepSeek's sparse
    attention also keeps each local query's ``index_topk`` chosen keys (int32).
    """
    H, nq = m.hidden_size, m.num_heads
    norm = rms_norm_saved_per_token(m, e, recompute_norms)
    # Recomputed, the attention's norm runs inside it (ds_tsp.blocks.input_norm), which keeps the layer's input alone.
    attention, mlp = (e * H if recompute_norms and not linear else norm + e * H), norm + e * H
    if sparse:
        k = m.experts_per_token
        mlp += router_saved_per_token(m, e) + k * (routing_weight_bytes(m, e) + 2 * INT64)
        mlp += 0 if tiled else k * e * 2 * m.expert_size  # each routed row's gate and up projections
        mlp += e if m.gated_shared_expert else 0
        mlp += FLOAT32 if m.output_router_logits else 0  # the layer's real-token mask of the load-balancing loss
        if all_to_all:
            mlp += 2 * k * e * H
            mlp += e * (H + (0 if tiled else 2 * m.shared_expert_size)) if m.shared_expert_size else 0
    elif not tiled:  # the gate and up projections (up alone in an ungated MLP)
        mlp += (2 if m.mlp_gated else 1) * e * m.intermediate_size
    if not tiled and not linear and not m.is_latent:  # every head group's q (and gate), k and v projections
        attention += e * (nq * m.q_width + m.kv_projections * m.num_kv_heads * m.head_dim)
    # Each head's output (values wide: the expanded latent form's) and log-sum-exp; a latent attention with a
    # lightning indexer attends to the chosen keys under autograd and keeps neither.
    if attention_backward == "fused" and not linear and not (m.is_latent and m.index_topk):
        attention += e * nq * m.value_dim + max(e, FLOAT32) * nq
    if m.is_latent and not linear:  # the down projections' outputs: the query latent, the latent and rotary key
        attention += e * sum(m.latent_down_rows())
    if m.index_topk and not linear:  # DeepSeek's sparse attention keeps each query's chosen keys, int32
        attention += 4 * m.index_topk
    return {"attention": attention, "mlp": mlp}


# Hugging Face's default experts (``experts_implementation`` "grouped_mm") per top-k slot: the routed
# token's hidden state, the up/gate projection, act(gate), act(gate) * up, the down projection's output,
# the slot's routing weight, and three int64 index tensors (the sort's permutation and the gathers it
# drives), as the saved-tensor hooks see them in the pinned transformers (a test measures them).
HF_SLOT_ORDERINGS = 3


def hf_layer_saved_per_token(m, e, t, ulysses, mlp_tiled=False, sparse=False, experts_split=True, linear=False):
    """Bytes a Hugging Face Llama layer saves per token (flash attention, no
    dropout), heads and F split over ``t`` tensor-parallel ranks: its token
    mixer's (``hf_mixer_saved_per_token``) and the rest
    (``hf_ffn_saved_per_token``)."""
    return hf_ffn_saved_per_token(m, e, t, mlp_tiled, sparse, experts_split) + \
        hf_mixer_saved_per_token(m, e, t, ulysses, linear)


def hf_mixer_saved_per_token(m, e, t, ulysses, linear=False):
    """The attention's part of ``hf_layer_saved_per_token``, heads split over
    ``t``: q, k, v (rotated), the output and the log-sum-exp (Ulysses also the
    output before its return all-to-all). Qwen3's per-head q/k RMSNorms save
    each head's float32 input, 1/rms and normalised value; an output gate
    (Qwen3-Next, Qwen3.5) its sigmoid and the gated output. A recurrent layer
    (``linear``) saves its mixer's ``hf_saved_per_token`` instead."""
    if linear:
        return m.recurrent.hf_saved_per_token(e) / t
    d, nq = m.head_dim, m.num_heads
    attention = e * (nq + 2 * m.num_kv_heads) * d + e * nq * d + FLOAT32 * nq + (e * nq * d if ulysses else 0)
    if m.qk_norm:
        attention += (nq + m.num_kv_heads) * rms_norm_saved_per_token(m, e, width=d)
    if m.attention_output_gate:
        attention += 2 * e * nq * d
    return attention / t


def hf_ffn_saved_per_token(m, e, t, mlp_tiled=False, sparse=False, experts_split=True):
    """The rest of ``hf_layer_saved_per_token``: the two RMSNorms and the
    inputs of the blocks after them, and the feed-forward block, ``F`` split
    over ``t``; a tiled MLP (ALST's TiledMLP) saves only its input, which the
    norm's output already is.

    A sparse layer (Hugging Face's default grouped experts) saves per token the
    router's tensors (``router_saved_per_token``) and per top-k slot
    ``4e F_e / t`` + ``2e H`` + its routing
    weight + three int64 orderings; a shared expert (a gated MLP of ``F_s``
    over ``t``) also its output and its gate's sigmoid. Plus, per layer,
    ``hf_moe_layer_saved``. ``experts_split`` false: the experts whole on every
    rank of ``t`` (AutoTP)."""
    H = m.hidden_size
    replicated = 2 * rms_norm_saved_per_token(m, e) + 2 * e * H
    if not sparse:
        return replicated + (0 if mlp_tiled else 4 * e * m.intermediate_size) / t
    k, ffn_t = m.experts_per_token, t if experts_split else 1
    experts = k * 4 * e * m.expert_size / ffn_t
    slots = k * (2 * e * H + routing_weight_bytes(m, e) + HF_SLOT_ORDERINGS * INT64)
    shared = (4 * e * m.shared_expert_size / ffn_t + e * H + (e if m.gated_shared_expert else 0)) \
        if m.shared_expert_size else 0
    return replicated + router_saved_per_token(m, e) + slots + experts + shared


def load_balancing_saved(m, tsp):
    """Outside the layers, with ``output_router_logits``: what the load-balancing
    loss saves on its ``(E,)`` statistics, ds_tsp's (``moe.balance_loss``: four
    float32 vectors of ``E`` and the row count) or Hugging Face's (the mean
    probability of each expert, float32)."""
    if not (m.is_moe and m.output_router_logits):
        return 0
    return FLOAT32 * (4 * m.num_experts + 1) if tsp else FLOAT32 * m.num_experts


def hf_moe_layer_saved(m):
    """Per sparse layer, whatever the tokens: the grouped experts' int32 offsets, one an expert."""
    return 4 * m.num_experts


def rope_saved(m, e, rope_rows):
    """cos/sin: ``rope_rows`` rows of the rotated dims (``d``, or its share under a partial rotary) each."""
    return rope_rows * 2 * m.rotary_dim * e


def model_level_saved(m, e, tokens, rope_rows, recompute_norm=False):
    """Outside the layers: input ids, cos/sin (``rope_saved``), the final norm
    (``rms_norm_saved_per_token``, ``rms_norm_saved_per_call``) and the LM head's input."""
    H = m.hidden_size
    return tokens * (INT64 + rms_norm_saved_per_token(m, e, recompute_norm) + e * H) + rope_saved(m, e, rope_rows) \
        + rms_norm_saved_per_call(m, e, recompute_norm)


def logits_memory(m, p, tokens, vocab_shards):
    """(saved, held): labels and fp32 log-probs the loss saves, and the logits
    output the model returns."""
    vocab = m.vocab_size / vocab_shards
    return tokens * (INT64 + p.accumulate * vocab) + p.accumulate, tokens * p.element * vocab


def loss_backward_per_logit(p):
    """Bytes per logit of a dense loss's backward: the fp32 gradients of the
    NLL and of the log-softmax and, where the model's dtype is narrower, the
    logits' gradient cast back to it (an fp32 model has no such copy)."""
    return 2 * p.accumulate + (p.element if p.element < p.accumulate else 0)


def loss_backward_beyond(setting, loss_backward, states):
    """What the loss backward adds to the peak: it runs first, when no gradient
    exists yet, except under ZeRO-3, whose gradient partition is one buffer
    allocated once for the whole run."""
    return loss_backward if setting.zero_stage >= 3 else max(loss_backward - states["grads"], 0)


def checkpoints_on_device(setting, tokens, prefetch=False):
    """With activation checkpointing, the layers' checkpointed inputs on the
    device: every layer's, or one when they are offloaded (the one back for
    its recompute; two with ``prefetch``, the next one coming back under its
    backward); nothing without checkpointing."""
    if not setting.activation_checkpointing:
        return 0
    kept = (2 if prefetch else 1) if setting.offload_activations else setting.model.num_layers
    return kept * tokens * setting.precision.element * setting.model.hidden_size


def model_states(params, p, zero_stage, zero_group, offload_optimizer=False, layer_params=0):
    """``({weights, grads, optimizer}, host)``: device bytes of the model states
    of ``params`` parameters (ZeRO over ``zero_group``), and the host bytes of
    this rank's offloaded optimizer (``offload_optimizer``), which takes the
    fp32 master weights, the Adam moments and the fp32 gradients; the device
    then holds ``layer_params``' gradients at a time."""
    weights, grads, optimizer = params * p.weight, params * p.grad, params * p.optimizer
    if zero_stage >= 1 and p.weight >= FLOAT32:
        # ZeRO's optimizer keeps its own fp32 master partition even when the model is fp32
        optimizer += params * FLOAT32
    if zero_group > 1:
        optimizer /= zero_group if zero_stage >= 1 else 1
        grads /= zero_group if zero_stage >= 2 else 1
        weights /= zero_group if zero_stage >= 3 else 1
    host = 0
    if offload_optimizer:
        partition = params / zero_group if zero_group > 1 else params
        host = partition * (p.optimizer + FLOAT32)
        grads, optimizer = layer_params * p.grad, 0
    return {"weights": weights, "grads": grads, "optimizer": optimizer}, host


def lora_model_states(frozen_params, adapter_params, p, zero_stage, zero_group, offload_optimizer=False,
                      layer_adapter_params=0):
    """``model_states`` of a LoRA run: the adapters' full states and the frozen
    base's weights alone (the model dtype: no gradient, master or optimizer
    state; partitioned only by ZeRO-3)."""
    states, host = model_states(adapter_params, p, zero_stage, zero_group, offload_optimizer, layer_adapter_params)
    states["weights"] += frozen_params * p.weight / (zero_group if zero_stage >= 3 and zero_group > 1 else 1)
    return states, host


def host_memory(setting, checkpoint_tokens, optimizer_host):
    """Per node: every rank's offloaded layer inputs (``checkpoint_tokens``
    local tokens of ``H`` each per layer) and offloaded optimizer."""
    m, ranks = setting.model, setting.ranks_per_node
    host = {}
    if setting.offload_activations:
        host[HOST_CHECKPOINTS] = ranks * m.num_layers * checkpoint_tokens * setting.precision.element * \
            m.hidden_size
    if setting.offload_optimizer:
        host[HOST_OPTIMIZER] = ranks * optimizer_host
    return host


def tsp_vocab_memory(m, p, tsp_size, tokens, logits_tile_mib):
    """The folded vocabulary: what its fused LM head + loss saves for backward
    (labels and the log-sum-exp), and the named pieces of the head's backward
    transient (``HEAD_BACKWARD``) and of the embedding's."""
    H, e, acc = m.hidden_size, p.element, p.accumulate
    rows = vocab_rows_per_rank(m.vocab_size, tsp_size)
    tile = logits_tile_tokens(rows, tokens, logits_tile_mib)
    saved = tokens * (INT64 + acc)
    hops = tsp_size - 1
    transient = {
        # one token tile's logits in fp32, turned into dz in place, and dz cast to a narrower model dtype
        "logits_tiles": tile * rows * (acc + (e if e < acc else 0)),
        "grad_hidden": tokens * H * acc,
        # The shard in use and the next one arriving, received ones only: the
        # first in use is the rank's own weight (one received at D = 2, none alone).
        "head_shards_in_flight": min(hops, 2) * rows * H * e,
        # ring.ring_gradients: the own shard's partial kept for the end, the
        # accumulator travelling, the one arriving and this step's partial (at
        # D = 2 the own partial and the other shard's; alone, the one partial)
        "head_grad_accumulators": (min(2 * hops, 4) or 1) * rows * H * acc,
        # the local tokens' row gradients in owner order and the rows returned
        # (N expected), the shard's gradient summed in fp32 and cast back
        "embedding_backward": 2 * tokens * H * e + rows * H * (acc + e),
    }
    return saved, transient


def tiled_loss_memory(m, p, tokens, vocab_shards, logits_tile_mib, head_gathered):
    """A loss computed in token tiles from the LM head's input (ALST's tiled
    loss): it saves the labels and fp32 log-sum-exp; its backward recomputes
    one fp32 logits tile at a time (``z``, softmax, ``dz``) into the input
    gradient in fp32, with the head's weight gathered whole under ZeRO-3."""
    rows = m.vocab_size / vocab_shards
    tile = logits_tile_tokens(rows, tokens, logits_tile_mib)
    backward = 3 * tile * rows * FLOAT32 + tokens * m.hidden_size * p.accumulate
    if head_gathered:
        backward += rows * m.hidden_size * p.element
    return tokens * (INT64 + p.accumulate), backward


def transient_terms(layer_pieces, others):
    """The named terms of ``max(one layer's backward, *others)``: the layer's
    pieces (``{term: bytes}``) when its sum is the largest, else the largest
    of ``others`` (``{term: bytes}``), whole."""
    layer = sum(layer_pieces.values())
    name, largest = max(others.items(), key=lambda item: item[1], default=(None, 0))
    if layer >= largest:
        return {k: v for k, v in layer_pieces.items() if v}
    return {name: largest}
