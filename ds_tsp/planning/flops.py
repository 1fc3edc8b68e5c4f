"""FLOPs per device per optimizer step, and the attention's part of them.

Matmuls count 2 FLOPs per multiply-add; causal attention ``2*B*S^2*nq*d``
forward (half of ``QK^T`` and ``PV``). Backward is 2x the matmuls and 2.5x the
attention (flash). TSP adds the attention forward again when its backward is
not fused, and the LM head's forward again when the vocabulary is folded (the
fused loss recomputes its logits tile by tile); a tiled MLP recomputes its
tiles' projections in backward (TSP: gate and up; ALST's TiledMLP: the whole
MLP). A sparse layer counts its router and the ``k`` experts (and shared
expert) each token uses; TSP's experts recompute their projections in
backward. A Gated DeltaNet layer counts its projections and its chunked rule
(``delta_rule_flops_per_token``), no ``S^2`` term; TSP's runs its forward again
in backward, with its chunks' state maps. DeepSeek's sparse attention attends
each query to at most ``index_topk`` keys (``twice_attended_pairs``), and its
lightning indexer runs in forward only: its projections and its float32
scores of every causal pair, ``Hi (Di + 1)`` multiply-adds each (``indexer_flops``).
Activation checkpointing runs every layer's forward once more.
"""

import logging
from fractions import Fraction

logger = logging.getLogger("ds_tsp")


def step_flops(m, setting, B, S, share, tsp, fused_head=False, ffn_recompute=None, ffn_replicas=None,
               projections_recomputed=False):
    """FLOPs per device per step, and the attention's part of them: the replica's
    total for ``B`` sequences of ``S`` times ``share``; ``fused_head``: the LM head
    + loss recomputes the logits in backward; ``ffn_recompute(sparse)``: the
    parameters of a layer's feed-forward block whose forward matmuls run again
    in backward (a tiled MLP's, a TSP expert's); ``projections_recomputed``: a TSP
    attention's query, key and value projections run again in backward (its
    local tokens in several tiles: ``tsp.token_tile``); ``ffn_replicas(sparse)``: how
    many ranks of a share compute the same feed-forward work (AutoTP's whole
    experts: ``t``). A sparse layer's matmuls are its active ones
    (``ModelShape.active_ffn_params``: k experts and the shared expert) and the
    router's."""
    T = B * S
    head = 2 * T * m.vocab_size * m.hidden_size
    forward, backward = head, (3 if fused_head else 2) * head
    attention = recompute = 0
    for view, linear, layers in m.mixer_groups:  # each kind of token mixer with its own sizes
        if linear:
            r = view.recurrent
            mm, rule = 2 * T * r.matmul_params, T * r.rule_flops_per_token()
            forward += layers * (mm + rule)
            backward += layers * 2 * (mm + rule)
            if tsp:  # the mixer's forward again under autograd, its chunks' maps included
                backward += layers * (mm + T * r.rule_flops_per_token(maps=True))
            if setting.activation_checkpointing:
                recompute += layers * (mm + rule)
            continue
        attn = B * twice_attended_pairs(S, view.index_topk) * view.num_heads * (view.head_dim + view.value_dim)
        mm_attn = 2 * T * (view.attention_params - view.indexer_params)  # the indexer takes no gradient
        index = indexer_flops(view, B, S)
        forward += layers * (mm_attn + attn + index)
        backward += layers * (2 * mm_attn + 2.5 * attn)
        attention += layers * attn * 3.5
        if tsp and setting.tsp_attention_backward == "recompute":  # the attention forward runs again
            backward += layers * attn
            attention += layers * attn
        if tsp and projections_recomputed and not view.is_latent:
            rows = view.num_heads * view.q_width + view.kv_projections * view.num_kv_heads * view.head_dim
            backward += layers * 2 * T * view.hidden_size * rows
        if tsp and view.is_latent:
            # Expanded latent attention (tsp.latent_attention "auto"'s choice for long sequences, the plans' regime;
            # cheaper_latent_form): each rank makes every head group's K/V from the whole sequence's latent,
            # in forward and again in backward (with its gradients), where one device would make them once.
            expansion = 2 * T * view.kv_lora_rank * view.num_heads * (view.qk_nope_head_dim + view.v_head_dim) * \
                (round(1 / share) - 1)
            forward += layers * expansion
            backward += layers * 3 * expansion
        if setting.activation_checkpointing:
            recompute += layers * (mm_attn + attn + index)
            attention += layers * attn
    for sparse, layers in m.layer_kinds:
        mm_ffn = 2 * T * (m.active_ffn_params(sparse) + (m.router_params if sparse else 0))
        mm_ffn *= ffn_replicas(sparse) if ffn_replicas else 1
        forward += layers * mm_ffn
        backward += layers * 2 * mm_ffn
        if ffn_recompute:
            backward += layers * 2 * T * ffn_recompute(sparse)
        if setting.activation_checkpointing:
            recompute += layers * mm_ffn
    return (forward + backward + recompute) * share, attention * share


