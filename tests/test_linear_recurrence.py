"""The chunk-map recurrence over TSP ranks (ds_tsp.blocks.linear.recurrence) against one process, float64:
Gated DeltaNet's rule (and KDA's), Mamba-2's and Mamba-1's."""

import pytest
import torch
import torch.distributed as dist

from ds_tsp.blocks.linear.delta_rule import GATED_DELTA
from ds_tsp.blocks.linear.selective_scan import SELECTIVE
from ds_tsp.blocks.linear.ssd import SSD
from ds_tsp.blocks.linear.recurrence import chunk_recurrence
from ds_tsp.parallel import comm, layout
from ds_tsp.parallel.topology import TSPTopology
import test_chunk_maps
import test_selective_scan
import test_ssd

RULES = {"gated_delta": (GATED_DELTA, test_chunk_maps), "ssd": (SSD, test_ssd), "kda": (GATED_DELTA, test_chunk_maps.KDA),
         "selective": (SELECTIVE, test_selective_scan)}


def _sharded_run(seq_len, layout_name="zigzag", rule="gated_delta"):
    topo = TSPTopology(dist.get_world_size() if dist.is_initialized() else 1)
    D, r = topo.tsp_size, topo.tsp_rank
    rule, reference = RULES[rule]
    full = [t.requires_grad_() for t in reference.inputs(L=seq_len)]
    state = reference.zero_state() if hasattr(reference, "zero_state") else torch.zeros(2, 3, 8, 6,
                                                                                            dtype=torch.float64)
    out, _ = reference.recurrence(*full, state)
    grad_out = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    expected = torch.autograd.grad((out * grad_out).sum(), full)
    local = [layout.shard(t.detach(), r, D, layout_name, dim=2).requires_grad_() for t in full]
    comm.counter.reset()
    mine = chunk_recurrence(rule, local, topo.tsp_group, layout_name, chunk_size=16)
    forward_bytes = comm.counter.received()
    grads = torch.autograd.grad((mine * layout.shard(grad_out, r, D, layout_name, dim=2)).sum(), local)
    diffs = {"out": (mine - layout.shard(out.detach(), r, D, layout_name, dim=2)).abs().max().item()}
    for name, got, want in zip(range(len(grads)), grads, expected):
        diffs[name] = (got - layout.shard(want, r, D, layout_name, dim=2)).abs().max().item()
    return diffs, forward_bytes


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_the_sharded_recurrence_equals_one_process(run_ranks, tsp_size, rule):
    # The maps' all-gather, per rank, whatever S: 2 chunks x B x h x (|T| + |U|), |T| = dk dk for Gated
    # DeltaNet's and KDA's dense T, 1 for Mamba-2's scalar a head, |U| = dk dv; Mamba-1's n and n a channel.
    per_head = {"gated_delta": 8 * 8 + 8 * 6, "kda": 8 * 8 + 8 * 6, "ssd": 1 + 8 * 6, "selective": 8 + 8}[rule]
    for seq_len in (40, 120):  # chunks of 5 and 15 tokens at D=4: not multiples of the 16-token chunk
        for layout_name in ("zigzag", "contiguous"):
            per_rank = run_ranks(tsp_size, _sharded_run, seq_len=seq_len, layout_name=layout_name, rule=rule)
            worst = max(max(d.values()) for d, _ in per_rank)
            print(f"{rule} D={tsp_size} S={seq_len} {layout_name}: max|diff| {worst:.2e}, forward bytes a rank "
                  f"{per_rank[0][1]}")
            assert worst < 1e-11
            assert all(b == (tsp_size - 1) * 2 * 2 * 3 * per_head * 8 for _, b in per_rank)
