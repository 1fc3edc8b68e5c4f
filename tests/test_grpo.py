"""TRL's GRPOTrainer under TSP (``ds_tsp.TSPGRPOTrainer``) against TRL's own run.

Tiny Llama, float32, prompts built in code and a reward of the completion's
characters (no model): 2 completions a prompt sampled by Hugging Face's
``generate`` (temperature 0.9, up to 6 new tokens) on the TSP model, a TSP-sharded
reference model (beta 0.04), SGD (whose update is the gradient: held to
float32 rounding, where Adam divides tiny gradients' rounding by their size),
gradient accumulation 2 (a generation batch serving two micro-batches), 2
steps, with the GRPO, Dr. GRPO, DAPO and BNPO losses (each normalizes by a
different count of tokens or sequences). TSP 2 runs each against one process;
TSP 2 x DP 2 under ZeRO-2 (DAPO, whose normalizer divides by the processes,
and GRPO) against DeepSpeed's data parallelism over 2 ranks (ZeRO-2), which
seeds each replica as TSP does. Checked: every sampled
completion, the rewards, and the losses, KL and entropies logged at every
step, and every weight of the saved model.
"""

import os
import re
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM

import ds_tsp
from ds_tsp.injection.inputs import left_padding
from models import chat_tokenizer, tiny_model

MICRO_BATCH = 2  # completions per data-parallel replica and micro-batch
ACCUMULATION = 2
NUM_GENERATIONS = 2  # a replica's generation batch of 4 rows: two prompts, which can differ in length
STEPS = 2
LR = 0.02
BETA = 0.04
# fp32, different summation orders (the ring's, the DP all-reduce): logged values and weights within 1e-6
# relative. The loss is a mean of advantage-weighted ratios that nearly cancel (0 at the first step) plus beta
# times the KL: its rounding is that of its terms, so it is measured against their size.
BOUND = 1e-6
# The KL, exp(d) - d - 1 of a log-probability difference d that starts at 0, carries the log-probabilities'
# float32 rounding (~5e-7 near log-probabilities of -5) divided by d's size (its relative error is about twice
# theirs over d): 3.1e-5 relative seen at mean KLs of 0.002 to 0.006 after one step. A wrong reference model
# or policy would put it off by its own size.
KL_BOUND = 1e-4
LOGGED = ("loss", "reward", "reward_std", "kl", "entropy")


def _prompts():
    from datasets import Dataset

    # Prompts of 12 to 14 characters: a batch's shorter ones are padded on the left (ds_tsp moves those rows).
    return Dataset.from_list([{"prompt": f"add {a} and {b}:"} for a in range(4) for b in (1, 23, 456, 7)])


def _reward(completions, **kwargs):
    """A deterministic score of each completion's characters, spread enough that a group's rewards differ."""
    return [sum(ord(c) for c in text) % 17 / 17 for text in completions]


def _initial_model():
    """Tiny Llama whose end-of-sequence logit is scaled by 20: completions of 2 to 6 tokens, so that the losses'
    normalizers (tokens of a sequence, of the batch, the longest completion) all differ."""
    eos = chat_tokenizer().eos_token_id
    model = tiny_model("llama", dtype=torch.float32, vocab_size=len(chat_tokenizer()))
    with torch.no_grad():
        model.lm_head.weight[eos] *= 20
    return model


def _grpo_trainer(trainer_class, loss_type, model_dir, output_dir, deepspeed=None):
    from trl import GRPOConfig

    tokenizer = chat_tokenizer()
    configured = {"accelerator_config": {"use_configured_state": True}} if deepspeed else {}
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=MICRO_BATCH, max_steps=STEPS,
                      gradient_accumulation_steps=ACCUMULATION, num_generations=NUM_GENERATIONS,
                      max_completion_length=6, temperature=0.9, beta=BETA, loss_type=loss_type, optim="sgd",
                      learning_rate=LR,
                      logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True, bf16=False,
                      log_completions=False, deepspeed=deepspeed, **configured)
    # Loaded by TRL from the directory, as is its reference model.
    return trainer_class(model=model_dir, reward_funcs=_reward, args=args, train_dataset=_prompts(),
                         processing_class=tokenizer)


def _run(trainer_class, loss_type, model_dir, output_dir, tsp_size=None):
    """Train under DeepSpeed ZeRO-2 (with a ``tsp`` section when ``tsp_size``), or in one process when
    launched alone; ``(logged values, completions, whether the reference model is TSP-sharded)``."""
    import deepspeed
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    from ds_tsp.injection.model import TSPCausalLMMixin
    from ds_tsp.runtime.trainer import configure_cpu_ranks

    config = None
    if dist.is_initialized():
        config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                  "zero_optimization": {"stage": 2}}
        if tsp_size:
            config["tsp"] = {"enabled": True, "size": tsp_size, "attention_backend": "sdpa"}
        else:  # a TSP engine built earlier in this worker left its mpu as DeepSpeed's global one
            deepspeed.utils.groups.mpu = None
        configure_cpu_ranks()
    try:
        trainer = _grpo_trainer(trainer_class, loss_type, model_dir, output_dir, config)
        completions = []
        generate = trainer._generate

        def recorded(prompts):
            out = generate(prompts)
            completions.append(out[1])  # the completions' token ids, a list a row, up to the end of sequence
            return out

        trainer._generate = recorded
        left_padded = []

        def moved_rows(attention_mask, labels=None):  # whether a training forward moved left-padded rows
            left = left_padding(attention_mask, labels)
            left_padded.append(left is not None)
            return left

        with mock.patch("ds_tsp.injection.model.left_padding", moved_rows):
            trainer.train()
        trainer.save_model(os.path.join(output_dir, "final"))
        logged = {key: [entry[key] for entry in trainer.state.log_history if key in entry] for key in LOGGED}
        advantages = max(abs(a) for a in trainer._logs["advantages"])  # the last generation batch's
        return {"logged": logged, "completions": completions, "advantages": advantages, "left_padded": any(left_padded),
                "reference_sharded": isinstance(trainer.ref_model, TSPCausalLMMixin)}
    finally:
        if config is not None:
            AcceleratorState._reset_state(reset_partial_state=True)


