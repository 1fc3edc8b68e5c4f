"""Bytes each TSP rank receives, per ``ds_tsp.parallel.comm`` op, as ``comm.counter``
counts them (ring algorithms): all-reduce of ``n`` bytes ``2(p-1)/p n``,
all-gather and reduce-scatter ``(p-1)/p`` of the full tensor, all-to-all
``(p-1)/p`` of the local tensor, broadcast ``n`` per non-owner, reduce
``(p-1) n`` at the owner. Per layer (``tsp_bytes_by_op``; a multi-head latent
attention's latent and rotary key take K/V's place: ``latent_attention_bytes_by_op``; a
hybrid's Gated DeltaNet layer moves its head groups and their state maps:
``delta_net_bytes_by_op``), for every layer (``tsp_layers_bytes_by_op``), for the folded
vocabulary (``tsp_vocab_bytes_by_op``) and per training step
(``tsp_step_bytes_by_op``, with ``tsp.check_batch``'s fingerprint all-gather
as the op ``batch_check``). The baselines' bytes are in ``baselines``.

A mixture-of-experts layer's experts travel round the ring as the dense MLP's
shards do, or stay at rest while the tokens go to them by all-to-all
(``ds_tsp.blocks.moe.module``, both built); ``tsp_moe_bytes_by_op`` gives that block's bytes
under either schedule, ``moe_crossover_tokens`` the micro-batch at which the
two move the same bytes, and ``cheaper_moe_schedule`` the choice
``tsp.moe_schedule: "auto"`` makes. With ``expert_parallel_size`` (``ep``, a
multiple of ``D``: DESIGN.md 6k) the experts split over ``ep`` consecutive
ranks, the TSP group and ``ep/D`` data-parallel replicas; above ``D`` the token
all-to-all over those ranks is the schedule, the ring being refused.

TSP's parameter-gradient partial sums (the attention's weight-gradient
``reduce``, the rings' gradient accumulators) travel in ``a`` bytes an element
(``grad_wire_bytes``): float32 (float64 for float64 models) by default, 2 with
a bf16 or fp16 ``communication_data_type``."""

import functools
from fractions import Fraction

from ds_tsp.planning.recurrent import GatedDeltaNet, KimiDeltaAttention, Mamba1, ShortConvolution
from ds_tsp.planning.shapes import (
    FLOAT32,
    INT64,
    ModelShape,
    model_shape,
    tsp_attention_shard,
    tsp_indexer_shard,
    tsp_qk_rows,
    tsp_shape_problem,
    vocab_rows_per_rank,
)

DIRECTIONS = ("forward", "backward", "both")
MOE_SCHEDULES = ("ring", "all_to_all")
# tsp.check_batch's fingerprint of one training micro-batch: input_ids, labels,
# position_ids and attention_mask, 4 int64 each (ds_tsp.injection.consistency).
BATCH_FINGERPRINT_BYTES = 4 * 4 * INT64


def gradient_wire_bytes(elem_bytes, grad_wire_bytes=None):
    """``a``: bytes per element of TSP's parameter-gradient partial sums on the
    wire, as ``precision.gradient_wire_dtype`` picks them: ``grad_wire_bytes`` (the
    ``communication_data_type`` a DeepSpeed config names), else the float32
    (or wider) sums' ``max(elem, 4)``; a float64 model keeps 8."""
    acc = max(elem_bytes, FLOAT32)
    return acc if grad_wire_bytes is None or acc > FLOAT32 else grad_wire_bytes


def _by_direction(forward, backward, direction):
    """``forward``, ``backward`` or their sum, per op; int where whole."""
    counts = {"forward": forward, "backward": backward,
              "both": {op: forward.get(op, 0) + backward.get(op, 0) for op in {**forward, **backward}}}[direction]
    return {op: int(v) if Fraction(v).denominator == 1 else float(v) for op, v in counts.items()}


def _one_kind(m, asked, flag, count, kinds, total):
    """``asked`` as given, else the model's one kind of layer for ``flag``:
    ``count`` of its ``total`` layers holding such a block are of ``kinds[1]``, the others of ``kinds[0]``."""
    if asked and not count:
        raise ValueError(f"{m.name} has no {kinds[1]} layer: {flag}=True asks for one")
    if asked is not None:
        return bool(asked)
    if 0 < count < total:
        raise ValueError(f"{m.name} has {total - count} {kinds[0]} and {count} {kinds[1]} layers: "
                         f"say which with {flag}=")
    return bool(count)


def _layer_kind(m, sparse):
    """``sparse`` as given, else the model's one kind of layer."""
    return _one_kind(m, sparse, "sparse", m.moe_layers if m.is_moe else 0, ("dense", "mixture-of-experts"),
                     sum(count for _, count in m.layer_kinds))


def _mixer_kind(m, linear):
    """``linear`` as given, else the model's one kind of token mixer."""
    return _one_kind(m, linear, "linear", m.linear_layers,
                     ("attention", m.recurrent.kind if m.is_hybrid else "recurrent"),
                     sum(count for _, count in m.mixer_kinds))


def _mixer_view(m, linear, mixer):
    """``(shape, linear)`` of the token mixer a per-layer count is asked for: ``mixer`` (a kind of
    ``ModelShape.mixer_kinds``), else ``linear``'s (``_mixer_kind``); a model with attention layers of two shapes
    (Gemma 4's full layers) must name one."""
    kinds = dict(m.mixer_kinds)
    if mixer is not None:
        if mixer not in kinds:
            raise ValueError(f"{m.name} has no {mixer!r} layers: mixer= takes one of {sorted(kinds)}")
        return m.mixer_view(mixer)
    if m.global_layers and not linear:
        raise ValueError(f"{m.name} has attention layers of two shapes ({kinds}): say which with mixer=")
    return m, _mixer_kind(m, linear)


