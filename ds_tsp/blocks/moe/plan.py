"""How the sparse MoE block's weights are sharded, and how tokens are grouped by expert.

Rank ``j`` of the expert-parallel group (the TSP group, unless
``tsp.expert_parallel_size`` folds ``ep/D`` data-parallel replicas into it:
``ep`` in place of ``D`` below, DESIGN.md 6k) owns experts ``[j E/D, (j+1) E/D)``: their slices
(dim 0) of every tensor of Hugging Face's experts module, in its own layout
(``experts.ExpertLayout``: ``gate_up_proj`` ``(E, 2F, H)`` and ``down_proj``
``(E, H, F)``, or GPT-OSS's ``(E, H, 2F)``, ``(E, F, H)`` with biases), and,
where the block has one, rows
``[j Fs/D, (j+1) Fs/D)`` of the dense shared expert (``mlp.SHARD_DIMS``:
Qwen2-MoE's ``shared_expert``, DeepSeek-V3-style ``shared_experts``), packed
into one flat buffer, the same under both schedules: a checkpoint does not
know which trained it. The router (``gate`` or ``router``: its parameters and
persistent buffers, such as a score-correction bias, and the buffers the block
holds to hand it, MiniMax-M2's) and Qwen2-MoE's ``shared_expert_gate`` are
replicated.
"""

import inspect
import re
from dataclasses import dataclass

import torch

from ds_tsp.blocks.mlp import MLPPlan
from ds_tsp.blocks.mlp import shard_spec as mlp_shard_spec
from ds_tsp.blocks.moe.experts import ExpertLayout
from ds_tsp.blocks.packing import PackSpec
from ds_tsp.parallel import comm
from ds_tsp.parallel.host_reads import host_read
from ds_tsp.parallel.precision import accumulation_dtype

# The two ways to meet the experts: shards round the ring (ring.py) or tokens by all-to-all (all_to_all.py).
MOE_SCHEDULES = ("ring", "all_to_all")

