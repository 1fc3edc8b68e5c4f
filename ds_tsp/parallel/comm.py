"""Counted collectives: the only place ds_tsp moves data with ``torch.distributed``
(group creation lives in ``topology``).

Every function takes its process group explicitly, returns early on a group of
size 1 and adds the bytes this rank sends and receives to ``counter``, so tests
can assert the DESIGN.md cost model to the byte and benchmarks can report it.
Counts are the logical data of the op, as a ring implementation moves it:

* broadcast: the owner sends ``(D-1) n``, every other rank receives ``n``;
* all-gather of ``n`` per rank: each rank sends and receives ``(D-1) n``;
* reduce-scatter to ``n`` per rank: each rank sends and receives ``(D-1) n``;
* reduce of ``n``: every non-owner sends ``n``, the owner receives ``(D-1) n``;
* all-reduce of ``n``: each rank sends and receives ``2 (D-1) n / D``;
* all-to-all: what goes to and comes from the other ranks (a rank's own
  block stays put);
* ring send/recv: exactly the tensors sent and received.

``all_gather_small`` and ``all_to_all_small`` carry a decode step's small
messages: as ``all_gather`` and ``all_to_all``, or, where DeepSpeed's
shared-memory all-reduce is there for the group (CPU ranks, the group the
whole world), as that all-reduce over zero-filled slots (counted as such).

``reduce_scatter_fp32`` and ``all_reduce_fp32`` move the same bytes in the
input's dtype as ``reduce_scatter`` and ``all_reduce`` (and are counted under
those names) but add in float32 or wider: a bf16 reduce-scatter or all-reduce
sums on the wire in bf16, one rounding per hop. ``reduce_fp32`` does the same
for a ``reduce`` of float32 partial sums sent in a narrower wire dtype.

Timeouts are carried by the process groups themselves (``topology`` creates
them with ``tsp.timeout_minutes``), so a dead peer fails the op instead of
hanging it.
"""

import math
import pickle
import sys
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ds_tsp.parallel.eager import untraced
from ds_tsp.parallel.precision import accumulation_dtype


@dataclass
class OpCount:
    calls: int = 0
    sent: int = 0
    received: int = 0


class CommCounter:
    """Bytes sent and received by this rank, per collective."""

    def __init__(self):
        self.ops = defaultdict(OpCount)

    @untraced
    def add(self, op, sent, received):
        count = self.ops[op]
        count.calls += 1
        count.sent += int(sent)
        count.received += int(received)

    def reset(self):
        self.ops.clear()

    def received(self, *ops):
        return sum(c.received for name, c in self.ops.items() if not ops or name in ops)

    def sent(self, *ops):
        return sum(c.sent for name, c in self.ops.items() if not ops or name in ops)

    def snapshot(self):
        return {name: vars(c).copy() for name, c in self.ops.items()}


counter = CommCounter()

# torch 2.13 renamed the *_into_tensor / *_tensor forms; keep older torch working. Looked up at each call, not
# bound at import, so that a wrapper installed on torch.distributed later (a profiler's, a benchmark's byte
# count) sees these calls as it sees every other.
def _all_gather_single(*args, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def _nbytes(tensor):
    return tensor.numel() * tensor.element_size()


def group_size(group):
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group):
    return dist.get_rank(group) if dist.is_initialized() else 0


def global_rank(group, rank_in_group):
    """The global rank of ``rank_in_group``: point-to-point ops and ``src``/``dst``
    arguments of torch.distributed take global ranks even inside a subgroup."""
    if not dist.is_initialized():
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


def broadcast(tensor, src, group, async_op=False):
    """Broadcast ``tensor`` in place from group rank ``src``; returns a work handle
    when ``async_op``."""
    size = group_size(group)
    if size == 1:
        return None
    nbytes = _nbytes(tensor)
    if group_rank(group) == src:
        counter.add("broadcast", sent=(size - 1) * nbytes, received=0)
    else:
        counter.add("broadcast", sent=0, received=nbytes)
    return dist.broadcast(tensor, global_rank(group, src), group=group, async_op=async_op)


