"""TSP inference behind Hugging Face's ``model.generate``: a prefill with the
training schedules, then one token at a time with the weights at rest and a
sequence-sharded KV cache (``ds_tsp.inference.kv_cache.TSPCache``).

A TSP model's forward with a cache (``use_cache=True``, or the ``cache`` that
``generate`` passes) is ``cached_forward``: Hugging Face's loop does the
decoding (greedy, sampling and its warpers, beam search, penalties, stopping
criteria, streamers) on every rank alike, and each forward it calls runs here.

Prefill runs the prompt through the TSP layers exactly as the training forward
does (broadcast schedule for attention, ring for the MLP, no autograd): the
prompt is thousands of tokens, so moving weights is the right trade. Each rank
keeps, per layer, the rotated K and the V of its own prompt tokens
(``TSPCache``).

Decoding is the opposite regime: one token per sequence, so moving
activations is orders of magnitude cheaper than moving weights (Llama-2-7B,
D=8, bf16, one sequence: the broadcast schedule and the ring would bring each
rank ~350 MB of weights per layer per token; this brings it ~150 KB). So
weights never move; every rank holds the new token (replicated) and, per
layer:

* attention: rank ``j`` projects q/k/v of head group ``j`` with its own shard;
  one all-gather hands every rank all heads' q and the new k/v, which the
  rank chosen by ``TSPCache.place_next_token`` appends to its cache. Each rank
  attends all heads over its LOCAL cache, giving partial ``(out, lse)``; an
  all-to-all sends head group ``j``'s partials to rank ``j``, which merges
  them by log-sum-exp and applies its ``o_proj`` columns. The ``D`` partial
  outputs ``(B, H)`` are all-gathered and summed in rank order.
* MLP: rank ``j`` runs the token through its own ``F``-shard (1/D of the
  FLOPs, where the ring would have every rank compute the whole MLP for the
  same token); a mixture of experts routes the token on every rank and rank
  ``j`` runs its own experts (and shared-expert slice). The ``D`` partial
  outputs are all-gathered and summed in rank order.

Summing all-gathered parts in a fixed order (rather than an all-reduce) makes
the hidden states, hence the logits and the chosen tokens, bit-identical on
every rank; for one token per sequence the extra bytes ((D-1) B H against
~2 B H) are noise next to the latency of a collective. Bytes received (=
sent) per rank, per decode step and layer, with ``e`` the model's element
size and ``a`` that of the accumulation dtype (float32, or float64 for
float64 models)::

    (D-1) * B * [ (hq + 2*hkv) * d * e      # all-gather of the new q, k, v
                + hq * (d + 1) * a          # all-to-all of partial (out, lse)
                + 2 * H * e ]               # all-gathers of attention and MLP outputs

and nothing else (no weight moves), plus, with the folded vocabulary
(``tsp.vocab_parallel``), the all-gather of each rank's embedding rows of
the new tokens (``(D-1) * B * H * e``; zeros where another rank owns the id)
and the all-gather of the logits slices (``(D-1) * B * ceil(V/D) * e``).
These are latency-bound messages (``comm.all_gather_small``): where
DeepSpeed's shared-memory all-reduce carries the group, as for its
tensor-parallel inference (CPU ranks, the TSP group spanning the world), each
all-gather of ``n`` bytes a rank is an all-reduce over zero-filled slots that
moves ``2 (D-1) n`` instead, and the all-to-all one of ``2 (D-1) D n``. The
prefill adds one all-gather of ``B * H`` (the last prompt token's hidden
state, from its owner), the same logits all-gather, and the broadcast of TSP
rank 0's random state (``agree_on_random_state``).
"""

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from ds_tsp.blocks.attention.schedule import attended_values, attention_forward, project, raw_values, split_gate
from ds_tsp.blocks.layer_inputs import local_layer_inputs, replicated_layer_inputs
from ds_tsp.blocks.streams import into_streams, out_of_streams
from ds_tsp.blocks.rotary import (layer_rotary_tables, query_scale_positions, rotary_at, rotate, scale_queries,
                                  text_and_rotary_positions)
from ds_tsp.blocks.vocab import (LogitMap, embed_local_tokens, embedding_multiplier, full_vocab_logits,
                                 replicated_embedding, soft_cap)
