"""TSP against DeepSpeed's own parallelisms on CPU gloo ranks: peak memory,
bytes communicated and step time per rank, for one small Llama-shaped model.

    python benchmarks/compare.py                       # the committed run (benchmarks/results/compare.md)
    python benchmarks/compare.py --sizes 2 --seq-lens 64 128 --layers 1 --out /tmp/cmp   # a smoke run

Strategies, each trained for ``--warmup`` + ``--steps`` AdamW steps on the same
weights and the same sequence (fp32, micro-batch ``--batch``):

* ``single``: one process, no parallelism (DeepSpeed engine, ZeRO-0), the reference;
* ``tsp``: ``ds_tsp.initialize`` with ``tsp.size = D`` (ZeRO-0, DP = 1);
* ``autotp``: DeepSpeed AutoTP training, ``"tensor_parallel": {"autotp_size": D}``;
* ``ulysses``: DeepSpeed-Ulysses for HF models (``UlyssesSPAttentionHF``,
  ``sequence_parallel_size = D``), ZeRO-0;
* ``ulysses_zero3``: the same with ZeRO-3 over the same D ranks (ALST style);
* ``autotp_x_ulysses``: AutoTP 2 x Ulysses 2, only where D = 4.

Each strategy runs in its own process group: the parent imports torch,
transformers, DeepSpeed and ds_tsp once and forks D ranks per strategy, which
meet through a file rendezvous and report through a queue. One engine per
strategy trains through the sequence lengths in ascending order. A rank that
fails is reported as ``unsupported: <error>`` for that strategy and sequence
length (and the longer ones, which are not tried), and the run goes on.

Two settings keep the comparison like for like: ZeRO-3's buckets are sized
for this model (``zero3_buckets``), and Ulysses under ZeRO-0 scales its
backward by 1/D (``UlyssesRun``); the loss-diff column shows every strategy
applying the same updates as the single process.

What is measured, the same way for every strategy:

* peak live-tensor bytes: a ``TorchDispatchMode`` registers the storage of
  every tensor an op returns, and, on entry, every tensor the garbage
  collector can reach (parameters, their ``.grad``, optimizer state, ZeRO
  buffers); a weak reference per storage subtracts its bytes when it is freed.
  The peak of that sum over one full training step (forward, backward,
  optimizer: the last warm-up step) is what the tables call peak memory; its
  value on entry (a step boundary) is reported as the persistent state. Storages are counted once
  however many views share them. Buffers that collectives allocate inside C++
  are not seen; they are in the RSS figure;
* peak RSS: the kernel's high-water mark (``VmHWM``), reset through
  ``/proc/self/clear_refs`` before the timed steps of each length;
* bytes per rank per step: every ``torch.distributed`` collective and
  point-to-point function is wrapped, before DeepSpeed or ds_tsp are imported,
  in a shim that adds the bytes this rank sends and receives (the ring-algorithm
  convention of ``ds_tsp.comm``: all-reduce ``2(n-1)/n``, all-gather and
  reduce-scatter ``(n-1)`` per-rank slices, all-to-all ``(n-1)/n``, broadcast and
  reduce ``(n-1)`` at the root and one tensor elsewhere). Object collectives
  are counted through the tensor collectives they are built on. For TSP,
  ds_tsp's own counters are reported too, and compared with the DESIGN.md
  cost model;
* step time: median over the timed steps of forward + backward + optimizer
  step, ranks aligned by a barrier before each step.
"""

import argparse
import gc
import json
import os
import queue
import shlex
import statistics
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections import defaultdict
from datetime import timedelta
from functools import partial, wraps

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_map_only  # noqa: E402

STRATEGIES = ("single", "tsp", "autotp", "ulysses", "ulysses_zero3", "autotp_x_ulysses")
LABELS = {"single": "single process", "tsp": "TSP", "autotp": "AutoTP", "ulysses": "Ulysses",
          "ulysses_zero3": "Ulysses + ZeRO-3", "autotp_x_ulysses": "AutoTP x Ulysses"}
LR = 1e-3
IGNORE_INDEX = -100


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


# DeepSpeed and ds_tsp keep references to some of these functions from import
# time on (e.g. ds_tsp.comm's all-gather), so the shim goes in first.
install_comm_shim()

