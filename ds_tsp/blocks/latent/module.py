"""The TSP multi-head latent attention block (DeepSeek-V2/V3, Kimi-K2, Mistral 4
and every Hugging Face class of their shape): this rank's down-projection rows
and head group of one layer's MLA, built from a Hugging Face module or a
checkpoint (``from_hf``, ``load_shard``), run by ``ds_tsp.blocks.latent.schedule``.
"""

import copy
import inspect
import sys

import torch
import torch.nn as nn

from ds_tsp.blocks.attention.selection import select_kernel
from ds_tsp.blocks.documents import query_blocks
from ds_tsp.blocks.latent.indexer import IndexerParts, IndexerPlan, indexer_form, key_bounds
from ds_tsp.blocks.latent.schedule import FORMS, LatentPlan, TSPLatentAttentionFunction
from ds_tsp.blocks.latent.shards import LatentShapes, REPLICATED, shard_piece, shard_spec
from ds_tsp.blocks.packing import PackedShardMixin, module_reader
from ds_tsp.blocks.rotary import query_scale_of
from ds_tsp.parallel import comm
from ds_tsp.parallel.amp import compute_dtype


class ModelRope:
    """The model's own rotary function on ``(B, L, h, d_rope)`` tensors: Hugging
    Face's ``apply_rotary_pos_emb`` (or its interleaved variant) over ``(cos,
    sin)`` tables, or DeepSeek-V2's ``apply_rotary_emb`` over complex ones,
    each called as the Hugging Face attention calls it, so the rotated values
    are the unsharded model's to the bit."""

    def __init__(self, apply):
        self.apply = apply

    def __call__(self, t, tables):
        heads_first = t.transpose(1, 2)
        tables = tables if isinstance(tables, tuple) else (tables,)
        return self.apply(heads_first, heads_first, *tables)[0].transpose(1, 2)


class NoRope:
    """A latent attention whose forward rotates nothing (Kimi Linear's MLA, NoPE): the rotary key passes as is."""

    def __call__(self, t, tables):
        return t


def model_rope(attn, config):
    """The rotary function ``attn``'s forward applies, read from its modeling
    module: the interleaved one where the forward calls it for
    ``config.rope_interleave`` and the config asks for it; DeepSeek-V2's
    complex one where the forward calls that; none where it calls none."""
    modeling = sys.modules[type(attn).__module__]
    source = inspect.getsource(type(attn).forward)
    if "apply_rotary" not in source:
        return NoRope()
    if "apply_rotary_emb(" in source:
        return ModelRope(modeling.apply_rotary_emb)
    # Interleaved where the config asks for it, or always where the forward reads no config for it (DeepSeek-V3.2's).
    if "apply_rotary_pos_emb_interleave" in source and ("rope_interleave" not in source
                                                         or getattr(config, "rope_interleave", False)):
        return ModelRope(modeling.apply_rotary_pos_emb_interleave)
    return ModelRope(modeling.apply_rotary_pos_emb)


