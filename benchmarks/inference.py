"""Inference on CPU gloo ranks: Hugging Face's ``model.generate`` on one process,
under DeepSpeed's tensor-parallel inference and under TSP, side by side.

    python benchmarks/inference.py                       # the committed run (benchmarks/results/inference.md)
    python benchmarks/inference.py --sizes 2 --prompt-lens 64 128 --batches 1 --layers 1 --vocab 1024 --out /tmp/inf

Strategies, each generating ``--new-tokens`` greedy tokens from the same
weights and the same prompts (fp32, no padding):

* ``single``: the Hugging Face model on one process (its ``DynamicCache``);
* ``tp``: DeepSpeed's tensor-parallel inference, ``deepspeed.init_inference(
  model, tensor_parallel={"tp_size": D})`` (AutoTP: attention heads and MLP
  columns split, one all-reduce after each, the KV cache split by head);
* ``tsp``: ``ds_tsp.inject`` with ``tsp.size = D``: the prefill on the TSP
  schedules, decoding with the weights at rest from the sequence-sharded
  ``TSPCache`` (``ds_tsp.inference.generate``).

For every prompt length and batch (``--prompt-lens``, ``--batches``), on every
rank (``benchmarks/ranks.py`` forks them):

* peak live-tensor bytes of one ``generate`` of 2 tokens (the prefill and a
  decode step: the prefill's peak, with the whole cache), counted as
  ``benchmarks/compare.py`` counts (``measure.LiveTensorBytes``), and what it
  holds: the weights this rank keeps and its KV cache;
* then, timed: the prefill (the first forward ``generate`` runs), decode
  tokens per second over the remaining ``--new-tokens - 1`` forwards (every
  sequence's tokens, wall time, ranks aligned by a barrier), and the RSS
  high-water mark; for TSP, ds_tsp's counted bytes of the prefill and of one
  decode step. DeepSpeed's inference all-reduce on CPU runs in its
  shared-memory op, which no counter sees: TP's bytes are not reported.

Every strategy's tokens are checked against the single process's. Writes
``<name>.json``, ``<name>.md`` and ``<name>.png`` under ``--out`` (``--name``
defaults to ``inference``).
"""

import argparse
import os
import shlex
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from measure import LiveTensorBytes, install_comm_shim, peak_rss_bytes, reset_peak_rss  # noqa: E402

install_comm_shim()  # before DeepSpeed and ds_tsp keep references to torch.distributed's functions

import deepspeed  # noqa: E402
from ranks import run_on_ranks  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import ds_tsp  # noqa: E402
from ds_tsp.parallel import comm as tsp_comm
from ds_tsp.config import TSPConfig  # noqa: E402
from ds_tsp.parallel.topology import TSPTopology

MIB = 2 ** 20
NAMES = {"single": "single process", "tp": "DeepSpeed TP inference", "tsp": "TSP"}


def build_model(args):
    """The same weights on every rank of every strategy (seeded)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, tie_word_embeddings=False, attn_implementation="sdpa",
                         max_position_embeddings=max(args.prompt_lens) + args.new_tokens, eos_token_id=None)
    return LlamaForCausalLM(config).float().eval()


class GenerateRun:
    """Greedy ``generate`` with ``model``; the wall time of every forward it
    runs (the first is the prefill) and, after each, ds_tsp's bytes received so far."""

    def __init__(self, model):
        self.model = model
        self.forward_s, self.tsp_received = [], []
        model.register_forward_pre_hook(lambda *_: self.forward_s.append(-time.perf_counter()))
        model.register_forward_hook(lambda *_: self._forward_done())

    def _forward_done(self):
        self.forward_s.append(self.forward_s.pop() + time.perf_counter())
        self.tsp_received.append(sum(op["received"] for op in tsp_comm.counter.snapshot().values()))

    @torch.no_grad()
    def generate(self, input_ids, new_tokens):
        self.forward_s, self.tsp_received = [], []
        return self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=0, return_dict_in_generate=True)

    def held_bytes(self):
        return sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))


def build_single(world, args):
    return GenerateRun(build_model(args))


def build_tp(world, args):
    engine = deepspeed.init_inference(build_model(args), tensor_parallel={"tp_size": world}, dtype=torch.float32,
                                      replace_with_kernel_inject=False)
    return GenerateRun(engine.module)


def build_tsp(world, args):
    config = TSPConfig(enabled=True, size=world, attention_backend="sdpa")
    return GenerateRun(ds_tsp.inject(build_model(args), TSPTopology(world), config))


