"""Which tokens of a sequence each TSP rank owns.

The sequence is cut into ``2*D`` equal chunks. With the zigzag layout rank
``r`` owns chunks ``r`` and ``2D-1-r`` (in that order), so every rank does the
same causal-attention work; with the contiguous layout it owns ``2r`` and
``2r+1``, i.e. one contiguous ``S/D`` slice. Keeping two chunks per rank in
both layouts lets attention treat them the same way.
"""

import torch

LAYOUTS = ("zigzag", "contiguous")


def chunk_ids(tsp_rank, tsp_size, layout):
    """The global chunk indices (out of ``2*tsp_size``) owned by ``tsp_rank``."""
    if layout == "zigzag":
        return [tsp_rank, 2 * tsp_size - 1 - tsp_rank]
    if layout == "contiguous":
        return [2 * tsp_rank, 2 * tsp_rank + 1]
    raise ValueError(f"unknown layout {layout!r}: choose one of {LAYOUTS}")


def rank_major_chunks(tsp_size, layout):
    """Global chunk indices in the order an all-gather over the group stacks them."""
    return [c for r in range(tsp_size) for c in chunk_ids(r, tsp_size, layout)]


def check_divisible(seq_len, tsp_size):
    if seq_len % (2 * tsp_size):
        raise ValueError(
            f"sequence length {seq_len} is not a multiple of 2*tsp.size = {2 * tsp_size}: "
            f"pad it with ds_tsp.parallel.layout.pad_to_multiple (the model does this for you)"
        )


def shard(x, tsp_rank, tsp_size, layout, dim=1):
    """This rank's tokens of ``x`` (the full sequence along ``dim``), shape ``S/D`` there."""
    check_divisible(x.shape[dim], tsp_size)
    chunks = x.chunk(2 * tsp_size, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(tsp_rank, tsp_size, layout)], dim=dim)


def unshard(stacked, tsp_size, layout, dim=1):
    """Inverse of ``shard`` for every rank at once.

    ``stacked`` is ``(D, *local_shape)``, the shards of ranks ``0..D-1`` as an
    all-gather returns them; the result is the full sequence in natural order
    along ``dim`` (``dim`` counts in the local shape).
    """
    pieces = [c for shard_ in stacked.unbind(0) for c in shard_.chunk(2, dim=dim)]
    order = rank_major_chunks(tsp_size, layout)
    natural = [None] * len(order)
    for piece, chunk in zip(pieces, order):
        natural[chunk] = piece
    return torch.cat(natural, dim=dim)


def stack_shards(x, tsp_size, layout, dim=1, dtype=None):
    """Every rank's shard of the full sequence ``x``, stacked ``(D, ...)``: the
    input a reduce-scatter needs to hand each rank its own tokens. One copy
    (in ``dtype``, ``x``'s by default), chunk by chunk into the result."""
    check_divisible(x.shape[dim], tsp_size)
    chunks = x.chunk(2 * tsp_size, dim=dim)
    local_shape = list(x.shape)
    local_shape[dim] //= tsp_size
    stacked = x.new_empty((tsp_size, *local_shape), dtype=dtype or x.dtype)
    for r in range(tsp_size):
        for piece, c in zip(stacked[r].chunk(2, dim=dim), chunk_ids(r, tsp_size, layout)):
            piece.copy_(chunks[c])
    return stacked


def positions(tsp_rank, tsp_size, layout, seq_len, device=None):
    """Global position ids ``(S/D,)`` of this rank's tokens."""
    return shard(torch.arange(seq_len, device=device).unsqueeze(0), tsp_rank, tsp_size, layout)[0]


def padded_length(seq_len, tsp_size):
    multiple = 2 * tsp_size
    return -(-seq_len // multiple) * multiple


def pad_to_multiple(x, tsp_size, value, dim=1):
    """Right-pad ``x`` along ``dim`` to a multiple of ``2*tsp_size``.

    Returns ``(padded, num_padding)``; ``real_token_mask`` says which tokens are real.
    """
    seq_len = x.shape[dim]
    num_padding = padded_length(seq_len, tsp_size) - seq_len
    if num_padding == 0:
        return x, 0
    pad_shape = list(x.shape)
    pad_shape[dim] = num_padding
    return torch.cat([x, x.new_full(pad_shape, value)], dim=dim), num_padding


def real_token_mask(seq_len, num_padding, device=None):
    """``(S_padded,)`` bool: True for real tokens, False for right padding."""
    mask = torch.ones(seq_len + num_padding, dtype=torch.bool, device=device)
    if num_padding:
        mask[seq_len:] = False
    return mask


def unpad(x, num_padding, dim=1):
    return x.narrow(dim, 0, x.shape[dim] - num_padding)
