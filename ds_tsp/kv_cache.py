"""The sequence-sharded KV cache of TSP inference.

Every rank of a TSP group keeps, for every layer, the rotated keys and the
values of the tokens IT owns, for all key/value heads, with their global
positions: the group's cache is the full one cut ``D`` ways by token, never
replicated. Prompt tokens stay where the prefill layout put them (right
padding of the layout is dropped); each generated token's K/V goes to the
least-filled rank (ties: lowest rank), so after the prompt's padding
imbalance (< 2 tokens) is absorbed no rank holds more than one token more
than another. Every rank computes the same placement from sizes alone, so
none of it needs communication, and the storage is allocated once at its
final size.
"""

import torch

from . import layout


def prompt_tokens(tsp_rank, tsp_size, layout_name, prompt_len, device=None):
    """``(local indices, positions)`` of this rank's real prompt tokens in the
    prefill layout of a prompt of ``prompt_len`` tokens (the layout's right
    padding is left out)."""
    positions = layout.positions(tsp_rank, tsp_size, layout_name, layout.padded_length(prompt_len, tsp_size),
                                 device=device)
    keep = (positions < prompt_len).nonzero().squeeze(1)
    return keep, positions[keep]


def placement(prompt_counts, num_new_tokens):
    """The rank that caches each of ``num_new_tokens`` generated tokens, and the
    per-rank slot counts at the end (``prompt_counts``: prompt tokens per rank)."""
    counts = list(prompt_counts)
    targets = []
    for _ in range(num_new_tokens):
        target = counts.index(min(counts))
        counts[target] += 1
        targets.append(target)
    return targets, counts


class KVCache:
    """This rank's slots of every layer's cache.

    ``keys[l]``, ``values[l]``: ``(B, capacity, nkv, d)``; ``positions`` and
    ``valid`` ``(B, capacity)`` are shared by the layers (a slot holds the same
    token in each). A slot is invalid for a row when it holds padding of that
    row; invalid slots are never attended. Only the first ``length`` slots are
    filled.
    """

    def __init__(self, num_layers, batch, capacity, num_kv_heads, head_dim, dtype, device):
        shape = (batch, capacity, num_kv_heads, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._positions = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self._valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.length = 0

    @property
    def capacity(self):
        return self._valid.shape[1]

    def reserve(self, positions, valid):
        """Claim the next ``n`` slots for tokens at ``positions`` ``(B, n)``, valid
        per row where ``valid`` ``(B, n)``; returns the slots as a slice."""
        n = positions.shape[1]
        if self.length + n > self.capacity:
            raise RuntimeError(f"KV cache full: {self.length} + {n} slots > capacity {self.capacity}")
        slots = slice(self.length, self.length + n)
        self._positions[:, slots] = positions
        self._valid[:, slots] = valid
        self.length += n
        return slots

    def write(self, layer, slots, keys, values):
        """Store rotated ``keys`` and ``values`` ``(B, n, nkv, d)`` of ``layer`` in ``slots``."""
        self.keys[layer][:, slots] = keys
        self.values[layer][:, slots] = values

    def layer(self, layer):
        """``(keys, values)`` of ``layer``'s filled slots, ``(B, length, nkv, d)`` each."""
        return self.keys[layer][:, :self.length], self.values[layer][:, :self.length]

    @property
    def positions(self):
        return self._positions[:, :self.length]

    @property
    def valid(self):
        return self._valid[:, :self.length]

    def nbytes(self):
        """Bytes of the cached keys and values (filled slots, all layers)."""
        return sum(t[:, :self.length].numel() * t.element_size() for t in (*self.keys, *self.values))
