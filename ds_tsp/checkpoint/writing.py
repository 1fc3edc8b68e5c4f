"""Writing checkpoints: a TSP model, or a pipeline's stages, as a plain Hugging Face directory; ``ds-tsp convert``.

``save_pretrained`` streams: the model is walked in Hugging Face's order one
gathering unit at a time (a TSP block: one collective over its TSP group; a
folded vocabulary matrix: one all-gather; a replicated module: nothing to
gather; under ZeRO-3, DeepSpeed's ``GatheredParameters`` over the unit's
data-parallel group first), each unit's full tensors go to global rank 0's
CPU (from another pipeline stage by a broadcast over the pipeline group of TSP
rank 0), and rank 0 writes each weights file as soon as its last tensor
arrives, into a directory beside the target that replaces it once complete
(``staging``). Files are cut
by ``max_shard_size`` with huggingface_hub's split (``split_into_files``)
and indexed by ``model.safetensors.index.json`` exactly as Hugging Face's
``save_pretrained`` does, so rank 0 holds about one file's worth of tensors,
not the model, and no other rank more than one unit.

Every writer here (``save_pretrained``, ``write_state_dict`` for ``ds-tsp
export``, ``ds-tsp convert --join``) writes the names transformers' own
``save_pretrained`` writes: sparse-MoE experts one tensor per expert
(``expert_files``), as Hub checkpoints hold them and as transformers 4 named
them; transformers 5 fuses them again on load.
"""

import copy
import json
import os
import shutil
from dataclasses import dataclass
from typing import Callable

import deepspeed
import torch
from huggingface_hub import split_state_dict_into_shards_factory, split_torch_state_dict_into_shards
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoConfig
from transformers.utils import CONFIG_NAME, GENERATION_CONFIG_NAME

from ds_tsp.blocks.fused import row_pieces
from ds_tsp.blocks.moe.module import TSPSparseMoE
from ds_tsp.blocks.packing import PackedShardMixin
from ds_tsp.blocks.tower import ShardedUnit
from ds_tsp.blocks.vocab import VocabParallelEmbedding, VocabParallelLMHead
from ds_tsp.checkpoint.adapters import save_adapters
from ds_tsp.checkpoint.expert_files import expert_files, to_files
from ds_tsp.checkpoint.formats import (
    SAFE_WEIGHTS,
    SAFE_WEIGHTS_INDEX,
    TSP_SHARDS,
    TSP_SHARDS_FORMAT,
    CheckpointError,
    checkpoint_files,
    is_checkpoint_file,
    rank_file,
)
from ds_tsp.checkpoint.reading import TSPShardCheckpoint, check_tensors_present, hf_checkpoint
from ds_tsp.checkpoint.shard_plan import (
    block_holdings,
    block_specs,
    hf_class,
    join_holdings,
    meta_model,
    shard_group,
    shard_plan,
    tied_names,
)
from ds_tsp.checkpoint.staging import SharedSave, staged, staged_together
from ds_tsp.injection.model import TSPCausalLMMixin, TSPDecoderLayer
from ds_tsp.injection.policy import hf_path, resolve_policy
from ds_tsp.parallel import comm

# Hugging Face's default before transformers 5 (which writes up to 50GB per
# file): the writer holds about one file in CPU memory.
DEFAULT_MAX_SHARD_SIZE = "5GB"
_FILENAME_PATTERN = SAFE_WEIGHTS.replace(".safetensors", "{suffix}.safetensors")


# ------------------------------------------------------------------ gathering

def gather_shards(block):
    """Every rank's packed shard of ``block`` (over its ``shard_group``),
    unpacked: one all-gather when the shards are the same size, else one
    broadcast from each owner."""
    specs, (group, rank) = block_specs(block), shard_group(block)
    packed = block.packed.detach()
    if len({spec.numel for spec in specs}) == 1:
        gathered, _ = comm.all_gather(packed, group)  # (D, shard numel)
        return [spec.unpack(flat) for spec, flat in zip(specs, gathered)]
    shards = []
    for owner in range(len(specs)):
        buf = packed if owner == rank else packed.new_empty(specs[owner].numel)
        comm.broadcast(buf, src=owner, group=group)
        shards.append(specs[owner].unpack(buf))
    return shards


