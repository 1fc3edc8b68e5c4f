"""Two ranks run a TSP forward; rank 1 dies inside it. Rank 0 must fail, not hang.

Usage: python rank_that_dies.py RANK RENDEZVOUS_FILE
"""

import os
import sys

import torch
import torch.distributed as dist

import ds_tsp
from ds_tsp.config import TSPConfig
from ds_tsp.parallel.topology import TSPTopology
from models import tiny_model

TIMEOUT_MINUTES = 0.25


def main():
    rank, rendezvous = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    topology = TSPTopology(2, timeout_minutes=TIMEOUT_MINUTES)
    model = ds_tsp.inject(tiny_model("llama"), topology, TSPConfig(enabled=True, size=2))
    if rank == 1:
        model.model.layers[1].mlp.register_forward_pre_hook(lambda *_: os._exit(3))
    ids = torch.zeros(1, 16, dtype=torch.long)
    model(input_ids=ids, labels=ids).loss.backward()
    print("rank", rank, "finished a step its peer never finished", flush=True)


if __name__ == "__main__":
    main()
