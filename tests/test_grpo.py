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
step, and every weight of the saved model. The same with a ``peft_config``
(LoRA; the reference is the policy with its adapters off, the adapters saved
in PEFT's format), and with ``generation_batch_size`` or
``steps_per_generation`` set explicitly (each meaning what it means under data
parallelism over as many replicas).
"""

import contextlib
import os
import re
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM

import ds_tsp
from ds_tsp.injection.inputs import left_padding
from float32_control import float32_bound
from models import chat_tokenizer, tiny_model

MICRO_BATCH = 2  # completions per data-parallel replica and micro-batch
ACCUMULATION = 2
NUM_GENERATIONS = 2  # a replica's generation batch of 4 rows: two prompts, which can differ in length
STEPS = 2
LR = 0.02
BETA = 0.04
# fp32 TSP sums in other orders (the ring's, the DP all-reduce) than TRL does. Its logged values and weights are
# measured against TRL's run in float64 and held to float32_bound of TRL's float32 run's distances to it, key by
# key (tests/float32_control.py). The loss is a mean of advantage-weighted ratios that nearly cancel (0 at the
# first step) plus beta times the KL: its rounding is that of its terms, so it is measured against their size.
# The KL, exp(d) - d - 1 of a log-probability difference d that starts at 0, carries the log-probabilities'
# float32 rounding divided by d's size, in the control as in the run under test; a wrong reference model or
# policy would put it off by its own size.
# The LoRA and explicit-schedule runs are held to the issue's criterion, 1e-4 a step: the loss (of its terms'
# size), rewards, entropy, the saved adapters (relative), and the log-probabilities behind the KL, as the error
# in nats that the KL's error implies (KL ~ mean d^2 / 2, so dKL ~ rms(d) x rms(dlogp): dKL / sqrt(2 KL)), which
# float32 rounding keeps near 5e-7 (u = 6e-8 of log-probabilities near -5) however small d is. Float32 in another
# summation order moves these by up to 1e-6 (test_grpo_trainer_matches_trl's figures), a wrong schedule changes the completions (compared
# exactly) and a wrong reference the KL by its own size: the bound sits 100x from either, on any machine.
CRITERION = 1e-4
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


def _grpo_trainer(trainer_class, loss_type, model_dir, output_dir, deepspeed=None, lora=False, schedule=None,
                  dtype=torch.float32):
    from peft import LoraConfig
    from trl import GRPOConfig

    tokenizer = chat_tokenizer()
    configured = {"accelerator_config": {"use_configured_state": True}} if deepspeed else {}
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=MICRO_BATCH, max_steps=STEPS,
                      gradient_accumulation_steps=ACCUMULATION, num_generations=NUM_GENERATIONS,
                      max_completion_length=6, temperature=0.9, beta=BETA, loss_type=loss_type, optim="sgd",
                      learning_rate=LR,
                      logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True, bf16=False,
                      log_completions=False, deepspeed=deepspeed, model_init_kwargs={"dtype": dtype}, **configured,
                      **(schedule or {}))
    # TRL wraps the model in PEFT itself and takes it with its adapters disabled as the reference model.
    # Non-zero lora_B: policy and reference differ from the first step.
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"],
                             init_lora_weights=False) if lora else None
    # PEFT draws the adapters from the global generator when TRL wraps the model, before the Trainer seeds it:
    # the same draws in every run, whatever the process ran before.
    torch.manual_seed(0)
    # Loaded by TRL from the directory, as is its reference model.
    return trainer_class(model=model_dir, reward_funcs=_reward, args=args, train_dataset=_prompts(),
                         processing_class=tokenizer, peft_config=peft_config)


def _run(trainer_class, loss_type, model_dir, output_dir, tsp_size=None, lora=False, schedule=None, dtype=torch.float32):
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
        trainer = _grpo_trainer(trainer_class, loss_type, model_dir, output_dir, config, lora, schedule, dtype)
        start = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "lora_" in name}
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
                "reference_sharded": isinstance(trainer.ref_model, TSPCausalLMMixin), "start_adapters": start,
                "schedule": (trainer.args.generation_batch_size, trainer.args.steps_per_generation)}
    finally:
        if config is not None:
            AcceleratorState._reset_state(reset_partial_state=True)


def _relative(values, expected):
    values, expected = torch.as_tensor(values, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((values - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def _kl_as_logprob_error(run, truth):
    """The error in nats of the log-probabilities behind the KL that its error implies: the KL is about
    mean(d^2) / 2 of the policy's and the reference's log-probability difference d, so dKL ~ rms(d) x rms(dlogp),
    that is dKL / sqrt(2 KL). Float32 rounds log-probabilities near -5 by ~u x 5 however small d is, so the KL's own
    relative error is that over d's size (3e-5 relative at KLs of 0.002): this is the measure that does not
    depend on how far training has moved the policy from its reference."""
    return max((abs(a - b) / (2 * b) ** 0.5 for a, b in zip(run["logged"]["kl"], truth["logged"]["kl"]) if b > 0),
               default=0.0)


def _errors(run, truth):
    """Each logged value's largest error over the steps, relative to its largest value; the loss's to the size
    of its terms (the advantages, and beta times the KL); the KL's as the log-probability error it implies,
    relative to the log-probabilities' size (the entropy, their mean over the vocabulary)."""
    expected = truth["logged"]
    errors = {key: _relative(run["logged"][key], expected[key]) for key in LOGGED if key not in ("loss", "kl")}
    terms = truth["advantages"] + BETA * max(expected["kl"])
    errors["loss"] = max(abs(a - b) for a, b in zip(run["logged"]["loss"], expected["loss"])) / terms
    errors["kl"] = _kl_as_logprob_error(run, truth) / max(expected["entropy"])
    return errors


def _criterion_errors(tsp, stock):
    """``_errors`` with the KL's as the log-probability error in nats (see CRITERION)."""
    return {**_errors(tsp, stock), "kl": _kl_as_logprob_error(tsp, stock)}


def _summary(label, tsp, stock, errors):
    return (f"{label}: losses {tsp['logged']['loss']} vs {stock['logged']['loss']}, rewards "
            f"{tsp['logged']['reward']}, kl {stock['logged']['kl']}; max rel "
            + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()) + " (loss: of its terms' size)")