def gather_block(block):
    """The full Hugging Face tensors of one TSP block (``{name: tensor}``), on
    every rank of its TSP group: the packed shards are gathered, unpacked and
    put back where each rank's piece came from (one copy of rows several ranks
    hold), fused where Hugging Face fuses them (``ds_tsp.blocks.fused``); replicated
    tensors are this rank's own."""
    holdings = block_holdings(block)
    shards = gather_shards(block)
    own = block.shard_tensors()
    full = {}
    for name in dict.fromkeys(name for held in holdings for name in held):
        held = [(pieces[name], shards[r][name] if pieces[name] is not None else own[name])
                for r, pieces in enumerate(holdings) if name in pieces]
        full[name] = join_holdings(name, held)
    return block.hf_rows.fuse(full)


def gather_vocab(module):
    """The full ``(V, H)`` matrix of a vocabulary-parallel embedding or head:
    every rank's rows all-gathered, the padding rows dropped."""
    gathered, _ = comm.all_gather(module.weight.detach(), module.tsp_group)  # (D, Vs, H)
    return gathered.flatten(0, 1)[:module.vocab_size]


@dataclass
class GatherUnit:
    """Tensors gathered together: ``dtypes`` names them (Hugging Face names) and
    ``gather()`` returns them full, collectively over the unit's TSP group and,
    where ZeRO-3 partitions ``params``, over their data-parallel group first."""

    dtypes: dict
    collect: Callable[[], dict]
    params: tuple = ()

    def gather(self):
        partitioned = [p for p in self.params if hasattr(p, "ds_id")]
        if not partitioned:
            return self.collect()
        # One module's partitions at a time (DeepSpeed's own gather over the data-parallel group), copied
        # out before they are released again.
        with deepspeed.zero.GatheredParameters(partitioned):
            return {name: tensor.clone() for name, tensor in self.collect().items()}


def gather_unit(prefix, module):
    """The ``GatherUnit`` of one module at Hugging Face name ``prefix``: a TSP
    block, a vocabulary-parallel matrix (none for a head tied to the embedding,
    whose rows the embedding's unit writes) or a module every rank holds whole.
    The dtypes come from the parameters alone, so partitioned ones need no gather."""
    params = tuple(module.parameters())
    if isinstance(module, PackedShardMixin):
        names = dict.fromkeys(module.hf_rows.hf_name(name) for held in block_holdings(module) for name in held)
        replicated = module.replicated_tensors()
        return GatherUnit({f"{prefix}.{n}": (replicated[n] if n in replicated else module.packed).dtype for n in names},
                          lambda: {f"{prefix}.{n}": t for n, t in gather_block(module).items()}, params)
    if isinstance(module, ShardedUnit):  # a tower unit: its flat vector all-gathered, cut into its tensors
        buffers = {f"{prefix}.{n}": t for n, t in module.unit.state_dict().items()}
        return GatherUnit({**{f"{prefix}.{n}": module.shard.dtype for n in module.names},
                           **{n: t.dtype for n, t in buffers.items()}},
                          lambda: {**_unit_tensors(prefix, module), **buffers}, params)
    if isinstance(module, (VocabParallelEmbedding, VocabParallelLMHead)):
        if getattr(module, "tied", False):
            return GatherUnit({}, dict)
        return GatherUnit({f"{prefix}.weight": module.weight.dtype},
                          lambda: {f"{prefix}.weight": gather_vocab(module)}, params)
    dtypes = {f"{prefix}.{n}": t.dtype for n, t in module.named_parameters()}
    dtypes.update({f"{prefix}.{n}": t.dtype for n, t in module.named_buffers() if n in module.state_dict()})
    return GatherUnit(dtypes, lambda: {f"{prefix}.{n}": t for n, t in module.state_dict().items()}, params)


