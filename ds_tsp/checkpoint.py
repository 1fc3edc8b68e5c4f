"""Checkpoints: Hugging Face safetensors in, TSP shards out of them, and back.

``from_pretrained`` builds the Hugging Face model on the meta device, checks
everything that needs only sizes, then reads from disk only this rank's piece
of every TSP-sharded tensor (``safe_open(...).get_slice``: the blocks' and,
with ``tsp.vocab_parallel``, the embedding's and LM head's rows) plus the
replicated tensors, so a rank's peak memory is about ``1/D`` of the weights.
``save_pretrained`` gathers the shards over the TSP group and writes a plain
Hugging Face checkpoint that ``AutoModelForCausalLM.from_pretrained`` loads.

Which piece of which tensor a rank holds is computed here for any rank
(``shard_plan``), so that one process can pre-shard a checkpoint
(``ds-tsp convert``) and a rank can reassemble every other rank's pieces. The
blocks' own ``shard_piece`` stays the authority: the loader and the gatherer
check it against the plan for their own rank.
"""

import copy
import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

from . import attention, comm, mlp, vocab
from .attention import HeadGroups, TSPAttention
from .inject import inject
from .mlp import TSPGatedMLP
from .model import TSPCausalLMMixin
from .policy import resolve_policy

SAFE_WEIGHTS = "model.safetensors"
SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
TSP_SHARDS = "tsp_shards.json"
TSP_SHARDS_FORMAT = "ds_tsp.tsp_shards"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model or the request; the message names the file and the fix."""


def rank_file(tsp_rank, tsp_size):
    return f"rank{tsp_rank}-of-{tsp_size}.safetensors"


# ---------------------------------------------------------------- shard plan
#
# A rank's holdings in one block are ``{name: piece}``: every tensor of its
# packed shard (its spec) with the piece of the full tensor it is, plus the
# block's replicated tensors (piece None: whole). With nkv < D only the first
# rank of each key/value replica set stores those heads, so shards differ.

def _holdings(specs, piece, replicated):
    """Per rank, ``{name: piece}`` of its packed tensors, then its replicated ones."""
    return [{**{name: piece(name, r) for name in spec.shapes}, **dict.fromkeys(replicated)}
            for r, spec in enumerate(specs)]


def layer_shards(layer, config, policy, tsp_size):
    """``{block name: (specs, holdings)}`` of one Hugging Face decoder layer
    (meta device is enough): every rank's ``PackSpec`` of the block's packed
    shard and its ``{name: piece}`` holdings (see ``_holdings``).

    Built with the functions the TSP modules use, so it raises their head and
    intermediate-size divisibility errors before any tensor is read.
    """
    attn = layer.get_submodule(policy.attention)
    heads = HeadGroups(config.num_attention_heads, config.num_key_value_heads, attn.head_dim, tsp_size)
    attn_specs = [attention.shard_spec(heads, config.hidden_size, attn.q_proj.bias is not None, r)
                  for r in range(tsp_size)]
    gated = layer.get_submodule(policy.mlp)
    intermediate_size = gated.gate_proj.out_features
    mlp_specs = [mlp.shard_spec(gated.gate_proj.in_features, intermediate_size, tsp_size,
                                gated.gate_proj.bias is not None)] * tsp_size
    return {
        policy.attention: (attn_specs, _holdings(attn_specs, lambda name, r: attention.shard_piece(heads, name, r),
                                                 attention.replicated_names(attn))),
        policy.mlp: (mlp_specs, _holdings(mlp_specs,
                                          lambda name, r: mlp.shard_piece(intermediate_size, tsp_size, name, r),
                                          [mlp.DOWN_BIAS] if gated.down_proj.bias is not None else [])),
    }


def vocab_names(model, policy):
    """Hugging Face names of the vocabulary matrices: the embedding's, and the
    LM head's unless it is tied to the embedding."""
    embed, lm_head = model.get_submodule(policy.embed_tokens), model.get_submodule(policy.lm_head)
    names = [f"{policy.embed_tokens}.weight"]
    if lm_head.weight is not embed.weight:
        names.append(f"{policy.lm_head}.weight")
    return names