def _weights(directory):
    return {name: p.detach() for name, p in AutoModelForCausalLM.from_pretrained(directory).named_parameters()}


def _tsp_and_stock(run_ranks, tmp_path, world, loss_type, **options):
    """The TSP 2 run on ``world`` ranks, and TRL's on ``world // 2`` (one process, or DeepSpeed's data
    parallelism over 2 ranks), from the same initial model directory."""
    from trl import GRPOTrainer

    model_dir = str(tmp_path / "initial")
    _initial_model().save_pretrained(model_dir)
    tsp = run_ranks(world, _run, trainer_class=ds_tsp.TSPGRPOTrainer, loss_type=loss_type, model_dir=model_dir,
                    output_dir=str(tmp_path / "tsp"), tsp_size=2, timeout_s=400, **options)
    if world == 2:
        stock = [_run(GRPOTrainer, loss_type, model_dir, str(tmp_path / "stock"), **options)]
    else:
        stock = run_ranks(world // 2, _run, trainer_class=GRPOTrainer, loss_type=loss_type, model_dir=model_dir,
                          output_dir=str(tmp_path / "stock"), timeout_s=400, **options)
    return model_dir, tsp, stock


def _assert_the_same_samples(tsp, stock):
    # Each TSP group samples its replica's completions, every rank of it the same tokens.
    for rank, out in enumerate(tsp):
        assert out["completions"] == stock[rank // 2]["completions"]
    # Rewards are logged for each generation batch (every step unless one serves several).
    assert len(tsp[0]["logged"]["loss"]) == STEPS
    assert all(len(tsp[0]["logged"][key]) == len(stock[0]["logged"][key]) > 0 for key in LOGGED)


def _truth(run_ranks, tmp_path, world, loss_type, model_dir):
    """TRL's run of ``_tsp_and_stock``'s stock schedule in float64: the float32 runs' truth."""
    from trl import GRPOTrainer

    output_dir = str(tmp_path / "truth")
    if world == 2:
        return [_run(GRPOTrainer, loss_type, model_dir, output_dir, dtype=torch.float64)]
    return run_ranks(world // 2, _run, trainer_class=GRPOTrainer, loss_type=loss_type, model_dir=model_dir,
                     output_dir=output_dir, dtype=torch.float64, timeout_s=400)


@pytest.mark.parametrize("world, loss_type", [(2, "grpo"), (2, "dr_grpo"), (2, "dapo"), (2, "bnpo"), (4, "dapo"),
                                              (4, "grpo")])
def test_grpo_trainer_matches_trl(run_ranks, tmp_path, world, loss_type):
    model_dir, tsp, stock = _tsp_and_stock(run_ranks, tmp_path, world, loss_type)
    truth = _truth(run_ranks, tmp_path, world, loss_type, model_dir)
    # float64 samples the same completions as float32 (a sampled token flips only where a uniform draw falls
    # within float32's rounding of a cumulative probability, about 1e-7 a token).
    assert [run["completions"] for run in truth] == [run["completions"] for run in stock]
    errors, control = _errors(tsp[0], truth[0]), _errors(stock[0], truth[0])
    bounds = {key: float32_bound([value]) for key, value in control.items()}
    reloaded, exact = _weights(tmp_path / "tsp" / "final"), _weights(tmp_path / "truth" / "final")
    stock_weights, start = _weights(tmp_path / "stock" / "final"), _weights(model_dir)
    weights = max(_relative(p, exact[n]) for n, p in reloaded.items())
    weights_control = max(_relative(p, exact[n]) for n, p in stock_weights.items())
    weights_bound = float32_bound([weights_control])
    moved = max(_relative(p, start[n]) for n, p in exact.items())
    print(_summary(f"GRPO {loss_type} TSP=2 DP={world // 2} ZeRO-2 against float64", tsp[0], truth[0], errors)
          + "; the float32 control's " + ", ".join(f"{k} {v:.1e}" for k, v in control.items())
          + f"; weights {weights:.1e} (control {weights_control:.1e}, bound {weights_bound:.1e}; moved {moved:.1e} "
          "from the start)")
    assert len({len(row) for batch in tsp[0]["completions"] for row in batch}) > 2  # lengths differ
    _assert_the_same_samples(tsp, stock)
    assert all(errors[key] <= bounds[key] for key in errors) and weights <= weights_bound
    assert moved > 100 * weights_bound  # the check can fail: training moved the weights far more than the bound
    assert tsp[0]["reference_sharded"] and tsp[0]["left_padded"]  # prompts of unequal lengths were scored


def test_grpo_with_lora_matches_trl(rank_pools, run_ranks, tmp_path):
    """GRPO with a peft_config at TSP 2 against one process: the reference (beta > 0) is the policy with its
    adapters disabled; the adapters saved in PEFT's format, read by PeftModel.from_pretrained."""
    from peft import PeftModel

    # Fresh rank workers: after test_engine's and the float64 runs above in the same 2-rank workers, the TSP run
    # sampled one other token in its first batch (128 for 156, deterministically), which one process of a real
    # job never meets. Not understood yet, so this test does not inherit that state.
    rank_pools.close()

    model_dir, tsp, stock = _tsp_and_stock(run_ranks, tmp_path, 2, "grpo", lora=True)
    errors = _criterion_errors(tsp[0], stock[0])
    adapters = {}
    for run in ("tsp", "stock"):
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / run / "final")
        adapters[run] = {name: p.detach() for name, p in loaded.named_parameters() if "lora_" in name}
    start = stock[0]["start_adapters"]
    weights = max(_relative(p, adapters["stock"][n]) for n, p in adapters["tsp"].items())
    moved = max(_relative(p, start[n]) for n, p in adapters["stock"].items())
    print(_summary("GRPO + LoRA TSP=2", tsp[0], stock[0], errors)
          + f"; adapters {weights:.1e} (moved {moved:.1e} from the start)")
    assert sorted(adapters["tsp"]) == sorted(start) and len(start) == 3 * 2 * 2  # q, v, gate; A, B; 2 layers
    _assert_the_same_samples(tsp, stock)
    assert max(errors.values()) <= CRITERION and weights <= CRITERION
    # The check can fail: training moved the adapters 100x the bound (PEFT's fresh adapters, where none were
    # read, would be as far off); the reference with its adapters on would give a KL of 0.
    assert moved > 100 * CRITERION and min(stock[0]["logged"]["kl"]) > 100 * CRITERION


