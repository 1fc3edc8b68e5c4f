"""The TSP attention block: this rank's head-group shard of one decoder
layer's self-attention, built from a Hugging Face module or a checkpoint
(``from_hf``, ``load_shard``), run by the broadcast schedule of
``ds_tsp.blocks.attention.schedule``.
"""

import copy
import sys

import torch
import torch.nn as nn

from ds_tsp.blocks.attention.head_groups import HeadGroups, shard_piece, shard_spec
from ds_tsp.blocks.attention.kernels import SinkKernel, SoftCappedKernel
from ds_tsp.blocks.attention.norms import projection_inv_rms
from ds_tsp.blocks.attention.schedule import AttentionPlan, TSPAttentionFunction
from ds_tsp.blocks.attention.selection import select_kernel
from ds_tsp.blocks.documents import chunked_documents, query_blocks
from ds_tsp.blocks.fused import FusedRows
from ds_tsp.blocks.input_norm import recomputable
from ds_tsp.blocks.packing import PackedShardMixin, module_reader
from ds_tsp.blocks.rotary import ROTATE_HALF, complex_tables, model_rotary, norm_weight, query_scale_of
from ds_tsp.parallel import comm
from ds_tsp.parallel.amp import compute_dtype


class TSPAttention(PackedShardMixin, nn.Module):
    """Self-attention of one decoder layer, sharded by head group over a TSP group.

    ``forward(x, position_embeddings)`` takes the local tokens ``(B, S/D, H)``
    and the rotary ``(cos, sin)`` of their GLOBAL positions, each ``(B, S/D, d)``
    as the model's Hugging Face rotary embedding computes them. The constructor
    allocates the shard without initialising it: ``from_hf`` or ``load_shard``
    fills it (TSP converts trained models; it does not initialise new ones).
    """

    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, tsp_group, *, qkv_bias=False,
                 o_bias=False, scale=None, sliding_window=None, layout_name="zigzag", backend="auto",
                 overlap=True, token_tile=0, fp32_accumulators=True, dtype=None, device=None, q_norm=None,
                 k_norm=None, softcap=None, sinks=False, rotary_halves=False, output_gate=False, rope=ROTATE_HALF,
                 query_scale=None, attention_chunk=None, v_norm=None, values_from_keys=False, kv_sharing=None,
                 kv_key=None, head_gate=False):
        super().__init__()
        self.tsp_group = tsp_group
        self.tsp_rank = comm.group_rank(tsp_group)
        self.heads = HeadGroups(num_heads, num_kv_heads, head_dim, comm.group_size(tsp_group), output_gate)
        # Keys used as values (Gemma 4's full layers): no v_proj in any shard.
        self.values_from_keys = values_from_keys
        # Keys and values shared across layers (Gemma 4's): "store" hands this layer's to the later layers of its
        # kind (``kv_key``, its layer type), which "reuse" them and hold no key/value projections.
        self.kv_sharing, self.kv_key = kv_sharing, kv_key
        self.specs = tuple(shard_spec(self.heads, hidden_size, qkv_bias, j, sinks, values=not values_from_keys,
                                      keys=kv_sharing != "reuse", head_gate=head_gate)
                           for j in range(self.heads.tsp_size))
        self.spec = self.specs[self.tsp_rank]
        self.packed = nn.Parameter(torch.empty(self.spec.numel, dtype=dtype, device=device))
        # DeepSpeed counts parameters tagged model-parallel on every TSP rank in
        # gradient norms (each rank holds a different shard).
        self.packed.tensor_model_parallel = True
        self.lora = None  # LoRA adapters of this rank's shard (ds_tsp.injection.lora)
        self.o_bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)) if o_bias else None
        # Norms of queries and keys, small, kept whole on every rank: per head (Qwen3, Gemma-3; Hunyuan's after
        # the rotary embedding) or over the whole projection (OLMo-2), whose RMS spans every rank's head groups
        # (ds_tsp.blocks.attention.norms). Their Hugging Face names: from_hf reads them off the module.
        self.q_norm, self.k_norm = q_norm, k_norm
        self.qk_norm_names = None if q_norm is None else ("q_norm", "k_norm")
        self.norms_span_projection = norm_weight(q_norm) is not None and q_norm.weight.numel() != head_dim
        # A weightless per-head norm of the values (Gemma 4's v_norm), or None.
        self.v_norm = v_norm
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        # Llama 4's chunked layers: attention within chunks of this many tokens (documents.chunked_documents).
        if attention_chunk is not None and sliding_window is not None:
            raise ValueError("a layer with both a sliding window and chunked attention: ds_tsp does not support it")
        self.attention_chunk = attention_chunk
        # Gemma-2's attention-logit soft-cap: a kernel of ds_tsp's own (SoftCappedKernel) serves it.
        if softcap is not None and backend not in ("auto", "sdpa"):
            raise ValueError(f"tsp.attention_backend = {backend!r} cannot soft-cap attention scores "
                             f"(attn_logit_softcapping = {softcap}): set tsp.attention_backend to \"auto\" or "
                             "\"sdpa\", with which ds_tsp's capped attention serves these layers")
        self.softcap = softcap
        # GPT-OSS's attention sinks, a logit per query head in the packed shard: ds_tsp's SinkKernel serves them.
        if sinks and softcap is not None:
            raise ValueError("attention sinks with soft-capped scores: ds_tsp's sink attention does not cap them")
        self.sinks = sinks
        # GPT-OSS's rotary tables hold each frequency once, and both halves of a head rotate by them.
        self.rotary_halves = rotary_halves
        # The rotary convention: Llama's, or the model's own function (GLM's and ERNIE 4.5's interleaved pairs).
        self.rope = rope
        # positions -> (B, L) factors of the queries (Llama4QueryScale, TemperatureTuning), or None; its
        # ``reads`` says which positions it takes ("position_ids" or "cache_positions").
        self.query_scale = query_scale
        self.layout_name, self.backend, self.overlap = layout_name, backend, overlap
        self.token_tile, self.fp32_accumulators = token_tile, fp32_accumulators
        # The weight-gradient reduces' wire dtype; None: float32 (or wider). ds_tsp.initialize
        # sets DeepSpeed's communication_data_type here when the config names it.
        self.grad_wire_dtype = None

    @classmethod
    def from_hf(cls, attn, config, tsp_group, layout_name="zigzag", backend="auto", overlap=True, token_tile=0,
                fp32_accumulators=True, read=None, device=None, fused=None):
        """Build from a Hugging Face attention module, keeping this rank's shard.

        ``read(name, piece)`` returns the tensor ``name`` (e.g. ``q_proj.weight``)
        cut to ``piece`` (see ``shard_piece``); by default it slices ``attn``'s own
        parameters, and a checkpoint reader can pass its own (``attn`` may then
        be on the meta device: only its shapes are used). ``fused``: the
        policy's fused projections of this module (``DecoderPolicy.fused``,
        Phi-3's ``qkv_proj``), whose rows ``read`` is then asked for under
        Hugging Face's names (``ds_tsp.blocks.fused``).
        """
        config = heads_config(attn, config)
        rows = hf_rows(attn, config, fused)
        q_proj = rows.hf_module(attn, "q_proj")
        weight = q_proj.weight
        device = device or weight.device
        norms = {}
        hf_names, after_rotary = qk_norm_names(attn)
        for name, hf_name in zip(("q_norm", "k_norm"), hf_names or (None, None)):
            norm = None if hf_name is None else getattr(attn, hf_name, None)  # a layer reusing keys has no k_norm
            if norm is not None:
                # A copy, so the HF module's parameters are never shared; its
                # weight is loaded from ``read`` below.
                norm = copy.deepcopy(norm).to_empty(device=device)
                norm.tsp_after_rotary = after_rotary  # read by rotary.rotate
            norms[name] = norm
        if getattr(attn, "v_norm", None) is not None:  # weightless (Gemma 4's): nothing to load
            norms["v_norm"] = copy.deepcopy(attn.v_norm).to_empty(device=device)
        rotary_halves = rotates_whole_head_by_half_tables(attn)
        module = cls(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, attn.head_dim,
                     tsp_group, qkv_bias=q_proj.bias is not None,
                     o_bias=rows.hf_module(attn, "o_proj").bias is not None,
                     # Falcon-H1's key_multiplier scales the keys, so the scores: folded into the scale.
                     scale=attn.scaling * getattr(attn, "key_multiplier", 1.0),
                     sliding_window=sliding_window_of(attn, config), layout_name=layout_name,
                     backend=backend, overlap=overlap, token_tile=token_tile, fp32_accumulators=fp32_accumulators,
                     dtype=weight.dtype, device=device, softcap=getattr(attn, "attn_logit_softcapping", None),
                     sinks=has_sinks(attn), rotary_halves=rotary_halves, output_gate=has_output_gate(attn, config, fused),
                     rope=model_rotary(attn, rotary_halves), query_scale=query_scale_of(attn, config),
                     attention_chunk=attention_chunk_of(attn, config), values_from_keys=values_from_keys(attn),
                     kv_sharing=kv_sharing_of(attn, config), kv_key=getattr(attn, "layer_type", None),
                     head_gate=has_head_gate(attn), **norms)
        module.hf_rows, module.qk_norm_names = rows, hf_names
        read = rows.reader(read or module_reader(attn))
        module.load_shard({name: read(name, module.shard_piece(name)) for name in module.shard_names()})
        return module

    def replicated_params(self):
        """The parameters every rank holds whole, under Hugging Face names."""
        params = {"o_proj.bias": self.o_bias}
        params.update({f"{hf_name}.weight": norm_weight(getattr(self, name))
                       for name, hf_name in zip(("q_norm", "k_norm"), self.qk_norm_names or ())})
        return {name: param for name, param in params.items() if param is not None}

    def shard_piece(self, name):
        """``(dim, start, length)`` of the full tensor ``name`` this rank holds, or None if whole."""
        return shard_piece(self.heads, name, self.tsp_rank)

    def plan(self, x, documents=None, input_norm=None, positions=None, spans=None):
        """How to run this layer on the local tokens ``x``; ``documents``: the
        rows' document starts (``ds_tsp.blocks.documents``), None for one per row;
        ``input_norm``: the layer's norm to run inside (``forward``);
        ``positions``: the tokens' positions ``(B, S/D)`` a query scale reads
        (its ``reads``: position ids or cache positions); ``spans``: per row
        the runs of tokens that see each other both ways (Gemma 3's images:
        ``documents.bidirectional_spans``), None for none."""
        if self.query_scale is not None and positions is None:
            raise ValueError("this attention scales its queries by position (llama_4_scaling_beta, "
                             "attn_temperature_tuning): its forward needs the tokens' positions")
        if self.attention_chunk is not None:
            documents = chunked_documents(documents, x.shape[1] * self.heads.tsp_size, x.shape[0],
                                          self.attention_chunk)
        if self.softcap is not None:
            kernel = SoftCappedKernel(self.softcap)
        else:
            # The dtype the Function computes in (autocast casts its inputs), not the residual stream's.
            kernel = select_kernel(self.backend, x.device, compute_dtype(self.packed), self.tsp_group)
        if self.sinks:
            kernel = SinkKernel(kernel)
        explicit = hasattr(kernel, "explicit_backward") and kernel.explicit_backward(self.heads.head_dim,
                                                                                     self.sliding_window)
        return AttentionPlan(group=self.tsp_group, heads=self.heads, specs=self.specs, layout=self.layout_name,
                             kernel=kernel, scale=self.scale, window=self.sliding_window, overlap=self.overlap,
                             explicit_backward=explicit, q_norm=self.q_norm, k_norm=self.k_norm,
                             v_norm=self.v_norm, values_from_keys=self.values_from_keys,
                             kv_sharing=self.kv_sharing,
                             query_blocks=query_blocks(documents, x.shape[1], self.tsp_rank, self.heads.tsp_size,
                                                       self.layout_name, x.shape[0], self.token_tile,
                                                       self.sliding_window, spans),
                             fp32_accumulators=self.fp32_accumulators, grad_wire_dtype=self.grad_wire_dtype,
                             input_norm=input_norm, token_tile=self.token_tile, rope=self.rope,
                             query_scale=None if self.query_scale is None else self.query_scale(positions),
                             casts_query_scale=getattr(self.query_scale, "casts_factors", True),
                             keep_projections=self.keeps_projections(x))

    def keeps_projections(self, x):
        """Whether a forward on the local tokens ``x`` keeps their projections for backward: one is to come
        (gradients enabled) and they fit one token tile (``tsp.token_tile``), as the MLP keeps its gate and up
        projections; else backward projects them again, so that what a layer keeps is bounded by the tile."""
        tokens = x.shape[0] * x.shape[1]
        return torch.is_grad_enabled() and (not self.token_tile or tokens <= self.token_tile)

    def projection_inv_rms(self, x, packed, plan):
        """With q/k norms over the whole projection, each local token's inverse
        RMS of q and of k (``{"q", "k"}``, ``(B, S/D)``) as Hugging Face's
        RMSNorm computes it (float32 or wider); None with per-head norms or none."""
        return projection_inv_rms(plan, x, packed) if self.norms_span_projection else None

    def takes_input_norm(self, norm):
        """Whether ``forward`` can run ``norm`` inside (``ds_tsp.blocks.input_norm``):
        a recomputable norm, and q/k norms that do not span the projection
        (whose sums of squares need the normed input first)."""
        return recomputable(norm) and not self.norms_span_projection

    def full_tables(self, tables):
        """The rotary tables ``(cos, sin)`` as ``self.rope`` takes them: a complex
        table (Llama 4's) as its real and imaginary parts; tables that hold each
        frequency once (``rotary_halves``) repeated for both halves of a head;
        others as they are; ``(None, None)`` for a model without a rotary
        embedding (``tables`` None), whose layers ``inject`` builds without one."""
        if tables is None:
            return None, None
        cos, sin = complex_tables(tables)
        if not self.rotary_halves:
            return cos, sin
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def forward(self, x, position_embeddings, documents=None, input_norm=None, positions=None, spans=None,
                shared=None):
        """``input_norm``: the layer's norm before the attention (``takes_input_norm``),
        applied to ``x`` here and recomputed tile by tile in backward; ``x`` is
        then the layer's input. ``positions``: the local tokens' positions
        ``(B, S/D)`` (position ids or cache positions: ``query_scale.reads``), read by a query scale.
        ``spans``: bidirectional runs of tokens (``plan``). Keys and values
        shared across layers (``kv_sharing``): a layer that reuses them takes the
        storing layer's local ones as ``shared`` ``(2, B, S/D, nkv, d)``; a layer
        that stores them returns ``(output, its local keys and values)``."""
        if self.kv_sharing == "reuse" and shared is None:
            raise ValueError("this attention reuses an earlier layer's keys and values: its forward takes them")
        cos, sin = self.full_tables(position_embeddings)
        plan, packed = self.plan(x, documents, input_norm, positions, spans), self.shard_weights()
        norm_weights = [norm_weight(norm) for norm in (self.q_norm, self.k_norm)]
        inv_rms = self.projection_inv_rms(x, packed, plan) or {"q": None, "k": None}
        out = TSPAttentionFunction.apply(x, packed, cos, sin, plan, *norm_weights, inv_rms["q"], inv_rms["k"],
                                          None if input_norm is None else input_norm.weight, shared)
        stored = None
        if self.kv_sharing == "store":
            out, stored = out
        out = out if self.o_bias is None else out + self.o_bias
        return out if stored is None else (out, stored)


