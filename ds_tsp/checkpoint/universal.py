"""TSP shards described to DeepSpeed's universal checkpoints, so a run resumes on another layout.

DeepSpeed's converter (``deepspeed/checkpoint/ds_to_universal.py``) joins every
parameter's ZeRO partitions over the data-parallel ranks and then its slices
over the model-parallel (here: TSP) ranks into one full tensor per parameter,
with its float32 master and Adam moments (``zero/<name>/{fp32,exp_avg,
exp_avg_sq,step}.pt``); an engine with ``"checkpoint": {"load_universal":
true}`` cuts each back to its own layout, whatever its TSP, data-parallel and
ZeRO sizes. The model states carry the description the converter reads
(``universal_checkpoint_info``), and each parameter the one its loader reads:

* a TSP block's packed shard (attention head groups, MLP columns of ``F``,
  whole experts) is a ``ParamAffineMap`` of one flat "full" tensor, the block's
  packed Hugging Face tensors whole, flattened and concatenated in name order.
  That tensor does not depend on the TSP size, so a map written at ``D``
  rebuilds it and a map at ``D'`` cuts it again; every piece of every tensor
  is one strided block of it;
* a folded vocabulary matrix is DeepSpeed's vocabulary tensor: rows concatenated
  over the ranks, padding stripped to ``vocab_size`` (``original_vocab_size``),
  padded again for the loading TSP size, which is TSP's own ``ceil(V / D)``
  rows per rank;
* everything else (norms, routers, biases every rank holds) is replicated,
  which the converter checks is equal on every TSP rank;
* experts folded over data-parallel replicas (``tsp.expert_parallel_size``)
  differ between replicas, which DeepSpeed's converter joins as partitions of
  one tensor: their map over the expert-parallel group is kept under
  ``FOLDED_EXPERTS`` for ``checkpoint.folded_experts``, which joins them
  itself, and each rank's loader gets its own pieces under its TSP rank.

DeepSpeed's affine maps express every TSP shard, so its converter joins them
unchanged. What its loaders do not do is ds_tsp's: ZeRO-3's loader cuts the
data-parallel partition from the whole universal tensor (here the TSP shard is
cut first, ``load_zero3_universal_states``); and a reshard
(``ds_tsp.checkpoint.resharding``) gives every parameter the pipe's and the
model's names, writes the model-states and optimizer files the way both ZeRO
1-2 and ZeRO-3 read them, and marks the embedding and head as vocabulary
tensors whether or not the source folded them.
"""

import math
import os
import re

import torch
import torch.distributed as dist
from deepspeed.checkpoint.affine import AFFINE_MAP_FORMAT_VERSION, SCALE_POWER_BY_STATE, AffinePiece, ParamAffineMap
from deepspeed.checkpoint.constants import (
    AFFINE_MAP,
    AFFINE_MAP_PARAMS,
    AFFINE_MAP_VERSION,
    DS_AUTOTP_UC_META,
    ORIGINAL_VOCAB_SIZE,
    PARAM,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    VOCABULARY_PARAMETER_PATTERNS,
)

from ds_tsp.blocks.moe.module import TSPSparseMoE
from ds_tsp.blocks.packing import PackedShardMixin
from ds_tsp.blocks.vocab import VocabParallelEmbedding, VocabParallelLMHead
from ds_tsp.checkpoint.shard_plan import block_holdings, block_specs, shard_group
from ds_tsp.parallel import comm

# universal_checkpoint_info's key for the maps of folded experts over their expert-parallel groups.
FOLDED_EXPERTS = "ds_tsp_folded_experts"


