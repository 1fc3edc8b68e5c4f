"""Run a test body on N gloo ranks on CPU.

A pool of worker processes per world size is started once and reused by every
test. Workers are forked from a server that has already imported torch,
transformers, deepspeed and ds_tsp, so those imports are paid once per suite,
not once per rank of every pool (pools are replaced after a failing test). The process groups a test creates are destroyed when it returns:
each gloo group keeps three polling threads, and workers that live for the
whole suite would otherwise pile up hundreds of them, which once cost more
CPU time than the tests themselves. Ranks meet through a file rendezvous in a fresh temporary
directory, so concurrent runs never fight over ports. Every call has a timeout:
a hung or crashed rank fails the test and the pool is torn down and started
afresh for the next test; so is a pool whose workers have piled up the threads
of more than a few destroyed groups.

A body is a module-level function ``body(**kwargs)``; it reads its rank from
``torch.distributed`` and returns something picklable. ``run`` returns the list
of per-rank results.
"""

import gc
import importlib
import os
import queue
import sys
import tempfile
import traceback
from multiprocessing import forkserver

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 180
FAILED_PEER_WAIT_S = 10
# A destroyed gloo group's threads live on in its workers; past this many a pool is replaced (cheaply: the
# fork server keeps the imports) before they slow every later test down.
MAX_WORKER_THREADS = 64
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# Imported once by the fork server; nothing in them starts Python threads or process groups (the Trainer's
# pyarrow starts its allocator's background thread, which a fork leaves behind, as in datasets' forked workers).
# Besides the packages, what a fresh worker would otherwise import lazily, each time a pool is replaced:
# DeepSpeed's first optimizer check imports its Muon optimizer, whose torch.compile decorators import inductor
# (about 2 s of CPU a rank); the tests' Hugging Face model classes; the Trainer (about 3 s); the shared-memory
# op's loader (torch.utils.cpp_extension, setuptools).
PRELOAD = ["torch", "torch.distributed", "transformers", "deepspeed", "ds_tsp.runtime.engine",
           "ds_tsp.inference.generate", "deepspeed.runtime.zero.muon.muon_optimizer", "torch.utils.cpp_extension",
           "deepspeed.ops.op_builder.all_ops", "peft", "trl", "transformers.trainer", "pytest", "models"]


class RankFailure(AssertionError):
    pass


def _worker(rank, world_size, init_file, tasks, results):
    # What a launcher would set; DeepSpeed reads these.
    # One thread a rank, as ranks outnumber the cores; TSP_TEST_RANK_THREADS=2 sums in another order, which the
    # float32 bounds must survive (tests/float32_control.py).
    threads = os.environ.get("TSP_TEST_RANK_THREADS", "1")
    os.environ.update(OMP_NUM_THREADS=threads, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_SIZE=str(world_size))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(threads))
    # What the fork server imported lives as long as the worker: out of the garbage collector's sight, a full
    # collection (ZeRO-3 runs one in every engine it builds) walks only what the tests made.
    gc.freeze()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        sys_path, module_name, fn_name, kwargs = task
        for entry in reversed(sys_path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
            results.put((rank, True, fn(**kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
        finally:
            _release_groups()
    dist.destroy_process_group()


def _release_groups():
    """Destroy every process group but the world, and DeepSpeed's module-level
    references to them (the next engine builds its own)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    for group in list(_world.pg_map):
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)
    groups = sys.modules.get("deepspeed.utils.groups")
    for name, value in (vars(groups) if groups else {}).items():
        if isinstance(value, dist.ProcessGroup):
            setattr(groups, name, None)
        elif isinstance(value, dict) and any(isinstance(v, dist.ProcessGroup) for v in value.values()):
            value.clear()


def forkserver_context():
    """The multiprocessing context whose fork server imports ``PRELOAD`` once."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # Python 3.11's fork server is handed this process's sys.path but does not apply it: it finds the tests' own
    # modules (``models``) on PYTHONPATH, which it inherits when it starts.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([TESTS_DIR] + ([saved] if saved else []))
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


class RankPool:
    def __init__(self, world_size):
        self.world_size = world_size
        ctx = forkserver_context()
        self._dir = tempfile.TemporaryDirectory(prefix="ds_tsp_rdzv_")
        init_file = os.path.join(self._dir.name, "rendezvous")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for proc in self.procs:
            proc.start()

    def run(self, fn, /, timeout_s=DEFAULT_TIMEOUT_S, **kwargs):
        for q in self.tasks:
            q.put((list(sys.path), fn.__module__, fn.__name__, kwargs))
        outputs, failures = [None] * self.world_size, {}
        for _ in range(self.world_size):
            try:
                # Once a rank has failed, its peers are likely stuck waiting for it.
                rank, ok, value = self.results.get(timeout=FAILED_PEER_WAIT_S if failures else timeout_s)
            except queue.Empty:
                if failures:
                    break
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                finished = [r for r in range(self.world_size) if outputs[r] is not None]
                raise RankFailure(f"{fn.__name__} on {self.world_size} ranks: no answer within {timeout_s} s "
                                  f"(ranks that died: {dead}; finished: {finished})") from None
            if ok:
                outputs[rank] = value
            else:
                failures[rank] = value
        if failures:
            details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise RankFailure(f"{fn.__name__} failed on ranks {sorted(failures)}:\n{details}")
        return outputs

    def threads(self):
        """The most threads any worker runs now."""
        counts = []
        for proc in self.procs:
            try:
                counts.append(len(os.listdir(f"/proc/{proc.pid}/task")))
            except OSError:
                counts.append(0)
        return max(counts)

    def close(self, graceful=True):
        if graceful:
            for q in self.tasks:
                q.put(None)
            for proc in self.procs:
                proc.join(timeout=10)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        self._dir.cleanup()


class RankPools:
    """One live pool per world size; a pool whose call failed is replaced."""

    def __init__(self):
        self.pools = {}

    def run(self, world_size, fn, /, timeout_s=DEFAULT_TIMEOUT_S, **kwargs):
        pool = self.pools.get(world_size)
        if pool is None:
            pool = self.pools[world_size] = RankPool(world_size)
        try:
            outputs = pool.run(fn, timeout_s=timeout_s, **kwargs)
        except RankFailure:
            # Ranks may be stuck in a collective the failing rank never joined.
            self.pools.pop(world_size).close(graceful=False)
            raise
        if pool.threads() > MAX_WORKER_THREADS:
            self.pools.pop(world_size).close()
        return outputs

    def close(self):
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
