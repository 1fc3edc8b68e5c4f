"""Which piece of which tensor every TSP rank holds, and how pieces join.

Pure sizes and indices, no files and no collectives: the model may live on
the meta device. Which piece of which tensor a rank holds is computed here for
any rank (``shard_plan``), so that one process can pre-shard a checkpoint
(``ds-tsp convert``) and a rank can reassemble every other rank's pieces. The
blocks' own ``shard_piece`` stays the authority: the loader and the gatherer
check it against the plan for their own rank.

A rank's holdings in one block are ``{name: piece}``: every tensor of its
packed shard (its spec) with the piece ``(dim, start, length)`` of the full
tensor it is, plus the block's replicated tensors (piece None: whole). With
nkv < D only the first rank of each key/value replica set stores those heads,
so shards differ. The names are the TSP block's; where Hugging Face fuses
projections (Phi-3's ``qkv_proj``) the block's ``FusedRows`` (``ds_tsp.blocks.fused``)
translates them, and ``shard_plan``, in Hugging Face's names, gives such a
tensor the tuple of row pieces a rank holds of it.
"""

import contextlib
from typing import NamedTuple

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from ds_tsp.blocks import mlp, vocab
from ds_tsp.blocks.attention import module as attention
from ds_tsp.blocks.attention.head_groups import HeadGroups, shard_piece, shard_spec
from ds_tsp.blocks.attention.module import TSPAttention
from ds_tsp.blocks.fused import FusedRows, split_rows
from ds_tsp.blocks.latent import module as latent
from ds_tsp.blocks.latent import shards as latent_shards
from ds_tsp.blocks.latent.module import TSPLatentAttention
from ds_tsp.blocks.linear import module as linear
from ds_tsp.blocks.linear.mamba2_module import is_mamba2, mamba2_shapes
from ds_tsp.blocks.linear.mamba1 import is_mamba1, mamba1_shapes
from ds_tsp.blocks.linear.short_conv import is_short_conv, short_conv_shapes
from ds_tsp.blocks.linear.streamed import StreamedMixer
from ds_tsp.blocks.linear.module import TSPGatedDeltaNet
from ds_tsp.blocks.mlp import TSPGatedMLP
from ds_tsp.blocks.moe import plan as moe
from ds_tsp.blocks.moe.module import TSPSparseMoE
from ds_tsp.injection.inject import check_same_vocabulary
from ds_tsp.injection.model import TSPCausalLMMixin
from ds_tsp.injection.policy import hf_path
from ds_tsp.parallel import comm


def _holdings(specs, piece, replicated):
    """Per rank, ``{name: piece}`` of its packed tensors, then its replicated ones."""
    return [{**{name: piece(name, r) for name in spec.shapes}, **dict.fromkeys(replicated)}
            for r, spec in enumerate(specs)]


class BlockShards(NamedTuple):
    """One block of a layer, for every rank of a TSP group: its ``PackSpec``s,
    its ``{name: piece}`` holdings (``_holdings``) and where those names lie in
    Hugging Face's tensors (``ds_tsp.blocks.fused``)."""

    specs: list
    holdings: list
    hf_rows: FusedRows


class ExpertPlacement(NamedTuple):
    """Experts folded past the TSP group (``tsp.expert_parallel_size``): over
    ``size`` ranks, TSP rank ``r`` of this group holding expert-parallel rank
    ``first + r``'s."""

    size: int
    first: int


def layer_shards(layer, config, policy, tsp_size, experts=None):
    """``{block's Hugging Face prefix under the layer: BlockShards}`` of one
    Hugging Face decoder layer (meta device is enough): its mixer, its MLP and
    experts beside it (``policy.ExpertsBesideMLP``: prefix "" for Gemma 4's, the layer's own); ``experts``: an
    ``ExpertPlacement``, or None for experts split over the TSP group.

    Built with the functions the TSP modules use, so it raises their head and
    intermediate-size divisibility errors before any tensor is read.
    """
    mixer, mlp_name = policy.mixer(layer), policy.mlp_of(layer)
    shards = {}
    for name in (mixer, policy.side_mixer(layer)):
        if name is not None:
            shards[name] = _mixer_shards(layer.get_submodule(name), config, policy, tsp_size)
    if mlp_name is not None:
        shards[mlp_name] = _mlp_shards(layer.get_submodule(mlp_name), policy, tsp_size, experts)
    beside = policy.beside(layer)
    if beside is not None:  # experts beside the MLP: the layer's own router, experts and their input norm
        shards[beside.block] = _sparse_shards(beside.hf_block(layer), tsp_size, experts, beside.input_norm)
    return shards