def _whole_tensors(prefix, tensors):
    """A ``GatherUnit`` of ``tensors`` every rank holds whole, under ``prefix``."""
    named = {f"{prefix}.{name}": tensor for name, tensor in tensors.items()}
    return GatherUnit({name: tensor.dtype for name, tensor in named.items()}, lambda: named)


@torch.no_grad()
def _unit_tensors(prefix, unit):
    return {f"{prefix}.{name}": tensor for name, tensor in unit.full_tensors().items()}


# ---------------------------------------------------------- what a rank holds

@dataclass
class SavedStage:
    """What this rank holds of the model to save (its pipeline stage's modules
    under their Hugging Face names, ``extra`` tensors outside them) and what
    describes the whole model."""

    topology: object
    policy: object
    model_class: type
    config: object
    generation_config: object
    modules: dict
    extra: dict

    def units(self):
        """This rank's ``GatherUnit``s; a decoder layer gives one per norm and
        block, and one per TSP block inside a block (a folded MoE block's shared expert)."""
        units = []
        for prefix, module in self.modules.items():
            if isinstance(module, TSPDecoderLayer):
                parts = {**module.whole_modules(), **module.hf_blocks()}
                units += [gather_unit(hf_path(prefix, name, inner), block)
                          for name, part in parts.items() for inner, block in part.named_modules()
                          if not inner or isinstance(block, PackedShardMixin)]
                units.append(_whole_tensors(prefix, module.own_tensors()))
            else:
                units.append(gather_unit(prefix, module))
        if self.extra:
            units.append(GatherUnit({n: t.dtype for n, t in self.extra.items()}, lambda: self.extra))
        return [unit for unit in units if unit.dtypes]

    @property
    def folds_experts(self):
        """Whether this rank's experts are folded over data-parallel replicas, which then gather them together."""
        return any(isinstance(block, TSPSparseMoE) and block.folded for m in self.modules.values()
                   for block in m.modules())

    @property
    def partitioned(self):
        """Whether ZeRO-3 partitions this rank's parameters over its data-parallel group."""
        return any(hasattr(p, "ds_id") for m in self.modules.values() for p in m.parameters())

    @property
    def device(self):
        return next((p.device for m in self.modules.values() for p in m.parameters()), torch.device("cpu"))


def saved_stage(model):
    """The ``SavedStage`` of an injected model, a DeepSpeed engine around one, a
    ``PipelineEngine`` or the ``PipelineModule`` of ``ds_tsp.injection.pipeline``."""
    module = model.module if not isinstance(model, TSPCausalLMMixin) and hasattr(model, "module") else model
    if isinstance(module, TSPCausalLMMixin):
        policy = module.tsp_policy
        modules = {policy.embed_tokens: module.get_submodule(policy.embed_tokens)}
        inputs = policy.model_inputs(module)
        if inputs is not None:  # the per-layer embedding, folded by vocabulary as the main one
            modules[inputs.embed] = module.get_submodule(inputs.embed)
        modules.update({f"{policy.layers}.{i}": layer for i, layer in enumerate(module.get_submodule(policy.layers))})
        modules.update({name: module.get_submodule(name) for name in (policy.final_norm, policy.lm_head)})
        modules.update({name: unit for name, unit in module.named_modules() if isinstance(unit, ShardedUnit)})
        inside = tuple(f"{name}." for name in (*modules, policy.layers))
        extra = {name: t for name, t in module.state_dict().items() if not name.startswith(inside)}
        stage = SavedStage(module.tsp_topology, policy, hf_class(module), module.config,
                           getattr(module, "generation_config", None), modules, extra)
    elif hasattr(module, "tsp_model_class"):
        # Imported here: the pipeline needs DeepSpeed, which loading and
        # non-pipeline saving do not.
        from ds_tsp.injection.pipeline import stage_modules
        stage = SavedStage(module.tsp_topology, module.tsp_policy, hf_class(module.tsp_model_class),
                           module.tsp_model_config, module.tsp_generation_config, stage_modules(module), {})
    else:
        raise TypeError(f"ds_tsp.save_pretrained takes a TSP model (ds_tsp.inject, ds_tsp.from_pretrained), the engine "
                        f"of ds_tsp.initialize or its module, not a {type(model).__name__}")
    return stage


