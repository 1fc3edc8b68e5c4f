"""The Hugging Face Trainer with TSP (``ds_tsp.TSPTrainer``) against one process's stock Trainer.

Tiny Qwen2 (q/k/v biases, so each packed attention shard mixes decayed weights
and undecayed biases), float32, AdamW with weight decay, a linear schedule
with warm-up, gradient accumulation 2, 6 steps, rows of 3 to 16 real tokens
(right padding), ZeRO-1. One rank-pool call per mesh trains, evaluates,
saves, resumes from the step-3 checkpoint and reports what each rank saw; the
stock Trainer runs once per mesh in the test process on the same global batches.
"""

import copy
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import ds_tsp
from ds_tsp.cli import main
from float32_control import float32_bound
from models import chat_tokenizer, tiny_model
from scripts import run_as_launched

SEQ_LEN = 16
MICRO_BATCH = 2  # per data-parallel replica
ACCUMULATION = 2
STEPS = 6
EVAL_ROWS = 8  # a multiple of MICRO_BATCH * dp: no padding samples in the last eval batch
# float32 results are measured against the same computation in float64 and bounded by float32_bound of the
# one-process float32 control's distance to it, on this machine (tests/float32_control.py).


def _rows(count, seed):
    """Right-padded rows of 3 to 16 real tokens; padding is never a target."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(3, SEQ_LEN + 1, (1,), generator=generator))
        input_ids = torch.randint(3, 61, (SEQ_LEN,), generator=generator)
        mask = (torch.arange(SEQ_LEN) < length).long()
        rows.append({"input_ids": input_ids * mask, "attention_mask": mask,
                     "labels": input_ids.masked_fill(mask == 0, -100)})
    return rows


def _arguments(output_dir, per_device_batch, deepspeed=None):
    """The same arguments for both runs; ``per_device_batch`` is the global batch
    for one process. Evaluation batches too: the Trainer's eval loss of a step is
    the mean over the tokens of all replicas' batches (``num_items_in_batch``)."""
    # DeepSpeed on CPU ranks: accelerate's state is configured by ds_tsp.runtime.trainer.configure_cpu_ranks.
    configured = {"accelerator_config": {"use_configured_state": True}} if deepspeed else {}
    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=per_device_batch,
        per_device_eval_batch_size=per_device_batch, gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS,
        learning_rate=3e-2, weight_decay=0.5, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1,
        save_strategy="steps", save_steps=3, report_to=[], seed=0, disable_tqdm=True,
        include_num_input_tokens_seen="non_padding", deepspeed=deepspeed, **configured)


def _deepspeed_config(tsp_size, zero_stage=1):
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "zero_optimization": {"stage": zero_stage},
            "tsp": {"enabled": True, "size": tsp_size, "attention_backend": "sdpa"}}


def _losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _learning_rates(trainer):
    return [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]


