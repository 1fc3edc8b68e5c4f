"""The TSP sparse mixture-of-experts block (Mixtral, Qwen2/3-MoE, GLM-4.5 and
every block of that form).

Each rank holds ``E/D`` whole experts and a slice of the shared expert, where
there is one (``plan.py``). The router and the shared expert's gate are
Hugging Face's own modules, replicated, run on the local tokens: routing
(softmax or sigmoid scores, a score-correction bias, group-limited top-k,
``norm_topk_prob``, a routed scaling factor, the weights' dtype) is HF's by
construction, whatever the router computes, as long as it returns HF's
``(logits, weights, indices)``. The block's output is the routed experts'
weighted sum plus the shared expert's output, times ``sigmoid`` of its gate
where it has one (Qwen2-MoE) or as it is (DeepSeek-V3's ``shared_experts``);
where the block's forward scales each expert's input by its routing weight
instead (Llama 4's: ``plan.scales_inputs``), the outputs are summed as they
are, in both schedules and in decoding.
Two schedules meet tokens and experts, ``tsp.moe_schedule``: expert shards
travel round a ring while tokens stay put (``ring.py``), or experts stay at
rest while tokens go to them by all-to-all (``all_to_all.py``). The ring's bytes are fixed and the all-to-all's grow
with the sequence, so "auto" hands the block a chooser
(``ds_tsp.planning.cheaper_moe_schedule``, see ``TSPSparseMoE.schedule_for``)
that takes the cheaper for each layer's local token count; at 32K tokens the
all-to-all moves about 9x fewer bytes for Qwen3-30B-A3B at D=8.
``ds_tsp.planning.moe_block_bytes_by_op`` holds both formulas.

With ``tsp.expert_parallel_size`` > ``tsp.size`` (DESIGN.md 6k) the experts
split ``E/ep`` per rank over the expert-parallel group, the TSP group and
``ep/D`` data-parallel replicas beside it, and the token all-to-all runs over
that group: every rank sends its own tokens' rows to their experts' owners,
whichever replica holds them. Their shard is tagged as DeepSpeed tags its
experts (``allreduce = False``, ``group_name``), so its gradient is reduced
over the expert-data-parallel group (``ds_tsp.runtime.expert_parallel``).
A shared expert's slices are reduced over the data-parallel group, so they
cannot share that shard: folded, the shared expert is a ``TSPGatedMLP`` of
its own under its Hugging Face name, on the MLP's ring, its output times
its gate's scale added to the routed experts'.

Decoding (``decode_share``) uses neither schedule: every rank holds the
step's tokens, runs its own experts on those routed to them and the shares
are summed. The router logits and the load-balancing loss: ``load_balancing.py``.
"""

import copy
import logging

import torch
import torch.distributed as dist
from torch import nn

from ds_tsp.blocks.mlp import TSPGatedMLP, mlp_activation
from ds_tsp.blocks.mlp import shard_forward as gated_shard_forward
from ds_tsp.blocks.moe.all_to_all import moe_all_to_all
from ds_tsp.blocks.moe.plan import (
    MOE_SCHEDULES,
    ROUTER_NAMES,
    SHARED_GATE,
    MoEPlan,
    Routing,
    child_named,
    expert_rows,
    hf_sizes,
    replicated_tensors,
    router_inputs,
    scales_expert_inputs,
    shard_piece,
    shard_spec,
    shared_is_gated,
    shared_weights,
)
from ds_tsp.blocks.moe.ring import moe_ring
from ds_tsp.blocks.packing import PackedShardMixin, module_reader
from ds_tsp.parallel import comm
from ds_tsp.parallel.amp import compute_dtype
from ds_tsp.parallel.ring import RingWireDtypeMixin

logger = logging.getLogger("ds_tsp")

# What tsp.moe_schedule "auto" has said in the log: each choice once per shape, not once per layer.
_announced = set()