def _mixer_shards(attn, config, policy, tsp_size):
    """``BlockShards`` of a layer's token mixer ``attn``: an attention, a latent attention, a Gated DeltaNet, a
    Mamba-2 mixer or a short convolution."""
    if is_mamba2(attn):
        return _streamed_shards(mamba2_shapes(attn, tsp_size))
    if is_short_conv(attn):
        return _streamed_shards(short_conv_shapes(attn, tsp_size))
    if is_mamba1(attn):
        return _streamed_shards(mamba1_shapes(attn, tsp_size))
    if linear.is_gated_delta_net(attn):
        return _delta_net_shards(attn, tsp_size)
    if latent.is_latent_attention(attn):
        return _latent_shards(attn, config, tsp_size)
    rows = attention.hf_rows(attn, config, policy.fused.get(policy.attention))
    config = attention.heads_config(attn, config)
    heads = HeadGroups(config.num_attention_heads, config.num_key_value_heads, attn.head_dim, tsp_size,
                       attention.has_output_gate(attn, config, policy.fused.get(policy.attention)))
    attn_specs = [shard_spec(heads, config.hidden_size, rows.hf_module(attn, "q_proj").bias is not None, r,
                             attention.has_sinks(attn), values=not attention.values_from_keys(attn),
                             keys=not attention.reuses_kv(attn), head_gate=attention.has_head_gate(attn))
                  for r in range(tsp_size)]
    return BlockShards(attn_specs, _holdings(attn_specs, lambda name, r: shard_piece(heads, name, r),
                                             attention.replicated_names(attn)), rows)


def _latent_shards(attn, config, tsp_size):
    """``BlockShards`` of a multi-head latent attention (``ds_tsp.blocks.latent``)."""
    shapes = latent.latent_shapes(attn, config, tsp_size)
    specs = [latent_shards.shard_spec(shapes, r) for r in range(tsp_size)]
    return BlockShards(specs, _holdings(specs, lambda name, r: latent_shards.shard_piece(shapes, name, r),
                                        latent.replicated_names(attn)), FusedRows())


def _delta_net_shards(hf_layer, tsp_size):
    """``BlockShards`` of a Gated DeltaNet (``ds_tsp.blocks.linear``)."""
    shapes = linear.delta_net_shapes(hf_layer, tsp_size)
    specs = [shapes.spec(r) for r in range(tsp_size)]
    return BlockShards(specs, _holdings(specs, shapes.piece, linear.replicated_names(hf_layer)), shapes.hf_rows())


def _streamed_shards(shapes):
    """``BlockShards`` of a mixer of three pieces (``ds_tsp.blocks.linear.streamed``) of ``shapes``."""
    specs = [shapes.spec(r) for r in range(shapes.tsp_size)]
    return BlockShards(specs, _holdings(specs, shapes.piece, shapes.replicated_names()), shapes.hf_rows())


def _mlp_shards(hf_mlp, policy, tsp_size, placement=None):
    """``BlockShards`` of a layer's MLP: a dense MLP (gated or not), or a sparse MoE
    block (experts cut on dim 0 of the fused 3-D tensors: a piece like any
    other, placed by ``placement``, an ``ExpertPlacement`` or None)."""
    if policy.is_sparse(hf_mlp):
        return _sparse_shards(hf_mlp, tsp_size, placement)
    fused = policy.fused.get(policy.mlp)
    rows, inputs = mlp.hf_rows(hf_mlp, fused), mlp.input_projections(hf_mlp, fused)
    down = mlp.down_projection(hf_mlp, fused)
    hidden_size, intermediate_size = down.out_features, down.in_features
    specs = [mlp.shard_spec(hidden_size, intermediate_size, tsp_size,
                            rows.hf_module(hf_mlp, inputs[0]).bias is not None, "gate_proj" in inputs)] * tsp_size
    return BlockShards(specs, _holdings(specs, lambda name, r: mlp.shard_piece(intermediate_size, tsp_size, name, r),
                                        [mlp.DOWN_BIAS] if down.bias is not None else []), rows)


def _sparse_shards(hf_moe, tsp_size, placement=None, input_norm=None):
    """``BlockShards`` of a sparse MoE block (experts cut on dim 0 of the fused
    3-D tensors, placed by ``placement``); ``input_norm``: the norm of its
    experts' inputs it holds (experts beside an MLP), or None."""
    hidden_size, num_experts, experts, shared_size, shared_name = moe.hf_sizes(hf_moe)
    placement = placement or ExpertPlacement(tsp_size, 0)
    specs = [moe.shard_spec(hidden_size, num_experts, experts, tsp_size, shared_size,
                            shared_name or "shared_expert", placement.size, moe.shared_is_gated(hf_moe))] * tsp_size
    return BlockShards(specs, _holdings(specs, lambda name, r: moe.shard_piece(
        num_experts, shared_size, tsp_size, name, r, placement.size, placement.first + r),
        moe.replicated_names(hf_moe, input_norm)), FusedRows())