# Each set explicitly to a value other than its default (steps_per_generation = gradient accumulation 2, the
# generation batch MICRO_BATCH x replicas x 2), which TRL's config counting ranks took for another schedule (at
# 4 ranks it refused generation_batch_size 4, not a multiple of 2 x 4 ranks). DAPO normalizes by the replicas and
# by steps_per_generation.
@pytest.mark.parametrize("world, schedule", [(2, {"generation_batch_size": 8}), (2, {"steps_per_generation": 1}),
                                             (4, {"generation_batch_size": 4}), (4, {"steps_per_generation": 4})])
def test_an_explicit_generation_schedule_means_what_it_means_under_data_parallelism(run_ranks, tmp_path, world,
                                                                                     schedule):
    model_dir, tsp, stock = _tsp_and_stock(run_ranks, tmp_path, world, "dapo", schedule=schedule)
    errors = _criterion_errors(tsp[0], stock[0])
    print(_summary(f"GRPO dapo TSP=2 DP={world // 2} {schedule}", tsp[0], stock[0], errors)
          + f"; (generation_batch_size, steps_per_generation) {tsp[0]['schedule']} vs {stock[0]['schedule']}")
    assert tsp[0]["schedule"] == stock[0]["schedule"]
    _assert_the_same_samples(tsp, stock)
    assert max(errors.values()) <= CRITERION


