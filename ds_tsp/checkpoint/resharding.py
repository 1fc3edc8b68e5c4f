"""DeepSpeed checkpoints of TSP engines across layouts: the saved layout, plain loads refused at another, reshards.

``engine.save_checkpoint`` writes, beside DeepSpeed's files, ``ds_tsp_layout.json``
in the tag folder: the ``(tsp, dp, pp, zero stage)`` the files are cut for.
``engine.load_checkpoint`` reads it before DeepSpeed reads anything and refuses
a plain load at another layout, naming both and the command that reshards:
``ds-tsp reshard`` (``reshard``), which runs DeepSpeed's own universal
converter (``ds_to_universal``) over the description of every TSP shard the
model states carry (``checkpoint.universal``). An engine of any layout loads
the result with ``"checkpoint": {"load_universal": true}``; the Trainer's
``resume_from_checkpoint`` reshards on the way (``_load_resharded``).

DeepSpeed's converter reads one source file at a time, dumps every
parameter's fragments and joins one parameter at a time, so it never holds
the model (``benchmarks/reshard_memory.py``: about one optimizer file and one
model-states file at its peak; it reads the model-states files and one
optimizer file more than once). The result is written into a temporary
directory beside ``--out`` and swapped in once complete (``staging``).
"""

import argparse
import contextlib
import json
import os
import re
import shutil

import deepspeed
import torch
from deepspeed.checkpoint.constants import (
    BASE_OPTIMIZER_STATE,
    DS_VERSION,
    OPTIMIZER_STATE_DICT,
    PARAM_GROUPS,
    VOCAB_TENSOR,
)
from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

from ds_tsp.checkpoint.folded_experts import (
    folded_maps,
    hyperparameters_for_expert_groups,
    without_folded_experts,
    write_folded_experts,
)
from ds_tsp.checkpoint.formats import CheckpointError
from ds_tsp.checkpoint.staging import link_or_copy, staged
from ds_tsp.checkpoint.tags import save_tag
from ds_tsp.injection.pipeline import hf_prefixes
from ds_tsp.parallel import comm

LAYOUT_FILE = "ds_tsp_layout.json"
LAYOUT_FORMAT = "ds_tsp.parallel.layout"
# DeepSpeed's names of the newest tag: plain and universal checkpoints.
LATEST, LATEST_UNIVERSAL = "latest", "latest_universal"


# Universal checkpoints do not describe how ds_tsp splits LoRA adapters.
LORA_RESHARD_REFUSED = ("{source} is a LoRA run's checkpoint, whose adapter shards ds_tsp does not reshard: resume it at "
                        "the TSP x DP x PP layout it was saved at, or write its adapters (ds_tsp.save_pretrained), "
                        "which PeftModel.from_pretrained loads for a model of any layout")


VISION_TOWER_REFUSED = ("{source} holds a vision-language model's tower, whose units are flat vectors cut by the "
                        "TSP size, which {what} does not join or recut yet: write the model with "
                        "ds_tsp.save_pretrained (or the Trainer's save_model), which ds_tsp.from_pretrained reads at "
                        "any layout")


def engine_layout(engine):
    """``{"tsp", "dp", "pp", "ep", "zero_stage", "pipeline_names", "folded_shared"}``
    of a ds_tsp engine (``ep``: the expert-parallel size; ``folded_shared``:
    whether a folded MoE block keeps its shared expert as a TSP MLP of its
    own, whose universal tensors an unfolded block, which packs the shared
    expert with the routed ones, does not read); ``pipeline_names`` pairs the
    module names of pipeline stages with the model's own, which a reshard
    gives every parameter under both."""
    topology, module = engine.tsp_topology, engine.module
    config = (getattr(module, "tsp_model_config", None) or module.config).get_text_config()
    policy = module.tsp_policy
    return {"tsp": topology.tsp_size, "dp": topology.dp_size, "pp": topology.pp_size, "ep": topology.ep_size,
            "zero_stage": int(engine.zero_optimization_stage()),
            "pipeline_names": hf_prefixes(policy, config.num_hidden_layers),
            "vocabulary": [f"{policy.embed_tokens}.weight", f"{policy.lm_head}.weight",
                           *([f"{policy.model_inputs(module).embed}.weight"] if policy.model_inputs(module) else [])],
            "lora": getattr(module, "tsp_peft_config", None) is not None,
            # A vision-language model's tower units, each a flat vector cut by the TSP size (ds_tsp.blocks.tower).
            "vision_tower": getattr(module, "tsp_vision_family", None) is not None and topology.tsp_size > 1,
            "folded_shared": any(getattr(block, "shared_mlp_name", None) is not None for block in module.modules())}