def heads_config(attn, config):
    """The config that gives ``attn``'s head counts: a heterogeneous config's
    view of its layer (transformers' per-layer attributes: Gemma 4's full
    layers' wider heads and fewer key/value heads), else ``config`` itself."""
    if not getattr(config, "is_heterogeneous", False):
        return config
    return config.per_layer_config[attn.layer_idx]


def reuses_kv(attn):
    """Whether ``attn`` attends to an earlier layer's keys and values, holding no key/value projections."""
    return bool(getattr(attn, "is_kv_shared_layer", False))


def kv_sharing_of(attn, config):
    """How ``attn`` shares keys and values across layers (``config.num_kv_shared_layers``, Gemma 4's): "reuse"
    (it attends to an earlier layer's), "store" (the last layer of its type that computes its own, where later
    ones of its type reuse them), or None."""
    if not getattr(config, "num_kv_shared_layers", 0):
        return None
    if reuses_kv(attn):
        return "reuse"
    if not getattr(attn, "store_full_length_kv", False):
        return None
    reused = any(mode == "reuse" and kind == attn.layer_type
                 for mode, kind in zip(config.kv_sharing_modes, config.layer_types))
    return "store" if reused else None


def values_from_keys(attn):
    """Whether ``attn``'s values are its keys before their norm and rotary
    embedding: it holds a key projection and no value projection (Gemma 4's
    full layers under ``attention_k_eq_v``)."""
    return (attn is not None and isinstance(getattr(attn, "k_proj", None), nn.Linear)
            and hasattr(attn, "v_proj") and attn.v_proj is None)


