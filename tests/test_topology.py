import pytest
import torch.distributed as dist

from ds_tsp.parallel import comm
from ds_tsp.config import TSPConfig, TSPConfigError
from ds_tsp.parallel.topology import MeshShape, TSPTopology


def test_mesh_puts_tsp_innermost():
    mesh = MeshShape.for_world(8, tsp_size=2, pipeline_stages=2)
    assert (mesh.pp, mesh.dp, mesh.tsp) == (2, 2, 2)
    assert mesh.tsp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all(mesh.rank(*mesh.coords(r)) == r for r in range(8))


@pytest.mark.parametrize("world, tsp, pp", [(4, 3, 1), (6, 4, 1), (4, 2, 3), (8, 16, 1)])
def test_sizes_that_do_not_divide_the_world_are_refused(world, tsp, pp):
    with pytest.raises(TSPConfigError, match=r"does not divide the world size .* choose tsp\.(size|pipeline_stages)"):
        MeshShape.for_world(world, tsp, pp)


def test_nonpositive_size_is_refused():
    with pytest.raises(TSPConfigError, match="tsp.size = 0 is invalid"):
        MeshShape.for_world(4, 0)


def _groups_on_four_ranks(tsp_size, pipeline_stages):
    topo = TSPTopology(tsp_size, pipeline_stages)
    # Every group must really connect its members: sum global ranks over it.
    sums = {}
    for name, group in (("tsp", topo.tsp_group), ("dp", topo.dp_group), ("pp", topo.pp_group)):
        t = comm.torch.tensor([float(topo.rank)])
        comm.all_reduce(t, group)
        sums[name] = t.item()
    ring = comm.RingExchange(topo.tsp_group)
    received = ring.send_recv(comm.torch.tensor([float(topo.rank)]))
    ring.wait()
    mpu = topo.mpu()
    return dict(
        rank=dist.get_rank(), tsp=topo.tsp_ranks, dp=topo.dp_ranks, pp=topo.pp_ranks, sums=sums,
        ring_next=topo.ring_next, ring_prev=topo.ring_prev, ring_exchange_next=ring.next_rank,
        received_from_prev=received.item(),
        mpu=(mpu.get_model_parallel_world_size(), mpu.get_data_parallel_world_size(),
             mpu.get_data_parallel_rank(), mpu.get_sequence_parallel_world_size()),
    )


def test_groups_for_tsp2_dp2(run_ranks):
    expected_tsp = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    expected_dp = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    for out in run_ranks(4, _groups_on_four_ranks, tsp_size=2, pipeline_stages=1):
        r = out["rank"]
        assert out["tsp"] == expected_tsp[r] and out["dp"] == expected_dp[r] and out["pp"] == [r]
        assert out["sums"] == {"tsp": sum(expected_tsp[r]), "dp": sum(expected_dp[r]), "pp": r}
        partner = expected_tsp[r][1 - expected_tsp[r].index(r)]
        assert out["ring_next"] == out["ring_prev"] == out["ring_exchange_next"] == partner
        assert out["received_from_prev"] == partner
        assert out["mpu"] == (2, 2, r // 2, 1)


def test_groups_for_pp2_tsp2(run_ranks):
    expected_tsp = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    expected_pp = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    for out in run_ranks(4, _groups_on_four_ranks, tsp_size=2, pipeline_stages=2):
        r = out["rank"]
        assert out["tsp"] == expected_tsp[r] and out["pp"] == expected_pp[r] and out["dp"] == [r]
        assert out["mpu"][:2] == (2, 1)


def _ring_on_four(tsp_size):
    topo = TSPTopology(tsp_size)
    ring = comm.RingExchange(topo.tsp_group)
    got = ring.send_recv(comm.torch.tensor([float(topo.rank)]))
    ring.wait()
    return topo.ring_next, topo.ring_prev, got.item()


def test_ring_of_four_uses_global_neighbours(run_ranks):
    results = run_ranks(4, _ring_on_four, tsp_size=4)
    assert results == [(1, 3, 3.0), (2, 0, 0.0), (3, 1, 1.0), (0, 2, 2.0)]


def test_experts_fold_over_consecutive_ranks_of_a_stage():
    """tsp.expert_parallel_size folds the TSP group and its neighbouring replicas (DESIGN.md 6k): at TSP 2 x DP 4,
    size 4 gives expert groups of two TSP groups each and expert-data-parallel groups across them; per stage."""
    mesh = MeshShape.for_world(8, tsp_size=2, expert_parallel_size=4)
    assert mesh.ep_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.edp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    staged = MeshShape.for_world(8, tsp_size=2, pipeline_stages=2, expert_parallel_size=4)
    assert staged.ep_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]] and staged.edp_groups() == [[0], [1], [2], [3], [4],
                                                                                           [5], [6], [7]]
    default = MeshShape.for_world(8, tsp_size=2)  # the TSP group alone: its replicas are the data-parallel groups
    assert default.ep_groups() == default.tsp_groups() and default.edp_groups() == default.dp_groups()


@pytest.mark.parametrize("ep", [3, 6, 16])
def test_expert_parallel_sizes_that_do_not_fold_are_refused(ep):
    with pytest.raises(TSPConfigError, match=rf"tsp.expert_parallel_size = {ep} must be a multiple of tsp.size "
                                             r"\(2\) dividing .* choose one of 2, 4, 8"):
        MeshShape.for_world(8, tsp_size=2, expert_parallel_size=ep)


def test_expert_parallel_sizes_the_model_cannot_take_are_refused():
    config = TSPConfig(size=2, expert_parallel_size=4)
    with pytest.raises(TSPConfigError, match="does not divide the model's 6 experts"):
        config.check_experts(6)
    with pytest.raises(TSPConfigError, match="no mixture-of-experts layer: remove tsp.expert_parallel_size"):
        config.check_experts(None)
    config.check_experts(8)
    TSPConfig(size=2).check_experts(None)


def _expert_groups(expert_parallel_size):
    topo = TSPTopology(2, expert_parallel_size=expert_parallel_size)
    sums = {}
    for name, group in (("ep", topo.ep_group), ("edp", topo.edp_group)):
        t = comm.torch.tensor([float(topo.rank)])
        comm.all_reduce(t, group)
        sums[name] = t.item()
    return dict(rank=topo.rank, ep=topo.ep_ranks, edp=topo.edp_ranks, ep_rank=topo.ep_rank, sums=sums)


def test_expert_groups_connect_their_ranks(run_ranks):
    for out in run_ranks(4, _expert_groups, expert_parallel_size=4):
        assert out["ep"] == [0, 1, 2, 3] and out["edp"] == [out["rank"]] and out["ep_rank"] == out["rank"]
        assert out["sums"] == {"ep": 6, "edp": out["rank"]}
    for out in run_ranks(4, _expert_groups, expert_parallel_size=None):
        r = out["rank"]
        assert out["ep"] == [r - r % 2, r - r % 2 + 1] and out["edp"] == [r % 2, r % 2 + 2]
