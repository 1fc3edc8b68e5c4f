"""Gated DeltaNet's recurrence over TSP ranks (ds_tsp.blocks.linear.recurrence) against one process, float64."""

import pytest
import torch
import torch.distributed as dist

from ds_tsp.blocks.linear.recurrence import gated_delta_recurrence
from ds_tsp.parallel import comm, layout
from ds_tsp.parallel.topology import TSPTopology
from test_chunk_maps import inputs, recurrence


def _sharded_run(seq_len, layout_name="zigzag"):
    topo = TSPTopology(dist.get_world_size() if dist.is_initialized() else 1)
    D, r = topo.tsp_size, topo.tsp_rank
    full = [t.requires_grad_() for t in inputs(L=seq_len)]
    grad_out = torch.randn(2, 3, seq_len, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    out, _ = recurrence(*full, torch.zeros(2, 3, 8, 6, dtype=torch.float64))
    expected = torch.autograd.grad((out * grad_out).sum(), full)
    local = [layout.shard(t.detach(), r, D, layout_name, dim=2).requires_grad_() for t in full]
    comm.counter.reset()
    mine = gated_delta_recurrence(*local, topo.tsp_group, layout_name, chunk_size=16)
    forward_bytes = comm.counter.received()
    grads = torch.autograd.grad((mine * layout.shard(grad_out, r, D, layout_name, dim=2)).sum(), local)
    diffs = {"out": (mine - layout.shard(out.detach(), r, D, layout_name, dim=2)).abs().max().item()}
    for name, got, want in zip("q k v g beta".split(), grads, expected):
        diffs[name] = (got - layout.shard(want, r, D, layout_name, dim=2)).abs().max().item()
    return diffs, forward_bytes


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_the_sharded_recurrence_equals_one_process(run_ranks, tsp_size):
    for seq_len in (40, 120):  # chunks of 5 and 15 tokens at D=4: not multiples of the 16-token GDN chunk
        for layout_name in ("zigzag", "contiguous"):
            per_rank = run_ranks(tsp_size, _sharded_run, seq_len=seq_len, layout_name=layout_name)
            worst = max(max(d.values()) for d, _ in per_rank)
            print(f"D={tsp_size} S={seq_len} {layout_name}: max|diff| {worst:.2e}, forward bytes a rank "
                  f"{per_rank[0][1]}")
            assert worst < 1e-11
            # The maps' all-gather: 2 chunks x B x h x dk (dk + dv) per rank, whatever S.
            assert all(b == (tsp_size - 1) * 2 * 2 * 3 * 8 * (8 + 6) * 8 for _, b in per_rank)
