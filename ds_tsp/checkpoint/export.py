"""``ds-tsp export``: a DeepSpeed checkpoint of a TSP model -> a Hugging Face directory.

DeepSpeed writes one ``mp_rank_XX_model_states.pt`` per TSP rank (the TSP group
is DeepSpeed's model-parallel group), each holding that rank's packed shards,
its rows of the embedding and LM head when the vocabulary is folded, and the
replicated tensors. This joins them in one process, without
torch.distributed, into ``config.json`` + ``model.safetensors`` (or shards
and an index) that ``AutoModelForCausalLM.from_pretrained`` loads.

With ``fp32_master`` the weights come from the ZeRO optimizer files instead,
as DeepSpeed's ``zero_to_fp32`` reads them: the float32 master copy that a
bf16 or fp16 run updates, which the model-dtype weights only round. Per TSP
rank ``m`` and data-parallel rank ``d``, ``[bf16_]zero_pp_rank_{d}_mp_rank_{m}_optim_states.pt``
holds rank ``d``'s partition of flat float32 vectors laid out by the
``param_shapes`` of the model-states file: ZeRO 1 and 2 cut each parameter
group's vector (parameters in order, each followed by its alignment padding)
into consecutive pieces, one per rank; ZeRO 3 cuts every parameter into
``ceil(numel / dp)`` pieces, one per rank, padded at the end. ZeRO-3 keeps
no weights in the model-states files: it is read with ``fp32_master``, or, where
the 16-bit weights were saved beside it (a Trainer checkpoint's
``model.safetensors``, gathered by ``save_model`` at the same step), from those.
Pipeline stages write each layer's weights per TSP rank
(``layer_XX-model_YY-model_states.pt``), named inside the pipe; they are
renamed to the model's names (``ds_tsp.injection.pipeline.hf_prefixes``). Their ZeRO
files follow the stages, so their float32 master weights are read through
DeepSpeed's universal converter (``ds-tsp reshard``) instead.

Every file is read with ``torch.load(weights_only=True)``; the optimizer files
pickle three DeepSpeed objects besides tensors, which are allowlisted by name.
"""

import math
import os
import pickle
import re
import tempfile
from collections import defaultdict

import torch
from deepspeed.checkpoint.constants import PARAM
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address
from tqdm.auto import tqdm

from ds_tsp.blocks.attention.module import QK_NORMS
from ds_tsp.blocks.tower import join_units
from ds_tsp.checkpoint.formats import CheckpointError, hf_weights_file
from ds_tsp.checkpoint.reading import check_tensors_present, hf_checkpoint
from ds_tsp.checkpoint.resharding import VISION_TOWER_REFUSED, read_layout, reshard
from ds_tsp.checkpoint.shard_plan import join_holdings, layer_shards, meta_model, untied, vocab_names
from ds_tsp.checkpoint.staging import staged
from ds_tsp.checkpoint.writing import (
    DEFAULT_MAX_SHARD_SIZE,
    check_out_dir,
    copy_other_files,
    replaced_by_a_checkpoint,
    write_state_dict,
)
from ds_tsp.injection.model import block_attribute
from ds_tsp.injection.pipeline import hf_prefixes
from ds_tsp.injection.policy import VISION_TOWERS, hf_path, resolve_policy, vision_family

# Replicated tensors of a TSP block whose parameter is not under its Hugging Face name (a MoE block's
# router and shared-expert gate keep theirs; a recurrent mixer's out_proj bias does not, and the attention holds
# its q/k norms as q_norm and k_norm whatever their names: LFM2's q/k_layernorm, Hunyuan's query/key_layernorm).
_RENAMED_REPLICATED = {"o_proj.bias": "o_bias", "down_proj.bias": "down_bias", "out_proj.bias": "out_bias",
                       **{f"{hf}.weight": f"{tsp}.weight" for pair in QK_NORMS if pair[0] != pair[1]
                          for hf, tsp in zip(pair, ("q_norm", "k_norm"))}}