def shard_plan(model, policy, tsp_size, vocab_parallel=True):
    """``plans[r][full_name] = piece`` for every tensor of every TSP block of the
    Hugging Face ``model`` (meta device is enough) that TSP rank ``r`` holds,
    and, with ``vocab_parallel``, its rows of the embedding and LM head (after
    checking that they can be folded)."""
    plans = [{} for _ in range(tsp_size)]
    if vocab_parallel:
        vocab.check_foldable(model.get_submodule(policy.embed_tokens), model.get_submodule(policy.lm_head),
                             type(model).__name__)
        for tsp_rank, plan in enumerate(plans):
            plan.update(dict.fromkeys(vocab_names(model, policy),
                                      vocab.shard_piece(model.config.vocab_size, tsp_size, tsp_rank)))
    for index, layer in enumerate(model.get_submodule(policy.layers)):
        prefix = f"{policy.layers}.{index}"
        for block_name, (_, holdings) in layer_shards(layer, model.config, policy, tsp_size).items():
            for plan, held in zip(plans, holdings):
                plan.update({f"{prefix}.{block_name}.{name}": piece for name, piece in held.items()})
    return plans


def block_specs(block):
    """The ``PackSpec`` of every rank's shard of an injected TSP block."""
    if isinstance(block, TSPAttention):
        return list(block.specs)
    if isinstance(block, TSPGatedMLP):
        return [block.spec] * comm.group_size(block.tsp_group)
    raise TypeError(f"{type(block).__name__} is not a TSP block")


def block_holdings(block):
    """``holdings[r] = {name: piece}`` of an injected TSP block for every rank of
    its group, checked against the block's own ``shard_names``/``shard_piece``."""
    tsp_size, specs = comm.group_size(block.tsp_group), block_specs(block)
    if isinstance(block, TSPAttention):
        holdings = _holdings(specs, lambda name, r: attention.shard_piece(block.heads, name, r),
                             list(block.replicated_params()))
    else:
        holdings = _holdings(specs, lambda name, r: mlp.shard_piece(block.intermediate_size, tsp_size, name, r),
                             [mlp.DOWN_BIAS] if block.down_bias is not None else [])
    own = {name: block.shard_piece(name) for name in block.shard_names()}
    if holdings[block.tsp_rank] != own:
        raise RuntimeError(f"{type(block).__name__} on TSP rank {block.tsp_rank} holds {own}, but "
                           f"ds_tsp.checkpoint expects {holdings[block.tsp_rank]}")
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
    """The full tensor ``name`` from ``[(piece, tensor)]`` of the ranks holding it."""
    if held[0][0] is None:
        return held[0][1]
    return join_pieces([piece for piece, _ in held], [tensor for _, tensor in held], name)


# ------------------------------------------------------------------- readers

