"""Cost of ``tsp.check_batch: "always"`` (the default): the per-micro-batch check
that every rank of a TSP group got the same batch, against a training step.

    python benchmarks/batch_check.py --out benchmarks/results

On ``--tsp`` forked CPU ranks (gloo), the byte-level Llama of
``examples/train.py`` (4 layers, 128 wide: a small step, so the check's share
is the largest it gets) trains on rows of ``--seq-lens`` tokens with labels
and an attention mask. Per length, timed in turns so both see the same
machine: the check alone (fingerprint of the host copy, one all-gather of 16
int64, the comparison) and a whole forward + backward with the check on and
off. Writes ``batch_check_cpu.json`` and a markdown table; the target is a
check under 1% of a step at 2048 tokens.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import ds_tsp  # noqa: E402
from ds_tsp.config import TSPConfig  # noqa: E402
from ds_tsp.parallel.host_reads import host_copy  # noqa: E402
from ds_tsp.parallel.topology import TSPTopology  # noqa: E402
from ranks import run_on_ranks  # noqa: E402
from train import small_byte_llama  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tsp", type=int, default=2, help="TSP size (CPU ranks)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--strategy-timeout", type=float, default=900)
    parser.add_argument("--collective-timeout", type=float, default=300)
    parser.add_argument("--out", default="benchmarks/results")
    return parser.parse_args(argv)


def build(world, args):
    torch.manual_seed(0)
    return ds_tsp.inject(small_byte_llama(), TSPTopology(world),
                         TSPConfig(enabled=True, size=world, attention_backend="sdpa"))


def _batch(args, seq_len):
    ids = torch.randint(0, 256, (args.batch, seq_len), generator=torch.Generator().manual_seed(seq_len))
    mask = torch.ones_like(ids)
    mask[:, -seq_len // 8:] = 0  # right padding
    return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}


def _median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model, seq_len, args):
    """Median seconds of the check alone and of a step with the check on and off."""
    batch = _batch(args, seq_len)
    check = model.tsp_batch_check

    def the_check():
        check.when = "always"
        ids, labels, mask = host_copy(batch["input_ids"], batch["labels"], batch["attention_mask"], reason="batch")
        check(input_ids=ids, labels=labels, position_ids=None, attention_mask=mask)

    def step(when):
        check.when = when
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()

    for when in ("always", "never"):  # warm-up
        step(when)
    on, off, alone = [], [], []
    for _ in range(args.repeats):  # in turns: a shared CPU's speed drifts more than the check costs
        on.append(_median_seconds(lambda: step("always"), 1))
        off.append(_median_seconds(lambda: step("never"), 1))
        alone.append(_median_seconds(the_check, 5))
    return {"check_s": statistics.median(alone), "step_on_s": statistics.median(on),
            "step_off_s": statistics.median(off)}


def main(argv=None):
    args = parse_args(argv)
    results = run_on_ranks(build, measure, args.seq_lens, args.tsp, args)
    rows = {}
    for seq_len, per_rank in results.items():
        if isinstance(per_rank, str):
            raise SystemExit(f"S={seq_len}: {per_rank}")
        # The slowest rank's: a step waits for it.
        row = {key: max(rank[key] for rank in per_rank) for key in per_rank[0]}
        row["check_share_of_step"] = row["check_s"] / row["step_off_s"]
        rows[seq_len] = row
    doc = {"tsp": args.tsp, "batch": args.batch, "model": "examples/train.py small_byte_llama", "device": "cpu",
           "torch": torch.__version__, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "batch_check_cpu.json"), "w") as f:
        json.dump(doc, f, indent=1)
    lines = [f"# tsp.check_batch \"always\": cost per micro-batch, TSP {args.tsp} on CPU ranks, batch {args.batch}",
             "", "| tokens | check (ms) | step, check on (ms) | step, check off (ms) | check / step |",
             "|---|---|---|---|---|"]
    for seq_len, row in rows.items():
        lines.append(f"| {seq_len} | {1e3 * row['check_s']:.3f} | {1e3 * row['step_on_s']:.1f} | "
                     f"{1e3 * row['step_off_s']:.1f} | {100 * row['check_share_of_step']:.3f}% |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "batch_check_cpu.md"), "w") as f:
        f.write(table)
    print(table)
    return doc


if __name__ == "__main__":
    main()