from ds_tsp.blocks.latent.indexer import choose_cached_keys
from ds_tsp.blocks.latent.module import TSPLatentAttention
from ds_tsp.blocks.linear.mamba1 import TSPMamba1
from ds_tsp.blocks.linear.mamba2_module import TSPMamba2
from ds_tsp.blocks.linear.streamed import left_padding_refusal
from ds_tsp.blocks.linear.module import TSPGatedDeltaNet
from ds_tsp.blocks.linear.short_conv import TSPShortConv
from ds_tsp.blocks.moe.module import TSPSparseMoE
from ds_tsp.inference.kv_cache import TSPCache, prompt_tokens
from ds_tsp.inference.latent_decode import decode_latent_attention, latent_cache_shape, prefill_latent_attention
from ds_tsp.inference import linear_decode, mamba1_decode, mamba2_decode, short_conv_decode
from ds_tsp.parallel import comm, layout
from ds_tsp.parallel.host_reads import host_read


@torch.no_grad()
def cached_forward(model, input_ids, attention_mask=None, position_ids=None, cache=None, logits_to_keep=0,
                   visual=None):
    """``(logits, cache)`` of a TSP model's forward with a KV cache, as Hugging
    Face's ``generate`` calls it, on every rank of the TSP group with the same
    arguments.

    Without a cache, or with the empty one ``generate`` makes, ``input_ids``
    ``(B, P)`` are prompts, LEFT padded where ``attention_mask`` is zero (as
    for Hugging Face generation): the prefill, which returns a new
    ``TSPCache``. With that cache, ``input_ids`` ``(B, n)`` are the next ``n``
    tokens of every row and ``attention_mask`` covers all ``seen + n``
    columns: decode steps. Positions count from each prompt's first real
    token; ``position_ids``, where given, must be those. ``logits`` ``(B, 1, V)``
    are the last token's, bit-identical on every rank, so every rank's loop
    picks the same tokens.

    A vision-language model's prompt may hold images and videos (``visual``,
    ``ds_tsp.injection.multimodal.VisualInputs``): the prefill encodes them
    split over the group as training does, and rotates by their M-RoPE
    positions (Hugging Face's ``(4, B, P)`` position ids: text positions,
    then the three axes; computed from the prompt where not given); each
    new token then rotates at its position plus its row's ``rope_deltas``.
    """
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep != 1:
        raise ValueError(f"a TSP forward with a KV cache returns the last token's logits only: it takes "
                         f"logits_to_keep=1, as model.generate passes it (got {logits_to_keep!r}; assisted and "
                         "speculative decoding, which ask for more, are not supported: a TSP cache cannot roll "
                         "tokens back); for every token's logits run the forward without use_cache or cache")
    decoder = TSPDecoder(model)
    if isinstance(cache, TSPCache):
        if visual is not None:
            raise ValueError("images or videos after the prompt: a TSP cache continues with text tokens only; "
                             "put every image in the prompt")
        _check_continuation(cache, input_ids, attention_mask, position_ids)
        for column in range(input_ids.shape[1]):
            logits = decoder.step(cache, input_ids[:, column])
        cache.seen_tokens += input_ids.shape[1]
        return logits.unsqueeze(1), cache
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(f"cache is a {type(cache).__name__} holding {cache.get_seq_length()} tokens; a TSP model "
                         "continues only from the TSPCache its own prefill returned: pass the whole prompt and no "
                         "cache")
    if any(hasattr(param, "ds_id") for param in model.parameters()):
        raise ValueError("generation reads the TSP shards at rest, which ZeRO-3 (zero_optimization.stage 3) keeps "
                         "partitioned over data-parallel ranks: save with ds_tsp.save_pretrained and generate from "
                         "ds_tsp.checkpoint.from_pretrained, or generate under ZeRO 0-2")
    folded = [block.ep_size for block in model.modules() if isinstance(block, TSPSparseMoE) and block.folded]
    if folded:
        raise ValueError(f"generation with experts folded over data-parallel replicas (tsp.expert_parallel_size = "
                         f"{folded[0]}) is not supported: each replica decodes its own prompts, while its experts "
                         "live on the others too; save with ds_tsp.save_pretrained and generate from "
                         "ds_tsp.checkpoint.from_pretrained without tsp.expert_parallel_size")
    prompt, lengths = left_aligned(input_ids, attention_mask, left_padding_refusal(model))
    text_positions, rotary = text_and_rotary_positions(position_ids)
    _check_prompt_positions(text_positions, attention_mask, input_ids)
    if visual is not None and rotary is None:
        _, rotary = visual.positions(input_ids, attention_mask, None)
    model.tsp_batch_check(input_ids=input_ids, attention_mask=attention_mask)
    agree_on_random_state(decoder.group, input_ids.device)
    rotary = None if rotary is None else _planes_left_aligned(rotary, lengths)
    cache, logits = decoder.prefill(prompt, lengths, rotary, visual)
    cache.seen_tokens = input_ids.shape[1]
    return logits.unsqueeze(1), cache