class SafetensorsCheckpoint:
    """The tensors of a Hugging Face checkpoint directory: ``model.safetensors``
    or the files listed by ``model.safetensors.index.json``.

    Only headers are read up front. Each ``read`` maps its file for that read
    alone, so the pages it touches leave this process's memory with the tensor
    it returns, instead of piling up in one long-lived mapping.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        index = os.path.join(self.path, SAFE_WEIGHTS_INDEX)
        single = os.path.join(self.path, SAFE_WEIGHTS)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.files = {name: os.path.join(self.path, file) for name, file in weight_map.items()}
        elif os.path.isfile(single):
            with safe_open(single, framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), single)
        else:
            present = sorted(os.listdir(self.path)) if os.path.isdir(self.path) else "no such directory"
            raise CheckpointError(f"no {SAFE_WEIGHTS} or {SAFE_WEIGHTS_INDEX} in {self.path} (found: {present}); "
                                  "ds_tsp reads safetensors checkpoints: re-save the model with "
                                  "save_pretrained(safe_serialization=True)")
        self.shapes = {}
        for file in sorted(set(self.files.values())):
            with safe_open(file, framework="pt") as f:
                self.shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})

    @property
    def names(self):
        return list(self.files)

    def read(self, name, piece=None):
        """The tensor ``name`` narrowed to ``piece`` (whole when None), possibly a
        view of the (copy-on-write) memory-mapped file."""
        with safe_open(self.files[name], framework="pt") as f:
            if piece is None:
                return f.get_tensor(name)
            return f.get_slice(name)[narrow_index(piece)]


class TSPShardCheckpoint:
    """A directory written by ``ds-tsp convert``: per TSP rank, one file holding
    that rank's pieces under Hugging Face names, and ``tsp_shards.json``::

        {"format": "ds_tsp.tsp_shards", "version": 1, "tsp_size": D,
         "tensors": {name: {"shape": [...], "dtype": "float32"}},
         "ranks": [{"file": "rank0-of-D.safetensors", "pieces": {name: [dim, start, length] or null}}, ...]}

    where a null piece is the whole tensor and a name missing from a rank's
    ``pieces`` is not in its file.
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
        self.holdings = [{name: None if piece is None else tuple(piece) for name, piece in rank["pieces"].items()}
                         for rank in meta["ranks"]]

    @property
    def names(self):
        return list(self.shapes)

    def read_rank(self, name, tsp_rank):
        """What rank ``tsp_rank``'s file holds under ``name`` (its piece, or the whole tensor)."""
        with safe_open(self.files[tsp_rank], framework="pt") as f:
            return f.get_tensor(name)

    def read(self, name, piece=None):
        held = self.holdings[self.tsp_rank]
        if name not in held or held[name] != (None if piece is None else tuple(piece)):
            raise CheckpointError(f"{self.path} holds {held.get(name, 'nothing')} of {name} for TSP rank "
                                  f"{self.tsp_rank}, but the model asks for {piece}: re-run ds-tsp convert (with "
                                  "--no-vocab-parallel if tsp.vocab_parallel is false) "
                                  "for this model and tsp.size")
        return self.read_rank(name, self.tsp_rank)


def open_checkpoint(path, tsp_size=1, tsp_rank=0):
    """The reader for ``path``: pre-sharded (``tsp_shards.json``) or Hugging Face safetensors."""
    if os.path.isfile(os.path.join(path, TSP_SHARDS)):
        checkpoint = TSPShardCheckpoint(path, tsp_rank)
        if checkpoint.tsp_size != tsp_size:
            raise CheckpointError(f"{path} is pre-sharded for tsp.size = {checkpoint.tsp_size}, not {tsp_size}: "
                                  f"run `ds-tsp convert --join` on it, or convert the original with "
                                  f"--tsp-size {tsp_size}")
        return checkpoint
    return SafetensorsCheckpoint(path)


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

def _resolve_dtype(torch_dtype, config):
    """``torch_dtype`` as a ``torch.dtype``; None or "auto" take the checkpoint's
    dtype from its config, as Hugging Face's ``from_pretrained`` does."""
    if torch_dtype in (None, "auto"):
        torch_dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(torch_dtype, str):
        torch_dtype = getattr(torch, torch_dtype.removeprefix("torch."))
    return torch_dtype


def meta_model(path_or_config, torch_dtype=None):
    """The Hugging Face causal LM of a checkpoint (or config), on the meta device: sizes, no memory."""
    config = path_or_config
    if not hasattr(config, "model_type"):
        config = AutoConfig.from_pretrained(path_or_config)
    dtype = _resolve_dtype(torch_dtype, config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype), dtype


def _owner(model, full_name):
    module_name, _, attr = full_name.rpartition(".")
    return model.get_submodule(module_name), attr