def _tsp_run(tsp_size, output_dir):
    """On every rank: train, evaluate, save, resume from checkpoint-3."""
    from accelerate.state import AcceleratorState

    from ds_tsp.runtime.trainer import configure_cpu_ranks

    try:
        configure_cpu_ranks()
        dp_size = dist.get_world_size() // tsp_size
        train, evaluation = _rows(STEPS * ACCUMULATION * MICRO_BATCH * dp_size, 1), _rows(EVAL_ROWS, 2)
        trainer = ds_tsp.TSPTrainer(model=tiny_model("qwen2", dtype=torch.float32),
                                    args=_arguments(output_dir, MICRO_BATCH, _deepspeed_config(tsp_size)),
                                    train_dataset=train, eval_dataset=evaluation)
        first_batches = [batch["input_ids"] for _, batch in zip(range(2), trainer.get_train_dataloader())]
        trainer.train()
        out = dict(losses=_losses(trainer), learning_rates=_learning_rates(trainer),
                   eval_loss=trainer.evaluate()["eval_loss"], tokens=trainer.state.num_input_tokens_seen,
                   max_steps=trainer.state.max_steps, total_batch=trainer.get_total_train_batch_size(trainer.args),
                   first_batches=first_batches, topology=(trainer.tsp_topology.dp_rank, trainer.tsp_topology.tsp_rank))
        trainer.save_model(os.path.join(output_dir, "final"))

        configure_cpu_ranks()
        resumed = ds_tsp.TSPTrainer(model=tiny_model("qwen2", dtype=torch.float32),
                                    args=_arguments(output_dir + "-resumed", MICRO_BATCH, _deepspeed_config(tsp_size)),
                                    train_dataset=train, eval_dataset=evaluation)
        resumed.train(resume_from_checkpoint=os.path.join(output_dir, "checkpoint-3"))
        out["resumed_losses"] = _losses(resumed)[3:]  # the state read from checkpoint-3 logged steps 1-3
        if dp_size > 1:  # once more on one TSP group of every rank: the checkpoint is resharded on the way
            configure_cpu_ranks()
            moved = ds_tsp.TSPTrainer(model=tiny_model("qwen2", dtype=torch.float32),
                                      args=_arguments(output_dir + "-moved", MICRO_BATCH * dp_size,
                                                      _deepspeed_config(tsp_size * dp_size)),
                                      train_dataset=train, eval_dataset=evaluation)
            moved.train(resume_from_checkpoint=os.path.join(output_dir, "checkpoint-3"))
            out["moved_losses"] = _losses(moved)[3:]
        return out
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _stock_run(dp_size, output_dir, dtype=torch.float32):
    train, evaluation = _rows(STEPS * ACCUMULATION * MICRO_BATCH * dp_size, 1), _rows(EVAL_ROWS, 2)
    # float64: the float32 model's initial weights, widened (tiny_model draws other ones in float64).
    trainer = Trainer(model=tiny_model("qwen2", dtype=torch.float32).to(dtype),
                      args=_arguments(output_dir, MICRO_BATCH * dp_size), train_dataset=train,
                      eval_dataset=evaluation)
    first_batches = [batch["input_ids"] for _, batch in zip(range(2), trainer.get_train_dataloader())]
    trainer.train()
    return dict(losses=_losses(trainer), learning_rates=_learning_rates(trainer),
                eval_loss=trainer.evaluate()["eval_loss"], tokens=trainer.state.num_input_tokens_seen,
                max_steps=trainer.state.max_steps, total_batch=trainer.get_total_train_batch_size(trainer.args),
                first_batches=first_batches, model=trainer.model)