import deepspeed  # noqa: E402
import torch.distributed.nn.functional as dist_nn  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import ds_tsp  # noqa: E402
from ds_tsp import comm as tsp_comm  # noqa: E402
from ds_tsp.plan import tsp_bytes_per_layer  # noqa: E402


# --- peak memory: live tensor storages -----------------------------------------------------------------------------

class LiveTensorBytes(TorchDispatchMode):
    """Bytes of every live tensor storage in this process while the mode is on.

    ``state_bytes``: what was alive on entry; ``peak_bytes``: the most that was
    alive at once. A storage is counted once, however many tensors view it;
    its bytes leave the sum when the storage is freed (weak-reference callback)
    and follow it when it is resized.
    """

    def __init__(self):
        super().__init__()
        self._nbytes = {}
        self._refs = {}
        # Storages that a collective's worker thread releases are freed (and
        # their callbacks run) on that thread. Re-entrant: registering one
        # storage can free another on this thread.
        self._lock = threading.RLock()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.state_bytes = 0

    def __enter__(self):
        gc.collect()
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                self._track(obj)
                # .grad tensors made by autograd have no Python object until read.
                if obj.requires_grad and obj.grad is not None:
                    self._track(obj.grad)
        self.state_bytes = self.peak_bytes = self.live_bytes
        return super().__enter__()

    def __exit__(self, *exc):
        with self._lock:
            self._refs.clear()  # no callbacks once the measurement is over
        return super().__exit__(*exc)

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
                self._refs[key] = weakref.ref(storage, partial(self._freed, key))
                self._nbytes[key] = nbytes
                self.live_bytes += nbytes
            elif known != nbytes:
                self._nbytes[key] = nbytes
                self.live_bytes += nbytes - known
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _freed(self, key, _ref):
        with self._lock:
            self.live_bytes -= self._nbytes.pop(key, 0)
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


# --- the strategies ------------------------------------------------------------------------------------------------