def all_gather(tensor, group, async_op=False, counted_as="all_gather"):
    """All-gather ``tensor`` from every rank of ``group`` into a new leading dim.

    Returns ``(gathered, work)`` with ``gathered`` of shape ``(D, *tensor.shape)``
    in group-rank order; ``work`` is None unless ``async_op``. ``counted_as``:
    the op name ``counter`` records it under (a check's all-gather is not the
    schedule's).
    """
    size = group_size(group)
    if size == 1:
        return tensor.unsqueeze(0), None
    tensor = tensor.contiguous()
    gathered = tensor.new_empty((size, *tensor.shape))
    counter.add(counted_as, sent=(size - 1) * _nbytes(tensor), received=(size - 1) * _nbytes(tensor))
    # Flat views: gloo wants the output concatenated along dim 0, not stacked.
    work = _all_gather_single(gathered.view(-1), tensor.view(-1), group=group, async_op=async_op)
    return gathered, work


def reduce_scatter(stacked, group, async_op=False):
    """Sum ``stacked`` of shape ``(D, *shape)`` over ``group`` and keep this
    rank's slice ``stacked[group_rank]`` of the sum.

    Returns ``(local_sum, work)``; ``work`` is None unless ``async_op``.
    """
    size = group_size(group)
    if size == 1:
        return stacked[0], None
    if stacked.shape[0] != size:
        raise ValueError(f"reduce_scatter expects a leading dim of {size} (the group size), got {tuple(stacked.shape)}")
    stacked = stacked.contiguous()
    out = stacked.new_empty(stacked.shape[1:])
    counter.add("reduce_scatter", sent=(size - 1) * _nbytes(out), received=(size - 1) * _nbytes(out))
    work = _reduce_scatter_single(out.view(-1), stacked.view(-1), group=group, async_op=async_op)
    return out, work


def _add_slices_fp32(received):
    """The slices ``received[j]`` (rank j's summands) added in group-rank order in float32 or wider."""
    total = received[0].to(accumulation_dtype(received.dtype))
    for part in received[1:]:
        total += part
    return total


def reduce_scatter_fp32(stacked, group, async_op=False):
    """``reduce_scatter`` with the bytes in ``stacked``'s dtype but the sum in
    float32 or wider; returns this rank's slice of the sum in that wider dtype
    (with ``async_op``, a ``Pending`` whose ``wait()`` returns it).

    Narrower inputs go as an all-to-all of the same slices (each rank sends and
    receives ``D-1`` of them, as a reduce-scatter does; counted as
    ``reduce_scatter``) and the received slices are added on arrival in
    group-rank order, so the sum does not depend on the wire algorithm. Wider
    inputs take ``reduce_scatter`` itself.
    """
    size = group_size(group)
    acc = accumulation_dtype(stacked.dtype)
    if size == 1:
        local = stacked[0].to(acc)
        return Pending(None, lambda: local) if async_op else local
    if acc == stacked.dtype:
        local, work = reduce_scatter(stacked, group, async_op=async_op)
        return Pending(work, lambda: local) if async_op else local
    if stacked.shape[0] != size:
        raise ValueError(f"reduce_scatter_fp32 expects a leading dim of {size} (the group size), "
                         f"got {tuple(stacked.shape)}")
    stacked = stacked.contiguous()
    counter.add("reduce_scatter", sent=(size - 1) * _nbytes(stacked[0]), received=(size - 1) * _nbytes(stacked[0]))
    received = torch.empty_like(stacked)  # received[j]: rank j's summand of this rank's slice
    work = dist.all_to_all_single(received, stacked, group=group, async_op=async_op)
    return Pending(work, lambda: _add_slices_fp32(received)) if async_op else _add_slices_fp32(received)


