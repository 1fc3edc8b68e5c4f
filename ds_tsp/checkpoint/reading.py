"""Reading checkpoints: Hugging Face safetensors directories and ``ds-tsp convert`` shards.

``from_pretrained`` builds the Hugging Face model on the meta device, checks
everything that needs only sizes, then reads from disk only this rank's piece
of every TSP-sharded tensor (``safe_open(...).get_slice``: the blocks' and,
with ``tsp.vocab_parallel``, the embedding's and LM head's rows) plus the
replicated tensors, so a rank's peak memory is about ``1/D`` of the weights.

A directory holding several checkpoints is read the way Hugging Face reads it
(``model.safetensors``, then ``model.safetensors.index.json``; pickled
``pytorch_model.bin`` files, which ds_tsp does not read, come next), so both
load the same weights; ``tsp_shards.json`` is read only where no Hugging Face
weights are.

Sparse-MoE experts are read in either layout a checkpoint may hold them:
fused, as the model holds them, or one tensor per expert, as Hub checkpoints
and transformers' ``save_pretrained`` hold them (``expert_files``). Under the
per-expert layout a rank reads only its own experts' tensors and concatenates
them into its piece of the fused tensor.
"""

import json
import os

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming, rename_source_key

from ds_tsp.blocks.fused import row_pieces, split_rows
from ds_tsp.checkpoint.adapters import AdapterFiles
from ds_tsp.checkpoint.expert_files import expert_files
from ds_tsp.checkpoint.formats import (
    SAFE_WEIGHTS,
    SAFE_WEIGHTS_INDEX,
    TORCH_WEIGHTS,
    TORCH_WEIGHTS_INDEX,
    TSP_SHARDS,
    TSP_SHARDS_FORMAT,
    CheckpointError,
    hf_weights_file,
    open_safetensors,
)
from ds_tsp.checkpoint.shard_plan import ExpertPlacement, meta_model, narrow_index, shard_plan
from ds_tsp.injection.inject import inject
from ds_tsp.injection.policy import resolve_policy
from ds_tsp.parallel import comm

# ------------------------------------------------------------------- readers


