"""The longest sequence each strategy trains within a per-rank memory budget,
measured on CPU gloo ranks (or GPUs where present), against the planner's.

    python benchmarks/longest.py                       # the committed run (benchmarks/results/longest.md)
    python benchmarks/longest.py --sizes 2 --budget-mib 8 --start 64 --out /tmp/longest   # a smoke run
    python benchmarks/longest.py --logits-tile-mib 1 --name longest_tile1mib   # the logits tile scaled to the budget
    python benchmarks/longest.py --replan       # the planner's side of the committed run again, nothing measured

For each strategy and each ``D`` in ``--sizes``, ranks forked as in
``compare.py`` train one engine through a search on the sequence length: the
length doubles from ``--start`` until a step does not fit, then bisection
finds the boundary on the strategy's grid (multiples of ``--granularity`` and
of its sequence divisor: ``2D`` for TSP's zigzag, ``D`` for Ulysses). A length
fits when one training step (forward, backward, optimizer) runs and its peak
live tensor bytes, the max over ranks, stay within ``--budget-mib``: the
length found fits, the next one on the grid does not. Every measured length is
set beside ``ds_tsp.planning.plan``'s per-device peak for the same setting
(AutoTP: ``plan_autotp``, whose vocabulary is laid out as AutoTP training lays
it out: embedding whole, LM-head output gathered; ``plan``'s ``TP(N)`` is
Megatron's vocabulary-parallel head).

Strategies, all fp32, AdamW, micro-batch ``--batch``, activation checkpointing
on (as long-context training runs):

* ``tsp``: ``ds_tsp.initialize``, folded vocabulary, ``tsp.token_tile``,
  ``tsp.recompute_norms`` (the long-sequence setting, as ``ds-tsp plan
  --max-seq-len`` plans it; ``--no-recompute-norms`` for Hugging Face's norms),
  DeepSpeed's ``activation_checkpointing`` section, ZeRO-0;
* ``tsp_offload``: the same with ``cpu_checkpointing`` (each layer's
  checkpointed input in host memory, ``ds_tsp.runtime.offload``) and ZeRO-2 with
  ``offload_optimizer: cpu`` (fp32 master weights, Adam moments and fp32
  gradients in host memory; the client's torch AdamW);
* ``autotp``, ``ulysses``, ``ulysses_zero3``: as ``compare.py`` runs them, with
  Hugging Face gradient checkpointing (non-reentrant) turned on in the model.

Host and device memory (``measure.in_host_memory``). On CPU ranks both are
the same RAM, so what a GPU run keeps in host memory is counted apart, as host
bytes, and left out of the budget: the copies ``ds_tsp.runtime.offload.HostCopy``
makes, the tensors ZeRO's CPU offload holds (fp32 partitions and their
gradients, the bit16 and gradient staging buffers, the optimizer state) and
everything the torch optimizer allocates in its step, which runs on the host.
``HostCopy.to_device`` returns the host tensor itself on CPU; here it returns a
copy, as the host-to-device copy does on a GPU, so the layer input that comes
back for its recompute is on the device side of the count. The measured host
peak is reported beside the planner's host bytes per rank.

Writes ``<name>.json``, ``<name>.md`` and ``<name>.png`` (peak memory against
sequence length per strategy, measured and planned) under ``--out``.
"""

import argparse
import json
import math
import os
import queue
import shlex
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import compare  # noqa: E402  (sets DS_ACCELERATOR/OMP_NUM_THREADS and installs the counting shim first)
import deepspeed
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from compare import FullSequenceRun, adamw, batch_ids, build_model, ds_config, zero3_buckets
from measure import LiveTensorBytes, in_host_memory
from ranks import _error_line, _exit
from report import plan_model

import ds_tsp
from ds_tsp.runtime import offload
from ds_tsp.planning import plan, plan_autotp, tsp_name

MIB = 2**20

LABELS = {"tsp": "TSP", "tsp_offload": "TSP + offload", "autotp": "AutoTP", "ulysses": "Ulysses",
          "ulysses_zero3": "Ulysses + ZeRO-3"}
TSP_STRATEGIES = ("tsp", "tsp_offload")
OFFLOAD_ZERO_STAGE = 2  # DeepSpeed's optimizer offload needs ZeRO >= 1; at DP = 1 stages 1 and 2 hold the same