def _check(m, seq_len, tsp_size, direction, expert_parallel_size=None):
    """Refuse what ``m`` cannot run at this size; return the expert-parallel size."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
    problem = tsp_shape_problem(m, tsp_size)
    if problem:
        raise ValueError(f"TSP cannot shard this model over {tsp_size} ranks: {problem}")
    if tsp_size > 1 and seq_len % tsp_size:
        raise ValueError(f"seq_len {seq_len} is not a multiple of tsp_size {tsp_size}")
    ep = _expert_parallel(tsp_size, expert_parallel_size)
    if ep > tsp_size and not m.is_moe:
        raise ValueError(f"expert_parallel_size {ep}: {m.name} has no mixture-of-experts layer")
    if ep > tsp_size and m.num_experts % ep:
        raise ValueError(f"expert_parallel_size {ep} does not divide {m.name}'s {m.num_experts} experts a layer")
    return ep


def _expert_parallel(tsp_size, expert_parallel_size):
    """``ep``: ``expert_parallel_size``, a multiple of ``tsp_size``, or ``tsp_size`` for None."""
    ep = tsp_size if expert_parallel_size is None else expert_parallel_size
    if not isinstance(ep, int) or ep < 1 or ep % tsp_size:
        raise ValueError(f"expert_parallel_size must be a multiple of tsp_size {tsp_size}, not {ep!r}")
    return ep


def tsp_bytes_by_op(model, seq_len, micro_batch, tsp_size, elem_bytes, direction, tsp_rank=None, *,
                    grad_wire_bytes=None, sparse=None, linear=None, moe_schedule="ring", expert_parallel_size=None,
                    mixer=None):
    """Bytes one rank receives in one TSP decoder layer (attention + MLP), per
    ``comm`` op name, as ``comm.counter`` counts them; ``direction`` is
    "forward", "backward" or "both".

    Forward: the other ranks' attention shards (``broadcast``), ``(D-1)/D`` of the
    MLP weights (``ring``) and ``(D-1)/D`` of the full-sequence K/V (``all_gather``):
    ``(D-1)/D * (Wa + Wm + 2*B*S*nkv*d)`` elements averaged over ranks. Backward:
    the same again (shards re-sent, K/V re-gathered), plus the ``reduce`` of this
    rank's own attention-shard gradient from the other ``D-1`` ranks and the
    ``D-1`` ring hops of MLP gradient accumulators, both in ``a`` bytes
    (``gradient_wire_bytes(elem, grad_wire_bytes)``: ``max(elem, 4)`` by
    default, sums in fp32 or wider), and the ``reduce_scatter`` of dK, dV in
    ``elem`` bytes. With ``nkv < D`` a key/value head is stored once, on the
    first rank of the heads sharing it, so shards differ by rank:
    ``tsp_rank=None`` gives the mean over ranks (own shard ``Wa/D``), a rank its
    exact count. Values are int when whole (always, for a given rank).

    With q/k norms over the whole projection (OLMo-2/3) the shards go round
    once more each way for the tokens' sums of squares, and backward reduces
    the gradient of each rank's q and k rows to it as well.

    ``sparse``: a mixture-of-experts layer, whose block's bytes under
    ``moe_schedule`` (``tsp_moe_bytes_by_op``; "auto": the one
    ``cheaper_moe_schedule`` picks for a training step) take the MLP's place:
    on the ring ``Wx = 3H (E F_e + F_s)`` for ``Wm``; by default the model's
    kind of layer (a model with both kinds must say). ``linear``: a Gated
    DeltaNet layer of a hybrid, whose bytes (``delta_net_bytes_by_op``: head
    groups broadcast, their state maps gathered) take the attention's place;
    likewise by default the model's kind of token mixer. ``mixer``: the kind of
    token mixer by name (``ModelShape.mixer_kinds``: Gemma 4's "global_attention"
    layers have heads of their own size), which a model with two attention
    shapes must give.
    ``expert_parallel_size``: the sparse block's experts over that many ranks
    (``moe_block_bytes_by_op``), above ``D`` by the token all-to-all whatever
    ``moe_schedule`` says.
    """
    m = model_shape(model)
    D = tsp_size
    view, linear = _mixer_view(m, linear, mixer)
    sparse = _layer_kind(m, sparse)
    ep = _check(m, seq_len, D, direction, expert_parallel_size)
    if ep == 1:
        return {}
    forward, backward = _mixer_ops(view, seq_len, micro_batch, D, elem_bytes, tsp_rank, linear, grad_wire_bytes)
    for ops, more in zip((forward, backward), _ffn_ops(m, seq_len, micro_batch, D, elem_bytes, sparse,
                                                        moe_schedule, grad_wire_bytes, ep)):
        for op, v in more.items():
            ops[op] = ops.get(op, 0) + v
    return _nonzero(_by_direction(forward, backward, direction), D)


def _nonzero(counts, tsp_size):
    """``counts``, without the ops a TSP group of one runs with nothing to move (its experts' all-to-all aside)."""
    return counts if tsp_size > 1 else {op: v for op, v in counts.items() if v}


def _mixer_ops(m, seq_len, micro_batch, D, e, tsp_rank, linear, grad_wire_bytes):
    """``(forward, backward)`` bytes by op of one layer's token mixer: an attention (with a projection norm's
    round of the shards) or, ``linear``, the recurrent mixer (``recurrent_bytes_by_op``)."""
    if D == 1:  # the experts' all-to-all alone moves bytes (expert_parallel_size > 1)
        return {}, {}
    if linear:
        return tuple({op: Fraction(v) for op, v in recurrent_bytes_by_op(
            m.recurrent, micro_batch, seq_len // D, D, e, direction, grad_wire_bytes=grad_wire_bytes).items()}
            for direction in ("forward", "backward"))
    a = gradient_wire_bytes(e, grad_wire_bytes)
    own = Fraction(m.attention_params, D) if tsp_rank is None else tsp_attention_shard(m, D, tsp_rank)
    index_own = Fraction(m.indexer_params, D) if tsp_rank is None else tsp_indexer_shard(m, D, tsp_rank)
    forward, backward = _attention_ops(m, micro_batch * seq_len, D, e, a, own, index_own)
    if m.qk_norm_spans_projection:
        # The sums of squares' round (attention.norms.projection_squares_forward): the shards once more each way,
        # and the gradient of this rank's q and k rows reduced to it.
        qk_own = Fraction(m.num_heads + m.num_kv_heads, D) * m.head_dim * (m.hidden_size + int(m.attention_bias)) \
            if tsp_rank is None else tsp_qk_rows(m, D, tsp_rank)
        for ops in (forward, backward):
            ops["broadcast"] = 2 * e * (m.attention_params - own)
        backward["reduce"] += a * (D - 1) * qk_own
    return forward, backward


def _ffn_ops(m, seq_len, micro_batch, D, e, sparse, moe_schedule, grad_wire_bytes, ep):
    """``(forward, backward)`` bytes by op of one layer's feed-forward block: the dense MLP's ring, or a sparse
    block's under its schedule, its experts over ``ep`` ranks."""
    if sparse:
        wire = {"grad_wire_bytes": grad_wire_bytes, "expert_parallel_size": ep}
        schedule = tsp_moe_schedule(m, seq_len, micro_batch, D, e, moe_schedule, **wire)
        return tuple({op: Fraction(v) for op, v in tsp_moe_bytes_by_op(
            m, seq_len, micro_batch, D, e, direction, schedule, **wire).items()}
            for direction in ("forward", "backward"))
    ffn = Fraction((D - 1) * m.ffn_params(sparse), D)
    return {"ring": e * ffn}, {"ring": (e + gradient_wire_bytes(e, grad_wire_bytes)) * ffn}


def latent_attention_bytes_by_op(hidden_size, num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
                                 qk_rope_head_dim, v_head_dim, tokens, tsp_size, tsp_rank, elem_bytes, direction, *,
                                 down_bias=False, grad_wire_bytes=None, index_heads=0, index_head_dim=0):
    """Bytes rank ``tsp_rank`` receives in one multi-head latent attention layer
    (DESIGN.md 6i, ``ds_tsp.blocks.latent``), by op, for ``tokens = B*S``:
    every other rank's down piece and head group broadcast (twice: backward
    again), the latent and rotary key all-gathered, ``(kv_lora_rank +
    qk_rope_head_dim) (D-1)/D B*S`` elements (twice), their gradient
    reduce-scattered once, and this rank's shard gradient reduced from the
    other ``D-1`` ranks in the gradient wire dtype: ``tsp_bytes_by_op``'s
    attention part. ``q_lora_rank`` None: no query latent. A lightning indexer
    of ``index_heads`` heads of ``index_head_dim`` (DeepSeek's sparse
    attention) adds, in forward only, its pieces' broadcast and ``index_head_dim``
    elements a token to the latent's gather (``_attention_ops``)."""
    m = ModelShape(hidden_size, 0, 1, num_heads, num_heads, qk_nope_head_dim + qk_rope_head_dim, 1,
                   attention_bias=down_bias, kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank or 0,
                   qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
                   index_heads=index_heads, index_head_dim=index_head_dim)
    D, e = tsp_size, elem_bytes
    if D == 1:
        return {}
    forward, backward = _attention_ops(m, tokens, D, e, gradient_wire_bytes(e, grad_wire_bytes),
                                       tsp_attention_shard(m, D, tsp_rank), tsp_indexer_shard(m, D, tsp_rank))
    return _by_direction(forward, backward, direction)


def _attention_ops(m, tokens, D, e, a, own, index_own=0):
    """An attention layer's bytes by op, forward and backward, for ``tokens = B*S`` and this rank's shard of
    ``own`` elements: the other shards broadcast, the full sequence's K/V (or a latent attention's latent and
    rotary key) gathered, and backward the same again, the gathered tensors' gradient reduce-scattered and the
    own shard's gradient reduced from the other ``D-1`` ranks in ``a`` bytes. A lightning indexer's pieces (this
    rank's of ``index_own`` elements, within ``own``) and keys move in forward only: it takes no gradient, and
    backward reuses its choice."""
    kv = Fraction((D - 1) * tokens, D) * (m.latent_width if m.is_latent else 2 * m.num_kv_heads * m.head_dim)
    index_keys = Fraction((D - 1) * tokens, D) * m.index_head_dim
    forward = {"broadcast": e * (m.attention_params - own), "all_gather": e * (kv + index_keys)}
    trained, trained_own = m.attention_params - m.indexer_params, own - index_own
    return forward, {"broadcast": e * (trained - trained_own), "all_gather": e * kv,
                     "reduce": a * (D - 1) * trained_own, "reduce_scatter": e * kv}


def recurrent_bytes_by_op(mixer, batch, local_tokens, tsp_size, elem_bytes, direction, *, grad_wire_bytes=None):
    """Bytes a rank receives in one recurrent layer (a ``planning.recurrent`` mixer), by op, for ``batch`` rows
    of ``local_tokens`` a rank: its kind's formula over its sizes."""
    r, wire = mixer, {"grad_wire_bytes": grad_wire_bytes}
    common = (batch, local_tokens, tsp_size, elem_bytes, direction)
    if isinstance(r, KimiDeltaAttention):
        return kda_bytes_by_op(r.hidden_size, r.num_value_heads, r.value_head_dim, r.conv_kernel, *common, **wire)
    if isinstance(r, GatedDeltaNet):
        return delta_net_bytes_by_op(r.hidden_size, r.num_key_heads, r.num_value_heads, r.key_head_dim,
                                     r.value_head_dim, r.conv_kernel, *common, **wire)
    if isinstance(r, Mamba1):
        return mamba1_bytes_by_op(r.hidden_size, r.d_inner, r.state_size, r.dt_rank, r.conv_kernel, *common,
                                  proj_bias=r.proj_bias, conv_bias=r.conv_bias, **wire)
    if isinstance(r, ShortConvolution):
        return short_conv_bytes_by_op(r.hidden_size, r.conv_kernel, *common, bias=r.bias, **wire)
    return mamba2_bytes_by_op(r.hidden_size, r.num_heads, r.head_dim, r.n_groups, r.state_size, r.conv_kernel,
                              *common, proj_bias=r.proj_bias, conv_bias=r.conv_bias, **wire)


def delta_net_bytes_by_op(hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel, batch,
                          local_tokens, tsp_size, elem_bytes, direction, *, grad_wire_bytes=None):
    """Bytes rank ``tsp_rank`` receives in one Gated DeltaNet layer (DESIGN.md
    6j, ``ds_tsp.blocks.linear``), by op, for ``batch`` rows of ``local_tokens``
    a rank: every other rank's head group broadcast (twice: backward again);
    per head group, each rank's two chunks' last ``kernel - 1`` convolution
    inputs and their two state maps ``(T, U)`` all-gathered (twice), and in
    backward the maps' initial-state gradients all-gathered and the halos'
    gradients reduce-scattered; this rank's shard gradient reduced from the
    other ``D-1`` ranks in the gradient wire dtype. The state travels in
    float32, or the model's dtype where wider. Nothing grows with the sequence
    once a chunk holds ``kernel - 1`` tokens."""
    k_heads, v_heads = num_k_heads // tsp_size, num_v_heads // tsp_size
    keys, values = k_heads * head_k_dim, v_heads * head_v_dim
    shard = hidden_size * (2 * keys + 2 * values + 2 * v_heads) + (2 * keys + values) * conv_kernel + 2 * v_heads \
        + hidden_size * values
    return _delta_rule_bytes(shard, 2 * keys + values, v_heads, head_k_dim, head_v_dim, conv_kernel, batch,
                             local_tokens, tsp_size, elem_bytes, direction, grad_wire_bytes)


def kda_bytes_by_op(hidden_size, num_heads, head_dim, conv_kernel, batch, local_tokens, tsp_size, elem_bytes,
                    direction, *, grad_wire_bytes=None):
    """Bytes a rank receives in one of Kimi Linear's KDA layers (DESIGN.md 6n,
    ``ds_tsp.blocks.linear`` with ``DeltaNetShapes.kda``), by op: Gated
    DeltaNet's exchanges (``delta_net_bytes_by_op``) over its head groups' shards
    (queries, keys, values, their channels, the gates' up projections
    ``f_b_proj`` and ``g_b_proj``, ``dt_bias`` per channel, ``A_log``, ``b_proj``,
    ``o_proj``'s columns). The gates' down projections are kept whole and move
    nothing; the maps are the same ``dk x dk`` a head: a decay per key channel
    changes what they hold, not their size."""
    heads = num_heads // tsp_size
    rows = heads * head_dim
    shard = 3 * hidden_size * rows + 3 * rows * conv_kernel + 2 * rows * head_dim + rows + heads \
        + heads * hidden_size + hidden_size * rows
    return _delta_rule_bytes(shard, 3 * rows, heads, head_dim, head_dim, conv_kernel, batch, local_tokens, tsp_size,
                             elem_bytes, direction, grad_wire_bytes)


def _delta_rule_bytes(shard, channels, v_heads, head_k_dim, head_v_dim, conv_kernel, batch, local_tokens, tsp_size,
                      elem_bytes, direction, grad_wire_bytes):
    """The exchanges of the delta rule's schedule (``ds_tsp.blocks.linear.schedule``) for head groups of
    ``shard`` elements, ``channels`` convolution channels and ``v_heads`` value heads each."""
    D, e = tsp_size, elem_bytes
    if D == 1:
        return {}
    state, a = max(e, 4), gradient_wire_bytes(e, grad_wire_bytes)
    halo = 2 * batch * min(conv_kernel - 1, local_tokens // 2) * channels
    maps = 2 * batch * v_heads * head_k_dim * (head_k_dim + head_v_dim)
    state_grads = 2 * batch * v_heads * head_k_dim * head_v_dim
    groups = (D - 1) * D  # D head groups, each exchange over the D ranks
    forward = {"broadcast": e * (D - 1) * shard, "all_gather": groups * (e * halo + state * maps)}
    backward = {"broadcast": e * (D - 1) * shard, "all_gather": groups * (e * halo + state * (maps + state_grads)),
                "reduce_scatter": groups * e * halo, "reduce": a * (D - 1) * shard}
    return _by_direction(forward, backward, direction)


def mamba2_bytes_by_op(hidden_size, num_heads, head_dim, n_groups, state_size, conv_kernel, batch, local_tokens,
                       tsp_size, elem_bytes, direction, *, proj_bias=False, conv_bias=True, grad_wire_bytes=None):
    """Bytes a rank receives in one Mamba-2 mixer (DESIGN.md 6n,
    ``ds_tsp.blocks.linear.mamba2_schedule``), by op, for ``batch`` rows of
    ``local_tokens`` a rank. Forward: every other rank's three pieces broadcast
    (input rows, per-channel tensors, ``out_proj`` columns); each rank's two
    chunks' last ``kernel - 1`` convolution inputs of every channel and their
    two state maps (one scalar and ``n x p`` a head) all-gathered once.
    Backward: the input and per-channel pieces broadcast again to recompute,
    the halos and maps gathered again, the state gradients all-gathered, the
    halos' gradients reduce-scattered, the output pieces broadcast, then the
    input pieces a third time for the input's gradient; each piece's gradient
    reduced to its owner in the gradient wire dtype. The states travel in
    float32, or the model's dtype where wider. Nothing grows with the sequence
    once a chunk holds ``kernel - 1`` tokens."""
    D = tsp_size
    heads, inner, rows = num_heads // D, num_heads * head_dim // D, n_groups * state_size // D
    pieces = ((hidden_size + proj_bias) * (2 * inner + 2 * rows + heads),
              (conv_kernel + conv_bias) * (inner + 2 * rows) + 3 * heads, hidden_size * inner)
    halo = 2 * batch * min(conv_kernel - 1, local_tokens // 2) * D * (inner + 2 * rows)  # every channel, every rank's
    maps = 2 * batch * num_heads * (1 + state_size * head_dim)
    state_grads = 2 * batch * num_heads * state_size * head_dim
    return _streamed_bytes(pieces, halo, maps, state_grads, D, elem_bytes, direction, grad_wire_bytes)


def mamba1_bytes_by_op(hidden_size, d_inner, state_size, dt_rank, conv_kernel, batch, local_tokens, tsp_size,
                       elem_bytes, direction, *, proj_bias=False, conv_bias=True, grad_wire_bytes=None):
    """Bytes a rank receives in one Mamba-1 mixer (Jamba's, DESIGN.md 6n,
    ``ds_tsp.blocks.linear.mamba1``), by op: ``mamba2_bytes_by_op``'s
    schedule over its pieces (``x`` and ``z`` rows; the convolution's taps,
    ``x_proj`` columns, ``dt_proj`` rows, ``A_log`` and ``D``; ``out_proj``
    columns), the halos of its ``d_inner`` channels, and its chunks' maps: an
    elementwise ``T`` and a ``U`` of ``d_inner x n`` each."""
    D = tsp_size
    channels = d_inner // D
    pieces = ((hidden_size + proj_bias) * 2 * channels,
              (conv_kernel + conv_bias + 2 * dt_rank + 3 * state_size + 2) * channels,  # x_proj, dt_proj, A_log, D
              hidden_size * channels)
    halo = 2 * batch * min(conv_kernel - 1, local_tokens // 2) * d_inner
    maps = 2 * batch * 2 * d_inner * state_size
    return _streamed_bytes(pieces, halo, maps, 2 * batch * d_inner * state_size, D, elem_bytes, direction,
                           grad_wire_bytes)


def _streamed_bytes(pieces, halo, maps, state_grads, tsp_size, elem_bytes, direction, grad_wire_bytes):
    """The bytes of a mixer on the streamed schedule (``ds_tsp.blocks.linear.streamed``) from the elements of
    its ``pieces`` (inputs, per-channel, outputs) a rank, of its convolution's ``halo`` (every rank's), of its
    chunks' state ``maps`` and their ``state_grads`` (the states in float32, or the model's dtype where wider)."""
    D, e = tsp_size, elem_bytes
    if D == 1:
        return {}
    state, a = max(e, 4), gradient_wire_bytes(e, grad_wire_bytes)
    inputs, channels, outputs = pieces
    forward = {"broadcast": e * (D - 1) * (inputs + channels + outputs),
               "all_gather": (D - 1) * (e * halo + state * maps)}
    backward = {"broadcast": e * (D - 1) * (2 * inputs + channels + outputs),
                "all_gather": (D - 1) * (e * halo + state * (maps + state_grads)),
                "reduce_scatter": (D - 1) * e * halo, "reduce": a * (D - 1) * (inputs + channels + outputs)}
    return _by_direction(forward, backward, direction)


def short_conv_bytes_by_op(hidden_size, conv_kernel, batch, local_tokens, tsp_size, elem_bytes, direction, *,
                           bias=False, grad_wire_bytes=None):
    """Bytes a rank receives in one gated short convolution (LFM's, DESIGN.md
    6n, ``ds_tsp.blocks.linear.short_conv``), by op, for ``batch`` rows of
    ``local_tokens`` a rank: ``mamba2_bytes_by_op``'s schedule without the
    state maps. Forward: every other rank's three pieces broadcast (``B``,
    ``C`` and ``x`` rows of its channels, their taps, their ``out_proj``
    columns) and each chunk's last ``kernel - 1`` convolution inputs of every
    channel all-gathered. Backward: the input and per-channel pieces broadcast
    again, the halos gathered again and their gradients reduce-scattered, the
    output pieces broadcast, the input pieces a third time; each piece's
    gradient reduced to its owner. ``bias``: LFM's ``conv_bias``, on
    ``in_proj`` and the convolution (broadcast) and ``out_proj`` (whole)."""
    channels = hidden_size // tsp_size
    pieces = ((hidden_size + bias) * 3 * channels, (conv_kernel + bias) * channels, hidden_size * channels)
    halo = 2 * batch * min(conv_kernel - 1, local_tokens // 2) * hidden_size  # every channel, every rank's
    return _streamed_bytes(pieces, halo, 0, 0, tsp_size, elem_bytes, direction, grad_wire_bytes)


def tsp_moe_bytes_by_op(model, seq_len, micro_batch, tsp_size, elem_bytes, direction, schedule="ring", *,
                        grad_wire_bytes=None, expert_parallel_size=None):
    """Bytes one rank receives in one sparse MoE block of ``model`` (experts
    ``E/ep`` per rank, ``ep = D`` by default, tokens ``N = B*S/D`` per rank), per
    ``comm`` op name, for either schedule: ``moe_block_bytes_by_op`` over the
    model's sizes."""
    m = model_shape(model)
    if not m.is_moe:
        raise ValueError(f"{m.name} has no mixture-of-experts layer")
    ep = _check(m, seq_len, tsp_size, direction, expert_parallel_size)
    return moe_block_bytes_by_op(m.hidden_size, m.num_experts, m.expert_size, m.shared_expert_size,
                                 m.experts_per_token, Fraction(micro_batch * seq_len, tsp_size), tsp_size, elem_bytes,
                                 direction, schedule, grad_wire_bytes=grad_wire_bytes, expert_bias=m.expert_bias,
                                 expert_parallel_size=ep)


def moe_block_bytes_by_op(hidden_size, num_experts, expert_size, shared_size, top_k, local_tokens, tsp_size,
                          elem_bytes, direction, schedule, *, grad_wire_bytes=None, rows_received=None,
                          expert_bias=False, expert_parallel_size=None):
    """Bytes one rank receives in one sparse MoE block (``ds_tsp.blocks.moe.module``), per
    ``comm`` op name: ``E`` experts of ``3 H F_e`` weights (``+ 2 F_e + H``
    with ``expert_bias``: GPT-OSS's gate/up and down biases), ``E/D`` per rank,
    top-``k`` routing, a shared expert of ``F_s`` (0: none), ``N`` local tokens.
    The same formula serves the planner and ``tsp.moe_schedule: "auto"``.

    ``"ring"``: the packed shard of ``W = E/D * 3H F_e + 3H F_s/D`` elements
    travels round the ring; forward ``(D-1) W e``, backward ``(D-1) W (e + a)``
    (the weights again and their gradient accumulators,
    ``a = gradient_wire_bytes(e, grad_wire_bytes)``), whatever the tokens.

    ``"all_to_all"``: the ``E/D`` split sizes of each other rank (int64,
    forward only), then each routed row ``(token, expert)`` goes to the
    expert's owner and its output comes back: a rank receives the rows other
    ranks route to its experts and the outputs of its own rows computed
    elsewhere, ``rows_received`` rows of ``H`` in all (by default the expected
    ``2 k N (D-1)/D``, routing spread evenly, also the mean over ranks);
    backward the gradients of both, the same rows again. The experts' weight
    gradients stay on their owner. The shared expert, dense, stays on the
    ring: ``(D-1)/D * 3H F_s`` each way, plus its accumulators backward.

    ``expert_parallel_size`` (``ep``, None: ``D``; a multiple of ``D``): the
    experts split ``E/ep`` per rank over ``ep`` consecutive ranks, the TSP
    group and ``ep/D`` data-parallel replicas (DESIGN.md 6k), and the
    all-to-all runs over them: ``(ep-1) E/ep`` split sizes, by default
    ``2 k N (ep-1)/ep`` rows; the shared expert's ring stays on the ``D`` ranks.
    Above ``D`` the ring is refused: the experts no longer fit its group.
    """
    D, e, H = tsp_size, elem_bytes, hidden_size
    ep = _expert_parallel(D, expert_parallel_size)
    if schedule not in MOE_SCHEDULES:
        raise ValueError(f"schedule must be one of {MOE_SCHEDULES}, not {schedule!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
    if schedule == "ring" and ep > D:
        raise ValueError(f"expert_parallel_size {ep} > tsp_size {D}: the experts are met by the token all-to-all, "
                         f"not the ring (schedule \"all_to_all\")")
    if ep == 1:
        return {}
    a = gradient_wire_bytes(e, grad_wire_bytes)
    shared = Fraction((D - 1) * 3 * H * shared_size, D)
    if schedule == "ring":
        expert = 3 * H * expert_size + (2 * expert_size + H if expert_bias else 0)
        weights = Fraction((D - 1) * num_experts * expert, D) + shared
        return _by_direction({"ring": e * weights}, {"ring": (e + a) * weights}, direction)
    if rows_received is None:
        rows_received = 2 * top_k * Fraction(local_tokens) * Fraction(ep - 1, ep)
    moved = e * H * Fraction(rows_received)
    forward = {"all_to_all": moved + INT64 * (ep - 1) * Fraction(num_experts, ep), "ring": e * shared}
    backward = {"all_to_all": moved, "ring": (e + a) * shared}
    return _by_direction({k: v for k, v in forward.items() if v}, {k: v for k, v in backward.items() if v},
                         direction)


@functools.lru_cache(maxsize=1024)
def cheaper_moe_schedule(hidden_size, num_experts, expert_size, shared_size, top_k, local_tokens, tsp_size,
                         elem_bytes, direction, *, grad_wire_bytes=None, expert_bias=False, expert_parallel_size=None):
    """``tsp.moe_schedule: "auto"``: the schedule of ``MOE_SCHEDULES`` whose
    expected bytes (``moe_block_bytes_by_op``) are fewer for this block and
    micro-batch shape; the ring where they tie. Experts over more ranks than
    the TSP group (``expert_parallel_size``) leave the all-to-all alone.
    Remembered per shape: every sparse layer asks it at every forward."""
    if _expert_parallel(tsp_size, expert_parallel_size) > tsp_size:
        return "all_to_all"
    moved = {schedule: sum(Fraction(v) for v in moe_block_bytes_by_op(
        hidden_size, num_experts, expert_size, shared_size, top_k, local_tokens, tsp_size, elem_bytes, direction,
        schedule, grad_wire_bytes=grad_wire_bytes, expert_bias=expert_bias).values()) for schedule in MOE_SCHEDULES}
    return min(MOE_SCHEDULES, key=lambda schedule: moved[schedule])


def tsp_moe_schedule(model, seq_len, micro_batch, tsp_size, elem_bytes, moe_schedule="auto", *,
                     grad_wire_bytes=None, expert_parallel_size=None):
    """The schedule ``model``'s sparse layers run under ``moe_schedule`` in a
    training step: itself, or for "auto" ``cheaper_moe_schedule``'s choice
    (forward and backward) at ``N = B*S/D`` local tokens; the all-to-all
    whatever it says where ``expert_parallel_size`` exceeds ``tsp_size``."""
    if _expert_parallel(tsp_size, expert_parallel_size) > tsp_size:
        return "all_to_all"
    if moe_schedule != "auto":
        return moe_schedule
    m = model_shape(model)
    return cheaper_moe_schedule(m.hidden_size, m.num_experts, m.expert_size, m.shared_expert_size,
                                m.experts_per_token, Fraction(micro_batch * seq_len, tsp_size), tsp_size, elem_bytes,
                                "both", grad_wire_bytes=grad_wire_bytes, expert_bias=m.expert_bias)


def moe_crossover_tokens(model, tsp_size, elem_bytes, direction="both", *, grad_wire_bytes=None):
    """Tokens per micro-batch (``B*S``) at which the token all-to-all moves as many
    bytes as the expert ring in one sparse MoE block (``tsp_moe_bytes_by_op``).
    The ring's bytes do not depend on the tokens and the all-to-all's grow with
    them, so the all-to-all moves fewer below it and the ring fewer above it
    (long sequences). Forward alone that is ``1.5 E F_e D / k`` (less the split
    sizes); with backward ``0.75 E F_e D (2e + a) / (k e)``."""
    m = model_shape(model)
    D = tsp_size
    if D == 1:
        return float("inf")
    ring = sum(Fraction(v) for v in tsp_moe_bytes_by_op(m, D, 1, D, elem_bytes, direction, "ring",
                                                         grad_wire_bytes=grad_wire_bytes).values())
    a2a = {S: sum(Fraction(v) for v in tsp_moe_bytes_by_op(m, S, 1, D, elem_bytes, direction, "all_to_all",
                                                           grad_wire_bytes=grad_wire_bytes).values())
           for S in (D, 2 * D)}
    per_token = (a2a[2 * D] - a2a[D]) / D  # the all-to-all is linear in B*S; the shared expert's ring is not
    fixed = a2a[D] - per_token * D
    return float((ring - fixed) / per_token)


def tsp_bytes_per_layer(model, seq_len, micro_batch, tsp_size, elem_bytes, direction, tsp_rank=None, *,
                        grad_wire_bytes=None, sparse=None, linear=None, moe_schedule="ring",
                        expert_parallel_size=None, mixer=None):
    """Total of ``tsp_bytes_by_op``: bytes one rank receives in one TSP layer
    (forward ``(D-1)/D * (Wa + Wm + 2*B*S*nkv*d) * elem`` on average)."""
    total = sum(Fraction(v) for v in tsp_bytes_by_op(model, seq_len, micro_batch, tsp_size, elem_bytes, direction,
                                                      tsp_rank, grad_wire_bytes=grad_wire_bytes, sparse=sparse,
                                                      linear=linear, moe_schedule=moe_schedule,
                                                      expert_parallel_size=expert_parallel_size,
                                                      mixer=mixer).values())
    return int(total) if total.denominator == 1 else float(total)


# --- outside the blocks: the folded vocabulary and the parameters every rank holds whole ---------

def tsp_vocab_bytes_by_op(model, seq_len, micro_batch, tsp_size, elem_bytes, direction, rows_exchanged=None, *,
                          grad_wire_bytes=None):
    """Bytes one rank receives for the folded vocabulary in one training step,
    per ``comm`` op name; ``direction`` is "forward", "backward" or "both".

    ``all_to_all``, the embedding: forward, the rows of this rank's local tokens
    that other ranks own; backward, the gradients of this rank's own rows for
    the other ranks' local tokens; ``H*elem`` bytes a token. ``rows_exchanged``
    is that pair of token counts for one batch (forward: this rank's local ids
    ``i`` with ``i // Vs != rank``; backward: the other ranks' local ids with
    ``i // Vs == rank``); by default the expected ``(D-1)/D * B*S/D`` each, for
    ids spread evenly over the vocabulary, which is also the mean over ranks.

    ``ring``, the fused LM head + loss: forward, ``D-1`` hops of a head shard
    (``Vs*H*elem``); backward, the same again plus ``D-1`` hops of its gradient
    accumulator in ``a`` bytes (``gradient_wire_bytes``: ``max(elem, 4)`` by
    default). Tied models send the one shard.
    The loss's all-reduce is in ``tsp_step_bytes_by_op``, both settings have it.
    """
    m = model_shape(model)
    D, e, H = tsp_size, elem_bytes, m.hidden_size
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
    if D == 1:
        return {}
    if seq_len % D:
        raise ValueError(f"seq_len {seq_len} is not a multiple of tsp_size {D}")
    if rows_exchanged is None:
        expected = Fraction((D - 1) * micro_batch * seq_len, D * D)
        rows_exchanged = (expected, expected)
    shard = vocab_rows_per_rank(m.vocab_size, D) * H
    forward = {"all_to_all": rows_exchanged[0] * H * e, "ring": (D - 1) * shard * e}
    a = gradient_wire_bytes(e, grad_wire_bytes)
    backward = {"all_to_all": rows_exchanged[1] * H * e, "ring": (D - 1) * shard * (e + a)}
    return _by_direction(forward, backward, direction)


def _all_reduced(nbytes, group_size):
    """Bytes ``comm.all_reduce`` counts as received for one tensor of ``nbytes``."""
    return 2 * (group_size - 1) * nbytes // group_size


def tsp_step_bytes_by_op(model, seq_len, micro_batch, tsp_size, elem_bytes, *, vocab_parallel=True,
                         activation_checkpointing=False, tsp_rank=None, rows_exchanged=None, grad_wire_bytes=None,
                         moe_schedule="ring", check_batch="always", expert_parallel_size=None):
    """Bytes one rank receives in one training step (forward and backward of one
    micro-batch), per ``comm`` op name, as ``comm.counter`` counts them.

    The layers: each layer's ``tsp_bytes_by_op(..., "both")`` (dense and sparse
    layers, attention and Gated DeltaNet layers each their own:
    ``tsp_layers_bytes_by_op``), plus its forward again with activation
    checkpointing. With ``vocab_parallel`` (the default),
    ``tsp_vocab_bytes_by_op(..., "both", rows_exchanged)``. ``all_reduce``: the
    loss (one scalar in ``max(elem, 4)`` bytes), with ``output_router_logits``
    the load-balancing loss's statistics (``2E+1`` float64 values, one
    all-reduce a forward), and the gradients of what every rank holds whole, one
    all-reduce per tensor in ``elem`` bytes (``ModelShape.replicated_tensors``:
    the norms, Qwen3's q/k norms, MLP down biases, routers and shared-expert
    gates), and without ``vocab_parallel`` the embedding and the LM head too.
    ``tsp_rank``, ``grad_wire_bytes`` and ``moe_schedule`` are as in
    ``tsp_bytes_by_op`` (the all-to-all's rows as routing spread evenly would
    send them). ``check_batch``: with ``tsp.check_batch`` "always", every
    micro-batch's fingerprint (``BATCH_FINGERPRINT_BYTES`` per rank, all-gathered).
    ``expert_parallel_size`` as in ``tsp_bytes_by_op``; the experts' gradients
    reduced over their expert-data-parallel group are DeepSpeed's, not counted here.
    """
    m = model_shape(model)
    D, e, H = tsp_size, elem_bytes, m.hidden_size
    ep = _check(m, seq_len, D, "both", expert_parallel_size)
    if ep == 1:
        return {}
    wire = {"grad_wire_bytes": grad_wire_bytes}
    forward, backward = _layers_ops(m, seq_len, micro_batch, D, e, tsp_rank, moe_schedule, grad_wire_bytes, ep)
    if activation_checkpointing:  # every layer's forward runs again in backward
        backward = {op: v + forward.get(op, 0) for op, v in backward.items()}
    counts = _by_direction(forward, backward, "both")
    whole = list(m.norm_tensors)  # the final norm
    for view, linear, layers in m.mixer_groups:
        whole += view.mixer_replicated_tensors(linear, untrained=False) * layers  # those whose gradients sum
    for sparse, layers in m.layer_kinds:
        whole += m.ffn_replicated_tensors(sparse) * layers
    if vocab_parallel:
        for op, v in tsp_vocab_bytes_by_op(m, seq_len, micro_batch, D, e, "both", rows_exchanged, **wire).items():
            counts[op] = counts.get(op, 0) + v
    else:
        whole += [m.vocab_size * H] * (1 if m.tie_word_embeddings else 2)
    reduced = _all_reduced(max(e, FLOAT32), D) + sum(_all_reduced(numel * e, D) for numel in whole)
    if m.is_moe and m.output_router_logits:
        reduced += _all_reduced((2 * m.num_experts + 1) * 8, D)  # moe.load_balancing_loss, float64
    counts["all_reduce"] = reduced
    if check_batch == "always":
        counts["batch_check"] = (D - 1) * BATCH_FINGERPRINT_BYTES
    return _nonzero(counts, D)


def tsp_layers_bytes_by_op(model, seq_len, micro_batch, tsp_size, elem_bytes, direction, tsp_rank=None, *,
                           grad_wire_bytes=None, moe_schedule="ring", expert_parallel_size=None):
    """Bytes one rank receives in every decoder layer of ``model`` together, per ``comm`` op name: each layer's
    token mixer and feed-forward block as ``tsp_bytes_by_op`` counts them, each kind by its count of layers (a
    hybrid's attention and Gated DeltaNet layers, dense and sparse layers)."""
    m = model_shape(model)
    ep = _check(m, seq_len, tsp_size, direction, expert_parallel_size)
    if ep == 1:
        return {}
    forward, backward = _layers_ops(m, seq_len, micro_batch, tsp_size, elem_bytes, tsp_rank, moe_schedule,
                                    grad_wire_bytes, ep)
    return _nonzero(_by_direction(forward, backward, direction), tsp_size)


def _layers_ops(m, seq_len, micro_batch, D, e, tsp_rank, moe_schedule, grad_wire_bytes, ep):
    """``(forward, backward)`` bytes by op of every layer: each kind of mixer and of feed-forward block times its
    count of layers, the experts over ``ep`` ranks."""
    forward, backward = {}, {}
    parts = [(layers, _mixer_ops(view, seq_len, micro_batch, D, e, tsp_rank, linear, grad_wire_bytes))
             for view, linear, layers in m.mixer_groups]
    parts += [(layers, _ffn_ops(m, seq_len, micro_batch, D, e, sparse, moe_schedule, grad_wire_bytes, ep))
              for sparse, layers in m.layer_kinds]
    for layers, pair in parts:
        for ops, more in zip((forward, backward), pair):
            for op, v in more.items():
                ops[op] = ops.get(op, 0) + layers * v
    return forward, backward
