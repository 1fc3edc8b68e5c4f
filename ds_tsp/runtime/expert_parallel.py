"""Experts folded over data-parallel replicas, handed to DeepSpeed's own MoE machinery.

With ``tsp.expert_parallel_size`` > ``tsp.size`` a sparse block's experts
differ between the replicas of one expert-parallel group (DESIGN.md 6k), so
their gradients must be reduced over the expert-data-parallel group, their
optimizer states partitioned over it, and the engine must not broadcast them
from replica 0. DeepSpeed does all three for its experts: parameters tagged
``allreduce = False`` with a ``group_name`` (``TSPSparseMoE`` tags its shard),
groups registered under that name (``TSPTopology``), optimizer parameter
groups marked ``moe`` (``expert_param_groups``), and an engine that knows the
model has MoE layers. The engine learns that from the classes of the model's
modules (its ``MoE`` and AutoEP's layer), so every folded block carries a
weightless ``DeepSpeedExpertLayer`` (``declare_expert_layers``).

Checkpoints: DeepSpeed writes the model states from replica 0 alone and its
own experts into files of their own, which it names by its MoE layers'
modules; the folded shards are in each rank's ZeRO optimizer file, as float32
masters, and a plain load puts them back into the weights from there
(``load_experts_from_their_masters``).

DeepSpeed refuses ZeRO-3 with its own MoE layers; without ZeRO its fp32
gradient clipping averages the replicas' norms, each of which counts only
the experts its replica holds; and pipelines would need the expert groups
per stage in its pipeline grid: all three are refused with folded experts,
before any weight is loaded (``check_expert_parallel_run``). ZeRO 1-2 count
each expert once: every rank sums its own partitions' squares, summed over
the data-parallel and the TSP group.
"""

import torch
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import safe_get_full_fp32_param
from torch import nn

from ds_tsp.blocks.moe.module import TSPSparseMoE
from ds_tsp.config import TSPConfigError

# The attribute under which a folded block keeps its DeepSpeedExpertLayer.
DECLARATION = "deepspeed_expert_layer"


class DeepSpeedExpertLayer(MoE):
    """What DeepSpeed's engine recognises as an MoE layer, weightless: its
    ``num_experts`` and ``expert_group_name``, for the engine's bookkeeping.
    The experts are the TSP block's shard; this holds none of them
    (``num_local_experts`` 0, so DeepSpeed writes no per-expert files: the
    shard is in the model states and ZeRO's partitions), and the groups are
    the topology's, already registered."""

    def __init__(self, num_experts, ep_size):
        nn.Module.__init__(self)  # MoE's own constructor builds experts and groups; this takes neither
        self.num_experts, self.ep_size = num_experts, ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_local_experts = 0

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_=False):
        """The groups are ``TSPTopology``'s, registered under ``expert_group_name``."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("DeepSpeedExpertLayer only declares a TSP block's folded experts to DeepSpeed")


def declare_expert_layers(model):
    """Give every folded ``TSPSparseMoE`` of ``model`` its ``DeepSpeedExpertLayer``."""
    for block in model.modules():
        if isinstance(block, TSPSparseMoE) and block.folded and not hasattr(block, DECLARATION):
            block.add_module(DECLARATION, DeepSpeedExpertLayer(block.num_experts, block.ep_size))


def expert_param_groups(model_parameters):
    """``model_parameters`` (parameters, or parameter groups) with the folded
    experts in groups of their own, marked ``moe`` and named by their expert
    group, as DeepSpeed's ZeRO 1-2 partitions them; unchanged without any."""
    groups = list(model_parameters)
    if not any(is_moe_param(p) for entry in groups for p in (entry["params"] if isinstance(entry, dict) else [entry])):
        return model_parameters
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    named = [{"name": f"tsp-params-{index}", **group} for index, group in enumerate(groups)]
    return split_params_into_different_moe_groups_for_optimizer(named)


def check_expert_parallel_run(ds_config, tsp_config):
    """Refuse what DeepSpeed cannot run with folded experts, naming the keys."""
    if not tsp_config.folds_experts:
        return
    ep = tsp_config.expert_parallel_size
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    if stage == 3:
        raise TSPConfigError(f"tsp.expert_parallel_size = {ep} with zero_optimization.stage = 3: DeepSpeed's ZeRO-3 "
                             "does not partition MoE experts over their expert-data-parallel group; use stage 1 or "
                             "2, or remove tsp.expert_parallel_size (ZeRO-3 then partitions the experts over the "
                             "replicas)")
    if stage == 0:
        raise TSPConfigError(f"tsp.expert_parallel_size = {ep} with zero_optimization.stage = 0: without ZeRO, "
                             "DeepSpeed clips gradients by the mean of the replicas' norms, each counting only the "
                             "experts its replica holds; use stage 1 or 2")
    if tsp_config.pipeline_stages > 1:
        raise TSPConfigError(f"tsp.expert_parallel_size = {ep} with tsp.pipeline_stages = "
                             f"{tsp_config.pipeline_stages} is not supported: set tsp.pipeline_stages to 1, or "
                             "remove tsp.expert_parallel_size")


def load_experts_from_their_masters(engine):
    """Make ``engine.load_checkpoint`` of a model with folded experts take
    them from this rank's float32 masters (its own ZeRO optimizer file), not
    from the model states, which hold replica 0's; refuse the loads that read
    the model states alone."""
    experts = [p for p in engine.module.parameters() if is_moe_param(p)]
    if not experts:
        return
    load = engine.load_checkpoint

    def load_checkpoint(load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, **kwargs):
        if load_module_only or not load_optimizer_states:
            raise ValueError("with tsp.expert_parallel_size folding experts over replicas, each rank's experts are "
                             "in its ZeRO optimizer file, the model states hold replica 0's: load with "
                             "load_optimizer_states=True and load_module_only=False")
        loaded = load(load_dir, tag, load_module_strict=load_module_strict, load_optimizer_states=True,
                      load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=False, **kwargs)
        with torch.no_grad():
            for param in experts:
                param.copy_(safe_get_full_fp32_param(param))
        return loaded

    engine.load_checkpoint = load_checkpoint
