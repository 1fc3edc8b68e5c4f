"""DPO at long context on CPU gloo ranks: the per-rank peak memory of one DPO step, TSP against ZeRO-3.

    python benchmarks/dpo_memory.py --pair-tokens 2048 8192 16384

One DPO step as TRL's ``DPOTrainer`` takes it: a pair (a chosen and a
rejected sequence of ``pair_tokens / 2`` tokens each, one batch of 2 rows)
through the policy with TRL's fused LM head (the per-token log-probabilities
of the labels, never the full logits), the same through the frozen reference
model without gradients, the sigmoid loss of the four sums, backward and an
AdamW step. Strategies, on 2 ranks:

* ``tsp``: ``ds_tsp.initialize`` with TSP 2 (ZeRO-0: the one data-parallel
  replica leaves ZeRO nothing to partition), the reference model
  injected over the same group (``ds_tsp.TSPDPOTrainer``'s layout): both hold
  1/2 of every weight, every activation holds 1/2 of the tokens, the fused
  head's fields come from the folded head's ring;
* ``zero3``: DeepSpeed ZeRO-3 over 2 data-parallel ranks, as TRL runs DPO
  with a ZeRO-3 config: the policy's engine, the reference model in a ZeRO-3
  engine of its own (TRL's ``prepare_deepspeed``), TRL's own fused head
  (float32 tiles of the vocabulary; on CPU its torch path, which holds
  several ``(tokens, 32768)`` tiles at once); each rank takes its own pair;
* ``zero3_tiled``: the same ZeRO-3 layout with ds_tsp's head at TSP size 1
  (tiles of ``tsp.logits_tile_mib``, the ring of one): the head's algorithm is
  TSP's, so the difference to ``tsp`` is the sharding alone.

Ulysses + ZeRO-3 is not run: TRL's DPO has no sequence-parallel path to
measure (its ``cp_size``/``sp_size`` options refuse DPO).

Measured as ``compare.py`` measures (``measure.LiveTensorBytes``): the most
bytes of live tensor storage at once in the last warm-up step, and the
kernel's RSS high-water mark. Writes ``<out>/<name>.json`` and
``<out>/<name>.md``.
"""

import argparse
import copy
import json
import os
import shlex
import sys

import compare  # noqa: F401  (installs the collective-counting shim before DeepSpeed and ds_tsp load)
import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from compare import adamw, build_model, ds_config, zero3_buckets
from compare_model import add_model_arguments
from measure import LiveTensorBytes, peak_rss_bytes, reset_peak_rss
from ranks import run_on_ranks

import ds_tsp

BETA = 0.1
STRATEGIES = ("tsp", "zero3", "zero3_tiled")


class DPOStep:
    """One DPO step of ``policy`` (a DeepSpeed engine) against ``reference`` on a pair."""

    def __init__(self, policy, reference):
        self.policy, self.reference = policy, reference

    def step(self, pair):
        labels = pair.clone()
        logps = self.policy(input_ids=pair, labels=labels, fused_lm_head=True).log_probs.sum(-1)
        with torch.no_grad():
            ref_logps = self.reference(input_ids=pair, labels=labels, fused_lm_head=True).log_probs.sum(-1)
        margin = (logps[0] - ref_logps[0]) - (logps[1] - ref_logps[1])
        loss = -F.logsigmoid(BETA * margin)
        self.policy.backward(loss)
        self.policy.step()
        return loss.item()


def run_tsp(world, args, tsp_size=None, zero_stage=0):
    tsp = {"enabled": True, "size": tsp_size or world, "attention_backend": "sdpa"}
    config = ds_config(args, zero_stage=zero_stage, tsp=tsp)  # TSP over the world: ZeRO has nothing to partition
    if zero_stage == 3:
        config["zero_optimization"].update(zero3_buckets(args))
    policy, *_ = ds_tsp.initialize(model=build_model(args), optimizer=adamw, config=config)
    reference = ds_tsp.inject(build_model(args), policy.tsp_topology, policy.module.tsp_config).requires_grad_(False)
    for model in (policy.module, reference):
        ds_tsp.add_fused_lm_head(model)
    return DPOStep(policy, reference.eval())


def run_zero3_tiled(world, args):
    return run_tsp(world, args, tsp_size=1, zero_stage=3)


def run_zero3(world, args):
    from trl.trainer.utils import add_fused_lm_head

    config = ds_config(args, zero_stage=3)
    config["zero_optimization"].update(zero3_buckets(args))
    policy_model, reference_model = build_model(args), build_model(args)
    for model in (policy_model, reference_model):
        add_fused_lm_head(model)
    policy, *_ = deepspeed.initialize(model=policy_model, optimizer=adamw, config=config)
    # TRL's prepare_deepspeed: the reference in a ZeRO-3 engine of its own, no optimizer.
    reference_config = {**config, "zero_optimization": dict(config["zero_optimization"])}
    reference, *_ = deepspeed.initialize(model=reference_model.requires_grad_(False), config=reference_config)
    reference.eval()
    return DPOStep(policy, reference)