# -------------------------------------------------------------------- writing

def check_max_shard_size(max_shard_size):
    """Refuse a ``max_shard_size`` that Hugging Face would not take: an int of
    bytes >= 1 or a string such as "5GB" or "500MB" (units KB, MB, GB, TB)."""
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, (int, str)) or (
            isinstance(max_shard_size, int) and max_shard_size < 1):
        ok = False
    else:
        try:
            split_torch_state_dict_into_shards({}, max_shard_size=max_shard_size)
            ok = True
        except ValueError:
            ok = False
    if not ok:
        raise CheckpointError(f"max_shard_size = {max_shard_size!r} is not a size: give bytes as an int >= 1 or a "
                              f"string such as \"{DEFAULT_MAX_SHARD_SIZE}\" or \"500MB\" (units KB, MB, GB, TB)")


def split_into_files(shapes, dtypes, max_shard_size, layout=None):
    """Hugging Face's split of the model's tensors (``{name: shape}`` in the
    order to write, ``{name: dtype}``), written under the file names of
    ``layout`` (``expert_files.to_files``), into files of at most
    ``max_shard_size`` bytes (a larger tensor gets a file of its own), from sizes alone.

    transformers writes one layer's experts of one projection from one storage,
    which the split keeps in one file and sizes as a whole; so do we.
    """
    files = to_files(layout, {name: torch.empty(shape, dtype=dtypes[name], device="meta")
                              for name, shape in shapes.items()})
    blocks = {}
    for file_name, tensor in files.items():
        expert = layout.expert_of(file_name) if layout is not None else None
        blocks.setdefault(file_name if expert is None else (expert[0], expert[2]), []).append(tensor)
    storage = {id(tensor): (key, sum(t.nbytes for t in tensors)) for key, tensors in blocks.items()
               for tensor in tensors}
    return split_state_dict_into_shards_factory(files, filename_pattern=_FILENAME_PATTERN,
                                                max_shard_size=max_shard_size,
                                                get_storage_id=lambda tensor: storage[id(tensor)][0],
                                                get_storage_size=lambda tensor: storage[id(tensor)][1])


