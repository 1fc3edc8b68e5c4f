"""Each counted collective: right values, and bytes equal to the analytic count."""

import pytest
import torch

from ds_tsp.parallel import comm, precision
from ds_tsp.parallel.topology import TSPTopology

SHAPE = (3, 5)


def _value(rank, dtype, shape=SHAPE):
    # Small integers are exact in bfloat16, so sums can be compared exactly.
    return (torch.arange(int(torch.tensor(shape).prod())).reshape(shape) % 7 + rank).to(dtype)


def _collectives(world_size, tsp_size, dtype):
    dtype = getattr(torch, dtype)
    topo = TSPTopology(tsp_size)
    group, r, D = topo.tsp_group, topo.tsp_rank, topo.tsp_size
    nbytes = _value(0, dtype).numel() * _value(0, dtype).element_size()
    checks = {}

    comm.counter.reset()
    x = _value(r, dtype)
    comm.broadcast(x, src=D - 1, group=group)
    checks["broadcast"] = torch.equal(x, _value(D - 1, dtype))
    expected = ((D - 1) * nbytes, 0) if r == D - 1 else (0, nbytes)
    checks["broadcast_bytes"] = (comm.counter.sent(), comm.counter.received()) == expected

    comm.counter.reset()
    y = _value(r, dtype)
    work = comm.broadcast(y, src=0, group=group, async_op=True)
    work.wait()
    checks["broadcast_async"] = torch.equal(y, _value(0, dtype))

    comm.counter.reset()
    gathered, _ = comm.all_gather(_value(r, dtype), group)
    checks["all_gather"] = torch.equal(gathered, torch.stack([_value(i, dtype) for i in range(D)]))
    checks["all_gather_bytes"] = comm.counter.received() == comm.counter.sent() == (D - 1) * nbytes

    comm.counter.reset()
    stacked = torch.stack([_value(r + i, dtype) for i in range(D)])
    out, work = comm.reduce_scatter(stacked, group, async_op=True)
    work.wait()
    checks["reduce_scatter"] = torch.equal(out, sum(_value(i + r, dtype) for i in range(D)))
    checks["reduce_scatter_bytes"] = comm.counter.received() == comm.counter.sent() == (D - 1) * nbytes

    comm.counter.reset()
    y = _value(r, dtype)
    comm.reduce(y, dst=1 % D, group=group)
    if r == 1 % D:
        checks["reduce"] = torch.equal(y, sum(_value(i, dtype) for i in range(D)))
        checks["reduce_bytes"] = (comm.counter.sent(), comm.counter.received()) == (0, (D - 1) * nbytes)
    else:
        checks["reduce_bytes"] = (comm.counter.sent(), comm.counter.received()) == (nbytes, 0)

    comm.counter.reset()
    z = _value(r, dtype)
    comm.all_reduce(z, group)
    checks["all_reduce"] = torch.equal(z, sum(_value(i, dtype) for i in range(D)))
    checks["all_reduce_bytes"] = comm.counter.received() == 2 * (D - 1) * nbytes // D

    comm.counter.reset()
    sent = torch.stack([_value(10 * r + j, dtype) for j in range(D)])  # row j goes to rank j
    received, _ = comm.all_to_all(sent, group)
    checks["all_to_all"] = torch.equal(received, torch.stack([_value(10 * j + r, dtype) for j in range(D)]))
    checks["all_to_all_bytes"] = comm.counter.received() == comm.counter.sent() == (D - 1) * nbytes

    comm.counter.reset()
    ring = comm.RingExchange(group)
    recv = ring.send_recv(_value(r, dtype))
    ring.wait()
    checks["ring"] = torch.equal(recv, _value((r - 1) % D, dtype))
    checks["ring_bytes"] = comm.counter.received() == comm.counter.sent() == nbytes
    checks["counted_ops"] = sorted(comm.counter.snapshot()) == ["ring"]
    return checks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("world_size, tsp_size", [(2, 2), (4, 4), (4, 2)])
