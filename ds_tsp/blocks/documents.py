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
"""

import bisect

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


def query_blocks(documents, local_len, tsp_rank, tsp_size, layout_name, batch=1, token_tile=0, window=None):
    """The attention work of this rank's ``local_len`` query tokens, grouped by
    the rows a group covers: ``[(rows, [(q_lo, q_hi, k_lo, k_hi), ...]), ...]``.
    Local queries ``[q_lo, q_hi)`` attend bottom-right causally to the global
    keys ``[k_lo, k_hi)``.

    Without documents: one group over every row (``batch`` of them), one block
    per chunk (chunk ``g`` of ``2D`` sees the key prefix that ends with itself).
    With documents: one group per row, one block per piece of a chunk that lies
    in one document, whose keys start at that document's start. Blocks are then
    cut into tiles of at most ``token_tile`` query tokens over the group's rows
    (0: no cut), each with its own causal key range, and with a sliding
    ``window`` no block's keys reach further back than its first query sees.
    """
    chunk_len = local_len // 2
    chunks = layout.chunk_ids(tsp_rank, tsp_size, layout_name)
    if documents is None:
        groups = [(slice(None), batch, [(i * chunk_len, (i + 1) * chunk_len, 0, (c + 1) * chunk_len)
                                        for i, c in enumerate(chunks)])]
    else:
        groups = []
        for row, starts in enumerate(documents):
            blocks = []
            for i, c in enumerate(chunks):
                lo, hi = c * chunk_len, (c + 1) * chunk_len
                k = bisect.bisect_right(starts, lo) - 1  # the document holding the chunk's first token
                while k < len(starts) and starts[k] < hi:
                    end = min(hi, starts[k + 1] if k + 1 < len(starts) else hi)
                    first = max(lo, starts[k])
                    blocks.append((first - lo + i * chunk_len, end - lo + i * chunk_len, starts[k], end))
                    k += 1
            groups.append((slice(row, row + 1), 1, blocks))
    return [(rows, [tile for block in _merge_adjacent(blocks)
                    for tile in _tiles(block, token_tile and max(1, token_tile // rows_in_group), window)])
            for rows, rows_in_group, blocks in groups]


def _merge_adjacent(blocks):
    """Blocks whose queries follow one another and that see the same keys'
    start at the same causal offset (``k_hi - q_hi``) are one block: the
    contiguous layout's two chunks, the zigzag layout's at D = 1, the two
    chunks' pieces of one document. Fewer, longer kernel calls; the same mask."""
    merged = []
    for block in blocks:
        if merged:
            q_lo, q_hi, k_lo, k_hi = merged[-1]
            if block[0] == q_hi and block[2] == k_lo and block[3] - block[1] == k_hi - q_hi:
                merged[-1] = (q_lo, block[1], k_lo, block[3])
                continue
        merged.append(block)
    return merged


def _tiles(block, tile_len, window):
    """``block`` cut into query tiles of at most ``tile_len`` tokens (one if 0),
    each keeping the keys its queries see under bottom-right causal alignment."""
    q_lo, q_hi, k_lo, k_hi = block
    tile_len = tile_len or q_hi - q_lo
    for start in range(q_lo, q_hi, tile_len):
        end = min(start + tile_len, q_hi)
        tile_k_hi = k_hi - (q_hi - end)
        tile_k_lo = k_lo if window is None else max(k_lo, tile_k_hi - (end - start) - window + 1)
        yield start, end, tile_k_lo, tile_k_hi
