"""Universal checkpoints of experts folded over data-parallel replicas (``tsp.expert_parallel_size``).

A folded MoE block's shard differs between the replicas of an expert-parallel
group, and ZeRO 1-2 keep it in parameter groups of their own (marked ``moe``)
partitioned over its expert-data-parallel group. DeepSpeed's converter
(``ds_to_universal``) would join those as the data-parallel partitions of one
tensor per TSP rank, so ``reshard`` hands it the checkpoint without them
(``without_folded_experts``: the optimizer files and model states rewritten
without the ``moe`` groups, every other file linked) and writes their
universal tensors here (``write_folded_experts``): for each expert-parallel
rank ``e``, its shard is the fragments of the ranks ``x * ep + e`` of its
expert-data-parallel group joined in order, and the shards of all ``ep``
ranks rebuild the full tensor through the block's map over them
(``universal.FOLDED_EXPERTS``). The result is the universal tensor an
unfolded run writes for the same block, so either loads the other's.
"""

import os
import re

import torch
from deepspeed.checkpoint.affine import SCALE_POWER_BY_STATE, ParamAffineMap
from deepspeed.checkpoint.constants import (
    BASE_OPTIMIZER_STATE,
    OPTIMIZER_STATE_DICT,
    PARAM,
    PARAM_GROUPS,
    PARAM_SHAPES,
    UNIVERSAL_CHECKPOINT_INFO,
)

from ds_tsp.checkpoint.staging import link_or_copy
from ds_tsp.checkpoint.universal import FOLDED_EXPERTS

_OPTIMIZER_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MODEL_STATES_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
# The ZeRO 1-2 optimizer file's lists with one entry per parameter group.
_PER_GROUP = ("single_partition_of_fp32_groups", "group_paddings", "param_alignment_paddings", "partition_count",
              "param_slice_mappings")
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def folded_maps(source):
    """``{parameter name: ParamAffineMap over its expert-parallel group}`` of
    the checkpoint folder ``source`` (empty: no folded experts)."""
    name = next((n for n in sorted(os.listdir(source)) if _MODEL_STATES_FILE.fullmatch(n)), None)
    if name is None:
        return {}
    info = torch.load(os.path.join(source, name), map_location="cpu", weights_only=False,
                      mmap=True).get(UNIVERSAL_CHECKPOINT_INFO) or {}
    return {param: ParamAffineMap.from_dict(entry) for param, entry in info.get(FOLDED_EXPERTS, {}).items()}


def _expert_groups(optimizer_state):
    return [i for i, group in enumerate(optimizer_state[BASE_OPTIMIZER_STATE][PARAM_GROUPS]) if group.get("moe")]


def without_folded_experts(source, scratch):
    """A copy of the checkpoint folder ``source`` in ``scratch`` without the
    folded experts, for DeepSpeed's converter: the ZeRO files without their
    parameter groups, the model states without their shapes and weights,
    every other file linked."""
    os.makedirs(scratch)
    for name in sorted(os.listdir(source)):
        path, out = os.path.join(source, name), os.path.join(scratch, name)
        if _OPTIMIZER_FILE.fullmatch(name):
            saved = torch.load(path, map_location="cpu", weights_only=False)
            inner = saved[OPTIMIZER_STATE_DICT]
            drop = set(_expert_groups(inner))
            for key in _PER_GROUP:
                inner[key] = [entry for i, entry in enumerate(inner[key]) if i not in drop]
            base = inner[BASE_OPTIMIZER_STATE]
            kept = [i for i in range(len(base[PARAM_GROUPS])) if i not in drop]
            base[PARAM_GROUPS] = [base[PARAM_GROUPS][i] for i in kept]
            base["state"] = {new: base["state"][old] for new, old in enumerate(kept) if old in base["state"]}
            torch.save(saved, out)
        elif _MODEL_STATES_FILE.fullmatch(name):
            saved = torch.load(path, map_location="cpu", weights_only=False)
            experts = set(saved[UNIVERSAL_CHECKPOINT_INFO].get(FOLDED_EXPERTS, {}))
            saved[PARAM_SHAPES] = [shapes for shapes in saved[PARAM_SHAPES] if not experts & set(shapes)]
            # Replica 0's experts, which the converter would take for parameters without optimizer state.
            saved["module"] = {key: value for key, value in saved["module"].items() if key not in experts}
            torch.save(saved, out)
        elif os.path.isfile(path):
            link_or_copy(path, out)
    return scratch


def write_folded_experts(source, layout, zero, maps):
    """``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`` of every folded
    expert parameter of the checkpoint folder ``source`` saved at ``layout``
    (``tsp``, ``dp``, ``ep``), ``maps`` its ``folded_maps``."""
    tsp, ep = layout["tsp"], layout["ep"]
    world = tsp * layout["dp"]
    files = {}
    for name in os.listdir(source):
        match = _OPTIMIZER_FILE.fullmatch(name)
        if match:
            files[int(match.group(1)) * tsp + int(match.group(2))] = os.path.join(source, name)
    if sorted(files) != list(range(world)):
        raise FileNotFoundError(f"{source} holds ZeRO files of ranks {sorted(files)}, not of all {world}")
    fragments = {}  # (parameter, state) -> {expert-parallel rank: [fragments in expert-data-parallel order]}
    step = None
    for rank in range(world):
        inner = torch.load(files[rank], map_location="cpu", weights_only=False, mmap=True)[OPTIMIZER_STATE_DICT]
        for group in _expert_groups(inner):
            flat = {"fp32": inner["single_partition_of_fp32_groups"][group],
                    **{key: value for key, value in inner[BASE_OPTIMIZER_STATE]["state"][group].items()
                       if key in STATES}}
            step = inner[BASE_OPTIMIZER_STATE]["state"][group]["step"]
            for param, address in inner["param_slice_mappings"][group].items():
                for state, values in flat.items():
                    piece = values.narrow(0, address.start, address.numel).clone()
                    fragments.setdefault((param, state), {}).setdefault(rank % ep, []).append((rank // ep, piece))
    for param, affine in maps.items():
        folder = os.path.join(zero, param)
        os.makedirs(folder)
        for state in STATES:
            shards = {e: torch.cat([piece for _, piece in sorted(held)]) for e, held in
                      fragments[(param, state)].items()}
            full = affine.rebuild(shards, SCALE_POWER_BY_STATE.get(state, 1))
            torch.save({PARAM: full.reshape(-1)}, os.path.join(folder, f"{state}.pt"))
        torch.save(step, os.path.join(folder, "step.pt"))


def hyperparameters_for_expert_groups(optimizer_state):
    """The universal ``optimizer_state.pt`` with a hyperparameter-only copy of
    each parameter group appended: ZeRO 1-2 restore group ``i`` from entry
    ``i``, and an engine with folded experts has their groups after the dense
    ones, one per dense group (DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``);
    without them, those groups would load nothing. An engine without folded
    experts reads only the first entries."""
    groups = optimizer_state[PARAM_GROUPS]
    optimizer_state[PARAM_GROUPS] = groups + [{key: value for key, value in group.items()
                                               if key not in ("params", "name", "moe")} for group in groups]
    return optimizer_state
