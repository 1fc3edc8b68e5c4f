"""The TSP sparse mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE).

Each rank holds ``E/D`` whole experts and, for Qwen2-MoE, a slice of the
shared expert (``plan.py``). The router and the shared expert's gate are
Hugging Face's own modules, replicated, run on the local tokens: routing
(softmax dtype, top-k, ``norm_topk_prob``, the weights' dtype) is HF's by
construction. Two schedules meet tokens and experts, ``tsp.moe_schedule``:
expert shards travel round a ring while tokens stay put (``ring.py``), or
experts stay at rest while tokens go to them by all-to-all
(``all_to_all.py``). The ring's bytes are fixed and the all-to-all's grow
with the sequence, so "auto" hands the block a chooser
(``ds_tsp.planning.cheaper_moe_schedule``, see ``TSPSparseMoE.schedule_for``)
that takes the cheaper for each layer's local token count; at 32K tokens the
all-to-all moves about 9x fewer bytes for Qwen3-30B-A3B at D=8.
``ds_tsp.planning.moe_block_bytes_by_op`` holds both formulas.

Decoding (``decode_share``) uses neither schedule: every rank holds the
step's tokens, runs its own experts on those routed to them and the shares
are summed. The router logits and the load-balancing loss: ``load_balancing.py``.
"""

import copy
import logging

import torch
import torch.distributed as dist
from torch import nn

from ds_tsp.blocks.mlp import shard_forward as gated_shard_forward
from ds_tsp.blocks.moe.all_to_all import moe_all_to_all
from ds_tsp.blocks.moe.plan import (
    MOE_SCHEDULES,
    ROUTER,
    SHARED_GATE,
    MoEPlan,
    Routing,
    expert_weights,
    hf_sizes,
    shard_piece,
    shard_spec,
    shared_weights,
)
from ds_tsp.blocks.moe.ring import moe_ring
from ds_tsp.blocks.packing import PackedShardMixin, module_reader
from ds_tsp.parallel import comm
from ds_tsp.parallel.amp import _compute_dtype
from ds_tsp.parallel.ring import RingWireDtypeMixin

logger = logging.getLogger("ds_tsp")

# What tsp.moe_schedule "auto" has said in the log: each choice once per shape, not once per layer.
_announced = set()