def vocab_names(model, policy):
    """``{Hugging Face name: vocabulary rows}`` of the matrices folded by
    vocabulary: the embedding's, the LM head's unless it is tied to the
    embedding, and a per-layer embedding's (Gemma 4's, rows of its own count)."""
    embed, lm_head = model.get_submodule(policy.embed_tokens), model.get_submodule(policy.lm_head)
    rows = model.config.get_text_config().vocab_size
    names = {f"{policy.embed_tokens}.weight": rows}
    if lm_head.weight is not embed.weight:
        names[f"{policy.lm_head}.weight"] = rows
    inputs = policy.model_inputs(model)
    if inputs is not None:
        names[f"{inputs.embed}.weight"] = model.get_submodule(inputs.embed).num_embeddings
    return names


def shard_plan(model, policy, tsp_size, vocab_parallel=True, experts=None):
    """``plans[r][full_name] = piece`` for every tensor of every TSP block of the
    Hugging Face ``model`` (meta device is enough) that TSP rank ``r`` holds
    (its experts placed by ``experts``, an ``ExpertPlacement``, or over the TSP group),
    and, with ``vocab_parallel``, its rows of the embedding and LM head (after
    checking that they can be folded). Names are Hugging Face's; a fused
    tensor's value is the tuple of the row pieces the rank holds of it
    (``ds_tsp.blocks.fused.row_pieces``)."""
    plans = [{} for _ in range(tsp_size)]
    if vocab_parallel:
        vocab.check_foldable(model.get_submodule(policy.embed_tokens), model.get_submodule(policy.lm_head),
                             type(model).__name__)
        inputs = policy.model_inputs(model)
        if inputs is not None:
            table, embed = model.get_submodule(inputs.embed), model.get_submodule(policy.embed_tokens)
            vocab.check_foldable_table(table, type(model).__name__, "per-layer embedding")
            check_same_vocabulary(table, embed, type(model).__name__)
        for tsp_rank, plan in enumerate(plans):
            plan.update({name: vocab.shard_piece(rows, tsp_size, tsp_rank)
                         for name, rows in vocab_names(model, policy).items()})
    for index, layer in enumerate(model.get_submodule(policy.layers)):
        prefix = f"{policy.layers}.{index}"
        shards = layer_shards(layer, model.config.get_text_config(), policy, tsp_size, experts)
        for block_name, block in shards.items():
            for plan, held in zip(plans, block.holdings):
                plan.update({hf_path(prefix, block_name, name): piece
                             for name, piece in block.hf_rows.hf_holdings(held).items()})
    return plans


def shard_group(block):
    """``(group, rank)``: the ranks an injected TSP block's shards are spread
    over and this rank's place among them: the expert-parallel group for
    experts folded past the TSP group (``tsp.expert_parallel_size``), else
    the TSP group."""
    if isinstance(block, TSPSparseMoE) and block.folded:
        return block.ep_group, block.ep_rank
    return block.tsp_group, block.tsp_rank


def block_specs(block):
    """The ``PackSpec`` of every rank's shard of an injected TSP block, over its ``shard_group``."""
    if isinstance(block, TSPAttention):
        return list(block.specs)
    if isinstance(block, TSPLatentAttention):
        return [latent_shards.shard_spec(block.shapes, r) for r in range(block.shapes.tsp_size)]
    if isinstance(block, (TSPGatedDeltaNet, StreamedMixer)):
        return [block.shapes.spec(r) for r in range(block.shapes.tsp_size)]
    if isinstance(block, (TSPGatedMLP, TSPSparseMoE)):
        return [block.spec] * comm.group_size(shard_group(block)[0])
    raise TypeError(f"{type(block).__name__} is not a TSP block")