def hf_rows(attn, config, fused=None):
    """Where q/k/v lie in the Hugging Face module ``attn`` under the policy's
    ``fused`` table for it (``ds_tsp.blocks.fused``: q rows, then k, then v)."""
    config = heads_config(attn, config)
    head_dim = attn.head_dim
    kv_rows = config.num_key_value_heads * head_dim
    q_rows = config.num_attention_heads * head_dim * (2 if has_output_gate(attn, config, fused) else 1)
    rows = FusedRows.of(fused or {}, {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows,
                                      "o_proj": config.hidden_size})
    rows.check_rows(attn, type(attn).__name__)
    return rows


def replicated_names(attn):
    """Hugging Face names of the tensors of an attention module that TSP keeps
    whole on every rank: the output bias and per-head q/k norms, where present."""
    output = attn.o_proj if hasattr(attn, "o_proj") else attn.out_proj  # LFM2's name
    names = ["o_proj.bias"] if output.bias is not None else []
    return names + [f"{name}.weight" for name in qk_norm_names(attn)[0] or ()
                    if norm_weight(getattr(attn, name, None)) is not None]


# Per-head query and key norms by their Hugging Face names: applied before the
# rotary embedding (Qwen3's, Gemma-3's, LFM2's q/k_layernorm) or after it (Hunyuan's; Llama 4's one
# weightless norm for both, ``qk_norm``).
QK_NORMS = {("q_norm", "k_norm"): False, ("q_layernorm", "k_layernorm"): False,
            ("query_layernorm", "key_layernorm"): True, ("qk_norm", "qk_norm"): True}