def test_collectives_values_and_bytes(run_ranks, world_size, tsp_size, dtype):
    for rank, checks in enumerate(run_ranks(world_size, _collectives, world_size=world_size, tsp_size=tsp_size,
                                            dtype=dtype)):
        failed = [name for name, ok in checks.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


def _seen_by_a_later_wrapper():
    """Which of torch.distributed's gather / reduce-scatter functions a wrapper
    installed after ds_tsp.parallel.comm was imported (as a profiler or compare.py's
    byte count installs one) sees ds_tsp call."""
    import torch.distributed as dist

    seen = []
    names = [n for n in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                         "reduce_scatter_tensor") if hasattr(dist, n)]
    originals = {name: getattr(dist, name) for name in names}

    def wrapped(name):
        def call(*args, **kwargs):
            seen.append(name)
            return originals[name](*args, **kwargs)
        return call

    for name in names:
        setattr(dist, name, wrapped(name))
    try:
        group = TSPTopology(dist.get_world_size()).tsp_group
        gathered, _ = comm.all_gather(torch.ones(3), group)
        summed, _ = comm.reduce_scatter(torch.ones(dist.get_world_size(), 3), group)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return seen, gathered.sum().item(), summed.tolist()


def test_a_wrapper_installed_after_import_sees_every_gather(run_ranks):
    for seen, gathered, summed in run_ranks(2, _seen_by_a_later_wrapper):
        assert gathered == 6 and summed == [2.0, 2.0, 2.0]
        assert len(seen) == 2 and seen[0].startswith("all_gather") and seen[1].startswith("reduce_scatter"), seen


def test_gradient_wire_dtype():
    # Unset: the accumulation dtype; set: that dtype, except for float64 models, which keep float64.
    assert precision.gradient_wire_dtype(None, torch.bfloat16) == torch.float32
    assert precision.gradient_wire_dtype(None, torch.float64) == torch.float64
    assert precision.gradient_wire_dtype(torch.bfloat16, torch.float32) == torch.bfloat16
    assert precision.gradient_wire_dtype(torch.bfloat16, torch.bfloat16) == torch.bfloat16
    assert precision.gradient_wire_dtype(torch.float16, torch.float64) == torch.float64


def test_size_one_group_moves_nothing():
    comm.counter.reset()
    x = torch.ones(4)
    assert comm.broadcast(x, 0, None) is None
    gathered, _ = comm.all_gather(x, None)
    assert gathered.shape == (1, 4)
    assert comm.counter.snapshot() == {}


