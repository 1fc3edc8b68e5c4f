"""The forward of a TSP-injected causal LM: HF calling convention, local tokens inside.

Every rank of a TSP group receives the same full micro-batch. The model pads
it to a multiple of ``2*D``, takes its own tokens (zigzag or contiguous),
runs embedding, TSP decoder layers, final norm and LM head on them, and
returns the loss as the mean over ALL real tokens of the full sequence. With
the folded vocabulary (``tsp.vocab_parallel``) the head and the loss are one
ring (``ds_tsp.blocks.vocab``) and, with labels, no logits are returned.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from ds_tsp.blocks.documents import check_cu_seq_lens, document_starts, start_at_position_zero
from ds_tsp.blocks.layer_inputs import local_layer_inputs
from ds_tsp.blocks.linear.streamed import left_padding_refusal
from ds_tsp.blocks.moe.load_balancing import full_sequence_router_logits, load_balancing_loss, recorded_router_logits
from ds_tsp.blocks.moe.module import TSPSparseMoE
from ds_tsp.blocks.rotary import layer_rotary_tables, query_scale_positions
from ds_tsp.blocks.vocab import (IGNORE_INDEX, LogitMap, VocabParallelLMHead, embed_local_tokens, embedding_multiplier,
                                 map_logits, scaled)
from ds_tsp.blocks.streams import into_streams, out_of_streams
from ds_tsp.inference.generate import cached_forward
from ds_tsp.injection.inputs import (check_shapes, check_token_ids, left_padding, rows_left_aligned,
                                     vocabulary_rows)
from ds_tsp.injection.policy import text_config
from ds_tsp.injection.scores import SCORES, fused_head_output, head_token_scores, scores_wanted
from ds_tsp.parallel import layout
from ds_tsp.parallel.eager import untraced
from ds_tsp.parallel.host_reads import host_copy
from ds_tsp.parallel.mappings import gather_sequence, sum_over_group


class TSPDecoderLayer(GradientCheckpointingLayer):
    """A decoder layer of two residual branches, TSP attention then the TSP MLP
    (or one of them: a layer of one block, Nemotron-H's, holds no mixer or no MLP),
    each with the Hugging Face norms the architecture puts around it (kept as
    they are, under their Hugging Face names): ``layout`` maps ``"attention"``
    and ``"mlp"`` to the names of the norms ``(before, after)`` the block, None
    where there is none: Llama's pre-norms, Gemma-2/3's sandwich (both),
    OLMo-2/3's post-norms (after only). ``rotary_kind`` names the rotary
    tables the layer takes (Gemma-3's and OLMo-3's layer types; None: the
    model's one table). The token mixer (``token_mixer``) is the TSP attention,
    or a hybrid's recurrent mixer (Gated DeltaNet, Mamba-2, Mamba-1, a short
    convolution), under its Hugging Face name ``mixer_name`` (``self_attn``,
    ``linear_attn``, ``mamba``, ``conv``, ``mixer``); the MLP is ``mlp`` whatever its Hugging
    Face name, ``mlp_name`` (Granite-MoE's ``block_sparse_moe``), which the
    checkpoint readers and writers use (``DecoderPolicy.mlp``). Subclassing HF's
    checkpointing layer makes ``model.gradient_checkpointing_enable()`` recompute it.
    ``parallel``: the MLP reads the attention's normed input and both add to
    the layer's input (Cohere's layer), ``blocks`` runs them so. ``side``:
    ``(Hugging Face name, TSP block)`` of a recurrent mixer beside the
    attention (Falcon-H1's Mamba-2 mixer), both off the attention's norm, their
    outputs summed: ``side(x) * side_out + attention(x * attention_in) *
    attention_out`` with ``mixer_multipliers = (attention_in, attention_out,
    side_out)``.
    ``streams``: the layer's ``policy.HyperConnections`` where the residual is
    several streams ``(B, S/D, hc_mult, H)`` (HY-V4's), its modules
    (``stream_modules``, by Hugging Face name) mixing them around each block
    (``branch``); None: one stream."""

    def __init__(self, mixer, mlp, norms, layout, recompute_norms=False, rotary_kind=None, mixer_name="self_attn",
                 mlp_name="mlp", parallel=False, residual_multiplier=1.0, layer_scalar=None, experts=None,
                 beside=None, inputs=None, input_modules=None, side=None, mixer_multipliers=(1.0, 1.0, 1.0),
                 streams=None, stream_modules=None):
        super().__init__()
        self.mixer_name, self.mlp_name = mixer_name, mlp_name
        self.side_name = None if side is None else side[0]
        self.mixer_multipliers = tuple(mixer_multipliers)
        # Attention and MLP side by side off the attention's norm, both added to the layer's input (Cohere's).
        self.parallel = parallel
        # Each block's output times this before it joins the residual stream (Granite's residual_multiplier).
        self.residual_multiplier = residual_multiplier
        # Registered in the order they run (experts beside the MLP and per-layer inputs after the rest):
        # DeepSpeed lays parameters out (ZeRO's flat buffers, its checkpoints) in this order.
        # A layer of one block (Nemotron-H's) holds no mixer (``mixer_name`` None) or no MLP (``mlp`` None); a
        # recurrent mixer beside the attention runs first, as Hugging Face's layer runs it.
        beside_attention = [side] if side is not None else []
        for name, block, (before, after), first in ((mixer_name, mixer, layout["attention"], beside_attention),
                                                    ("mlp", mlp, layout["mlp"], [])):
            for module_name, module in ((before, norms.get(before)), *first, (name, block), (after, norms.get(after))):
                if module_name is not None:
                    self.add_module(module_name, module)
        self.layout = layout
        self.recompute_norms = recompute_norms  # tsp.recompute_norms
        self.rotary_kind = rotary_kind
        # The layer's output times this buffer, kept under its Hugging Face name (Gemma 4's layer_scalar), or None.
        self.register_buffer("layer_scalar", layer_scalar)
        # Experts beside the MLP (a TSPSparseMoE: Gemma 4's, whose tensors are the layer's own, so its Hugging
        # Face prefix is the layer's; Granite-4.0-H's block), with the norms of the two outputs where there are
        # any (``beside``, a policy.ExpertsBesideMLP).
        self.beside = beside
        if experts is not None:
            for name in beside.norms():
                self.add_module(name, norms[name])
            self.moe = experts
        else:
            self.moe = None
        # Per-layer inputs (Gemma 4's, a policy.PerLayerInputs): the layer's gate, projection and norm of its
        # input and the gate's activation, under their Hugging Face names, kept whole.
        self.inputs = inputs
        for name, module in (input_modules or {}).items():
            self.add_module(name, module)
        if streams is not None and (parallel or experts is not None or side is not None or residual_multiplier != 1.0):
            raise ValueError("hyper-connected streams (hc_mult) in a layer whose blocks run side by side, hold "
                             "experts beside the MLP or a mixer beside the attention, or scale their outputs "
                             "(residual_multiplier): not built; ds_tsp mixes the streams around one attention and "
                             "one MLP (HY-V4's layer)")
        self.streams = streams
        for name, module in (stream_modules or {}).items():
            self.add_module(name, module)

    def hf_prefixes(self):
        """``{attribute of a TSP block: its Hugging Face prefix under the layer}`` (``block_attribute``)."""
        prefixes = {self.mixer_name: self.mixer_name, "mlp": self.mlp_name, self.side_name: self.side_name}
        prefixes = {attribute: hf for attribute, hf in prefixes.items()
                    if attribute is not None and getattr(self, attribute) is not None}
        return prefixes if self.moe is None else {**prefixes, "moe": self.beside.block}

    def hf_blocks(self):
        """``{Hugging Face prefix under the layer: TSP block}`` (``hf_prefixes``)."""
        return {hf: getattr(self, attribute) for attribute, hf in self.hf_prefixes().items()}

    def own_tensors(self):
        """The tensors the layer holds itself, outside its norms and blocks, by Hugging Face name."""
        return {} if self.layer_scalar is None else {"layer_scalar": self.layer_scalar}

    @property
    def token_mixer(self):
        """The token mixer: the TSP attention, or a hybrid's recurrent mixer, under its Hugging Face name
        ``mixer_name``; None in a layer of an MLP alone."""
        return None if self.mixer_name is None else getattr(self, self.mixer_name)

    def norms(self):
        """The layer's norms by Hugging Face name."""
        names = [name for pair in self.layout.values() for name in pair if name is not None]
        return {name: getattr(self, name) for name in names + list(self.beside.norms() if self.beside else ())}

    def whole_modules(self):
        """The Hugging Face modules the layer keeps whole, by name: its norms and what applies a per-layer input."""
        parts = (*(self.inputs.layer_parts() if self.inputs is not None else ()),
                 *(self.streams.layer_parts() if self.streams is not None else ()))
        return {**self.norms(), **{name: getattr(self, name) for name in parts}}

    def branch(self, block, hidden, run, run_with_norm=None, run_experts=None):
        """``hidden`` plus the ``block`` (``"attention"`` or ``"mlp"``) ``run`` on
        it, normed before and after as the layout says, in HF's order.
        ``run_with_norm(hidden, norm)``: the block given the norm before it to
        run inside, used where ``tsp.recompute_norms`` asks for it and the
        block can (its ``takes_input_norm``) while autograd records.
        ``run_experts(hidden)``: the experts beside the MLP, whose output joins
        the MLP's (each normed, Gemma 4's, or not, Granite-4.0-H's) before the
        norm after; they take the branch's input where they norm it themselves
        (``beside.input_norm``), else the MLP's normed input."""
        before, after = self.layout[block]
        norm = None if before is None else getattr(self, before)
        module = self.token_mixer if block == "attention" else self.mlp
        if self.streams is not None:
            return self.stream_branch(block, hidden, norm, run, after)
        if (run_with_norm is not None and norm is not None and self.recompute_norms and torch.is_grad_enabled()
                and module.takes_input_norm(norm)):
            out = run_with_norm(hidden, norm)
        else:
            normed = hidden if norm is None else normalize(norm, hidden, self.recompute_norms)
            out = run(normed)
        if run_experts is not None:
            experts = run_experts(hidden if self.beside.input_norm else normed)
            if self.beside.norms():
                mlp_norm, experts_norm = (getattr(self, name) for name in self.beside.norms())
                out, experts = (normalize(mlp_norm, out, self.recompute_norms),
                                normalize(experts_norm, experts, self.recompute_norms))
            out = out + experts
        out = out if after is None else normalize(getattr(self, after), out, self.recompute_norms)
        return hidden + scaled(out, self.residual_multiplier)

    def stream_branch(self, block, streams, norm, run, after):
        """``branch`` over hyper-connected ``streams`` ``(B, S/D, hc_mult, H)``, as Hugging Face's layer runs it:
        the block's module mixes them into its input and the weights ``post`` ``(B, S/D, hc_mult)``, and the
        normed block's output joins each stream by its weight, in float32 (or the streams' dtype if wider)."""
        hyper = getattr(self, self.streams.attention if block == "attention" else self.streams.mlp)
        post, hidden = hyper(streams)
        normed = hidden if norm is None else normalize(norm, hidden, self.recompute_norms)
        out = run(normed)
        out = out if after is None else normalize(getattr(self, after), out, self.recompute_norms)
        wide = torch.promote_types(streams.dtype, torch.float32)
        return (post.to(wide).unsqueeze(-1) * out.to(wide).unsqueeze(-2) + streams.to(wide)).to(streams.dtype)

    @property
    def side_mixer(self):
        """The recurrent mixer beside the attention (``side``), or None."""
        return None if self.side_name is None else getattr(self, self.side_name)

    @property
    def kv_sharing(self):
        """How the layer's attention shares keys and values across layers (``TSPAttention.kv_sharing``)."""
        return getattr(self.token_mixer, "kv_sharing", None)

    def forward(self, hidden_states, position_embeddings, documents=None, positions=None, cache_positions=None,
                spans=None, shared=None, per_layer_input=None):
        """``positions``: the local tokens' position ids ``(B, S/D)``, which an attention that scales its
        queries by position reads (Ministral 3's, Mistral 4's); ``cache_positions``: their indices in
        their rows as Hugging Face counts them, which Llama 4's temperature tuning reads; ``spans``: the
        rows' runs of tokens that see each other both ways (a VLM's images, Gemma 3's), for the attention.
        Keys and values shared across layers (``kv_sharing``): a layer that reuses them takes them as
        ``shared``, one that stores them returns ``(hidden, its local keys and values)``, so that an
        activation checkpoint sees them as its input and output. ``per_layer_input``: the layer's input from the
        per-layer embedding ``(B, S/D, P)`` (``inputs``)."""
        scale = getattr(self.token_mixer, "query_scale", None)
        options = {} if scale is None else {
            "positions": query_scale_positions(scale, positions, cache_positions)}
        if spans is not None:
            options["spans"] = spans
        if self.kv_sharing == "reuse":
            options["shared"] = shared
        stored = []

        def attention(normed, **norm):
            out = self.token_mixer(normed, position_embeddings, documents, **norm, **options)
            if self.kv_sharing == "store":
                out, kv = out
                stored.append(kv)
            return out

        def run_with_norm(hidden, norm):
            return attention(hidden, input_norm=norm)

        if self.side_mixer is None:
            hidden = self.blocks(hidden_states, attention, self.mlp, run_with_norm, per_layer_input=per_layer_input)
        else:  # the norm runs outside: it feeds two mixers
            side = self.beside_attention(attention, lambda normed: self.side_mixer(normed, None, documents))
            hidden = self.blocks(hidden_states, side, self.mlp, per_layer_input=per_layer_input)
        return (hidden, stored[0]) if stored else hidden

    def beside_attention(self, run_attention, run_side):
        """The token-mixing branch of a layer with a recurrent mixer beside its attention (``side``), as Hugging
        Face's layer sums them (Falcon-H1's), from ``run_attention(normed)`` and ``run_side(normed)``."""
        attention_in, attention_out, side_out = self.mixer_multipliers

        def run(normed):
            side = scaled(run_side(normed), side_out)
            return side + scaled(run_attention(scaled(normed, attention_in)), attention_out)

        return run

    def blocks(self, hidden, run_attention, run_mlp, run_attention_with_norm=None, run_experts=None,
               per_layer_input=None):
        """The layer's two blocks on ``hidden`` (``branch``'s ``run`` for each):
        one after the other, or side by side (``parallel``) as
        ``hidden + attention(norm(hidden)) + mlp(norm(hidden))``, in Hugging Face's order;
        experts beside the MLP (``moe``) by ``run_experts``, by default the block itself;
        then the layer's ``per_layer_input`` (``add_input``) and its ``layer_scalar``."""
        if self.moe is not None and run_experts is None:
            run_experts = self.moe
        if self.parallel and run_experts is not None:
            raise ValueError("experts beside the MLP in a layer whose blocks run side by side: not built")
        if not self.parallel:
            if self.token_mixer is not None:
                hidden = self.branch("attention", hidden, run_attention, run_attention_with_norm)
            if self.mlp is not None:
                hidden = self.branch("mlp", hidden, run_mlp, run_experts=run_experts)
        else:
            before, _ = self.layout["attention"]
            normed = normalize(getattr(self, before), hidden, self.recompute_norms)
            hidden = hidden + run_attention(normed) + run_mlp(normed)
        if self.inputs is not None:
            hidden = self.add_input(hidden, per_layer_input)
        return hidden if self.layer_scalar is None else hidden * self.layer_scalar

    def add_input(self, hidden, per_layer_input):
        """``hidden`` plus the layer's input ``per_layer_input`` gated by ``hidden``, projected and normed, as
        Hugging Face's layer adds it (per token: no collective)."""
        if per_layer_input is None:
            raise ValueError("this layer takes a per-layer input (hidden_size_per_layer_input): its forward needs it")
        gate, projection, norm = (getattr(self, name) for name in self.inputs.layer_parts())
        gated = self.get_submodule(self.inputs.activation)(gate(hidden)) * per_layer_input
        return hidden + normalize(norm, projection(gated), self.recompute_norms)


def block_attribute(hf_prefix, mlp_name, experts_name=""):
    """The ``TSPDecoderLayer`` attribute holding the TSP block whose Hugging Face prefix under the layer is
    ``hf_prefix``: the token mixer's own name, ``mlp`` for the MLP whatever its Hugging Face name ``mlp_name``
    (Granite-MoE's ``block_sparse_moe``; None in a layer of a mixer alone), ``moe`` for experts beside it under
    ``experts_name`` (Granite-4.0-H's block; "" where their tensors are the layer's own, Gemma 4's)."""
    return {experts_name: "moe", mlp_name: "mlp"}.get(hf_prefix, hf_prefix)


def normalize(norm, hidden, recompute):
    """``norm(hidden)``. With ``recompute`` (``tsp.recompute_norms``) autograd
    keeps only ``hidden`` and backward runs the norm again (torch's
    non-reentrant checkpoint), instead of keeping the norm's float32 copy of
    its input and its normalised values; the numbers are the same."""
    if recompute and torch.is_grad_enabled() and hidden.requires_grad:
        return torch.utils.checkpoint.checkpoint(norm, hidden, use_reentrant=False)
    return norm(hidden)


class TSPBatch:
    """One micro-batch as this rank sees it: padded, shifted, sharded.
    ``documents`` are the rows' packed documents (``ds_tsp.blocks.documents``), None
    when each row is one sequence.

    What the host must know about the batch (whether the mask is right
    padding, where documents start, how many targets there are, and the
    embedding's all-to-all sizes) is read from ONE host copy of the batch
    (``host_copy``), before the step's first kernel, so the layers, the loss
    and backward never wait for the device. ``rank_input_ids`` are that host
    copy's shards; the tensors the layers compute with stay on the device."""

    @untraced
    def __init__(self, input_ids, labels, position_ids, attention_mask, tsp_rank, tsp_size, layout_name,
                 cu_seq_lens=None, vocab_size=None, batch_check=None, rotary_positions=None):
        """``rotary_positions``: ``(P, B, S)`` positions the rotary embedding
        reads in place of ``position_ids`` (a VLM's M-RoPE axes), moved,
        padded and sharded alike (``self.rotary_positions``; by default the
        position ids). ``vocab_size``: ``(embedding rows, head classes)`` to check the ids
        and labels against (``ds_tsp.injection.inputs``); ``batch_check``
        (``tsp.check_batch``): compare the batch across the TSP group (its
        fingerprints travel in the batch's host copy). An
        input is refused before anything else reaches a collective, after the
        batch check, which every rank joins whatever it found: ranks that got
        the same batch reach the same verdict, ranks that did not are all
        refused, and none is left waiting for the others."""
        refusal = _refusal(check_shapes, input_ids, labels, attention_mask, position_ids)
        if refusal is None and position_ids is not None and position_ids.shape == (1, input_ids.shape[1]):
            position_ids = position_ids.expand(input_ids.shape[0], -1)  # HF accepts positions shared by every row
        fingerprints = None if batch_check is None else batch_check.gather(
            input_ids=input_ids, labels=labels, position_ids=position_ids, attention_mask=attention_mask)
        host_ids, host_labels, host_positions, host_mask, fingerprints = host_copy(
            input_ids, labels, position_ids, attention_mask, fingerprints, reason="batch")
        if refusal is None and vocab_size is not None:
            refusal = _refusal(check_token_ids, host_ids, host_labels, *vocab_size)
        self.left_padding = None  # (B,) on the host: how far each row was moved left (``inputs.left_padding``)
        if refusal is None:
            self.left_padding, refusal = _left_padding(host_mask, host_labels)
        if self.left_padding is not None:
            if rotary_positions is not None:
                rotary_positions = torch.stack([rows_left_aligned(self.left_padding, axis, None, None,
                                                                  attention_mask)[0] for axis in rotary_positions])
            input_ids, labels, position_ids, attention_mask = rows_left_aligned(
                self.left_padding, input_ids, labels, position_ids, attention_mask)
            host_ids, host_labels, host_positions, host_mask = rows_left_aligned(
                self.left_padding, host_ids, host_labels, host_positions, host_mask)
        if batch_check is not None:
            batch_check.verify(fingerprints, ("input_ids", "labels", "position_ids", "attention_mask"))
        if refusal is not None:
            raise refusal
        batch, seq_len = input_ids.shape
        host_real = _real_tokens(host_mask, batch, seq_len, host_ids.device)
        self.documents = document_starts(host_positions, host_mask, cu_seq_lens, input_ids.shape)
        self.documents_start_at_zero = start_at_position_zero(self.documents, host_positions)
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=input_ids.device).expand(batch, -1)
        # What rotary types that scale with the sequence read (HF: max(position_ids)).
        self.max_position = (position_ids if rotary_positions is None else rotary_positions).amax().view(1, 1)
        shifted = None
        if labels is not None:
            shifted = shifted_targets(labels, real)
            self.num_real_labels = int((shifted_targets(host_labels, host_real) != IGNORE_INDEX).sum())
        input_ids, self.num_padding = layout.pad_to_multiple(input_ids, tsp_size, value=0)
        host_ids, _ = layout.pad_to_multiple(host_ids, tsp_size, value=0)
        # Padding goes after the last real token, so causal masking keeps every
        # real token from seeing it; its positions just continue the sequence.
        tail = position_ids[:, -1:] + torch.arange(1, self.num_padding + 1, device=input_ids.device)
        position_ids = torch.cat([position_ids, tail], dim=1)
        if rotary_positions is not None:
            rotary_positions = torch.cat([rotary_positions, rotary_positions[..., -1:]
                                          + torch.arange(1, self.num_padding + 1, device=input_ids.device)], dim=-1)

        def own(t):
            return layout.shard(t, tsp_rank, tsp_size, layout_name)

        # Every rank's tokens, on the host: the vocabulary-parallel embedding routes them all.
        self.rank_input_ids = [layout.shard(host_ids, r, tsp_size, layout_name) for r in range(tsp_size)]
        self.host_input_ids = host_ids  # (B, S) padded: where a VLM's visual rows go (ds_tsp.blocks.visual)
        self.input_ids, self.position_ids = own(input_ids), own(position_ids)
        self.rotary_positions = self.position_ids if rotary_positions is None else \
            layout.shard(rotary_positions, tsp_rank, tsp_size, layout_name, dim=2)
        # Each token's index in its row before the rows were left-aligned (Hugging Face's cache position).
        cache_positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(batch, -1)
        if self.left_padding is not None:
            cache_positions = cache_positions + self.left_padding.to(input_ids.device).unsqueeze(1)
        self.cache_positions = own(cache_positions)
        self.real = own(layout.pad_to_multiple(real, tsp_size, value=False)[0])  # (B, S/D): not padding
        self.labels = None if shifted is None else own(layout.pad_to_multiple(shifted, tsp_size, IGNORE_INDEX)[0])


def _left_padding(host_mask, host_labels):
    """``(left padding per row or None, refusal or None)``."""
    try:
        return left_padding(host_mask, host_labels), None
    except ValueError as error:
        return None, error


def _refusal(check, *args):
    """The error ``check(*args)`` raises for a bad input (None when it passes)."""
    try:
        check(*args)
    except (TypeError, ValueError, IndexError) as error:
        return error
    return None


def shifted_targets(labels, real):
    """Token t's target is label t+1 (``IGNORE_INDEX`` for the last token),
    shifted on the full sequence before sharding; padding is never a target."""
    labels = labels.masked_fill(~real, IGNORE_INDEX)
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def num_targets(labels, attention_mask=None):
    """How many tokens of a micro-batch the loss averages over: what the TSP
    forward counts when no ``num_items_in_batch`` is given; a 0-dim int64
    where ``labels`` are, not read on the host."""
    real = _real_tokens(attention_mask, *labels.shape, labels.device)
    return (shifted_targets(labels, real) != IGNORE_INDEX).sum()


def _real_tokens(attention_mask, batch, seq_len, device):
    """``(B, S)`` bool of real tokens; only right padding can be honoured."""
    if attention_mask is None:
        return torch.ones(batch, seq_len, dtype=torch.bool, device=device)
    real = attention_mask.bool()
    if real.shape != (batch, seq_len) or (real[:, 1:] & ~real[:, :-1]).any():
        raise ValueError("attention_mask must be (batch, seq_len) with each row's real tokens in one run (padding "
                         "before and after it only); TSP training cannot take masks inside a sequence")
    return real


@dataclass
class TSPCausalLMOutput(CausalLMOutputWithPast):
    """Hugging Face's output, with the local tokens' per-token scores where asked
    (``return_token_logprobs``, ``return_entropy``: ``(B, S/D)``)."""

    token_logprobs: torch.FloatTensor | None = None
    entropy: torch.FloatTensor | None = None


@dataclass
class TSPMoeCausalLMOutput(MoeCausalLMOutputWithPast):
    """``TSPCausalLMOutput``'s scores on Hugging Face's mixture-of-experts output."""

    token_logprobs: torch.FloatTensor | None = None
    entropy: torch.FloatTensor | None = None


class TSPCausalLMMixin:
    """Put in front of the Hugging Face causal LM class by ``ds_tsp.inject``."""

    def _visual_inputs(self, kwargs):
        """The images and videos among the forward's keyword arguments (a vision-language model's,
        ``ds_tsp.injection.multimodal``); a causal LM takes none."""
        return None

    def _batch(self, input_ids, labels, position_ids, attention_mask, cu_seq_lens, vocab_size, visual):
        """The micro-batch as this rank sees it (``TSPBatch``); a VLM's rotary embedding reads its M-RoPE
        positions (``visual.positions``)."""
        rotary_positions = None
        if visual is not None:
            position_ids, rotary_positions = visual.positions(input_ids, attention_mask, position_ids)
        topo = self.tsp_topology
        return TSPBatch(input_ids, labels, position_ids, attention_mask, topo.tsp_rank, topo.tsp_size,
                        self.tsp_config.layout, cu_seq_lens, vocab_size, self.tsp_batch_check, rotary_positions)

    def _layer_inputs(self, batch, hidden):
        """Every layer's input from the per-layer embedding for this rank's tokens ``(B, S/D, L, P)``
        (``ds_tsp.blocks.layer_inputs``), or None for a model without."""
        inputs = self.tsp_policy.model_inputs(self)
        if inputs is None:
            return None
        decoder = self.get_submodule(self.tsp_policy.layers.rpartition(".")[0])
        return local_layer_inputs(decoder, self.get_submodule(inputs.embed), batch.rank_input_ids,
                                  self.tsp_topology.tsp_rank, batch.input_ids, hidden)

    def _decoder_layers(self, layers, hidden, batch, visual, layer_inputs=None):
        """The TSP decoder ``layers`` on this rank's ``hidden``, each given its rotary tables (computed once per
        kind) and its part of ``layer_inputs`` (``_layer_inputs``); a VLM's tower adds its features to the first
        layers' outputs (``visual.after_layer``), and its images may see themselves both ways (``visual.spans``)."""
        tables = layer_rotary_tables(self.tsp_policy.rotary_module(self), layers, hidden,
                                     batch.rotary_positions, batch.max_position)
        spans = None if visual is None else visual.spans(batch.left_padding)
        shared_kv = {}  # keys and values shared across layers (Gemma 4's), by layer type
        for index, decoder_layer in enumerate(layers):
            sharing, key = decoder_layer.kv_sharing, getattr(decoder_layer.token_mixer, "kv_key", None)
            hidden = decoder_layer(hidden, tables[decoder_layer.rotary_kind], batch.documents, batch.position_ids,
                                   batch.cache_positions, spans, shared_kv[key] if sharing == "reuse" else None,
                                   None if layer_inputs is None else layer_inputs[:, :, index])
            if sharing == "store":
                hidden, shared_kv[key] = hidden
            if visual is not None:
                hidden = visual.after_layer(index, hidden)
        return hidden

    def _forward_options(self, kwargs):
        """``(moe_blocks, output_router_logits, asked, cu_seq_lens)`` from the
        forward's other keyword arguments, refusing those it does not take;
        ``asked``: ``output_router_logits`` passed to the forward (the whole
        sequence's router logits, as Hugging Face's), not just the config's."""
        moe_blocks = [block for layer in self.get_submodule(self.tsp_policy.layers)
                      for block in (layer.mlp, layer.moe) if isinstance(block, TSPSparseMoE)]
        output_router_logits = None
        asked = bool(kwargs.get("output_router_logits"))
        if moe_blocks:
            output_router_logits = kwargs.pop("output_router_logits", None)
            if output_router_logits is None:
                output_router_logits = getattr(text_config(self), "output_router_logits", False)
        cu_seq_lens = check_cu_seq_lens(kwargs)
        unsupported = {key: value for key, value in kwargs.items()
                       if value not in (None, False) and not (key == "return_dict" and value is True)}
        if unsupported:
            raise ValueError(f"the TSP forward does not support {sorted(unsupported)}: it returns the loss and the "
                             "local tokens' logits only")
        return moe_blocks, output_router_logits, asked, cu_seq_lens

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, inputs_embeds=None,
                use_cache=None, num_items_in_batch=None, cache=None, logits_to_keep=0, tsp_predictions=None,
                return_token_logprobs=False, return_entropy=False, temperature=1.0, fused_lm_head=False,
                shift_labels=None, **kwargs):
        """With ``use_cache`` or a ``cache`` this is the inference forward that
        Hugging Face's ``model.generate`` calls (``ds_tsp.inference.generate.cached_forward``):
        prefill or decode steps, the last token's logits and the ``TSPCache``.

        ``num_items_in_batch`` (as the HF Trainer passes it under gradient
        accumulation, or ``ds_tsp.num_items_in_batch`` gives it) replaces the
        micro-batch's count of target tokens as the loss divisor.

        Returns ``.loss`` and ``.logits``: the local tokens' full-vocabulary
        logits, or None when the loss is fused with a folded LM head (labels
        given and ``tsp.vocab_parallel``), as with fused-loss kernels.
        ``tsp_predictions`` (evaluation, ``TSPTrainer.prediction_step``) makes
        ``.logits`` the whole sequence's, on every rank: ``"argmax"`` the
        predicted ids ``(B, S)`` (a folded head finds them on its ring, with
        no full logits), ``"logits"`` the full logits ``(B, S, V)``.

        ``return_token_logprobs`` / ``return_entropy`` (with labels, and a
        ``temperature``): ``.token_logprobs`` / ``.entropy`` of the local
        tokens ``(B, S/D)``, ``.loss`` the mean of ``-logp``, no ``.logits``
        (``ds_tsp.injection.scores``); ``fused_lm_head`` TRL's fused-head output.

        Mixture-of-experts models take ``output_router_logits`` (default: the
        config's) as Hugging Face's do: ``.aux_loss`` is the load-balancing
        loss over the whole sequence, where Hugging Face's forward computes one
        (``policy.load_balancing_loss``; None for GLM-4.5), added to ``.loss`` times
        ``config.router_aux_loss_coef`` when labels are given. ``.router_logits``
        holds per MoE layer the whole sequence's ``(B*S, E)`` as Hugging Face's
        (differentiable) when ``output_router_logits`` is passed here, else
        (turned on by the config alone, as for the load-balancing loss in
        training) the LOCAL tokens' ``(B*S/D, E)`` (this rank's shard, in its
        layout's order)."""
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("a TSP model takes input_ids (the full sequence on every TSP rank), not inputs_embeds")
        visual = self._visual_inputs(kwargs)
        moe_blocks, output_router_logits, asked, cu_seq_lens = self._forward_options(kwargs)
        if use_cache or cache is not None:
            if labels is not None or asked or cu_seq_lens is not None or tsp_predictions is not None:
                raise ValueError("a TSP forward with use_cache or a cache (generation) takes no labels, "
                                 "output_router_logits, tsp_predictions or packed documents: train without use_cache")
            logits, cache = cached_forward(self, input_ids, attention_mask, position_ids, cache, logits_to_keep,
                                           visual)
            output = MoeCausalLMOutputWithPast if moe_blocks else CausalLMOutputWithPast
            return output(logits=logits, cache=cache)
        if tsp_predictions not in (None, "argmax", "logits"):
            raise ValueError(f"tsp_predictions = {tsp_predictions!r}: use \"argmax\" (predicted ids) or \"logits\"")
        request = scores_wanted(self, labels, tsp_predictions, temperature, return_token_logprobs, return_entropy,
                                fused_lm_head, shift_labels)
        if torch.is_tensor(logits_to_keep) or logits_to_keep != 0:
            raise ValueError(f"the TSP training forward returns the local tokens' logits, so it takes no "
                             f"logits_to_keep (got {logits_to_keep!r}); model.generate's forward (use_cache=True) "
                             "keeps the last token's")
        policy, topo = self.tsp_policy, self.tsp_topology
        vocab_size = tuple(vocabulary_rows(self.get_submodule(name)) for name in (policy.embed_tokens, policy.lm_head))
        batch = self._batch(input_ids, labels, position_ids, attention_mask, cu_seq_lens, vocab_size, visual)
        _check_left_padding_use(batch, request, self.get_submodule(policy.lm_head), tsp_predictions)
        if batch.left_padding is not None and left_padding_refusal(self) is not None:
            raise ValueError(left_padding_refusal(self))
        config, layers = text_config(self), self.get_submodule(policy.layers)
        _check_chunked_documents(batch, layers)
        hidden = embed_local_tokens(self.get_submodule(policy.embed_tokens), batch.rank_input_ids, topo.tsp_rank,
                                    batch.input_ids, embedding_multiplier(config))
        if visual is not None:
            hidden = visual.embed(hidden, batch.host_input_ids, topo, self.tsp_config.layout)
        layer_inputs = self._layer_inputs(batch, hidden)
        with recorded_router_logits(moe_blocks if output_router_logits else []) as router_logits:
            hidden = out_of_streams(self, self._decoder_layers(layers, into_streams(self, hidden), batch, visual,
                                                               layer_inputs))
        hidden = normalize(self.get_submodule(policy.final_norm), hidden, self.tsp_config.recompute_norms)
        head, logit_map = self.get_submodule(policy.lm_head), LogitMap.of(config)
        if request.wanted:
            (loss, scores), logits = head_token_scores(head, hidden, batch, topo.tsp_group, num_items_in_batch,
                                                       logit_map, request.temperature, request.wanted,
                                                       request.statistics), None
        else:
            (loss, logits), scores = lm_head_and_loss(head, hidden, batch, topo.tsp_group, num_items_in_batch,
                                                      logit_map, tsp_predictions), {}
        if tsp_predictions is not None:
            logits = gather_sequence(logits, batch.num_padding, topo.tsp_group, self.tsp_config.layout)
        aux_loss = None
        if output_router_logits and self.tsp_load_balancing == "switch":  # as Hugging Face's forward adds it
            aux_loss = router_aux_loss(self, moe_blocks, router_logits, batch)
            if loss is not None:
                loss = loss + config.router_aux_loss_coef * aux_loss
        if request.fused:
            return fused_head_output(self, batch, loss, scores, input_ids.shape[1], vocab_size[1], aux_loss)
        if not moe_blocks:
            return TSPCausalLMOutput(loss=loss, logits=logits, **{name: scores.get(name) for name in SCORES})
        if output_router_logits:
            router_logits = full_sequence_router_logits(router_logits, input_ids.shape[0], batch.num_padding,
                                                        topo.tsp_group, self.tsp_config.layout) if asked else \
                tuple(router_logits)
        return TSPMoeCausalLMOutput(loss=loss, aux_loss=aux_loss, logits=logits,
                                    router_logits=router_logits if output_router_logits else None,
                                    **{name: scores.get(name) for name in SCORES})


def _check_chunked_documents(batch, layers):
    """Refuse packed documents that chunked attention layers (Llama 4's) would cut elsewhere than Hugging Face."""
    if not batch.documents_start_at_zero and any(getattr(layer.token_mixer, "attention_chunk", None)
                                                 for layer in layers):
        raise ValueError("packed documents whose position_ids do not restart at 0 with chunked attention "
                         "layers (attention_chunk_size): Hugging Face cuts chunks off the position ids, ds_tsp "
                         "from each document's start; give every document position ids from 0 "
                         "(DataCollatorWithFlattening's)")


def _check_left_padding_use(batch, request, head, tsp_predictions):
    """Left-padded rows (``TSPBatch.left_padding``) run moved to the right: the
    loss of a folded head and TRL's fused-head fields (moved back) do not show
    it; every per-token output in the local layout would, so those are refused."""
    if batch.left_padding is None or request.fused:
        return
    if batch.labels is not None and not request.wanted and tsp_predictions is None \
            and isinstance(head, VocabParallelLMHead):
        return
    raise ValueError("attention_mask pads rows on the left, which a TSP forward moves to the right before the "
                     "layers: it takes them for the loss with the folded vocabulary (tsp.vocab_parallel) and for "
                     "TRL's fused LM head (fused_lm_head=True, the fields in the rows' own order); pad on the right "
                     "for the local tokens' logits, token scores or predictions")


def router_aux_loss(model, moe_blocks, router_logits, batch):
    """The load-balancing loss of Hugging Face's MoE causal LMs over the whole
    sequence (``ds_tsp.blocks.moe.load_balancing.load_balancing_loss``)."""
    if len(router_logits) != len(moe_blocks):
        raise RuntimeError(f"{len(moe_blocks)} MoE layers ran but {len(router_logits)} router outputs were recorded")
    routers = [p for block in moe_blocks for p in block.router_module().parameters()]
    if torch.is_grad_enabled() and any(p.requires_grad for p in routers) and not all(
            logits.requires_grad for logits in router_logits):
        raise RuntimeError("the router logits carry no gradient (a reentrant activation checkpoint ran the layers "
                           "without autograd), so the auxiliary loss would not train the routers: use HF's "
                           "gradient_checkpointing_enable (non-reentrant) or set output_router_logits False")
    top_k = moe_blocks[0].top_k
    return load_balancing_loss(router_logits, top_k, batch.real, model.tsp_topology.tsp_group)


def lm_head_and_loss(lm_head, hidden, batch, tsp_group, num_items_in_batch=None, logit_map=None,
                     predictions=None):
    """``(loss, logits)`` of the normed local hidden states ``(B, S/D, H)``,
    the logits mapped by ``logit_map`` (``LogitMap``: the config's logit scale and final soft-cap).

    The loss (None without labels) is the mean cross-entropy over all real
    tokens of the full sequence: each rank sums its own tokens' losses and the
    sums add up over the TSP group. A folded head computes it on its ring and
    returns no logits; a replicated head returns the local tokens' logits.
    ``predictions`` (evaluation): ``"argmax"`` returns in place of the logits
    the local tokens' predicted ids ``(B, S/D)`` (a folded head finds them on
    its ring, with no full logits); ``"logits"`` the local tokens' full
    logits, from which the loss is then taken."""
    folded = isinstance(lm_head, VocabParallelLMHead)
    if predictions == "argmax" and folded:
        local_sum, logits = lm_head.loss_sum_and_argmax(hidden, batch.labels, logit_map)
    elif folded and predictions is None and batch.labels is not None:
        logits, local_sum = None, lm_head.loss_sum(hidden, batch.labels, logit_map)
    else:
        logits = map_logits(lm_head(hidden), logit_map)
        local_sum = None if batch.labels is None else F.cross_entropy(
            logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)), batch.labels.flatten(),
            ignore_index=IGNORE_INDEX, reduction="sum")
        if predictions == "argmax":
            logits = logits.argmax(dim=-1)
    if local_sum is None:
        return None, logits
    count = batch.num_real_labels if num_items_in_batch is None else num_items_in_batch
    # A tensor count (the HF Trainer passes one, maybe on the device) is not read on the host.
    divisor = count.clamp(min=1) if torch.is_tensor(count) else max(count, 1)
    return sum_over_group(local_sum, tsp_group) / divisor, logits
