"""How benchmarks/compare.py counts, the same way for every strategy: bytes
each rank sends and receives through ``torch.distributed`` (a counting shim,
installed before DeepSpeed or ds_tsp are imported), live tensor bytes
(a ``TorchDispatchMode``) and the kernel's RSS high-water mark. The method is
spelled out in compare.py's docstring; benchmarks/longest.py adds the split of
live bytes into device and host memory (``in_host_memory``)."""

import gc
import threading
import weakref
from collections import defaultdict
from contextlib import contextmanager
from functools import partial, wraps

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only


# --- bytes communicated: a counting shim over torch.distributed --------------------------------------------------

class CollectiveBytes:
    """Bytes this rank sent and received, per ``torch.distributed`` function."""

    def __init__(self):
        self.ops = defaultdict(lambda: {"calls": 0, "sent": 0, "received": 0})

    def add(self, op, sent, received):
        count = self.ops[op]
        count["calls"] += 1
        count["sent"] += int(sent)
        count["received"] += int(received)

    def reset(self):
        self.ops.clear()

    def snapshot(self):
        return {name: dict(count) for name, count in self.ops.items()}


collective_bytes = CollectiveBytes()
_shim_depth = threading.local()


def _nbytes(tensor):
    return tensor.numel() * tensor.element_size()


def _group_size_rank(group):
    return dist.get_world_size(group), dist.get_rank(group)


def _is_root(group, global_root, group_root):
    if group_root is not None:
        return dist.get_rank(group) == group_root
    return dist.get_rank() == global_root


def _broadcast_bytes(tensor, src=None, group=None, async_op=False, group_src=None):
    n, _ = _group_size_rank(group)
    return ((n - 1) * _nbytes(tensor), 0) if _is_root(group, src, group_src) else (0, _nbytes(tensor))


def _reduce_bytes(tensor, dst=None, op=None, group=None, async_op=False, group_dst=None):
    n, _ = _group_size_rank(group)
    return (0, (n - 1) * _nbytes(tensor)) if _is_root(group, dst, group_dst) else (_nbytes(tensor), 0)


def _all_reduce_bytes(tensor, op=None, group=None, async_op=False):
    n, _ = _group_size_rank(group)
    moved = 2 * (n - 1) * _nbytes(tensor) // n
    return moved, moved


def _all_reduce_coalesced_bytes(tensors, op=None, group=None, async_op=False):
    n, _ = _group_size_rank(group)
    moved = 2 * (n - 1) * sum(_nbytes(t) for t in tensors) // n
    return moved, moved


def _all_gather_list_bytes(tensor_list, tensor, group=None, async_op=False):
    n, _ = _group_size_rank(group)
    return (n - 1) * _nbytes(tensor), (n - 1) * _nbytes(tensor)


def _all_gather_flat_bytes(output_tensor, input_tensor, group=None, async_op=False):
    n, _ = _group_size_rank(group)
    return (n - 1) * _nbytes(input_tensor), (n - 1) * _nbytes(input_tensor)


def _reduce_scatter_bytes(output, input, op=None, group=None, async_op=False):
    n, _ = _group_size_rank(group)
    return (n - 1) * _nbytes(output), (n - 1) * _nbytes(output)


def _all_to_all_single_bytes(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                             async_op=False):
    n, rank = _group_size_rank(group)

    def off_rank(tensor, splits):
        if splits is None:
            return _nbytes(tensor) * (n - 1) // n
        row = _nbytes(tensor) // max(tensor.shape[0], 1)
        return (sum(splits) - splits[rank]) * row

    return off_rank(input, input_split_sizes), off_rank(output, output_split_sizes)


def _all_to_all_bytes(output_tensor_list, input_tensor_list, group=None, async_op=False):
    _, rank = _group_size_rank(group)
    sent = sum(_nbytes(t) for i, t in enumerate(input_tensor_list) if i != rank)
    return sent, sum(_nbytes(t) for i, t in enumerate(output_tensor_list) if i != rank)