def _planes_left_aligned(planes, lengths):
    """Position planes ``(P, B, S)`` of left-padded prompts moved as ``left_aligned`` moves the prompts."""
    prompt_len = planes.shape[-1]
    shift = (prompt_len - lengths.to(planes.device)).unsqueeze(1)
    index = (torch.arange(prompt_len, device=planes.device).unsqueeze(0) + shift) % prompt_len
    return planes.gather(2, index.expand(planes.shape[0], -1, -1))


def _check_prompt_positions(position_ids, attention_mask, input_ids):
    """Refuse prompt ``position_ids`` other than Hugging Face's from the mask
    (each real token's count of real tokens before it)."""
    if position_ids is None:
        return
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    expected = real.long().cumsum(dim=1) - 1
    if position_ids.shape[-1] != input_ids.shape[1] or not bool(((position_ids == expected) | ~real).all()):
        raise ValueError("position_ids must count each prompt's real tokens from 0 (Hugging Face's "
                         "attention_mask.cumsum(-1) - 1), as TSP generation places the cached keys; pass no "
                         "position_ids, or those")


def _positions_continue(position_ids, expected, rope_deltas):
    """Whether new tokens' ``position_ids`` are those Hugging Face passes for
    the ``expected`` text positions ``(B, n)``: rotary positions, which a VLM
    offsets by each row's ``rope_deltas`` (zero for a text model), behind a
    text plane where there are four (a VLM's ``(4, B, n)``)."""
    rotary = expected + rope_deltas.unsqueeze(1)
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:
        return (position_ids[0] == expected).all() & (position_ids[1:] == rotary).all()
    return (position_ids == rotary).all()


def _check_continuation(cache, input_ids, attention_mask, position_ids):
    """Refuse new tokens that do not continue every row of ``cache``."""
    batch, n = input_ids.shape
    if batch != cache.next_positions.shape[0]:
        raise ValueError(f"input_ids has {batch} rows but the TSP cache {cache.next_positions.shape[0]}")
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, cache.seen_tokens + n):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; after {cache.seen_tokens} "
                         f"cached columns and {n} new tokens it must be ({batch}, {cache.seen_tokens + n})")
    continues = []
    if attention_mask is not None:
        continues.append(attention_mask[:, -n:].bool().all())
    if position_ids is not None:
        if position_ids.shape[-1] != n:
            raise ValueError(f"position_ids has {position_ids.shape[-1]} columns for {n} new tokens: pass the new "
                             "tokens' positions only, or none")
        expected = cache.next_positions.unsqueeze(1) + torch.arange(n, device=cache.next_positions.device)
        continues.append(_positions_continue(position_ids.to(expected.device), expected, cache.rope_deltas))
    if continues and not bool(host_read(torch.stack(continues).all(), "decode step check")):
        raise ValueError("new tokens must be real (attention_mask ones) at the positions that continue each row "
                         "(position_ids: the row's real tokens so far); TSP generation does not mask generated "
                         "tokens")


def agree_on_random_state(group, device):
    """Give every rank of ``group`` TSP rank 0's random state for ``device``,
    from which Hugging Face's sampling draws: with identical logits, every rank
    then samples the same tokens. Ranks seeded alike see no change."""
    if comm.group_size(group) == 1:
        return
    from deepspeed.accelerator import get_accelerator
    accelerator = None if device.type == "cpu" else get_accelerator()
    state = torch.get_rng_state() if accelerator is None else accelerator.get_rng_state(device.index)
    travelling = state.to(comm.group_device(group))  # NCCL's rule: a host tensor cannot travel
    comm.broadcast(travelling, src=0, group=group)
    state = host_read(travelling, "random state")
    if accelerator is None:
        torch.set_rng_state(state)
    else:
        accelerator.set_rng_state(state, device.index)


def left_aligned(input_ids, attention_mask, padding_refused=None):
    """``(prompts, lengths)``: each row's real tokens moved to the front (padding
    after them, where causal masking and the cache's validity keep it unseen),
    and the number of real tokens per row. Only left padding is accepted;
    ``padding_refused``: why the model cannot run padded prompts, or None."""
    batch, prompt_len = input_ids.shape
    if attention_mask is None:
        return input_ids, torch.full((batch,), prompt_len, dtype=torch.long, device=input_ids.device)
    mask = attention_mask.bool()
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}")
    host_mask = host_read(attention_mask, "prompt").bool()  # checked on the host, in one read
    if (host_mask[:, :-1] & ~host_mask[:, 1:]).any():
        raise ValueError("attention_mask must be left padding (each row: zeros, then ones); right padding or "
                         "holes inside a prompt are not supported by TSP generation: pad prompts on the left "
                         "(tokenizer.padding_side = 'left')")
    if padding_refused is not None and not host_mask.all():  # why the model's left-padded prompts cannot run
        raise ValueError(padding_refused)
    lengths = mask.sum(dim=1)
    if (host_mask.sum(dim=1) == 0).any():
        raise ValueError("every prompt needs at least one real token (a row of attention_mask is all zeros)")
    shift = (prompt_len - lengths).unsqueeze(1)
    index = (torch.arange(prompt_len, device=input_ids.device).unsqueeze(0) + shift) % prompt_len
    return input_ids.gather(1, index), lengths