def pair_ids(args, pair_tokens):
    """A chosen and a rejected sequence of ``pair_tokens / 2`` tokens; each data-parallel rank of ZeRO-3 its own."""
    data_parallel = args.strategy != "tsp"
    generator = torch.Generator().manual_seed(pair_tokens + (dist.get_rank() if data_parallel else 0))
    return torch.randint(0, args.vocab, (2, pair_tokens // 2), generator=generator)


def measure(run, pair_tokens, args):
    pair = pair_ids(args, pair_tokens)
    losses = [run.step(pair) for _ in range(args.warmup - 1)]
    dist.barrier()
    reset_peak_rss()
    with LiveTensorBytes() as live:
        losses.append(run.step(pair))
    dist.barrier()
    return {"peak_live_bytes": live.peak_bytes, "state_bytes": live.state_bytes, "peak_rss_bytes": peak_rss_bytes(),
            "losses": losses}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair-tokens", type=int, nargs="+", default=[2048, 8192, 16384],
                        help="tokens of a pair: a chosen and a rejected sequence of half as many each")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--warmup", type=int, default=2, help="steps; the last is the measured one")
    add_model_arguments(parser)
    parser.add_argument("--strategy-timeout", type=float, default=1800, help="seconds for one strategy, all lengths")
    parser.add_argument("--collective-timeout", type=float, default=600, help="gloo timeout, so a dead peer fails")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="dpo_memory")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the last step is the measured one")
    for pair_tokens in args.pair_tokens:
        if pair_tokens % 8:
            parser.error(f"--pair-tokens {pair_tokens} is not a multiple of 8 (two sequences, each of 2*D tokens)")
    # compare.build_model's fields: a Llama, batch 1 (a pair's two rows are its micro-batch)
    args.model, args.batch, args.seq_lens = "dense", 1, [t // 2 for t in args.pair_tokens]
    return args


def table(results, args):
    baselines = [name for name in ("zero3", "zero3_tiled") if name in args.strategies and "tsp" in args.strategies]
    lines = ["| tokens a pair | " + " | ".join(f"{s}: peak live / RSS (MiB)" for s in args.strategies)
             + "".join(f" | TSP / {name}" for name in baselines) + " |",
             "|---" * (1 + len(args.strategies) + len(baselines)) + "|"]
    for pair_tokens in args.pair_tokens:
        cells, peaks = [], {}
        for strategy in args.strategies:
            per_rank = results[strategy][pair_tokens]
            if isinstance(per_rank, str):
                cells.append(per_rank[:80])
                continue
            peaks[strategy] = max(r["peak_live_bytes"] for r in per_rank)
            rss = max(r["peak_rss_bytes"] for r in per_rank)
            cells.append(f"{peaks[strategy] / 2**20:.0f} / {rss / 2**20:.0f}")
        ratios = [f"{peaks['tsp'] / peaks[name]:.2f}x" if {"tsp", name} <= peaks.keys() else "-" for name in baselines]
        lines.append(f"| {pair_tokens} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in ["python", os.path.relpath(__file__)] + sys.argv[1:])
    builders = {"tsp": run_tsp, "zero3": run_zero3, "zero3_tiled": run_zero3_tiled}
    results = {}
    for strategy in args.strategies:
        strategy_args = copy.copy(args)
        strategy_args.strategy = strategy
        results[strategy] = run_on_ranks(builders[strategy], measure, args.pair_tokens, 2, strategy_args)
        print(f"{strategy}: " + ", ".join(f"{t}: {'ok' if not isinstance(v, str) else v[:200]}"
                                          for t, v in results[strategy].items()), flush=True)
    meta = {"command": command, "model": {"arch": "LlamaForCausalLM", "hidden": args.hidden, "layers": args.layers,
                                          "heads": args.heads, "kv_heads": args.kv_heads,
                                          "intermediate": args.intermediate, "vocab": args.vocab, "dtype": "float32"},
            "ranks": 2, "beta": BETA, "warmup": args.warmup, "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "transformers": transformers.__version__}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({"meta": meta, "results": {s: {str(t): v for t, v in r.items()} for s, r in results.items()}}, f,
                  indent=1)
    text = (f"# DPO: per-rank peak memory of one step, 2 CPU ranks\n\n`{command}`\n\n{table(results, args)}\n\n"
            "Peak live: the most bytes of tensor storage alive at once in the measured step (the larger rank's). "
            "ZeRO-3 takes a pair a rank (2 data-parallel replicas); TSP one pair over both ranks.\n")
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
