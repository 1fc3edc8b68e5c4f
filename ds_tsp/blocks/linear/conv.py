"""Gated DeltaNet's causal short convolution over TSP ranks: each of a rank's
two sequence chunks needs the ``kernel - 1`` tokens before it, which other
ranks hold (the zigzag layout's neighbours, or further back where chunks are
shorter than that). Every chunk's last ``kernel - 1`` tokens are all-gathered
(forward; their gradients reduce-scattered to their owners in backward):
``2 (kernel - 1) C`` elements a rank, whatever the sequence length."""

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


def causal_conv(x, weight, bias, group, layout_name="zigzag", activation=None):
    """Hugging Face's ``causal_conv1d_fn`` (depthwise, ``weight`` ``(C, kernel)``)
    on this rank's tokens ``x`` ``(B, S/D, C)`` in the TSP layout, exact for the whole sequence."""
    width = weight.shape[-1] - 1
    outputs = []
    for chunk, halo in zip(x.chunk(2, dim=1), halos(x, group, layout_name, width)):
        padded = torch.cat([halo, chunk], dim=1).transpose(1, 2)  # (B, C, width + n)
        outputs.append(F.conv1d(padded.to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0]))
    out = torch.cat(outputs, dim=2)
    return (out if activation is None else activation(out)).transpose(1, 2).to(x.dtype)
