"""Gated DeltaNet's rule (and Kimi Linear's KDA, its decay one a key channel) as
affine maps of its state (DESIGN.md 6j, 6n): a span's chunk terms, its run
from a given initial state and its map.

Within a span of tokens the state ``S`` (``dk x dv`` per value head) moves as
``S_out = T S_in + U``, ``T`` a dense ``dk x dk`` matrix, and the span's
outputs are affine in ``S_in`` too (``ds_tsp.blocks.linear.chunk_maps`` composes
the maps). Everything here is Hugging Face's ``torch_chunk_gated_delta_rule``
(64-token chunks, the UT transform) restated per chunk, in the inputs' dtype
(float32 or wider).

Shapes: ``q, k`` ``(B, h, L, dk)`` (already repeated to the value heads,
l2-normed and scaled as HF does), ``v`` ``(B, h, L, dv)``, ``g, beta``
``(B, h, L)``; states ``(B, h, dk, dv)``.
"""

import torch
import torch.nn.functional as F

from ds_tsp.blocks.linear.chunk_maps import ChunkRule, compose


def chunk_terms(q, k, v, g, beta, chunk_size=64, starts=None):
    """Each chunk's terms of HF's chunked rule, a dict of ``(B, h, n, C, ...)``
    tensors: ``w`` (``k_cumdecay``), ``u`` (``new_values``), ``q`` decayed from
    the chunk's start, ``k`` decayed to its end, the masked intra-chunk
    attention ``a`` and each chunk's total decay ``decay`` ``(B, h, n, c)``. The
    log decay ``g`` is one a head and token ``(B, h, L)`` (Gated DeltaNet's,
    ``c = 1``) or one a key channel ``(B, h, L, dk)`` (Kimi Linear's KDA,
    ``chunk_kimi_delta_attention``: ``c = dk``). The span is zero-padded to
    whole chunks (padding decays nothing and writes nothing: ``g = beta = 0``);
    ``length`` keeps its real token count.

    ``starts`` ``(B, L)`` (bool, or None): the tokens that start a packed
    document, where the state restarts from zero, as Hugging Face's layer run
    on each document alone. Tokens then interact only within their document:
    the intra-chunk terms are masked to pairs of one document, a token reads
    the chunk's incoming state only if no document starts between them
    (``q``, ``w``), writes the outgoing one only if none starts after it
    (``k``), and a chunk with a start passes none of its incoming state on
    (``decay`` 0), so its map's ``T`` is exactly 0."""
    length = q.shape[2]
    pad = (chunk_size - length % chunk_size) % chunk_size
    per_channel = g.dim() == 4
    g = g if per_channel else g.unsqueeze(-1)  # (B, h, L, c)
    q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    B, h, L = beta.shape
    n = L // chunk_size
    q, k, v, g = (t.reshape(B, h, n, chunk_size, t.shape[-1]) for t in (q, k, v, g))
    beta = beta.reshape(B, h, n, chunk_size)
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    cum = g.cumsum(-2)  # (B, h, n, C, c)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    reads = writes = keeps = None
    if starts is not None:
        starts = F.pad(starts, (0, pad)).reshape(B, 1, n, chunk_size)
        document = starts.long().cumsum(-1)  # (B, 1, n, C): starts seen since the chunk began
        upper = upper | (document.unsqueeze(-1) != document.unsqueeze(-2))
        reads, writes = (document == 0).to(q.dtype), (document == document[..., -1:]).to(q.dtype)
        keeps = (document[..., -1] == 0).to(q.dtype)
    # (B, h, n, C, C, c): the decay from token j to token i (j <= i, one document), per channel or for all
    pairwise = torch.where(upper[..., None], float("-inf"), cum.unsqueeze(-2) - cum.unsqueeze(-3)).exp()
    if per_channel:
        system = torch.einsum("...ic,...jc,...ijc->...ij", k_beta, k, pairwise)
        a = torch.einsum("...ic,...jc,...ijc->...ij", q, k, pairwise)
    else:
        system = (k_beta @ k.transpose(-1, -2)) * pairwise[..., 0]
        a = (q @ k.transpose(-1, -2)) * pairwise[..., 0]
    from_start, to_end = cum.exp(), (cum[..., -1:, :] - cum).exp()
    decay = cum[..., -1, :].exp()  # (B, h, n, c)
    if starts is not None:
        from_start, to_end = from_start * reads.unsqueeze(-1), to_end * writes.unsqueeze(-1)
        decay = decay * keeps.unsqueeze(-1)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * from_start, upper=False, unitriangular=True)
    return {"w": w, "u": u, "a": a, "q": q * from_start, "k": k * to_end, "decay": decay, "length": length}


def run_chunks(terms, state):
    """The span's outputs ``(B, h, length, dv)`` and final state from the initial ``state``: HF's scan. Only the
    states and the chunks' corrected values run chunk by chunk; the outputs are one batched product after."""
    incoming, values = [], []
    for u, w, k, decay in zip(*(terms[name].unbind(2) for name in ("u", "w", "k", "decay"))):
        v_new = u - w @ state
        incoming.append(state), values.append(v_new)
        state = state * decay[..., None] + k.transpose(-1, -2) @ v_new
    out = terms["q"] @ torch.stack(incoming, dim=2) + terms["a"] @ torch.stack(values, dim=2)
    return out.flatten(2, 3)[:, :, :terms["length"]], state


def span_map(terms):
    """``(T, U)`` of the whole span: ``S_out = T S_in + U``, ``T`` ``(B, h, dk, dk)``.
    Per chunk ``T_c = diag(decay_c) - K_c^T W_c`` and ``U_c = K_c^T V_c``, composed in order."""
    dk = terms["k"].shape[-1]
    eye = torch.eye(dk, dtype=terms["k"].dtype, device=terms["k"].device)
    k_t = terms["k"].transpose(-1, -2)
    T_cs = (terms["decay"][..., None] * eye - k_t @ terms["w"]).unbind(2)
    T = U = None
    for T_c, U_c in zip(T_cs, (k_t @ terms["u"]).unbind(2)):
        T, U = (T_c, U_c) if T is None else compose((T, U), (T_c, U_c), elementwise=False)
    return T, U


def zero_state(terms):
    """The ``(B, h, dk, dv)`` state before a sequence."""
    k, u = terms["k"], terms["u"]
    return k.new_zeros(*k.shape[:2], k.shape[-1], u.shape[-1])


GATED_DELTA = ChunkRule(chunk_terms, run_chunks, span_map, elementwise=False, zero_state=zero_state)