def attend_cache(q, keys, values, key_positions, key_valid, query_positions, scale, window=None, softcap=None,
                 chunk=None):
    """Partial attention of one new token per row over this rank's cached keys.

    ``q`` ``(B, nq, d)``; ``keys`` ``(B, nkv, T, d)``, ``values`` ``(B, nkv, T, dv)`` with global
    ``key_positions`` and ``key_valid`` ``(B, T)``; ``query_positions`` ``(B,)``.
    Every cached key is at or before the query, so only validity, the
    sliding window and the chunk (Llama 4's chunked layers: keys in the
    query's chunk of ``chunk`` positions) mask; ``softcap`` caps the scores as the layer's attention
    does. Returns ``out`` ``(B, nq, dv)`` and ``lse`` ``(B, nq)``
    in the accumulation dtype; a row with no visible key here gets ``out = 0``
    and ``lse = -inf``, which weigh nothing in ``merge_partials``.
    """
    # Softmax and sums in at least float32, as the merge needs; a fused
    # decoding kernel (flash-decoding) would avoid upcasting a bf16 cache.
    # The cache's (B, nkv, T, d) layout lets both products read it in place.
    acc = torch.promote_types(q.dtype, torch.float32)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    q = q.to(acc).view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = soft_cap(q @ keys.to(acc).transpose(-1, -2) * scale, softcap)  # (B, nkv, nq/nkv, T)
    visible = key_valid
    if window is not None:
        visible = visible & (key_positions > query_positions.unsqueeze(1) - window)
    if chunk is not None:
        visible = visible & (key_positions // chunk == query_positions.unsqueeze(1) // chunk)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0, lse).unsqueeze(-1))
    out = probs @ values.to(acc)  # (B, nkv, nq/nkv, d)
    return out.reshape(batch, num_heads, values.shape[-1]), lse.reshape(batch, num_heads)


def merge_partials(out, lse):
    """Merge partial attention over disjoint key sets by log-sum-exp: ``out``
    ``(D, B, h, d)``, ``lse`` ``(D, B, h)`` -> ``(B, h, d)``, ``(B, h)``."""
    total = torch.logsumexp(lse, dim=0)
    weights = torch.exp(lse - total)
    return (weights.unsqueeze(-1) * out).sum(dim=0), total


class RecurrentDecode(NamedTuple):
    """How generation runs one kind of recurrent mixer: its states' shapes, its prefill and its decode step."""

    state_shapes: Callable
    prefill: Callable
    decode: Callable


RECURRENT = {TSPGatedDeltaNet: RecurrentDecode(linear_decode.state_shapes, linear_decode.prefill_delta_net,
                                               linear_decode.decode_delta_net),
             TSPMamba2: RecurrentDecode(mamba2_decode.state_shapes, mamba2_decode.prefill_mamba2,
                                        mamba2_decode.decode_mamba2),
             TSPMamba1: RecurrentDecode(mamba1_decode.state_shapes, mamba1_decode.prefill_mamba1,
                                        mamba1_decode.decode_mamba1),
             TSPShortConv: RecurrentDecode(short_conv_decode.state_shapes, short_conv_decode.prefill_short_conv,
                                           short_conv_decode.decode_short_conv)}


def _recurrent_mixers(layers):
    """Each layer's recurrent mixer (its token mixer, or the one beside its attention), or None."""
    return [layer.side_mixer if layer.side_mixer is not None else
            layer.token_mixer if type(layer.token_mixer) in RECURRENT else None for layer in layers]


def _token_mixing(layer, attention, recurrent):
    """A layer's token-mixing branch for prefill or a decode step: ``attention(normed)`` for its attention,
    ``recurrent(normed, mixer)`` for a recurrent mixer, or both summed where the mixer runs beside the attention
    (``TSPDecoderLayer.beside_attention``)."""
    if layer.side_mixer is not None:
        return layer.beside_attention(attention, lambda normed: recurrent(normed, layer.side_mixer))
    if type(layer.token_mixer) in RECURRENT:
        return lambda normed: recurrent(normed, layer.token_mixer)
    return attention


class TSPDecoder:
    """Prefill and single-token steps of one injected model on this rank."""

    def __init__(self, model):
        policy, topology = model.tsp_policy, model.tsp_topology
        self.topology = topology
        self.group, self.tsp_rank, self.tsp_size = topology.tsp_group, topology.tsp_rank, topology.tsp_size
        self.layout = model.tsp_config.layout
        self.embed = model.get_submodule(policy.embed_tokens)
        self.rotary = policy.rotary_module(model)
        self.layers = list(model.get_submodule(policy.layers))
        self.final_norm = model.get_submodule(policy.final_norm)
        self.model = model  # its residual streams, where it has several (into_streams, out_of_streams)
        self.lm_head = model.get_submodule(policy.lm_head)
        config = model.config.get_text_config()
        self.logit_map = LogitMap.of(config)
        self.embedding_multiplier = embedding_multiplier(config)
        # Keys and values shared across layers (Gemma 4's): the layer storing them, by layer type.
        self.kv_sources = {layer.token_mixer.kv_key: index for index, layer in enumerate(self.layers)
                           if getattr(layer.token_mixer, "kv_sharing", None) == "store"}
        # Per-layer inputs (Gemma 4's): the decoder that mixes them and their embedding, or None.
        inputs = policy.model_inputs(model)
        self.decoder = model.get_submodule(policy.layers.rpartition(".")[0])
        self.layer_table = None if inputs is None else model.get_submodule(inputs.embed)

    def _layer_input(self, layer_inputs, index):
        """Layer ``index``'s part of every layer's input (``ds_tsp.blocks.layer_inputs``), None without."""
        return None if layer_inputs is None else layer_inputs[:, :, index]

    @torch.no_grad()
    def prefill(self, prompt, lengths, rotary=None, visual=None):
        """Run the left-aligned ``prompt`` ``(B, P)`` (``lengths`` real tokens per
        row) through the TSP layers; returns this rank's new ``TSPCache`` and the
        logits ``(B, V)`` of each row's last real token, on every rank. A VLM's
        prompt rotates by its M-RoPE positions ``rotary`` ``(3, B, P)`` (left-aligned
        too) and holds the images and videos of ``visual``."""
        batch, prompt_len = prompt.shape
        D, r, device = self.tsp_size, self.tsp_rank, prompt.device
        padded, num_padding = layout.pad_to_multiple(prompt, D, value=0)
        positions = layout.positions(r, D, self.layout, padded.shape[1], device=device)  # (S/D,)
        rank_ids = [layout.shard(padded, j, D, self.layout) for j in range(D)]
        hidden = embed_local_tokens(self.embed, rank_ids, r, multiplier=self.embedding_multiplier)  # (B, S/D, H)
        layer_inputs = None if self.layer_table is None else \
            local_layer_inputs(self.decoder, self.layer_table, rank_ids, r, None, hidden)
        if visual is not None:
            hidden = visual.embed(hidden, host_read(padded, "visual placeholders"), self.topology, self.layout)
        if rotary is None:
            tables = layer_rotary_tables(self.rotary, self.layers, hidden, positions.expand(batch, -1),
                                         (lengths.max() - 1).view(1, 1))
        else:
            tail = rotary.new_zeros(*rotary.shape[:-1], num_padding)  # padding: no real token sees it
            local = layout.shard(torch.cat([rotary, tail], dim=-1), r, D, self.layout, dim=2)
            tables = layer_rotary_tables(self.rotary, self.layers, hidden, local, rotary.amax().view(1, 1))
        hidden = into_streams(self.model, hidden)

        prompt_counts = [len(prompt_tokens(j, D, self.layout, prompt_len)[0]) for j in range(D)]
        # Worked out on the host (a nonzero on the device would wait for it), then moved.
        keep, kept_positions = (t.to(device) for t in prompt_tokens(r, D, self.layout, prompt_len))
        shapes = {index: _cache_shape(layer.token_mixer) for index, layer in enumerate(self.layers)
                  if layer.token_mixer is not None and type(layer.token_mixer) not in RECURRENT}
        states = {index: RECURRENT[type(mixer)].state_shapes(mixer, hidden.dtype)
                  for index, mixer in enumerate(_recurrent_mixers(self.layers)) if mixer is not None}
        cache = TSPCache(len(self.layers), batch, hidden.dtype, device, r, prompt_counts, shapes, states)
        slots = cache.reserve(kept_positions.expand(batch, -1), kept_positions.unsqueeze(0) < lengths.unsqueeze(1))
        cache.next_positions = lengths.clone()
        cache.left_padding = prompt_len - lengths
        if rotary is not None:  # Hugging Face's rope_deltas: the largest M-RoPE position of the prompt, past its length
            real = torch.arange(prompt_len, device=device).unsqueeze(0) < lengths.unsqueeze(1)
            cache.rope_deltas = rotary.masked_fill(~real, -1).amax(dim=(0, 2)) + 1 - lengths

        spans = None if visual is None else visual.spans(cache.left_padding)
        shared_kv = {}  # keys and values shared across layers (Gemma 4's), by layer type
        for index, layer in enumerate(self.layers):
            def store(conv, recurrent, index=index):
                for state, value in zip(cache.states(index), (conv, recurrent)):
                    state.copy_(value)

            def recurrent(normed, mixer):
                return RECURRENT[type(mixer)].prefill(mixer, normed, positions, lengths, self.group, store)

            def attention(normed):
                return self._prefill_attention(cache, index, slots, keep, layer.token_mixer, normed,
                                               tables[layer.rotary_kind], positions.expand(batch, -1), spans,
                                               shared_kv)

            attention = _token_mixing(layer, attention, recurrent)
            hidden = layer.blocks(hidden, attention, layer.mlp, per_layer_input=self._layer_input(layer_inputs, index))
            if visual is not None:
                hidden = visual.after_layer(index, hidden)
        hidden = out_of_streams(self.model, hidden)
        return cache, self._logits(self._last_tokens(hidden, positions, lengths, padded.shape[1]))

    def _prefill_attention(self, cache, index, slots, keep, attn, h, tables, positions, spans=None, shared_kv=None):
        """The broadcast schedule's attention output for the local tokens ``h``;
        their rotated K and V (``keep``: the real prompt tokens; a latent
        attention's latent) go to ``cache``. What the schedule saves for a
        backward is freed on return, before the MLP. ``spans``: the prompts'
        runs of tokens that see each other both ways (``VisualInputs.spans``).
        ``shared_kv``: the prompt's keys and values shared across layers, which
        a storing layer writes and a reusing one attends to, caching none."""
        if isinstance(attn, TSPLatentAttention):  # a choice of keys shared across layers like keys and values
            out, chosen = prefill_latent_attention(attn, h, tables, positions,
                                                   lambda latent: cache.write(index, slots, latent[:, keep],
                                                                              latent[:, keep, :, :0]),
                                                   shared_kv.get(attn.kv_key) if attn.kv_sharing == "reuse" else None)
            if attn.kv_sharing == "store":
                shared_kv[attn.kv_key] = chosen
            return out
        # A token's cache position counts its prompt's left padding, as Hugging Face's does.
        scale_positions = query_scale_positions(getattr(attn, "query_scale", None), positions,
                                                positions + cache.left_padding.unsqueeze(1))
        plan = attn.plan(h, positions=scale_positions, spans=spans)
        packed = attn.shard_weights().detach()
        cos, sin = attn.full_tables(tables)
        inv_rms = attn.projection_inv_rms(h, packed, plan)
        keys, values = [], []
        reuses = attn.kv_sharing == "reuse"
        out, _, *stored = attention_forward(plan, h, packed, cos, sin, inv_rms,
                                            kv_sink=lambda k, v: (keys.append(k), values.append(v)),
                                            shared=shared_kv[attn.kv_key] if reuses else None)
        if attn.kv_sharing == "store":
            shared_kv[attn.kv_key] = stored[0]
        if not reuses:
            cache.write(index, slots, _all_kv_heads(torch.stack(keys))[:, keep],
                        _all_kv_heads(torch.stack(values))[:, keep])
        return out if attn.o_bias is None else out + attn.o_bias

    @torch.no_grad()
    def step(self, cache, tokens):
        """One new token per row (``tokens`` ``(B,)``, the same on every rank) at
        each row's next position, cached on the rank ``cache`` places it on;
        returns its logits ``(B, V)``."""
        positions = cache.next_positions
        target = cache.place_next_token()
        hidden = replicated_embedding(self.embed, tokens.unsqueeze(1), self.embedding_multiplier)  # (B, 1, H)
        layer_inputs = None if self.layer_table is None else \
            replicated_layer_inputs(self.decoder, self.layer_table, tokens.unsqueeze(1), hidden)
        rotated_at = (positions + cache.rope_deltas).unsqueeze(1)  # a VLM's M-RoPE axes, equal for text tokens
        tables = {kind: rotary_at(self.rotary, hidden, rotated_at, kind)
                  for kind in dict.fromkeys(layer.rotary_kind for layer in self.layers)}
        hidden = into_streams(self.model, hidden)
        self.step_choice = {}  # a sparse attention's choice of cached keys, shared across layers (GLM-MoE-DSA's)
        slots = None
        if target == self.tsp_rank:
            slots = cache.reserve(positions.unsqueeze(1), torch.ones_like(positions, dtype=torch.bool)[:, None])
        for index, layer in enumerate(self.layers):
            def recurrent(normed, mixer):
                return RECURRENT[type(mixer)].decode(mixer, normed, *cache.states(index), self._sum_over_group)

            def attention(normed):
                return self._attention(cache, index, layer.token_mixer, normed, tables[layer.rotary_kind], slots,
                                       positions)

            attention = _token_mixing(layer, attention, recurrent)
            hidden = layer.blocks(hidden, attention, lambda normed: self._mlp(layer.mlp, normed),
                                  run_experts=None if layer.moe is None else lambda h: self._mlp(layer.moe, h),
                                  per_layer_input=self._layer_input(layer_inputs, index))
        cache.next_positions = positions + 1
        return self._logits(out_of_streams(self.model, hidden))

    def _attention(self, cache, index, attn, h, tables, slots, positions):
        """Attention of the new token ``h`` ``(B, 1, H)``, see the module docstring."""
        if isinstance(attn, TSPLatentAttention):
            width = attn.shapes.latent_width  # then the index key, where the layer has an indexer of its own

            def write(latent):
                if slots is not None:
                    cache.write(index, slots, latent, latent[..., :0])

            def choose(q, weights):
                keys, _ = cache.layer(index)
                return choose_cached_keys(attn.indexer_plan(h, None, bounds=False), q, weights, keys[:, 0, :, width:],
                                          cache.positions, cache.valid, self.group)

            def attend(q_all, chosen):
                keys = cache.layer(index)[0][..., :width]
                return self._heads_of_this_rank(keys, keys[..., :attn.shapes.kv_lora_rank], q_all, cache,
                                                positions, attn.scale, visible=chosen)

            out, chosen = decode_latent_attention(attn, h, tables, positions.unsqueeze(1), self.group, write, attend,
                                                  self._sum_over_group, choose,
                                                  self.step_choice.get(attn.kv_key) if attn.kv_sharing == "reuse"
                                                  else None)
            if attn.kv_sharing == "store":
                self.step_choice[attn.kv_key] = chosen
            return out
        heads, D = attn.heads, self.tsp_size
        cos, sin = attn.full_tables(tables)
        hq, hkv, d = heads.q_heads, heads.kv_heads, heads.head_dim
        w = attn.spec.unpack(attn.shard_weights().detach())
        # Projected here, normed and rotated once gathered: every rank then holds
        # every head of the new token (a norm over the projection needs them all).
        q, gate = split_gate(project(h, w, "q_proj", hq, heads.q_width), d)  # (B, 1, hq, d); an output gate
        if "g_proj.weight" in w:  # one gate a head (LFM3's)
            gate = project(h, w, "g_proj", hq, 1)
        if attn.kv_sharing == "reuse":  # an earlier layer's keys and values, cached there
            k = v = q[:, :, :0]
        elif heads.holds_kv(self.tsp_rank):
            k = project(h, w, "k_proj", hkv, d)
            v = raw_values(attn, lambda name: project(h, w, name, hkv, d), k)
        else:  # a replica of another rank's key/value heads: it holds no k/v weights, sends zeros
            k = v = q.new_zeros(q.shape[0], 1, hkv, d)
        # (D, B, hq+2hkv, d); (D, B, hq, d) where the layer reuses another's keys and values
        gathered = comm.all_gather_small(torch.cat([q, k, v], dim=2)[:, 0], self.group)
        q_all = gathered[:, :, :hq].transpose(0, 1).flatten(1, 2)  # (B, nq, d)
        q_all = _normed_and_rotated(attn, attn.q_norm, q_all.unsqueeze(1), cos, sin)[:, 0]
        if attn.query_scale is not None:  # (B, 1) factors at the new token's position
            factors = attn.query_scale(query_scale_positions(attn.query_scale, positions,
                                                             positions + cache.left_padding).unsqueeze(1))
            q_all = scale_queries(q_all.unsqueeze(1), factors, attn.query_scale.casts_factors)[:, 0]
        if slots is not None and attn.kv_sharing != "reuse":
            kv = gathered[[j for j in range(D) if heads.holds_kv(j)], :, hq:].transpose(0, 1)  # (B, G, 2hkv, d)
            k_new, v_new = kv[:, :, :hkv].flatten(1, 2), kv[:, :, hkv:].flatten(1, 2)  # (B, nkv, d)
            k_new = _normed_and_rotated(attn, attn.k_norm, k_new.unsqueeze(1), cos, sin)
            cache.write(index, slots, k_new, attended_values(attn, v_new.unsqueeze(1)))
        keys, values = cache.layer(self._kv_layer(index, attn))
        o, lse = self._heads_of_this_rank(keys, values, q_all, cache, positions, attn.scale, attn.sliding_window,
                                          attn.softcap, attn.attention_chunk)  # (B, hq, d)
        if "sinks" in w:  # each head's sink joins its softmax once, over the whole cache (DESIGN.md 6h)
            o = o * torch.sigmoid(lse - w["sinks"].to(lse.dtype)).unsqueeze(-1).to(o.dtype)
        if gate is not None:  # this rank's heads' gates, kept from its own projection
            o = o.to(h.dtype) * torch.sigmoid(gate[:, 0])
        y = self._sum_over_group(F.linear(o.flatten(1).to(h.dtype), w["o_proj.weight"]))  # (B, H)
        if attn.o_bias is not None:
            y = y + attn.o_bias
        return y.unsqueeze(1)

    def _kv_layer(self, index, attn):
        """The layer whose cache layer ``index`` attends to: its own, or, where it reuses an earlier layer's keys
        and values, the layer of its type that stores them."""
        return self.kv_sources.get(attn.kv_key, index) if attn.kv_sharing == "reuse" else index

    def _heads_of_this_rank(self, keys, values, q_all, cache, positions, scale, window=None, softcap=None,
                            chunk=None, visible=None):
        """Every head's partial attention over this rank's cached ``keys`` and
        ``values`` (``visible`` ``(B, T)`` of them, a sparse attention's choice; by default every valid one);
        an all-to-all hands each rank its head group's partials,
        merged: ``(B, hq, dv)`` and the log-sum-exp ``(B, hq)``."""
        out, lse = attend_cache(q_all, keys, values, cache.positions, cache.valid if visible is None else visible,
                                positions, scale, window, softcap, chunk)
        dv = out.shape[-1]
        partial = torch.cat([out, lse.unsqueeze(-1)], dim=-1)  # (B, nq, dv+1)
        partial = partial.view(partial.shape[0], self.tsp_size, -1, dv + 1).transpose(0, 1)  # (D, B, hq, dv+1)
        received = comm.all_to_all_small(partial, self.group)  # every rank's partial for this rank's heads
        return merge_partials(received[..., :dv], received[..., dv])

    def _mlp(self, mlp, h):
        """This rank's share of the MLP (its ``F``-shard; for a mixture of
        experts, its experts) for the new token, summed over the group."""
        return self._sum_over_group(mlp.decode_share(h[:, 0])).unsqueeze(1)  # (B, 1, H)

    def _sum_over_group(self, part):
        """Sum of every rank's ``part``, in rank order, so bit-identical on every rank."""
        gathered = comm.all_gather_small(part, self.group)
        total = gathered[0].to(torch.promote_types(part.dtype, torch.float32))
        for other in gathered[1:]:
            total = total + other
        return total.to(part.dtype)

    def _last_tokens(self, hidden, positions, lengths, padded_len):
        """Hidden state ``(B, 1, H)`` of each row's last real prompt token, from
        the rank that owns it, on every rank."""
        last = lengths - 1
        here = positions.unsqueeze(0) == last.unsqueeze(1)  # (B, S/D): at most one per row
        # A sum of zeros and at most one value (exact), where a nonzero would wait for the device.
        mine = torch.where(here.unsqueeze(-1), hidden, 0).sum(dim=1)
        gathered = comm.all_gather_small(mine, self.group)  # (D, B, H)
        owned = torch.stack([layout.positions(j, self.tsp_size, self.layout, padded_len, device=hidden.device)
                             for j in range(self.tsp_size)])  # (D, S/D)
        owners = (owned.unsqueeze(0) == last[:, None, None]).any(dim=-1).int().argmax(dim=1)  # (B,)
        return gathered[owners, torch.arange(hidden.shape[0], device=hidden.device)].unsqueeze(1)

    def _logits(self, hidden):
        return full_vocab_logits(self.lm_head, self.final_norm(hidden), self.logit_map)[:, 0]


def _cache_shape(attn):
    """``(key heads, key width, value width)`` a layer's cache holds per token."""
    if isinstance(attn, TSPLatentAttention):
        return latent_cache_shape(attn)
    if attn.kv_sharing == "reuse":  # attends to an earlier layer's cache
        return 0, attn.heads.head_dim, None
    return attn.heads.num_kv_heads, attn.heads.head_dim, None


def _normed_and_rotated(attn, norm, t, cos, sin):
    """Queries or keys ``(B, 1, heads, d)`` of every head of the new token as
    attention sees them: normed (per head, or over all heads by Hugging Face's
    own norm) and rotated."""
    if norm is not None and attn.norms_span_projection:
        return attn.rope(norm(t.flatten(-2)).to(t.dtype).view_as(t), cos, sin)
    return rotate(t, norm, cos, sin, attn.rope)


def _all_kv_heads(groups):
    """``(G, B, S/D, hkv, d)`` per key/value head group -> ``(B, S/D, nkv, d)``."""
    return groups.permute(1, 2, 0, 3, 4).flatten(2, 3)
