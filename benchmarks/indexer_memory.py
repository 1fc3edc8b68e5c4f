"""What the lightning indexer's scoring holds on one TSP rank (DeepSeek's sparse attention, DESIGN.md 6o):
its live tensor bytes while rank 0 of ``D`` chooses its queries' keys over the whole sequence, at two lengths.

    python benchmarks/indexer_memory.py                          # 16K and 32K tokens, D = 4, DeepSeek-V3.2's indexer
    python benchmarks/indexer_memory.py --lengths 2048 4096 --heads 8 --head-dim 32 --topk 256

Rank 0's queries (its zigzag share of ``S``) score against every key in
float32 tiles with a running top-k (``ds_tsp.blocks.latent.indexer.choose_keys``);
their inputs (index queries, head weights, the gathered index keys) and its
output (``topk`` int32 keys a query) grow with the sequence, the scratch
beyond them must not. Hugging Face's forward holds a ``(S, heads, S)`` float32
score tensor for the same choice. Writes ``<out>.json`` and ``<out>.md``.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import LiveTensorBytes  # noqa: E402

from ds_tsp.blocks.latent import indexer  # noqa: E402
from ds_tsp.blocks.latent.indexer import IndexerPlan, choose_keys, key_bounds  # noqa: E402


def measure_one(seq_len, args):
    """Live bytes of rank 0's scoring at ``seq_len`` tokens."""
    D, local = args.tsp_size, seq_len // args.tsp_size
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, local, args.heads, args.head_dim, generator=generator)
    weights = torch.randn(1, local, args.heads, generator=generator)
    keys = torch.randn(1, seq_len, args.head_dim, generator=generator).to(torch.bfloat16)
    first, last, ends = key_bounds(None, 1, local, 0, D, "zigzag", q.device)
    plan = IndexerPlan(topk=args.topk, heads=args.heads, head_dim=args.head_dim, rope_dim=0, rope_first=True,
                       rope=None, parts=None, scale_on_scores=True, first_key=first, last_key=last, tile_ends=ends)
    inputs = sum(t.numel() * t.element_size() for t in (q, weights, keys, first, last))
    start = time.perf_counter()
    with LiveTensorBytes() as live:
        chosen = choose_keys(plan, q, weights, keys)
        at_rest = live.state_bytes
    seconds = time.perf_counter() - start
    output = chosen.numel() * chosen.element_size()
    peak = live.peak_bytes - at_rest
    return {"seq_len": seq_len, "local_queries": local, "inputs_bytes": inputs, "output_bytes": output,
            "peak_above_inputs_bytes": peak, "scratch_bytes": peak - output,
            "hf_scores_bytes": seq_len * args.heads * seq_len * 4, "seconds": round(seconds, 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs=2, default=[16384, 32768])
    parser.add_argument("--tsp-size", type=int, default=4)
    parser.add_argument("--heads", type=int, default=64, help="index_n_heads (DeepSeek-V3.2's)")
    parser.add_argument("--head-dim", type=int, default=128, help="index_head_dim (DeepSeek-V3.2's)")
    parser.add_argument("--topk", type=int, default=2048, help="index_topk (DeepSeek-V3.2's)")
    parser.add_argument("--out", default="benchmarks/results/indexer_memory_cpu")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rows = [measure_one(seq_len, args) for seq_len in args.lengths]
    result = {"tsp_size": args.tsp_size, "heads": args.heads, "head_dim": args.head_dim, "topk": args.topk,
              "query_tile": indexer.QUERY_TILE, "key_tile": indexer.KEY_TILE, "results": rows}
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    mb = 2 ** 20
    lines = [f"# The lightning indexer's scoring on TSP rank 0 of {args.tsp_size} (CPU, float32 scores)\n",
             f"{args.heads} index heads of {args.head_dim}, top {args.topk} keys a query, tiles of "
             f"{indexer.QUERY_TILE} queries x {indexer.KEY_TILE} keys. Live tensor bytes while the rank chooses its "
             "queries' keys: inputs (index queries, head weights, gathered keys) and output (int32 keys a query) "
             "grow with the sequence; the scratch is the peak beyond them.\n",
             "| tokens | local queries | inputs (MiB) | output (MiB) | scratch (MiB) | HF's (S, heads, S) scores "
             "(MiB) | seconds |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['seq_len']} | {r['local_queries']} | {r['inputs_bytes'] / mb:.1f} | {r['output_bytes'] / mb:.1f} "
              f"| {r['scratch_bytes'] / mb:.1f} | {r['hf_scores_bytes'] / mb:.0f} | {r['seconds']} |" for r in rows]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