# --- the strategies, with activation checkpointing -----------------------------------------------------------------

def _tsp_section(world, args):
    return {"enabled": True, "size": world, "layout": compare.TSP_LAYOUT, "attention_backend": "sdpa",
            "token_tile": args.token_tile, "recompute_norms": args.recompute_norms,
            "logits_tile_mib": args.logits_tile_mib}


def run_tsp(world, args):
    config = ds_config(args, tsp=_tsp_section(world, args),
                       activation_checkpointing={"partition_activations": False, "cpu_checkpointing": False})
    engine, *_ = ds_tsp.initialize(model=build_model(args), optimizer=adamw, config=config)
    return FullSequenceRun(engine)


def run_tsp_offload(world, args):
    buckets = zero3_buckets(args)["reduce_bucket_size"]
    config = ds_config(args, zero_stage=OFFLOAD_ZERO_STAGE, tsp=_tsp_section(world, args),
                       activation_checkpointing={"partition_activations": False, "cpu_checkpointing": True},
                       zero_force_ds_cpu_optimizer=False)
    # Buckets sized for this model, as compare.py's ZeRO-3 ones (DeepSpeed's 5e8 elements would swamp it).
    config["zero_optimization"].update(offload_optimizer={"device": "cpu"}, reduce_bucket_size=buckets,
                                       allgather_bucket_size=buckets)
    engine, *_ = ds_tsp.initialize(model=build_model(args), optimizer=adamw, config=config)
    _optimizer_step_on_host(engine.optimizer)
    return FullSequenceRun(engine)


def _checkpointed_model(args):
    model = build_model(args)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def run_autotp(world, args):
    return compare.run_autotp(world, args, build=_checkpointed_model)


def run_ulysses(world, args):
    return compare.run_ulysses(world, args, build=_checkpointed_model)


def run_ulysses_zero3(world, args):
    return compare.run_ulysses_zero3(world, args, build=_checkpointed_model)


STRATEGIES = {"tsp": run_tsp, "tsp_offload": run_tsp_offload, "autotp": run_autotp, "ulysses": run_ulysses,
              "ulysses_zero3": run_ulysses_zero3}


def sequence_divisor(strategy, world):
    """The lengths a strategy can take: TSP's zigzag cuts 2D chunks, Ulysses D."""
    return {"tsp": 2 * world, "tsp_offload": 2 * world, "ulysses": world, "ulysses_zero3": world}.get(strategy, 1)


# --- what lives in host memory on CPU ranks ------------------------------------------------------------------------

def _host_copy_made_in_host_memory():
    """``HostCopy``'s copy counts as host memory; on CPU its ``to_device``
    returns a copy, as the host-to-device copy would on a GPU."""
    make, to_device = offload.HostCopy.__init__, offload.HostCopy.to_device

    def made_in_host_memory(self, tensor, *args, **kwargs):
        with in_host_memory():
            make(self, tensor, *args, **kwargs)

    def copied_back(self):
        out = to_device(self)
        return out.clone() if out.untyped_storage()._cdata == self.host.untyped_storage()._cdata else out

    offload.HostCopy.__init__, offload.HostCopy.to_device = made_in_host_memory, copied_back


def _optimizer_step_on_host(zero_optimizer):
    """ZeRO-Offload runs the client optimizer's step on the host: what it allocates is host memory."""
    inner = zero_optimizer.optimizer
    step = inner.step

    def step_on_host(*args, **kwargs):
        with in_host_memory():
            return step(*args, **kwargs)

    inner.step = step_on_host


def offloaded_optimizer_tensors(zero_optimizer):
    """The tensors ZeRO-1/2's CPU offload keeps in host memory."""
    if not getattr(zero_optimizer, "cpu_offload", False):
        return []
    tensors = []
    for partition in zero_optimizer.single_partition_of_fp32_groups:
        tensors += [partition] + ([partition.grad] if partition.grad is not None else [])
    tensors += list(zero_optimizer.param_buffer_of_bit16_for_cpu_offload_groups)
    tensors += list(getattr(zero_optimizer, "accumulated_grads_in_cpu", {}).values())
    if getattr(zero_optimizer, "temp_grad_buffer_for_cpu_offload", None) is not None:
        tensors.append(zero_optimizer.temp_grad_buffer_for_cpu_offload)
    for state in zero_optimizer.optimizer.state.values():
        tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    return tensors