def describe(layout):
    stage = f"ZeRO-{layout['zero_stage']}"
    experts = f", experts over {layout['ep']}" if layout.get("ep", layout["tsp"]) != layout["tsp"] else ""
    return f"tsp {layout['tsp']} x dp {layout['dp']} x pp {layout['pp']}{experts}, {stage}"


def read_layout(folder):
    """The layout a tag folder's files are cut for (None: not written by ds_tsp)."""
    path = os.path.join(folder, LAYOUT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        record = json.load(f)
    if record.get("format") != LAYOUT_FORMAT:
        raise CheckpointError(f"{path} is not a ds_tsp layout record")
    return record


def write_layout(folder, layout, universal=False):
    with open(os.path.join(folder, LAYOUT_FILE), "w") as f:
        json.dump({"format": LAYOUT_FORMAT, "version": 1, **layout, "universal": universal}, f, indent=1)


def resolve_tag(load_dir, tag, universal):
    """DeepSpeed's choice of tag: ``tag``, else the one ``latest`` (``latest_universal``) names."""
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, LATEST_UNIVERSAL if universal else LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def load_refusal(load_dir, tag, current, universal):
    """Why ``engine.load_checkpoint(load_dir, tag)`` cannot load into an engine of
    layout ``current`` (a message naming the fix), or None."""
    resolved = resolve_tag(load_dir, tag, universal)
    if resolved is None and not universal and os.path.isfile(os.path.join(load_dir, LATEST_UNIVERSAL)):
        resolved = resolve_tag(load_dir, None, universal=True)
    saved = read_layout(os.path.join(load_dir, resolved)) if resolved is not None else None
    if saved is None:
        return None
    if saved["universal"] and not universal:
        return (f"{load_dir}/{resolved} is a universal checkpoint (ds-tsp reshard): load it with "
                "\"checkpoint\": {\"load_universal\": true} in the DeepSpeed config")
    if universal:
        if saved.get("folded_shared", False) == current["folded_shared"]:
            return None
        where = {True: "folded over replicas", False: "split over the TSP group"}
        return (f"{load_dir}/{resolved} holds a model with shared experts, its routed experts "
                f"{where[saved.get('folded_shared', False)]}, this engine's {where[current['folded_shared']]}: a "
                "folded block keeps its shared expert's universal tensors apart from the routed ones, an unfolded "
                "one packs them together. Resume with tsp.expert_parallel_size folding as the saved run's did (or "
                "not), or move the weights alone (ds_tsp.save_pretrained, then ds_tsp.initialize from that directory)")
    keys = ("tsp", "dp", "pp", "zero_stage") if current["zero_stage"] or saved["zero_stage"] else ("tsp", "pp",
                                                                                                    "zero_stage")
    if all(saved[key] == current[key] for key in keys) and saved.get("ep", saved["tsp"]) == current["ep"]:
        return None
    return (f"{load_dir}/{resolved} was saved at {describe(saved)}, this engine is {describe(current)}: a plain "
            f"load would read other ranks' shards. Reshard it first, `ds-tsp reshard --checkpoint {load_dir} "
            f"--tag {resolved} --out {os.path.normpath(load_dir)}-universal`, and load that with "
            "\"checkpoint\": {\"load_universal\": true} in the DeepSpeed config")


def reshard(checkpoint_dir, out_dir, tag=None, force=False):
    """Turn the DeepSpeed checkpoint ``checkpoint_dir`` (tag ``tag``, default the
    one ``latest`` names) of a ds_tsp engine into a universal checkpoint in
    ``out_dir`` (``out_dir/<tag>`` and ``latest_universal``), which an engine of
    any layout loads with ``"checkpoint": {"load_universal": true}``. Returns the tag."""
    checkpoint_dir, out_dir = os.fspath(checkpoint_dir), os.fspath(out_dir)
    tag = resolve_tag(checkpoint_dir, tag, universal=False)
    if tag is None:
        raise CheckpointError(f"{checkpoint_dir} has no '{LATEST}' file: pass --tag")
    source = os.path.join(checkpoint_dir, tag)
    saved = read_layout(source)
    if saved is None:
        raise CheckpointError(f"{source} has no {LAYOUT_FILE}: it was not written by the engine of "
                              "ds_tsp.initialize (engine.save_checkpoint)")
    if saved["universal"]:
        raise CheckpointError(f"{source} is a universal checkpoint already: load it with "
                              "\"checkpoint\": {\"load_universal\": true}")
    if saved.get("lora"):
        raise CheckpointError(LORA_RESHARD_REFUSED.format(source=source))
    if saved.get("vision_tower"):
        raise CheckpointError(VISION_TOWER_REFUSED.format(source=source, what="resharding"))
    if saved["zero_stage"] == 0:
        raise CheckpointError(f"{source} was saved with zero_optimization.stage 0, whose optimizer state DeepSpeed's "
                              "universal checkpoints do not read: train with stage 1, 2 or 3 to move between layouts")
    _check_adam_states(source)
    if os.path.exists(out_dir):
        if not force:
            raise CheckpointError(f"--out {out_dir} exists: pass --force to replace it, or choose another --out")
        if os.path.exists(os.path.join(out_dir, LATEST)) or os.path.samefile(out_dir, checkpoint_dir):
            raise CheckpointError(f"--out {out_dir} holds the checkpoint to reshard: choose another --out")
    experts = folded_maps(source)
    with staged(out_dir) as staging, _mapped_loads():
        folder = os.path.join(staging, tag)
        # Experts folded over replicas are joined by folded_experts, the rest by DeepSpeed's converter.
        converted = without_folded_experts(source, os.path.join(staging, "folded-source")) if experts else source
        ds_to_universal(argparse.Namespace(input_folder=converted, output_folder=folder, num_extract_workers=1,
                                           num_merge_workers=1, keep_temp_folder=False, strict=True,
                                           inject_missing_state=False))
        if experts:
            shutil.rmtree(converted)
            write_folded_experts(source, saved, os.path.join(folder, "zero"), experts)
        _name_params_for_pipelines_and_not(os.path.join(folder, "zero"), saved["pipeline_names"])
        _name_model_states_for_every_stage(folder)
        _optimizer_state_for_every_stage(folder)
        _mark_vocabulary(os.path.join(folder, "zero"), saved["vocabulary"])
        write_layout(folder, saved, universal=True)
    return tag


def _check_adam_states(source):
    """DeepSpeed's universal checkpoints carry Adam's state (``exp_avg``,
    ``exp_avg_sq``, ``step``) and its converter fails on any other optimizer's:
    refuse those by name first."""
    files = sorted(name for name in os.listdir(source) if name.endswith("optim_states.pt"))
    if not files:
        raise CheckpointError(f"{source} has no ZeRO optimizer files (*optim_states.pt): nothing to reshard")
    optimizer = torch.load(os.path.join(source, files[0]), map_location="cpu", weights_only=False,
                           mmap=True)[OPTIMIZER_STATE_DICT]
    inner = optimizer.get(BASE_OPTIMIZER_STATE) or optimizer.get(OPTIMIZER_STATE_DICT) or {}
    keys = set(next(iter(inner.get("state", {}).values()), {}))
    if not {"exp_avg", "exp_avg_sq"} <= keys:
        raise CheckpointError(f"{source} holds an optimizer state with {sorted(keys) or 'no entries'}; DeepSpeed's "
                              "universal checkpoints move Adam's (exp_avg, exp_avg_sq): reshard a checkpoint of Adam "
                              "or AdamW that has taken a step")


def _mark_vocabulary(zero, names):
    """Mark the embedding and the LM head as DeepSpeed's vocabulary tensors even
    where the source held them whole (``tsp.vocab_parallel: false``), so that a
    loader with folded rows pads them to ``D * ceil(V / D)`` rows and cuts them
    as TSP does, rather than splitting ``V`` rows evenly, which ``V`` may not allow."""
    for name in names:
        folder = os.path.join(zero, name)
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            path = os.path.join(folder, f"{state}.pt")
            if not os.path.isfile(path):
                continue
            saved = torch.load(path, weights_only=False)
            if not saved.get(VOCAB_TENSOR):
                saved[VOCAB_TENSOR] = True
                _rewrite(path, saved)


@contextlib.contextmanager
def _mapped_loads():
    """DeepSpeed's converter ``torch.load``s whole files, some more than once:
    every model-states file for its metadata and again for parameters without
    optimizer state, the first optimizer file for the ZeRO stage and for the
    optimizer's common state. Memory-mapped, each load reads only the tensors it
    uses, so only the extraction reads the optimizer files' tensors, once, and
    a file no longer used holds no memory."""
    load = torch.load

    def mapped(*args, **kwargs):
        kwargs.setdefault("mmap", True)
        return load(*args, **kwargs)

    torch.load = mapped
    try:
        yield
    finally:
        torch.load = load


def _name_params_for_pipelines_and_not(zero, pipeline_names):
    """The loader finds a parameter's universal tensors under the engine's own
    name of it: with pipeline stages, the pipe's (``3.layer.mlp.packed``), else
    the model's (``model.layers.2.mlp.packed``). Each gets the other name too (a
    symbolic link), so the checkpoint loads with or without stages."""
    to_model = {f"{pipe}.": f"{model}." for pipe, model in pipeline_names.items()}
    to_pipe = {model: pipe for pipe, model in to_model.items()}
    for name in os.listdir(zero):
        if not os.path.isdir(os.path.join(zero, name)):
            continue
        for prefixes in (to_model, to_pipe):
            prefix = next((p for p in prefixes if name.startswith(p)), None)
            if prefix is not None:
                os.symlink(name, os.path.join(zero, prefixes[prefix] + name[len(prefix):]), target_is_directory=True)
                break


_MODEL_STATES = re.compile(r"(zero_pp_rank_0_)?mp_rank_(\d+)_model_states\.pt")


def _name_model_states_for_every_stage(folder):
    """A universal load reads the model-states file of its TSP rank (the LR
    scheduler, step counts, client state) under its own ZeRO stage's name:
    ``mp_rank_XX_model_states.pt`` at ZeRO 0-2, ``zero_pp_rank_0_mp_rank_XX_...``
    at ZeRO-3. Each file gets the other name too (a hard link where it can)."""
    for name in os.listdir(folder):
        match = _MODEL_STATES.fullmatch(name)
        if match is None:
            continue
        other = f"mp_rank_{match.group(2)}_model_states.pt" if match.group(1) else f"zero_pp_rank_0_{name}"
        if not os.path.exists(os.path.join(folder, other)):
            link_or_copy(os.path.join(folder, name), os.path.join(folder, other))


def _optimizer_state_for_every_stage(folder):
    """DeepSpeed's converter writes ``zero/optimizer_state.pt`` in the layout of
    the source's ZeRO stage, and the loaders of ZeRO 1-2 and ZeRO-3 read
    different ones (top-level ``param_groups`` and ``ds_version``; the torch
    optimizer's ``optimizer_state_dict`` with its step): complete it for both,
    without ZeRO-3's copy of one partition of the master weights, and with the
    groups of experts folded over replicas (``hyperparameters_for_expert_groups``)."""
    zero = os.path.join(folder, "zero")
    path = os.path.join(zero, "optimizer_state.pt")
    state = torch.load(path, weights_only=False)
    state.pop("fp32_flat_groups", None)
    state.setdefault(DS_VERSION, deepspeed.__version__)
    params = [os.path.join(zero, name) for name in sorted(os.listdir(zero)) if os.path.isdir(os.path.join(zero, name))]
    if OPTIMIZER_STATE_DICT in state:  # from ZeRO-3: ZeRO 1-2 read the step beside each parameter's moments
        step = state[OPTIMIZER_STATE_DICT]["state"][0]["step"]
        for param in params:
            torch.save(step, os.path.join(param, "step.pt"))
    else:  # from ZeRO 1-2: ZeRO-3 reads it from the torch optimizer's state
        step = next(torch.load(os.path.join(p, "step.pt"), weights_only=False) for p in params
                    if os.path.isfile(os.path.join(p, "step.pt")))
        state[OPTIMIZER_STATE_DICT] = {"state": {0: {"step": step}}, PARAM_GROUPS: state[PARAM_GROUPS]}
    _rewrite(path, hyperparameters_for_expert_groups(state))


def _rewrite(path, state):
    """Save ``state`` over the file ``path`` it was read from: beside it, then over
    it, as the file may still be mapped (``_mapped_loads``)."""
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def attach_layout_checks(engine):
    """Make ``engine.save_checkpoint`` write its tag whole (``tags.save_tag``)
    with the engine's layout recorded in it, and
    ``engine.load_checkpoint`` refuse a plain load at another; with
    ``engine.tsp_reshard_on_load`` (the Trainer's resume) it reshards instead."""
    save, load, layout = engine.save_checkpoint, engine.load_checkpoint, engine_layout(engine)

    def save_checkpoint(save_dir, tag=None, *args, **kwargs):
        # Written whole, on every rank or none (``tags``).
        return save_tag(engine, save, save_dir, tag, args, kwargs, also=lambda folder: write_layout(folder, layout))

    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        universal = engine.load_universal_checkpoint()
        if universal and not layout["zero_stage"]:
            # DeepSpeed would load nothing at all, silently.
            raise CheckpointError("\"checkpoint\": {\"load_universal\": true} restores through ZeRO's optimizer, "
                                  "which zero_optimization.stage 0 has none of: use stage 1, 2 or 3")
        if universal and layout["lora"]:
            raise CheckpointError(LORA_RESHARD_REFUSED.format(source=load_dir))
        refusal = load_refusal(load_dir, tag, layout, universal)
        if refusal is None:
            loaded = load(load_dir, tag, *args, **kwargs)
            if universal:
                restore_buffers(engine.module, load_dir, tag)
            return loaded
        if not getattr(engine, "tsp_reshard_on_load", False) or universal or not layout["zero_stage"]:
            raise CheckpointError(refusal)
        return _load_resharded(engine, load, load_dir, tag, *args, **kwargs)

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint


def _load_resharded(engine, load, load_dir, tag, *args, **kwargs):
    """Reshard ``load_dir`` into ``load_dir/universal`` (global rank 0) and load
    that as a universal checkpoint."""
    resharded = os.path.join(load_dir, "universal")
    failure = None
    if comm.group_rank(None) == 0:
        try:
            tag = reshard(load_dir, resharded, tag, force=True)
        except (CheckpointError, OSError) as err:
            failure = str(err)
    # Every rank raises the same error, or none.
    failure, tag = comm.all_gather_objects((failure, tag), None)[0]
    if failure is not None:
        raise CheckpointError(failure)
    # DeepSpeed reads "checkpoint.load_universal" from its parsed config at each load; this one load turns it on.
    config = engine._config
    config.load_universal_checkpoint = True
    try:
        loaded = load(resharded, tag, *args, **kwargs)
    finally:
        config.load_universal_checkpoint = False
    restore_buffers(engine.module, resharded, tag)
    return loaded


@torch.no_grad()
def restore_buffers(module, load_dir, tag=None):
    """Put back ``module``'s persistent buffers (a router's score-correction
    bias) from a universal checkpoint's model-states file, where they keep the
    names they had: DeepSpeed's universal loader restores parameters only.
    TSP keeps such buffers whole on every rank, so one rank's file serves every
    layout; a buffer whose name or shape the checkpoint does not hold is left."""
    tag = resolve_tag(load_dir, tag, universal=True)
    folder = os.path.join(load_dir, tag or "")
    files = sorted(name for name in os.listdir(folder) if _MODEL_STATES.fullmatch(name)) if tag else []
    if not files:
        return
    saved = torch.load(os.path.join(folder, files[0]), map_location="cpu", weights_only=False, mmap=True)
    states = saved.get("module") or {}
    persistent = module.state_dict()
    for name, buffer in module.named_buffers():
        value = states.get(name)
        if name in persistent and value is not None and value.shape == buffer.shape:
            buffer.copy_(value)

