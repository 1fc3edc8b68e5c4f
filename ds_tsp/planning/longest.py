"""The longest sequence each strategy trains on ``N`` devices of a given memory,
with a given host memory per node, by the peak-memory model of the plans (``tsp_plan``, ``baselines``)
(DESIGN.md 6d), and the term that stops it.

Every term of a plan's peak grows with the sequence length, so "fits" is
monotone in ``S`` and a doubling search followed by bisection finds the
boundary on the strategy's own grid of lengths (multiples of its sequence
divisor: ``2N`` for TSP's zigzag, ``c`` for Ulysses, 1 for TP): the length
found fits, the next one on the grid does not. The binding term is the largest
term of the budget that the next length breaks: of the device's peak
(``StrategyPlan.terms``) or of the node's host memory (``StrategyPlan.host``).

Strategies, each with activation checkpointing (no strategy reaches long
sequences without it):

* ``TSP(N)``: folded vocabulary, ``tsp.token_tile``, checkpoints and optimizer
  on the device;
* ``TSP(N) + offload``: checkpoints in host memory (``cpu_checkpointing``) and
  ZeRO's CPU optimizer offload;
* ``TSP(N) + offload, prefetched``: the same with one more layer input on the
  device, the next checkpoint coming back under the layer above's backward:
  up to its length ``tsp.prefetch_checkpoints: "auto"`` prefetches;
* ``TP(N)`` (AutoTP), the best ``TP+SP(t x c)`` split, ``SP-Ulysses(N)``: as
  DeepSpeed runs them, ZeRO over the sequence axis at the stage given; for a
  mixture-of-experts model, which AutoTP refuses, TP splits every expert's
  ``F_e`` as Megatron's expert tensor parallelism does, and the layout says so;
* ALST: ``strategies.plan_alst``.
"""

from dataclasses import dataclass, replace

from ds_tsp.planning.anchors import ALST_DEVICE_GB, ALST_MODEL, ALST_PUBLISHED, FPDT_PUBLISHED
from ds_tsp.planning.baselines import plan_baseline
from ds_tsp.planning.shapes import (
    DEFAULT_DEVICES_PER_NODE,
    DEFAULT_LOGITS_TILE_MIB,
    DEFAULT_TOKEN_TILE,
    GB,
    model_shape,
    tsp_name,
)
from ds_tsp.planning.strategies import make_setting, plan_alst
from ds_tsp.planning.tsp_plan import plan_tsp

# A bound on the doubling, far past any memory: 2^40 tokens.
_MAX_STEPS = 2 ** 40


@dataclass
class LongestSequence:
    """One strategy's longest trainable sequence (0: not even one step of its grid)."""

    name: str
    layout: str
    seq_len: int
    step: int  # the grid: seq_len is a multiple of it, and seq_len + step does not fit
    binding: str  # the largest term of the budget the next length breaks, or why the strategy cannot run
    limit: str  # "device", "host" or "shape"
    plan: object  # the StrategyPlan at seq_len (at one step when nothing fits)
    published: int | None = None  # ALST's published length for this setting

    @property
    def device_bytes(self):
        return self.plan.total

    @property
    def host_bytes(self):
        return self.plan.host_total

    def as_dict(self):
        return {"strategy": self.name, "layout": self.layout, "longest_seq_len": self.seq_len, "step": self.step,
                "binding_term": self.binding, "limit": self.limit, "device_gb": self.device_bytes / GB,
                "host_gb_per_node": self.host_bytes / GB,
                "terms_gb": {k: v / GB for k, v in self.plan.terms.items()},
                "host_terms_gb": {k: v / GB for k, v in self.plan.host.items()},
                "published_seq_len": self.published}


def longest_fitting(fits, step):
    """The largest ``k*step`` (``k >= 1``) with ``fits(k*step)``, for ``fits``
    monotone (true up to a length, false after); 0 if ``step`` does not fit.
    Doubling, then bisection: about ``2 log2(k)`` calls."""
    if not fits(step):
        return 0
    lo, hi = 1, 2
    while fits(hi * step):
        lo, hi = hi, hi * 2
        if hi > _MAX_STEPS:
            raise ValueError(f"every length up to {lo * step} tokens fits: the memory model does not grow with S")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step


def _over(plan_, device_budget, host_budget):
    """Budgets ``plan_`` breaks, the worst first, by how far over it goes."""
    over = [(plan_.total / device_budget, "device"), (plan_.host_total / host_budget, "host")]
    return [name for ratio, name in sorted(over, reverse=True) if ratio > 1]


def search(plan_at, step, device_budget, host_budget, published=None):
    """``LongestSequence`` of the strategy ``plan_at(seq_len) -> StrategyPlan``."""
    first = plan_at(step)
    if not first.feasible:
        return LongestSequence(first.name, first.layout, 0, step, first.notes, "shape", first, published)

    def fits(seq_len):
        return not _over(plan_at(seq_len), device_budget, host_budget)

    seq_len = longest_fitting(fits, step)
    at = plan_at(seq_len or step)
    limit = _over(plan_at(seq_len + step) if seq_len else at, device_budget, host_budget)[0]
    terms = at.terms if limit == "device" else at.host
    binding = max(terms, key=terms.get)
    return LongestSequence(at.name, at.layout, seq_len, step, binding, limit, at, published)