class SafetensorsCheckpoint:
    """The tensors of a Hugging Face checkpoint directory: ``model.safetensors``
    or, when there is none, the files listed by ``model.safetensors.index.json``
    (Hugging Face's order).

    Only headers are read up front. Each ``read`` maps its file for that read
    alone, so the pages it touches leave this process's memory with the tensor
    it returns, instead of piling up in one long-lived mapping.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        chosen = hf_weights_file(self.path) if os.path.isdir(self.path) else None
        if chosen == SAFE_WEIGHTS:
            single = os.path.join(self.path, SAFE_WEIGHTS)
            with open_safetensors(single) as f:
                self.files = dict.fromkeys(f.keys(), single)
        elif chosen == SAFE_WEIGHTS_INDEX:
            with open(os.path.join(self.path, SAFE_WEIGHTS_INDEX)) as f:
                weight_map = json.load(f)["weight_map"]
            self.files = {name: os.path.join(self.path, file) for name, file in weight_map.items()}
        else:
            present = sorted(os.listdir(self.path)) if os.path.isdir(self.path) else "no such directory"
            raise CheckpointError(f"no {SAFE_WEIGHTS} or {SAFE_WEIGHTS_INDEX} in {self.path} (found: {present}); "
                                  "ds_tsp reads safetensors checkpoints: re-save the model with "
                                  "save_pretrained(safe_serialization=True)")
        self.shapes = {}
        for file in sorted(set(self.files.values())):
            with open_safetensors(file) as f:
                self.shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})

    @property
    def names(self):
        return list(self.files)

    def read(self, name, piece=None):
        """The tensor ``name`` narrowed to ``piece`` (whole when None), possibly a
        view of the (copy-on-write) memory-mapped file."""
        with open_safetensors(self.files[name]) as f:
            if piece is None:
                return f.get_tensor(name)
            return f.get_slice(name)[narrow_index(piece)]

    def read_whole(self, names):
        """``{name: tensor}`` of ``names``, each whole; one opening per file."""
        by_file = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        tensors = {}
        for file, file_names in by_file.items():
            with open_safetensors(file) as f:
                tensors.update({name: f.get_tensor(name) for name in file_names})
        return tensors


class ExpertFilesCheckpoint:
    """A Hugging Face checkpoint (``SafetensorsCheckpoint``) seen under the
    model's names: files in transformers' per-expert layout (``ExpertFiles``)
    read as the fused tensors the model holds, the block renamed where the
    layout renames it (Mixtral's ``block_sparse_moe``); fused files read as
    they are; a tensor the files hold in parts (``ExpertFiles.concatenations``)
    read as their concatenation.

    ``read`` of a fused tensor reads only the experts of its piece: a rank
    holding experts ``[a, b)`` reads their ``3 (b - a)`` tensors per MoE layer
    and no other expert's.
    """

    def __init__(self, files, layout):
        self.path, self.files, self.layout = files.path, files, layout
        self.sources = {}  # model name -> file name
        by_expert = {}  # fused model name -> {expert: {projection: file name}}
        by_part = {}  # concatenated model name -> {part index: file name}
        for file_name in files.names:
            found, part = layout.expert_of(file_name), layout.concatenation_of(file_name)
            if part is not None:
                by_part.setdefault(part[0], {})[part[1]] = file_name
            elif found is None:
                self.sources[layout.model_name(file_name)] = file_name
            else:
                name, expert, projection = found
                by_expert.setdefault(name, {}).setdefault(expert, {})[projection] = file_name
        self.experts = {name: self._expert_names(name, held) for name, held in by_expert.items()}
        both = sorted(set(self.sources) & set(self.experts))
        if both:
            raise CheckpointError(f"{self.path} holds {both[0]} both fused and per expert: keep one of the two")
        self.parts = {name: [held[index] for index in sorted(held)] for name, held in by_part.items()}
        self.shapes = {name: files.shapes[source] for name, source in self.sources.items()}
        for name, parts in self.parts.items():
            shapes = [files.shapes[file_name] for file_name in parts]
            self.shapes[name] = (sum(shape[0] for shape in shapes), *shapes[0][1:])
        for name, experts in self.experts.items():
            shapes = [files.shapes[file_name] for parts in experts for file_name in parts]
            if len(set(shapes)) != 1:
                raise CheckpointError(f"the per-expert tensors of {name} in {self.path} differ in shape: {shapes}")
            rows, columns = shapes[0]
            self.shapes[name] = (len(experts), rows * len(experts[0]), columns)

    def _expert_names(self, name, held):
        """Per expert, the file names of its projections in the fused order; every
        expert ``0..E-1`` with every projection, or ``CheckpointError`` naming a missing one."""
        projections = self.layout.projections_of(name)
        for expert in range(max(held) + 1):
            for projection in projections:
                if projection not in held.get(expert, {}):
                    raise CheckpointError(f"{self.path} holds experts of {name} one tensor per expert, but not "
                                          f"{self.layout.expert_file_name(name, expert, projection)}")
        return [[held[expert][projection] for projection in projections] for expert in range(len(held))]

    @property
    def names(self):
        return list(self.shapes)

    def read(self, name, piece=None):
        if name in self.parts:  # a concatenation of small tensors (a convolution's parts): read whole, then cut
            tensors = self.files.read_whole(self.parts[name])
            whole = torch.cat([tensors[file_name] for file_name in self.parts[name]])
            return whole if piece is None else whole.narrow(*piece)
        experts = self.experts.get(name)
        if experts is None:
            return self.files.read(self.sources[name], piece)
        dim, start, length = piece or (0, 0, len(experts))
        # A rank's piece is whole experts (dim 0); any other piece is cut from all of them.
        chosen = experts[start:start + length] if dim == 0 else experts
        tensors = self.files.read_whole([file_name for parts in chosen for file_name in parts])
        fused = torch.stack([torch.cat([tensors[file_name] for file_name in parts]) for parts in chosen])
        return fused if dim == 0 else fused.narrow(dim, start, length)


class RenamedCheckpoint:
    """A Hugging Face checkpoint (``SafetensorsCheckpoint``) under the model's
    names where its files name tensors otherwise: ``rename(file name)`` gives
    the model's name (a vision-language model's files keep their original
    layout, Qwen2-VL's ``visual.*`` and ``model.layers.*``)."""

    def __init__(self, files, rename):
        self.path, self.files = files.path, files
        self.sources = {rename(file_name): file_name for file_name in files.names}
        self.shapes = {name: files.shapes[source] for name, source in self.sources.items()}

    @property
    def names(self):
        return list(self.shapes)

    def read(self, name, piece=None):
        return self.files.read(self.sources[name], piece)


def hf_checkpoint(path, config=None, model=None):
    """The tensors of the Hugging Face checkpoint at ``path`` under the model's
    names: ``SafetensorsCheckpoint``, through ``ExpertFilesCheckpoint`` where
    ``config``'s architecture has a per-expert file layout (None: as the files
    name them), or through ``RenamedCheckpoint`` where ``model`` is a
    vision-language model, whose class's conversion mapping renames its files'
    tensors (transformers' own renaming, as its ``from_pretrained`` applies it)."""
    files = SafetensorsCheckpoint(path)
    config = model.config if model is not None else config
    if model is not None and config.get_text_config() is not config:
        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
        return RenamedCheckpoint(files, lambda name: rename_source_key(name, renamings, [])[0])
    layout = expert_files(config)
    return files if layout is None else ExpertFilesCheckpoint(files, layout)


class TSPShardCheckpoint:
    """A directory written by ``ds-tsp convert``: per TSP rank, one file holding
    that rank's pieces under Hugging Face names, and ``tsp_shards.json``::

        {"format": "ds_tsp.tsp_shards", "version": 1, "tsp_size": D,
         "tensors": {name: {"shape": [...], "dtype": "float32"}},
         "ranks": [{"file": "rank0-of-D.safetensors", "pieces": {name: [dim, start, length] or null}}, ...]}

    where a null piece is the whole tensor, a list of pieces the row pieces a
    rank holds of a fused tensor (``ds_tsp.blocks.fused``), concatenated in its file,
    and a name missing from a rank's ``pieces`` is not in its file.
    """

    def __init__(self, path, tsp_rank=0):
        self.path = os.fspath(path)
        with open(os.path.join(self.path, TSP_SHARDS)) as f:
            meta = json.load(f)
        if meta.get("format") != TSP_SHARDS_FORMAT:
            raise CheckpointError(f"{os.path.join(self.path, TSP_SHARDS)} is not a ds_tsp shard description")
        self.tsp_size, self.tsp_rank = meta["tsp_size"], tsp_rank
        self.shapes = {name: tuple(t["shape"]) for name, t in meta["tensors"].items()}
        self.files = [os.path.join(self.path, rank["file"]) for rank in meta["ranks"]]
        self.holdings = [{name: _holding(piece) for name, piece in rank["pieces"].items()} for rank in meta["ranks"]]

    @property
    def names(self):
        return list(self.shapes)

    def read_rank(self, name, tsp_rank):
        """What rank ``tsp_rank``'s file holds under ``name`` (its piece, or the whole tensor)."""
        with open_safetensors(self.files[tsp_rank]) as f:
            return f.get_tensor(name)

    def read(self, name, piece=None):
        held = self.holdings[self.tsp_rank]
        wanted = None if piece is None else tuple(piece)
        if name not in held or wanted not in row_pieces(held[name]):
            raise CheckpointError(f"{self.path} holds {held.get(name, 'nothing')} of {name} for TSP rank "
                                  f"{self.tsp_rank}, but the model asks for {piece}: re-run ds-tsp convert (with "
                                  "--no-vocab-parallel if tsp.vocab_parallel is false) "
                                  "for this model and tsp.size")
        return dict(split_rows(held[name], self.read_rank(name, self.tsp_rank)))[wanted]


def _holding(piece):
    """A holding of ``tsp_shards.json`` as ``shard_plan`` gives it: None, a piece or a tuple of pieces."""
    if piece is None:
        return None
    return tuple(tuple(part) for part in piece) if isinstance(piece[0], list) else tuple(piece)


def open_checkpoint(path, tsp_size=1, tsp_rank=0, config=None, model=None):
    """The reader for ``path``: the Hugging Face weights that Hugging Face itself
    would load (``hf_checkpoint``: under the names of ``model``, or of a model
    with ``config``), else the pre-sharded files of ``tsp_shards.json``."""
    path = os.fspath(path)
    chosen = hf_weights_file(path) if os.path.isdir(path) else None
    if chosen is None and os.path.isfile(os.path.join(path, TSP_SHARDS)):
        checkpoint = TSPShardCheckpoint(path, tsp_rank)
        if checkpoint.tsp_size != tsp_size:
            raise CheckpointError(f"{path} is pre-sharded for tsp.size = {checkpoint.tsp_size}, not {tsp_size}: "
                                  f"run `ds-tsp convert --join` on it, or convert the original with "
                                  f"--tsp-size {tsp_size}")
        return checkpoint
    if chosen in (TORCH_WEIGHTS, TORCH_WEIGHTS_INDEX):
        raise CheckpointError(f"{path} holds {chosen}, which Hugging Face loads before any other file there, but "
                              "ds_tsp reads safetensors only: re-save the model with save_pretrained (which writes "
                              f"safetensors) and remove {chosen}")
    return hf_checkpoint(path, config, model)


def check_tensors_present(model, checkpoint):
    """Every tensor of ``model``'s state dict is in ``checkpoint`` with its shape,
    except tied copies (``lm_head.weight`` under ``tie_word_embeddings``)."""
    tied = getattr(model, "all_tied_weights_keys", {}) or {}
    for name, tensor in model.state_dict().items():
        if name not in checkpoint.shapes:
            if name in tied and tied[name] in checkpoint.shapes:
                continue
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint at {checkpoint.path}")
        if checkpoint.shapes[name] != tuple(tensor.shape):
            raise CheckpointError(f"tensor {name!r} in {checkpoint.path} has shape {checkpoint.shapes[name]}, but "
                                  f"the model built from its config.json needs {tuple(tensor.shape)}")


# ------------------------------------------------------------------- loading

def _owner(model, full_name):
    module_name, _, attr = full_name.rpartition(".")
    return model.get_submodule(module_name), attr


def _within(name, prefix):
    """Whether the module ``name`` is the module ``prefix`` or lies inside it."""
    return not prefix or name == prefix or name.startswith(f"{prefix}.")


def _materialise_replicated(model, checkpoint, skip_prefixes, dtype, device, progress):
    """Read every parameter and persistent buffer outside the TSP blocks whole
    from ``checkpoint`` (tied parameters once, under whichever of their names the
    file has) and fill non-persistent buffers the way Hugging Face does after a
    meta-device load: the ``_init_weights`` of the model that holds their module."""
    groups = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not name.startswith(skip_prefixes):
            groups.setdefault(id(param), (param, []))[1].append(name)
    for param, names in groups.values():
        source = next((n for n in names if n in checkpoint.shapes), names[0])
        # A copy of its own, not a view of the mapped file: saving over that file
        # later must not pull the pages from under a live parameter.
        value = checkpoint.read(source).to(device=device, dtype=param.dtype, copy=True)
        progress.update()
        new = torch.nn.Parameter(value, requires_grad=param.requires_grad)
        for name in names:
            module, attr = _owner(model, name)
            setattr(module, attr, new)

    state_names = set(model.state_dict())
    for name, buffer in list(model.named_buffers()):
        # Non-persistent buffers are in no file: made here for the TSP blocks too (a scaled embedding's constant).
        if not buffer.is_meta or (name.startswith(skip_prefixes) and name in state_names):
            continue
        module, attr = _owner(model, name)
        if name in state_names:
            value = checkpoint.read(name).to(device=device, dtype=buffer.dtype, copy=True)
            value._is_hf_initialized = True  # read: no initialiser below may overwrite it
            progress.update()
        else:
            value = torch.empty_like(buffer, device=device)
        module._buffers[attr] = value
    # Each by the Hugging Face model it belongs to, as Hugging Face initialises a model nested in another
    # (a VLM's SigLIP tower fills its own position ids), its read parameters marked as Hugging Face marks
    # loaded ones, so that its initialisers leave them be (SigLIP's would draw new position embeddings).
    # The Hugging Face models above them too, children first as Hugging Face goes: a model may fill its
    # layers' buffers itself (Falcon-H1's decoder, its mixers' mup_vector).
    owners = {name: module for name, module in model.named_modules() if isinstance(module, PreTrainedModel)}
    holders = {name for name, module in model.named_modules()
               if any(attr in module._non_persistent_buffers_set for attr in module._buffers)}
    above = {owner for name in holders for owner in owners if _within(name, owner) and owner != name}
    for name, module in reversed(list(model.named_modules())):
        if name in holders or name in above:
            owner = max((prefix for prefix in owners if _within(name, prefix)), key=len)
            for param in module.parameters():
                param._is_hf_initialized = True
            owners[owner]._init_weights(module)


def _check_materialised(model):
    on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if on_meta:
        raise RuntimeError(f"ds_tsp.from_pretrained left tensors on the meta device: {on_meta}")


def from_pretrained(path, topology, tsp_config, torch_dtype=None, device=None, adapter=None):
    """A TSP model straight from a Hugging Face checkpoint directory, reading only
    this rank's shards of the decoder blocks.

    ``path`` holds ``config.json`` and ``model.safetensors`` (or a sharded
    safetensors index), or is the output of ``ds-tsp convert`` for
    ``topology.tsp_size``. ``torch_dtype`` None or "auto" keeps the checkpoint's
    dtype. Steps, in this order:

    1. build the model on the meta device and check the policy and every
       size-only constraint (heads, intermediate size, a foldable vocabulary,
       tensor names and shapes);
    2. read the replicated tensors whole (norms; embeddings and LM head unless
       ``tsp.vocab_parallel``) and
       recompute non-persistent buffers such as the rotary ``inv_freq``;
    3. ``inject`` with a reader that loads only this rank's piece of each
       sharded tensor from disk;
    4. check nothing is left on the meta device.

    ``adapter``: a PEFT adapter directory of LoRA adapters on this model
    (``PeftModel.save_pretrained``, ``ds_tsp.save_pretrained`` of a LoRA
    model), read onto the TSP blocks, each rank reading only its slices;
    the base is then frozen, as a ``PeftModel``'s.

    ``device`` None: the TSP group's communication device (``comm.group_device``:
    the accelerator's current device under NCCL, the CPU under gloo). On
    ``"meta"`` nothing is read into the model, which stays a skeleton.
    """
    path = os.fspath(path)
    device = torch.device(device) if device is not None else comm.group_device(topology.tsp_group)
    adapter_files = None
    if adapter is not None:
        adapter_files = AdapterFiles(os.fspath(adapter))
    model, dtype = meta_model(path, torch_dtype)
    policy = resolve_policy(model, tsp_config.policy)
    experts = ExpertPlacement(topology.ep_size, topology.ep_rank - topology.tsp_rank) if topology.folds_experts else None
    plan = shard_plan(model, policy, topology.tsp_size, tsp_config.vocab_parallel, experts)[topology.tsp_rank]
    checkpoint = open_checkpoint(path, topology.tsp_size, topology.tsp_rank, model=model)
    if experts is not None and isinstance(checkpoint, TSPShardCheckpoint):
        raise CheckpointError(f"{path} holds ds-tsp convert's shards, whose experts are cut over the TSP group, but "
                              f"tsp.expert_parallel_size = {topology.ep_size} folds them over replicas too: load "
                              "the Hugging Face checkpoint (ds-tsp convert --join turns the shards back into one)")
    check_tensors_present(model, checkpoint)

    blocks = tuple(f"{policy.layers}.{i}.{part}." for i, layer in enumerate(model.get_submodule(policy.layers))
                   for part in policy.block_prefixes(layer))
    if tsp_config.vocab_parallel:
        blocks += (f"{policy.embed_tokens}.", f"{policy.lm_head}.")
        if policy.model_inputs(model) is not None:
            blocks += (f"{policy.model_inputs(model).embed}.",)
    replicated = {id(p) for n, p in model.named_parameters() if not n.startswith(blocks)}
    state_names = set(model.state_dict())  # persistent buffers (Gemma 4's layer_scalar) are read whole too
    persistent = {n for n, _ in model.named_buffers() if n in state_names and not n.startswith(blocks)}
    progress = tqdm(total=len(plan) + len(replicated) + len(persistent), desc=f"Loading {os.path.basename(path)}",
                    unit="tensor", disable=topology.rank != 0)
    _materialise_replicated(model, checkpoint, blocks, dtype, device, progress)

    def read(full_name, piece):
        if full_name not in plan or piece not in row_pieces(plan[full_name]):
            raise RuntimeError(f"the TSP block asks for piece {piece} of {full_name}, but ds_tsp.checkpoint "
                               f"planned {plan.get(full_name, 'nothing')}: shard_plan and the block disagree")
        progress.update()
        return checkpoint.read(full_name, piece).to(dtype)

    inject(model, topology, tsp_config, read=read, device=device, adapter_files=adapter_files)
    progress.close()
    if device.type != "meta":
        _check_materialised(model)
    return model.eval()