def block_holdings(block):
    """``holdings[r] = {name: piece}`` of an injected TSP block for every rank of
    its ``shard_group``, checked against the block's own ``shard_names``/``shard_piece``."""
    tsp_size, specs = comm.group_size(block.tsp_group), block_specs(block)
    if isinstance(block, TSPAttention):
        holdings = _holdings(specs, lambda name, r: shard_piece(block.heads, name, r),
                             list(block.replicated_tensors()))
    elif isinstance(block, TSPLatentAttention):
        holdings = _holdings(specs, lambda name, r: latent_shards.shard_piece(block.shapes, name, r),
                             list(block.replicated_tensors()))
    elif isinstance(block, (TSPGatedDeltaNet, StreamedMixer)):
        holdings = _holdings(specs, block.shapes.piece, list(block.replicated_tensors()))
    elif isinstance(block, TSPSparseMoE):
        holdings = _holdings(specs, lambda name, r: moe.shard_piece(block.num_experts, block.shared_size, tsp_size,
                                                                   name, r, block.ep_size, r),
                             list(block.replicated_tensors()))
    else:
        holdings = _holdings(specs, lambda name, r: mlp.shard_piece(block.intermediate_size, tsp_size, name, r),
                             [mlp.DOWN_BIAS] if block.down_bias is not None else [])
    own, rank = {name: block.shard_piece(name) for name in block.shard_names()}, shard_group(block)[1]
    if holdings[rank] != own:
        raise RuntimeError(f"{type(block).__name__} on shard rank {rank} holds {own}, but "
                           f"ds_tsp.checkpoint expects {holdings[rank]}")
    return holdings


def narrow_index(piece):
    """``piece = (dim, start, length)`` as an index for ``tensor[...]`` or a safetensors slice."""
    dim, start, length = piece
    return (slice(None),) * dim + (slice(start, start + length),)


def join_pieces(pieces, tensors, name):
    """The full tensor from ``pieces`` and the ``tensors`` holding them; a piece
    held by several ranks is taken once."""
    dim = pieces[0][0]
    shape = list(tensors[0].shape)
    shape[dim] = max(start + length for _, start, length in pieces)
    full = tensors[0].new_empty(shape)
    distinct = {}
    for piece, tensor in zip(pieces, tensors):
        if tuple(piece) not in distinct:
            distinct[tuple(piece)] = tensor
            full[narrow_index(piece)] = tensor
    if sum(length for _, _, length in distinct) != shape[dim]:
        raise RuntimeError(f"the pieces {pieces} of {name} do not tile its {shape[dim]} rows")
    return full


def join_holdings(name, held):
    """The full tensor ``name`` from ``[(piece, tensor)]`` of the ranks holding
    it; a rank's tuple of row pieces of a fused tensor comes as their concatenation."""
    if held[0][0] is None:
        return held[0][1]
    held = [part for piece, tensor in held for part in split_rows(piece, tensor)]
    return join_pieces([piece for piece, _ in held], [tensor for _, tensor in held], name)


# ------------------------------------------------------- the model, by size

def resolve_dtype(torch_dtype, config):
    """``torch_dtype`` as a ``torch.dtype``; None or "auto" take the checkpoint's
    dtype from its config, as Hugging Face's ``from_pretrained`` does."""
    if torch_dtype in (None, "auto"):
        torch_dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(torch_dtype, str):
        torch_dtype = getattr(torch, torch_dtype.removeprefix("torch."))
    return torch_dtype


def meta_model(path_or_config, torch_dtype=None, model_class=None):
    """The Hugging Face causal LM (or vision-language model) of a checkpoint (or config), on the meta device:
    sizes, no memory. ``model_class`` (default: the Auto class's choice) builds it."""
    config = path_or_config
    if not hasattr(config, "model_type"):
        config = AutoConfig.from_pretrained(path_or_config)
    dtype = resolve_dtype(torch_dtype, config)
    with torch.device("meta"), _without_hf_zero3_init():
        if model_class is None:
            # A vision-language model's text config sits under its own (Qwen2-VL's text_config).
            auto = AutoModelForCausalLM if config.get_text_config() is config else AutoModelForImageTextToText
            return auto.from_config(config, dtype=dtype), dtype
        return model_class._from_config(config, dtype=dtype), dtype


@contextlib.contextmanager
def _without_hf_zero3_init():
    """Once ``TrainingArguments(deepspeed=<a ZeRO-3 config>)`` exists, transformers
    builds every model under ``deepspeed.zero.Init`` and initialises its weights
    by gathering them, which a model of sizes alone on the meta device cannot do."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    active = ref() if ref is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if active is not None:
            hf_deepspeed.set_hf_deepspeed_config(active)


def hf_class(model_or_class):
    """The Hugging Face class an injected model (or its class) was made from."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return next(c for c in cls.__mro__ if not issubclass(c, TSPCausalLMMixin))


def tied_names(model):
    """Names Hugging Face leaves out of its files: tied copies such as
    ``lm_head.weight`` under ``tie_word_embeddings``."""
    return set(getattr(model, "all_tied_weights_keys", {}) or {})


def untied(model, state):
    """``state`` without the tied copies Hugging Face leaves out of its files."""
    tied = tied_names(model)
    return {name: tensor for name, tensor in state.items() if name not in tied}