def _materialise_replicated(model, checkpoint, skip_prefixes, dtype, device, progress):
    """Read every parameter and persistent buffer outside the TSP blocks whole
    from ``checkpoint`` (tied parameters once, under whichever of their names the
    file has) and fill non-persistent buffers the way Hugging Face does after a
    meta-device load: the model's own ``_init_weights`` on their module."""
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
        if name.startswith(skip_prefixes) or not buffer.is_meta:
            continue
        module, attr = _owner(model, name)
        if name in state_names:
            value = checkpoint.read(name).to(device=device, dtype=buffer.dtype, copy=True)
            progress.update()
        else:
            value = torch.empty_like(buffer, device=device)
        module._buffers[attr] = value
    for module in model.modules():
        if any(attr in module._non_persistent_buffers_set for attr in module._buffers):
            model._init_weights(module)


def _check_materialised(model):
    on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if on_meta:
        raise RuntimeError(f"ds_tsp.from_pretrained left tensors on the meta device: {on_meta}")


def from_pretrained(path, topology, tsp_config, torch_dtype=None, device="cpu"):
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
    """
    path = os.fspath(path)
    model, dtype = meta_model(path, torch_dtype)
    policy = resolve_policy(model, tsp_config.policy)
    plan = shard_plan(model, policy, topology.tsp_size, tsp_config.vocab_parallel)[topology.tsp_rank]
    checkpoint = open_checkpoint(path, topology.tsp_size, topology.tsp_rank)
    check_tensors_present(model, checkpoint)

    blocks = tuple(f"{policy.layers}.{i}.{part}." for i in range(len(model.get_submodule(policy.layers)))
                   for part in (policy.attention, policy.mlp))
    if tsp_config.vocab_parallel:
        blocks += (f"{policy.embed_tokens}.", f"{policy.lm_head}.")
    replicated = {id(p) for n, p in model.named_parameters() if not n.startswith(blocks)}
    progress = tqdm(total=len(plan) + len(replicated), desc=f"Loading {os.path.basename(path)}", unit="tensor",
                    disable=topology.rank != 0)
    _materialise_replicated(model, checkpoint, blocks, dtype, device, progress)

    def read(full_name, piece):
        if full_name not in plan or piece != plan[full_name]:
            raise RuntimeError(f"the TSP block asks for piece {piece} of {full_name}, but ds_tsp.checkpoint "
                               f"planned {plan.get(full_name, 'nothing')}: shard_plan and the block disagree")
        progress.update()
        return checkpoint.read(full_name, piece).to(dtype)

    inject(model, topology, tsp_config, read=read, device=device)
    progress.close()
    _check_materialised(model)
    return model.eval()


# -------------------------------------------------------------------- saving

def gather_shards(block):
    """Every rank's packed shard of ``block``, unpacked: one all-gather when the
    shards are the same size, else one broadcast from each owner."""
    specs = block_specs(block)
    packed = block.packed.detach()
    if len({spec.numel for spec in specs}) == 1:
        gathered, _ = comm.all_gather(packed, block.tsp_group)  # (D, shard numel)
        return [spec.unpack(flat) for spec, flat in zip(specs, gathered)]
    shards = []
    for owner in range(len(specs)):
        buf = packed if owner == block.tsp_rank else packed.new_empty(specs[owner].numel)
        comm.broadcast(buf, src=owner, group=block.tsp_group)
        shards.append(specs[owner].unpack(buf))
    return shards


def gather_block(block):
    """The full Hugging Face tensors of one TSP block (``{name: tensor}``), on
    every rank of its TSP group: the packed shards are gathered, unpacked and
    put back where each rank's piece came from (one copy of rows several ranks
    hold); replicated tensors are this rank's own."""
    holdings = block_holdings(block)
    shards = gather_shards(block)
    own = block.shard_tensors()
    full = {}
    for name in dict.fromkeys(name for held in holdings for name in held):
        held = [(pieces[name], shards[r][name] if pieces[name] is not None else own[name])
                for r, pieces in enumerate(holdings) if name in pieces]
        full[name] = join_holdings(name, held)
    return full


