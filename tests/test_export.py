"""``ds-tsp export``: a bf16 DeepSpeed checkpoint of a TSP run -> Hugging Face, in
the model's dtype or as the ZeRO optimizer's float32 master weights, read with
``torch.load(weights_only=True)``."""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import ds_tsp
from ds_tsp.cli import main
from models import tiny_model

MICRO_BATCH = 2
SEQ_LEN = 16


def _train_bf16_and_save(model_dir, checkpoint_dir, zero_stage):
    """TSP 2 x DP 2, bf16 with ZeRO: Adam steps leave float32 master weights that
    bf16 rounds."""
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "zero_optimization": {"stage": zero_stage},
              "bf16": {"enabled": True}, "tsp": {"enabled": True, "size": 2, "attention_backend": "sdpa"}}
    engine, *_ = ds_tsp.initialize(model=model_dir, config=config,
                                   optimizer=lambda params: torch.optim.Adam(params, lr=1e-2))
    generator = torch.Generator().manual_seed(2)
    for _ in range(2):
        ids = torch.randint(0, 61, (2 * MICRO_BATCH, SEQ_LEN), generator=generator)
        mine = ids.view(2, MICRO_BATCH, SEQ_LEN)[engine.tsp_topology.dp_rank]
        engine.backward(engine(input_ids=mine, labels=mine).loss)
        engine.step()
    engine.save_checkpoint(checkpoint_dir)
    # Under ZeRO-3 too: each block gathered over the data-parallel replicas, then over TSP.
    ds_tsp.save_pretrained(engine, os.path.join(checkpoint_dir, "hf"))


@pytest.fixture(scope="module")
def bf16_checkpoints(rank_pools, tmp_path_factory):
    """``{zero stage: DeepSpeed checkpoint dir}`` and the Hugging Face dir they started from."""
    root = tmp_path_factory.mktemp("export")
    model_dir = str(root / "hf")
    tiny_model("llama", dtype=torch.float32).save_pretrained(model_dir)
    checkpoints = {}
    for stage in (1, 3):
        checkpoints[stage] = str(root / f"zero{stage}")
        rank_pools.run(4, _train_bf16_and_save, model_dir=model_dir, checkpoint_dir=checkpoints[stage],
                       zero_stage=stage)
    return model_dir, checkpoints


def _export(model_dir, checkpoint, out, *flags):
    assert main(["export", "--checkpoint", checkpoint, "--model", model_dir, "--out", out, *flags]) == 0
    return load_file(os.path.join(out, "model.safetensors"))


def test_fp32_master_weights_are_what_bf16_rounds(bf16_checkpoints, tmp_path):
    model_dir, checkpoints = bf16_checkpoints
    weights = _export(model_dir, checkpoints[1], str(tmp_path / "bf16"))
    master = _export(model_dir, checkpoints[1], str(tmp_path / "fp32"), "--fp32-master")
    original = load_file(os.path.join(model_dir, "model.safetensors"))
    assert weights.keys() == master.keys() == original.keys()
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert {t.dtype for t in master.values()} == {torch.float32}
    # The model's weights are exactly the master's, rounded to bf16 after the last step ...
    assert all(torch.equal(master[n].to(torch.bfloat16), weights[n]) for n in master)
    # ... and the master keeps what bf16 loses, in every tensor (the check could fail).
    differs = [n for n in master if not torch.equal(master[n], weights[n].float())]
    print(f"master differs from the bf16 weights in {len(differs)} of {len(master)} tensors")
    assert len(differs) == len(master)
    assert not any(torch.equal(master[n], original[n]) for n in master), "training changed nothing?"


