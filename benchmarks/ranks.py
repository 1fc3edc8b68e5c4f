"""One strategy on ``world`` forked CPU ranks, measured cell by cell (a cell is
a sequence length, or a (prompt length, batch) pair): the benchmarks' runner.

The parent has imported torch, transformers, DeepSpeed and ds_tsp once; it
forks the ranks, which meet through a file rendezvous on gloo and report
through a queue. Each rank builds the strategy once and measures the cells in
order. A rank that fails is reported as ``unsupported: <error>`` for that cell
(and the later ones, which are not tried), and the benchmark goes on.
"""

import os
import queue
import tempfile
import time
import traceback
from collections import defaultdict
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from measure import collective_bytes


def _error_line(exc):
    """The exception and where it was raised, on one line."""
    where = traceback.extract_tb(exc.__traceback__)[-1]
    what = " ".join(" ".join(traceback.format_exception_only(type(exc), exc)).split())
    return f"{what} (at {os.path.basename(where.filename)}:{where.lineno})"[:400]


def _worker(build, measure, cells, world, rank, rendezvous, args, results):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    collective_bytes.reset()
    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=args.collective_timeout))
        # deepspeed.comm joins the group now: Ulysses' group set-up asks it before deepspeed.initialize does.
        deepspeed.init_distributed(dist_backend="gloo")
        run = build(world, args)
    except Exception as exc:  # reported as unsupported for every cell; the run goes on
        _exit(results, (rank, "error", None, _error_line(exc)))
    for cell in cells:
        try:
            results.put((rank, "ok", cell, measure(run, cell, args)))
        except Exception as exc:
            _exit(results, (rank, "error", cell, _error_line(exc)))
    _exit(results, (rank, "done", None, None))


def _exit(results, message):
    """Send the last message and leave without tearing down DeepSpeed and gloo:
    their destructors can abort a rank whose peers are already gone."""
    results.put(message)
    # os._exit skips the queue's feeder thread: flush it first.
    results.close()
    results.join_thread()
    os._exit(0)


def run_on_ranks(build, measure, cells, world, args):
    """Fork ``world`` ranks; each runs ``run = build(world, args)`` then
    ``measure(run, cell, args)`` for every cell, within ``args.strategy_timeout``
    seconds in all.

    Returns ``{cell: [per-rank result] | "unsupported: <error>"}``.
    """
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ds_tsp_bench_") as tmp:
        procs = [ctx.Process(target=_worker, args=(build, measure, cells, world, r, os.path.join(tmp, "rdzv"), args,
                                                   results), daemon=True) for r in range(world)]
        for proc in procs:
            proc.start()
        per_cell = defaultdict(dict)
        errors, done = {}, set()
        deadline = time.monotonic() + args.strategy_timeout
        while len(done) < world:
            # After the first failure, the other ranks get a short grace to
            # report their own error, then they are ended.
            wait = min(10.0, deadline - time.monotonic()) if errors else deadline - time.monotonic()
            if wait <= 0:
                break
            try:
                rank, kind, cell, payload = results.get(timeout=wait)
            except queue.Empty:
                if errors or all(not p.is_alive() for p in procs):
                    break
                continue
            if kind == "ok":
                per_cell[cell][rank] = payload
            elif kind == "error":
                errors.setdefault(cell, payload)
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
    for cell in cells:
        if failure is None and cell in errors:
            failure = errors[cell]
        if failure is None and None in errors:
            failure = errors[None]
        ranks = per_cell.get(cell, {})
        if failure is None and len(ranks) == world:
            out[cell] = [ranks[r] for r in range(world)]
        else:
            out[cell] = f"unsupported: {failure or 'a peer rank failed'}"
    return out
