"""The sequence-sharded KV cache of TSP inference, as a transformers ``Cache``.

Every rank of a TSP group keeps, for every layer, the rotated keys and the
values of the tokens IT owns, for all key/value heads, with their global
positions: the group's cache is the full one cut ``D`` ways by token, never
replicated. Prompt tokens stay where the prefill layout put them (right
padding of the layout is dropped); each generated token's K/V goes to the
least-filled rank (ties: lowest rank), so after the prompt's padding
imbalance (< 2 tokens) is absorbed no rank holds more than one token more
than another. Every rank computes the same placement from sizes alone, so
none of it needs communication.

Being a ``Cache`` is what lets Hugging Face's ``generate`` carry it from step
to step, reorder it for beam search (``reorder_cache``) and expand it
(``batch_repeat_interleave``); only the TSP decoder (``ds_tsp.inference.generate``)
reads and writes its tensors. Rolling tokens back (``crop``, which assisted
and speculative decoding need) is refused.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ds_tsp.parallel import layout

# A full cache grows by at least this fraction of its capacity, so the
# reallocations of a long generation stay few and the slack stays small.
GROWTH = 1 / 8


def prompt_tokens(tsp_rank, tsp_size, layout_name, prompt_len, device=None):
    """``(local indices, positions)`` of this rank's real prompt tokens in the
    prefill layout of a prompt of ``prompt_len`` tokens (the layout's right
    padding is left out)."""
    positions = layout.positions(tsp_rank, tsp_size, layout_name, layout.padded_length(prompt_len, tsp_size),
                                 device=device)
    keep = (positions < prompt_len).nonzero().squeeze(1)
    return keep, positions[keep]


def _not_for_hugging_face_attention(*_args, **_kwargs):
    raise TypeError("a TSP KV cache holds this rank's tokens only and is read and written by the TSP decoder "
                    "(ds_tsp.inference.generate); a Hugging Face attention layer cannot use it")


class _TSPLayer(CacheLayerMixin):
    """A layer of a ``TSPCache``: its tensors are read and written by the TSP decoder only."""

    def __init__(self):
        super().__init__()
        self.is_initialized = True

    lazy_initialization = update = get_mask_sizes = _not_for_hugging_face_attention

    def get_seq_length(self):
        raise TypeError("ask the TSPCache, not one of its layers, for its length")

    def get_max_length(self):
        return -1


class TSPCacheLayer(_TSPLayer):
    """One decoder layer's rotated keys and values in this rank's slots,
    ``(B, nkv, capacity, d)`` each, Hugging Face's layout (their positions are
    the cache's): a decode step's attention multiplies them in place."""

    def __init__(self, keys, values):
        super().__init__()
        self.keys, self.values = keys, values


class TSPStateLayer(_TSPLayer):
    """One recurrent layer's states for this rank's heads (not cut by token):
    its convolution's last ``kernel - 1`` inputs ``(B, C, kernel - 1)`` and its
    recurrent state (Gated DeltaNet's ``(B, hv, dk, dv)``, Mamba-2's
    ``(B, h/D, n, p)``), both updated in place by a decode step
    (``ds_tsp.inference.linear_decode``, ``mamba2_decode``)."""

    def __init__(self, conv, recurrent):
        super().__init__()
        self.conv, self.recurrent = conv, recurrent


class TSPHybridLayer(TSPCacheLayer):
    """A layer running a recurrent mixer beside its attention (Falcon-H1's): the attention's slots and the
    mixer's states, both updated in place."""

    def __init__(self, keys, values, conv, recurrent):
        super().__init__(keys, values)
        self.conv, self.recurrent = conv, recurrent


class TSPCache(Cache):
    """This rank's slots of every layer's cache.

    ``positions`` and ``valid`` ``(B, length)`` are shared by the layers (a
    slot holds the same token in each); a slot is invalid for a row when it
    holds padding of that row, and invalid slots are never attended.
    ``rank_counts`` are the slots of every rank of the group (the same list on
    each), from which every rank places the next token alike;
    ``next_positions`` ``(B,)`` the position of each row's next token.
    ``get_seq_length`` counts the input columns seen, padding included, as
    Hugging Face's caches do. ``shapes``: ``{layer: (key heads, key width,
    value width)}`` of the attention layers, each its own (Gemma 4's full
    layers have wider heads and fewer of them); a value width None is the
    key's, 0 no values (a multi-head latent attention caches its latent and
    rotary key as one key head, its values being the latent itself).
    ``states``: ``{layer: (conv shape, recurrent shape, recurrent dtype)}`` of
    a hybrid's recurrent layers, without the batch: those layers keep this
    rank's head group's states (``TSPStateLayer``) instead of slots. A layer in
    both (Falcon-H1's: a Mamba-2 mixer beside the attention) keeps both
    (``TSPHybridLayer``); a layer in neither (an MLP alone, Nemotron-H's)
    keeps nothing.
    """

    def __init__(self, num_layers, batch, dtype, device, tsp_rank, rank_counts, shapes, states=None):
        slots = rank_counts[tsp_rank]
        states = states or {}

        def layer(index):
            if index not in states and index not in shapes:  # a layer of an MLP alone (Nemotron-H's)
                return _TSPLayer()
            if index in states:
                conv, recurrent, state_dtype = states[index]
                held = (torch.zeros((batch, *conv), dtype=dtype, device=device),
                        torch.zeros((batch, *recurrent), dtype=state_dtype, device=device))
                if index not in shapes:
                    return TSPStateLayer(*held)
            key_heads, key_dim, value_dim = shapes[index]
            # Zeros, not empty: a slot no token of a row is written to is masked out of that row's attention,
            # but its value still meets a zero weight in probs @ values, and 0 x NaN of stale memory is NaN.
            kv = (torch.zeros((batch, key_heads, slots, key_dim), dtype=dtype, device=device),
                  torch.zeros((batch, key_heads, slots, key_dim if value_dim is None else value_dim), dtype=dtype,
                              device=device))
            return TSPHybridLayer(*kv, *held) if index in states else TSPCacheLayer(*kv)

        super().__init__(layers=[layer(index) for index in range(num_layers)])
        self._positions = torch.zeros(batch, slots, dtype=torch.long, device=device)
        self._valid = torch.zeros(batch, slots, dtype=torch.bool, device=device)
        self.length = 0
        self.rank_counts = list(rank_counts)
        self.next_positions = torch.zeros(batch, dtype=torch.long, device=device)
        # (B,) padding tokens each prompt had before its first real one: a token's cache position as Hugging
        # Face counts it (Llama 4's temperature tuning reads it) is its position plus this.
        self.left_padding = torch.zeros(batch, dtype=torch.long, device=device)
        # (B,) what a VLM's new tokens add to their positions to rotate (Hugging Face's rope_deltas: a prompt's
        # M-RoPE positions run past its length by this); zero for a text model.
        self.rope_deltas = torch.zeros(batch, dtype=torch.long, device=device)
        self.seen_tokens = 0

    @property
    def capacity(self):
        return self._valid.shape[1]

    def place_next_token(self):
        """The rank that caches the next generated token (the least filled,
        ties to the lowest rank); counts it there."""
        target = self.rank_counts.index(min(self.rank_counts))
        self.rank_counts[target] += 1
        return target

    def reserve(self, positions, valid):
        """Claim the next ``n`` slots for tokens at ``positions`` ``(B, n)``, valid
        per row where ``valid`` ``(B, n)``, growing the storage if it is full;
        returns the slots as a slice."""
        n = positions.shape[1]
        if self.length + n > self.capacity:
            self._grow(self.length + n)
        slots = slice(self.length, self.length + n)
        self._positions[:, slots] = positions
        self._valid[:, slots] = valid
        self.length += n
        return slots

    def _grow(self, needed):
        capacity = max(needed, self.capacity + max(int(self.capacity * GROWTH), 16))

        def grown(tensor, dim):
            shape = list(tensor.shape)
            shape[dim] = capacity
            bigger = tensor.new_zeros(shape)
            bigger.narrow(dim, 0, self.length).copy_(tensor.narrow(dim, 0, self.length))
            return bigger

        for layer in self._slot_layers():
            layer.keys, layer.values = grown(layer.keys, 2), grown(layer.values, 2)
        self._positions, self._valid = grown(self._positions, 1), grown(self._valid, 1)

    def _slot_layers(self):
        return [layer for layer in self.layers if isinstance(layer, TSPCacheLayer)]

    def states(self, layer):
        """``(conv, recurrent)`` states of a recurrent ``layer`` (Gated DeltaNet, Mamba-2, Mamba-1, a short
        convolution), updated in place."""
        return self.layers[layer].conv, self.layers[layer].recurrent

    def write(self, layer, slots, keys, values):
        """Store rotated ``keys`` and ``values`` ``(B, n, nkv, d)`` of ``layer`` in ``slots``."""
        self.layers[layer].keys[:, :, slots] = keys.transpose(1, 2)
        self.layers[layer].values[:, :, slots] = values.transpose(1, 2)

    def layer(self, layer):
        """``(keys, values)`` of ``layer``'s filled slots, ``(B, nkv, length, d)`` each."""
        return self.layers[layer].keys[:, :, :self.length], self.layers[layer].values[:, :, :self.length]

    @property
    def positions(self):
        return self._positions[:, :self.length]

    @property
    def valid(self):
        return self._valid[:, :self.length]

    def nbytes(self):
        """Bytes of the cached keys and values (filled slots, all layers) and of the Gated DeltaNet states."""
        slots = sum(t[:, :, :self.length].numel() * t.element_size()
                    for layer in self._slot_layers() for t in (layer.keys, layer.values))
        return slots + sum(t.numel() * t.element_size() for layer in self.layers if hasattr(layer, "recurrent")
                           for t in (layer.conv, layer.recurrent))

    def get_seq_length(self, layer_idx=0):
        return self.seen_tokens

    def get_max_length(self, layer_idx=None):
        return -1

    def _select_rows(self, select):
        """Apply ``select`` (a function of a tensor with the batch first) to every per-row tensor."""
        for layer in self.layers:
            if hasattr(layer, "recurrent"):
                layer.conv, layer.recurrent = select(layer.conv), select(layer.recurrent)
            if isinstance(layer, TSPCacheLayer):
                layer.keys, layer.values = select(layer.keys), select(layer.values)
        self._positions, self._valid = select(self._positions), select(self._valid)
        self.next_positions = select(self.next_positions)
        self.left_padding, self.rope_deltas = select(self.left_padding), select(self.rope_deltas)

    def reorder_cache(self, beam_idx):
        """Beam search: row ``i`` becomes row ``beam_idx[i]``, on every rank alike."""
        self._select_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats):
        self._select_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        self._select_rows(lambda t: t[indices])

    def crop(self, tokens_to_remove):
        raise NotImplementedError("a TSP KV cache cannot roll tokens back (crop), which assisted and speculative "
                                  "decoding (assistant_model, prompt_lookup_num_tokens) need: generate without them")

    def reset(self):
        raise NotImplementedError("a TSP KV cache is not reset between generations: pass no cache to "
                                  "model.generate and the prefill builds a new one")