def _refusal(options, model_dir, output_dir, zero_stage, built_before_ds_tsp=False):
    from accelerate.state import AcceleratorState
    from trl import GRPOConfig

    from ds_tsp.runtime.trainer import configure_cpu_ranks

    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": zero_stage},
              "tsp": {"enabled": True, "size": 2}}
    # TRL's own __post_init__, as it runs where ds_tsp was not imported yet: its arithmetic counts the ranks.
    trl_own = mock.patch.object(GRPOConfig, "__post_init__", GRPOConfig.__post_init__.__wrapped__)
    try:
        configure_cpu_ranks()
        with trl_own if built_before_ds_tsp else contextlib.nullcontext():
            args = GRPOConfig(output_dir=output_dir, report_to=[], deepspeed=config, bf16=False,
                              max_completion_length=4, accelerator_config={"use_configured_state": True}, **options)
        ds_tsp.TSPGRPOTrainer(model=model_dir, reward_funcs=_reward, args=args, train_dataset=_prompts(),
                              processing_class=chat_tokenizer())
    except ValueError as error:
        return str(error)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("options, zero_stage, message", [
    ({"use_vllm": True}, 1, r"^use_vllm = True: .* leave it False under TSP"),
    ({}, 3, r"^zero_optimization.stage 3: .* use stage 0-2 with TSPGRPOTrainer"),
    # TRL's own refusals, counting the one replica of the 2 ranks as data parallelism over 1 would (counting the
    # ranks, TRL took these: 3 x 2 ranks holds whole groups of 2, and so does an evaluation batch of 1 x 2).
    ({"per_device_train_batch_size": 3, "num_generations": 2, "steps_per_generation": 1}, 1,
     r"^generation_batch_size \(3\) must be divisible by num_generations \(2\)"),
    ({"per_device_eval_batch_size": 1, "num_generations": 2, "eval_strategy": "steps"}, 1,
     r"^The global eval batch size \(1 \* 1\) must be divisible by the number of generations used for evaluation"),
    # A config built where ds_tsp was not imported yet counted the ranks: refused, naming the fix.
    ({"built_before_ds_tsp": True}, 1,
     r"^generation_batch_size = 16 is not per_device_train_batch_size 8 x data-parallel size 1 x "
     r"steps_per_generation 1: the GRPOConfig counted the 2 ranks.* Import ds_tsp before building the GRPOConfig")])
def test_what_grpo_cannot_take_under_tsp_is_refused_by_name(run_ranks, tmp_path, options, zero_stage, message):
    model_dir = str(tmp_path / "initial")
    _initial_model().save_pretrained(model_dir)
    options = dict(options)
    built_before_ds_tsp = options.pop("built_before_ds_tsp", False)
    refusal = run_ranks(2, _refusal, options=options, model_dir=model_dir, output_dir=str(tmp_path / "out"),
                        zero_stage=zero_stage, built_before_ds_tsp=built_before_ds_tsp)[0]
    assert refusal is not None and re.search(message, refusal), refusal