def _fp32_sums(world_size, tsp_size):
    topo = TSPTopology(tsp_size)
    group, r, D = topo.tsp_group, topo.tsp_rank, topo.tsp_size
    small = 2.0 ** -8  # half an ulp of bf16 at 1: 1 + small rounds back to 1 in a bf16 sum
    exact = 1 + (D - 1) * small  # exact in fp32 and in the bf16 inputs' terms
    bf16_sum = torch.tensor(1.0, dtype=torch.bfloat16)
    for _ in range(D - 1):
        bf16_sum = bf16_sum + torch.tensor(small, dtype=torch.bfloat16)  # what summing in bf16 gives: 1
    checks = {}

    # Slice j (for rank j) gets 1 from rank j and `small` from every other rank, 5 values each.
    stacked = torch.full((D, 5), small, dtype=torch.bfloat16)
    stacked[r] = 1.0
    comm.counter.reset()
    local = comm.reduce_scatter_fp32(stacked, group)
    checks["reduce_scatter_dtype"] = local.dtype == torch.float32
    checks["reduce_scatter_fp32_sum"] = torch.equal(local, torch.full((5,), exact))
    checks["reduce_scatter_not_bf16_sum"] = not torch.equal(local, torch.full((5,), bf16_sum.float().item()))
    checks["reduce_scatter_bytes"] = comm.counter.received() == comm.counter.sent() == (D - 1) * 5 * 2
    checks["reduce_scatter_counted_as"] = sorted(comm.counter.snapshot()) == ["reduce_scatter"]

    # 7 values (not a multiple of D: padded pieces); rank 0 holds 1, the others `small`.
    x = torch.full((7,), 1.0 if r == 0 else small, dtype=torch.bfloat16)
    comm.counter.reset()
    total = comm.all_reduce_fp32(x, group)
    rounded_once = torch.tensor(exact).to(torch.bfloat16)
    checks["all_reduce_dtype"] = total.dtype == torch.bfloat16 and total.shape == x.shape
    checks["all_reduce_fp32_sum"] = torch.equal(total, rounded_once.expand(7))
    # From D = 4 the fp32 sum rounds to 1 + 2^-6, the bf16 sum stays at 1.
    checks["all_reduce_not_bf16_sum"] = D < 4 or not torch.equal(total, bf16_sum.expand(7))
    checks["all_reduce_bytes"] = comm.counter.received() == comm.counter.sent() == 2 * (D - 1) * 7 * 2 // D
    checks["all_reduce_counted_as"] = sorted(comm.counter.snapshot()) == ["all_reduce"]

    # Float32 inputs take the plain collectives, with their values and bytes.
    y = torch.full((3,), float(r + 1))
    checks["all_reduce_fp32_of_fp32"] = torch.equal(comm.all_reduce_fp32(y, group), torch.full((3,), D * (D + 1) / 2))

    # reduce_fp32: float32 partials sent in bf16 to the last rank (a global rank != group rank on a subgroup).
    # The owner's own 1 + 2^-12 is not a bf16 number, nor are the others' 2^-8 + 2^-20: the sum keeps the
    # owner's part whole and the others' parts as bf16 rounded them, every term exact in float32.
    owner, tiny = D - 1, 2.0 ** -20
    part = torch.full((5,), 1 + 2.0 ** -12 if r == owner else small + tiny)
    for wire, expected in ((torch.bfloat16, 1 + 2.0 ** -12 + (D - 1) * small),
                           (torch.float32, 1 + 2.0 ** -12 + (D - 1) * (small + tiny))):
        name = f"reduce_{str(wire).removeprefix('torch.')}_wire"
        comm.counter.reset()
        pending = comm.reduce_fp32(part.clone(), owner, group, wire, async_op=True)
        total = pending.wait()
        nbytes = 5 * wire.itemsize
        if r == owner:
            checks[name] = total.dtype == torch.float32 and torch.equal(total, torch.full((5,), expected))
            checks[f"{name}_bytes"] = (comm.counter.sent(), comm.counter.received()) == (0, (D - 1) * nbytes)
            checks[f"{name}_waits_once"] = pending.wait() is total
        else:
            checks[name] = total is None
            checks[f"{name}_bytes"] = (comm.counter.sent(), comm.counter.received()) == (nbytes, 0)
        checks[f"{name}_counted_as"] = sorted(comm.counter.snapshot()) == ["reduce"]
    summed = comm.reduce_fp32(part.clone(), owner, group, torch.bfloat16)  # without async_op: the sum itself
    checks["reduce_bf16_wire_sync"] = (summed is None) == (r != owner)
    return checks


@pytest.mark.parametrize("world_size, tsp_size", [(2, 2), (4, 4), (4, 2)])
def test_fp32_sums_of_bf16(run_ranks, world_size, tsp_size):
    """bf16 in (or, for ``reduce_fp32``, float32 partials sent in bf16), bf16
    bytes on the wire, float32 sums: the values a bf16 sum would round away
    survive, and the bytes are the plain collectives'."""
    for rank, checks in enumerate(run_ranks(world_size, _fp32_sums, world_size=world_size, tsp_size=tsp_size)):
        failed = [name for name, ok in checks.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