def build_model(args):
    """The same weights on every rank of every strategy (seeded)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq_lens),
                         tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config).float()


def ds_config(args, zero_stage=0, **sections):
    # DeepSpeed's default gradient clipping (1.0) is kept for every strategy.
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30, **sections}


def zero3_buckets(args):
    """ZeRO-3 bucket sizes for this model, by the Hugging Face Trainer's "auto"
    rule. DeepSpeed's defaults are sized for billion-parameter models: its
    5e8-element reduce bucket alone is 1.9 GiB of fp32 per rank, which would
    swamp everything this benchmark measures."""
    hidden = args.hidden
    return {"reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


class FullSequenceRun:
    """Every rank gets the whole sequence: single process, TSP (the model takes
    its own tokens), AutoTP (every rank computes every token)."""

    def __init__(self, engine):
        self.engine = engine

    def step(self, input_ids):
        loss = self.engine(input_ids=input_ids, labels=input_ids).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()


class UlyssesRun:
    """Ulysses as ``UlyssesSPDataLoaderAdapter`` feeds it: rank ``r`` of the SP
    group gets the ``r``-th contiguous chunk of ``input_ids``, ``position_ids``
    and the labels shifted on the full sequence (``shift_labels``). Every rank
    here already holds the full micro-batch, so the chunks are cut locally
    instead of all-gathered from DP ranks. The loss is the ALST one: local
    mean losses weighted by their token counts, summed through a
    differentiable all-gather over the SP group.

    That loss sends every rank's backward D times its share (each of the D
    ranks holds the whole loss). DeepSpeed divides the D back out when it
    reduces gradients over the SP ranks with ZeRO-1/2/3, but its ZeRO-0 path
    divides by ``world / sequence_parallel_size`` (= 1 here) only, so with
    ZeRO-0 the gradients are D times too large and, through clipping, the
    training drifts from the single-process run (2e-2 in the loss within 15
    steps). ``backward_scale = 1/D`` under ZeRO-0 restores the same update;
    the loss-diff column checks it."""

    def __init__(self, engine, sp_group, backward_scale=1.0):
        self.engine, self.sp_group, self.backward_scale = engine, sp_group, backward_scale

    def step(self, input_ids):
        sp_size, sp_rank = dist.get_world_size(self.sp_group), dist.get_rank(self.sp_group)
        batch, seq_len = input_ids.shape
        shift_labels = F.pad(input_ids, (0, 1), value=IGNORE_INDEX)[:, 1:]
        positions = torch.arange(seq_len).expand(batch, seq_len)
        chunk = seq_len // sp_size
        own = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
        logits = self.engine(input_ids=input_ids[:, own], position_ids=positions[:, own]).logits
        labels = shift_labels[:, own]
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        good = (labels != IGNORE_INDEX).sum()
        losses = dist_nn.all_gather(loss, group=self.sp_group)
        goods = dist_nn.all_gather(good, group=self.sp_group)
        loss = sum(l * g for l, g in zip(losses, goods) if g > 0) / max(sum(goods), 1)
        self.engine.backward(loss * self.backward_scale)
        self.engine.step()
        return loss.item()


def register_ulysses(model, sp_size, args):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp_size,
        micro_batch_size=args.batch, seq_length_is_variable=True)


def build_run(strategy, world, args):
    model = build_model(args)
    if strategy == "single":
        engine, *_ = deepspeed.initialize(model=model, optimizer=adamw, config=ds_config(args))
        return FullSequenceRun(engine)
    if strategy == "tsp":
        tsp = {"enabled": True, "size": world, "attention_backend": "sdpa"}
        engine, *_ = ds_tsp.initialize(model=model, optimizer=adamw, config=ds_config(args, tsp=tsp))
        return FullSequenceRun(engine)
    if strategy == "autotp":
        config = ds_config(args, tensor_parallel={"autotp_size": world})
        engine, *_ = deepspeed.initialize(model=model, optimizer=adamw, config=config)
        return FullSequenceRun(engine)
    if strategy in ("ulysses", "ulysses_zero3"):
        mpu = register_ulysses(model, world, args)
        zero3 = strategy == "ulysses_zero3"
        config = ds_config(args, zero_stage=3 if zero3 else 0, sequence_parallel_size=world)
        if zero3:
            config["zero_optimization"].update(zero3_buckets(args))
        engine, *_ = deepspeed.initialize(model=model, optimizer=adamw, config=config, mpu=mpu)
        return UlyssesRun(engine, mpu.get_sequence_parallel_group(), backward_scale=1.0 if zero3 else 1 / world)
    if strategy == "autotp_x_ulysses":
        tp_size = sp_size = 2
        if world != tp_size * sp_size:
            raise ValueError(f"autotp_x_ulysses runs as AutoTP 2 x Ulysses 2 on 4 ranks, not {world}")
        mpu = register_ulysses(model, sp_size, args)
        config = ds_config(args, tensor_parallel={"autotp_size": tp_size}, sequence_parallel_size=sp_size)
        engine, *_ = deepspeed.initialize(model=model, optimizer=adamw, config=config, mpu=mpu)
        return UlyssesRun(engine, mpu.get_sequence_parallel_group(), backward_scale=1 / sp_size)
    raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")


# --- one sequence length, on one rank ------------------------------------------------------------------------------

def measure(run, seq_len, args):
    generator = torch.Generator().manual_seed(seq_len)
    input_ids = torch.randint(0, args.vocab, (args.batch, seq_len), generator=generator)
    losses = []
    # First step: builds optimizer state and runs one-off first-forward checks.
    for _ in range(max(args.warmup - 1, 0)):
        losses.append(run.step(input_ids))
    dist.barrier()
    with LiveTensorBytes() as live:
        losses.append(run.step(input_ids))
    dist.barrier()

    collective_bytes.reset()
    tsp_comm.counter.reset()
    rss_reset = reset_peak_rss()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        losses.append(run.step(input_ids))
        times.append(time.perf_counter() - start)
    ops = {name: count for name, count in collective_bytes.snapshot().items() if name != "barrier"}
    tsp_ops = {name: count for name, count in tsp_comm.counter.snapshot().items() if name != "barrier"}
    per_step = args.steps
    return {
        "peak_live_bytes": live.peak_bytes, "state_bytes": live.state_bytes,
        "peak_rss_bytes": peak_rss_bytes(), "rss_high_water_mark_reset": rss_reset,
        "step_s": statistics.median(times), "step_times_s": times,
        "sent_per_step": sum(c["sent"] for c in ops.values()) // per_step,
        "received_per_step": sum(c["received"] for c in ops.values()) // per_step,
        "by_op_per_step": {name: {k: v // per_step for k, v in c.items()} for name, c in sorted(ops.items())},
        "ds_tsp_received_per_step": sum(c["received"] for c in tsp_ops.values()) // per_step,
        "ds_tsp_by_op_per_step": {name: {k: v // per_step for k, v in c.items()}
                                  for name, c in sorted(tsp_ops.items())},
        "losses": losses,
    }


def _error_line(exc):
    """The exception and where it was raised, on one line."""
    where = traceback.extract_tb(exc.__traceback__)[-1]
    what = " ".join(" ".join(traceback.format_exception_only(type(exc), exc)).split())
    return f"{what} (at {os.path.basename(where.filename)}:{where.lineno})"[:400]


def _worker(strategy, world, rank, rendezvous, args, results):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    collective_bytes.reset()
    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=args.collective_timeout))
        # deepspeed.comm joins the group now: Ulysses' group set-up asks it before deepspeed.initialize does.
        deepspeed.init_distributed(dist_backend="gloo")
        run = build_run(strategy, world, args)
    except Exception as exc:  # reported as unsupported for every length; the run goes on
        _exit(results, (rank, "error", None, _error_line(exc)))
    for seq_len in args.seq_lens:
        try:
            results.put((rank, "ok", seq_len, measure(run, seq_len, args)))
        except Exception as exc:
            _exit(results, (rank, "error", seq_len, _error_line(exc)))
    _exit(results, (rank, "done", None, None))


def _exit(results, message):
    """Send the last message and leave without tearing down DeepSpeed and gloo:
    their destructors can abort a rank whose peers are already gone."""
    results.put(message)
    # os._exit skips the queue's feeder thread: flush it first.
    results.close()
    results.join_thread()
    os._exit(0)


def run_strategy(strategy, world, args):
    """Fork ``world`` ranks, collect per-rank results per sequence length.

    Returns ``{seq_len: [per-rank dict] | "unsupported: <error>"}``.
    """
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ds_tsp_compare_") as tmp:
        procs = [ctx.Process(target=_worker, args=(strategy, world, r, os.path.join(tmp, "rdzv"), args, results),
                             daemon=True) for r in range(world)]
        for proc in procs:
            proc.start()
        per_len = defaultdict(dict)
        errors, done = {}, set()
        deadline = time.monotonic() + args.strategy_timeout
        while len(done) < world:
            # After the first failure, the other ranks get a short grace to
            # report their own error, then they are ended.
            wait = min(10.0, deadline - time.monotonic()) if errors else deadline - time.monotonic()
            if wait <= 0:
                break
            try:
                rank, kind, seq_len, payload = results.get(timeout=wait)
            except queue.Empty:
                if errors or all(not p.is_alive() for p in procs):
                    break
                continue
            if kind == "ok":
                per_len[seq_len][rank] = payload
            elif kind == "error":
                errors.setdefault(seq_len, payload)
                done.add(rank)
            else:
                done.add(rank)
        for proc in procs:
            proc.join(timeout=1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    if len(done) < world and not errors:
        errors[None] = f"no answer within {args.strategy_timeout} s"
    out, failure = {}, None
    for seq_len in args.seq_lens:
        if failure is None and seq_len in errors:
            failure = errors[seq_len]
        if failure is None and None in errors:
            failure = errors[None]
        ranks = per_len.get(seq_len, {})
        if failure is None and len(ranks) == world:
            out[seq_len] = [ranks[r] for r in range(world)]
        else:
            out[seq_len] = f"unsupported: {failure or 'a peer rank failed'}"
    return out


# --- the TSP cost model --------------------------------------------------------------------------------------------

def tsp_planned_received(args, tsp_size, seq_len):
    """Bytes one TSP rank is planned to receive per training step.

    Blocks: ``ds_tsp.plan.tsp_bytes_per_layer`` (forward + backward) times the
    layers. Per layer, forward is DESIGN.md section 8's
    ``(D-1)/D * (Wa + Wm + 2 B S nkv d)`` elements; backward re-broadcasts the
    attention shards and re-gathers K/V (the forward again), reduces the shard
    gradients to their owners (``(D-1)/D * Wa``), reduce-scatters dK, dV
    (``(D-1)/D * 2 B S nkv d``) and moves the MLP's gradient accumulators round
    the ring (``(D-1)/D * Wm``): in fp32, three times the forward. Outside the
    blocks: the replicated parameters' gradients (embedding, LM head, norms) and
    the loss, each all-reduced over the TSP group once.
    """
    D, H, elem = tsp_size, args.hidden, 4
    model = {"hidden_size": H, "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
             "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "vocab_size": args.vocab,
             "tie_word_embeddings": False}
    per_layer = tsp_bytes_per_layer(model, seq_len, args.batch, D, elem, "both")
    replicated = 2 * args.vocab * H + H + 2 * args.layers * H
    outside = 2 * (D - 1) * replicated * elem // D + 2 * (D - 1) * elem // D
    return {"per_layer": per_layer, "blocks": args.layers * per_layer, "outside_blocks": outside,
            "total": args.layers * per_layer + outside}


# --- reports -------------------------------------------------------------------------------------------------------

# ds_tsp ops that run inside the decoder blocks; all_reduce is the replicated
# parameters' gradients and the loss.
TSP_BLOCK_OPS = ("broadcast", "all_gather", "reduce_scatter", "reduce", "ring")


def _mib(nbytes):
    return nbytes / 2**20


def strategies_for(world):
    names = ["tsp", "autotp", "ulysses", "ulysses_zero3"]
    if world == 4:
        names.append("autotp_x_ulysses")
    return names


def summarize(per_rank, reference_losses):
    """Max over ranks of each figure: the rank that sets what a job needs."""
    row = {
        "peak_live_mib": max(_mib(r["peak_live_bytes"]) for r in per_rank),
        "state_mib": max(_mib(r["state_bytes"]) for r in per_rank),
        "peak_rss_mib": max(_mib(r["peak_rss_bytes"]) for r in per_rank),
        "received_mib_per_step": max(_mib(r["received_per_step"]) for r in per_rank),
        "sent_mib_per_step": max(_mib(r["sent_per_step"]) for r in per_rank),
        "step_s": max(r["step_s"] for r in per_rank),
        "losses": per_rank[0]["losses"],
    }
    if reference_losses is not None:
        row["max_loss_diff_vs_single"] = max(abs(a - b) for a, b in zip(row["losses"], reference_losses))
    return row


def tsp_bytes_row(args, world, seq_len, per_rank):
    """Planned against measured bytes received per TSP rank per step."""
    row = tsp_planned_received(args, world, seq_len)
    if isinstance(per_rank, str):
        return row
    blocks = max(sum(count["received"] for op, count in r["ds_tsp_by_op_per_step"].items() if op in TSP_BLOCK_OPS)
                 for r in per_rank)
    total = max(r["ds_tsp_received_per_step"] for r in per_rank)
    row.update(measured_blocks=blocks, measured_total=total, blocks_ratio=blocks / row["blocks"],
               ratio=total / row["total"], measured_all_traffic=max(r["received_per_step"] for r in per_rank))
    return row


def tabulate(results, args):
    """``summaries[(strategy, D, seq_len)]``: a summary row or the
    ``unsupported: ...`` string; ``tsp_bytes[(D, seq_len)]``: the cost-model rows."""
    single = results["single"]
    summaries, tsp_bytes = {}, {}
    for world in args.sizes:
        for name in ["single"] + strategies_for(world):
            raw = single if name == "single" else results[(name, world)]
            for seq_len in args.seq_lens:
                value, ref = raw[seq_len], single[seq_len]
                ref_losses = None if name == "single" or isinstance(ref, str) else ref[0]["losses"]
                summaries[(name, world, seq_len)] = value if isinstance(value, str) else summarize(value, ref_losses)
        for seq_len in args.seq_lens:
            tsp_bytes[(world, seq_len)] = tsp_bytes_row(args, world, seq_len, results[("tsp", world)][seq_len])
    return summaries, tsp_bytes


def write_json(results, summaries, tsp_bytes, args, meta):
    for world in args.sizes:
        doc = {**meta, "tsp_size": world, "strategies": {}, "tsp_bytes": {}}
        for name in ["single"] + strategies_for(world):
            raw = results["single"] if name == "single" else results[(name, world)]
            doc["strategies"][name] = {"ranks": 1 if name == "single" else world, "results": {
                str(s): raw[s] if isinstance(raw[s], str) else {"summary": summaries[(name, world, s)],
                                                                "per_rank": raw[s]}
                for s in args.seq_lens}}
        doc["tsp_bytes"] = {str(s): tsp_bytes[(world, s)] for s in args.seq_lens}
        with open(os.path.join(args.out, f"compare_{world}.json"), "w") as f:
            json.dump(doc, f, indent=1)


def write_markdown(summaries, tsp_bytes, args, meta):
    model = meta["model"]
    lines = [f"Command: `{meta['command']}`", "",
             f"Whole run: {meta['elapsed_s']:.0f} s on {meta['cpu_count']} shared CPU cores (gloo, one thread per "
             f"rank), torch {meta['torch']}, DeepSpeed {meta['deepspeed']}. Model: Llama-shaped, hidden "
             f"{model['hidden']}, {model['layers']} layers, {model['heads']} heads, {model['kv_heads']} KV heads, "
             f"intermediate {model['intermediate']}, vocab {model['vocab']}, fp32, micro-batch {model['batch']}, "
             f"AdamW; {args.warmup} warm-up + {args.steps} timed steps per length, the same sequence for every "
             "strategy. Every figure is the max over ranks; how each is measured is in the docstring of "
             "`benchmarks/compare.py`.", "",
             "* peak memory: peak live tensor bytes over one whole training step; state: what is alive between "
             "steps (weights, gradients, optimizer state, DeepSpeed buffers);",
             "* comm: bytes received per rank per step, counted by one shim over `torch.distributed` for every "
             "strategy;",
             "* loss diff: max |loss - single-process loss| over all steps (same weights, same data): every "
             "strategy trains the same model.", "",
             "Reading the bytes: TSP's are a weight term that does not grow with S plus a K/V term linear in S "
             "(cost-model table below); AutoTP's are activation all-reduces, linear in S; Ulysses' are the "
             "gradient all-reduce (constant) plus all-to-alls linear in S. Step times are wall clock on CPU "
             "cores shared with other jobs, with D=4 ranks on fewer cores than ranks and gloo's own threads "
             "competing with them: read them as orders of magnitude, not as a GPU ranking. Peak RSS includes "
             "~400 MiB of libraries per process and the allocator's cache, so it separates the strategies less "
             "than the live-tensor peak does.", ""]
    for world in args.sizes:
        lines += [f"### D = {world}", "",
                  "| strategy | seq len | peak memory (MiB) | state (MiB) | peak RSS (MiB) | comm recv (MiB/step) "
                  "| step time (s) | loss diff |", "|---|---|---|---|---|---|---|---|"]
        for name in ["single"] + strategies_for(world):
            label = LABELS[name] + ("" if name == "single" else f" ({world})")
            for seq_len in args.seq_lens:
                row = summaries[(name, world, seq_len)]
                if isinstance(row, str):
                    lines.append(f"| {label} | {seq_len} | {row} | | | | | |")
                    continue
                diff = row.get("max_loss_diff_vs_single")
                lines.append(f"| {label} | {seq_len} | {row['peak_live_mib']:.1f} | {row['state_mib']:.1f} | "
                             f"{row['peak_rss_mib']:.0f} | {row['received_mib_per_step']:.2f} | {row['step_s']:.3f} | "
                             f"{'-' if diff is None else f'{diff:.1e}'} |")
        lines.append("")
    lines += ["### TSP bytes: measured against the cost model", "",
              "Received per rank per step, forward + backward. Planned blocks: `ds_tsp.plan.tsp_bytes_per_layer` "
              "(DESIGN.md section 8: per layer forward `(D-1)/D*(Wa+Wm+2*B*S*nkv*d)` elements; in fp32 forward + "
              "backward is 3 times that) times the layers. Planned total adds the "
              "all-reduce of the replicated parameters' gradients (embedding, LM head, norms) and of the loss. "
              "Measured: ds_tsp's own counters; the last column is everything the shim saw, DeepSpeed's own "
              "traffic included.", "",
              "| D | seq len | planned blocks (MiB) | measured blocks (MiB) | ratio | planned total (MiB) | "
              "measured total (MiB) | ratio | all traffic (MiB) |", "|---|---|---|---|---|---|---|---|---|"]
    for world in args.sizes:
        for seq_len in args.seq_lens:
            row = tsp_bytes[(world, seq_len)]
            if "measured_total" not in row:
                lines.append(f"| {world} | {seq_len} | {_mib(row['blocks']):.3f} | - | - | {_mib(row['total']):.3f} "
                             "| - | - | - |")
                continue
            lines.append(f"| {world} | {seq_len} | {_mib(row['blocks']):.3f} | {_mib(row['measured_blocks']):.3f} | "
                         f"{row['blocks_ratio']:.4f} | {_mib(row['total']):.3f} | {_mib(row['measured_total']):.3f} | "
                         f"{row['ratio']:.4f} | {_mib(row['measured_all_traffic']):.3f} |")
    lines += ["", "### Where TSP is not the lowest peak memory", ""]
    lines += tsp_not_lowest(summaries, args) or ["TSP has the lowest per-rank peak memory at every D and length."]
    lines += ["", "### Unsupported", ""]
    lines += unsupported_notes(summaries, args) or ["Every strategy ran at every D and length."]
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


# Why a strategy can come in under TSP on this small model; printed only for
# the strategies that do, under their measured breakdown.
BELOW_TSP_WHY = {
    "autotp": "AutoTP: it holds the same 1/D of the block weights as TSP but never moves them, while TSP keeps "
              "the next packed weight shard in flight in forward and a shard plus its travelling fp32 gradient "
              "accumulator in backward (about 2 (Wa+Wm)/D x 4 B per layer, a constant). Where the sequence is "
              "short, that outweighs the activations TSP saves over AutoTP (AutoTP replicates the activations "
              "between blocks; TSP shards all of them by D).",
    "ulysses_zero3": "Ulysses + ZeRO-3: ZeRO-3 partitions every parameter over the D ranks, the embedding and "
                     "LM head included, which TSP keeps replicated (DESIGN.md section 6; folding them is a later "
                     "step), and it shards the activations by D like TSP. With a vocabulary this small the "
                     "difference is a few MiB and shows only where activations are small.",
    "ulysses": "Ulysses (ZeRO-0): it replicates all weights, gradients and optimizer state, so it can only come "
               "in under TSP where TSP's shards in flight outweigh that replicated state.",
}

# Why a combination does not run; printed next to the error it raised.
UNSUPPORTED_WHY = {
    "autotp_x_ulysses": "Why: AutoTP builds its tensor-parallel groups from a (data, tensor) DeviceMesh, i.e. "
                        "from consecutive ranks {0,1}, {2,3}, and replaces the engine's mpu with them; Ulysses' "
                        "`parallel_state_sp` builds its sequence-parallel groups from consecutive ranks too. The "
                        "two land on the same pairs of ranks, so the two ranks of a TP group hold different "
                        "sequence chunks and AutoTP's first-forward check that a TP group sees the same data "
                        "refuses. DeepSpeed 0.19.8 has no way to lay them out orthogonally on one world "
                        "(`deepspeed.initialize(mesh_param=...)` knows only (data_parallel, sequence_parallel)). "
                        "Folding both onto one axis of D ranks is what TSP does instead.",
}


def tsp_not_lowest(summaries, args):
    notes, beaten_by = [], set()
    for world in args.sizes:
        for seq_len in args.seq_lens:
            tsp = summaries[("tsp", world, seq_len)]
            if isinstance(tsp, str):
                continue
            for name in strategies_for(world)[1:]:
                other = summaries[(name, world, seq_len)]
                if isinstance(other, str) or other["peak_live_mib"] >= tsp["peak_live_mib"]:
                    continue
                beaten_by.add(name)
                notes.append(
                    f"* D={world}, S={seq_len}: {LABELS[name]} {other['peak_live_mib']:.1f} MiB (state "
                    f"{other['state_mib']:.1f} + transient {other['peak_live_mib'] - other['state_mib']:.1f}) against "
                    f"TSP {tsp['peak_live_mib']:.1f} MiB (state {tsp['state_mib']:.1f} + transient "
                    f"{tsp['peak_live_mib'] - tsp['state_mib']:.1f}).")
    if not notes:
        return []
    return notes + ["", "Why:", ""] + [f"* {BELOW_TSP_WHY[name]}" for name in sorted(beaten_by)]


def unsupported_notes(summaries, args):
    notes = {}
    for (name, world, _), row in summaries.items():
        if isinstance(row, str):
            notes.setdefault((name, world), row)
    return [f"* {LABELS[name]} at D={world}: {error}" + (f" {UNSUPPORTED_WHY[name]}" if name in UNSUPPORTED_WHY else "")
            for (name, world), error in sorted(notes.items())]


def write_plots(summaries, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, ylabel, stem in (("peak_live_mib", "peak live tensor memory per rank (MiB)", "compare_memory"),
                              ("step_s", "median step time (s)", "compare_time")):
        fig, axes = plt.subplots(1, len(args.sizes), figsize=(6 * len(args.sizes), 4.5), squeeze=False)
        for ax, world in zip(axes[0], args.sizes):
            for name in ["single"] + strategies_for(world):
                points = [(s, summaries[(name, world, s)][key]) for s in args.seq_lens
                          if not isinstance(summaries[(name, world, s)], str)]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, marker="o", linestyle="--" if name == "single" else "-", label=LABELS[name],
                            linewidth=2.5 if name == "tsp" else 1.5)
            ax.set_xscale("log", base=2)
            ax.set_xticks(args.seq_lens, [str(s) for s in args.seq_lens])
            ax.set_xlabel("sequence length")
            ax.set_ylabel(ylabel)
            ax.set_title(f"D = {world} ranks")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"{stem}.png"), dpi=110)
        plt.close(fig)


# --- main ----------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4], help="ranks D per parallel strategy")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES[1:]), choices=STRATEGIES[1:])
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps; the last is the memory-tracked one")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--strategy-timeout", type=float, default=300, help="seconds for one strategy, all lengths")
    parser.add_argument("--collective-timeout", type=float, default=120, help="gloo timeout, so a dead peer fails")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    args.seq_lens = sorted(args.seq_lens)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the last warm-up step is the memory-tracked one")
    for world in args.sizes:
        if world < 2:
            parser.error("--sizes are parallel group sizes, 2 or more (the single process always runs)")
        for seq_len in args.seq_lens:
            if seq_len % (2 * world):
                parser.error(f"--seq-lens {seq_len} is not a multiple of 2*D = {2 * world}")
    return args


def main(argv=None):
    args = parse_args(argv)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("DS_ACCELERATOR", "OMP_NUM_THREADS"))
    command = f"{env} " + " ".join(shlex.quote(a) for a in ["python", os.path.relpath(__file__)] + sys.argv[1:])
    start = time.monotonic()
    results = {"single": run_strategy("single", 1, args)}
    print(f"[{time.monotonic() - start:.0f} s] single process done", flush=True)
    for world in args.sizes:
        for name in strategies_for(world):
            if name not in args.strategies:
                results[(name, world)] = {s: "unsupported: not run (--strategies)" for s in args.seq_lens}
                continue
            results[(name, world)] = run_strategy(name, world, args)
            status = {s: "ok" if not isinstance(v, str) else v[:100] for s, v in results[(name, world)].items()}
            print(f"[{time.monotonic() - start:.0f} s] {name} D={world}: {status}", flush=True)
    meta = {"command": command, "elapsed_s": time.monotonic() - start, "model": _model_card(args),
            "warmup": args.warmup, "timed_steps": args.steps, "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "cpu_count": os.cpu_count()}
    os.makedirs(args.out, exist_ok=True)
    summaries, tsp_bytes = tabulate(results, args)
    write_json(results, summaries, tsp_bytes, args, meta)
    write_markdown(summaries, tsp_bytes, args, meta)
    write_plots(summaries, args)
    print(open(os.path.join(args.out, "compare.md")).read())


def _model_card(args):
    return {"arch": "LlamaForCausalLM", "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
            "kv_heads": args.kv_heads, "intermediate": args.intermediate, "vocab": args.vocab, "batch": args.batch,
            "dtype": "float32", "optimizer": f"torch.optim.AdamW(lr={LR})"}


if __name__ == "__main__":
    main()