def gather_vocab(module):
    """The full ``(V, H)`` matrix of a vocabulary-parallel embedding or head:
    every rank's rows all-gathered, the padding rows dropped."""
    gathered, _ = comm.all_gather(module.weight.detach(), module.tsp_group)  # (D, Vs, H)
    return gathered.flatten(0, 1)[:module.vocab_size]


def gather_state_dict(model, progress=True):
    """The full Hugging Face state dict of an injected model, on every rank of its
    TSP group, under the original names (``lm_head.weight`` included when tied,
    as ``state_dict()`` has it). Collective over the TSP group."""
    policy, topology = model.tsp_policy, model.tsp_topology
    state = {name: tensor for name, tensor in model.state_dict().items()
             if not name.startswith(f"{policy.layers}.")}
    embed, lm_head = model.get_submodule(policy.embed_tokens), model.get_submodule(policy.lm_head)
    if isinstance(embed, vocab.VocabParallelEmbedding):
        state[f"{policy.embed_tokens}.weight"] = gather_vocab(embed)
        state[f"{policy.lm_head}.weight"] = (state[f"{policy.embed_tokens}.weight"] if lm_head.tied
                                             else gather_vocab(lm_head))
    layers = model.get_submodule(policy.layers)
    for index, layer in enumerate(tqdm(layers, desc="Gathering TSP shards", unit="layer",
                                       disable=not progress or topology.rank != 0)):
        prefix = f"{policy.layers}.{index}"
        for part, hf_name in ((layer.input_layernorm, policy.input_norm),
                              (layer.post_attention_layernorm, policy.post_attention_norm)):
            state.update({f"{prefix}.{hf_name}.{k}": v for k, v in part.state_dict().items()})
        for block, hf_name in ((layer.self_attn, policy.attention), (layer.mlp, policy.mlp)):
            state.update({f"{prefix}.{hf_name}.{k}": v for k, v in gather_block(block).items()})
    return state


def hf_class(model):
    """The Hugging Face class an injected model was made from."""
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, TSPCausalLMMixin))


def untied(model, state):
    """``state`` without the tied copies Hugging Face leaves out of its files."""
    tied = getattr(model, "all_tied_weights_keys", {}) or {}
    return {name: tensor for name, tensor in state.items() if name not in tied}


def write_hf_checkpoint(out_dir, state, config, generation_config=None, safe_serialization=True):
    """``config.json`` and one weights file, as Hugging Face's ``save_pretrained`` writes them."""
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    if generation_config is not None:
        generation_config.save_pretrained(out_dir)
    state = {name: tensor.contiguous() for name, tensor in state.items()}
    if safe_serialization:
        save_file(state, os.path.join(out_dir, SAFE_WEIGHTS), metadata={"format": "pt"})
    else:
        torch.save(state, os.path.join(out_dir, TORCH_WEIGHTS))


def save_pretrained(model, out_dir, safe_serialization=True):
    """Write an injected model as a plain Hugging Face checkpoint in ``out_dir``.

    Collective: every rank calls it. The TSP group of data-parallel replica 0
    gathers the shards; global rank 0 writes ``config.json`` and
    ``model.safetensors`` with the original names and shapes; no rank returns
    before the files exist.
    """
    topology = model.tsp_topology
    if topology.dp_rank == 0 and topology.pp_rank == 0:
        state = gather_state_dict(model)
        if topology.rank == 0:
            config = copy.deepcopy(model.config)
            config.architectures = [hf_class(model).__name__]
            config.dtype = model.dtype
            write_hf_checkpoint(os.fspath(out_dir), untied(model, state), config,
                                getattr(model, "generation_config", None), safe_serialization)
    comm.barrier(None)


# ---------------------------------------------------------------- conversion

def _is_weight_file(name):
    """Weights of any layout; every other file (config, tokenizer, ...) is copied as it is."""
    return name.endswith((".safetensors", ".bin")) or name in (SAFE_WEIGHTS_INDEX, f"{TORCH_WEIGHTS}.index.json",
                                                               TSP_SHARDS)