def qk_norm_names(attn):
    """``((query norm, key norm), after_rotary)`` of the Hugging Face attention
    ``attn``'s q/k norms by name, or ``(None, False)`` without."""
    return next(((names, after) for names, after in QK_NORMS.items() if getattr(attn, names[0], None) is not None),
                (None, False))


def has_output_gate(attn, config, fused=None):
    """Whether ``attn``'s ``q_proj`` yields each head's query and its output
    gate (Qwen3-Next's and Qwen3.5's full attention: ``2 * head_dim`` rows a
    head, the output multiplied by the gate's sigmoid before ``o_proj``)."""
    q_proj = getattr(attn, "q_proj", None)
    return (not fused and isinstance(q_proj, nn.Linear)
            and q_proj.out_features == 2 * config.num_attention_heads * attn.head_dim)


def has_head_gate(attn):
    """Whether ``attn`` gates each head's output by one sigmoid of its own projection ``g_proj`` (LFM3's:
    ``o * sigmoid(g_proj(x))``, one row a query head)."""
    g_proj, q_proj = getattr(attn, "g_proj", None), getattr(attn, "q_proj", None)
    return (isinstance(g_proj, nn.Linear) and isinstance(q_proj, nn.Linear)
            and g_proj.out_features * attn.head_dim == q_proj.out_features)


