"""What a plan is: ``StrategyPlan``, one strategy's per-device memory,
communication and FLOPs, and ``CommPart``, its bytes of one kind of
communication with the group that kind runs in, named by the constants below
(``timing`` prices each kind on its own link).

Everything is per device and per optimizer step of one micro-batch ``B`` of
sequences of length ``S``, for a model replica spread over ``N`` devices (DP:
``N`` replicas of one device each). Communication is bytes RECEIVED per
device; per step it is ``L * (forward + backward [+ forward again when
checkpointing])`` plus the once-per-step syncs (embedding, LM head,
replicated gradients, ZeRO). A model whose layers differ (dense and sparse,
attention and Gated DeltaNet) reports the mean over its layers as its
per-layer figures.
"""

from dataclasses import dataclass, field

from ds_tsp.planning.shapes import Setting

# What each strategy sends, by kind (``StrategyPlan.comm_parts``). The baselines:
TP_ACTIVATIONS = "tp_activations"  # TP all-reduces of activations and their gradients (and the vocab-parallel ends)
SP_ALL_TO_ALL = "sp_all_to_all"  # Ulysses: q, k, v in and the attention output back
CP_KV = "cp_kv"  # context parallel: the full-sequence K/V gathered, dK/dV scattered back
ZERO3_GATHER = "zero3_gather"  # ZeRO-3: every layer's parameters gathered before its forward and backward
GRAD_REDUCE = "grad_reduce"  # gradients reduced over the weight replicas (reduce-scatter under ZeRO)
PARAM_GATHER = "param_gather"  # ZeRO-1/2: the updated weights gathered after the optimizer step
EP_ALL_TO_ALL = "ep_all_to_all"  # expert parallelism (AutoEP): routed rows to the experts' owners and back
# Where experts fold across data-parallel replicas (AutoEP, TSP's expert_parallel_size): their gradients reduced
# over the ranks holding the same experts, and under ZeRO-1/2 their updated weights gathered, apart from the rest.
EXPERT_GRAD_REDUCE = "expert_grad_reduce"
EXPERT_PARAM_GATHER = "expert_param_gather"
# TSP, one per ``comm`` op (``communication.tsp_step_bytes_by_op``):
TSP_PARTS = {"broadcast": "tsp_weight_broadcast", "ring": "tsp_ring", "all_gather": "tsp_kv_gather",
             "reduce_scatter": "tsp_kv_grad_scatter", "reduce": "tsp_weight_grad_reduce",
             "all_to_all": "tsp_embedding_all_to_all", "all_reduce": "tsp_replicated_grads",
             "batch_check": "tsp_batch_check"}
# A vision-language model's tower (``visual``): TSP's units all-gathered (forward, and again where checkpointed
# blocks run again) and ZeRO-3's gathers of the tower; their gradients reduce-scattered over the TSP group, or the
# baselines' reduced over the weight replicas; ZeRO-1/2's gather of the updated tower; TSP's merged visual rows
# sent to their placeholders' ranks (and their gradients back).
VISION_GATHER = "vision_tower_gather"
VISION_GRADS = "vision_tower_grads"
VISION_PARAM_GATHER = "vision_tower_param_gather"
VISION_ROWS = "vision_rows_all_to_all"
# TSP's sparse layers under the token all-to-all, over their expert-parallel group (the TSP group, or more ranks)
TSP_EXPERT_ALL_TO_ALL = "tsp_expert_all_to_all"


@dataclass(frozen=True)
class CommPart:
    """Bytes one device receives per step in one kind of communication, and its
    group: ``group_size`` ranks ``stride`` apart (TP innermost, then SP/CP, then
    DP; a TSP group is consecutive), running ``op`` (a ``comm`` op name)."""

    nbytes: float
    group_size: int
    stride: int
    op: str


@dataclass
class StrategyPlan:
    """One strategy's per-device costs. Bytes are per device; communication is
    bytes received per device; FLOPs per device per optimizer step."""

    name: str  # e.g. "TP+SP(2x4)"
    layout: str  # e.g. "tp=2 x sp=4"
    memory: dict  # MEMORY_PARTS -> bytes
    comm_forward_per_layer: float
    comm_backward_per_layer: float
    comm_per_step: float
    flops_per_step: float
    tokens_per_device: float  # tokens whose activations this device holds (B*S/c; B*S/D for TSP)
    setting: Setting
    feasible: bool = True
    notes: str = ""
    # why the strategy computes another function than the model's, "" where it is exact (DeepSpeed-Ulysses on a
    # Gated DeltaNet hybrid: its linear layers see the local tokens alone)
    inexact: str = ""
    detail: dict = field(default_factory=dict)  # named pieces of the memory terms, bytes
    terms: dict = field(default_factory=dict)  # the peak as named terms (memory.STATES, ...), summing to total
    host: dict = field(default_factory=dict)  # per node: what offloading puts in host memory, bytes
    comm_parts: dict = field(default_factory=dict)  # name -> CommPart, summing to comm_per_step
    attention_flops_per_step: float = 0.0  # the part of flops_per_step in QK^T and PV (and their backward)
    devices_per_replica: int = 1  # devices sharing one micro-batch: t*c, D for TSP (1 for DP)
    attention_rows: int = 0  # query rows of a sequence one attention kernel takes (S, S/c for CP, S/D for TSP)
    tower: dict = field(default_factory=dict)  # a vision-language model's tower on this device (visual.tower_summary)

    @property
    def total(self):
        return sum(self.memory.values())

    @property
    def host_total(self):
        return sum(self.host.values())