class ShardWriter:
    """Writes the files of a ``split`` (``split_into_files`` with the same
    ``layout``) as the model's tensors arrive in any order: each file as soon
    as its last tensor is in, then ``model.safetensors.index.json`` when there
    is more than one, as Hugging Face's ``save_pretrained`` writes them.
    With a ``SharedSave`` its write errors are held for the save's agreement
    and the tensors that arrive after one are dropped."""

    def __init__(self, out_dir, split, total_parameters, layout=None, save=None):
        self.out_dir, self.split, self.total_parameters, self.layout = out_dir, split, total_parameters, layout
        self.save = save
        self.missing = {file: set(names) for file, names in split.filename_to_tensors.items()}
        self.pending = {}

    def add(self, name, tensor):
        """The model's tensor ``name``, under its file names."""
        if self.failed:
            return
        for file_name, part in to_files(self.layout, {name: tensor}).items():
            file = self.split.tensor_to_filename[file_name]
            self.pending.setdefault(file, {})[file_name] = part.detach().to("cpu").contiguous()
            self.missing[file].discard(file_name)
            if not self.missing[file]:
                path = os.path.join(self.out_dir, file)
                self._write(path, save_file, self.pending.pop(file), path, metadata={"format": "pt"})

    @property
    def failed(self):
        return self.save is not None and self.save.failed

    def _write(self, path, fn, *args, **kwargs):
        return fn(*args, **kwargs) if self.save is None else self.save.write(path, fn, *args, **kwargs)

    def close(self):
        if not self.failed:
            self._write(self.out_dir, self._close)

    def _close(self):
        unwritten = sorted(name for names in self.missing.values() for name in names)
        if unwritten:
            raise RuntimeError(f"ds_tsp.save_pretrained never received {unwritten[:5]}")
        if self.split.is_sharded:
            index = {"metadata": {"total_parameters": self.total_parameters, **self.split.metadata},
                     "weight_map": self.split.tensor_to_filename}
            with open(os.path.join(self.out_dir, SAFE_WEIGHTS_INDEX), "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _out_dir_refusal(out_dir, overwrite):
    """Why ``out_dir`` cannot take a checkpoint (a message naming the fix), or None."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        return f"save_pretrained: {out_dir} exists and is not a directory: choose another out_dir"
    found = checkpoint_files(out_dir)
    if found and not overwrite:
        return (f"save_pretrained: {out_dir} already holds a checkpoint ({', '.join(found)}): pass overwrite=True "
                "to replace it (its weights, index and TSP shard files are removed first), or choose another out_dir")
    return None


def replaced_by_a_checkpoint(name):
    """Whether a new checkpoint replaces the entry ``name`` of its directory: every
    weights, index and TSP shard file, so that it is the only checkpoint there,
    and the configs it writes. The rest (a tokenizer, training arguments) stays."""
    return is_checkpoint_file(name) or name in (CONFIG_NAME, GENERATION_CONFIG_NAME)


def write_config(out_dir, config, model_class, dtype, generation_config=None):
    """``config.json`` (naming ``model_class`` and ``dtype``) and
    ``generation_config.json``, as Hugging Face's ``save_pretrained`` writes them."""
    config = copy.deepcopy(config)
    config.architectures = [model_class.__name__]
    config.dtype = dtype
    config.save_pretrained(out_dir)
    if generation_config is not None:
        generation_config.save_pretrained(out_dir)


def write_state_dict(out_dir, state, config, generation_config=None, max_shard_size=DEFAULT_MAX_SHARD_SIZE,
                     model_class=None):
    """Write a full Hugging Face ``state`` held in memory (tied copies left out)
    as ``config.json`` plus weights files cut by ``max_shard_size``, in the order
    of the model's own state dict, under the names transformers writes."""
    check_max_shard_size(max_shard_size)
    meta, _ = meta_model(config, model_class=model_class)
    order = [name for name in meta.state_dict() if name in state]
    state = {name: state[name] for name in order + sorted(set(state) - set(order))}
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    write_config(out_dir, config, model_class or type(meta), dtype, generation_config)
    layout = expert_files(config)
    split = split_into_files({n: t.shape for n, t in state.items()}, {n: t.dtype for n, t in state.items()},
                             max_shard_size, layout)
    writer = ShardWriter(out_dir, split, meta.num_parameters(), layout)
    for name, tensor in state.items():
        writer.add(name, tensor)
    writer.close()


def _write_plan(stage, units, out_dir, overwrite):
    """The same plan on every rank: ``[(pp_rank, names)]`` per unit in Hugging
    Face's order, every name's shape and dtype, and the model's meta twin.
    One object all-gather carries each stage's unit names and dtypes (from its
    TSP rank 0 of data-parallel replica 0) and global rank 0's verdict on
    ``out_dir``, so that every rank raises the same error or none."""
    topology = stage.topology
    listing = None
    if topology.dp_rank == 0 and topology.tsp_rank == 0:
        listing = [{name: str(dtype).removeprefix("torch.") for name, dtype in unit.dtypes.items()} for unit in units]
    refusal = _out_dir_refusal(out_dir, overwrite) if topology.rank == 0 else None
    gathered = comm.all_gather_objects((topology.pp_rank, listing, refusal), None)
    if gathered[0][2] is not None:
        raise CheckpointError(gathered[0][2])

    meta, _ = meta_model(stage.config, model_class=stage.model_class)
    shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items()}
    order = {name: i for i, name in enumerate(shapes)}
    tied = tied_names(meta)
    plan, dtypes = [], {}
    for pp_rank, stage_units, _ in gathered:
        for unit in stage_units or []:
            unknown = sorted(set(unit) - set(order))
            if unknown:
                raise CheckpointError(f"the TSP model holds {unknown[:5]}, which {stage.model_class.__name__} built "
                                      "from its config does not have: was the config changed after injection?")
            names = sorted((name for name in unit if name not in tied), key=order.get)
            if names:
                plan.append((pp_rank, names))
                dtypes.update({name: getattr(torch, unit[name]) for name in names})
    missing = [name for name in shapes if name not in dtypes and name not in tied]
    if missing:
        raise CheckpointError(f"the TSP model holds none of {missing[:5]}, which {stage.model_class.__name__} "
                              "has: was the model changed after injection?")
    plan.sort(key=lambda entry: order[entry[1][0]])
    return plan, {name: shape for name, shape in shapes.items() if name in dtypes}, dtypes, meta


