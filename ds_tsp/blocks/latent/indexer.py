"""DeepSeek's sparse attention under TSP (DESIGN.md 6o): the lightning indexer
chooses, for every query, the ``index_topk`` earlier tokens its attention reads.

Per layer with an indexer of its own, in forward only (Hugging Face runs the
indexer under ``no_grad``: its weights take no gradient):

1. the indexer pieces (``wq_b``'s and ``wk``'s rows, ``shards.py``) are
   broadcast in turn, and each rank projects its own tokens through all of
   them: its queries' index heads ``(B, S/D, Hi, Di)`` from the query latent,
   and its tokens' index keys ``(B, S/D, Di)`` from the hidden states, normed
   by the key norm and rotated as the model's indexer rotates them;
2. the index keys ride in the latent's all-gather: ``Di`` more elements a token;
3. each rank scores its own queries against every key it may see (causal,
   within its packed document), tile by tile of queries and keys, in float32
   as Hugging Face does, and keeps a running top-k: no rank holds a
   ``(local tokens x S)`` score matrix. Among equal scores the earlier key is
   kept (``torch.topk``'s order among ties is its own, and differs between
   devices and lengths; the tests check each query's choice against Hugging Face's);
4. each query attends to its chosen latent rows only (``attend_selected``), in
   query tiles, each recomputed in backward, so the chosen rows of one tile
   exist at a time; their gradients add into the gathered latent's gradient,
   which goes back to the owners with the latent's reduce-scatter.

A layer whose indexer is shared (GLM-MoE-DSA's ``indexer_types`` "shared")
attends to the previous indexer layer's choice, which the decoder layers hand
on (``TSPDecoderLayer``'s ``shared``). The choice is saved for backward
(``index_topk`` int32 a token): backward does not run the indexer again.
A decode step chooses among every rank's cached keys (``choose_cached_keys``).
"""

import functools
import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ds_tsp.parallel import comm, layout

QUERY_TILE = 128  # queries scored (and attended) at once
KEY_TILE = 1024  # keys scored at once against a query tile
NOT_CHOSEN = -1  # a slot of the choice left empty: the query may see fewer keys than index_topk


class IndexerParts(nn.Module):
    """The indexer's tensors every rank keeps whole, under Hugging Face's names:
    the key norm (a LayerNorm) and the per-head weights (``weights_proj``, which
    Hugging Face keeps in float32)."""

    def __init__(self, k_norm, weights_proj):
        super().__init__()
        self.k_norm, self.weights_proj = k_norm, weights_proj


@dataclass(frozen=True)
class IndexerPlan:
    """How one layer scores and chooses its keys."""

    topk: int
    heads: int
    head_dim: int
    rope_dim: int
    rope_first: bool  # the rotated dims lead each index head (DeepSeek-V3.2's, GLM's), or trail it (HY-V4's)
    rope: object  # rope(t (B, L, h, rope_dim), tables): the model's indexer's rotary function
    parts: IndexerParts
    scale_on_scores: bool  # softmax_scale inside the relu (DeepSeek-V3.2's), or on the head weights (HY-V4's)
    first_key: torch.Tensor  # (B, S/D) each local query's first visible key (its document's start), natural order
    last_key: torch.Tensor  # (B, S/D) its last: itself
    tile_ends: tuple  # per query tile, one past the last key any of its queries sees (host ints)

    @property
    def softmax_scale(self):
        return self.head_dim ** -0.5


def indexer_form(indexer):
    """``(rotary function, rope_first, scale_on_scores)`` of a Hugging Face indexer, read off its forward:
    interleaved or half-split rotary, the rotated dims first or last, the softmax scale inside the relu or on
    the head weights."""
    modeling = sys.modules[type(indexer).__module__]
    source = inspect.getsource(type(indexer).forward)
    rotate = (modeling.apply_rotary_pos_emb_interleave if "apply_rotary_pos_emb_interleave(" in source
              else modeling.apply_rotary_pos_emb)
    rope_first = "q_rot, q_pass = torch.split" in source
    scale_on_scores = ".float().unsqueeze(1)) * self.softmax_scale" in source
    return rotate, rope_first, scale_on_scores


