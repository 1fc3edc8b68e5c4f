"""Step time of each strategy on a cluster: its FLOPs at a stated fraction of
the device's peak, its communication over the intra-node link (NVLink) or the
inter-node one (InfiniBand), and the overlap its schedule allows; and the
bound, the busiest of compute, the intra-node link and the inter-node link.

Per device, per optimizer step of one micro-batch (``plan_types``)::

    compute = attention FLOPs / (peak * efficiency) + other FLOPs / (matmul peak * efficiency)
    part    = bytes received / bandwidth of the link its group runs over    (one per ``comm_parts`` kind)
    step    = sum(blocking parts) + max(compute, overlapped parts on NVLink, overlapped parts on InfiniBand)

Which link: a group of ``g`` ranks ``stride`` apart covers ``g * stride``
consecutive ranks (ranks numbered node by node; TP innermost, then SP/CP,
then DP; a TSP group consecutive). When that span fits a node and divides it,
every group lies inside one node: NVLink. Otherwise the group crosses nodes.
Crossing, an all-to-all sends ``(g - local) / (g - 1)`` of its bytes over
InfiniBand (``local``: the group's ranks on one node) and the rest over NVLink
at the same time; every other collective (ring all-reduce, all-gather,
reduce-scatter, broadcast, reduce, ds_tsp's p2p ring) is taken to move all
its bytes at the inter-node bandwidth, as a ring whose every byte crosses a
node boundary on one device's NIC does. NCCL spreads a collective's channels
over a node's NICs, so a group with several ranks per node can beat this; the
model does not credit it.

Overlap, by kind (``OVERLAPPED``; the strategies' schedules as DESIGN.md and
the frameworks run them):

* TP all-reduces (Megatron, AutoTP): blocking, the next matmul needs them.
* Ulysses all-to-alls: blocking, attention needs the heads they bring and
  DeepSpeed's ``DistributedAttention`` runs them synchronously.
* Context parallel K/V: overlapped, as Megatron's context parallelism runs it
  (a ring of p2p transfers under the attention of the chunk in hand).
* ZeRO-3 parameter gathers: overlapped (prefetch of the next layers).
* Gradient reduction over the weight replicas: overlapped with backward
  (DeepSpeed's ``overlap_comm`` buckets, DDP); folded experts' over their
  expert-data-parallel group likewise.
* ZeRO-1/2 gather of the updated weights: blocking, after the optimizer step.
* TSP weight broadcasts and the MLP / LM-head ring: overlapped (DESIGN.md 4
  and 5: shard ``j+1`` arrives while shard ``j`` computes); the K/V all-gather
  and dK/dV reduce-scatter: overlapped, the next head group's under the current
  group's compute, as ``ds_tsp/blocks/attention/schedule.py`` runs them; the weight-gradient reduces:
  overlapped (posted, waited at the layer's end). The embedding all-to-all is
  blocking (the first layer needs the rows) and so are the all-reduces of the
  gradients every rank holds whole (ds_tsp waits for them before DeepSpeed's own
  reduction reads those gradients: bucketed once per optimizer step under
  ZeRO-0/1, per micro-step under ZeRO-2/3). The sparse layers' token
  all-to-all is blocking, as AutoEP's: the experts wait for their rows.

Overlapped traffic hides under the step's whole compute, not only the phase
that issues it, and costs no compute; bandwidths are what a large message
achieves (no latency term); the optimizer step, host offloads and elementwise
kernels are not timed (the efficiency absorbs the last). One micro-batch per
step: gradient accumulation amortises the gradient reduction, not modelled.

Defaults (``Cluster``): an H100/H200 SXM node. BF16 dense peak 989.4 TFLOPs
(FP8 1978.9) and NVLink 4 at 900 GB/s per GPU, both directions, so 450 GB/s
each way (https://glennklockwood.com/garden/processors/h100); one 400 Gb/s
NDR InfiniBand NIC per GPU, 50 GB/s each way (DGX H100: 8x ConnectX-7
400 Gb/s, stas00/ml-engineering network/README.md). Efficiency 0.5: about
what Megatron-LM reports at scale, 52% of A100 peak for a 1T model on 3072
GPUs (Narayanan et al. 2021, arXiv 2104.04473).

``compare_anchor`` runs the model on a published run (``anchors.TIME_ANCHORS``)
and sets its throughput, counted as the source counts FLOPs, beside the
published one.
"""

import math
from dataclasses import dataclass, field

from ds_tsp.planning.anchors import TIME_ANCHORS
from ds_tsp.planning.baselines import plan_baseline
from ds_tsp.planning.plan_types import (
    CP_KV,
    EP_ALL_TO_ALL,
    EXPERT_GRAD_REDUCE,
    EXPERT_PARAM_GATHER,
    GRAD_REDUCE,
    PARAM_GATHER,
    SP_ALL_TO_ALL,
    TP_ACTIVATIONS,
    TSP_EXPERT_ALL_TO_ALL,
    TSP_PARTS,
    VISION_GATHER,
    VISION_GRADS,
    VISION_PARAM_GATHER,
    VISION_ROWS,
    ZERO3_GATHER,
)
from ds_tsp.planning.shapes import DEFAULT_DEVICES_PER_NODE
from ds_tsp.planning.strategies import make_setting

