"""Two ranks save a TSP model over an existing checkpoint; one dies part way.

Usage: python rank_dies_while_saving.py RANK RENDEZVOUS_FILE TARGET DYING_RANK

The dying rank exits inside ``save_pretrained``: rank 0 (the writer) after its
second weights file, rank 1 while its blocks are being gathered.
"""

import os
import sys

import torch
import torch.distributed as dist

import ds_tsp
from ds_tsp.checkpoint import writing
from ds_tsp.config import TSPConfig
from ds_tsp.parallel.topology import TSPTopology
from models import tiny_model

TIMEOUT_MINUTES = 0.1


def main():
    rank, rendezvous, target, dying = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    topology = TSPTopology(2, timeout_minutes=TIMEOUT_MINUTES)
    model = ds_tsp.inject(tiny_model("llama", seed=1, dtype=torch.float32), topology, TSPConfig(enabled=True, size=2))
    if rank == dying == 0:
        written, save_file = [], writing.save_file

        def save_then_die(*args, **kwargs):
            save_file(*args, **kwargs)
            written.append(args[1])
            if len(written) == 2:
                os._exit(3)

        writing.save_file = save_then_die
    elif rank == dying == 1:
        gather_block, calls = writing.gather_block, []

        def die_on_the_third_block(block):
            calls.append(block)
            if len(calls) == 3:
                os._exit(3)
            return gather_block(block)

        writing.gather_block = die_on_the_third_block
    ds_tsp.save_pretrained(model, target, max_shard_size="4KB", overwrite=True)
    print("rank", rank, "finished a save its peer never finished", flush=True)


if __name__ == "__main__":
    main()