BUILDERS = {"single": build_single, "tp": build_tp, "tsp": build_tsp}


def cache_bytes(cache):
    """Bytes of the keys and values a cache holds on this rank (a ``TSPCache``: its filled slots)."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def prompts(args, prompt_len, batch):
    generator = torch.Generator().manual_seed(prompt_len * 10 + batch)
    return torch.randint(1, args.vocab, (batch, prompt_len), generator=generator)


def measure(run, cell, args):
    prompt_len, batch = cell
    input_ids = prompts(args, prompt_len, batch)
    dist.barrier()
    with LiveTensorBytes() as live:
        out = run.generate(input_ids, 2)
    kv_bytes = cache_bytes(out.cache)
    del out
    dist.barrier()
    tsp_comm.counter.reset()
    rss_reset = reset_peak_rss()
    dist.barrier()
    start = time.perf_counter()
    out = run.generate(input_ids, args.new_tokens)
    elapsed = time.perf_counter() - start
    prefill_s, decode_steps = run.forward_s[0], len(run.forward_s) - 1
    received = run.tsp_received
    return {"peak_live_bytes": live.peak_bytes, "held_bytes": run.held_bytes(), "kv_cache_bytes": kv_bytes,
            "peak_rss_bytes": peak_rss_bytes(), "rss_high_water_mark_reset": rss_reset,
            "prefill_s": prefill_s, "decode_s": elapsed - prefill_s, "decode_steps": decode_steps,
            "decode_tokens_per_s": batch * decode_steps / (elapsed - prefill_s),
            "tsp_prefill_received": received[0],
            "tsp_decode_step_received": (received[-1] - received[0]) // max(decode_steps, 1),
            "tokens": out.sequences[:, prompt_len:].tolist()}


def summary(per_rank):
    """One row of the table: the worst rank's memory, rank 0's times."""
    return {"peak_live_mib": max(r["peak_live_bytes"] for r in per_rank) / MIB,
            "held_mib": max(r["held_bytes"] for r in per_rank) / MIB,
            "kv_cache_mib": max(r["kv_cache_bytes"] for r in per_rank) / MIB,
            "peak_rss_mib": max(r["peak_rss_bytes"] for r in per_rank) / MIB,
            "prefill_s": per_rank[0]["prefill_s"], "decode_tokens_per_s": per_rank[0]["decode_tokens_per_s"],
            "tsp_decode_step_received_kib": per_rank[0]["tsp_decode_step_received"] / 1024,
            "tokens_agree_across_ranks": all(r["tokens"] == per_rank[0]["tokens"] for r in per_rank)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4], help="ranks D for TP and TSP")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--strategies", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--strategy-timeout", type=float, default=1800, help="seconds for one strategy, all cells")
    parser.add_argument("--collective-timeout", type=float, default=600, help="gloo timeout, so a dead peer fails")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="inference", help="stem of the files written under --out")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: one prefill, then decode steps to time")
    args.prompt_lens = sorted(args.prompt_lens)
    return args


def write_report(results, args, meta):
    """``<name>.json``, ``<name>.md`` and ``<name>.png``; returns the markdown's path."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(p, b) for b in args.batches for p in args.prompt_lens]
    rows = {}
    for (strategy, world), per_cell in results.items():
        for cell, result in per_cell.items():
            rows[(strategy, world, cell)] = result if isinstance(result, str) else summary(result)
    reference = {cell: results[("single", 1)][cell] for cell in cells}
    doc = {"meta": meta, "results": []}
    lines = [f"Command: `{meta['command']}`", "",
             f"Model: Llama-shaped, hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
             f"({args.kv_heads} key/value), intermediate {args.intermediate}, vocabulary {args.vocab}, fp32; "
             f"{args.new_tokens} greedy tokens. torch {meta['torch']}, DeepSpeed {meta['deepspeed']}, "
             f"{meta['cpu_count']} CPU cores shared by all ranks.", "",
             "| strategy | D | prompt | batch | peak MiB / rank | weights MiB | KV cache MiB | peak RSS MiB "
             "| prefill s | decode tok/s | TSP KiB / decode step | tokens = single's |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (strategy, world, cell), row in sorted(rows.items(), key=lambda kv: (kv[0][2][1], kv[0][2][0], kv[0][0],
                                                                              kv[0][1])):
        prompt_len, batch = cell
        entry = {"strategy": strategy, "size": world, "prompt_len": prompt_len, "batch": batch}
        if isinstance(row, str):
            doc["results"].append({**entry, "error": row})
            lines.append(f"| {NAMES[strategy]} | {world} | {prompt_len} | {batch} | {row[:80]} |||||||")
            continue
        ref = reference[cell]
        same = not isinstance(ref, str) and all(r["tokens"] == ref[0]["tokens"] for r in results[(strategy, world)][cell])
        row["tokens_equal_single"] = same
        doc["results"].append({**entry, **row, "per_rank": results[(strategy, world)][cell]})
        step = f"{row['tsp_decode_step_received_kib']:.1f}" if strategy == "tsp" else "-"
        lines.append(f"| {NAMES[strategy]} | {world} | {prompt_len} | {batch} | {row['peak_live_mib']:.1f} "
                     f"| {row['held_mib']:.1f} | {row['kv_cache_mib']:.2f} | {row['peak_rss_mib']:.0f} "
                     f"| {row['prefill_s']:.2f} | {row['decode_tokens_per_s']:.1f} | {step} "
                     f"| {'yes' if same else 'no'} |")
    lines += ["", *targets(rows, args)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(doc, f, indent=1)

    fig, axes = plt.subplots(2, len(args.batches), figsize=(5.5 * len(args.batches), 7), squeeze=False)
    for column, batch in enumerate(args.batches):
        for key in sorted({(s, w) for s, w, _ in rows}):
            points = [(p, rows[(*key, (p, batch))]) for p in args.prompt_lens
                      if not isinstance(rows.get((*key, (p, batch)), ""), str)]
            label = NAMES[key[0]] + ("" if key[0] == "single" else f" ({key[1]})")
            for ax, field in zip(axes[:, column], ("peak_live_mib", "decode_tokens_per_s")):
                ax.plot([p for p, _ in points], [r[field] for _, r in points], marker="o", label=label)
        axes[0, column].set(title=f"batch {batch}: peak memory per rank", ylabel="MiB", xscale="log")
        axes[1, column].set(title=f"batch {batch}: decode", ylabel="tokens / s", xlabel="prompt tokens",
                            xscale="log")
        axes[0, column].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, f"{args.name}.png"), dpi=110)
    path = os.path.join(args.out, f"{args.name}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n\n![per-rank peak memory and decode rate](" + f"{args.name}.png)\n")
    return path


