"""The ``pp x dp x tsp`` device mesh, its process groups and DeepSpeed's ``mpu``.

TSP is the innermost axis: the ranks of one TSP group are consecutive, so a
group stays inside one node and its weight and K/V traffic on the fast links.
Global rank = ``(pp_rank * dp + dp_rank) * tsp + tsp_rank``.

Experts fold over ``ep`` consecutive ranks of a stage (DESIGN.md 6k): the TSP
group and ``ep / tsp`` data-parallel replicas beside it. An expert's
gradients are summed over its expert-data-parallel group: the ranks holding
the same experts, one in each expert-parallel group of the stage. Folded
past the TSP group, both are DeepSpeed's expert groups (``deepspeed.utils.groups``,
named ``ep_size_<ep>``, the layout DeepSpeed's own "sp" ordering builds), so its
engine and ZeRO reduce and partition the experts over them.
"""

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from deepspeed.utils import groups as ds_groups

from ds_tsp.config import TSPConfig


@dataclass(frozen=True)
class MeshShape:
    """Degrees of the mesh; validated to multiply to the world size."""

    pp: int
    dp: int
    tsp: int
    ep: int = 0  # expert-parallel size (0: tsp), a multiple of tsp dividing dp x tsp

    @classmethod
    def for_world(cls, world_size, tsp_size, pipeline_stages=1, expert_parallel_size=None):
        """The mesh with data parallelism filling what TSP and pipelines leave;
        sizes that cannot tile the world raise ``TSPConfigError``."""
        config = TSPConfig(size=tsp_size, pipeline_stages=pipeline_stages, expert_parallel_size=expert_parallel_size)
        return cls(pp=pipeline_stages, dp=config.check_world(world_size), tsp=tsp_size,
                   ep=config.expert_parallel(world_size))

    @property
    def experts_size(self):
        return self.ep or self.tsp

    def rank(self, pp_rank, dp_rank, tsp_rank):
        return (pp_rank * self.dp + dp_rank) * self.tsp + tsp_rank

    def coords(self, rank):
        """``(pp_rank, dp_rank, tsp_rank)`` of a global rank."""
        return rank // (self.dp * self.tsp), rank // self.tsp % self.dp, rank % self.tsp

    def tsp_groups(self):
        return [[self.rank(p, d, t) for t in range(self.tsp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self):
        return [[self.rank(p, d, t) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tsp)]

    def pp_groups(self):
        return [[self.rank(p, d, t) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tsp)]

    def ep_groups(self):
        """Consecutive ranks of a stage that split the experts: the TSP group and the replicas beside it."""
        stage, ep = self.dp * self.tsp, self.experts_size
        return [[p * stage + g * ep + i for i in range(ep)] for p in range(self.pp) for g in range(stage // ep)]

    def edp_groups(self):
        """The ranks of a stage that hold the same experts: one in each expert-parallel group."""
        stage, ep = self.dp * self.tsp, self.experts_size
        return [[p * stage + g * ep + i for g in range(stage // ep)] for p in range(self.pp) for i in range(ep)]


class TSPTopology:
    """This rank's place in the mesh and the process groups it belongs to.

    Must be built on every rank (group creation is collective). Works without
    torch.distributed for a single process.
    """

    def __init__(self, tsp_size, pipeline_stages=1, timeout_minutes=10.0, expert_parallel_size=None):
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.mesh = MeshShape.for_world(world_size, tsp_size, pipeline_stages, expert_parallel_size)
        self.rank = rank
        self.pp_rank, self.dp_rank, self.tsp_rank = self.mesh.coords(rank)
        timeout = timedelta(minutes=timeout_minutes)
        self.tsp_ranks, self.tsp_group = self._own_group(self.mesh.tsp_groups(), timeout)
        self.dp_ranks, self.dp_group = self._own_group(self.mesh.dp_groups(), timeout)
        self.pp_ranks, self.pp_group = self._own_group(self.mesh.pp_groups(), timeout)
        if self.mesh.experts_size == tsp_size:  # the experts split over the TSP group; their replicas are DP's
            self.ep_ranks, self.ep_group, self.edp_ranks, self.edp_group = (self.tsp_ranks, self.tsp_group,
                                                                            self.dp_ranks, self.dp_group)
        else:
            self.ep_ranks, self.ep_group = self._own_group(self.mesh.ep_groups(), timeout)
            self.edp_ranks, self.edp_group = self._own_group(self.mesh.edp_groups(), timeout)
            self._register_expert_groups()

    @classmethod
    def of(cls, tsp_config):
        """The topology a ``TSPConfig`` asks for."""
        return cls(tsp_config.size, tsp_config.pipeline_stages, tsp_config.timeout_minutes,
                   tsp_config.expert_parallel_size)

    @property
    def folds_experts(self):
        """Whether the experts split over more ranks than the TSP group."""
        return self.ep_size != self.tsp_size

    @property
    def expert_group_name(self):
        """DeepSpeed's name of the expert-parallel group (``deepspeed.utils.groups``)."""
        return f"ep_size_{self.ep_size}"

    def _register_expert_groups(self):
        """Hand DeepSpeed this rank's expert-parallel and expert-data-parallel
        groups under its own name, as its ``_create_expert_and_data_parallel``
        would build them (with this topology's timeout), for its engine and
        ZeRO to find by the experts' ``group_name``."""
        if not dist.is_initialized():
            return
        name = self.expert_group_name
        ds_groups._EXPERT_PARALLEL_GROUP[name], ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name] = (self.ep_group,
                                                                                                self.ep_ranks)
        ds_groups._EXPERT_DATA_PARALLEL_GROUP[name], ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = (
            self.edp_group, self.edp_ranks)

    def _own_group(self, all_groups, timeout):
        mine = None
        for ranks in all_groups:
            group = dist.new_group(ranks, timeout=timeout) if dist.is_initialized() else None
            if self.rank in ranks:
                mine = (ranks, group)
        return mine

    @property
    def tsp_size(self):
        return self.mesh.tsp

    @property
    def dp_size(self):
        return self.mesh.dp

    @property
    def pp_size(self):
        return self.mesh.pp

    @property
    def ep_size(self):
        """Ranks that split the experts (``tsp.expert_parallel_size``)."""
        return self.mesh.experts_size

    @property
    def ep_rank(self):
        return self.ep_ranks.index(self.rank)

    @property
    def ring_next(self):
        """Global rank of the next rank in this TSP group's ring."""
        return self.tsp_ranks[(self.tsp_rank + 1) % self.tsp_size]

    @property
    def ring_prev(self):
        """Global rank of the previous rank in this TSP group's ring."""
        return self.tsp_ranks[(self.tsp_rank - 1) % self.tsp_size]

    def mpu(self):
        return TSPMpu(self)

    def __repr__(self):
        return (f"TSPTopology(rank={self.rank}, pp={self.pp_size}, dp={self.dp_size}, tsp={self.tsp_size}, "
                f"tsp_ranks={self.tsp_ranks}, dp_ranks={self.dp_ranks})")


class TSPMpu:
    """The ``mpu`` duck type DeepSpeed takes in ``deepspeed.initialize``.

    Model parallel = the TSP group (its parameters are sharded there, so
    gradient norms count tagged shards on every TSP rank and replicated
    parameters once); data parallel = the true DP replicas, so ZeRO partitions
    and reduces over DP only. Sequence parallelism reports size 1: TSP shards
    the sequence itself and must not make DeepSpeed reduce over the world.
    ``get_sequence_data_parallel_group`` and ``initialize_sequence_parallel``
    are deliberately absent: their presence makes DeepSpeed 0.19 reduce and
    broadcast over the whole world, overwriting TSP shards.
    """

    def __init__(self, topology):
        self.topology = topology

    def get_model_parallel_group(self):
        return self.topology.tsp_group

    def get_model_parallel_rank(self):
        return self.topology.tsp_rank

    def get_model_parallel_world_size(self):
        return self.topology.tsp_size

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self):
        return self.topology.tsp_ranks[0]

    def get_data_parallel_group(self):
        return self.topology.dp_group

    def get_data_parallel_rank(self):
        return self.topology.dp_rank

    def get_data_parallel_world_size(self):
        return self.topology.dp_size

    def get_pipe_parallel_group(self):
        return self.topology.pp_group

    def get_pipe_parallel_rank(self):
        return self.topology.pp_rank

    def get_pipe_parallel_world_size(self):
        return self.topology.pp_size

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_sequence_parallel_world_size(self):
        return 1

    def get_sequence_parallel_rank(self):
        return 0
