"""TRL's DPOTrainer under TSP (``ds_tsp.TSPDPOTrainer``) against one process's DPOTrainer.

Tiny Llama and Qwen3 (per-head q/k norms), float32, on a conversational
preference dataset built in code (the right answer against an off-by-one),
a TSP-sharded reference model, AdamW or SGD, gradient accumulation 2, 3 steps, at
TSP 2 and TSP 2 x DP 2 under ZeRO-2, with the sigmoid loss and IPO (whose
per-sequence log-probabilities are averaged over the completion's tokens).
One process's DPOTrainer takes each step's global batch at once. Checked:
the losses, the sequences' log-probabilities, the chosen and rejected rewards
and their margins of every step (a reward against beta times the size of the
log-probabilities it is a difference of), and every weight of the saved model.
With a ``peft_config`` (LoRA, SGD, TSP 2) and no ``ref_model``, TRL's reference
is the policy with its adapters disabled; the adapters are saved in PEFT's format.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import ds_tsp
from float32_control import float32_bound
from models import chat_tokenizer, tiny_model

MICRO_BATCH = 2  # pairs per data-parallel replica and micro-batch
ACCUMULATION = 2
STEPS = 3
BETA = 0.1
LR = {"adamw_torch": 1e-2, "sgd": 1.0}
# fp32, 3 steps: TSP sums in other orders (the ring's, the DP all-reduce) than one process does. The control is
# one process against itself, each step's pairs taken as micro-batches x ACCUMULATION or as one batch (the same
# loss and gradient, other sums): TSP's logged values and weights are held to float32_bound of the control's
# distances (tests/float32_control.py). Adam divides small gradients' rounding by their size, which the control
# sees too (AdamW's weights: 6e-6 between the two one-process runs).
# With LoRA (TSP 2 against one process): the criterion, 1e-4 a step for the loss, rewards and
# log-probabilities, and for the saved adapters. Float32 rounding (u = 6e-8) in another summation order moves them
# by 1e-7 to 1e-6 (the control's figures), a wrong reference or wrong adapters by 1e-2 or more (the guards): the
# bound sits 100x from either, on any machine's rounding.
CRITERION = 1e-4
LOGGED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def _pairs():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"add {a} and {b}"}],
                               "chosen": [{"role": "assistant", "content": str(a + b)}],
                               "rejected": [{"role": "assistant", "content": str(a + b + 1) * (1 + (a + b) % 3)}]}
                              for a in range(4) for b in range(4)])


def _dpo_trainer(trainer_class, arch, loss_type, optim, output_dir, per_device_batch, deepspeed=None, lora=False,
                 accumulation=ACCUMULATION):
    from peft import LoraConfig
    from trl import DPOConfig

    tokenizer = chat_tokenizer()
    configured = {"accelerator_config": {"use_configured_state": True}} if deepspeed else {}
    args = DPOConfig(output_dir=output_dir, per_device_train_batch_size=per_device_batch, max_steps=STEPS,
                     gradient_accumulation_steps=accumulation, optim=optim, learning_rate=LR[optim], logging_steps=1,
                     loss_type=[loss_type], beta=BETA, save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
                     bf16=False, deepspeed=deepspeed, **configured)
    model = tiny_model(arch, dtype=torch.float32, vocab_size=len(tokenizer))
    if not lora:
        return trainer_class(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=_pairs(),
                             processing_class=tokenizer)
    # TRL wraps the model in PEFT itself and, without a ref_model, takes the model with its adapters disabled as
    # the reference. Non-zero lora_B: policy and reference differ from the first step.
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"],
                             init_lora_weights=False)
    return trainer_class(model=model, args=args, train_dataset=_pairs(), processing_class=tokenizer,
                         peft_config=peft_config)


def _logged(trainer):
    return {key: [entry[key] for entry in trainer.state.log_history if key in entry] for key in LOGGED}


def _tsp_dpo_run(arch, loss_type, optim, zero_stage, output_dir, lora=False):
    from accelerate.state import AcceleratorState

    from ds_tsp.injection.model import TSPCausalLMMixin
    from ds_tsp.runtime.trainer import configure_cpu_ranks

    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": zero_stage},
              "tsp": {"enabled": True, "size": 2, "attention_backend": "sdpa"}}
    try:
        configure_cpu_ranks()
        trainer = _dpo_trainer(ds_tsp.TSPDPOTrainer, arch, loss_type, optim, output_dir, MICRO_BATCH, config, lora)
        trainer.train()
        trainer.save_model(os.path.join(output_dir, "final"))
        reference = trainer.ref_model
        if reference is None:  # LoRA: the policy with its adapters disabled
            return {"logged": _logged(trainer)}
        return {"logged": _logged(trainer), "reference_sharded": isinstance(reference, TSPCausalLMMixin),
                "reference_frozen": not any(p.requires_grad for p in reference.parameters())}
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _logps_scale(expected):
    """Beta times the sequences' log-probabilities: a reward is beta times a difference of log-probabilities
    (that start equal without adapters: 0 at the first step), so its rounding is theirs."""
    return BETA * max(abs(v) for key in ("logps/chosen", "logps/rejected") for v in expected[key])


def _errors(logged, expected):
    """``{key: largest error over the steps}``, relative to the key's largest value; rewards' to ``_logps_scale``."""
    return {key: _relative(logged[key], expected[key]) if not key.startswith("rewards/") else
            max(abs(a - b) for a, b in zip(logged[key], expected[key])) / _logps_scale(expected) for key in LOGGED}


def _relative(values, expected):
    values, expected = torch.as_tensor(values, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((values - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("arch, world, loss_type, optim", [
    ("llama", 2, "sigmoid", "adamw_torch"), ("llama", 4, "ipo", "sgd"), ("qwen3", 2, "ipo", "sgd"),
    ("qwen3", 4, "sigmoid", "adamw_torch")])
def test_dpo_trainer_matches_one_process(run_ranks, tmp_path, arch, world, loss_type, optim):
    from trl import DPOTrainer

    dp_size = world // 2
    zero_stage = 2 if dp_size > 1 else 1
    tsp = run_ranks(world, _tsp_dpo_run, arch=arch, loss_type=loss_type, optim=optim, zero_stage=zero_stage,
                    output_dir=str(tmp_path / "tsp"), timeout_s=400)[0]
    stock = _dpo_trainer(DPOTrainer, arch, loss_type, optim, str(tmp_path / "stock"), MICRO_BATCH * dp_size)
    stock.train()
    control = _dpo_trainer(DPOTrainer, arch, loss_type, optim, str(tmp_path / "control"),
                           MICRO_BATCH * dp_size * ACCUMULATION, accumulation=1)
    control.train()
    expected = _logged(stock)
    errors, control_errors = _errors(tsp["logged"], expected), _errors(_logged(control), expected)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tsp" / "final")
    reference = dict(stock.model.named_parameters())
    weights = max(_relative(p.detach(), reference[n].detach()) for n, p in reloaded.named_parameters())
    control_weights = max(_relative(p.detach(), reference[n].detach()) for n, p in control.model.named_parameters())
    start = dict(tiny_model(arch, dtype=torch.float32, vocab_size=reloaded.config.vocab_size).named_parameters())
    moved = max(_relative(p.detach(), start[n].detach()) for n, p in reloaded.named_parameters())
    bound, weights_bound = float32_bound(control_errors.values()), float32_bound([control_weights])
    print(f"DPO {arch} {loss_type} {optim} TSP=2 DP={dp_size} ZeRO-{zero_stage}: losses {tsp['logged']['loss']} vs "
          f"{expected['loss']}; max rel " + ", ".join(f"{key} {value:.1e}" for key, value in errors.items())
          + f" (the control's largest {max(control_errors.values()):.1e}, bound {bound:.1e}); weights {weights:.1e} "
          f"(the control's {control_weights:.1e}, bound {weights_bound:.1e}; moved {moved:.1e} from the start)")
    assert all(len(tsp["logged"][key]) == STEPS for key in LOGGED)
    assert max(errors.values()) <= bound and weights <= weights_bound
    assert moved > 100 * weights_bound  # the check can fail: training moved the weights far more than the bound
    assert tsp["reference_sharded"] and tsp["reference_frozen"]


def test_dpo_with_lora_matches_one_process(run_ranks, tmp_path):
    """DPO with a peft_config and no ref_model: TRL takes the policy with its adapters disabled as the reference
    (``use_adapter``), on the TSP model its sharded adapters switched off; the adapters saved in PEFT's format."""
    from peft import PeftModel
    from trl import DPOTrainer

    tsp = run_ranks(2, _tsp_dpo_run, arch="llama", loss_type="sigmoid", optim="sgd", zero_stage=1,
                    output_dir=str(tmp_path / "tsp"), lora=True, timeout_s=400)[0]
    stock = _dpo_trainer(DPOTrainer, "llama", "sigmoid", "sgd", str(tmp_path / "stock"), MICRO_BATCH, lora=True)
    start = {n: p.detach().clone() for n, p in stock.model.named_parameters() if "lora_" in n}
    stock.train()
    expected = _logged(stock)
    errors = _errors(tsp["logged"], expected)
    loaded = PeftModel.from_pretrained(tiny_model("llama", dtype=torch.float32, vocab_size=len(chat_tokenizer())),
                                       tmp_path / "tsp" / "final")
    trained = dict(stock.model.named_parameters())
    adapters = {n: p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
    weights = max(_relative(p, trained[n].detach()) for n, p in adapters.items())
    moved = max(_relative(trained[n].detach(), start[n]) for n in adapters)
    print(f"DPO + LoRA TSP=2: losses {tsp['logged']['loss']} vs {expected['loss']}, rewards/chosen "
          f"{tsp['logged']['rewards/chosen']} vs {expected['rewards/chosen']}; max rel "
          + ", ".join(f"{key} {value:.1e}" for key, value in errors.items())
          + f"; adapters {weights:.1e} (moved {moved:.1e} from the start)")
    assert sorted(adapters) == sorted(start) and len(adapters) == 3 * 2 * loaded.config.num_hidden_layers
    assert all(len(tsp["logged"][key]) == STEPS for key in LOGGED)
    assert max(errors.values()) <= CRITERION and weights <= CRITERION
    # The check can fail: a reference with its adapters on would give rewards of 0 at the first step, adapters
    # not loaded (PEFT's fresh ones) or not trained would be off by as much as training moved them.
    assert abs(expected["rewards/chosen"][0]) > 100 * CRITERION * _logps_scale(expected)
    assert moved > 100 * CRITERION


def _refusals(output_dir):
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from trl import DPOConfig, SFTConfig

    from ds_tsp.runtime.trainer import configure_cpu_ranks

    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 1},
              "tsp": {"enabled": True, "size": 2}}
    chats = Dataset.from_list([{"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "ok"}]}])
    # The last: a PeftModel without ref_model, beside whose adapter TRL adds a frozen copy, "ref".
    cases = ((ds_tsp.TSPDPOTrainer, DPOConfig, {"precompute_ref_log_probs": True}, _pairs()),
             (ds_tsp.TSPSFTTrainer, SFTConfig, {"label_smoothing_factor": 0.1}, chats),
             (ds_tsp.TSPDPOTrainer, DPOConfig, {}, _pairs()))
    found = []
    for index, (trainer_class, config_class, options, dataset) in enumerate(cases):
        try:
            configure_cpu_ranks()
            args = config_class(output_dir=output_dir, report_to=[], deepspeed=config, bf16=False,
                                accelerator_config={"use_configured_state": True}, **options)
            model = tiny_model("llama", dtype=torch.float32, vocab_size=len(chat_tokenizer()))
            extra = {"ref_model": copy.deepcopy(model)} if trainer_class is ds_tsp.TSPDPOTrainer else {}
            if index == 2:
                model, extra = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])), {}
            trainer_class(model=model, args=args, train_dataset=dataset, processing_class=chat_tokenizer(), **extra)
            found.append(None)
        except ValueError as error:
            found.append(str(error))
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
    return found


def test_what_a_tsp_trainer_cannot_take_is_refused_by_name(run_ranks, tmp_path):
    precompute, smoothing, second_adapter = run_ranks(2, _refusals, output_dir=str(tmp_path))[0]
    assert precompute and precompute.startswith("precompute_ref_log_probs = True") and "leave it False" in precompute
    assert smoothing and smoothing.startswith("label_smoothing_factor") and "leave it unset" in smoothing
    assert second_adapter and second_adapter.startswith("the PeftModel holds adapters ['default', 'ref']")
    assert "peft_config=LoraConfig(...)" in second_adapter and "ref_model=" in second_adapter
