"""Bytes each TSP rank receives, per ``ds_tsp.comm`` op, as ``comm.counter``
counts them (ring algorithms): all-reduce of ``n`` bytes ``2(p-1)/p n``,
all-gather and reduce-scatter ``(p-1)/p`` of the full tensor, all-to-all
``(p-1)/p`` of the local tensor, broadcast ``n`` per non-owner, reduce
``(p-1) n`` at the owner. Per layer (``tsp_bytes_by_op``), for the folded
vocabulary (``tsp_vocab_bytes_by_op``) and per training step
(``tsp_step_bytes_by_op``). The baselines' bytes are in ``strategies``.

TSP's parameter-gradient partial sums (the attention's weight-gradient
``reduce``, the rings' gradient accumulators) travel in ``a`` bytes an element
(``grad_wire_bytes``): float32 (float64 for float64 models) by default, 2 with
a bf16 or fp16 ``communication_data_type``."""

from fractions import Fraction

from .shapes import FLOAT32, model_shape, tsp_attention_shard, tsp_shape_problem, vocab_rows_per_rank

DIRECTIONS = ("forward", "backward", "both")


def gradient_wire_bytes(elem_bytes, grad_wire_bytes=None):
    """``a``: bytes per element of TSP's parameter-gradient partial sums on the
    wire, as ``comm.gradient_wire_dtype`` picks them: ``grad_wire_bytes`` (the
    ``communication_data_type`` a DeepSpeed config names), else the float32
    (or wider) sums' ``max(elem, 4)``; a float64 model keeps 8."""
    acc = max(elem_bytes, FLOAT32)
    return acc if grad_wire_bytes is None or acc > FLOAT32 else grad_wire_bytes


def _by_direction(forward, backward, direction):
    """``forward``, ``backward`` or their sum, per op; int where whole."""
    counts = {"forward": forward, "backward": backward,
              "both": {op: forward.get(op, 0) + backward.get(op, 0) for op in {**forward, **backward}}}[direction]
    return {op: int(v) if Fraction(v).denominator == 1 else float(v) for op, v in counts.items()}


def tsp_bytes_by_op(model, seq_len, micro_batch, tsp_size, elem_bytes, direction, tsp_rank=None, *,
                    grad_wire_bytes=None):
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
    """
    m = model_shape(model)
    D, e = tsp_size, elem_bytes
    a = gradient_wire_bytes(e, grad_wire_bytes)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
    problem = tsp_shape_problem(m, D)
    if problem:
        raise ValueError(f"TSP cannot shard this model over {D} ranks: {problem}")
    if D == 1:
        return {}
    if seq_len % D:
        raise ValueError(f"seq_len {seq_len} is not a multiple of tsp_size {D}")
    own = Fraction(m.attention_params, D) if tsp_rank is None else tsp_attention_shard(m, D, tsp_rank)
    mlp = Fraction((D - 1) * m.mlp_params, D)
    kv = (D - 1) * 2 * micro_batch * (seq_len // D) * m.num_kv_heads * m.head_dim
    forward = {"broadcast": e * (m.attention_params - own), "ring": e * mlp, "all_gather": e * kv}
    backward = {**forward, "ring": (e + a) * mlp, "reduce": a * (D - 1) * own, "reduce_scatter": e * kv}
    return _by_direction(forward, backward, direction)


def tsp_bytes_per_layer(model, seq_len, micro_batch, tsp_size, elem_bytes, direction, tsp_rank=None, *,
                        grad_wire_bytes=None):
    """Total of ``tsp_bytes_by_op``: bytes one rank receives in one TSP layer
    (forward ``(D-1)/D * (Wa + Wm + 2*B*S*nkv*d) * elem`` on average)."""
    total = sum(Fraction(v) for v in tsp_bytes_by_op(model, seq_len, micro_batch, tsp_size, elem_bytes, direction,
                                                      tsp_rank, grad_wire_bytes=grad_wire_bytes).values())
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
                         activation_checkpointing=False, tsp_rank=None, rows_exchanged=None, grad_wire_bytes=None):
    """Bytes one rank receives in one training step (forward and backward of one
    micro-batch), per ``comm`` op name, as ``comm.counter`` counts them.

    The layers: ``L`` times ``tsp_bytes_by_op(..., "both")``, plus its forward
    again with activation checkpointing. With ``vocab_parallel`` (the default),
    ``tsp_vocab_bytes_by_op(..., "both", rows_exchanged)``. ``all_reduce``: the
    loss (one scalar in ``max(elem, 4)`` bytes) and the gradients of what every
    rank holds whole, one all-reduce per tensor in ``elem`` bytes: the norms
    (and MLP down biases), and without ``vocab_parallel`` the embedding and the
    LM head too. ``tsp_rank`` and ``grad_wire_bytes`` are as in ``tsp_bytes_by_op``.
    """
    m = model_shape(model)
    D, e, H, L = tsp_size, elem_bytes, m.hidden_size, m.num_layers
    if D == 1:
        return {}
    wire = {"grad_wire_bytes": grad_wire_bytes}
    counts = {op: L * v for op, v in tsp_bytes_by_op(m, seq_len, micro_batch, D, e, "both", tsp_rank, **wire).items()}
    if activation_checkpointing:  # every layer's forward runs again in backward
        for op, v in tsp_bytes_by_op(m, seq_len, micro_batch, D, e, "forward", tsp_rank).items():
            counts[op] += L * v
    if vocab_parallel:
        for op, v in tsp_vocab_bytes_by_op(m, seq_len, micro_batch, D, e, "both", rows_exchanged, **wire).items():
            counts[op] = counts.get(op, 0) + v
    whole = [H] * (2 * L + 1) + [H] * (L if m.mlp_bias else 0)  # norms, final norm, MLP down biases
    if not vocab_parallel:
        whole += [m.vocab_size * H] * (1 if m.tie_word_embeddings else 2)
    counts["all_reduce"] = _all_reduced(max(e, FLOAT32), D) + sum(_all_reduced(numel * e, D) for numel in whole)
    return counts