def _gather_bytes(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    n, _ = _group_size_rank(group)
    return (0, (n - 1) * _nbytes(tensor)) if _is_root(group, dst, group_dst) else (_nbytes(tensor), 0)


def _scatter_bytes(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    n, _ = _group_size_rank(group)
    return ((n - 1) * _nbytes(tensor), 0) if _is_root(group, src, group_src) else (0, _nbytes(tensor))


def _send_bytes(tensor, *args, **kwargs):
    return _nbytes(tensor), 0


def _recv_bytes(tensor, *args, **kwargs):
    return 0, _nbytes(tensor)


def _no_bytes(*args, **kwargs):
    return 0, 0


_BYTE_RULES = {
    "broadcast": _broadcast_bytes, "reduce": _reduce_bytes, "all_reduce": _all_reduce_bytes,
    "all_reduce_coalesced": _all_reduce_coalesced_bytes, "all_gather": _all_gather_list_bytes,
    "all_gather_into_tensor": _all_gather_flat_bytes, "all_gather_single": _all_gather_flat_bytes,
    "_all_gather_base": _all_gather_flat_bytes, "reduce_scatter": _reduce_scatter_bytes,
    "reduce_scatter_tensor": _reduce_scatter_bytes, "reduce_scatter_single": _reduce_scatter_bytes,
    "_reduce_scatter_base": _reduce_scatter_bytes, "all_to_all_single": _all_to_all_single_bytes,
    "all_to_all": _all_to_all_bytes, "gather": _gather_bytes, "scatter": _scatter_bytes,
    "send": _send_bytes, "isend": _send_bytes, "recv": _recv_bytes, "irecv": _recv_bytes, "barrier": _no_bytes,
}


def install_comm_shim():
    """Wrap every collective and point-to-point function, in both namespaces
    (``torch.distributed`` and ``distributed_c10d``), with one counting wrapper.

    Both, because callers reach them either way and the object collectives are
    built on the module-level functions; the same wrapper object in both,
    because ``P2POp`` and ``batch_isend_irecv`` compare ``op is isend``. Only
    the outermost call counts, so a wrapped function that calls another (e.g. a
    deprecated alias) is counted once. ``batch_isend_irecv`` is left alone: it
    calls the wrapped ``isend``/``irecv`` once per op.
    """
    if getattr(c10d, "_compare_shim_installed", False):
        return
    for name, rule in _BYTE_RULES.items():
        original = getattr(c10d, name, None)
        if original is None:
            continue

        @wraps(original)
        def counted(*args, __original=original, __name=name, __rule=rule, **kwargs):
            if getattr(_shim_depth, "value", 0):
                return __original(*args, **kwargs)
            collective_bytes.add(__name, *__rule(*args, **kwargs))
            _shim_depth.value = 1
            try:
                return __original(*args, **kwargs)
            finally:
                _shim_depth.value = 0

        setattr(c10d, name, counted)
        if getattr(dist, name, None) is original:
            setattr(dist, name, counted)
    c10d._compare_shim_installed = True


# --- peak memory: live tensor storages -----------------------------------------------------------------------------

_host_scope = threading.local()


@contextmanager
def in_host_memory():
    """Storages first seen inside this block, on this thread, count as host
    memory in every ``LiveTensorBytes``. On CPU ranks host and device memory
    are the same RAM: what a GPU run would put in host memory (ds_tsp's
    offloaded checkpoints, ZeRO's CPU optimizer step) is told apart by where
    it is made, not by its device."""
    depth = getattr(_host_scope, "depth", 0)
    _host_scope.depth = depth + 1
    try:
        yield
    finally:
        _host_scope.depth = depth


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of every live tensor storage in this process while the mode is on.

    ``state_bytes``: what was alive on entry; ``peak_bytes``: the most that was
    alive at once. A storage is counted once, however many tensors view it;
    its bytes leave the sum when the storage is freed (weak-reference callback)
    and follow it when it is resized.

    Host memory is counted apart (``host_state_bytes``, ``host_peak_bytes``):
    the storages of ``host_tensors`` (alive on entry) and those first seen
    inside ``in_host_memory``. Without either, every byte is device memory.
    """

    def __init__(self, host_tensors=()):
        super().__init__()
        self._nbytes = {}
        self._refs = {}
        self._host_tensors = list(host_tensors)
        self._host_keys = set()
        # Storages that a collective's worker thread releases are freed (and
        # their callbacks run) on that thread. Re-entrant: registering one
        # storage can free another on this thread.
        self._lock = threading.RLock()
        self.live_bytes = self.peak_bytes = self.state_bytes = 0
        self.host_live_bytes = self.host_peak_bytes = self.host_state_bytes = 0

    def __enter__(self):
        self._host_keys.update(t.untyped_storage()._cdata for t in self._host_tensors)
        self._host_tensors = []
        gc.collect()
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                self._track(obj)
                # .grad tensors made by autograd have no Python object until read.
                if obj.requires_grad and obj.grad is not None:
                    self._track(obj.grad)
        self.state_bytes = self.peak_bytes = self.live_bytes
        self.host_state_bytes = self.host_peak_bytes = self.host_live_bytes
        return super().__enter__()

    def __exit__(self, *exc):
        with self._lock:
            self._refs.clear()  # no callbacks once the measurement is over
        return super().__exit__(*exc)

    def _add(self, key, nbytes):
        if key in self._host_keys:
            self.host_live_bytes += nbytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_live_bytes)
        else:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _track(self, tensor):
        if tensor.device.type == "meta" or tensor.is_sparse:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key, nbytes = storage._cdata, storage.nbytes()
        with self._lock:
            known = self._nbytes.get(key)
            if known is None:
                if getattr(_host_scope, "depth", 0):
                    self._host_keys.add(key)
                self._refs[key] = weakref.ref(storage, partial(self._freed, key))
                self._nbytes[key] = nbytes
                self._add(key, nbytes)
            elif known != nbytes:
                self._nbytes[key] = nbytes
                self._add(key, nbytes - known)

    def _freed(self, key, _ref):
        with self._lock:
            self._add(key, -self._nbytes.pop(key, 0))
            self._host_keys.discard(key)
            self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out


def reset_peak_rss():
    """Reset the kernel's RSS high-water mark; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