COMPUTE, INTRA_NODE, INTER_NODE = "compute", "intra-node", "inter-node"
BOUNDS = (COMPUTE, INTRA_NODE, INTER_NODE)

# True: runs under compute; False: the compute waits for it (module docstring).
OVERLAPPED = {
    TP_ACTIVATIONS: False,
    SP_ALL_TO_ALL: False,
    EP_ALL_TO_ALL: False,  # the experts wait for their rows, the layer's output for theirs
    CP_KV: True,
    ZERO3_GATHER: True,
    GRAD_REDUCE: True,
    PARAM_GATHER: False,
    EXPERT_GRAD_REDUCE: True,
    EXPERT_PARAM_GATHER: False,
    TSP_PARTS["broadcast"]: True,
    TSP_PARTS["ring"]: True,
    TSP_PARTS["all_gather"]: True,
    TSP_PARTS["reduce_scatter"]: True,
    TSP_PARTS["reduce"]: True,
    TSP_PARTS["all_to_all"]: False,
    TSP_PARTS["all_reduce"]: False,
    TSP_PARTS["batch_check"]: False,  # the forward waits for the fingerprints
    TSP_EXPERT_ALL_TO_ALL: False,
    VISION_GATHER: True,
    VISION_GRADS: True,
    VISION_PARAM_GATHER: False,
    VISION_ROWS: False,  # the decoder waits for its visual rows
}


@dataclass(frozen=True)
class Cluster:
    """The device and its links. Bandwidths are GB/s (1e9 B) per device per
    direction; ``matmul_peak_tflops`` (None: ``peak_tflops``) is for matmuls
    that run faster than attention, e.g. FP8 GEMMs beside BF16 attention."""

    peak_tflops: float = 989.4
    efficiency: float = 0.5
    intra_node_gb_s: float = 450.0
    inter_node_gb_s: float = 50.0
    matmul_peak_tflops: float | None = None

    def __post_init__(self):
        for label in ("peak_tflops", "intra_node_gb_s", "inter_node_gb_s"):
            if not getattr(self, label) > 0:
                raise ValueError(f"{label} must be > 0, not {getattr(self, label)!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency is a fraction of peak, in (0, 1], not {self.efficiency!r}")
        if self.matmul_peak_tflops is not None and not self.matmul_peak_tflops > 0:
            raise ValueError(f"matmul_peak_tflops must be > 0, not {self.matmul_peak_tflops!r}")

    def describe(self):
        matmuls = "" if self.matmul_peak_tflops is None else f" (matmuls {self.matmul_peak_tflops:g})"
        return (f"{self.peak_tflops:g}{matmuls} TFLOPs peak x {self.efficiency:g} efficiency, "
                f"{self.intra_node_gb_s:g} GB/s intra-node and {self.inter_node_gb_s:g} GB/s inter-node per device "
                f"each way")


DEFAULT_CLUSTER = Cluster()


@dataclass(frozen=True)
class StepTime:
    """``step_time``'s answer. Seconds per optimizer step of one micro-batch;
    ``blocking`` and ``overlapped`` by link; ``parts``: kind -> (link, seconds)."""

    seconds: float
    compute: float
    blocking: dict = field(default_factory=dict)
    overlapped: dict = field(default_factory=dict)
    bound: str = ""
    tflops_per_device: float = math.nan  # the plan's FLOPs (recomputation included) / seconds
    tokens_per_s_per_device: float = math.nan
    parts: dict = field(default_factory=dict)

    @property
    def exposed_comm(self):
        """Seconds of the step not spent computing."""
        return self.seconds - self.compute


def crosses_nodes(group_size, stride, devices_per_node):
    """Whether some group of ``group_size`` ranks ``stride`` apart spans two nodes."""
    span = group_size * stride
    return group_size > 1 and (span > devices_per_node or devices_per_node % span != 0)


