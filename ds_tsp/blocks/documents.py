"""Packed documents: several documents in one row, each attended causally within itself.

A row packs documents where its position ids do not go up by exactly one from
a token to the next: each such place starts a document (Hugging Face's rule,
``masking_utils.find_packed_sequence_indices``, which ``DataCollatorWithFlattening``
and SFT packing produce by restarting position ids at 0). Flash-attention's
``cu_seq_lens_q`` / ``cu_seq_lens_k`` keyword arguments say the same for a row.
As in Hugging Face, documents are read from position ids only when no
``attention_mask`` is given: HF attends across documents when a mask is
given, so ds_tsp refuses the two together instead of guessing.

A document is kept as the global index of its first token, one sorted list per
row. The TSP attention never builds a mask from them: ``query_blocks`` cuts
each of this rank's query chunks at document starts, and every piece attends
bottom-right causally to the keys from its document's start to its own end,
which is exactly the block-diagonal causal mask, at no memory cost.

A vision-language model may also let the tokens of one image see each other
both ways (Gemma 3's ``token_type_ids``): its *bidirectional spans*, per row
sorted ``(start, end)`` pairs, cut the query pieces again, and a piece inside
a span sees the span's keys up to its end (``Block.ahead``), still within its
document.
"""

import bisect
from typing import NamedTuple

import torch

from ds_tsp.parallel import layout

CU_SEQ_LENS_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")


def document_starts(position_ids, attention_mask=None, cu_seq_lens=None, shape=None):
    """Per row, the sorted start indices of its documents (``[[0, 5, 9], [0]]``),
    or None when every row is one document (the common case costs nothing more).

    ``position_ids`` is ``(B, S)`` as the caller gave it, or None;
    ``cu_seq_lens`` the flash-attention cumulative lengths ``(n + 1,)`` of a
    batch ``shape = (1, S)`` that is one packed row, or None.
    """
    starts = None
    if cu_seq_lens is not None:
        starts = _starts_from_cu_seq_lens(cu_seq_lens, position_ids, shape)
    elif position_ids is not None:
        boundary = torch.diff(position_ids, dim=-1) != 1  # (B, S-1): token t+1 starts a document
        if boundary.any():
            rows, columns = boundary.nonzero(as_tuple=True)
            starts = [[0] for _ in range(position_ids.shape[0])]
            for row, column in zip(rows.tolist(), columns.tolist()):
                starts[row].append(column + 1)
    if starts is not None and attention_mask is not None:
        raise ValueError("position_ids restart inside a row (packed documents) and an attention_mask is given: "
                         "Hugging Face then attends across the documents, so the result would depend on the "
                         "attention backend. Pass attention_mask=None (as DataCollatorWithFlattening does) to "
                         "attend within each document, or give each row one run of position ids")
    return starts


def _starts_from_cu_seq_lens(cu_seq_lens, position_ids, shape):
    cu_seq_lens = [int(n) for n in cu_seq_lens]
    if cu_seq_lens[0] != 0 or any(b <= a for a, b in zip(cu_seq_lens, cu_seq_lens[1:])):
        raise ValueError(f"cu_seq_lens_q = {cu_seq_lens} must start at 0 and strictly increase: "
                         "they are the cumulative document lengths of one packed row")
    if tuple(shape) != (1, cu_seq_lens[-1]):
        raise ValueError(f"cu_seq_lens_q ends at {cu_seq_lens[-1]} but the batch is {tuple(shape)}: "
                         "cu_seq_lens describe one packed row (batch size 1) of exactly that many tokens")
    if position_ids is not None:
        # HF's flash-attention reads cu_seq_lens and ignores the position ids'
        # restarts; the two must not tell different stories.
        from_positions = document_starts(position_ids) or [[0]]
        if from_positions[0] != cu_seq_lens[:-1]:
            raise ValueError(f"cu_seq_lens_q = {cu_seq_lens} and the restarts of position_ids "
                             f"(documents at {from_positions[0]}) disagree: pass one of them, or make them match")
    return [cu_seq_lens[:-1]] if len(cu_seq_lens) > 2 else None