def _replicated(holdings):
    """``{Hugging Face name: the TSP block's parameter name}`` of the tensors a
    block's ``holdings`` hold whole."""
    return {name: _RENAMED_REPLICATED.get(name, name) for held in holdings for name, piece in held.items()
            if piece is None}
# ZeRO 0-2 write mp_rank_XX_model_states.pt per TSP rank; ZeRO-3 one per data-parallel rank as well.
_MODEL_STATES = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
_LAYER_STATES = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")
_OPTIM_STATES = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
# What DeepSpeed's optimizer files pickle besides tensors and builtins: the
# loss scaler (static for bf16, dynamic for fp16), the ZeRO stage and ZeRO 1/2's
# parameter slice addresses.
_DEEPSPEED_GLOBALS = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_weights_only(path):
    """``torch.load(path)`` that unpickles tensors, builtins and ``_DEEPSPEED_GLOBALS``
    only, memory-mapped."""
    try:
        with torch.serialization.safe_globals(_DEEPSPEED_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        refused = str(err).split("WeightsUnpickler error: ")[-1].splitlines()[0]
        raise CheckpointError(f"{path} holds objects that torch.load(weights_only=True) refuses ({refused}); "
                              "ds-tsp export unpickles only tensors and DeepSpeed's loss scaler and ZeRO records: "
                              "export a checkpoint written by engine.save_checkpoint") from None


def checkpoint_folder(checkpoint_dir, tag=None):
    """The folder of checkpoint ``tag`` (default: the one named in ``latest``)."""
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise CheckpointError(f"{checkpoint_dir} has no 'latest' file: pass --tag")
        with open(latest) as f:
            tag = f.read().strip()
    return os.path.join(checkpoint_dir, tag)


def _files_by_rank(folder, pattern):
    """``{tsp rank: {data-parallel rank (0 if none): file}}`` of the files matching ``pattern``."""
    files = defaultdict(dict)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if m := pattern.fullmatch(name):
            files[int(m.group(2))][int(m.group(1) or 0)] = os.path.join(folder, name)
    return files


def read_rank_states(folder):
    """The model-states file of every TSP rank (data-parallel rank 0's), in rank order."""
    files = _files_by_rank(folder, _MODEL_STATES)
    if not files or sorted(files) != list(range(len(files))):
        raise CheckpointError(f"{folder} has no complete set of mp_rank_XX_model_states.pt files")
    return [load_weights_only(files[rank][0]) for rank in range(len(files))]


def _zero_partitions(folder, tsp_rank):
    """The ZeRO stage and every data-parallel rank's ``optimizer_state_dict`` of one TSP rank."""
    files = _files_by_rank(folder, _OPTIM_STATES).get(tsp_rank, {})
    if not files:
        raise CheckpointError(f"{folder} has no ZeRO optimizer files for TSP rank {tsp_rank} "
                              f"(*zero_pp_rank_*_mp_rank_{tsp_rank:02d}_optim_states.pt): fp32 master weights exist "
                              "only with zero_optimization.stage >= 1; export without fp32_master (--fp32-master)")
    partitions = [load_weights_only(files[dp])["optimizer_state_dict"] for dp in sorted(files)]
    counts = partitions[0]["partition_count"]
    dp_size = max(counts) if isinstance(counts, list) else counts
    if dp_size != len(partitions):
        raise CheckpointError(f"{folder} holds {len(partitions)} optimizer files for TSP rank {tsp_rank}, but ZeRO "
                              f"partitioned over {dp_size} data-parallel ranks: the checkpoint is incomplete")
    return int(partitions[0]["zero_stage"]), partitions


def fp32_master_weights(folder, model_states, tsp_rank):
    """``{parameter name: float32 tensor}`` of one TSP rank, joined from its
    ZeRO partitions (see the module docstring)."""
    stage, partitions = _zero_partitions(folder, tsp_rank)
    param_shapes = model_states["param_shapes"]
    master = {}
    if stage <= 2:
        paddings = partitions[0].get("param_alignment_paddings")
        for group, shapes in enumerate(param_shapes):
            flat = torch.cat([p["single_partition_of_fp32_groups"][group] for p in partitions])
            offset = 0
            for index, (name, shape) in enumerate(shapes.items()):
                numel = math.prod(shape)
                master[name] = flat[offset:offset + numel].view(shape)
                offset += numel + (paddings[group][index] if paddings else 0)
        return master
    flats = [torch.cat(p["fp32_flat_groups"]) for p in partitions]
    offset = 0
    for name, shape in ((n, s) for shapes in param_shapes for n, s in shapes.items()):
        numel = math.prod(shape)
        piece = math.ceil(numel / len(flats))
        master[name] = torch.cat([flat[offset:offset + piece] for flat in flats])[:numel].view(shape)
        offset += piece
    return master


def pipeline_rank_weights(folder, pipeline_names):
    """Every TSP rank's module state of a pipeline checkpoint, under the model's
    names: DeepSpeed writes each pipe layer's state per TSP rank
    (``layer_XX-model_YY-model_states.pt``), named inside the layer;
    ``pipeline_names`` (``ds_tsp.injection.pipeline.hf_prefixes``) renames them."""
    files = defaultdict(dict)
    for name in sorted(os.listdir(folder)):
        if m := _LAYER_STATES.fullmatch(name):
            files[int(m.group(2))][int(m.group(1))] = os.path.join(folder, name)
    to_model = {f"{pipe}.": f"{model}." for pipe, model in pipeline_names.items()}
    states = []
    for tsp_rank in range(len(files)):
        state = {}
        for layer, path in sorted(files[tsp_rank].items()):
            for name, tensor in load_weights_only(path).items():
                name = f"{layer}.{name}"
                prefix = next((p for p in to_model if name.startswith(p)), None)
                if prefix is None:
                    raise CheckpointError(f"{path} holds {name}, which no layer of the model's pipeline has: was "
                                          "it written from this model (--model)?")
                state[to_model[prefix] + name[len(prefix):]] = tensor
        states.append(state)
    return states


def rank_weights(folder, fp32_master=False, pipeline_names=None):
    """Every TSP rank's module state (``{name: tensor}``), in rank order: the
    model-dtype weights, or with ``fp32_master`` the float32 master weights
    (buffers and frozen parameters cast to float32). ``pipeline_names`` reads
    the layer files of pipeline stages."""
    if is_pipeline(folder):
        return pipeline_rank_weights(folder, pipeline_names)
    states = read_rank_states(folder)
    if not fp32_master:
        if any(t.numel() == 0 for t in states[0]["module"].values()):
            raise CheckpointError(f"{folder} is a ZeRO-3 checkpoint, whose model-states files hold no weights, and "
                                  "no 16-bit weights were saved beside it (save_model with "
                                  "stage3_gather_16bit_weights_on_model_save: true): export its fp32 master weights "
                                  "with --fp32-master (fp32_master=True)")
        return [state["module"] for state in states]
    weights = []
    for tsp_rank, state in enumerate(states):
        module = {name: t.float() if t.is_floating_point() else t for name, t in state["module"].items()}
        module.update(fp32_master_weights(folder, state, tsp_rank))
        weights.append(module)
    return weights


def join_vocab(name, per_rank, vocab_size):
    """The full ``(V, H)`` matrix from every rank's copy: whole when replicated,
    else the ranks' rows in order with the padding rows dropped."""
    if per_rank[0].shape[0] == vocab_size:
        return per_rank[0]
    full = torch.cat(per_rank)
    if full.shape[0] < vocab_size:
        raise CheckpointError(f"the ranks' rows of {name} ({full.shape[0]}) do not cover vocab_size {vocab_size}")
    return full[:vocab_size]


def export_deepspeed_checkpoint(checkpoint_dir, model_dir, out_dir, tag=None, force=False, fp32_master=False,
                                max_shard_size=DEFAULT_MAX_SHARD_SIZE):
    """Join the TSP ranks' shards of a DeepSpeed checkpoint into a Hugging Face
    directory of files of at most ``max_shard_size``; ``model_dir`` supplies the
    model's config (the original HF dir). With ``fp32_master`` the weights are
    the ZeRO optimizer's float32 master copy (ZeRO 1-3), else the model-dtype
    weights (ZeRO 0-2)."""
    model, _ = meta_model(model_dir)
    policy = resolve_policy(model, "auto")
    folder = checkpoint_folder(os.fspath(checkpoint_dir), tag)
    layout = read_layout(folder) or {}
    folded = layout.get("ep", layout.get("tsp")) != layout.get("tsp")
    if layout.get("vision_tower") and fp32_master and (is_pipeline(folder) or folded):
        raise CheckpointError(VISION_TOWER_REFUSED.format(
            source=folder, what="exporting the master weights of pipeline stages or folded experts"))
    if folded and not fp32_master:
        raise CheckpointError(f"{folder} was saved with experts folded over replicas (tsp.expert_parallel_size = "
                              f"{layout['ep']}): its model states hold replica 0's experts, each rank's own are in "
                              "its ZeRO file: export with --fp32-master (fp32_master=True)")
    if not fp32_master and is_zero3(folder) and hf_weights_file(os.fspath(checkpoint_dir)) is not None:
        state = saved_16bit_weights(os.fspath(checkpoint_dir), model)
    elif fp32_master and (is_pipeline(folder) or folded):
        state = resharded_master_weights(os.fspath(checkpoint_dir), os.path.basename(folder), model, policy)
    else:
        layers = model.config.get_text_config().num_hidden_layers
        state = joined_state(model, policy, rank_weights(folder, fp32_master, hf_prefixes(policy, layers)),
                             layout.get("vision_tower"))
    check_out_dir(os.fspath(model_dir), os.fspath(out_dir), force)
    with staged(out_dir, replaced=replaced_by_a_checkpoint) as staging:
        copy_other_files(os.fspath(model_dir), staging)  # the tokenizer, the generation config
        write_state_dict(staging, state, model.config, getattr(model, "generation_config", None), max_shard_size)


def is_pipeline(folder):
    """Whether pipeline stages wrote the checkpoint in ``folder`` (one file per pipe layer and TSP rank)."""
    return any(_LAYER_STATES.fullmatch(name) for name in os.listdir(folder))


def resharded_master_weights(checkpoint_dir, tag, model, policy):
    """The float32 master weights of a checkpoint whose ZeRO files follow pipeline
    stages or experts folded over replicas: resharded (``ds-tsp reshard``)
    into a temporary directory, where every parameter is one full tensor under
    the model's names (a packed block: its tensors whole, in name order; a
    folded block's shared expert, a TSP MLP inside it: its own)."""
    with tempfile.TemporaryDirectory(prefix="ds_tsp_export_") as scratch:
        reshard(checkpoint_dir, os.path.join(scratch, "universal"), tag)
        zero = os.path.join(scratch, "universal", tag, "zero")

        def master(name):
            return torch.load(os.path.join(zero, name, "fp32.pt"), weights_only=False)[PARAM]

        state = {}
        for index, layer in enumerate(model.get_submodule(policy.layers)):
            prefix = f"{policy.layers}.{index}"
            for block, shards in layer_shards(layer, model.config.get_text_config(), policy, 1).items():
                # where the TSP layer holds the block
                held_at = f"{prefix}.{block_attribute(block, policy.mlp_of(layer), policy.experts_prefix(layer))}"
                # Each packed parameter's tensors in name order: the block's, and a TSP block's inside it.
                tensors, by_param = {}, defaultdict(list)
                for name in sorted(shards.specs[0].shapes):
                    inner = name.partition(".")[0]
                    nested = os.path.isdir(os.path.join(zero, f"{held_at}.{inner}.packed"))
                    by_param[f"{held_at}.{inner}.packed" if nested else f"{held_at}.packed"].append(name)
                for param, names in by_param.items():
                    flat, offset = master(param).reshape(-1), 0
                    for name in names:
                        shape = shards.specs[0].shapes[name]
                        tensors[name] = flat[offset:offset + math.prod(shape)].view(shape)
                        offset += math.prod(shape)
                state.update({hf_path(prefix, block, name): t for name, t in shards.hf_rows.fuse(tensors).items()})
                state.update({hf_path(prefix, block, hf): master(f"{held_at}.{param}")
                              for hf, param in _replicated(shards.holdings).items()
                              if os.path.isdir(os.path.join(zero, f"{held_at}.{param}"))})
        expected = untied(model, dict(model.state_dict()))
        state.update({name: master(name) for name in expected if name not in state})
        return {name: state[name].view(expected[name].shape) for name in expected}


def is_zero3(folder):
    """Whether ZeRO-3 wrote the checkpoint in ``folder`` (its model states are per data-parallel rank)."""
    return any((m := _MODEL_STATES.fullmatch(name)) and m.group(1) is not None for name in os.listdir(folder))


def saved_16bit_weights(checkpoint_dir, model):
    """The model-dtype weights ZeRO-3 gathered beside its DeepSpeed checkpoint
    (the Trainer's ``save_model`` under ``stage3_gather_16bit_weights_on_model_save``
    writes them at the same step), checked against ``model``."""
    source = hf_checkpoint(checkpoint_dir, model=model)
    check_tensors_present(model, source)
    expected = set(untied(model, dict(model.state_dict())))
    return {name: source.read(name) for name in source.names if name in expected}


def joined_state(model, policy, states, vision_tower=False):
    """The model's full tensors from every TSP rank's module state (``rank_weights``); ``vision_tower``: the
    states hold a vision-language model's tower units, each rank a slice (``ds_tsp.blocks.tower``)."""
    tsp_size = len(states)
    full = {}
    for index, layer in enumerate(tqdm(model.get_submodule(policy.layers), desc=f"Joining {tsp_size} TSP ranks",
                                       unit="layer")):
        prefix = f"{policy.layers}.{index}"
        shards = layer_shards(layer, model.config.get_text_config(), policy, tsp_size)
        for block, (specs, holdings, hf_rows) in shards.items():
            # where the TSP layer holds the block
            held_at = f"{prefix}.{block_attribute(block, policy.mlp_of(layer), policy.experts_prefix(layer))}"
            named = []
            for spec, state in zip(specs, states):
                tensors = spec.unpack(state[f"{held_at}.packed"])
                tensors.update({hf: state[f"{held_at}.{param}"] for hf, param in _replicated(holdings).items()
                                if f"{held_at}.{param}" in state})
                named.append(tensors)
            joined = {name: join_holdings(name, [(held[name], tensors[name])
                                                 for held, tensors in zip(holdings, named) if name in held])
                      for name in holdings[0].keys() | {n for held in holdings for n in held}}
            full.update({hf_path(prefix, block, name): tensor for name, tensor in hf_rows.fuse(joined).items()})
    block_prefixes = tuple(f"{policy.layers}.{i}.{b}." for i, layer in enumerate(model.get_submodule(policy.layers))
                           for b in policy.block_prefixes(layer))
    full.update({name: tensor for name, tensor in states[0].items() if not name.startswith(block_prefixes)})
    full.update({name: join_vocab(name, [state[name] for state in states], rows)
                 for name, rows in vocab_names(model, policy).items() if name in states[0]})
    if vision_tower:
        full.update(join_units(model, VISION_TOWERS[vision_family(model)], states))
    expected = set(untied(model, dict(model.state_dict())))
    state = {name: full[name] for name in expected if name in full}
    missing = expected - set(state)
    if missing:
        raise CheckpointError(f"the checkpoint lacks {sorted(missing)[:5]}: was it written from this model?")
    return state