def _relative(values, expected):
    values, expected = torch.as_tensor(values, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((values - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("world, loss_type", [(2, "grpo"), (2, "dr_grpo"), (2, "dapo"), (2, "bnpo"), (4, "dapo"),
                                              (4, "grpo")])
def test_grpo_trainer_matches_trl(run_ranks, tmp_path, world, loss_type):
    from trl import GRPOTrainer

    dp_size = world // 2
    model_dir = str(tmp_path / "initial")
    _initial_model().save_pretrained(model_dir)
    tsp = run_ranks(world, _run, trainer_class=ds_tsp.TSPGRPOTrainer, loss_type=loss_type, model_dir=model_dir,
                    output_dir=str(tmp_path / "tsp"), tsp_size=2, timeout_s=400)
    if dp_size == 1:
        stock = [_run(GRPOTrainer, loss_type, model_dir, str(tmp_path / "stock"))]
    else:
        stock = run_ranks(dp_size, _run, trainer_class=GRPOTrainer, loss_type=loss_type, model_dir=model_dir,
                          output_dir=str(tmp_path / "stock"), timeout_s=400)
    expected = stock[0]["logged"]
    errors = {key: _relative(tsp[0]["logged"][key], expected[key]) for key in LOGGED if key != "loss"}
    terms = stock[0]["advantages"] + BETA * max(expected["kl"])
    errors["loss"] = max(abs(a - b) for a, b in zip(tsp[0]["logged"]["loss"], expected["loss"])) / terms
    reloaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "tsp" / "final").named_parameters())
    reference = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "stock" / "final").named_parameters())
    start = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    weights = max(_relative(p.detach(), reference[n].detach()) for n, p in reloaded.items())
    moved = max(_relative(p.detach(), start[n].detach()) for n, p in reference.items())
    print(f"GRPO {loss_type} TSP=2 DP={dp_size} ZeRO-2: losses {tsp[0]['logged']['loss']} vs {expected['loss']}, "
          f"rewards {tsp[0]['logged']['reward']}, kl {expected['kl']}; max rel "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
          + f" (loss: of its terms' size); weights {weights:.1e} (moved {moved:.1e} from the start)")
    # Each TSP group samples its replica's completions, every rank of it the same tokens.
    for rank, out in enumerate(tsp):
        assert out["completions"] == stock[rank // 2]["completions"]
    assert all(len(tsp[0]["logged"][key]) == STEPS for key in LOGGED)
    assert len({len(row) for batch in tsp[0]["completions"] for row in batch}) > 2  # lengths differ
    assert errors.pop("kl") <= KL_BOUND
    assert max(errors.values()) <= BOUND and weights <= BOUND
    assert moved > 1e3 * BOUND  # the check can fail: training moved the weights far more than the bound
    assert tsp[0]["reference_sharded"] and tsp[0]["left_padded"]  # prompts of unequal lengths were scored


def _refusal(options, model_dir, output_dir, zero_stage):
    from accelerate.state import AcceleratorState
    from trl import GRPOConfig

    from ds_tsp.runtime.trainer import configure_cpu_ranks

    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": zero_stage},
              "tsp": {"enabled": True, "size": 2}}
    try:
        configure_cpu_ranks()
        args = GRPOConfig(output_dir=output_dir, report_to=[], deepspeed=config, bf16=False, max_completion_length=4,
                          accelerator_config={"use_configured_state": True}, **options)
        ds_tsp.TSPGRPOTrainer(model=model_dir, reward_funcs=_reward, args=args, train_dataset=_prompts(),
                              processing_class=chat_tokenizer())
    except ValueError as error:
        return str(error)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("options, zero_stage, message", [
    ({"use_vllm": True}, 1, r"^use_vllm = True: .* leave it False under TSP"),
    ({}, 3, r"^zero_optimization.stage 3: .* use stage 0-2 with TSPGRPOTrainer"),
    # 3 completions a micro-batch x 1 replica x 1 step: no whole group of 2 (TRL counted 2 ranks: 6).
    ({"per_device_train_batch_size": 3, "num_generations": 2, "steps_per_generation": 1}, 1,
     r"generation_batch_size = 3 \(per_device_train_batch_size 3 x data-parallel size 1 x steps_per_generation 1 "
     r"under tsp.size 2\) must be divisible by num_generations = 2")])
def test_what_grpo_cannot_take_under_tsp_is_refused_by_name(run_ranks, tmp_path, options, zero_stage, message):
    model_dir = str(tmp_path / "initial")
    _initial_model().save_pretrained(model_dir)
    refusal = run_ranks(2, _refusal, options=options, model_dir=model_dir, output_dir=str(tmp_path / "out"),
                        zero_stage=zero_stage)[0]
    assert refusal is not None and re.search(message, refusal), refusal
