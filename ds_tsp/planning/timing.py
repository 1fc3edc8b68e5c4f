"""Step time of each strategy on a cluster: its attention, matmuls and
elementwise work each at the rate its kernels reach on the device
(``kernels``: published benchmarks, none fitted here), its communication
over the intra-node link (NVLink) or the inter-node one (InfiniBand) at what
NCCL achieves there, the overlap its schedule allows, and a factor for the
framework around the kernels (1 by default, the kernels alone;
``compare_anchors`` fits it to published runs, in sample and leaving each run
out of the fit it is judged by); and the bound, the busiest of compute, the
intra-node link and the inter-node link.

Per device, per optimizer step of ``m`` micro-batches (``plan_types``)::

    compute = attention FLOPs / attention rate(kernel, head size, rows)
            + matmul FLOPs / matmul rate(dtype, shape) + elementwise bytes / HBM rate
    part    = bytes received / what NCCL achieves on the link its group runs over   (one per ``comm_parts`` kind)
    micro   = sum(blocking parts) + max(compute, overlapped parts on NVLink, overlapped parts on InfiniBand)
    step    = overhead * ((m - 1) * micro without the once-a-step parts + micro with them)

The attention rate is looked up at the query rows one kernel takes
(``StrategyPlan.attention_rows``: the sequence, ``S/c`` under context
parallelism, ``S/D`` under TSP) and the model's head size; the matmul shape is
the device's tokens by the hidden size square; the elementwise bytes are
``flops.elementwise_bytes`` over the replica's devices (FP8 matmuls add their
casts). The optimizer step and host offloads are not timed.

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
achieves (no latency term). Once a step (``PER_STEP``): the updated weights'
gathers, and under ZeRO-0/1 the gradient reductions (ZeRO-2/3 reduce every
micro-step).

``compare_anchors`` runs the model on every published run
(``anchors.TIME_ANCHORS``), on its own hardware, kernels and batch, and sets
its throughput, counted as the source counts FLOPs, beside the published one:
with no overhead (the kernels alone), with the overhead fitted to all the runs
(in sample), and with the overhead fitted to the others (left out).
"""

import math
import statistics
from dataclasses import dataclass, field

from ds_tsp.planning.anchors import TIME_ANCHORS
from ds_tsp.planning.baselines import plan_baseline
from ds_tsp.planning.flops import elementwise_bytes
from ds_tsp.planning.kernels import attention_tflops, check_kernels, device, link_gb_s, matmul_tflops
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
from ds_tsp.planning.strategies import make_setting, plan_alst

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
# Once an optimizer step, whatever the micro-batches: the updated weights' gathers; under ZeRO-0/1 the reductions.
PER_STEP = (PARAM_GATHER, EXPERT_PARAM_GATHER, VISION_PARAM_GATHER)
PER_STEP_BELOW_ZERO_2 = (GRAD_REDUCE, EXPERT_GRAD_REDUCE, TSP_PARTS["all_reduce"])

# The framework around the kernels (launches, host work, what the overlap misses), a factor on the step time: 1,
# the kernels alone, so that nothing is fitted to the published runs the model is judged on. ``compare_anchors``
# prints the factor those runs imply, fitted in sample and with each run left out.
OVERHEAD = 1.0


@dataclass(frozen=True)
class Cluster:
    """The ``device`` (``kernels.DEVICES``), the attention kernel its layers run
    (None: the device's default), the matmuls' dtype, the framework's
    ``overhead`` on the kernels' time, and the links' line rates where they
    differ from the device's (GB/s, 1e9 B, per device per direction; NCCL
    reaches its published share of them)."""

    device: str = "h100"
    attention_kernel: str | None = None
    matmul_dtype: str = "bf16"
    overhead: float = OVERHEAD
    intra_node_gb_s: float | None = None
    inter_node_gb_s: float | None = None

    def __post_init__(self):
        check_kernels(device(self.device), self.attention, self.matmul_dtype)
        for label in ("intra_node_gb_s", "inter_node_gb_s"):
            value = getattr(self, label)
            if value is not None and not value > 0:
                raise ValueError(f"{label} must be > 0, not {value!r}")
        if not self.overhead > 0:
            raise ValueError(f"overhead multiplies the kernels' time: it must be > 0, not {self.overhead!r}")

    @property
    def spec(self):
        return device(self.device)

    @property
    def attention(self):
        return self.attention_kernel or device(self.device).default_attention

    def link(self, intra_node, all_to_all):
        """GB/s NCCL moves per device each way on the intra-node or inter-node link."""
        return link_gb_s(self.spec, intra_node, all_to_all, self.intra_node_gb_s if intra_node else
                         self.inter_node_gb_s)

    def describe(self):
        d = self.spec
        return (f"{d.name.upper()}: {self.attention} attention, {self.matmul_dtype} matmuls at up to "
                f"{d.matmul[self.matmul_dtype]:g} TFLOPs, HBM {d.hbm_gb_s:g} GB/s x {d.hbm_share:.2f}, "
                f"{self.intra_node_gb_s or d.intra_node_gb_s:g} GB/s intra-node and "
                f"{self.inter_node_gb_s or d.inter_node_gb_s:g} GB/s inter-node per device each way at NCCL's share, "
                f"framework overhead x{self.overhead:.2f}")


