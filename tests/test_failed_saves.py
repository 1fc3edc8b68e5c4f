"""Saves that fail, fail on every rank at once: a full disk (a small tmpfs
mounted here) under ``ds_tsp.save_pretrained`` and ``engine.save_checkpoint``
at TSP 2, and the Trainer's checkpoints, raises on every rank within seconds,
naming the file system and the cause, and the checkpoint already there stays
whole and loadable (a resume from DeepSpeed's ``latest`` is exact). A write
that fails on one rank only raises the same error on both."""

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import ds_tsp
from ds_tsp.checkpoint.staging import SaveError, SharedSave, leftovers
from ds_tsp.config import TSPConfig
from ds_tsp.parallel import comm
from ds_tsp.parallel.topology import TSPTopology
from models import tiny_model
from test_checkpoint import assert_same_tensors

# "Within seconds": the ranks must not wait for the process group's timeout (30 minutes by default).
RAISED_WITHIN_S = 10
PAGE = 4096


@contextlib.contextmanager
def small_disk(path):
    """A tmpfs mounted at ``path`` while the body runs, unmounted after;
    skips where mounting is not permitted (not root)."""
    os.makedirs(path)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a full disk is a tmpfs mounted by the test, which needs root (mount -t tmpfs)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


def shrink(disk):
    """Leave the tmpfs ``disk`` room for half as much again as it holds: what
    it holds fits once more only in part. Returns its new size in bytes."""
    used = shutil.disk_usage(disk).used
    size = (used + used // 2) // PAGE * PAGE
    subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True, capture_output=True)
    return size


def _save_over_a_full_disk(target):
    """``save_pretrained`` of other weights over ``target``: how long until it
    raised, and what."""
    model = ds_tsp.inject(tiny_model("llama", seed=1), TSPTopology(2), TSPConfig(enabled=True, size=2))
    start = time.monotonic()
    try:
        ds_tsp.save_pretrained(model, target, max_shard_size="4KB", overwrite=True)
    except SaveError as error:
        return time.monotonic() - start, str(error)
    return time.monotonic() - start, None


def test_a_full_disk_fails_save_pretrained_on_every_rank(run_ranks, tmp_path):
    disk = tmp_path / "disk"
    target = disk / "model"
    with small_disk(disk):
        old = tiny_model("llama", seed=0)
        old.save_pretrained(target, max_shard_size="4KB")
        (target / "tokenizer.json").write_text("{}")
        before = {name: (target / name).read_bytes() for name in os.listdir(target)}
        size = shrink(disk)

        results = run_ranks(2, _save_over_a_full_disk, timeout_s=60, target=str(target))
        for rank, (elapsed, message) in enumerate(results):
            print(f"rank {rank} raised after {elapsed:.2f} s ({size:,} B tmpfs): {message}")
            assert message is not None and elapsed < RAISED_WITHIN_S
            assert "No space left on device" in message and f"file system at {disk} is full" in message
            assert f"{target} is as it was before the save" in message
        assert results[0][1] == results[1][1]  # the same error on every rank

        assert {name: (target / name).read_bytes() for name in os.listdir(target)} == before
        assert leftovers(target) == []
        loaded = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).state_dict()
        assert_same_tensors(loaded, old.state_dict())
        # The save that failed held other weights: an old checkpoint it had half replaced would show.
        new = tiny_model("llama", seed=1).state_dict()
        assert all(not torch.equal(new[name], tensor) for name, tensor in loaded.items())


def _resume_after_a_full_disk(save_dir, disk):
    """Train, save tag step1, fill the disk (rank 0 shrinks it), train, fail to
    save step2 on every rank; then a fresh engine resumes from ``latest``."""
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
              "tsp": {"enabled": True, "size": 2, "attention_backend": "sdpa"}}

    def fresh_engine():
        engine, *_ = ds_tsp.initialize(model=tiny_model("llama", dtype=torch.float32),
                                       optimizer=lambda params: torch.optim.Adam(params, lr=1e-2), config=config)
        return engine

    def step(engine, batch):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    generator = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 61, (2, 16), generator=generator) for _ in range(3)]
    engine = fresh_engine()
    step(engine, batches[0])
    engine.save_checkpoint(save_dir, tag="step1")
    size = shrink(disk) if dist.get_rank() == 0 else None
    dist.barrier()
    losses = [step(engine, batches[1])]
    start = time.monotonic()
    message = None
    try:
        engine.save_checkpoint(save_dir, tag="step2")
    except SaveError as error:
        message = str(error)
    elapsed = time.monotonic() - start
    losses.append(step(engine, batches[2]))  # the engine trains on after a failed save

    resumed = fresh_engine()
    resumed.load_checkpoint(save_dir)
    return dict(elapsed=elapsed, message=message, size=size, losses=losses,
                resumed=[step(resumed, batch) for batch in batches[1:]])