def key_bounds(documents, batch, local_len, tsp_rank, tsp_size, layout_name, device):
    """``(first, last, tile_ends)``: each local query's first and last visible
    key ``(B, S/D)`` in natural order (its packed document's start, itself),
    on ``device``, and per query tile one past the last key it sees, worked
    out on the host."""
    positions = layout.positions(tsp_rank, tsp_size, layout_name, local_len * tsp_size)
    rows = documents or [[0]] * batch
    first = torch.stack([torch.tensor(starts)[torch.searchsorted(torch.tensor(starts), positions, right=True) - 1]
                         for starts in rows])
    # Worked out without reading a tensor: the layout's two chunks of local_len / 2 tokens, each in natural order.
    chunk, chunks = local_len // 2, layout.chunk_ids(tsp_rank, tsp_size, layout_name)

    def natural(i):
        return chunks[i // chunk] * chunk + i % chunk

    tiles = [(a, min(a + QUERY_TILE, local_len)) for a in range(0, local_len, QUERY_TILE)]
    ends = tuple(max(natural(b - 1), natural(min(b, chunk) - 1)) + 1 for a, b in tiles)
    last = positions.expand(batch, -1)
    return first.to(device, non_blocking=True), last.to(device, non_blocking=True), ends


def index_projections(x, c_q, pieces):
    """The local tokens' whole ``wq_b`` and ``wk`` outputs ``(B, S/D, Hi * Di)`` and ``(B, S/D, Di)``, from
    every rank's indexer piece (``pieces``: ``(j, weights)`` pairs)."""
    queries, keys = [], []
    for _, w in pieces:
        queries.append(F.linear(c_q, w["indexer.wq_b.weight"]))
        keys.append(F.linear(x, w["indexer.wk.weight"]))
    return torch.cat(queries, dim=-1), torch.cat(keys, dim=-1)


def index_inputs(ip, x, q, k, tables):
    """From the tokens ``x`` and their whole ``wq_b`` and ``wk`` outputs ``q``
    and ``k``: their index queries ``(B, L, Hi, Di)`` and head weights ``(B, L,
    Hi)``, in float32, and index keys ``(B, L, Di)`` in ``x``'s dtype, as the
    model's indexer makes them."""
    B, L = x.shape[:2]
    q = q.view(B, L, ip.heads, ip.head_dim)
    norm = ip.parts.k_norm
    k = norm(k.to(norm.weight.dtype)).to(x.dtype).unsqueeze(2)
    q, k = _rotated(ip, q, tables), _rotated(ip, k, tables).squeeze(2)
    projection = ip.parts.weights_proj
    weights = projection(x.to(projection.weight.dtype)).float() * ip.heads ** -0.5
    if not ip.scale_on_scores:
        weights = weights * ip.softmax_scale
    return q.float(), weights, k


def _rotated(ip, t, tables):
    """``t`` ``(B, L, h, Di)`` with its rotary dims rotated by the indexer's own function."""
    split = [ip.rope_dim, ip.head_dim - ip.rope_dim] if ip.rope_first else [ip.head_dim - ip.rope_dim, ip.rope_dim]
    first, second = t.split(split, dim=-1)
    if ip.rope_first:
        return torch.cat([ip.rope(first, tables).to(t.dtype), second], dim=-1)
    return torch.cat([first, ip.rope(second, tables).to(t.dtype)], dim=-1)


@torch.no_grad()
def choose_keys(ip, q, weights, keys):
    """Each local query's chosen keys ``(B, S/D, topk)`` (natural indices, int32,
    ``NOT_CHOSEN`` in the slots of a query that sees fewer keys): the
    top-``topk`` index scores among the keys it may see, scored in tiles against
    the whole sequence's index ``keys`` ``(B, S, Di)``."""
    chosen = torch.empty((*q.shape[:2], ip.topk), dtype=torch.int32, device=q.device)
    for tile, a in enumerate(range(0, q.shape[1], QUERY_TILE)):
        b = min(a + QUERY_TILE, q.shape[1])
        chosen[:, a:b] = _choose_for_tile(ip, q[:, a:b], weights[:, a:b], keys, ip.first_key[:, a:b, None],
                                          ip.last_key[:, a:b, None], ip.tile_ends[tile])
    return chosen


def _choose_for_tile(ip, q, weights, keys, first, last, end):
    B, T = q.shape[:2]
    values = q.new_empty((B, T, 0))
    index = torch.empty((B, T, 0), dtype=torch.long, device=q.device)
    for s in range(0, end, KEY_TILE):
        e = min(s + KEY_TILE, end)
        tile = _index_scores(ip, q, weights, keys[:, s:e])  # (B, T, e - s)
        positions = torch.arange(s, e, device=q.device)
        tile = tile.masked_fill(~visible(positions, first, last), float("-inf"))
        values = torch.cat([values, tile], dim=-1)
        index = torch.cat([index, positions.expand(B, T, -1)], dim=-1)
        if values.shape[-1] > ip.topk:
            # Stable: among equal scores the earlier candidate, which is the earlier key, stays.
            values, order = values.sort(dim=-1, descending=True, stable=True)
            values, index = values[..., :ip.topk], index.gather(-1, order[..., :ip.topk])
    index = index.masked_fill(values == float("-inf"), NOT_CHOSEN).to(torch.int32)
    return F.pad(index, (0, ip.topk - index.shape[-1]), value=NOT_CHOSEN)  # every tile topk wide


def _index_scores(ip, q, weights, keys):
    """Index scores ``(B, T, K)`` of queries ``q`` ``(B, T, Hi, Di)`` (head weights ``(B, T, Hi)``) against
    ``keys`` ``(B, K, Di)``, in float32, by Hugging Face's indexer's steps."""
    scores = torch.matmul(q, keys.transpose(-1, -2).float().unsqueeze(1))  # (B, T, Hi, K)
    if ip.scale_on_scores:
        scores = scores * ip.softmax_scale
    return torch.matmul(weights.unsqueeze(-2), F.relu(scores)).squeeze(-2)


@torch.no_grad()
def choose_cached_keys(ip, q, weights, keys, key_positions, key_valid, group):
    """A decode step's choice: which of this rank's cached keys ``(B, T, Di)``
    (at ``key_positions``, cached where ``key_valid``, ``(B, T)``) the new
    query ``q`` ``(B, Hi, Di)`` (head weights ``(B, Hi)``) attends to, ``(B,
    T)`` bool. Each rank sends its best ``topk`` (score, position) pairs; every
    rank merges them alike and keeps the keys that rank above the
    ``topk``-th, the earlier key first among equal scores."""
    scores = _index_scores(ip, q.unsqueeze(1), weights.unsqueeze(1), keys)[:, 0]  # (B, T)
    scores = scores.masked_fill(~key_valid, float("-inf"))
    values, positions = _best(scores, key_positions, ip.topk)
    every = comm.all_gather_small(torch.stack([values.double(), positions.double()]), group)  # (D, 2, B, topk)
    values, positions = (every[:, part].transpose(0, 1).flatten(1) for part in (0, 1))
    values, positions = _best(values, positions.long(), ip.topk)
    last_value, last_position = values[:, -1:].to(scores.dtype), positions[:, -1:]
    return key_valid & ((scores > last_value) | ((scores == last_value) & (key_positions <= last_position)))


def _best(values, positions, topk):
    """The ``topk`` best ``(values, positions)`` of each row, the earlier position first among equal values,
    padded with ``(-inf, -1)`` to ``topk``."""
    order = positions.argsort(dim=-1, stable=True)
    values, positions = values.gather(-1, order), positions.gather(-1, order)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    k = min(topk, values.shape[-1])
    values, positions = values[:, :k], positions.gather(-1, order[:, :k])
    return F.pad(values, (0, topk - k), value=float("-inf")), F.pad(positions, (0, topk - k), value=-1)


def visible(keys, first, last):
    """Which of the natural positions ``keys`` each query sees, given its first and last visible key."""
    return (keys >= first) & (keys <= last)


def attend_selected(q, K, V, chosen, scale, sinks=None):
    """Each query of ``q`` ``(B, S/D, h, dk)`` attending to its ``chosen`` rows
    ``(B, S/D, k)`` of ``K`` ``(B, S, hk, dk)`` and ``V`` ``(B, S, hk, dv)``
    (``hk`` 1: one key head for all, the absorbed form), with a sink logit a
    head (``sinks`` ``(h,)``) in each softmax where given, tile by tile of
    queries; under autograd each tile is recomputed in backward, so one tile's
    chosen rows exist at a time."""
    outputs = []
    for a in range(0, q.shape[1], QUERY_TILE):
        b = min(a + QUERY_TILE, q.shape[1])
        run = functools.partial(_attend_tile, scale=scale)
        if torch.is_grad_enabled():
            outputs.append(checkpoint(run, q[:, a:b], K, V, chosen[:, a:b], sinks, use_reentrant=False))
        else:
            outputs.append(run(q[:, a:b], K, V, chosen[:, a:b], sinks))
    return torch.cat(outputs, dim=1)


def _attend_tile(q, K, V, chosen, sinks, scale):
    chosen = chosen.long()
    rows = torch.arange(q.shape[0], device=q.device)[:, None, None]
    keys, values = K[rows, chosen.clamp(min=0)], V[rows, chosen.clamp(min=0)]  # (B, T, k, hk, d)
    if K.shape[2] == 1:
        logits = torch.einsum("bqhd,bqkd->bqhk", q, keys.squeeze(3)) * scale
    else:
        logits = torch.einsum("bqhd,bqkhd->bqhk", q, keys) * scale
    logits = logits.masked_fill((chosen == NOT_CHOSEN).unsqueeze(2), float("-inf"))
    acc = torch.promote_types(q.dtype, torch.float32)
    if sinks is not None:  # a sink column a head, dropped after the softmax
        sink = sinks.to(logits.dtype).view(1, 1, -1, 1).expand(*logits.shape[:-1], 1)
        weights = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1, dtype=acc)[..., :-1].to(q.dtype)
    else:
        weights = torch.softmax(logits, dim=-1, dtype=acc).to(q.dtype)
    if V.shape[2] == 1:
        return torch.einsum("bqhk,bqkd->bqhd", weights, values.squeeze(3))
    return torch.einsum("bqhk,bqkhd->bqhd", weights, values)