def save_pretrained(model, out_dir, max_shard_size=DEFAULT_MAX_SHARD_SIZE, overwrite=False):
    """Write a TSP model as a plain Hugging Face checkpoint in ``out_dir``:
    ``config.json``, ``generation_config.json`` and ``model.safetensors``, or
    files of at most ``max_shard_size`` (int bytes, or "5GB", "500MB", ...)
    with ``model.safetensors.index.json``, the names and shapes transformers'
    ``save_pretrained`` writes for the original model (sparse-MoE experts one
    tensor per expert), which ``AutoModelForCausalLM.from_pretrained`` loads.

    ``model`` is an injected model (``ds_tsp.inject``, ``ds_tsp.from_pretrained``),
    the engine of ``ds_tsp.initialize`` or its ``module``; with
    ``tsp.pipeline_stages > 1`` (a ``PipelineEngine``) every stage's layers, the
    final norm and the head are written. An ``out_dir`` that already holds a
    checkpoint is refused unless ``overwrite``: its weights, index and TSP shard
    files are then replaced, its other files kept.

    Collective: every rank calls it. The ranks of data-parallel replica 0
    gather, unit by unit (under ZeRO-3 every replica joins each unit's
    data-parallel gather first; experts folded over replicas,
    ``tsp.expert_parallel_size``, are gathered over their expert-parallel
    group, every replica joining), and global rank 0 writes, beside ``out_dir``,
    which the files become once all are written (``staging``; see the module
    docstring); no rank returns before they are in place. A write that fails
    (a full disk, a permission) raises ``staging.SaveError`` on every rank once
    the gathers are done, naming the file and the cause, and ``out_dir`` stays
    as it was.

    A model with LoRA adapters (``ds_tsp.inject`` of a ``PeftModel``) writes
    PEFT's adapter directory instead, as ``PeftModel.save_pretrained`` does
    (``ds_tsp.checkpoint.adapters``): load it with ``PeftModel.from_pretrained``
    over the base model, and ``merge_and_unload()`` there for a merged model.
    """
    out_dir = os.fspath(out_dir)
    check_max_shard_size(max_shard_size)
    module = model.module if not isinstance(model, TSPCausalLMMixin) and hasattr(model, "module") else model
    if getattr(module, "tsp_peft_config", None) is not None:
        return save_adapters(module, out_dir, overwrite)
    stage = saved_stage(model)
    topology = stage.topology
    # Replica 0 gathers over TSP; under ZeRO-3 every replica joins the data-parallel gathers first, and
    # experts folded over replicas are gathered over their expert-parallel group.
    gathering = topology.dp_rank == 0 or stage.partitioned or stage.folds_experts
    units = stage.units() if gathering else []
    plan, shapes, dtypes, meta = _write_plan(stage, units, out_dir, overwrite)

    # Written beside out_dir, which it becomes once every file is complete and every rank agrees.
    save = SharedSave(f"ds_tsp.save_pretrained to {os.path.abspath(out_dir)}")
    with staged_together(out_dir, save, topology.rank == 0, replaced=replaced_by_a_checkpoint) as staging:
        writer = None
        if staging is not None:
            # Hugging Face's model.dtype: the first floating tensor's.
            first_float = next((dtypes[n] for n in shapes if dtypes[n].is_floating_point), torch.float32)
            save.write(staging, write_config, staging, stage.config, stage.model_class, first_float,
                       stage.generation_config)
            layout = expert_files(stage.config)
            writer = ShardWriter(staging, split_into_files(shapes, dtypes, max_shard_size, layout),
                                 meta.num_parameters(), layout, save)
        if gathering:
            _gather_and_write(stage, units, plan, shapes, dtypes, writer)