def targets(rows, args):
    """The issue's targets, read off the table, at the longest prompt."""
    longest, lines = args.prompt_lens[-1], []
    for batch in args.batches:
        cell = (longest, batch)
        peaks = {(s, w): r["peak_live_mib"] for (s, w, c), r in rows.items() if c == cell and not isinstance(r, str)}
        tsp = {w: v for (s, w), v in peaks.items() if s == "tsp"}
        if tsp and peaks:
            lowest = min(peaks, key=peaks.get)
            lines.append(f"* Prompt {longest}, batch {batch}: the lowest per-rank peak is "
                         f"{NAMES[lowest[0]]} ({lowest[1]}), {peaks[lowest]:.1f} MiB.")
        for world in sorted(tsp):
            if ("tp", world) in peaks:
                lines.append(f"  TSP ({world}) / TP ({world}) peak: {tsp[world] / peaks[('tp', world)]:.2f}.")
        for world in args.sizes:
            tsp_row, tp_row = rows.get(("tsp", world, cell)), rows.get(("tp", world, cell))
            if isinstance(tsp_row, dict) and isinstance(tp_row, dict):
                lines.append(f"  TSP ({world}) / TP ({world}) decode tokens/s: "
                             f"{tsp_row['decode_tokens_per_s'] / tp_row['decode_tokens_per_s']:.2f}.")
    return lines


def main(argv=None):
    args = parse_args(argv)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("DS_ACCELERATOR", "OMP_NUM_THREADS"))
    command = f"{env} " + " ".join(shlex.quote(a) for a in ["python", os.path.relpath(__file__)] + sys.argv[1:])
    cells = [(p, b) for b in args.batches for p in args.prompt_lens]
    start = time.monotonic()
    results = {}
    runs = [("single", 1)] + [(s, w) for w in args.sizes for s in args.strategies if s != "single"]
    for strategy, world in runs:
        results[(strategy, world)] = run_on_ranks(BUILDERS[strategy], measure, cells, world, args)
        status = {c: "ok" if not isinstance(v, str) else v[:100] for c, v in results[(strategy, world)].items()}
        print(f"[{time.monotonic() - start:.0f} s] {strategy} D={world}: {status}", flush=True)
    meta = {"command": command, "elapsed_s": time.monotonic() - start, "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "cpu_count": os.cpu_count()}
    print(open(write_report(results, args, meta)).read())


if __name__ == "__main__":
    main()