def check_cu_seq_lens(kwargs):
    """The one ``cu_seq_lens`` of HF's flash-attention keyword arguments (q and k
    must agree: self-attention), or None. Removes the keys it reads."""
    given = {key: kwargs.pop(key) for key in CU_SEQ_LENS_KEYS if kwargs.get(key) is not None}
    for key in ("max_length_q", "max_length_k"):
        kwargs.pop(key, None)  # derived from cu_seq_lens
    if not given:
        return None
    if len(given) == 2 and not torch.equal(torch.as_tensor(given["cu_seq_lens_q"]),
                                           torch.as_tensor(given["cu_seq_lens_k"])):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ: TSP self-attention needs the same documents for "
                         "queries and keys")
    return next(iter(given.values()))


def local_starts(documents, tsp_rank, tsp_size, layout_name, local_len, device):
    """``(B, S/D)`` bool: which of this rank's tokens start a packed document (``documents``: each row's starts),
    where a recurrent layer's state restarts; worked out on the host, then moved without waiting for the device."""
    positions = layout.positions(tsp_rank, tsp_size, layout_name, local_len * tsp_size)
    starts = torch.stack([torch.isin(positions, torch.tensor(row, dtype=positions.dtype)) for row in documents])
    return starts.to(device, non_blocking=True)


def chunked_documents(documents, seq_len, batch, chunk):
    """The document starts a chunked-attention layer attends within (Llama 4's
    ``chunked_attention`` layers: a block-diagonal causal mask over chunks of
    ``chunk`` tokens): each row (or packed document, from ``documents``) cut
    every ``chunk`` tokens from its start, as Hugging Face's chunked mask cuts
    it (from the first real token of a row; from position 0 of a document)."""
    rows = documents or [[0]] * batch
    return [sorted({t for start, end in zip(starts, [*starts[1:], seq_len]) for t in range(start, end, chunk)})
            for starts in rows]


def start_at_position_zero(documents, positions):
    """Whether every packed document of ``documents`` starts at position id 0
    (``positions`` ``(B, S)`` on the host), as HF's chunked mask, reading chunks
    off the position ids, and ``chunked_documents`` agree only then."""
    if documents is None:
        return True
    return positions is not None and all(int(positions[row, start]) == 0 for row, starts in enumerate(documents)
                                         for start in starts)


def bidirectional_spans(marked, left_padding=None):
    """Per row, the sorted ``(start, end)`` runs of ``marked`` tokens (a host
    ``(B, S)`` bool: Gemma 3's image tokens, ``token_type_ids == 1``), moved
    left by the row's ``left_padding`` (``(B,)`` or None) as the rows are; None
    when no row has one. One run is one image's tokens, as Hugging Face's
    ``get_block_sequence_ids_for_mask`` groups them."""
    if not marked.any():
        return None
    border = torch.zeros(marked.shape[0], 1, dtype=torch.int8)
    edges = torch.diff(marked.to(torch.int8), dim=-1, prepend=border, append=border)  # 1: a run starts, -1: ends
    spans = []
    for row, row_edges in enumerate(edges):
        shift = 0 if left_padding is None else int(left_padding[row])
        starts, ends = ((row_edges == step).nonzero().flatten().tolist() for step in (1, -1))
        spans.append([(start - shift, end - shift) for start, end in zip(starts, ends)])
    return spans


class Block(NamedTuple):
    """Local queries ``[q_lo, q_hi)`` attending to the global keys ``[k_lo, k_hi)``.

    Query ``i`` of the block is the key ``own = i + (k_hi - k_lo) - (q_hi - q_lo) - ahead``
    of the range (bottom-right alignment, ``ahead`` keys past the last query's
    own). A causal block (``ahead`` None) sees the keys up to its own; a
    bidirectional one (queries inside a bidirectional span, ``ahead`` >= 0:
    the span's keys after the last query) sees every key of the range. With
    a sliding window, either sees only keys after ``own - window``."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    ahead: int | None = None

    @property
    def end(self):
        """One past the global position of the block's last query."""
        return self.k_hi - (self.ahead or 0)