def _row_major(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    return tuple(strides)


def packed_map(specs, holdings):
    """The ``ParamAffineMap`` of a block's packed shards over its TSP group:
    ``specs[r]`` lays out rank ``r``'s shard, ``holdings[r]`` says which piece
    of which full tensor each of its tensors is (``checkpoint.planning``)."""
    full_shapes = {}
    for spec, held in zip(specs, holdings):
        for name, shape in spec.shapes.items():
            dim, start, length = held[name] or (0, 0, shape[0])
            full = list(shape)
            full[dim] = max(start + length, full_shapes[name][dim] if name in full_shapes else 0)
            full_shapes[name] = tuple(full)
    base, offset = {}, 0
    for name in sorted(full_shapes):
        base[name] = offset
        offset += math.prod(full_shapes[name])
    pieces_by_rank = {}
    for rank, (spec, held) in enumerate(zip(specs, holdings)):
        pieces = []
        for name, shape in spec.shapes.items():
            dim, start, _ = held[name] or (0, 0, shape[0])
            strides = _row_major(full_shapes[name])
            holders = [r for r, other in enumerate(holdings) if name in specs[r].shapes and other[name] == held[name]]
            pieces.append(AffinePiece(shape, base[name] + start * strides[dim], strides, spec.offsets[name],
                                      _row_major(shape), holders))
        pieces_by_rank[rank] = pieces
    return ParamAffineMap((offset,), {rank: (spec.numel,) for rank, spec in enumerate(specs)}, pieces_by_rank)


def _exact(name):
    return re.escape(name) + "$"


class UniversalShard:
    """How a TSP-sharded parameter is cut from its universal tensor: by its
    block's affine map, or as a vocabulary matrix (zero padding rows)."""

    def __init__(self, tsp_rank, affine=None, rows=None):
        self.tsp_rank, self.affine, self.rows = tsp_rank, affine, rows

    def cut(self, full, key):
        """This rank's shard of the universal ``full`` tensor of state ``key`` (fp32, exp_avg, ...)."""
        if self.affine is not None:
            return self.affine.extract(full, self.tsp_rank, SCALE_POWER_BY_STATE.get(key, 1))
        start = self.tsp_rank * self.rows
        shard = full.new_zeros(self.rows, *full.shape[1:])
        held = full[start:start + self.rows]
        shard[:held.shape[0]] = held
        return shard


def universal_info(module):
    """The ``universal_checkpoint_info`` of an injected TSP model (or pipeline
    stage), which DeepSpeed writes into every model-states file. Each sharded
    parameter gets its ``UniversalShard`` (``tsp_universal_shard``) for
    ``load_zero3_universal_states``, and a packed one its map where DeepSpeed's
    ZeRO 1-2 loader reads it."""
    maps, folded, vocabulary, replicated = {}, {}, [], []
    vocab_size = None
    sharded = set()
    for prefix, block in module.named_modules():
        if isinstance(block, PackedShardMixin):
            affine = packed_map(block_specs(block), block_holdings(block))
            if isinstance(block, TSPSparseMoE) and block.folded:
                folded[f"{prefix}.packed"] = affine.to_dict()
                # DeepSpeed's loader cuts by TSP rank: this rank's pieces of the expert-parallel map under it.
                rank = shard_group(block)[1]
                affine = ParamAffineMap(affine.logical_shape, {block.tsp_rank: affine.shard_shapes[rank]},
                                        {block.tsp_rank: affine.pieces_by_rank[rank]})
            else:
                maps[_exact(f"{prefix}.packed")] = affine.to_dict()
            setattr(block.packed, DS_AUTOTP_UC_META, {"conversion": {"affine_map": affine.to_dict()}})
            block.packed.tsp_universal_shard = UniversalShard(block.tsp_rank, affine=affine)
            sharded.add(id(block.packed))
        elif isinstance(block, (VocabParallelEmbedding, VocabParallelLMHead)) and id(block.weight) not in sharded:
            vocabulary.append(_exact(f"{prefix}.weight"))
            vocab_size = block.vocab_size
            block.weight.tsp_universal_shard = UniversalShard(block.tsp_rank, rows=block.rows)
            sharded.add(id(block.weight))
    for name, param in module.named_parameters():
        if id(param) not in sharded:
            replicated.append(_exact(name))
    info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            AFFINE_MAP: {AFFINE_MAP_VERSION: AFFINE_MAP_FORMAT_VERSION, AFFINE_MAP_PARAMS: maps},
            TP_REPLICATED_PARAMETER_PATTERNS: replicated}
    if vocabulary:
        info.update({VOCABULARY_PARAMETER_PATTERNS: vocabulary, ORIGINAL_VOCAB_SIZE: vocab_size})
    if folded:
        info[FOLDED_EXPERTS] = folded
    return info


def describe_for_universal_checkpoints(module, topology):
    """Put ``universal_info`` where ``engine.save_checkpoint`` looks for it. The
    converter reads it from one file, so with pipeline stages each stage's
    description is gathered over its pipeline group into one of the whole model."""
    info = universal_info(module)
    if topology.pp_size > 1:
        stages = comm.all_gather_objects(info, topology.pp_group)
        info[AFFINE_MAP][AFFINE_MAP_PARAMS] = {pattern: entry for stage in stages
                                               for pattern, entry in stage[AFFINE_MAP][AFFINE_MAP_PARAMS].items()}
        info[TP_REPLICATED_PARAMETER_PATTERNS] = [pattern for stage in stages
                                                  for pattern in stage[TP_REPLICATED_PARAMETER_PATTERNS]]
        vocabulary = [p for stage in stages for p in stage.get(VOCABULARY_PARAMETER_PATTERNS, [])]
        if vocabulary:
            info.update({VOCABULARY_PARAMETER_PATTERNS: vocabulary,
                         ORIGINAL_VOCAB_SIZE: next(s[ORIGINAL_VOCAB_SIZE] for s in stages if ORIGINAL_VOCAB_SIZE in s)})
    setattr(module, UNIVERSAL_CHECKPOINT_INFO, info)


def load_zero3_universal_states(optimizer):
    """ZeRO-3's universal loader cuts a parameter's data-parallel partition out
    of the universal tensor whole, without the TSP cut (its AutoTP branch asks
    for a tensor-parallel group DeepSpeed never built here): in front of it,
    TSP-sharded parameters are cut to their TSP shard first, then partitioned
    exactly as ZeRO-3 partitions a parameter (``ceil(numel / dp)`` elements per
    rank, zero padded at the end)."""
    original = optimizer.load_hp_checkpoint_state

    def load_hp_checkpoint_state(folder, key, param=None):
        shard = getattr(param, "tsp_universal_shard", None)
        if shard is None:
            return original(folder, key, param=param)
        full = torch.load(os.path.join(folder, f"{key}.pt"), weights_only=False)[PARAM]
        flat = shard.cut(full, key).reshape(-1)
        group = param.ds_process_group
        world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        piece = math.ceil(flat.numel() / world)
        flat = torch.cat([flat, flat.new_zeros(world * piece - flat.numel())])
        return flat.narrow(0, rank * piece, piece)

    optimizer.load_hp_checkpoint_state = load_hp_checkpoint_state
