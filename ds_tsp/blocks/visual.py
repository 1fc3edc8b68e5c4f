"""A vision tower's work split over the TSP group, its rows sent to the tokens they replace (DESIGN.md 6m).

The images and videos of a micro-batch (its visual items) are encoded per
item: patches attend within their item only. Under TSP the group acts as
data parallelism for the tower: each rank encodes a contiguous share of the
items, balanced by patch count (``share_items``), so no rank runs the tower on
every item. Each item's merged rows replace its placeholder tokens'
embeddings, which live on the ranks whose zigzag (or contiguous) chunks hold
their positions: one all-to-all with split sizes sends every row to its
owner, and backward sends each row's gradient back (``VisualRoute``).

Everything the route needs (the placeholders' positions, every item's patch
and token count) is known to every rank from the same host copy of the
batch, so every rank computes every rank's plan alike and no counts travel.
"""

from dataclasses import dataclass

import torch

from ds_tsp.parallel import layout
from ds_tsp.parallel.mappings import exchange_rows


@dataclass(frozen=True)
class VisualItem:
    """One image or video of the micro-batch: which placeholder token it fills
    (``token_id``), how many rows of its pixel tensor it takes (``patches``) and
    how many placeholder tokens (merged rows) the tower gives it (``tokens``)."""

    token_id: int
    patches: int
    tokens: int


def share_items(patches, tsp_size):
    """Each rank's items ``range(first, stop)``, contiguous and in order:
    rank ``r`` takes the items whose first patch falls in ``[r T/D, (r+1) T/D)``
    of the ``T`` patches in all, so it encodes at most ``T/D`` plus the largest
    item's patches."""
    total, starts, start = sum(patches), [], 0
    for count in patches:
        starts.append(start)
        start += count
    bounds = [sum(1 for s in starts if s * tsp_size < r * total) for r in range(tsp_size + 1)]
    bounds[-1] = len(patches)
    return [range(bounds[r], bounds[r + 1]) for r in range(tsp_size)]


class VisualRoute:
    """Where this rank's encoded rows go and where the rows it receives land.

    ``items``: the micro-batch's visual items in the order their rows fill the
    placeholders (Hugging Face's ``masked_scatter``: per token id, the items in
    order, each item's rows to the next placeholders of its id in row-major
    order). ``token_ids``: ``(B, S)`` host ids, padded as the TSP batch is.
    Every rank's share of the items is ``share_items``'s; ``self.items`` is
    this rank's, ``send_order`` the permutation of its encoded rows by
    destination rank, ``send_counts`` / ``recv_counts`` the all-to-all's split
    sizes and ``slots`` the local flat token indices ``(B * S/D)`` the
    received rows fill, in the order they arrive."""

    def __init__(self, items, token_ids, tsp_rank, tsp_size, layout_name):
        batch, seq_len = token_ids.shape
        shares = share_items([item.patches for item in items], tsp_size)
        self.items = shares[tsp_rank]
        flat = torch.arange(batch * seq_len).view(batch, seq_len)
        owner, local = torch.empty(batch * seq_len, dtype=torch.long), torch.empty(batch * seq_len, dtype=torch.long)
        for rank in range(tsp_size):
            owned = layout.shard(flat, rank, tsp_size, layout_name).reshape(-1)
            owner[owned], local[owned] = rank, torch.arange(owned.numel())
        # Every encoded row's placeholder (a flat index into the batch), in item order.
        placeholders = {token_id: (token_ids.reshape(-1) == token_id).nonzero().squeeze(1)
                        for token_id in dict.fromkeys(item.token_id for item in items)}
        for token_id, positions in placeholders.items():
            wanted = sum(item.tokens for item in items if item.token_id == token_id)
            if positions.numel() != wanted:
                raise ValueError(f"the batch holds {positions.numel()} placeholder tokens of id {token_id} but its "
                                 f"images or videos of that kind give {wanted} rows (Hugging Face: \"features and "
                                 "tokens do not match\"): build input_ids, the pixel values and their grids with "
                                 "the model's processor, and truncate no row inside an image")
        taken, rows, source = dict.fromkeys(placeholders, 0), [], []
        for index, item in enumerate(items):
            start = taken[item.token_id]
            rows.append(placeholders[item.token_id][start:start + item.tokens])
            taken[item.token_id] = start + item.tokens
            source.append(next(rank for rank, share in enumerate(shares) if index in share))
        rows = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
        source = torch.repeat_interleave(torch.tensor(source, dtype=torch.long),
                                         torch.tensor([item.tokens for item in items], dtype=torch.long))
        destination = owner[rows]
        mine = destination[source == tsp_rank]
        self.send_order = torch.sort(mine, stable=True).indices
        self.send_counts = torch.bincount(mine, minlength=tsp_size).tolist()
        # Rows arrive by source rank, each source's in item order: the global item order, as shares are contiguous.
        arriving = destination == tsp_rank
        self.recv_counts = torch.bincount(source[arriving], minlength=tsp_size).tolist()
        self.slots = local[rows[arriving]]

    def received(self, encoded, group):
        """The encoded rows this rank's placeholders take, in ``slots`` order:
        ``encoded`` (this rank's items' rows, in item order; their features
        side by side where the tower gives several per row) sent to their
        owners. Backward sends each row's gradient back."""
        return exchange_rows(encoded[self.send_order.to(encoded.device)], self.send_counts, self.recv_counts, group)

    def place(self, hidden, rows):
        """``hidden`` ``(B, S/D, H)`` (this rank's embeddings) with its
        placeholder tokens' rows replaced by ``rows`` (``received``'s).
        Differentiable in both (a placeholder's embedding gets no gradient)."""
        flat = hidden.flatten(0, 1).index_put((self.slots.to(hidden.device),), rows.to(hidden.dtype))
        return flat.view_as(hidden)

    def add(self, hidden, rows):
        """``hidden`` with ``rows`` added at its placeholder tokens (Qwen3-VL's
        deepstack: ``hidden[visual] + features``, as Hugging Face adds them)."""
        flat = hidden.flatten(0, 1).index_add(0, self.slots.to(hidden.device), rows.to(hidden.dtype))
        return flat.view_as(hidden)