def query_blocks(documents, local_len, tsp_rank, tsp_size, layout_name, batch=1, token_tile=0, window=None,
                 spans=None):
    """The attention work of this rank's ``local_len`` query tokens, grouped by
    the rows a group covers: ``[(rows, [Block, ...]), ...]``.

    Without documents or spans: one group over every row (``batch`` of them),
    one causal block per chunk (chunk ``g`` of ``2D`` sees the key prefix that
    ends with itself). With documents (or ``spans``, per row its sorted
    bidirectional ``(start, end)`` pairs, or None): one group per row, one
    block per piece of a chunk that lies in one document, whose keys start at
    that document's start, and a piece in a span its own block, whose keys end
    at the span's end (cut at the document's). Blocks are then cut into tiles
    of at most ``token_tile`` query tokens over the group's rows (0: no cut),
    each with its own key range, and with a sliding ``window`` no block's keys
    reach further back than its first query sees.
    """
    chunk_len = local_len // 2
    chunks = layout.chunk_ids(tsp_rank, tsp_size, layout_name)
    if documents is None and spans is None:
        groups = [(slice(None), batch, [Block(i * chunk_len, (i + 1) * chunk_len, 0, (c + 1) * chunk_len)
                                        for i, c in enumerate(chunks)])]
    else:
        groups = []
        for row in range(batch):
            starts, row_spans = [0] if documents is None else documents[row], [] if spans is None else spans[row]
            blocks = []
            for i, c in enumerate(chunks):
                lo, hi = c * chunk_len, (c + 1) * chunk_len
                k = bisect.bisect_right(starts, lo) - 1  # the document holding the chunk's first token
                while k < len(starts) and starts[k] < hi:
                    document_end = starts[k + 1] if k + 1 < len(starts) else None
                    end = min(hi, document_end or hi)
                    blocks += _pieces(max(lo, starts[k]), end, starts[k], document_end, row_spans,
                                      i * chunk_len - lo)
                    k += 1
            groups.append((slice(row, row + 1), 1, blocks))
    return [(rows, [tile for block in _merge_adjacent(blocks)
                    for tile in _tiles(block, token_tile and max(1, token_tile // rows_in_group), window)])
            for rows, rows_in_group, blocks in groups]


def _pieces(first, end, document_start, document_end, spans, to_local):
    """The blocks of the global queries ``[first, end)`` of one document
    (from ``document_start``; ``document_end`` None: the row's end): causal
    pieces between the bidirectional ``spans``, and each piece inside one its
    own block seeing the span's keys (cut at the document's end).
    ``to_local``: added to a global query position to give its local index."""
    blocks, at = [], first
    for span_start, span_end in spans[max(0, bisect.bisect_right(spans, (first, float("inf"))) - 1):]:
        if span_start >= end:
            break
        span_start = max(span_start, document_start)
        span_end = span_end if document_end is None else min(span_end, document_end)
        if span_end <= at:
            continue
        if span_start > at:
            blocks.append(Block(at + to_local, span_start + to_local, document_start, span_start))
            at = span_start
        piece_end = min(end, span_end)
        blocks.append(Block(at + to_local, piece_end + to_local, document_start, span_end, span_end - piece_end))
        at = piece_end
    if at < end:
        blocks.append(Block(at + to_local, end + to_local, document_start, end))
    return blocks


def _merge_adjacent(blocks):
    """Blocks of one kind whose queries follow one another, locally and in
    the row, and that see the same keys' start (and, bidirectional, the same
    keys' end) are one block: the contiguous layout's two chunks, the zigzag
    layout's at D = 1, the two chunks' pieces of one document or one span.
    Fewer, longer kernel calls; the same mask."""
    merged = []
    for block in blocks:
        if merged:
            last = merged[-1]
            follows = (block.q_lo == last.q_hi and block.k_lo == last.k_lo
                       and block.end - block.q_hi == last.end - last.q_hi)
            if follows and block.ahead is None and last.ahead is None:
                merged[-1] = last._replace(q_hi=block.q_hi, k_hi=block.k_hi)
                continue
            if follows and block.ahead is not None and last.ahead is not None and block.k_hi == last.k_hi:
                merged[-1] = last._replace(q_hi=block.q_hi, ahead=block.ahead)
                continue
        merged.append(block)
    return merged


def _tiles(block, tile_len, window):
    """``block`` cut into query tiles of at most ``tile_len`` tokens (one if 0),
    each keeping the keys its queries see."""
    tile_len = tile_len or block.q_hi - block.q_lo
    for start in range(block.q_lo, block.q_hi, tile_len):
        stop = min(start + tile_len, block.q_hi)
        own_end = block.end - (block.q_hi - stop)  # one past the tile's last query in the row
        k_hi = own_end if block.ahead is None else block.k_hi
        k_lo = block.k_lo if window is None else max(block.k_lo, own_end - (stop - start) - window + 1)
        yield Block(start, stop, k_lo, k_hi, None if block.ahead is None else k_hi - own_end)