class TSPLatentAttention(PackedShardMixin, nn.Module):
    """Multi-head latent attention of one decoder layer over a TSP group.

    ``forward(x, position_embeddings)`` takes the local tokens ``(B, S/D, H)``
    and the model's rotary tables of their GLOBAL positions. ``form``:
    ``"expanded"``, ``"absorbed"`` or a callable ``form(shapes, rows, queries,
    keys, pairs)`` choosing one per input shape (ds_tsp's planner hands its cost
    model in at injection). The constructor allocates the shard without
    initialising it: ``from_hf`` or ``load_shard`` fills it.

    DeepSeek's sparse attention (``indexer.py``): ``indexer`` is the lightning
    indexer's ``(IndexerParts, rotary function, rope_first, scale_on_scores)``
    where the layer has one of its own (``shapes.index_heads``), ``index_topk``
    how many keys it chooses a query; ``selection``: ``"store"`` where a later
    layer reuses this layer's choice (the forward then returns ``(out,
    choice)``), ``"reuse"`` where this layer attends to an earlier layer's
    (given as ``shared``), or None.
    """

    # What TSPDecoderLayer hands on between layers that share one indexer's choice (its ``kv_sharing`` protocol).
    kv_key = "index_choice"

    def __init__(self, shapes, tsp_group, q_norm, kv_norm, rope, *, o_bias=False, scale=None, form="expanded",
                 query_scale=None, layout_name="zigzag", backend="auto", overlap=True, token_tile=0,
                 fp32_accumulators=True, indexer=None, index_topk=0, selection=None, dtype=None, device=None):
        super().__init__()
        if backend not in ("auto", "sdpa"):
            raise ValueError(f"tsp.attention_backend = {backend!r}: multi-head latent attention runs on torch "
                             "SDPA, whose kernels take its different query/key and value head sizes; set "
                             "tsp.attention_backend to \"auto\" or \"sdpa\"")
        if not callable(form) and form not in FORMS:
            raise ValueError(f"tsp.latent_attention = {form!r}: choose one of {('auto', *FORMS)}")
        self.tsp_group = tsp_group
        self.tsp_rank = comm.group_rank(tsp_group)
        self.shapes = shapes
        self.specs = tuple(shapes.specs(j) for j in range(shapes.tsp_size))
        self.spec = shard_spec(shapes, self.tsp_rank)
        self.packed = nn.Parameter(torch.empty(self.spec.numel, dtype=dtype, device=device))
        self.packed.tensor_model_parallel = True  # counted on every TSP rank in gradient norms
        self.lora = None
        self.o_bias = nn.Parameter(torch.zeros(shapes.hidden_size, dtype=dtype, device=device)) if o_bias else None
        # Hugging Face's names: the latents' norms, kept whole on every rank.
        self.q_a_layernorm, self.kv_a_layernorm = q_norm, kv_norm
        self.rope = rope
        self.query_scale = query_scale  # positions -> (B, L) factors of the queries, or None (Llama4QueryScale)
        self.scale = shapes.qk_head_dim ** -0.5 if scale is None else scale
        self.form = form
        self.layout_name, self.backend, self.overlap = layout_name, backend, overlap
        self.token_tile, self.fp32_accumulators = token_tile, fp32_accumulators
        self.grad_wire_dtype = None  # set by ds_tsp.initialize from DeepSpeed's communication_data_type
        if (indexer is not None) != shapes.indexed:
            raise ValueError("a latent attention with index heads (shapes.index_heads) takes its indexer's parts")
        if shapes.sinks and indexer is None and selection != "reuse":
            raise ValueError("sink logits on a latent attention that attends to every earlier key are not built: "
                             "ds_tsp's latent attention takes sinks with DeepSeek's sparse attention (HY-V4's)")
        self.indexer, self.index_form = (None, None) if indexer is None else (indexer[0], indexer[1:])
        self.index_topk, self.selection = index_topk, selection

    @classmethod
    def from_hf(cls, attn, config, tsp_group, form="expanded", layout_name="zigzag", backend="auto", overlap=True,
                token_tile=0, fp32_accumulators=True, read=None, device=None):
        """Build from a Hugging Face MLA module, keeping this rank's shard;
        ``read(name, piece)`` as ``TSPAttention.from_hf``'s."""
        weight = attn.kv_a_proj_with_mqa.weight
        device = device or weight.device
        shapes = latent_shapes(attn, config, comm.group_size(tsp_group))
        norms = [None if norm is None else copy.deepcopy(norm).to_empty(device=device)
                 for norm in (getattr(attn, "q_a_layernorm", None), attn.kv_a_layernorm)]
        indexer = getattr(attn, "indexer", None)
        if indexer is not None:
            rotate, rope_first, scale_on_scores = indexer_form(indexer)
            parts = IndexerParts(*(copy.deepcopy(getattr(indexer, name)).to_empty(device=device)
                                   for name in ("k_norm", "weights_proj")))
            indexer = (parts, ModelRope(rotate), rope_first, scale_on_scores)
        module = cls(shapes, tsp_group, *norms, model_rope(attn, config), o_bias=attn.o_proj.bias is not None,
                     scale=attn.scaling, form=form, query_scale=query_scale_of(attn, config), layout_name=layout_name,
                     backend=backend, overlap=overlap, token_tile=token_tile, fp32_accumulators=fp32_accumulators,
                     indexer=indexer, index_topk=getattr(config, "index_topk", 0), selection=selection_of(attn, config),
                     dtype=weight.dtype, device=device)
        read = read or module_reader(attn)
        module.load_shard({name: read(name, module.shard_piece(name)) for name in module.shard_names()})
        return module

    def replicated_params(self):
        """The parameters every rank holds whole, under Hugging Face names."""
        params = {"q_a_layernorm.weight": None if self.q_a_layernorm is None else self.q_a_layernorm.weight,
                  "kv_a_layernorm.weight": self.kv_a_layernorm.weight, "o_proj.bias": self.o_bias}
        if self.indexer is not None:
            params.update({f"indexer.{name}": param for name, param in self.indexer.named_parameters()})
        return {name: param for name, param in params.items() if param is not None}

    @property
    def kv_sharing(self):
        """``"store"``, ``"reuse"`` or None: how the layer shares its indexer's choice (``selection``)."""
        return self.selection

    def shard_piece(self, name):
        return shard_piece(self.shapes, name, self.tsp_rank)

    def takes_input_norm(self, norm):
        return False

    def form_for(self, rows, queries, keys, pairs):
        """The form for ``rows`` of ``queries`` tokens over ``keys``, scoring ``pairs`` (query, key) pairs a row."""
        return self.form(self.shapes, rows, queries, keys, pairs) if callable(self.form) else self.form

    def plan(self, x, documents=None, positions=None, form=None, decode=False):
        """How to run this layer on the local tokens ``x``; ``positions``: their
        position ids ``(B, S/D)``, which a query scale reads; ``form``: the form
        to run, or None for this module's choice (``form_for``); ``decode``: ``x``
        is a decode step's new token (``indexer_plan``)."""
        D = self.shapes.tsp_size
        if self.query_scale is not None and positions is None:
            raise ValueError("this latent attention scales its queries by position (Mistral 4's "
                             "llama_4_scaling_beta): its forward needs the tokens' positions")
        query_scale = None if self.query_scale is None else self.query_scale(positions).to(x.dtype)
        kernel = select_kernel("sdpa", x.device, compute_dtype(self.packed))
        form = form or self.form_for(*zigzag_work(x.shape[0], x.shape[1], D))
        # Dense attention over the whole latent takes the fused kernels at the width of its queries and keys.
        width = self.shapes.latent_width if form == "absorbed" else self.shapes.qk_head_dim
        explicit = self.indexer is None and self.selection is None and hasattr(kernel, "explicit_backward") and \
            kernel.explicit_backward(width, None)
        return LatentPlan(group=self.tsp_group, shapes=self.shapes, specs=self.specs, layout=self.layout_name,
                          kernel=kernel, scale=self.scale, form=form, rope=self.rope, explicit_backward=explicit,
                          q_norm=self.q_a_layernorm, kv_norm=self.kv_a_layernorm, overlap=self.overlap,
                          query_blocks=query_blocks(documents, x.shape[1], self.tsp_rank, D, self.layout_name,
                                                    x.shape[0], self.token_tile),
                          fp32_accumulators=self.fp32_accumulators, grad_wire_dtype=self.grad_wire_dtype,
                          query_scale=query_scale, indexer=self.indexer_plan(x, documents, bounds=not decode))

    def indexer_plan(self, x, documents, bounds=True):
        """The ``IndexerPlan`` of this layer's own indexer on the local tokens ``x``, or None; without
        ``bounds``, one that scores a decode step's new token (no key limits: every cached key is earlier)."""
        if self.indexer is None:
            return None
        D = self.shapes.tsp_size
        first = last = None
        ends = ()
        if bounds:
            first, last, ends = key_bounds(documents, x.shape[0], x.shape[1], self.tsp_rank, D, self.layout_name,
                                           x.device)
        rope, rope_first, scale_on_scores = self.index_form
        return IndexerPlan(topk=self.index_topk, heads=self.shapes.index_heads, head_dim=self.shapes.index_head_dim,
                           rope_dim=self.shapes.qk_rope_head_dim, rope_first=rope_first, rope=rope, parts=self.indexer,
                           scale_on_scores=scale_on_scores, first_key=first, last_key=last, tile_ends=ends)

    def forward(self, x, position_embeddings, documents=None, input_norm=None, positions=None, shared=None):
        """``positions``: the local tokens' position ids ``(B, S/D)``, read by a query scale (``query_scale``);
        ``shared``: the keys an earlier layer's indexer chose for each local query, where this layer reuses
        them (``selection`` "reuse"); with ``selection`` "store" returns ``(out, this layer's choice)``."""
        if input_norm is not None:
            raise ValueError("the latent attention does not run its input norm inside (takes_input_norm)")
        if (shared is not None) != (self.selection == "reuse"):
            raise ValueError("a latent attention that reuses an earlier layer's chosen keys (indexer_types "
                             "\"shared\") takes them as shared, and only it does")
        q_norm_weight = None if self.q_a_layernorm is None else self.q_a_layernorm.weight
        out, chosen = TSPLatentAttentionFunction.apply(x, self.shard_weights(), self.plan(x, documents, positions),
                                                       position_embeddings, q_norm_weight,
                                                       self.kv_a_layernorm.weight, shared)
        out = out if self.o_bias is None else out + self.o_bias
        return (out, chosen) if self.selection == "store" else out