def part_seconds(part, devices_per_node, cluster=DEFAULT_CLUSTER):
    """(link, seconds) of one ``plan_types.CommPart`` (module docstring)."""
    intra, inter = cluster.intra_node_gb_s * 1e9, cluster.inter_node_gb_s * 1e9
    g = part.group_size
    if not crosses_nodes(g, part.stride, devices_per_node):
        return INTRA_NODE, part.nbytes / intra
    if part.op != "all_to_all":
        return INTER_NODE, part.nbytes / inter
    local = min(g, max(1, devices_per_node // part.stride))
    remote = (g - local) / (g - 1)
    over_nvlink, over_ib = part.nbytes * (1 - remote) / intra, part.nbytes * remote / inter
    return (INTER_NODE, over_ib) if over_ib >= over_nvlink else (INTRA_NODE, over_nvlink)


def compute_seconds(plan, cluster=DEFAULT_CLUSTER):
    """The plan's FLOPs at ``cluster.efficiency`` of the peaks."""
    matmul_peak = cluster.matmul_peak_tflops or cluster.peak_tflops
    attention = plan.attention_flops_per_step
    return (attention / cluster.peak_tflops + (plan.flops_per_step - attention) / matmul_peak) / (
        1e12 * cluster.efficiency)


def step_time(plan, cluster=DEFAULT_CLUSTER):
    """``StepTime`` of one ``plan_types.StrategyPlan`` on ``cluster``, with the
    plan's ``setting.devices_per_node``."""
    if not plan.feasible:
        return StepTime(math.nan, math.nan)
    compute = compute_seconds(plan, cluster)
    blocking, overlapped, parts = {INTRA_NODE: 0.0, INTER_NODE: 0.0}, {INTRA_NODE: 0.0, INTER_NODE: 0.0}, {}
    for name, part in plan.comm_parts.items():
        link, seconds = part_seconds(part, plan.setting.devices_per_node, cluster)
        (overlapped if OVERLAPPED[name] else blocking)[link] += seconds
        parts[name] = (link, seconds)
    seconds = sum(blocking.values()) + max(compute, *overlapped.values())
    busy = {COMPUTE: compute, **{link: blocking[link] + overlapped[link] for link in blocking}}
    setting = plan.setting
    tokens = setting.micro_batch * setting.seq_len / plan.devices_per_replica
    return StepTime(seconds, compute, blocking, overlapped, max(BOUNDS, key=busy.__getitem__),
                    plan.flops_per_step / seconds / 1e12, tokens / seconds, parts)


# --- against published runs ----------------------------------------------------------------------

@dataclass(frozen=True)
class AnchorComparison:
    """``compare_anchor``'s answer: the anchor, the plan of its run and its ``StepTime``."""

    anchor: object  # anchors.TimeAnchor
    plan: object  # plan_types.StrategyPlan
    time: StepTime
    cluster: Cluster

    @property
    def micro_batches(self):
        """Micro-batches (of one sequence) each replica runs per published step."""
        return self.anchor.sequences_per_step / self.anchor.dp

    @property
    def seconds(self):
        return self.time.seconds * self.micro_batches

    @property
    def tflops(self):
        """Modelled TFLOPs per GPU, counted as the source counts them."""
        return self.anchor.count_flops(self.anchor) / (self.seconds * self.anchor.gpus * 1e12)

    @property
    def ratio(self):
        """Modelled / published throughput: published / modelled step time."""
        return self.tflops / self.anchor.published_tflops

    @property
    def implied_efficiency(self):
        """The efficiency at which the model would give the published time, with its
        communication as it is; None where the overlapped traffic alone exceeds it."""
        compute = self.anchor.seconds / self.micro_batches - sum(self.time.blocking.values())
        if compute <= max(self.time.overlapped.values()):
            return None
        return self.cluster.efficiency * self.time.compute / compute


def anchor_plan(anchor, devices_per_node=DEFAULT_DEVICES_PER_NODE):
    """The ``StrategyPlan`` of one replica of ``anchor``'s run, micro-batch 1, bf16."""
    setting = make_setting(anchor.model, anchor.seq_len, 1, anchor.tp * anchor.sp, "bf16", anchor.zero_stage,
                           anchor.activation_checkpointing, devices_per_node=devices_per_node)
    sequence = "SP-Ulysses" if anchor.kind == "ulysses" else "CP"
    name = f"{sequence}({anchor.sp})" + (f" x TP({anchor.tp})" if anchor.tp > 1 else "") + f" x DP({anchor.dp})"
    layout = f"tp={anchor.tp} x {sequence.split('-')[0].lower()}={anchor.sp} x dp={anchor.dp}, ZeRO-{anchor.zero_stage}"
    return plan_baseline(setting, name, layout, anchor.tp, anchor.sp, anchor.dp, anchor.kind)


def compare_anchor(anchor, efficiency=DEFAULT_CLUSTER.efficiency):
    """``AnchorComparison`` of ``anchor`` on its own hardware at ``efficiency``."""
    cluster = Cluster(efficiency=efficiency, **anchor.cluster)
    plan = anchor_plan(anchor)
    return AnchorComparison(anchor, plan, step_time(plan, cluster), cluster)


def compare_anchors(efficiency=DEFAULT_CLUSTER.efficiency):
    """``compare_anchor`` for every published run in ``anchors.TIME_ANCHORS``."""
    return [compare_anchor(anchor, efficiency) for anchor in TIME_ANCHORS]
