"""Gated DeltaNet's causal short convolution over TSP ranks: each of a rank's
two sequence chunks needs the ``kernel - 1`` tokens before it, which other
ranks hold (the zigzag layout's neighbours, or further back where chunks are
shorter than that). Every chunk's last ``kernel - 1`` tokens are all-gathered
(forward; their gradients reduce-scattered to their owners in backward):
``2 (kernel - 1) C`` elements a rank, whatever the sequence length.

With packed documents a token's window stops at its document's start, as
Hugging Face's layer run on each document alone pads it with zeros."""

import bisect

import torch
import torch.nn.functional as F

from ds_tsp.parallel import comm, layout
from ds_tsp.parallel.mappings import gather_rows


def halos(x, group, layout_name, width):
    """``(B, width, C)`` for each of this rank's two chunks of ``x`` ``(B, S/D, C)``:
    the ``width`` tokens before the chunk in the sequence, zeros before its start."""
    D, r = comm.group_size(group), comm.group_rank(group)
    chunks = x.chunk(2, dim=1)
    keep = min(width, chunks[0].shape[1])
    tails = gather_rows(torch.stack([c[:, -keep:] for c in chunks]), group)  # (2D, B, keep, C), rank-major
    order = layout.rank_major_chunks(D, layout_name)
    by_chunk = [None] * len(order)
    for tail, chunk in zip(tails.unbind(0), order):
        by_chunk[chunk] = tail
    start = x.new_zeros(x.shape[0], width, x.shape[2])
    return [torch.cat([start, *by_chunk[:chunk]], dim=1)[:, -width:] for chunk in layout.chunk_ids(r, D, layout_name)]


def _within_documents(padded, weight, bias, documents, first):
    """The depthwise causal convolution of ``padded`` ``(B, width + n, C)``
    (global positions from ``first``) with each output's window cut at its
    document's start: every run of one document's tokens convolved on its own,
    zero-padded where the document starts, as Hugging Face's layer convolves a
    document run alone."""
    width = weight.shape[-1] - 1
    rows = []
    for row, starts in zip(padded, documents):
        cuts = [first + width] + [s for s in starts if first + width < s < first + row.shape[0]]
        pieces = []
        for begin, end in zip(cuts, cuts[1:] + [first + row.shape[0]]):
            document = starts[bisect.bisect_right(starts, begin) - 1]
            context_start = max(document, begin - width)
            context = row[context_start - first:end - first].t().unsqueeze(0)  # (1, C, end - context_start)
            out = F.conv1d(context, weight.unsqueeze(1), bias, padding=width, groups=weight.shape[0])
            pieces.append(out[0, :, begin - context_start:end - context_start])
        rows.append(torch.cat(pieces, dim=1))
    return torch.stack(rows)  # (B, C, n)


def causal_conv(x, weight, bias, group, layout_name="zigzag", activation=None, documents=None):
    """Hugging Face's ``causal_conv1d_fn`` (depthwise, ``weight`` ``(C, kernel)``)
    on this rank's tokens ``x`` ``(B, S/D, C)`` in the TSP layout, exact for the
    whole sequence; ``documents``: the rows' packed document starts, or None."""
    D, r = comm.group_size(group), comm.group_rank(group)
    width = weight.shape[-1] - 1
    chunk_len = x.shape[1] // 2
    outputs = []
    for chunk, halo, index in zip(x.chunk(2, dim=1), halos(x, group, layout_name, width),
                                  layout.chunk_ids(r, D, layout_name)):
        padded = torch.cat([halo, chunk], dim=1).to(weight.dtype)  # (B, width + n, C)
        if documents is None:
            out = F.conv1d(padded.transpose(1, 2), weight.unsqueeze(1), bias, groups=weight.shape[0])
        else:
            out = _within_documents(padded, weight, bias, documents, index * chunk_len - width)
        outputs.append(out)
    out = torch.cat(outputs, dim=2)
    return (out if activation is None else activation(out)).transpose(1, 2).to(x.dtype)