def zigzag_work(rows, local_tokens, tsp_size):
    """``(rows, queries, keys, pairs)`` of a rank's causal attention on the zigzag
    layout: its two chunks of ``c = S/2D`` tokens attend to ``r + 1`` and
    ``2D - r`` chunks of keys, causally within their own: ``2D c^2 + c`` pairs
    a row on every rank, about ``S/D * S/2`` (the contiguous layout's mean
    rank, whose form the others take too)."""
    seq_len = local_tokens * tsp_size
    chunk = local_tokens // 2
    pairs = (2 * tsp_size + 1) * chunk * chunk - chunk * (chunk - 1)
    return rows, local_tokens, seq_len, pairs


def selection_of(attn, config):
    """How a Hugging Face MLA module shares its indexer's choice across layers
    (GLM-MoE-DSA's ``indexer_types``): ``"reuse"`` where it has no indexer
    of its own but attends to chosen keys, ``"store"`` where it has one and
    a later layer reuses its choice, else None."""
    kinds = getattr(config, "indexer_types", None) or ()
    if getattr(attn, "skip_topk", False):
        return "reuse"
    if getattr(attn, "indexer", None) is not None and "shared" in kinds:
        return "store"
    return None


def latent_shapes(attn, config, tsp_size):
    """The ``LatentShapes`` of a Hugging Face MLA module."""
    indexed = getattr(attn, "indexer", None) is not None
    return LatentShapes(hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                        q_lora_rank=config.q_lora_rank if getattr(attn, "q_a_proj", None) is not None else None,
                        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
                        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, tsp_size=tsp_size,
                        down_bias=attn.kv_a_proj_with_mqa.bias is not None,
                        index_heads=config.index_n_heads if indexed else 0,
                        index_head_dim=config.index_head_dim if indexed else 0,
                        head_gate=isinstance(getattr(attn, "gate_proj", None), nn.Linear),
                        sinks=getattr(attn, "sinks", None) is not None)


def is_latent_attention(attn):
    """Whether ``attn`` is a multi-head latent attention (its keys and values from a latent)."""
    return isinstance(getattr(attn, "kv_a_proj_with_mqa", None), nn.Linear)


def replicated_names(attn):
    """Hugging Face names of the MLA tensors TSP keeps whole on every rank."""
    return [name for name in REPLICATED if _has(attn, name)]


def _has(module, name):
    owner, _, attr = name.rpartition(".")
    try:
        sub = module.get_submodule(owner)
    except AttributeError:
        return False
    return sub is not None and getattr(sub, attr, None) is not None