def test_zero3_is_exported_from_its_master_weights(bf16_checkpoints, tmp_path, capsys):
    """ZeRO-3 keeps no weights in its model files; its master weights are those of the
    same run under ZeRO-1 (same data, same float32 Adam updates)."""
    model_dir, checkpoints = bf16_checkpoints
    assert main(["export", "--checkpoint", checkpoints[3], "--model", model_dir, "--out",
                 str(tmp_path / "refused")]) == 1
    err = capsys.readouterr().err
    assert "is a ZeRO-3 checkpoint" in err and "--fp32-master" in err
    zero3 = _export(model_dir, checkpoints[3], str(tmp_path / "zero3"), "--fp32-master")
    zero1 = _export(model_dir, checkpoints[1], str(tmp_path / "zero1"), "--fp32-master")
    assert zero3.keys() == zero1.keys()
    rel = {n: ((zero3[n] - zero1[n]).abs().max() / zero1[n].abs().max()).item() for n in zero1}
    replicated = {n for n in rel if "norm" in n}
    worst_sharded = max(v for n, v in rel.items() if n not in replicated)
    worst_replicated = max(rel[n] for n in replicated)
    print(f"ZeRO-3 vs ZeRO-1 master weights: max rel {worst_sharded:.2e} sharded, {worst_replicated:.2e} norms")
    # ZeRO-3 reduce-scatters gradients where ZeRO-1 all-reduces them: float32 sums in another order. This is not a
    # float64-control bound (tests/float32_control.py): both sides are the same bf16 run, of which no float64 run is
    # the truth. What they share (each rank's bf16 forward and backward) cancels; what differs is elementwise: with
    # DP = 2 each data-parallel sum is one correctly rounded float32 addition and the halving is exact, and Adam's
    # update is elementwise IEEE arithmetic, so neither depends on the CPU's vector width, BLAS path or threads.
    # 1e-6 is about 17 unit roundoffs (2**-24) of each tensor's largest weight over the two steps.
    assert worst_sharded <= 1e-6
    # The norms' gradients are summed over the TSP group after ZeRO-3's bf16 data-parallel mean and before
    # ZeRO-1's, so they round differently in bf16 (1.1e-4 after the two Adam steps); their bf16 weights, which an
    # export that missed the master would read, are 3.3e-3 off.
    assert worst_replicated <= 5e-4


def test_fp32_master_needs_zero_optimizer_files(bf16_checkpoints, tmp_path, capsys):
    model_dir, checkpoints = bf16_checkpoints
    stripped = str(tmp_path / "stripped")
    shutil.copytree(checkpoints[1], stripped, ignore=shutil.ignore_patterns("*optim_states.pt"))
    assert main(["export", "--checkpoint", stripped, "--model", model_dir, "--out", str(tmp_path / "out"),
                 "--fp32-master"]) == 1
    assert "no ZeRO optimizer files for TSP rank 0" in capsys.readouterr().err


class _Payload:
    """Unpickling this runs ``os.makedirs(path)``: the code a hostile checkpoint would run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path,)


def test_export_never_runs_pickled_code(bf16_checkpoints, tmp_path, capsys):
    model_dir, checkpoints = bf16_checkpoints
    hostile, marker = str(tmp_path / "hostile"), str(tmp_path / "payload_ran")
    shutil.copytree(checkpoints[1], hostile)
    with open(os.path.join(hostile, "latest")) as f:
        folder = os.path.join(hostile, f.read().strip())
    state = torch.load(os.path.join(folder, "mp_rank_01_model_states.pt"), weights_only=True)
    state["payload"] = _Payload(marker)
    torch.save(state, os.path.join(folder, "mp_rank_01_model_states.pt"))
    assert main(["export", "--checkpoint", hostile, "--model", model_dir, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "mp_rank_01_model_states.pt holds objects that torch.load(weights_only=True) refuses" in err
    assert not os.path.exists(marker)


@pytest.mark.parametrize("stage", [1, 3])
def test_save_pretrained_writes_the_bf16_weights_of_every_zero_stage(bf16_checkpoints, tmp_path, stage):
    """What the engine's save_pretrained writes is its bf16 weights: the float32
    master of the DeepSpeed checkpoint saved beside it, rounded."""
    model_dir, checkpoints = bf16_checkpoints
    saved_dir = os.path.join(checkpoints[stage], "hf")
    assert sorted(os.listdir(saved_dir)) == ["config.json", "generation_config.json", "model.safetensors"]
    saved = load_file(os.path.join(saved_dir, "model.safetensors"))
    master = _export(model_dir, checkpoints[stage], str(tmp_path / "fp32"), "--fp32-master")
    assert saved.keys() == master.keys()
    assert all(torch.equal(master[n].to(torch.bfloat16), saved[n]) for n in master)