def test_a_full_disk_fails_a_deepspeed_tag_on_every_rank_and_latest_resumes(run_ranks, tmp_path):
    disk = tmp_path / "disk"
    save_dir = disk / "checkpoints"
    with small_disk(disk):
        results = run_ranks(2, _resume_after_a_full_disk, timeout_s=90, save_dir=str(save_dir), disk=str(disk))
        for rank, out in enumerate(results):
            print(f"rank {rank} raised after {out['elapsed']:.2f} s: {out['message']}; losses {out['losses']}, "
                  f"resumed from latest {out['resumed']}")
            assert out["message"] is not None and out["elapsed"] < RAISED_WITHIN_S
            assert str(save_dir / "step2") in out["message"] and f"file system at {disk} is full" in out["message"]
            assert "latest still names 'step1'" in out["message"]
            assert out["resumed"] == out["losses"]
        print(f"tmpfs of {results[0]['size']:,} B")
        assert (save_dir / "latest").read_text() == "step1"
        assert sorted(name for name in os.listdir(save_dir) if "step" in name) == ["step1"]


def _held_and_agreed(failing_rank):
    """A write that fails on ``failing_rank`` only (none where -1), then the
    agreement: what each rank raised, and the all-reduce bytes it sent."""
    save = SharedSave("a save")
    if dist.get_rank() == failing_rank:
        save.write("/nowhere/file", open, "/nowhere/file", "w")
    before = comm.counter.snapshot().get("all_reduce", {}).get("sent", 0)
    message = errno_ = None
    try:
        save.agree("kept")
    except SaveError as error:
        message, errno_ = str(error), error.errno
    return message, errno_, comm.counter.snapshot()["all_reduce"]["sent"] - before


def test_one_rank_failing_raises_on_every_rank(run_ranks):
    for failing_rank in (0, 1):
        for message, errno_, sent in run_ranks(2, _held_and_agreed, timeout_s=30, failing_rank=failing_rank):
            assert message.startswith(f"a save failed: rank {failing_rank} could not write /nowhere/file: "
                                      "FileNotFoundError: [Errno 2] No such file or directory: '/nowhere/file'; "
                                      "the file system at / has ")
            assert message.endswith(" bytes free. kept")
            assert errno_ == 2
            assert sent == 4  # the agreement: one int32 all-reduced over 2 ranks, 2 (D-1) n / D bytes


def test_a_save_where_nothing_failed_costs_one_small_all_reduce(run_ranks):
    assert run_ranks(2, _held_and_agreed, timeout_s=30, failing_rank=-1) == [(None, None, 4)] * 2


def _files(folder):
    """Every file under ``folder`` and its bytes."""
    return {path.relative_to(folder): path.read_bytes() for path in Path(folder).rglob("*") if path.is_file()}


def _trainer_on_a_full_disk(output_dir, disk):
    """A TSPTrainer saving checkpoint-1, then (rank 0 shrinks the disk) checkpoint-2."""
    from accelerate.state import AcceleratorState
    from transformers import TrainerCallback

    from ds_tsp.runtime.trainer import configure_cpu_ranks
    from test_trainer import _arguments, _deepspeed_config, _rows

    class FillTheDiskAfterCheckpoint1(TrainerCallback):
        before, start = None, None

        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 1 and dist.get_rank() == 0:
                self.before = _files(os.path.join(output_dir, "checkpoint-1"))
                shrink(disk)
            dist.barrier()

        def on_step_end(self, args, state, control, **kwargs):
            self.start = time.monotonic()

    try:
        configure_cpu_ranks()
        args = _arguments(output_dir, 2, _deepspeed_config(2))
        args.max_steps, args.save_steps = 2, 1
        callback = FillTheDiskAfterCheckpoint1()
        trainer = ds_tsp.TSPTrainer(model=tiny_model("qwen2", dtype=torch.float32), args=args,
                                    train_dataset=_rows(8, 1), callbacks=[callback])
        try:
            trainer.train()
        except SaveError as error:
            return time.monotonic() - callback.start, str(error), callback.before
        return None, None, callback.before
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_a_full_disk_fails_the_trainers_checkpoint_on_every_rank(run_ranks, tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    disk = tmp_path / "disk"
    output_dir = disk / "out"
    with small_disk(disk):
        results = run_ranks(2, _trainer_on_a_full_disk, timeout_s=90, output_dir=str(output_dir), disk=str(disk))
        for rank, (elapsed, message, _) in enumerate(results):
            print(f"rank {rank} raised {elapsed:.2f} s after step 2: {message}")
            assert message is not None and elapsed < RAISED_WITHIN_S
            assert f"file system at {disk} is full" in message
            assert message.endswith(f"{output_dir / 'checkpoint-2'} was removed")
        assert get_last_checkpoint(output_dir) == str(output_dir / "checkpoint-1")
        assert _files(output_dir / "checkpoint-1") == results[0][2]
        assert (output_dir / "checkpoint-1" / "latest").read_text() == "global_step1"