def _published_setting(model, memory_gb, micro_batch, dtype):
    """Whether this is the setting the published lengths are for: Llama-3.1-8B's
    shape on 80 GB devices, B = 1, bf16."""
    same_model = replace(model_shape(model), name="") == replace(model_shape(ALST_MODEL), name="")
    return same_model and memory_gb == ALST_DEVICE_GB and micro_batch == 1 and dtype == "bf16"


def alst_published(model, devices, memory_gb, micro_batch=1, dtype="bf16"):
    """ALST's published length where the setting is ALST's (1, 8 or 32 devices), else None."""
    return ALST_PUBLISHED.get(devices) if _published_setting(model, memory_gb, micro_batch, dtype) else None


def fpdt_published(model, devices, memory_gb, micro_batch=1, dtype="bf16"):
    """FPDT's published length where the setting is FPDT's (4 devices), else None."""
    return FPDT_PUBLISHED.get(devices) if _published_setting(model, memory_gb, micro_batch, dtype) else None


def max_seq_len(model, devices, memory_gb, host_memory_gb, *, micro_batch=1, dtype="bf16", zero_stage=1,
                token_tile=DEFAULT_TOKEN_TILE, fp32_accumulators=True, recompute_norms=True,
                tsp_attention_backward=None,
                logits_tile_mib=DEFAULT_LOGITS_TILE_MIB, devices_per_node=DEFAULT_DEVICES_PER_NODE):
    """``LongestSequence`` of every strategy (module docstring) for ``devices``
    devices of ``memory_gb`` GB and ``host_memory_gb`` GB of host memory per
    node of ``devices_per_node``. ``zero_stage`` applies to TSP, TP, TP+SP and
    Ulysses (ALST runs ZeRO-3); TSP with offload runs at least ZeRO-1, which
    DeepSpeed's optimizer offload needs. TSP's ``token_tile``,
    ``fp32_accumulators`` and ``recompute_norms`` are the ``tsp`` config keys
    (``recompute_norms`` on by default here: the long-sequence setting)."""
    N = devices
    device_budget, host_budget = memory_gb * GB, host_memory_gb * GB
    base = make_setting(model, 2 * N, micro_batch, N, dtype, zero_stage, True, tsp_attention_backward,
                        logits_tile_mib, token_tile=token_tile, fp32_accumulators=fp32_accumulators,
                        recompute_norms=recompute_norms, devices_per_node=devices_per_node)
    offload = make_setting(model, 2 * N, micro_batch, N, dtype, max(zero_stage, 1), True, tsp_attention_backward,
                           logits_tile_mib, token_tile=token_tile, fp32_accumulators=fp32_accumulators,
                           recompute_norms=recompute_norms, offload_activations=True, offload_optimizer=True,
                           devices_per_node=devices_per_node)
    tiles = (f"token_tile={token_tile}" + ("" if fp32_accumulators else ", fp32_accumulators=false")
             + (", recompute_norms" if recompute_norms else ""))

    def tsp(setting, name, layout):
        def plan_at(seq_len):
            found = plan_tsp(replace(setting, seq_len=seq_len), vocab_parallel=True)
            found.name, found.layout = name, layout
            return found
        return search(plan_at, 2 * N, device_budget, host_budget)

    def baseline(name, layout, t, c):
        if t > 1 and base.model.is_moe:
            layout += ", experts split by F_e (Megatron's expert TP; DeepSpeed's AutoTP refuses this model)"
        return search(lambda seq_len: plan_baseline(replace(base, seq_len=seq_len), name, layout, t, c, 1,
                                                     "none" if c == 1 else "ulysses"),
                      c, device_budget, host_budget)

    results = [tsp(base, tsp_name(N), f"tsp={N}, {tiles}, ZeRO-{zero_stage}"),
               tsp(offload, tsp_name(N) + " + offload",
                   f"tsp={N}, {tiles}, ZeRO-{offload.zero_stage}, CPU optimizer + checkpoint offload"),
               tsp(replace(offload, prefetch_checkpoints=True), tsp_name(N) + " + offload, prefetched",
                   "the same, each checkpoint back under the layer above's backward (tsp.prefetch_checkpoints "
                   "\"auto\" prefetches up to this length)"),
               baseline(f"TP({N})", f"tp={N}, ZeRO-{zero_stage}", N, 1)]
    splits = [baseline(f"TP+SP({t}x{N // t})", f"tp={t} x sp={N // t}, ZeRO-{zero_stage}", t, N // t)
              for t in range(2, N) if N % t == 0]
    if splits:
        results.append(max(splits, key=lambda r: r.seq_len))
    results.append(baseline(f"SP-Ulysses({N})", f"sp={N}, ZeRO-{zero_stage}", 1, N))
    results.append(search(lambda seq_len: plan_alst(base.model, seq_len, N, micro_batch, dtype, logits_tile_mib,
                                                    devices_per_node),
                          N, device_budget, host_budget, alst_published(model, N, memory_gb, micro_batch, dtype)))
    return results