def has_sinks(attn):
    """Whether ``attn`` has attention sinks: GPT-OSS's ``sinks``, a logit per query head."""
    return isinstance(getattr(attn, "sinks", None), nn.Parameter)


@torch.no_grad()
def rotates_whole_head_by_half_tables(attn):
    """Whether the model's own ``apply_rotary_pos_emb`` (of ``attn``'s modeling
    module) rotates a whole head by tables of half its width, each frequency
    once (GPT-OSS: the head's halves rotate as a pair), rather than the first
    dims only or not at all (a partial rotary factor, Llama's convention)."""
    apply = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    d = getattr(attn, "head_dim", 0)
    if apply is None or d < 2 or d % 2:
        return False
    head = torch.arange(1.0, d + 1, dtype=torch.float64).view(1, 1, 1, d)
    cos, sin = torch.full((1, 1, d // 2), 0.5, dtype=torch.float64), torch.full((1, 1, d // 2), 0.25,
                                                                                dtype=torch.float64)
    try:
        rotated, _ = apply(head, head, cos, sin)
    except (RuntimeError, TypeError, ValueError):  # Llama's convention: tables as wide as the head, or fail
        return False
    return rotated.shape == head.shape and not torch.equal(rotated[..., d // 2:], head[..., d // 2:])


def attention_chunk_of(attn, config):
    """The chunk a layer of type ``chunked_attention`` attends within (Llama 4's
    ``attention_chunk_size``), None for other layers."""
    layer_types = getattr(config, "layer_types", None) or ()
    index = getattr(attn, "layer_idx", None)
    if index is None or index >= len(layer_types) or layer_types[index] != "chunked_attention":
        return None
    return config.attention_chunk_size


def sliding_window_of(attn, config):
    """The layer's sliding window: Qwen2-style modules carry it per layer,
    Mistral-style configs set it for every layer; None means full causal, and
    so does 0 (Qwen2-MoE's config says "no window" so; no mask applies it)."""
    return getattr(attn, "sliding_window", getattr(config, "sliding_window", None)) or None