def _gather_and_write(stage, units, plan, shapes, dtypes, writer):
    """Every unit of ``plan`` gathered in turn, on the ranks that gather, and
    written by global rank 0's ``writer``."""
    topology = stage.topology
    position = {name: i for i, name in enumerate(shapes)}
    local = {min((n for n in unit.dtypes if n in position), key=position.get): unit for unit in units
             if any(n in position for n in unit.dtypes)}
    with torch.no_grad():
        for pp_rank, names in tqdm(plan, desc="Writing Hugging Face checkpoint", unit="unit",
                                   disable=topology.rank != 0):
            full = local[names[0]].gather() if pp_rank == topology.pp_rank else {}
            for name in names:
                tensor = full.get(name)
                if pp_rank != 0 and topology.tsp_rank == 0 and topology.dp_rank == 0:
                    # From the stage that holds it to global rank 0 (stage 0 of this pipeline
                    # group); comm has no point-to-point send, so TSP rank 0 of the other
                    # stages receive and drop a copy.
                    if tensor is None:
                        tensor = torch.empty(shapes[name], dtype=dtypes[name], device=stage.device)
                    tensor = tensor.contiguous()
                    comm.broadcast(tensor, src=pp_rank, group=topology.pp_group)
                if writer is not None:
                    writer.add(name, tensor)
    if writer is not None:
        writer.close()


# ---------------------------------------------------------------- conversion

def check_out_dir(in_dir, out_dir, force):
    """Refuse to write over ``in_dir`` or, without ``force``, into a non-empty ``out_dir``."""
    if os.path.exists(out_dir) and os.path.samefile(in_dir, out_dir):
        raise CheckpointError(f"--out {out_dir} is the input directory: choose another output directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not force:
        raise CheckpointError(f"output directory {out_dir} exists and is not empty: pass --force to "
                              "overwrite it, or choose another --out")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"output {out_dir} exists and is not a directory")


def copy_other_files(in_dir, out_dir):
    """The files of ``in_dir`` that are not weights (config, tokenizer, ...) into ``out_dir``."""
    weights = set(checkpoint_files(in_dir))
    for name in sorted(os.listdir(in_dir)):
        source = os.path.join(in_dir, name)
        if os.path.isfile(source) and name not in weights:
            shutil.copyfile(source, os.path.join(out_dir, name))


def shard_checkpoint(in_dir, out_dir, tsp_size, policy="auto", force=False, vocab_parallel=True):
    """Pre-shard the Hugging Face checkpoint ``in_dir`` for a TSP group of
    ``tsp_size``, in one process: ``out_dir`` gets ``rank{r}-of-{D}.safetensors``
    per rank (that rank's piece of every sharded tensor and every replicated
    tensor whole, all under the model's names: a sparse-MoE block's experts
    fused, whichever layout ``in_dir`` holds them in), ``tsp_shards.json`` (full
    shapes and every rank's pieces) and the other files of ``in_dir``. With
    ``vocab_parallel`` (as ``tsp.vocab_parallel``) the embedding and LM head
    are sharded by rows too.

    The model is checked (policy, sizes, tensor names and shapes) before
    anything is written.
    """
    in_dir, out_dir = os.fspath(in_dir), os.fspath(out_dir)
    if os.path.isfile(os.path.join(in_dir, TSP_SHARDS)):
        raise CheckpointError(f"{in_dir} is already pre-sharded: use --join to turn it back into a "
                              "Hugging Face checkpoint")
    model, _ = meta_model(in_dir)
    plans = shard_plan(model, resolve_policy(model, policy), tsp_size, vocab_parallel)
    source = hf_checkpoint(in_dir, model=model)
    check_tensors_present(model, source)
    check_out_dir(in_dir, out_dir, force)
    with staged(out_dir, replaced=replaced_by_a_checkpoint) as staging:
        copy_other_files(in_dir, staging)
        _write_shards(source, plans, tsp_size, staging)