DEFAULT_CLUSTER = Cluster()


@dataclass(frozen=True)
class StepTime:
    """``step_time``'s answer. Seconds per optimizer step; ``compute``: its
    kernels' seconds (overhead included); ``blocking`` and ``overlapped`` by
    link, of the step's last micro-batch; ``parts``: kind -> (link, seconds)."""

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
    a2a = part.op == "all_to_all"
    intra, inter = cluster.link(True, a2a) * 1e9, cluster.link(False, a2a) * 1e9
    g = part.group_size
    if not crosses_nodes(g, part.stride, devices_per_node):
        return INTRA_NODE, part.nbytes / intra
    if not a2a:
        return INTER_NODE, part.nbytes / inter
    local = min(g, max(1, devices_per_node // part.stride))
    remote = (g - local) / (g - 1)
    over_nvlink, over_ib = part.nbytes * (1 - remote) / intra, part.nbytes * remote / inter
    return (INTER_NODE, over_ib) if over_ib >= over_nvlink else (INTRA_NODE, over_nvlink)


def kernel_seconds(plan, cluster=DEFAULT_CLUSTER):
    """Seconds of one micro-batch's kernels, by kind: attention, matmuls and
    elementwise (module docstring), before the overhead."""
    setting, d = plan.setting, cluster.spec
    m = setting.model
    attention = plan.attention_flops_per_step
    seconds = {"attention": 0.0}
    if attention:
        rate = attention_tflops(d, cluster.attention, m.head_dim, plan.attention_rows or setting.seq_len)
        seconds["attention"] = attention / (rate * 1e12)
    fp8 = cluster.matmul_dtype == "fp8"
    tokens = plan.tokens_per_device
    rate = matmul_tflops(d, cluster.matmul_dtype, tokens, m.hidden_size, m.hidden_size,
                         1 if fp8 else setting.precision.element)
    seconds["matmul"] = (plan.flops_per_step - attention) / (rate * 1e12)
    moved = elementwise_bytes(m, setting, setting.micro_batch, setting.seq_len, fp8) / plan.devices_per_replica
    seconds["elementwise"] = moved / (d.hbm_gb_s * d.hbm_share * 1e9)
    return seconds


def compute_seconds(plan, cluster=DEFAULT_CLUSTER):
    """One micro-batch's kernels, attention, matmuls and elementwise, before the overhead."""
    return sum(kernel_seconds(plan, cluster).values())


def _micro_batch(plan, cluster, compute, once):
    """(seconds, blocking, overlapped, parts) of one micro-batch; ``once``: with the once-a-step parts."""
    blocking, overlapped, parts = {INTRA_NODE: 0.0, INTER_NODE: 0.0}, {INTRA_NODE: 0.0, INTER_NODE: 0.0}, {}
    per_step = PER_STEP + (PER_STEP_BELOW_ZERO_2 if plan.setting.zero_stage < 2 else ())
    for name, part in plan.comm_parts.items():
        if name in per_step and not once:
            continue
        link, seconds = part_seconds(part, plan.setting.devices_per_node, cluster)
        (overlapped if OVERLAPPED[name] else blocking)[link] += seconds
        parts[name] = (link, seconds)
    return sum(blocking.values()) + max(compute, *overlapped.values()), blocking, overlapped, parts


def step_time(plan, cluster=DEFAULT_CLUSTER, micro_batches=1):
    """``StepTime`` of one ``plan_types.StrategyPlan`` on ``cluster`` for an
    optimizer step of ``micro_batches``, with the plan's ``setting.devices_per_node``."""
    if not plan.feasible:
        return StepTime(math.nan, math.nan)
    compute = compute_seconds(plan, cluster)
    last, blocking, overlapped, parts = _micro_batch(plan, cluster, compute, once=True)
    earlier = _micro_batch(plan, cluster, compute, once=False)[0]
    seconds = cluster.overhead * ((micro_batches - 1) * earlier + last)
    busy = {COMPUTE: compute, **{link: blocking[link] + overlapped[link] for link in blocking}}
    setting = plan.setting
    tokens = micro_batches * setting.micro_batch * setting.seq_len / plan.devices_per_replica
    return StepTime(seconds, cluster.overhead * micro_batches * compute, blocking, overlapped,
                    max(BOUNDS, key=busy.__getitem__), micro_batches * plan.flops_per_step / seconds / 1e12,
                    tokens / seconds, parts)


# --- against published runs ----------------------------------------------------------------------

@dataclass(frozen=True)
class AnchorComparison:
    """One line of ``compare_anchors``: the anchor, the plan of one replica of
    its run, the ``StepTime`` of its published step with no overhead (the
    kernels alone), and the overheads fitted to every anchor (``in_sample``)
    and to every other one (``left_out``)."""

    anchor: object  # anchors.TimeAnchor
    plan: object  # plan_types.StrategyPlan
    time: StepTime
    in_sample: float
    left_out: float

    @property
    def implied_overhead(self):
        """The overhead at which the model gives the published time."""
        return self.anchor.seconds / self.time.seconds

    def seconds(self, overhead):
        return self.time.seconds * overhead

    def tflops(self, overhead):
        """Modelled TFLOPs per GPU at ``overhead``, counted as the source counts them."""
        return self.anchor.count_flops(self.anchor) / (self.seconds(overhead) * self.anchor.gpus * 1e12)

    def ratio(self, overhead):
        """Modelled / published throughput at ``overhead``: published / modelled step time."""
        return self.anchor.seconds / self.seconds(overhead)


def anchor_plan(anchor):
    """The ``StrategyPlan`` of one replica of ``anchor``'s run, one sequence a micro-batch, bf16; under pipeline
    parallelism, of its slowest stage: ``L / pp`` layers and the LM head."""
    if anchor.kind == "alst":
        return plan_alst(anchor.model, anchor.seq_len, anchor.sp, devices_per_node=DEFAULT_DEVICES_PER_NODE)
    model = anchor.model
    if anchor.pp > 1:
        model = {**model, "num_hidden_layers": -(-model["num_hidden_layers"] // anchor.pp)}
    setting = make_setting(model, anchor.seq_len, 1, anchor.tp * anchor.sp, "bf16", anchor.zero_stage,
                           anchor.activation_checkpointing, offload_optimizer=anchor.offload_optimizer,
                           devices_per_node=DEFAULT_DEVICES_PER_NODE)
    sequence = "SP-Ulysses" if anchor.kind == "ulysses" else "CP"
    name = f"{sequence}({anchor.sp})" + (f" x TP({anchor.tp})" if anchor.tp > 1 else "") + f" x DP({anchor.dp})"
    layout = (f"tp={anchor.tp} x {sequence.split('-')[0].lower()}={anchor.sp}"
              + (f" x pp={anchor.pp}" if anchor.pp > 1 else "") + f" x dp={anchor.dp}"
              + (f", ep={anchor.ep}" if anchor.ep > 1 else "") + f", ZeRO-{anchor.zero_stage}")
    return plan_baseline(setting, name, layout, anchor.tp, anchor.sp, anchor.dp, anchor.kind,
                         expert_parallel=anchor.ep)


def fitted_overhead(comparisons):
    """The overhead that sets the model on the published runs of ``comparisons`` best (those ``in_fit``): the
    geometric mean of their published over kernel-only step times."""
    return math.exp(statistics.fmean(math.log(c.implied_overhead) for c in comparisons if c.anchor.in_fit))


def compare_anchors(anchors=TIME_ANCHORS):
    """``AnchorComparison`` of every run in ``anchors`` on its own hardware, kernels and batch."""
    kernels_only = []
    for anchor in anchors:
        plan = anchor_plan(anchor)
        # 1F1B: the slowest stage runs its micro-batches and waits out pp - 1 more slots (the bubble)
        time = step_time(plan, Cluster(overhead=1.0, **anchor.cluster), anchor.micro_batches + anchor.pp - 1)
        kernels_only.append(AnchorComparison(anchor, plan, time, math.nan, math.nan))
    in_sample = fitted_overhead(kernels_only)
    return [AnchorComparison(c.anchor, c.plan, c.time, in_sample,
                             fitted_overhead(kernels_only[:i] + kernels_only[i + 1:]))
            for i, c in enumerate(kernels_only)]
