"""A dry run that enforces NCCL's rules on CPU (DESIGN.md section 10, issue 60).

A multi-GPU run initialises torch.distributed with NCCL alone, which takes no
host tensor; gloo, which the CPU suite runs on, takes any, so the suite cannot
see a collective on a CPU tensor. Here the model lives on the meta device, a
stand-in for the accelerator (its tensors cannot be read on the host), under
torch's fake process group, and ``DryRun``:

* wraps every ``torch.distributed`` collective to record each tensor's device:
  any device but the model's (a CPU tensor) is a collective that would fail
  on NCCL;
* makes ``comm.group_device`` answer the model's device, as it answers the
  accelerator's current device under NCCL;
* stands in for the device-to-host transfer of ``ds_tsp.parallel.host_reads``
  (meta tensors hold no values): it counts every host read by reason and
  answers with the batch's own values (``on_device`` keeps them) or with what
  a run that passes every check would read.

``meta_accelerator`` makes DeepSpeed's accelerator name the meta device, so
that ``ds_tsp.initialize``'s engine moves the model there as it moves it to
``cuda:LOCAL_RANK`` on a GPU.
"""

import contextlib
from collections import Counter
from unittest import mock

import torch
import torch.distributed as dist

from ds_tsp.parallel import comm, host_reads

# Every torch.distributed op that moves tensors, as ds_tsp or DeepSpeed call them.
COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
               "all_to_all_single", "batch_isend_irecv", "gather", "scatter", "send", "recv")


def fake_world(world_size, rank=0):
    """torch's fake process group of ``world_size`` (collectives return at once,
    moving nothing), the default group until ``dist.destroy_process_group()``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


@contextlib.contextmanager
def meta_accelerator():
    """DeepSpeed's accelerator answering the meta device for its device names
    (the engine's device, ZeRO's buffers), as the CUDA accelerator answers
    ``cuda``."""
    from deepspeed.accelerator import get_accelerator

    kind = type(get_accelerator())
    with mock.patch.object(kind, "device_name", lambda self, index=None: "meta"), \
            mock.patch.object(kind, "current_device_name", lambda self: "meta"):
        yield


def _tensors(args, kwargs):
    for value in (*args, *kwargs.values()):
        if torch.is_tensor(value):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if torch.is_tensor(item):
                    yield item
                elif isinstance(item, dist.P2POp):
                    yield item.tensor


class DryRun:
    """While active: the collectives by ``(op, device type)`` (``by_device``),
    those on another device than ``device`` (``misplaced``: op, device and the
    ds_tsp frame that issued it) and the host reads by reason (``host_reads``).
    ``routed_rows``: the ``(token, expert)`` rows a mixture-of-experts layer
    routes on this rank, which its split sizes must add up to."""

    def __init__(self, device="meta", routed_rows=0):
        self.device = torch.device(device)
        self.routed_rows = routed_rows
        self.by_device, self.misplaced = Counter(), []
        self._values = {}

    def on_device(self, tensor):
        """``tensor`` (on the host) on the dry run's device, its values kept for the host reads."""
        moved = tensor.to(self.device)
        self._values[id(moved)] = (moved, tensor)
        return moved

    @property
    def host_reads(self):
        return Counter(host_reads.reads)

    def _record(self, op, args, kwargs):
        for tensor in _tensors(args, kwargs):
            self.by_device[op, tensor.device.type] += 1
            if tensor.device != self.device:
                self.misplaced.append((op, str(tensor.device), _issuer()))

    def _wrap(self, op, function):
        def recorded(*args, **kwargs):
            self._record(op, args, kwargs)
            if op == "batch_isend_irecv":  # torch looks its backend up by the tensors' device, which meta has none
                return []  # of; the fake group would move nothing anyway
            return function(*args, **kwargs)
        return recorded

    def _answer(self, tensors, reason):
        """What the host reads of ``tensors`` (on the dry run's device) under ``reason``."""
        answers = []
        for tensor in tensors:
            kept = self._values.get(id(tensor))
            if kept is not None and kept[0] is tensor:
                answers.append(kept[1].clone())
            elif reason == "random state":  # TSP rank 0's: this process's own
                answers.append(torch.get_rng_state())
            elif reason in ("moe split sizes", "moe routing"):
                answers.append(self._even_split(tensor, reason))
            elif tensor.dtype == torch.bool:  # a check's condition: it holds
                answers.append(torch.ones(tensor.shape, dtype=tensor.dtype))
            else:  # a check's differences, fingerprints or bad ids: none, every rank alike
                answers.append(torch.zeros(tensor.shape, dtype=tensor.dtype))
        return answers

    def _even_split(self, counts, reason):
        """Routing spread evenly: ``(E,)`` rows per expert, or ``(D, E/D)``
        rows each rank sends to this rank's experts (every rank routing alike)."""
        experts = counts.shape[0] if counts.dim() == 1 else counts.numel()
        rows = self.routed_rows if reason == "moe split sizes" else experts
        even = torch.full((experts,), rows // experts, dtype=torch.int64)
        even[:rows % experts] += 1
        if counts.dim() == 1:
            return even
        size = counts.shape[0]
        return even.view(size, -1)[comm.group_rank(None) % size].expand(size, -1).clone()

    def __enter__(self):
        host_reads.reads.clear()
        self._stack = contextlib.ExitStack()
        for op in COLLECTIVES:
            if hasattr(dist, op):
                self._stack.enter_context(mock.patch.object(dist, op, self._wrap(op, getattr(dist, op))))
        # The accelerator's current device under NCCL is the model's here (DESIGN.md section 10, turn 5).
        self._stack.enter_context(mock.patch.object(comm, "group_device", lambda group: self.device))
        self._stack.enter_context(mock.patch.object(host_reads, "_transfer", self._answer))
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def report(self, title):
        devices = Counter()
        for (_, device), count in self.by_device.items():
            devices[device] += count
        lines = [f"{title}: collective tensors by device {dict(devices)} "
                 f"(on the CPU: {devices.get('cpu', 0)}), host reads by reason {dict(self.host_reads)}"]
        lines += [f"  misplaced: {op} on {device} from {where}" for op, device, where in self.misplaced]
        return "\n".join(lines)


def _issuer():
    """``file:line`` of the innermost ds_tsp frame on the stack."""
    import os
    import sys

    import ds_tsp
    package = os.path.dirname(ds_tsp.__file__)
    frame = sys._getframe(3)
    while frame is not None:
        if frame.f_code.co_filename.startswith(package) and not frame.f_code.co_filename.endswith("comm.py"):
            return f"{os.path.relpath(frame.f_code.co_filename, package)}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside ds_tsp"