def all_reduce_fp32(tensor, group, async_op=False):
    """The sum of ``tensor`` over ``group``, a new tensor of ``tensor``'s dtype:
    the float32 (or wider) sum rounded once, the same on every rank, for the
    bytes of an ``all_reduce`` in ``tensor``'s dtype (counted as one).

    Narrower inputs: the ``reduce_scatter_fp32`` of ``D`` equal pieces (zero
    padded), then an all-gather of the summed pieces in ``tensor``'s dtype:
    ``2 (D-1) n / D`` each way, as a ring all-reduce. Wider inputs take
    ``all_reduce`` itself.

    With ``async_op`` the sum is launched and a ``Pending`` returned, whose
    ``wait()`` returns it: the wider inputs' all-reduce, or the narrower
    inputs' exchange of pieces, is in flight until then (the narrower inputs'
    all-gather of summed pieces runs inside ``wait()``, as it needs the sums).
    """
    size = group_size(group)
    if size == 1:
        return Pending(None, tensor.clone) if async_op else tensor.clone()
    if accumulation_dtype(tensor.dtype) == tensor.dtype:
        out = tensor.clone()
        work = all_reduce(out, group, async_op=async_op)
        return Pending(work, lambda: out) if async_op else out
    flat = tensor.reshape(-1)
    piece = -(-flat.numel() // size)
    stacked = flat.new_zeros(size * piece)
    stacked[:flat.numel()] = flat
    moved = 2 * (size - 1) * _nbytes(tensor) // size
    counter.add("all_reduce", sent=moved, received=moved)
    received = torch.empty_like(stacked)  # received[j]: rank j's summand of this rank's piece
    work = dist.all_to_all_single(received, stacked, group=group, async_op=async_op)

    def gather_sums():
        local = _add_slices_fp32(received.view(size, piece)).to(tensor.dtype)
        gathered = local.new_empty(size * piece)
        _all_gather_single(gathered, local, group=group)
        return gathered[:flat.numel()].view(tensor.shape)

    return Pending(work, gather_sums) if async_op else gather_sums()


class Pending:
    """A collective in flight (``reduce_scatter_fp32``, ``all_reduce_fp32`` or
    ``reduce_fp32`` with ``async_op``, an all-gather the caller wraps):
    ``wait()`` finishes it and returns its result, computed by ``finish`` once
    ``work`` is done; later calls return the same result."""

    def __init__(self, work, finish):
        self._work, self._finish, self._result = work, finish, None

    def wait(self):
        if self._finish is not None:
            if self._work is not None:
                self._work.wait()
            self._result, self._finish, self._work = self._finish(), None, None
        return self._result


def reduce_fp32(tensor, dst, group, dtype=None, async_op=False):
    """The sum over ``group`` of ``tensor`` (partial sums, float32 or wider) at
    group rank ``dst``, sent in ``dtype`` (default: ``tensor``'s) and added in
    ``tensor``'s dtype; returns the sum on ``dst`` and None elsewhere (with
    ``async_op``, a ``Pending`` whose ``wait()`` returns it).

    A narrower ``dtype`` goes as a gather to ``dst`` (each other rank sends
    ``n`` bytes of ``dtype``, ``dst`` receives ``(D-1) n``: a ``reduce``'s
    bytes, counted as one), and ``dst`` adds the parts in group-rank order,
    its own unrounded: a reduce in that dtype would sum on the wire in it, one
    rounding per hop. Otherwise ``reduce`` itself, in place in ``tensor``.
    """
    size = group_size(group)
    wire = tensor.dtype if dtype is None else dtype
    if size == 1:
        return Pending(None, lambda: tensor) if async_op else tensor
    rank = group_rank(group)
    if wire == tensor.dtype:
        work = reduce(tensor, dst, group, async_op=async_op)
        result = tensor if rank == dst else None
        return Pending(work, lambda: result) if async_op else result
    sent = tensor.to(wire).contiguous()
    if rank == dst:
        counter.add("reduce", sent=0, received=(size - 1) * _nbytes(sent))
        received = sent.new_empty((size, *sent.shape))  # received[j]: rank j's part
        gather_list = list(received.unbind(0))
    else:
        counter.add("reduce", sent=_nbytes(sent), received=0)
        received = gather_list = None
    work = dist.gather(sent, gather_list, dst=global_rank(group, dst), group=group, async_op=async_op)

    def add_in_rank_order():
        if received is None:
            return None
        total = (tensor if dst == 0 else received[0]).to(tensor.dtype, copy=True)
        for j in range(1, size):
            total += tensor if j == dst else received[j]
        return total

    return Pending(work, add_in_rank_order) if async_op else add_in_rank_order()


def reduce(tensor, dst, group, async_op=False):
    """Sum ``tensor`` over ``group`` into group rank ``dst`` (in place there)."""
    size = group_size(group)
    if size == 1:
        return None
    nbytes = _nbytes(tensor)
    if group_rank(group) == dst:
        counter.add("reduce", sent=0, received=(size - 1) * nbytes)
    else:
        counter.add("reduce", sent=nbytes, received=0)
    return dist.reduce(tensor, global_rank(group, dst), group=group, async_op=async_op)


def _shared_memory_all_reduce(tensor, group):
    """DeepSpeed's inference all-reduce where its shared-memory op carries
    ``tensor`` over ``group``, else None: CPU tensors of a dtype its kernels
    take, over a group that is the whole world (the op knows no subgroups)."""
    if tensor.device.type != "cpu" or tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    ds_comm = sys.modules.get("deepspeed.comm")  # initialized only where DeepSpeed was imported
    if ds_comm is None or not ds_comm.is_initialized() or group_size(group) != dist.get_world_size():
        return None
    return ds_comm.inference_all_reduce if getattr(ds_comm.comm.cdb, "shm_comm_op", None) is not None else None


def _all_reduce_slots(stacked, group, reduce):
    """Every rank's ``stacked`` as ``(D, *stacked.shape)``: each in its own
    zero-filled slot of one all-reduce, which adds only zeros to it (exact)."""
    size = group_size(group)
    slots = stacked.new_zeros((size, *stacked.shape))
    slots[group_rank(group)] = stacked
    moved = 2 * (size - 1) * _nbytes(slots) // size
    counter.add("all_reduce", sent=moved, received=moved)
    reduce(slots, group=group)
    return slots


def all_gather_small(tensor, group):
    """``all_gather(tensor, group)[0]`` for latency-bound messages (a decode
    step's). Where DeepSpeed's shared-memory all-reduce carries the group
    (CPU ranks, the TSP group spanning the world), the one DeepSpeed's
    tensor-parallel inference uses, it is that all-reduce of every rank's
    tensor in its own zero-filled slot: the same result bit for bit, counted
    as an all-reduce of ``D n``, in a fraction of a gloo all-gather's latency."""
    if group_size(group) == 1:
        return tensor.unsqueeze(0)
    reduce = _shared_memory_all_reduce(tensor, group)
    if reduce is None:
        return all_gather(tensor, group)[0]
    return _all_reduce_slots(tensor, group, reduce)


def all_to_all_small(stacked, group):
    """``all_to_all(stacked, group)[0]`` for latency-bound messages, carried
    like ``all_gather_small``: the all-reduce brings every rank's whole
    ``stacked`` (``D`` times the all-to-all's data), and this rank keeps its block of each."""
    if group_size(group) == 1:
        return stacked
    reduce = _shared_memory_all_reduce(stacked, group)
    if reduce is None:
        return all_to_all(stacked, group)[0]
    return _all_reduce_slots(stacked, group, reduce)[:, group_rank(group)]


def all_reduce(tensor, group, async_op=False):
    """Sum ``tensor`` over ``group`` in place on every rank."""
    size = group_size(group)
    if size == 1:
        return None
    moved = 2 * (size - 1) * _nbytes(tensor) // size
    counter.add("all_reduce", sent=moved, received=moved)
    return dist.all_reduce(tensor, group=group, async_op=async_op)


class RingExchange:
    """Send to the next rank of ``group`` and receive from the previous one.

    ``send_recv`` posts the exchange at once (batched isend/irecv) and returns the
    buffer the message will land in; ``wait`` completes every posted exchange.
    Posting before computing and waiting after is what overlaps the two.
    """

    def __init__(self, group):
        self.group = group
        size, rank = group_size(group), group_rank(group)
        self.next_rank = global_rank(group, (rank + 1) % size)
        self.prev_rank = global_rank(group, (rank - 1) % size)
        self._ops = []
        self._works = []

    def send_recv(self, tensor):
        tensor = tensor.contiguous()
        recv = torch.empty_like(tensor)
        self._ops += [
            dist.P2POp(dist.isend, tensor, self.next_rank, group=self.group),
            dist.P2POp(dist.irecv, recv, self.prev_rank, group=self.group),
        ]
        counter.add("ring", sent=_nbytes(tensor), received=_nbytes(recv))
        return recv

    def commit(self):
        if self._ops:
            self._works += dist.batch_isend_irecv(self._ops)
            self._ops = []

    def wait(self):
        self.commit()
        for work in self._works:
            work.wait()
        self._works = []


def all_gather_objects(obj, group):
    """``obj`` of every rank of ``group`` (None: the world), in rank order: small
    picklable values (plans, verdicts, model listings), never tensors in bulk.
    Counted by the pickle's size."""
    if not dist.is_initialized() or group_size(group) == 1:
        return [obj]
    size, rank = group_size(group), group_rank(group)
    gathered = [None] * size
    dist.all_gather_object(gathered, obj, group=group)
    received = sum(len(pickle.dumps(other)) for r, other in enumerate(gathered) if r != rank)
    counter.add("all_gather_object", sent=(size - 1) * len(pickle.dumps(obj)), received=received)
    return gathered


def group_device(group):
    """Where a collective over ``group`` (None: the world) takes its tensors:
    the CPU where the group's backend carries CPU tensors (gloo, or a
    ``"cpu:gloo,cuda:nccl"`` pair), else the accelerator's current device
    (NCCL and the like, which take no CPU tensor)."""
    cpu = torch.device("cpu")
    if not dist.is_initialized():
        return cpu
    backend = str(dist.get_backend(group))
    if backend in ("gloo", "mpi") or "cpu:" in backend:
        return cpu
    if not hasattr(torch, "accelerator"):  # torch < 2.6
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else cpu
    accelerator = torch.accelerator.current_accelerator()
    return cpu if accelerator is None else torch.device(accelerator.type, torch.accelerator.current_device_index())


def count_true(flag, group):
    """How many ranks of ``group`` (None: the world) pass a true ``flag``: one
    all-reduce of one int32 on ``group_device`` (counted as such), the same
    answer on every rank. A small collective every rank can join to agree on
    an outcome, a save's success or failure, before any acts on it."""
    if group_size(group) == 1:
        return int(bool(flag))
    count = torch.tensor([int(bool(flag))], dtype=torch.int32, device=group_device(group))
    all_reduce(count, group)
    return int(count.item())


def barrier(group):
    """Wait until every rank of ``group`` (None: the whole world) gets here; no data moves."""
    if group_size(group) == 1:
        return
    counter.add("barrier", sent=0, received=0)
    dist.barrier(group=group)


def all_to_all(stacked, group, async_op=False):
    """Send ``stacked[j]`` to group rank ``j``; receive into ``out[j]`` what rank
    ``j`` sent to this rank (``stacked`` is ``(D, *shape)``).

    Returns ``(out, work)``; ``work`` is None unless ``async_op``.
    """
    size = group_size(group)
    if size == 1:
        return stacked, None
    if stacked.shape[0] != size:
        raise ValueError(f"all_to_all expects a leading dim of {size} (the group size), got {tuple(stacked.shape)}")
    stacked = stacked.contiguous()
    out = torch.empty_like(stacked)
    counter.add("all_to_all", sent=(size - 1) * _nbytes(stacked[0]), received=(size - 1) * _nbytes(stacked[0]))
    work = dist.all_to_all_single(out, stacked, group=group, async_op=async_op)
    return out, work


def all_to_all_rows(rows, send_counts, recv_counts, group):
    """Uneven all-to-all of rows: the first ``send_counts[0]`` rows of ``rows``
    go to group rank 0, the next ``send_counts[1]`` to rank 1, and so on.
    Returns the rows received, grouped by source rank (``recv_counts[j]`` from
    rank ``j``). Both sides must know the counts; nothing else is exchanged."""
    size = group_size(group)
    if size == 1:
        return rows
    rank = group_rank(group)
    row_bytes = _nbytes(rows[:1]) if len(rows) else rows.element_size() * math.prod(rows.shape[1:])
    counter.add("all_to_all", sent=(sum(send_counts) - send_counts[rank]) * row_bytes,
                received=(sum(recv_counts) - recv_counts[rank]) * row_bytes)
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=list(recv_counts),
                           input_split_sizes=list(send_counts), group=group)
    return out