def twice_attended_pairs(seq_len, topk=0):
    """Twice the (query, key) pairs a causal row of ``seq_len`` attends (an
    integer): every earlier key, ``S^2`` as this module counts the dense
    attention, or at most ``topk`` keys a query (DeepSeek's sparse attention; 0: dense)."""
    S, k = seq_len, topk
    if not k or S <= k:
        return S * S
    return k * k + 2 * (S - k) * k


def indexer_flops(m, B, S):
    """Forward FLOPs of a layer's lightning indexer (none without one): its
    projections (``wq_b``, ``wk``, ``weights_proj``) and its float32 scores of
    every causal pair, ``Hi * Di`` for the dot products and ``Hi`` for the head
    weights' sum, two FLOPs each."""
    if not m.index_heads:
        return 0
    T = B * S
    projections = 2 * T * (m.indexer_params + m.index_heads * m.hidden_size)
    return projections + B * S * S * m.index_heads * (m.index_head_dim + 1)


def latent_attention_flops(shapes, rows, queries, keys, form, pairs=None):
    """Forward FLOPs of one head group of a multi-head latent attention layer
    (``blocks.latent.shards.LatentShapes``): ``rows`` sequences of ``queries``
    query tokens each over ``keys`` keys, scoring ``pairs`` (query, key) pairs
    a row: by default the queries are the last of the keys (bottom-right causal).
    ``"expanded"`` makes the group's keys and values from every key's latent,
    ``"absorbed"`` attends in latent space: its queries and outputs go through
    the group's up-projections instead, and every score and output spans the latent."""
    hq, nope, rope, v, c = (shapes.q_heads, shapes.qk_nope_head_dim, shapes.qk_rope_head_dim, shapes.v_head_dim,
                            shapes.kv_lora_rank)
    if pairs is None:
        pairs = queries * keys - Fraction(queries * (queries - 1), 2)
    pairs *= rows
    if form == "expanded":
        return 2 * rows * keys * c * hq * (nope + v) + 2 * pairs * hq * (nope + rope + v)
    return 2 * rows * queries * hq * c * (nope + v) + 2 * pairs * hq * (c + rope + c)


_last_form = {}  # layer shapes -> the form last chosen and logged for them


def cheaper_latent_form(shapes, rows, queries, keys, pairs=None):
    """``tsp.latent_attention: "auto"``: the form with fewer FLOPs at this shape
    (``latent_attention_flops``'s; expanded where they tie), logged whenever the choice for a layer shape changes."""
    costs = {form: latent_attention_flops(shapes, rows, queries, keys, form, pairs)
             for form in ("expanded", "absorbed")}
    form = min(costs, key=costs.get)
    if _last_form.get(shapes) != form:
        _last_form[shapes] = form
        logger.info("tsp.latent_attention auto: %s for %d x %d queries over %d keys (%.3g against %.3g FLOPs a head "
                    "group)", form, rows, queries, keys, costs[form],
                    costs["absorbed" if form == "expanded" else "expanded"])
    return form


def elementwise_bytes(m, setting, B, S, fp8_casts=False):
    """Bytes the step's elementwise and norm kernels read and write, for the
    replica's ``B`` sequences of ``S``: per token and layer the norms (read and
    write ``H`` each), the two residual adds (two reads, one write of ``H``),
    the rotary or the recurrent mixer's gates (its projections' outputs read
    and written once), the feed-forward's activation (gate and up read, their
    product and its activation written: ``5 F`` a token, ``k`` experts' with
    their rows' dispatch and combine); backward twice forward's, checkpointing
    one forward more. The loss reads and writes the logits in float32 six
    times (upcast, log-softmax, its backward). ``fp8_casts``: every matmul's
    input is cast to FP8 (read at the element size, written at one byte), its
    gradient too."""
    e, H, T = setting.precision.element, m.hidden_size, B * S
    passes = 3 + (1 if setting.activation_checkpointing else 0)
    per_token = 0
    for view, linear, layers in m.mixer_groups:
        width = (view.recurrent.matmul_params // H if linear else
                 view.num_heads * view.q_width + view.kv_projections * view.num_kv_heads * view.head_dim)
        per_token += layers * (view.norms_per_layer * 2 * H + 2 * 3 * H + 2 * width)
        if fp8_casts:
            per_token += layers * (H + view.num_heads * view.value_dim) * (e + 1) / e
    for sparse, layers in m.layer_kinds:
        if sparse:
            ffn = m.experts_per_token * (5 * m.expert_size + 4 * H) + 5 * m.shared_expert_size
        else:
            ffn = (5 if m.mlp_gated else 2) * m.intermediate_size
        per_token += layers * ffn
        if fp8_casts:
            inner = m.experts_per_token * m.expert_size if sparse else m.intermediate_size
            per_token += layers * (H + inner) * (e + 1) / e
    return T * (per_token * e * passes + 6 * 4 * m.vocab_size)
