"""Gated DeltaNet's causal short convolution over TSP ranks: each of a rank's
two sequence chunks needs the ``kernel - 1`` tokens before it, which other
ranks hold (the zigzag layout's neighbours, or further back where chunks are
shorter than that). Every chunk's last ``kernel - 1`` tokens are all-gathered
(forward; their gradients reduce-scattered to their owners in backward):
``2 (kernel - 1) C`` elements a rank, whatever the sequence length.

With packed documents a token's window stops at its document's start, as
Hugging Face's layer run on each document alone pads it with zeros."""

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


def document_ids(documents, first, length, device):
    """``(B, length)``: which document of its row each global position
    ``first .. first + length - 1`` lies in (``documents``: each row's sorted
    document starts, ``ds_tsp.blocks.documents``)."""
    positions = torch.arange(first, first + length, device=device)
    return torch.stack([torch.searchsorted(torch.tensor(starts, device=device), positions, right=True)
                        for starts in documents])


def _within_documents(padded, weight, ids):
    """The depthwise causal convolution of ``padded`` ``(B, width + n, C)`` with
    each output's window cut to its own document (``ids`` ``(B, width + n)``)."""
    kernel = weight.shape[-1]
    windows = padded.unfold(1, kernel, 1)  # (B, n, C, kernel)
    same = ids.unfold(1, kernel, 1) == ids[:, kernel - 1:].unsqueeze(-1)  # (B, n, kernel)
    return (windows * same.unsqueeze(2).to(windows.dtype) * weight).sum(-1).transpose(1, 2)  # (B, C, n)


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
            ids = document_ids(documents, index * chunk_len - width, chunk_len + width, x.device)
            out = _within_documents(padded, weight, ids)
            out = out if bias is None else out + bias.unsqueeze(-1)
        outputs.append(out)
    out = torch.cat(outputs, dim=2)
    return (out if activation is None else activation(out)).transpose(1, 2).to(x.dtype)