# --- one rank: the search ------------------------------------------------------------------------------------------

def measure_step(run, seq_len, args):
    """Peak device and host bytes of one training step at ``seq_len``, and its time."""
    input_ids = batch_ids(args, seq_len)
    dist.barrier()
    start = time.perf_counter()
    with LiveTensorBytes(host_tensors=offloaded_optimizer_tensors(run.engine.optimizer)) as live:
        loss = run.step(input_ids)
    seconds = time.perf_counter() - start
    return {"peak_live_bytes": live.peak_bytes, "state_bytes": live.state_bytes,
            "host_peak_bytes": live.host_peak_bytes, "host_state_bytes": live.host_state_bytes,
            "step_s": seconds, "loss": loss}


def search_lengths(fits, grid, start, max_len):
    """The largest multiple of ``grid`` that ``fits`` (monotone), 0 if none:
    doubling from ``start`` (a multiple of ``grid``), then bisection on the grid.
    Stops doubling at ``max_len``, which then is the answer if it fits."""
    lo, hi = 0, start // grid
    while fits(hi * grid):
        lo = hi
        if hi * grid >= max_len:
            return lo * grid
        hi = min(2 * hi, max_len // grid)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * grid) else (lo, mid)
    return lo * grid


def grid_for(strategy, world, args):
    divisor = sequence_divisor(strategy, world)
    return divisor * args.granularity // math.gcd(divisor, args.granularity)


def _worker(strategy, world, rank, rendezvous, args, results):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=args.collective_timeout))
        deepspeed.init_distributed(dist_backend="gloo")
        if strategy == "tsp_offload":
            _host_copy_made_in_host_memory()
        run = STRATEGIES[strategy](world, args)
        grid = grid_for(strategy, world, args)
        run.step(batch_ids(args, grid))  # builds the optimizer state: every measured step is a steady one
    except Exception as exc:
        _exit(results, (rank, "error", None, _error_line(exc)))
    budget = args.budget_mib * MIB

    def fits(seq_len):
        try:
            measured = measure_step(run, seq_len, args)
        except Exception as exc:  # a GPU out of memory; the ranks cannot be trusted to go on in step
            _exit(results, (rank, "error", seq_len, _error_line(exc)))
        results.put((rank, "ok", seq_len, measured))
        worst = torch.tensor([float(measured["peak_live_bytes"])], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return worst.item() <= budget

    start = -(-args.start // grid) * grid
    search_lengths(fits, grid, start, args.max_len)
    _exit(results, (rank, "done", None, None))


def run_search(strategy, world, args):
    """Fork ``world`` ranks; ``({seq_len: [per-rank dict]} in measured order, error or None)``."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    measured, error, done = {}, None, set()
    with tempfile.TemporaryDirectory(prefix="ds_tsp_longest_") as tmp:
        procs = [ctx.Process(target=_worker, args=(strategy, world, r, os.path.join(tmp, "rdzv"), args, results),
                             daemon=True) for r in range(world)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + args.strategy_timeout
        while len(done) < world:
            wait = min(10.0, deadline - time.monotonic()) if error else deadline - time.monotonic()
            if wait <= 0:
                error = error or f"no answer within {args.strategy_timeout} s"
                break
            try:
                rank, kind, seq_len, payload = results.get(timeout=wait)
            except queue.Empty:
                if error or all(not p.is_alive() for p in procs):
                    error = error or "ranks exited without an answer"
                    break
                continue
            if kind == "ok":
                measured.setdefault(seq_len, {})[rank] = payload
            else:
                done.add(rank)
                if kind == "error":
                    error = error or f"at {seq_len or 'set-up'}: {payload}"
        for proc in procs:
            proc.join(timeout=1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    complete = {s: [ranks[r] for r in range(world)] for s, ranks in measured.items() if len(ranks) == world}
    return complete, error


# --- the planner's counterpart -------------------------------------------------------------------------------------

def planned(strategy, world, seq_len, args):
    """The planner's ``StrategyPlan`` for this strategy at ``seq_len``."""
    name = {"tsp": tsp_name(world), "tsp_offload": tsp_name(world), "autotp": f"TP({world})",
            "ulysses": f"SP-Ulysses({world})", "ulysses_zero3": f"SP-Ulysses({world})"}[strategy]
    zero_stage = {"tsp_offload": OFFLOAD_ZERO_STAGE, "ulysses_zero3": 3}.get(strategy, 0)
    offloads = strategy == "tsp_offload"
    if strategy == "autotp":  # plan's TP(N) is Megatron's vocabulary-parallel head; AutoTP gathers the logits
        # compare.FullSequenceRun keeps only the loss, so the logits output is freed before backward.
        return plan_autotp(plan_model(args), seq_len, args.batch, world, dtype="fp32", zero_stage=zero_stage,
                           activation_checkpointing=True, logits_kept=False)
    plans = plan(plan_model(args), seq_len, args.batch, world, dtype="fp32", zero_stage=zero_stage,
                 activation_checkpointing=True, token_tile=args.token_tile, logits_tile_mib=args.logits_tile_mib,
                 recompute_norms=args.recompute_norms and strategy in TSP_STRATEGIES, offload_activations=offloads,
                 offload_optimizer=offloads)
    return next(p for p in plans if p.name == name)


def summarize(strategy, world, measured, error, args):
    """One strategy at one D: every measured length (max over ranks) with the
    planner's peak, the longest length that fits and what binds past it."""
    budget = args.budget_mib * MIB
    rows = []
    for seq_len, per_rank in measured.items():
        peak = max(r["peak_live_bytes"] for r in per_rank)
        rows.append({"seq_len": seq_len, "fits": peak <= budget, "peak_mib": peak / MIB,
                     "state_mib": max(r["state_bytes"] for r in per_rank) / MIB,
                     "host_peak_mib": max(r["host_peak_bytes"] for r in per_rank) / MIB,
                     "step_s": max(r["step_s"] for r in per_rank), "loss": per_rank[0]["loss"]})
    return planned_entry(strategy, world, rows, list(measured), error, args)


def planned_entry(strategy, world, rows, order, error, args):
    """The entry of one strategy at one D from its measured ``rows``: each
    with the planner's peak for its length, the longest length that fits and
    what the planner says binds past it."""
    grid = grid_for(strategy, world, args)
    for row in rows:
        plan_ = planned(strategy, world, row["seq_len"], args)
        row.update(planned_mib=plan_.total / MIB, planned_over_measured=plan_.total / (row["peak_mib"] * MIB),
                   planned_host_mib=plan_.host_total / plan_.setting.ranks_per_node / MIB,
                   planned_terms_mib={k: v / MIB for k, v in plan_.terms.items()})
    longest = max((r["seq_len"] for r in rows if r["fits"]), default=0)
    beyond = [r for r in rows if r["seq_len"] == longest + grid]
    ratios = [r["planned_over_measured"] for r in rows]
    entry = {"strategy": strategy, "tsp_size": world, "grid": grid, "longest_seq_len": longest,
             "next_fits": beyond[0]["fits"] if beyond else None,
             "worst_planned_over_measured": max(ratios, key=lambda x: abs(x - 1)) if ratios else None,
             "measured": sorted(rows, key=lambda r: r["seq_len"]), "order": order, "error": error}
    if beyond:  # what the planner says grows past the budget first: its largest term one step beyond
        terms = beyond[0]["planned_terms_mib"]
        entry["binding_term"] = max(terms, key=terms.get)
    return entry


# --- the report ----------------------------------------------------------------------------------------------------

def best_anchor(entries, world):
    anchors = [e for e in entries if e["tsp_size"] == world and e["strategy"] not in TSP_STRATEGIES]
    return max(anchors, key=lambda e: e["longest_seq_len"], default=None)


def write_markdown(doc, path):
    replanned = f" (the planner's side: `{doc['replanned']}`)" if doc.get("replanned") else ""
    lines = [f"Command: `{doc['command']}`{replanned}", "",
             f"Whole run: {doc['elapsed_s']:.0f} s on {doc['cpu_count']} shared CPU cores (gloo, one thread per rank), "
             f"torch {doc['torch']}, DeepSpeed {doc['deepspeed']}. Budget: {doc['budget_mib']:g} MiB of peak live "
             f"tensors per rank (device memory; host memory counted apart, see `benchmarks/longest.py`). Model: "
             f"{_model_line(doc['model'])}; every strategy with activation checkpointing; TSP with "
             f"`tsp.token_tile` = {doc['token_tile']}, `tsp.logits_tile_mib` = {doc.get('logits_tile_mib', 32):g} "
             f"and `tsp.recompute_norms` = "
             f"{str(doc['recompute_norms']).lower()}. Search: doubling from {doc['start']} tokens, then bisection "
             f"on multiples of {doc['granularity']} tokens (and of each strategy's sequence divisor).", "",
             "| strategy | D | longest sequence | / best anchor | peak at longest (MiB) | next length fits | "
             "planned / measured, worst | planner's binding term past it |", "|---|---|---|---|---|---|---|---|"]
    for entry in doc["results"]:
        anchor = best_anchor(doc["results"], entry["tsp_size"])
        ratio = entry["longest_seq_len"] / anchor["longest_seq_len"] if anchor and anchor["longest_seq_len"] else None
        at = next((r for r in entry["measured"] if r["seq_len"] == entry["longest_seq_len"]), None)
        worst = entry["worst_planned_over_measured"]
        cells = ["-" if ratio is None else f"{ratio:.2f}x", "-" if at is None else f"{at['peak_mib']:.2f}",
                 _yes_no(entry["next_fits"]), "-" if worst is None else f"{worst:.3f}"]
        lines.append(f"| {LABELS[entry['strategy']]} | {entry['tsp_size']} | {entry['longest_seq_len']} | "
                     f"{' | '.join(cells)} | "
                     f"{entry.get('binding_term', '-')} |")
    lines += ["", "### Every measured length", "",
              "Peak: max over ranks of the peak live device bytes of one training step; host: the same for the "
              "host memory of the offloads (planned: the planner's host bytes per rank). Planned: "
              "`ds_tsp.planning.plan(model, S, B, D, dtype=\"fp32\", zero_stage, activation_checkpointing=True, "
              "token_tile, recompute_norms, offload_*)`.", "",
              "| strategy | D | seq len | fits | peak (MiB) | planned (MiB) | planned / measured | host (MiB) | "
              "planned host (MiB) | step (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for entry in doc["results"]:
        for row in entry["measured"]:
            lines.append(f"| {LABELS[entry['strategy']]} | {entry['tsp_size']} | {row['seq_len']} | "
                         f"{_yes_no(row['fits'])} | {row['peak_mib']:.2f} | {row['planned_mib']:.2f} | "
                         f"{row['planned_over_measured']:.3f} | {row['host_peak_mib']:.2f} | "
                         f"{row['planned_host_mib']:.2f} | {row['step_s']:.2f} |")
    errors = [f"* {LABELS[e['strategy']]} at D={e['tsp_size']}: {e['error']}" for e in doc["results"] if e["error"]]
    if errors:
        lines += ["", "### Errors", ""] + errors
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _yes_no(value):
    return "-" if value is None else ("yes" if value else "no")


def _model_line(model):
    return (f"Llama-shaped, hidden {model['hidden']}, {model['layers']} layers, {model['heads']} heads, "
            f"{model['kv_heads']} KV heads, intermediate {model['intermediate']}, vocab {model['vocab']}, fp32, "
            f"micro-batch {model['batch']}, AdamW")


def write_plot(doc, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({e["tsp_size"] for e in doc["results"]})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.8), squeeze=False)
    for ax, world in zip(axes[0], sizes):
        for index, entry in enumerate(e for e in doc["results"] if e["tsp_size"] == world):
            rows = entry["measured"]
            if not rows:
                continue
            color = f"C{index}"
            xs = [r["seq_len"] for r in rows]
            ax.plot(xs, [r["peak_mib"] for r in rows], marker="o", color=color,
                    linewidth=2.5 if entry["strategy"] in TSP_STRATEGIES else 1.5,
                    label=f"{LABELS[entry['strategy']]} (longest {entry['longest_seq_len']})")
            ax.plot(xs, [r["planned_mib"] for r in rows], linestyle=":", color=color, linewidth=1)
        ax.axhline(doc["budget_mib"], color="black", linestyle="--", linewidth=1, label="budget")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("peak live tensor memory per rank (MiB)")
        ax.set_title(f"D = {world}: measured (solid), planned (dotted)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main ----------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4], help="ranks D per parallel strategy")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--budget-mib", type=float, default=24.0, help="peak live device tensor MiB per rank")
    parser.add_argument("--start", type=int, default=512, help="first length of the doubling")
    parser.add_argument("--granularity", type=int, default=64, help="lengths searched are multiples of this")
    parser.add_argument("--max-len", type=int, default=1 << 16, help="the doubling stops here")
    parser.add_argument("--token-tile", type=int, default=512, help="tsp.token_tile")
    parser.add_argument("--logits-tile-mib", type=float, default=32.0, help="tsp.logits_tile_mib")
    parser.add_argument("--recompute-norms", action=argparse.BooleanOptionalAction, default=True,
                        help="tsp.recompute_norms for the TSP strategies (default: on, the long-sequence setting)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=176)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--strategy-timeout", type=float, default=600, help="seconds for one strategy's search")
    parser.add_argument("--collective-timeout", type=float, default=300, help="gloo timeout, so a dead peer fails")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="longest", help="stem of the files written under --out")
    parser.add_argument("--replan", action="store_true",
                        help="measure nothing: put the planner's peaks beside --out/--name's measured ones again "
                             "(after a planner change) and rewrite its table and plot; pass the run's own options")
    args = parser.parse_args(argv)
    if min(args.sizes) < 2:
        parser.error("--sizes are parallel group sizes, 2 or more")
    if args.start < 1 or args.granularity < 1 or args.max_len < args.start:
        parser.error("--start and --granularity must be >= 1 and --max-len >= --start")
    args.seq_lens = [args.max_len]  # compare.build_model sizes max_position_embeddings by it
    args.model = "dense"  # compare.build_model's Llama-shaped model
    return args


def _settings(args):
    """What a run's measurements depend on, as its JSON records them."""
    return {"budget_mib": args.budget_mib, "token_tile": args.token_tile, "logits_tile_mib": args.logits_tile_mib,
            "recompute_norms": args.recompute_norms, "model": compare._model_card(args)}


def replan(args, command):
    """``--replan``: the planner's side of a written run again, its measurements kept."""
    path = os.path.join(args.out, f"{args.name}.json")
    with open(path) as f:
        doc = json.load(f)
    for key, value in _settings(args).items():
        if doc.get(key) != value:
            raise SystemExit(f"--replan: {path} was measured with {key} = {doc.get(key)!r}, not {value!r}: "
                             f"pass the options of its command, `{doc['command']}`")
    doc["results"] = [planned_entry(e["strategy"], e["tsp_size"], e["measured"], e["order"], e["error"], args)
                      for e in doc["results"]]
    doc["replanned"] = command
    return doc


def main(argv=None):
    args = parse_args(argv)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("DS_ACCELERATOR", "OMP_NUM_THREADS"))
    command = f"{env} " + " ".join(shlex.quote(a) for a in ["python", os.path.relpath(__file__)] + sys.argv[1:])
    if args.replan:
        write_reports(replan(args, command), args)
        return
    begin = time.monotonic()
    entries = []
    for world in args.sizes:
        for strategy in args.strategies:
            measured, error = run_search(strategy, world, args)
            entries.append(summarize(strategy, world, measured, error, args))
            steps = [f"{s}:{statistics.mean(r['peak_live_bytes'] for r in v) / MIB:.1f}" for s, v in measured.items()]
            print(f"[{time.monotonic() - begin:.0f} s] {strategy} D={world}: longest "
                  f"{entries[-1]['longest_seq_len']} ({' '.join(steps)}){' ' + error if error else ''}", flush=True)
    doc = {"command": command, "elapsed_s": time.monotonic() - begin, **_settings(args),
           "start": args.start, "granularity": args.granularity, "max_len": args.max_len,
           "torch": torch.__version__, "deepspeed": deepspeed.__version__, "cpu_count": os.cpu_count(),
           "results": entries}
    write_reports(doc, args)


def write_reports(doc, args):
    """``<name>.json``, ``.md`` and ``.png`` under ``--out``, and the table on stdout."""
    for world in sorted({entry["tsp_size"] for entry in doc["results"]}):
        anchor = best_anchor(doc["results"], world)
        doc.setdefault("best_anchor", {})[str(world)] = anchor and {"strategy": anchor["strategy"],
                                                                    "longest_seq_len": anchor["longest_seq_len"]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    write_markdown(doc, os.path.join(args.out, f"{args.name}.md"))
    write_plot(doc, os.path.join(args.out, f"{args.name}.png"))
    print(open(os.path.join(args.out, f"{args.name}.md")).read())


if __name__ == "__main__":
    main()