class TSPSparseMoE(RingWireDtypeMixin, PackedShardMixin, nn.Module):
    """A Hugging Face sparse MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE) over the
    local tokens, experts sharded ``E/D`` per rank, moved by a ring or met by a
    token all-to-all (``tsp.moe_schedule``, see the module docstring).

    Parameters: ``packed``, this rank's experts (and shared-expert slice) laid
    out by ``self.spec``, tagged ``tensor_model_parallel``; the replicated
    Hugging Face router ``gate`` and, for Qwen2-MoE, ``shared_expert_gate``.
    """

    def __init__(self, hidden_size, num_experts, expert_size, act_fn, router, tsp_group, shared_size=0,
                 shared_gate=None, overlap=True, token_tile=0, fp32_accumulators=True, schedule="ring", dtype=None,
                 device=None):
        super().__init__()
        if bool(shared_size) != (shared_gate is not None):
            raise ValueError("a shared expert needs its shared_expert_gate, and the gate its expert")
        self.hidden_size, self.num_experts, self.expert_size = hidden_size, num_experts, expert_size
        self.shared_size = shared_size
        self.tsp_group = tsp_group
        self.tsp_size, self.tsp_rank = comm.group_size(tsp_group), comm.group_rank(tsp_group)
        self.spec = shard_spec(hidden_size, num_experts, expert_size, self.tsp_size, shared_size)
        self.act_fn = act_fn
        self.overlap = overlap
        if not callable(schedule) and schedule not in MOE_SCHEDULES:
            raise ValueError(f"schedule must be one of {MOE_SCHEDULES} or a chooser, not {schedule!r}")
        self.plan = MoEPlan(self.spec, act_fn, tsp_group, num_experts, expert_size, bool(shared_size), overlap,
                            token_tile, fp32_accumulators, schedule=schedule)
        self.gate = router
        self.shared_expert_gate = shared_gate
        self.packed = nn.Parameter(torch.empty(self.spec.numel, dtype=dtype, device=device))
        # DeepSpeed counts a parameter on every model-parallel rank in grad norms only with this tag.
        self.packed.tensor_model_parallel = True
        self.lora = None  # no LoRA on the experts (ds_tsp.injection.lora)

    def replicated_params(self):
        """The parameters every rank holds whole, under Hugging Face names."""
        params = {ROUTER: self.gate.weight}
        if self.shared_expert_gate is not None:
            params[SHARED_GATE] = self.shared_expert_gate.weight
        return params

    def shard_piece(self, name):
        """``(dim, start, length)`` of the full tensor ``name`` this rank holds, or None if whole."""
        return shard_piece(self.num_experts, self.shared_size, self.tsp_size, name, self.tsp_rank)

    @classmethod
    def from_hf(cls, moe, tsp_group, overlap=True, token_tile=0, fp32_accumulators=True, schedule="ring", read=None,
                device=None):
        """Build from a Hugging Face sparse MoE block (``gate``: its TopKRouter,
        ``experts`` with fused 3-D ``gate_up_proj`` / ``down_proj``, and
        optionally ``shared_expert`` + ``shared_expert_gate``), keeping this
        rank's experts. The router and shared-expert gate modules are Hugging
        Face's own, copied. ``read(name, piece)`` as in ``TSPGatedMLP.from_hf``."""
        hidden_size, num_experts, expert_size, shared_size = hf_sizes(moe)
        dtype = moe.experts.gate_up_proj.dtype
        device = device or moe.experts.gate_up_proj.device

        def replica(module):
            return None if module is None else copy.deepcopy(module).to_empty(device=device)

        module = cls(hidden_size, num_experts, expert_size, moe.experts.act_fn, replica(moe.gate), tsp_group,
                     shared_size=shared_size, shared_gate=replica(getattr(moe, "shared_expert_gate", None)),
                     overlap=overlap, token_tile=token_tile, fp32_accumulators=fp32_accumulators, schedule=schedule,
                     dtype=dtype, device=device)
        read = read or module_reader(moe)
        module.load_shard({name: read(name, module.shard_piece(name)) for name in module.shard_names()})
        return module

    @torch.no_grad()
    def decode_share(self, x):
        """For tokens ``x`` ``(N, H)`` that every rank holds (decoding), this
        rank's share of the output: its own experts' weighted outputs for the
        tokens routed to them and its slice of the shared expert, no weight
        moving; the shares sum over the group to the block's output."""
        _, weights, index = self.gate(x)
        shared_scale = None if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x))
        y = torch.zeros(x.shape, dtype=self.plan.accumulator_dtype(x.dtype), device=x.device)
        routing = Routing.of(index, self.num_experts)
        w = self.spec.unpack(self.packed.detach())
        for local, expert in self.plan.held_experts(0):
            for tokens, slots in routing.of_expert(expert, 0):
                out, _, _ = gated_shard_forward(x[tokens], expert_weights(w, local, self.expert_size), self.plan.act_fn)
                y.index_add_(0, tokens, (out * weights[tokens, slots, None]).to(y.dtype))
        if shared_scale is not None:
            out, _, _ = gated_shard_forward(x, shared_weights(w), self.plan.act_fn)
            y += (shared_scale * out).to(y.dtype)
        return y.to(x.dtype)

    def forward(self, x):
        """``x``: this rank's tokens ``(B, S/D, H)``; returns ``(B, S/D, H)``."""
        x2 = x.reshape(-1, self.hidden_size)  # (N, H)
        _, weights, index = self.gate(x2)  # HF's router: softmax, top-k, normalisation and dtypes as HF
        shared_scale = None
        if self.shared_expert_gate is not None:
            shared_scale = torch.sigmoid(self.shared_expert_gate(x2))  # (N, 1)
        schedule = moe_ring if self.schedule_for(x2, index.shape[-1]) == "ring" else moe_all_to_all
        return schedule(x2, weights, index, shared_scale, self.packed, self.plan).view(x.shape)

    def schedule_for(self, x2, top_k):
        """The schedule of this forward: the block's, or its chooser's answer for
        ``x2``'s ``N`` local tokens, logged once per choice. The chooser takes
        ``(hidden_size, num_experts, expert_size, shared_size, top_k, N,
        tsp_size, element bytes, direction, grad_wire_bytes=)``, direction
        "both" in training mode and "forward" in eval mode, as
        ``ds_tsp.planning.cheaper_moe_schedule`` does (``tsp.moe_schedule: "auto"``)."""
        if not callable(self.plan.schedule):
            return self.plan.schedule
        wire = self.plan.grad_wire_dtype
        choice = self.plan.schedule(self.hidden_size, self.num_experts, self.expert_size, self.shared_size, top_k,
                                    x2.shape[0], self.tsp_size, _compute_dtype(x2).itemsize,
                                    "both" if self.training else "forward",
                                    grad_wire_bytes=None if wire is None else wire.itemsize)
        said = (choice, x2.shape[0], self.num_experts, top_k, self.tsp_size)
        if said not in _announced:
            _announced.add(said)
            if not dist.is_initialized() or dist.get_rank() == 0:
                logger.info("tsp.moe_schedule auto: %s for %d local tokens (E=%d, top-%d, D=%d)", *said)
        return choice

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, expert_size={self.expert_size}, "
                f"shared_size={self.shared_size}, tsp_size={self.tsp_size}, overlap={self.overlap}, "
                f"schedule={getattr(self.plan.schedule, '__name__', self.plan.schedule)}")
