"""How the sparse MoE block's weights are sharded, and how tokens are grouped by expert.

Rank ``j`` of the TSP group owns experts ``[j E/D, (j+1) E/D)``: their slices
of Hugging Face's fused ``experts.gate_up_proj`` ``(E, 2F, H)`` and
``experts.down_proj`` ``(E, H, F)`` (dim 0), and, for Qwen2-MoE, rows
``[j Fs/D, (j+1) Fs/D)`` of the dense shared expert (``mlp.SHARD_DIMS``),
packed into one flat buffer, the same under both schedules: a checkpoint does
not know which trained it. The router (``gate``) and Qwen2-MoE's
``shared_expert_gate`` are replicated.
"""

from dataclasses import dataclass

import torch

from ds_tsp.blocks.mlp import MLPPlan
from ds_tsp.blocks.mlp import shard_spec as mlp_shard_spec
from ds_tsp.blocks.packing import PackSpec
from ds_tsp.parallel import comm
from ds_tsp.parallel.precision import accumulation_dtype

# The two ways to meet the experts: shards round the ring (ring.py) or tokens by all-to-all (all_to_all.py).
MOE_SCHEDULES = ("ring", "all_to_all")

GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"
# The shared expert's tensors, with the dim each is split on (mlp.SHARD_DIMS, no biases).
SHARED = {"shared_expert.gate_proj.weight": 0, "shared_expert.up_proj.weight": 0, "shared_expert.down_proj.weight": 1}
# Which dim of each full Hugging Face tensor is split across the TSP group; the
# router and the shared expert's gate are replicated.
SHARD_DIMS = {GATE_UP: 0, DOWN: 0, **SHARED}
ROUTER, SHARED_GATE = "gate.weight", "shared_expert_gate.weight"


def shard_spec(hidden_size, num_experts, expert_size, tsp_size, shared_size=0):
    """``PackSpec`` of one rank's shard; raises if ``E`` (or the shared expert's
    intermediate size) does not split evenly."""
    if num_experts % tsp_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(f"num_experts {num_experts} is not divisible by tsp.size {tsp_size}: every TSP rank holds "
                         f"E/D whole experts; choose tsp.size from {divisors} (that also divides the world size)")
    if shared_size % tsp_size:
        raise ValueError(f"shared_expert_intermediate_size {shared_size} is not divisible by tsp.size {tsp_size}: "
                         f"choose tsp.size from the common divisors of {num_experts} and {shared_size}")
    e, f = num_experts // tsp_size, shared_size // tsp_size
    shapes = {GATE_UP: (e, 2 * expert_size, hidden_size), DOWN: (e, hidden_size, expert_size)}
    if shared_size:
        shapes.update({"shared_expert.gate_proj.weight": (f, hidden_size),
                       "shared_expert.up_proj.weight": (f, hidden_size),
                       "shared_expert.down_proj.weight": (hidden_size, f)})
    return PackSpec(shapes)


def shard_piece(num_experts, shared_size, tsp_size, name, tsp_rank):
    """``(dim, start, length)`` of the full tensor ``name`` that ``tsp_rank``
    holds, or None if it is not split."""
    if name not in SHARD_DIMS:
        return None
    length = (num_experts if name in (GATE_UP, DOWN) else shared_size) // tsp_size
    return SHARD_DIMS[name], tsp_rank * length, length


def replicated_names(hf_moe):
    """Hugging Face names of the tensors of a sparse MoE block every rank keeps whole."""
    return [ROUTER] + ([SHARED_GATE] if getattr(hf_moe, "shared_expert_gate", None) is not None else [])


def hf_sizes(hf_moe):
    """``(hidden_size, num_experts, expert_size, shared_size)`` of a Hugging Face sparse MoE block."""
    experts = hf_moe.experts
    num_experts, two_f, hidden_size = experts.gate_up_proj.shape
    shared = getattr(hf_moe, "shared_expert", None)
    return hidden_size, num_experts, two_f // 2, 0 if shared is None else shared.gate_proj.out_features


def expert_weights(w, local, expert_size):
    """One expert's weights from an unpacked shard, under the gated MLP's names (views)."""
    gate_up = w[GATE_UP][local]
    return {"gate_proj.weight": gate_up[:expert_size], "up_proj.weight": gate_up[expert_size:],
            "down_proj.weight": w[DOWN][local]}


def shared_weights(w):
    """The shared expert's slice from an unpacked shard, under the gated MLP's names."""
    return {name.removeprefix("shared_expert."): w[name] for name in SHARED}


@dataclass(frozen=True)
class Routing:
    """The local tokens grouped by expert: ``tokens[offsets[e]:offsets[e+1]]``
    chose expert ``e`` in top-k slot ``slots[...]``."""

    tokens: torch.Tensor
    slots: torch.Tensor
    offsets: tuple

    @classmethod
    def of(cls, index, num_experts):
        """From the router's ``(N, k)`` expert indices."""
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        top_k = index.shape[-1]
        return cls(order // top_k, order % top_k, (0, *counts.cumsum(0).tolist()))

    def of_expert(self, expert, tile):
        """``[(tokens, slots)]`` of ``expert``, in pieces of at most ``tile`` tokens (0: one piece)."""
        start, end = self.offsets[expert], self.offsets[expert + 1]
        size = tile or max(end - start, 1)
        return [(self.tokens[s:min(s + size, end)], self.slots[s:min(s + size, end)]) for s in range(start, end, size)]


@dataclass(frozen=True)
class MoEPlan:
    """Everything either schedule needs besides tensors."""

    spec: PackSpec
    act_fn: object
    group: object
    num_experts: int
    expert_size: int
    shared: bool = False
    overlap: bool = True
    token_tile: int = 0  # most tokens one expert (or the shared slice) computes at once (0: all)
    fp32_accumulators: bool = True
    grad_wire_dtype: object = None  # the gradient accumulators' wire dtype (gradient_wire_dtype; None: float32)
    schedule: object = "ring"  # one of MOE_SCHEDULES, or a chooser per shape (TSPSparseMoE.schedule_for)

    @property
    def routed_spec(self):
        """``PackSpec`` of the routed experts alone, the head of ``spec``: what
        the all-to-all schedule keeps at rest."""
        return PackSpec({name: self.spec.shapes[name] for name in (GATE_UP, DOWN)})

    @property
    def shared_plan(self):
        """The shared expert's slice (the tail of ``spec``) as a dense MLP shard
        on the MLP's ring, for the all-to-all schedule."""
        tsp_size = comm.group_size(self.group)
        spec = mlp_shard_spec(self.spec.shapes[DOWN][1], self.spec.shapes["shared_expert.down_proj.weight"][1] *
                              tsp_size, tsp_size, bias=False)
        return MLPPlan(spec, self.act_fn, self.group, self.overlap, self.token_tile, self.fp32_accumulators,
                       self.grad_wire_dtype)

    @property
    def experts_per_rank(self):
        return self.num_experts // comm.group_size(self.group)

    def held_experts(self, t):
        """``[(local index, global expert)]`` of the shard held at ring step ``t``."""
        tsp_size = comm.group_size(self.group)
        owner = (comm.group_rank(self.group) - t) % tsp_size
        per_rank = self.num_experts // tsp_size
        return [(local, owner * per_rank + local) for local in range(per_rank)]

    def tiles(self, num_tokens):
        size = self.token_tile or num_tokens
        return [(start, min(start + size, num_tokens)) for start in range(0, num_tokens, max(size, 1))]

    def accumulator_dtype(self, dtype):
        return accumulation_dtype(dtype) if self.fp32_accumulators else dtype