def _prepare_out_dir(in_dir, out_dir, force):
    """Refuse to write over ``in_dir`` or, without ``force``, into a non-empty
    ``out_dir``; with ``force``, drop its old weight files so that it ends up
    holding exactly one checkpoint."""
    if os.path.exists(out_dir) and os.path.samefile(in_dir, out_dir):
        raise CheckpointError(f"--out {out_dir} is the input directory: choose another output directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not force:
            raise CheckpointError(f"output directory {out_dir} exists and is not empty: pass --force to "
                                  "overwrite it, or choose another --out")
        for name in os.listdir(out_dir):
            if _is_weight_file(name):
                os.remove(os.path.join(out_dir, name))
    elif os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"output {out_dir} exists and is not a directory")
    os.makedirs(out_dir, exist_ok=True)
    for name in sorted(os.listdir(in_dir)):
        source = os.path.join(in_dir, name)
        if os.path.isfile(source) and not _is_weight_file(name):
            shutil.copyfile(source, os.path.join(out_dir, name))


def shard_checkpoint(in_dir, out_dir, tsp_size, policy="auto", force=False, vocab_parallel=True):
    """Pre-shard the Hugging Face checkpoint ``in_dir`` for a TSP group of
    ``tsp_size``, in one process: ``out_dir`` gets ``rank{r}-of-{D}.safetensors``
    per rank (that rank's piece of every sharded tensor and every replicated
    tensor whole, all under Hugging Face names), ``tsp_shards.json`` (full
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
    source = SafetensorsCheckpoint(in_dir)
    check_tensors_present(model, source)
    _prepare_out_dir(in_dir, out_dir, force)

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
                held[name] = source.read(name, piece).contiguous()
                tensors[name] = {"shape": list(source.shapes[name]),
                                 "dtype": str(held[name].dtype).removeprefix("torch.")}
                bar.update()
            file = rank_file(tsp_rank, tsp_size)
            save_file(held, os.path.join(out_dir, file), metadata={"format": "pt"})
            ranks.append({"file": file,
                          "pieces": {name: None if p is None else list(p) for name, p in pieces.items()}})
    description = {"format": TSP_SHARDS_FORMAT, "version": 1, "tsp_size": tsp_size,
                   "tensors": {name: tensors[name] for name in source.names}, "ranks": ranks}
    # Written last: a directory without it is not mistaken for a finished conversion.
    with open(os.path.join(out_dir, TSP_SHARDS), "w") as f:
        json.dump(description, f, indent=1)


def join_checkpoint(in_dir, out_dir, tsp_size=None, force=False):
    """Turn a directory written by ``shard_checkpoint`` (for ``tsp_size``, if
    given) back into a Hugging Face checkpoint (``model.safetensors`` plus the
    other files), tensor for tensor."""
    in_dir, out_dir = os.fspath(in_dir), os.fspath(out_dir)
    if not os.path.isfile(os.path.join(in_dir, TSP_SHARDS)):
        raise CheckpointError(f"{in_dir} has no {TSP_SHARDS}: it is not the output of ds-tsp convert")
    shards = TSPShardCheckpoint(in_dir)
    if tsp_size is not None and tsp_size != shards.tsp_size:
        raise CheckpointError(f"{in_dir} holds shards for tsp.size {shards.tsp_size}, not {tsp_size}: "
                              "drop --tsp-size to join it")
    _prepare_out_dir(in_dir, out_dir, force)
    state = {}
    for name in tqdm(shards.names, desc=f"Joining {shards.tsp_size} TSP shards", unit="tensor"):
        state[name] = join_holdings(name, [(held[name], shards.read_rank(name, r))
                                           for r, held in enumerate(shards.holdings) if name in held])
    save_file(state, os.path.join(out_dir, SAFE_WEIGHTS), metadata={"format": "pt"})