class TSPSparseMoE(RingWireDtypeMixin, PackedShardMixin, nn.Module):
    """A Hugging Face sparse MoE block over the local tokens, experts sharded
    ``E/D`` per rank, moved by a ring or met by a token all-to-all
    (``tsp.moe_schedule``, see the module docstring).

    Parameters: ``packed``, this rank's experts (and shared-expert slice) laid
    out by ``self.spec``, tagged ``tensor_model_parallel`` (and, folded over
    ``ep_group``, as DeepSpeed's experts; a folded block's shared expert is
    then its own ``TSPGatedMLP`` at ``shared_name``); the replicated
    Hugging Face router, under its Hugging Face name (``router_name``: ``gate``
    or ``router``), and, for Qwen2-MoE, ``shared_expert_gate``.
    """

    def __init__(self, hidden_size, num_experts, experts, act_fn, router, tsp_group, shared_size=0,
                 shared_gate=None, overlap=True, token_tile=0, fp32_accumulators=True, schedule="ring", dtype=None,
                 device=None, router_name="gate", shared_name="shared_expert", router_buffers=None, ep_group=None,
                 scales_inputs=False, input_norm=None, input_norm_name=None, shared_gated=True):
        super().__init__()
        if shared_gate is not None and not shared_size:
            raise ValueError("a shared_expert_gate needs its shared expert")
        self.hidden_size, self.num_experts, self.experts = hidden_size, num_experts, experts
        self.expert_size = experts.expert_size
        self.shared_size = shared_size
        self.tsp_group = tsp_group
        self.tsp_size, self.tsp_rank = comm.group_size(tsp_group), comm.group_rank(tsp_group)
        self.ep_group = tsp_group if ep_group is None else ep_group
        self.ep_size, self.ep_rank = comm.group_size(self.ep_group), comm.group_rank(self.ep_group)
        if self.folded:
            schedule = "all_to_all"  # the only schedule that reaches experts on other replicas
        # Folded, a shared expert is a TSP MLP of its own; else its slice ends the packed shard.
        self.shared_mlp_name = shared_name if self.folded and shared_size else None
        packed_shared = 0 if self.shared_mlp_name else shared_size
        self.shared_gated = shared_gated  # the shared expert gate_proj, up_proj, down_proj, or the last two
        self.spec = shard_spec(hidden_size, num_experts, experts, self.tsp_size, packed_shared, shared_name,
                               self.ep_size, shared_gated)
        self.act_fn = act_fn
        self.overlap = overlap
        if not callable(schedule) and schedule not in MOE_SCHEDULES:
            raise ValueError(f"schedule must be one of {MOE_SCHEDULES} or a chooser, not {schedule!r}")
        self.plan = MoEPlan(self.spec, experts, act_fn, self.ep_group, num_experts, bool(packed_shared), overlap,
                            token_tile, fp32_accumulators, schedule=schedule, scales_inputs=scales_inputs)
        if self.shared_mlp_name:
            self.add_module(shared_name, TSPGatedMLP(hidden_size, shared_size, act_fn, tsp_group, overlap=overlap,
                                                     token_tile=token_tile, fp32_accumulators=fp32_accumulators,
                                                     dtype=dtype, device=device, gated=shared_gated))
        self.router_name = router_name
        self.add_module(router_name, router)
        # Buffers the Hugging Face block holds and hands its router by name, kept under the block's names.
        self.router_inputs = list(router_buffers or {})
        for name, buffer in (router_buffers or {}).items():
            self.register_buffer(name, buffer)
        self.shared_expert_gate = shared_gate
        # The norm the experts' inputs pass after routing, under its Hugging Face name (Gemma 4's experts beside
        # its MLP: routed on the branch's input, run on pre_feedforward_layernorm_2 of it), or None.
        self.input_norm_name = input_norm_name
        if input_norm is not None:
            self.add_module(input_norm_name, input_norm)
        self.packed = nn.Parameter(torch.empty(self.spec.numel, dtype=dtype, device=device))
        # DeepSpeed counts a parameter on every model-parallel rank in grad norms only with this tag.
        self.packed.tensor_model_parallel = True
        if self.folded:  # DeepSpeed's tags of its experts: reduced over their expert-data-parallel group
            self.packed.allreduce, self.packed.group_name = False, f"ep_size_{self.ep_size}"
        self.lora = None  # no LoRA on the experts (ds_tsp.injection.lora)

    @property
    def folded(self):
        """Whether the experts split over more ranks than the TSP group (``tsp.expert_parallel_size``)."""
        return self.ep_size != self.tsp_size

    def router_module(self):
        """The replicated Hugging Face router module."""
        return getattr(self, self.router_name)

    @property
    def top_k(self):
        """Experts per token, as the router's ``top_k``."""
        return self.router_module().top_k

    def replicated_tensors(self):
        """The tensors every rank holds whole, under Hugging Face names: the
        router's parameters and persistent buffers, the shared expert's gate."""
        return replicated_tensors(self.router_module(), self.router_name, self.shared_expert_gate,
                                  {name: getattr(self, name) for name in self.router_inputs},
                                  {self.input_norm_name: self.input_norm} if self.input_norm_name else None)

    @property
    def input_norm(self):
        """The norm of the experts' inputs (``input_norm_name``), or None."""
        return None if self.input_norm_name is None else self.get_submodule(self.input_norm_name)

    def expert_inputs(self, x2):
        """What the experts compute on for the routed tokens ``x2``: ``x2``, or its ``input_norm``."""
        return x2 if self.input_norm is None else self.input_norm(x2)

    def replicated_params(self):
        """The parameters every rank holds whole, under Hugging Face names."""
        return {name: t for name, t in self.replicated_tensors().items() if isinstance(t, nn.Parameter)}

    def shard_piece(self, name):
        """``(dim, start, length)`` of the full tensor ``name`` this rank holds, or None if whole."""
        return shard_piece(self.num_experts, self.shared_size, self.tsp_size, name, self.tsp_rank, self.ep_size,
                           self.ep_rank)

    @classmethod
    def from_hf(cls, moe, tsp_group, overlap=True, token_tile=0, fp32_accumulators=True, schedule="ring", read=None,
                device=None, ep_group=None, input_norm_name=None):
        """Build from a Hugging Face sparse MoE block (``gate`` or ``router``:
        its router, ``experts`` in any layout ``experts.ExpertLayout`` reads
        (fused 3-D tensors, transposed or not, with biases or not), and
        optionally ``shared_expert`` with or without ``shared_expert_gate``, or
        ``shared_experts``), keeping this rank's experts (split over
        ``ep_group``, by default the TSP group). The router and
        shared-expert gate modules are Hugging Face's own, copied. ``read(name,
        piece)`` as in ``TSPGatedMLP.from_hf``."""
        hidden_size, num_experts, experts, shared_size, shared_name = hf_sizes(moe)
        router_name = child_named(moe, ROUTER_NAMES)
        router_buffers = {name: torch.empty_like(moe._buffers[name], device=device)
                          for name in router_inputs(moe, moe.get_submodule(router_name))}
        dtype = moe.experts.down_proj.dtype
        device = device or moe.experts.down_proj.device

        def replica(module):
            return None if module is None else copy.deepcopy(module).to_empty(device=device)

        shared_act = None if shared_name is None else mlp_activation(moe.get_submodule(shared_name))
        input_norm = None if input_norm_name is None else replica(moe.get_submodule(input_norm_name))
        module = cls(hidden_size, num_experts, experts, shared_act,
                     replica(moe.get_submodule(router_name)), tsp_group, shared_size=shared_size,
                     shared_gate=replica(getattr(moe, SHARED_GATE, None)), overlap=overlap, token_tile=token_tile,
                     fp32_accumulators=fp32_accumulators, schedule=schedule, dtype=dtype, device=device,
                     router_name=router_name, shared_name=shared_name or "shared_expert",
                     router_buffers=router_buffers, ep_group=ep_group, scales_inputs=scales_expert_inputs(moe),
                     input_norm=input_norm, input_norm_name=input_norm_name, shared_gated=shared_is_gated(moe))
        read = read or module_reader(moe)
        module.load_shard({name: read(name, module.shard_piece(name)) for name in module.shard_names()})
        if module.shared_mlp_name:
            shared = module.get_submodule(shared_name)
            shared.load_shard({name: read(f"{shared_name}.{name}", shared.shard_piece(name))
                               for name in shared.shard_names()})
        return module

    @torch.no_grad()
    def decode_share(self, x):
        """For tokens ``x`` ``(N, H)`` that every rank holds (decoding), this
        rank's share of the output: its own experts' weighted outputs for the
        tokens routed to them and its slice of the shared expert, no weight
        moving; the shares sum over the group to the block's output."""
        weights, index = self.route(x)
        shared_scale = self.shared_scale(x)
        x = self.expert_inputs(x)
        y = torch.zeros(x.shape, dtype=self.plan.accumulator_dtype(x.dtype), device=x.device)
        routing = Routing.of(index, self.num_experts)
        w = self.spec.unpack(self.packed.detach())
        for local, expert in self.plan.held_experts(0):
            for tokens, slots in routing.of_expert(expert, 0):
                weight = weights[tokens, slots, None]
                out = self.experts.forward(expert_rows(x[tokens], weight, self.plan), self.experts.weights(w, local))
                y.index_add_(0, tokens, (out if self.plan.scales_inputs else out * weight).to(y.dtype))
        if shared_scale is not None:
            out, _, _ = gated_shard_forward(x, shared_weights(w), self.plan.act_fn)
            y += (shared_scale * out).to(y.dtype)
        return y.to(x.dtype)

    def forward(self, x):
        """``x``: this rank's tokens ``(B, S/D, H)``; returns ``(B, S/D, H)``."""
        x2 = x.reshape(-1, self.hidden_size)  # (N, H)
        weights, index = self.route(x2)
        shared_scale = self.shared_scale(x2)
        schedule = moe_ring if self.schedule_for(x2, index.shape[-1]) == "ring" else moe_all_to_all
        # The local tokens in one token tile: the experts' gate and up projections are kept for backward, as the
        # MLP keeps its; beyond, backward computes them again tile by tile.
        keep = torch.is_grad_enabled() and len(self.plan.tiles(x2.shape[0])) == 1
        y = schedule(self.expert_inputs(x2), weights, index, shared_scale if self.plan.shared else None, self.packed,
                     self.plan, keep)
        if self.shared_mlp_name:  # HF: the routed experts' sum, plus the shared expert's output times its scale
            y = y + shared_scale * self.get_submodule(self.shared_mlp_name)(x).reshape(x2.shape)
        return y.view(x.shape)

    def run_router(self, x2):
        """Hugging Face's router's output on the tokens ``x2`` ``(N, H)``, with
        the buffers the block hands it (``plan.router_inputs``)."""
        return self.router_module()(x2, *(getattr(self, name) for name in self.router_inputs))

    def route(self, x2):
        """``(weights, indices)``, each ``(N, k)``, of Hugging Face's router on the
        tokens ``x2`` ``(N, H)``: scores, top-k, normalisation, scaling and dtypes as HF's.
        A router returning ``(scores over every expert, logits)`` (Llama 4's) has
        its top-k taken again from the logits, as its own ``torch.topk`` took it,
        and its scores read there."""
        routed = self.run_router(x2)
        if isinstance(routed, tuple) and len(routed) == 2 and routed[0].shape == routed[1].shape:
            scores, logits = routed
            index = torch.topk(logits, self.top_k, dim=1).indices
            return scores.gather(1, index), index
        if not (isinstance(routed, tuple) and len(routed) == 3 and routed[1].shape == routed[2].shape
                and routed[2].shape[:1] == x2.shape[:1] and not routed[2].is_floating_point()):
            raise TypeError(f"{type(self.router_module()).__name__} does not return Hugging Face's (logits, weights, "
                            "indices) with weights and indices (tokens, top_k): the TSP MoE block cannot route "
                            "with it")
        return routed[1], routed[2]

    def shared_scale(self, x2):
        """``(N, 1)``: what the shared expert's output is multiplied by, ``sigmoid``
        of its gate (Qwen2-MoE) or ones (an ungated shared expert: exact); None
        without a shared expert."""
        if not self.shared_size:
            return None
        if self.shared_expert_gate is None:
            return torch.ones(x2.shape[0], 1, dtype=x2.dtype, device=x2.device)
        return torch.sigmoid(self.shared_expert_gate(x2))

    def schedule_for(self, x2, top_k):
        """The schedule of this forward: the block's, or its chooser's answer for
        ``x2``'s ``N`` local tokens, logged once per choice. The chooser takes
        ``(hidden_size, num_experts, expert_size, shared_size, top_k, N,
        tsp_size, element bytes, direction, grad_wire_bytes=, expert_bias=)``, direction
        "both" in training mode and "forward" in eval mode, as
        ``ds_tsp.planning.cheaper_moe_schedule`` does (``tsp.moe_schedule: "auto"``)."""
        if not callable(self.plan.schedule):
            return self.plan.schedule
        wire = self.plan.grad_wire_dtype
        choice = self.plan.schedule(self.hidden_size, self.num_experts, self.expert_size, self.shared_size, top_k,
                                    x2.shape[0], self.tsp_size, compute_dtype(x2).itemsize,
                                    "both" if self.training else "forward",
                                    grad_wire_bytes=None if wire is None else wire.itemsize,
                                    expert_bias=self.experts.biased)
        said = (choice, x2.shape[0], self.num_experts, top_k, self.tsp_size)
        if said not in _announced:
            _announced.add(said)
            if not dist.is_initialized() or dist.get_rank() == 0:
                logger.info("tsp.moe_schedule auto: %s for %d local tokens (E=%d, top-%d, D=%d)", *said)
        return choice

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, expert_size={self.expert_size}, "
                f"shared_size={self.shared_size}, tsp_size={self.tsp_size}, ep_size={self.ep_size}, "
                f"overlap={self.overlap}, schedule={getattr(self.plan.schedule, '__name__', self.plan.schedule)}")