def _relative(values, expected):
    values, expected = torch.as_tensor(values, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((values - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("world, tsp_size", [(2, 2), (4, 2)])
def test_trainer_matches_one_process(run_ranks, tmp_path, world, tsp_size):
    dp_size = world // tsp_size
    per_rank = run_ranks(world, _tsp_run, tsp_size=tsp_size, output_dir=str(tmp_path / "tsp"), timeout_s=400)
    stock = _stock_run(dp_size, str(tmp_path / "stock"))
    # The float32 runs' truth is the same training in float64; the stock float32 Trainer on one process is the
    # control that says how far this machine's float32 rounding carries this computation (tests/float32_control.py).
    truth = _stock_run(dp_size, str(tmp_path / "truth"), dtype=torch.float64)
    tsp = per_rank[0]
    print(f"TSP={tsp_size} DP={dp_size}: losses {[round(v, 6) for v in tsp['losses']]}, stock "
          f"{[round(v, 6) for v in stock['losses']]}; eval {tsp['eval_loss']:.6f} vs {stock['eval_loss']:.6f}; "
          f"tokens {tsp['tokens']} vs {stock['tokens']}; resumed steps 4-6 {tsp['resumed_losses']}; max rel "
          f"|dloss| {_relative(tsp['losses'], stock['losses']):.1e}, "
          f"eval {_relative(tsp['eval_loss'], stock['eval_loss']):.1e}")

    # save_model wrote an ordinary Hugging Face directory: the final weights and logits, against float64.
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tsp" / "final")
    exact = dict(truth["model"].named_parameters())
    worst = max(_relative(p.detach(), exact[n].detach()) for n, p in reloaded.named_parameters())
    worst_control = max(_relative(p.detach(), exact[n].detach()) for n, p in stock["model"].named_parameters())
    batch = torch.stack([row["input_ids"] for row in _rows(2, 3)])
    with torch.no_grad():
        exact_logits = truth["model"](input_ids=batch).logits
        logits_error = _relative(reloaded(input_ids=batch).logits, exact_logits)
        logits_control = _relative(stock["model"](input_ids=batch).logits, exact_logits)
    weights_bound, logits_bound = float32_bound([worst_control]), float32_bound([logits_control])
    print(f"  reloaded weights max rel |dw| against float64 {worst:.1e}, the float32 control's {worst_control:.1e} "
          f"(bound {weights_bound:.1e}); logits {logits_error:.1e}, the control's {logits_control:.1e} (bound "
          f"{logits_bound:.1e})")
    assert worst <= weights_bound and logits_error <= logits_bound
    # The check can fail: the weights moved far more than the bound.
    start = dict(tiny_model("qwen2", dtype=torch.float32).named_parameters())
    assert max(_relative(p.detach(), start[n].detach()) for n, p in reloaded.named_parameters()) > 1e3 * weights_bound

    # Every rank of a TSP group gets the same micro-batches; the replicas share the global batch.
    for rank, out in enumerate(per_rank):
        assert out["topology"] == (rank // tsp_size, rank % tsp_size)
        group_first = per_rank[rank - rank % tsp_size]
        assert all(torch.equal(a, b) for a, b in zip(out["first_batches"], group_first["first_batches"]))
    for step, global_batch in enumerate(stock["first_batches"]):
        replicas = torch.cat([per_rank[dp * tsp_size]["first_batches"][step] for dp in range(dp_size)])
        assert torch.equal(replicas, global_batch)

    # Batch size, steps and schedule count data-parallel replicas, not ranks.
    assert tsp["total_batch"] == stock["total_batch"] == MICRO_BATCH * ACCUMULATION * dp_size
    assert tsp["max_steps"] == stock["max_steps"] == STEPS
    assert tsp["learning_rates"] == pytest.approx(stock["learning_rates"], rel=1e-12)
    # The loss: the mean over all real tokens of each step, logged once per step.
    assert len(tsp["losses"]) == STEPS
    losses, losses_control = _relative(tsp["losses"], truth["losses"]), _relative(stock["losses"], truth["losses"])
    evaluated, evaluated_control = (_relative(tsp["eval_loss"], truth["eval_loss"]),
                                    _relative(stock["eval_loss"], truth["eval_loss"]))
    print(f"  against float64: losses {losses:.1e}, the control's {losses_control:.1e} (bound "
          f"{float32_bound([losses_control]):.1e}); eval {evaluated:.1e}, the control's {evaluated_control:.1e} "
          f"(bound {float32_bound([evaluated_control]):.1e})")
    assert losses <= float32_bound([losses_control])
    assert evaluated <= float32_bound([evaluated_control])
    # Every token counted once, not once per TSP rank.
    assert tsp["tokens"] == stock["tokens"]
    # Resuming from the step-3 checkpoint reproduces steps 4-6, at the same layout or at TSP 4.
    assert tsp["resumed_losses"] == pytest.approx(tsp["losses"][3:], rel=1e-6)
    if dp_size > 1:
        print(f"  resumed at TSP={tsp_size * dp_size} DP=1: steps 4-6 {tsp['moved_losses']}")
        assert tsp["moved_losses"] == pytest.approx(tsp["losses"][3:], rel=1e-6)


def _accuracy(prediction):
    """The next-token accuracy over real targets (prediction t against label t+1), as users compute it."""
    predicted, labels = torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids)
    predicted = predicted.argmax(-1) if predicted.is_floating_point() else predicted  # full logits: argmax here
    real = labels[:, 1:] != -100
    return {"accuracy": (predicted[:, :-1] == labels[:, 1:])[real].double().mean().item()}


def _prediction_args(output_dir, deepspeed=None):
    configured = {"accelerator_config": {"use_configured_state": True}} if deepspeed else {}
    return TrainingArguments(output_dir=output_dir, per_device_eval_batch_size=MICRO_BATCH, report_to=[],
                             disable_tqdm=True, deepspeed=deepspeed, **configured)


def _tsp_predictions(output_dir):
    """On every rank: predict() and evaluate() with the argmax ids and with full logits."""
    from accelerate.state import AcceleratorState

    from ds_tsp.runtime.trainer import configure_cpu_ranks

    out = {}
    try:
        for name, preprocess in (("argmax", ds_tsp.argmax_token_ids), ("logits", None)):
            configure_cpu_ranks()
            trainer = ds_tsp.TSPTrainer(model=tiny_model("qwen2", dtype=torch.float32),
                                        # Evaluation before any training: ZeRO-3, as Hugging Face asks.
                                        args=_prediction_args(output_dir, _deepspeed_config(dist.get_world_size(), 3)),
                                        eval_dataset=_rows(EVAL_ROWS, 2), compute_metrics=_accuracy,
                                        preprocess_logits_for_metrics=preprocess)
            prediction = trainer.predict(_rows(EVAL_ROWS, 2))
            out[name] = dict(predictions=torch.as_tensor(prediction.predictions),
                             labels=torch.as_tensor(prediction.label_ids), metrics=prediction.metrics,
                             evaluated=trainer.evaluate())
        return out
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_predict_gives_one_process_predictions_and_metrics(run_ranks, tmp_path):
    """predict() and evaluate() at TSP 2 with compute_metrics: with
    preprocess_logits_for_metrics=ds_tsp.argmax_token_ids the predicted ids
    (found on the folded head's ring) equal the plain Trainer's argmax path on
    one process, and so does the accuracy; without it, the full logits."""
    per_rank = run_ranks(2, _tsp_predictions, output_dir=str(tmp_path / "tsp"))
    plain = {}
    for name, preprocess in (("argmax", lambda logits, labels: logits.argmax(-1)), ("logits", None)):
        trainer = Trainer(model=tiny_model("qwen2", dtype=torch.float32), args=_prediction_args(str(tmp_path / name)),
                          eval_dataset=_rows(EVAL_ROWS, 2), compute_metrics=_accuracy,
                          preprocess_logits_for_metrics=preprocess)
        plain[name] = trainer.predict(_rows(EVAL_ROWS, 2))
    # The float32 runs' truth: the same predictions in float64; the plain float32 Trainer is the control
    # (tests/float32_control.py).
    truth = Trainer(model=tiny_model("qwen2", dtype=torch.float32).double(), args=_prediction_args(str(tmp_path / "truth")),
                    eval_dataset=_rows(EVAL_ROWS, 2), compute_metrics=_accuracy).predict(_rows(EVAL_ROWS, 2))
    ids, logits = torch.as_tensor(plain["argmax"].predictions), torch.as_tensor(plain["logits"].predictions)
    exact_loss, exact_logits = truth.metrics["test_loss"], torch.as_tensor(truth.predictions)
    # Real tokens: what right padding computes is no prediction (HF's padded queries see other keys than TSP's).
    real = torch.stack([row["attention_mask"] for row in _rows(EVAL_ROWS, 2)]).bool()
    loss_control = abs(plain["argmax"].metrics["test_loss"] - exact_loss) / exact_loss
    logits_control = _relative(logits[real], exact_logits[real])
    for rank, out in enumerate(per_rank):
        tsp, full = out["argmax"], out["logits"]["predictions"]
        print(f"rank {rank}: predicted ids {tuple(tsp['predictions'].shape)} on {int(real.sum())} real tokens equal "
              f"to one process's: {torch.equal(tsp['predictions'][real], ids[real])}; accuracy "
              f"{tsp['metrics']['test_accuracy']:.4f} vs {plain['argmax'].metrics['test_accuracy']:.4f}, loss "
              f"{tsp['metrics']['test_loss']:.6f} vs {plain['argmax'].metrics['test_loss']:.6f}; full logits "
              f"{tuple(full.shape)}, max |diff| {(full - logits)[real].abs().max():.1e}")
        assert tsp["predictions"].dtype == torch.long and tsp["predictions"].shape == ids.shape
        assert torch.equal(tsp["predictions"][real], ids[real])
        assert torch.equal(tsp["labels"], torch.as_tensor(plain["argmax"].label_ids))
        assert tsp["metrics"]["test_accuracy"] == plain["argmax"].metrics["test_accuracy"]
        assert tsp["evaluated"]["eval_accuracy"] == plain["argmax"].metrics["test_accuracy"]
        loss_error = abs(tsp["metrics"]["test_loss"] - exact_loss) / exact_loss
        logits_error = _relative(full[real], exact_logits[real])
        print(f"  against float64: loss {loss_error:.1e}, the float32 control's {loss_control:.1e} (bound "
              f"{float32_bound([loss_control]):.1e}); full logits {logits_error:.1e}, the control's "
              f"{logits_control:.1e} (bound {float32_bound([logits_control]):.1e})")
        assert loss_error <= float32_bound([loss_control])
        assert full.shape == logits.shape and logits_error <= float32_bound([logits_control])
        assert out["logits"]["metrics"]["test_accuracy"] == plain["logits"].metrics["test_accuracy"]


def _launched(argv, env, cwd):
    """Two ranks of an example started as the deepspeed launcher starts them
    (tests/scripts.py; examples/train.py runs under the launcher itself in
    test_engine.py): rank 0's standard output, once both succeeded."""
    procs = run_as_launched(argv, 2, env=env, cwd=cwd, timeout=400)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return procs[0].stdout


@pytest.mark.parametrize("config", ["trainer_tsp2_zero3_cpu.json"])
def test_example_fine_tunes_on_launched_ranks(tmp_path, own_processes, config):
    """examples/hf_trainer.py on 2 CPU ranks with the Hugging Face docs' ZeRO-3
    config (its ZeRO-2 offload config runs the LoRA example below), "auto" sizes, DeepSpeed's own AdamW and
    WarmupLR: the loss falls, each token is counted once, and the model save_model
    writes loads in Hugging Face and is the engine's: the float32 master weights
    of the DeepSpeed checkpoint written at the same step (the ZeRO-1 Trainer is
    tested against one process in test_trainer_matches_one_process)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    steps, seq_len = 10, 64
    out = tmp_path / "out"
    argv = [os.path.join(root, "examples", "hf_trainer.py"), "--deepspeed", os.path.join(root, "ds_configs", config),
            "--steps", str(steps), "--save-steps", str(steps), "--seq-len", str(seq_len), "--lr", "1e-2",
            "--output-dir", str(out)]
    stdout = _launched(argv, env, tmp_path)
    logs = [json.loads(line) for line in stdout.splitlines() if line.startswith("{\"step\"")]
    losses = [entry["loss"] for entry in logs if "loss" in entry]
    print(f"example ({config}): losses {[round(v, 3) for v in losses]}")
    assert losses[-1] < losses[0] - 0.5
    # batch 2 x accumulation 2 per step, one data-parallel replica: every token once.
    assert logs[-1]["num_input_tokens_seen"] == steps * 2 * 2 * seq_len
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.num_hidden_layers == 4
    checkpoint = out / f"checkpoint-{steps}"
    assert main(["export", "--checkpoint", str(checkpoint), "--model", str(checkpoint), "--out",
                 str(tmp_path / "master"), "--fp32-master"]) == 0
    master = AutoModelForCausalLM.from_pretrained(tmp_path / "master").state_dict()
    saved = model.state_dict()
    assert saved.keys() == master.keys()
    worst = max((saved[n] - master[n]).abs().max().item() for n in master)
    print(f"  saved model vs the checkpoint's master weights: max |dw| {worst:.1e}")
    assert worst == 0
    # Without --fp32-master: ZeRO-2's model-dtype weights, or the 16-bit weights ZeRO-3 saved beside its checkpoint.
    assert main(["export", "--checkpoint", str(checkpoint), "--model", str(checkpoint), "--out",
                 str(tmp_path / "model_dtype")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model_dtype").state_dict()
    assert all(torch.equal(exported[n], saved[n]) for n in saved)


def test_example_fine_tunes_lora_adapters_on_launched_ranks(tmp_path, own_processes):
    """examples/hf_trainer.py --lora 8 on 2 CPU ranks with the Hugging Face
    docs' ZeRO-2 config with optimizer offload (DeepSpeed's CPU Adam on the
    adapters): a PEFT model's adapters train (the loss falls) and save_model
    writes PEFT's adapter directory, which PEFT loads over the base model on
    one process."""
    from peft import PeftModel

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    argv = [os.path.join(root, "examples", "hf_trainer.py"), "--deepspeed",
            os.path.join(root, "ds_configs", "trainer_tsp2_zero2_offload_cpu.json"), "--lora", "8", "--steps", "15",
            "--seq-len", "64", "--lr", "1e-2", "--output-dir", str(out)]
    stdout = _launched(argv, env, tmp_path)
    losses = [json.loads(line)["loss"] for line in stdout.splitlines()
              if line.startswith("{\"step\"") and "\"loss\"" in line]
    print(f"example --lora 8: losses {[round(v, 3) for v in losses]}")
    assert losses[-1] < losses[0] - 0.3
    assert sorted(os.listdir(out / "final")) == ["adapter_config.json", "adapter_model.safetensors",
                                                 "training_args.bin"]
    sys.path.insert(0, os.path.join(root, "examples"))
    from train import small_byte_llama

    loaded = PeftModel.from_pretrained(small_byte_llama(), out / "final")
    assert sum(".lora_A." in name for name, _ in loaded.named_parameters()) == 7 * loaded.config.num_hidden_layers


@pytest.mark.parametrize("example", ["dpo.py", "grpo.py"])
def test_post_training_examples_learn_on_launched_ranks(tmp_path, own_processes, example):
    """examples/dpo.py and examples/grpo.py on 2 CPU ranks (TSP 2, ZeRO-1, the
    byte-level chat Llama): DPO's loss falls and its reward margin grows, GRPO's
    mean reward rises (its completions turn to digits); each writes a Hugging
    Face directory that loads on one process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    argv = [os.path.join(root, "examples", example), "--deepspeed",
            os.path.join(root, "ds_configs", "trainer_tsp2_cpu.json"), "--steps", "20", "--output-dir", str(out)]
    logs = [json.loads(line) for line in _launched(argv, env, tmp_path).splitlines()
            if line.startswith("{\"step\"") and "\"loss\"" in line]
    losses = [entry["loss"] for entry in logs]
    measure = "rewards/margins" if example == "dpo.py" else "reward"
    measured = [entry[measure] for entry in logs]
    print(f"{example}: losses {[round(v, 3) for v in losses]}, {measure} {[round(v, 3) for v in measured]}")
    if example == "dpo.py":
        assert losses[-1] < losses[0] - 0.01 and measured[-1] > measured[0] + 0.02
    else:  # GRPO's loss is 0 where the policy is the old one: the reward shows the learning
        assert measured[-1] > measured[0] + 0.3 and len(set(losses)) == len(losses)
    assert AutoModelForCausalLM.from_pretrained(out / "final").config.num_hidden_layers == 4


def test_accelerate_launch_with_a_deepspeed_plugin_matches_one_process(tmp_path):
    """The Hugging Face docs' way: ``accelerate launch --config_file`` with a
    DeepSpeed plugin whose ``deepspeed_config_file`` carries the ``tsp`` section
    (``ds_configs/accelerate_tsp2_cpu.yaml``), no ``TrainingArguments(deepspeed=...)``:
    examples/hf_trainer.py trains at TSP 2 on CPU ranks, and every step's loss is
    one process's stock Trainer's on the same batches."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    example = ["--steps", "4", "--seq-len", "32", "--logging-steps", "1", "--output-dir", str(tmp_path / "out")]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["accelerate", "launch", "--config_file", "ds_configs/accelerate_tsp2_cpu.yaml",
                           "--main_process_port", str(port), "examples/hf_trainer.py", *example],
                          env=env, cwd=root, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in proc.stdout.splitlines()
              if line.startswith("{\"step\"") and "\"loss\"" in line]
    assert "tsp=2" in proc.stdout

    sys.path.insert(0, os.path.join(root, "examples"))
    import hf_trainer
    from train import small_byte_llama

    args = hf_trainer.parse_args([*example[:-1], str(tmp_path / "stock")])
    stock_args = hf_trainer.training_arguments(args, configured_state=False)
    torch.manual_seed(stock_args.seed)
    train, _ = hf_trainer.datasets(args.seq_len)
    stock = Trainer(model=small_byte_llama(), args=stock_args, train_dataset=train)
    stock.train()
    # The float32 runs' truth: the same model (the same seed) trained in float64; the stock float32 run is the
    # control (tests/float32_control.py).
    truth_args = hf_trainer.training_arguments(hf_trainer.parse_args([*example[:-1], str(tmp_path / "truth")]),
                                               configured_state=False)
    torch.manual_seed(truth_args.seed)
    truth = Trainer(model=small_byte_llama().double(), args=truth_args, train_dataset=train)
    truth.train()
    error, control = _relative(losses, _losses(truth)), _relative(_losses(stock), _losses(truth))
    print(f"accelerate launch, TSP 2: losses {losses}\n  one process:          {_losses(stock)}; against float64 "
          f"max rel |dloss| {error:.1e}, the float32 control's {control:.1e} (bound {float32_bound([control]):.1e})")
    assert len(losses) == 4 and error <= float32_bound([control])


# ------------------------------------------------------------------------ TRL

def _sft_trainer(trainer_class, output_dir, per_device_batch, deepspeed=None, lora=False, dtype=torch.float32):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig

    tokenizer = chat_tokenizer()
    chats = Dataset.from_list([{"messages": [{"role": "user", "content": f"add {a} and {b}"},
                                             {"role": "assistant", "content": str(a + b)}]}
                               for a in range(4) for b in range(4)])
    configured = {"accelerator_config": {"use_configured_state": True}} if deepspeed else {}
    args = SFTConfig(output_dir=output_dir, per_device_train_batch_size=per_device_batch, max_steps=4,
                     gradient_accumulation_steps=ACCUMULATION, learning_rate=3e-2, weight_decay=0.5, logging_steps=1,
                     save_strategy="no", report_to=[], seed=0, disable_tqdm=True, max_length=SEQ_LEN * 2, bf16=False,
                     deepspeed=deepspeed, **configured)
    model = tiny_model("qwen2", dtype=torch.float32, vocab_size=len(tokenizer)).to(dtype)
    # TRL wraps the model in PEFT itself; non-zero lora_B, so the adapters matter from the first step.
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                             init_lora_weights=False) if lora else None
    return trainer_class(model=model, args=args, train_dataset=chats, processing_class=tokenizer,
                         peft_config=peft_config)


SFT_METRICS = ("loss", "entropy", "mean_token_accuracy", "num_tokens")


def _sft_metrics(trainer):
    return {key: [entry[key] for entry in trainer.state.log_history if key in entry] for key in SFT_METRICS}


def _tsp_sft_run(output_dir, lora):
    from accelerate.state import AcceleratorState

    from ds_tsp.runtime.trainer import configure_cpu_ranks

    try:
        configure_cpu_ranks()
        trainer = _sft_trainer(ds_tsp.TSPSFTTrainer, output_dir, MICRO_BATCH, _deepspeed_config(dist.get_world_size()),
                               lora)
        trainer.train()
        trainer.save_model(os.path.join(output_dir, "final"))
        return _sft_metrics(trainer)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("lora", [False, True])
def test_trl_sft_trainer_matches_one_process(run_ranks, tmp_path, lora):
    """TRL's SFTTrainer with the mixin in front (``ds_tsp.TSPSFTTrainer``), on a
    chat dataset, against one process's SFTTrainer: its own loss and metrics
    (entropy, token accuracy, token count) on both sides from a fused LM head,
    TRL's and TSP's; with ``peft_config``, TRL's own PEFT model of LoRA adapters,
    saved in PEFT's format (read by ``PeftModel.from_pretrained`` on one process)."""
    SFTTrainer = pytest.importorskip("trl").SFTTrainer

    tsp = run_ranks(2, _tsp_sft_run, output_dir=str(tmp_path / "tsp"), lora=lora)[0]
    # The float32 runs' truth is the same training in float64; one process's float32 SFTTrainer is the control
    # (tests/float32_control.py). AdamW divides the adapters' small gradients' rounding by their size, which the
    # control sees too.
    stock = _sft_trainer(SFTTrainer, str(tmp_path / "stock"), MICRO_BATCH, lora=lora)
    truth = _sft_trainer(SFTTrainer, str(tmp_path / "truth"), MICRO_BATCH, lora=lora, dtype=torch.float64)
    start = {name: p.detach().clone() for name, p in stock.model.named_parameters() if "lora_" in name}
    assert all(torch.equal(p.detach().float(), start[name]) for name, p in truth.model.named_parameters()
               if "lora_" in name)  # the float64 run starts from the same adapters
    stock.train()
    truth.train()
    expected = _sft_metrics(truth)
    errors = {key: _relative(tsp[key], expected[key]) for key in SFT_METRICS}
    control = {key: _relative(values, expected[key]) for key, values in _sft_metrics(stock).items()}
    bounds = {key: float32_bound([control[key]]) for key in SFT_METRICS}
    adapters = adapters_control = moved = 0.0
    if lora:
        from peft import PeftModel

        base = tiny_model("qwen2", dtype=torch.float32, vocab_size=len(chat_tokenizer()))
        saved = {name: p.detach() for name, p in PeftModel.from_pretrained(base, tmp_path / "tsp" / "final")
                 .named_parameters() if "lora_" in name}
        exact = {name: p.detach() for name, p in truth.model.named_parameters() if "lora_" in name}
        assert sorted(saved) == sorted(exact) == sorted(start) and saved
        adapters = max(_relative(p, exact[name]) for name, p in saved.items())
        adapters_control = max(_relative(p.detach(), exact[name]) for name, p in stock.model.named_parameters()
                               if "lora_" in name)
        moved = max(_relative(p, start[name]) for name, p in exact.items())
    print(f"SFT TSP=2 (LoRA {lora}): losses {[round(v, 6) for v in tsp['loss']]}, float64 "
          f"{[round(v, 6) for v in expected['loss']]}; against float64, max rel "
          + ", ".join(f"{k} {v:.1e} (control {control[k]:.1e}, bound {bounds[k]:.1e})" for k, v in errors.items())
          + (f"; saved adapters {adapters:.1e} (control {adapters_control:.1e}, bound "
             f"{float32_bound([adapters_control]):.1e}; moved {moved:.1e} from the start)" if lora else ""))
    assert all(len(tsp[key]) == 4 for key in SFT_METRICS)
    assert all(errors[key] <= bounds[key] for key in SFT_METRICS)
    # An adapter saved wrong or not read (PEFT's fresh one) is off by as much as training moved it.
    assert adapters <= float32_bound([adapters_control])
    assert not lora or moved > 100 * float32_bound([adapters_control])


# ------------------------------------------------------------ ZeRO-3 in the Trainer

def _zero3_from_pretrained_run(model_dir, output_dir):
    """Hugging Face's ZeRO-3 flow: TrainingArguments first, so from_pretrained
    builds the model under zero.Init (partitioned over the world); then
    TSPTrainer, whose injection gathers it layer by layer. save_model with
    stage3_gather_16bit_weights_on_model_save false writes the DeepSpeed
    checkpoint only."""
    from accelerate.state import AcceleratorState

    from ds_tsp.runtime.trainer import configure_cpu_ranks

    try:
        configure_cpu_ranks()
        config = {**_deepspeed_config(2), "zero_optimization": {
            "stage": 3, "stage3_gather_16bit_weights_on_model_save": False}}
        args = _arguments(output_dir, MICRO_BATCH, config)
        args.max_steps, args.save_strategy, args.gradient_accumulation_steps = 2, "no", 1
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
        trainer = ds_tsp.TSPTrainer(model=model, args=args, train_dataset=_rows(8, 1))
        first = next(iter(trainer.get_train_dataloader()))
        trainer.train()
        trainer.save_model(os.path.join(output_dir, "final"))
        return dict(partitioned=partitioned, losses=_losses(trainer), first=first)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_zero3_models_built_under_zero_init_train_and_save(run_ranks, tmp_path):
    model_dir = str(tmp_path / "hf")
    reference = tiny_model("qwen2", dtype=torch.float32)
    reference.save_pretrained(model_dir)
    out = run_ranks(2, _zero3_from_pretrained_run, model_dir=model_dir, output_dir=str(tmp_path / "out"))[0]
    assert out["partitioned"]
    first = out["first"]
    inputs = {k: first[k] for k in ("input_ids", "attention_mask", "labels")}
    with torch.no_grad():  # the float32 control and its float64 truth (tests/float32_control.py)
        control = reference(**inputs).loss.item()
        exact = copy.deepcopy(reference).double()(**inputs).loss.item()
    error, control_error = abs(out["losses"][0] - exact) / exact, abs(control - exact) / exact
    print(f"zero.Init model under TSP: first loss {out['losses'][0]:.6f}, one process {control:.6f}; against float64 "
          f"{error:.1e}, the float32 control's {control_error:.1e} (bound {float32_bound([control_error]):.1e})")
    assert error <= float32_bound([control_error])
    assert len(out["losses"]) == 2
    final = tmp_path / "out" / "final"
    assert (final / "latest").is_file() and not (final / "model.safetensors").exists()
    assert main(["export", "--checkpoint", str(final), "--model", model_dir, "--out", str(tmp_path / "exported"),
                 "--fp32-master"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    moved = max((p - reference.get_parameter(n)).abs().max().item() for n, p in exported.named_parameters())
    assert moved > 1e-3  # two AdamW steps at lr 3e-2