EXPERTS = "experts"  # the experts module of a Hugging Face sparse MoE block
# Where Hugging Face's blocks keep their router, and their dense shared expert (gated by SHARED_GATE or not).
ROUTER_NAMES = ("gate", "router")
SHARED_NAMES = ("shared_expert", "shared_experts", "shared_mlp")  # the last: Hunyuan-MoE's
SHARED_GATE = "shared_expert_gate"
# A shared expert's projections, with the dim each is split on (mlp.SHARD_DIMS, no biases).
SHARED_DIMS = {"gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1}


def child_named(block, names):
    """The first of ``names`` that is a child module of ``block`` holding tensors, or None."""
    children = dict(block.named_children())
    return next((name for name in names if name in children and children[name].state_dict()), None)


def shared_tensors(shared_name):
    """``{Hugging Face name: split dim}`` of a shared expert at ``shared_name``."""
    return {f"{shared_name}.{name}": dim for name, dim in SHARED_DIMS.items()}


def shard_spec(hidden_size, num_experts, experts, tsp_size, shared_size=0, shared_name="shared_expert",
               expert_parallel_size=None, shared_gated=True):
    """``PackSpec`` of one rank's shard, ``experts`` an ``ExpertLayout``, the
    routed experts split over ``expert_parallel_size`` ranks (None: the TSP
    group), a shared expert gated or not (``shared_gated``: Nemotron-H's is
    ``up``, ``down`` alone); raises if ``E`` (or the shared expert's
    intermediate size) does not split evenly."""
    ep = expert_parallel_size or tsp_size
    if ep != tsp_size and num_experts % ep:
        raise ValueError(f"num_experts {num_experts} is not divisible by tsp.expert_parallel_size {ep}: choose "
                         f"a multiple of tsp.size ({tsp_size}) dividing {num_experts}")
    if num_experts % tsp_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(f"num_experts {num_experts} is not divisible by tsp.size {tsp_size}: every TSP rank holds "
                         f"E/D whole experts; choose tsp.size from {divisors} (that also divides the world size)")
    if shared_size % tsp_size:
        raise ValueError(f"the shared expert's intermediate size {shared_size} is not divisible by tsp.size "
                         f"{tsp_size}: choose tsp.size from the common divisors of {num_experts} and {shared_size}")
    e, f = num_experts // ep, shared_size // tsp_size
    shapes = {name: (e, *shape) for name, shape in experts.shapes.items()}
    if shared_size:
        gate, up, down = shared_tensors(shared_name)
        shapes.update({**({gate: (f, hidden_size)} if shared_gated else {}), up: (f, hidden_size),
                       down: (hidden_size, f)})
    return PackSpec(shapes)


def shard_piece(num_experts, shared_size, tsp_size, name, tsp_rank, ep_size=None, ep_rank=None):
    """``(dim, start, length)`` of the full tensor ``name`` that ``tsp_rank``
    (``ep_rank`` of ``ep_size`` for the routed experts, where they are folded
    past the TSP group) holds, or None if it is not split."""
    if is_routed(name):
        length = num_experts // (ep_size or tsp_size)
        return 0, (tsp_rank if ep_rank is None else ep_rank) * length, length
    shared, _, projection = name.partition(".")
    if shared not in SHARED_NAMES or projection not in SHARED_DIMS:
        return None
    length = shared_size // tsp_size
    return SHARED_DIMS[projection], tsp_rank * length, length


def router_inputs(block, router):
    """Names of the buffers ``block`` holds itself and hands its router by name
    (MiniMax-M2's ``e_score_correction_bias``: ``gate(hidden, e_score_correction_bias)``)."""
    taken = list(inspect.signature(router.forward).parameters)[1:]
    return [name for name in taken if name in block._buffers and block._buffers[name] is not None]


def replicated_tensors(router, router_name, shared_gate=None, block_inputs=None, input_norm=None):
    """``{Hugging Face name: tensor}`` of what every rank keeps whole: the
    router's parameters and persistent buffers, the block's own buffers it
    hands the router (``block_inputs``: ``{name: tensor}``), the shared
    expert's gate, and the norm of the experts' inputs (``input_norm``: ``{name: module}``)."""
    tensors = {f"{router_name}.{name}": tensor for name, tensor in router.state_dict(keep_vars=True).items()}
    tensors.update(block_inputs or {})
    for norm_name, norm in (input_norm or {}).items():
        tensors.update({f"{norm_name}.{name}": tensor for name, tensor in norm.state_dict(keep_vars=True).items()})
    if shared_gate is not None:
        tensors.update({f"{SHARED_GATE}.{name}": tensor
                        for name, tensor in shared_gate.state_dict(keep_vars=True).items()})
    return tensors


def replicated_names(hf_moe, input_norm_name=None):
    """Hugging Face names of the tensors of a sparse MoE block every rank keeps
    whole; ``input_norm_name``: the norm of its experts' inputs (``TSPSparseMoE.input_norm``), or None."""
    router_name = child_named(hf_moe, ROUTER_NAMES)
    router = hf_moe.get_submodule(router_name)
    norm = {} if input_norm_name is None else {input_norm_name: hf_moe.get_submodule(input_norm_name)}
    return list(replicated_tensors(router, router_name, getattr(hf_moe, SHARED_GATE, None),
                                   {name: hf_moe._buffers[name] for name in router_inputs(hf_moe, router)}, norm))


def is_routed(name):
    """Whether ``name`` (under the block) is a tensor of the routed experts."""
    return name.startswith(f"{EXPERTS}.")


def hf_sizes(hf_moe):
    """``(hidden_size, num_experts, experts, shared_size, shared_name)`` of a
    Hugging Face sparse MoE block: ``experts`` its ``ExpertLayout``,
    ``shared_name`` None without a shared expert."""
    experts = ExpertLayout.of(hf_moe.experts, EXPERTS)
    num_experts = hf_moe.experts.down_proj.shape[0]
    hidden_size = hf_moe.experts.down_proj.shape[-1 if experts.transposed else 1]
    shared_name = child_named(hf_moe, SHARED_NAMES)
    shared_size = 0 if shared_name is None else hf_moe.get_submodule(shared_name).up_proj.out_features
    return hidden_size, num_experts, experts, shared_size, shared_name


def shared_is_gated(hf_moe):
    """Whether the Hugging Face block's shared expert (if any) is a gated MLP (``gate_proj``: all but Nemotron-H's)."""
    shared_name = child_named(hf_moe, SHARED_NAMES)
    return shared_name is None or hasattr(hf_moe.get_submodule(shared_name), "gate_proj")


# Llama 4's block: each routed row is the token times its routing score, the experts' outputs summed unweighted.
SCALED_EXPERT_INPUTS = re.compile(r"routed_in\s*=\s*routed_in\s*\*\s*router_scores")


def scales_expert_inputs(hf_moe):
    """Whether the Hugging Face block ``hf_moe``'s forward multiplies each
    expert's input by its routing weight instead of its output (Llama 4's)."""
    try:
        source = inspect.getsource(type(hf_moe).forward)
    except (OSError, TypeError):
        return False
    return SCALED_EXPERT_INPUTS.search(source) is not None


def expert_rows(x, weights, plan):
    """What an expert computes on: the tokens ``x`` ``(n, H)``, or, where
    routing scales the inputs (``plan.scales_inputs``), the tokens times their
    routing ``weights`` ``(n, 1)`` in ``x``'s dtype, as Hugging Face's product."""
    return (x * weights).to(x.dtype) if plan.scales_inputs else x


def shared_weights(w):
    """The shared expert's slice from an unpacked shard, under the gated MLP's names."""
    return {name.partition(".")[2]: tensor for name, tensor in w.items() if not is_routed(name)}


def expert_counts(index, num_experts):
    """``(E,)`` int64 where ``index`` is: how many ``(token, slot)`` chose each
    expert. A scatter-add, not ``bincount``, which sizes its output on the host."""
    flat = index.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


@dataclass(frozen=True)
class Routing:
    """The local tokens grouped by expert: ``tokens[offsets[e]:offsets[e+1]]``
    chose expert ``e`` in top-k slot ``slots[...]``."""

    tokens: torch.Tensor
    slots: torch.Tensor
    offsets: tuple

    @classmethod
    def of(cls, index, num_experts, counts=None):
        """From the router's ``(N, k)`` expert indices; ``counts``: their
        ``expert_counts`` already on the host, else read here (one host read)."""
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        if counts is None:
            counts = host_read(expert_counts(index, num_experts), "moe routing")
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
    experts: ExpertLayout
    act_fn: object  # the shared expert's activation (None without one)
    group: object
    num_experts: int
    shared: bool = False
    overlap: bool = True
    token_tile: int = 0  # most tokens one expert (or the shared slice) computes at once (0: all)
    fp32_accumulators: bool = True
    grad_wire_dtype: object = None  # the gradient accumulators' wire dtype (gradient_wire_dtype; None: float32)
    schedule: object = "ring"  # one of MOE_SCHEDULES, or a chooser per shape (TSPSparseMoE.schedule_for)
    # Routing weights scale each expert's input, not its output (Llama 4's block: expert(x * w), summed).
    scales_inputs: bool = False

    @property
    def routed_spec(self):
        """``PackSpec`` of the routed experts alone, the head of ``spec``: what
        the all-to-all schedule keeps at rest."""
        return PackSpec({name: self.spec.shapes[name] for name in self.experts.names})

    @property
    def shared_plan(self):
        """The shared expert's slice (the tail of ``spec``) as a dense MLP shard
        on the MLP's ring, for the all-to-all schedule."""
        tsp_size = comm.group_size(self.group)
        shared_down = next(shape for name, shape in self.spec.shapes.items() if name.endswith(".down_proj.weight"))
        gated = any(name.endswith(".gate_proj.weight") for name in self.spec.shapes if not is_routed(name))
        spec = mlp_shard_spec(shared_down[0], shared_down[1] * tsp_size, tsp_size, bias=False, gated=gated)
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
