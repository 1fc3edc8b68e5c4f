"""Mamba-2's state space duality (SSD) as affine maps of its state (DESIGN.md 6n).

Per head the state ``S`` (``n x p``: state size by head size) moves as
``S_t = exp(a_t) S_{t-1} + B_t^T (dt_t x_t)`` and the output reads it,
``y_t = C_t S_t``: gated linear attention with ``q = C``, ``k = B``,
``v = dt x`` and the log decay ``a = dt A``, one scalar a head and token. A
span's map is ``T = exp(sum a)``, one scalar a head (``elementwise``), and
``U`` the state it writes from zero. Everything here is Hugging Face's
``mamba2_chunk_scan`` (its torch path) restated per chunk of ``chunk_size``
tokens, in the inputs' dtype (float32 or wider); the ``D`` skip term is the
caller's.

Shapes: ``q, k`` ``(B, h, L, n)`` (the groups' ``C`` and ``B`` repeated to the
heads), ``v`` ``(B, h, L, p)``, ``a`` ``(B, h, L)``; states ``(B, h, n, p)``.
"""

import torch
import torch.nn.functional as F

from ds_tsp.blocks.linear.chunk_maps import ChunkRule, compose


def chunk_terms(q, k, v, a, chunk_size=256, starts=None):
    """Each chunk's terms, a dict of ``(B, h, n, C, ...)`` tensors: ``q`` decayed
    from the chunk's start, ``k`` decayed to its end, ``v``, the masked
    intra-chunk weights ``w`` (``C_i . B_j exp(a_{j+1} + ... + a_i)``, ``j <= i``)
    and each chunk's total decay ``decay`` ``(B, h, n)``; zero-padded to whole
    chunks (padding decays and writes nothing), ``length`` the real count.

    ``starts`` ``(B, L)`` (bool, or None): the tokens that start a packed
    document, as ``delta_rule.chunk_terms`` takes them: tokens interact only
    within their document, read the chunk's incoming state only if no document
    starts between, write the outgoing one only if none starts after, and a
    chunk with a start passes none of its incoming state on."""
    length = q.shape[2]
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    a = F.pad(a, (0, pad))
    B, h, L = a.shape
    n = L // chunk_size
    q, k, v = (t.reshape(B, h, n, chunk_size, t.shape[-1]) for t in (q, k, v))
    cum = a.reshape(B, h, n, chunk_size).cumsum(-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    from_start, to_end, decay = cum.exp(), (cum[..., -1:] - cum).exp(), cum[..., -1].exp()
    if starts is not None:
        starts = F.pad(starts, (0, pad)).reshape(B, 1, n, chunk_size)
        document = starts.long().cumsum(-1)  # (B, 1, n, C): starts seen since the chunk began
        upper = upper | (document.unsqueeze(-1) != document.unsqueeze(-2))
        from_start = from_start * (document == 0).to(q.dtype)
        to_end = to_end * (document == document[..., -1:]).to(q.dtype)
        decay = decay * (document[..., -1] == 0).to(q.dtype)
    pairwise = torch.where(upper, float("-inf"), cum.unsqueeze(-1) - cum.unsqueeze(-2)).exp()
    w = (q @ k.transpose(-1, -2)) * pairwise
    return {"q": q * from_start.unsqueeze(-1), "k": k * to_end.unsqueeze(-1), "v": v, "w": w, "decay": decay,
            "length": length}


def run_chunks(terms, state):
    """The span's outputs ``(B, h, length, p)`` and final state from the initial ``state``. Only the
    states run chunk by chunk; each chunk's reads and writes are one batched product over all chunks."""
    writes = (terms["k"].transpose(-1, -2) @ terms["v"]).unbind(2)  # K_c^T V_c, (B, h, n, p) each
    incoming = []
    for write, decay in zip(writes, terms["decay"].unbind(2)):
        incoming.append(state)
        state = state * decay[..., None, None] + write
    out = terms["q"] @ torch.stack(incoming, dim=2) + terms["w"] @ terms["v"]  # (B, h, chunks, C, p)
    return out.flatten(2, 3)[:, :, :terms["length"]], state


def span_map(terms):
    """``(T, U)`` of the whole span, ``T`` ``(B, h, 1, 1)``: per chunk its decay and ``K_c^T V_c``, composed."""
    T = U = None
    writes = (terms["k"].transpose(-1, -2) @ terms["v"]).unbind(2)
    for decay, U_c in zip(terms["decay"].unbind(2), writes):
        T_c = decay[..., None, None]
        T, U = (T_c, U_c) if T is None else compose((T, U), (T_c, U_c), elementwise=True)
    return T, U


def zero_state(terms):
    """The ``(B, h, n, p)`` state before a sequence."""
    k, v = terms["k"], terms["v"]
    return k.new_zeros(*k.shape[:2], k.shape[-1], v.shape[-1])


SSD = ChunkRule(chunk_terms, run_chunks, span_map, elementwise=True, zero_state=zero_state)