def _write_shards(source, plans, tsp_size, out_dir):
    """Every rank's file of ``shard_checkpoint``, then ``tsp_shards.json``."""
    # Tensors outside the plan (norms; embeddings and LM head if not folded) go whole into every file.
    in_blocks = set().union(*plans)
    replicated = dict.fromkeys(name for name in source.names if name not in in_blocks)
    ranks, tensors = [], {}
    with tqdm(total=sum(len(plan) + len(replicated) for plan in plans), desc=f"Sharding for tsp.size {tsp_size}",
              unit="tensor") as bar:
        for tsp_rank, plan in enumerate(plans):
            pieces = {**{name: plan[name] for name in source.names if name in plan}, **replicated}
            held = {}
            for name, piece in pieces.items():
                # A fused tensor's row pieces (ds_tsp.blocks.fused) are stored concatenated, in row order.
                held[name] = torch.cat([source.read(name, part) for part in row_pieces(piece)]).contiguous()
                tensors[name] = {"shape": list(source.shapes[name]),
                                 "dtype": str(held[name].dtype).removeprefix("torch.")}
                bar.update()
            file = rank_file(tsp_rank, tsp_size)
            save_file(held, os.path.join(out_dir, file), metadata={"format": "pt"})
            ranks.append({"file": file, "pieces": {name: _json_piece(p) for name, p in pieces.items()}})
    description = {"format": TSP_SHARDS_FORMAT, "version": 1, "tsp_size": tsp_size,
                   "tensors": {name: tensors[name] for name in source.names}, "ranks": ranks}
    with open(os.path.join(out_dir, TSP_SHARDS), "w") as f:
        json.dump(description, f, indent=1)


def _json_piece(piece):
    """A holding in ``tsp_shards.json``: null, ``[dim, start, length]`` or a list of them (``row_pieces``)."""
    if piece is None:
        return None
    return [list(part) for part in piece] if isinstance(piece[0], tuple) else list(piece)


def join_checkpoint(in_dir, out_dir, tsp_size=None, force=False):
    """Turn a directory written by ``shard_checkpoint`` (for ``tsp_size``, if
    given) back into a Hugging Face checkpoint (``model.safetensors`` plus the
    other files), tensor for tensor, under the names transformers writes."""
    in_dir, out_dir = os.fspath(in_dir), os.fspath(out_dir)
    if not os.path.isfile(os.path.join(in_dir, TSP_SHARDS)):
        raise CheckpointError(f"{in_dir} has no {TSP_SHARDS}: it is not the output of ds-tsp convert")
    shards = TSPShardCheckpoint(in_dir)
    if tsp_size is not None and tsp_size != shards.tsp_size:
        raise CheckpointError(f"{in_dir} holds shards for tsp.size {shards.tsp_size}, not {tsp_size}: "
                              "drop --tsp-size to join it")
    check_out_dir(in_dir, out_dir, force)
    state = {}
    for name in tqdm(shards.names, desc=f"Joining {shards.tsp_size} TSP shards", unit="tensor"):
        state[name] = join_holdings(name, [(held[name], shards.read_rank(name, r))
                                           for r, held in enumerate(shards.holdings) if name in held])
    state = to_files(expert_files(AutoConfig.from_pretrained(in_dir)), state)
    with staged(out_dir, replaced=replaced_by_a_checkpoint) as staging:
        copy_other_files(in_dir, staging)
        save_file(state, os.path.join(staging, SAFE_WEIGHTS), metadata={"format": "pt"})
