"""``engine.compile()`` on TSP models (attention, latent attention, experts, Gated DeltaNet, Mamba-2 and
MLP-only layers): compiled training equals eager training
at TSP 2 (losses, every weight, every parameter moved) in float32 and float64,
and each decoder
layer's graph breaks fall at its blocks' schedules (``EagerFunction``), the same
on every rank and at every length, none inside a schedule's loops."""

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import ds_tsp
from ds_tsp.parallel.eager import EagerFunction
from float32_control import ROUNDING_FLOOR
from models import tiny_model

# A small step: the compiled kernels' float32 rounding moves the weights, and a larger step carries it further
# (at 0.1 the tiny Qwen3.5's losses differed by 1.2e-5, 12 units in the last place).
STEPS, SEQ_LEN, LR = 3, 16, 0.02
ARCHS = ("llama", "deepseek_v3", "qwen3_5", "gpt_oss", "nemotron_h")
# Breaks that mean dynamo traced into a schedule: at each of its asynchronous collectives (inside the ring and
# head-group loops) and at its host reads. Left to trace ds_tsp's autograd Functions, it broke a Llama layer at TSP 2
# into 26 graphs at the first and a DeepSeek-V3 expert layer into 42-45 at both; an EagerFunction is one break.
INSIDE_A_SCHEDULE = ("async_op=True for distributed collectives", "Data dependent operator", "Tensor.item()")


def _engine(model):
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
              "tsp": {"enabled": True, "size": dist.get_world_size(), "attention_backend": "sdpa"}}
    engine, *_ = ds_tsp.initialize(model=model, optimizer=lambda params: torch.optim.SGD(params, lr=LR),
                                   config=config)
    return engine


def _train(engine, batches):
    losses = []
    for batch in batches:
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def compiled_against_eager(arch, dtype=torch.float32):
    """Eager and compiled SGD training of the same tiny ``arch`` model in ``dtype`` at TSP = world size."""
    ref = tiny_model(arch, dtype=dtype)
    batches = [torch.randint(0, ref.config.vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(i))
               for i in range(STEPS)]
    eager = _engine(copy.deepcopy(ref))
    start = {name: param.detach().clone() for name, param in eager.module.named_parameters()}
    eager_losses = _train(eager, batches)
    compiled = _engine(copy.deepcopy(ref))
    torch._dynamo.reset()
    compiled.compile()
    compiled_losses = _train(compiled, batches)
    weights = dict(compiled.module.named_parameters())
    diffs, scales, unmoved = {}, {}, []
    for name, param in eager.module.named_parameters():
        diffs[name], scales[name] = (weights[name] - param).abs().max().item(), param.abs().max().item()
        if not torch.equal(param, start[name]) and torch.equal(weights[name], start[name]):
            unmoved.append(name)
    breaks = {seq_len: ds_tsp.layer_graph_breaks(eager.module, input_ids=batches[0][:, :seq_len])
              for seq_len in (SEQ_LEN // 2, SEQ_LEN)}
    return dict(losses=eager_losses, compiled_losses=compiled_losses, diffs=diffs, scales=scales, unmoved=unmoved,
                breaks=breaks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_training_equals_eager(run_ranks, arch, dtype):
    """Three SGD steps at TSP 2, eager and under ``engine.compile()``: the compiled kernels reorder float32
    sums and compute float32 functions their own way (Hugging Face's rotary tables are float32 in a float64
    model too), so losses and weights are held to float32's rounding floor of their scale (``ROUNDING_FLOOR``) in
    both dtypes; a parameter the eager run moves must move compiled too (a lost gradient would leave it). ZeRO-1:
    DeepSpeed's ZeRO-0 reduction takes no float64 gradients."""
    floor = ROUNDING_FLOOR
    per_rank = run_ranks(2, compiled_against_eager, arch=arch, dtype=dtype, timeout_s=1200)
    for rank, out in enumerate(per_rank):
        loss_diff = max(abs(a - b) for a, b in zip(out["losses"], out["compiled_losses"]))
        name, weight_diff = max(out["diffs"].items(), key=lambda item: item[1] / max(1.0, out["scales"][item[0]]))
        print(f"\n{arch} {dtype} rank {rank}: losses {out['losses']} compiled {out['compiled_losses']}, max loss diff "
              f"{loss_diff:.1e}, max weight diff {weight_diff:.1e} ({name}; its scale {out['scales'][name]:.2f})")
        for seq_len, layers in out["breaks"].items():
            for layer in layers:
                print(f"  {seq_len} tokens, layer {layer.index} ({layer.kind}): {layer.graphs} graphs, {layer.breaks} "
                      f"breaks: {layer.reasons}")
        assert loss_diff <= floor * max(map(abs, out["losses"])), out["losses"]
        assert weight_diff <= floor * max(1.0, out["scales"][name]) and not out["unmoved"], out["unmoved"]
        for layers in out["breaks"].values():
            assert [(layer.kind, layer.breaks) for layer in layers] == [
                (layer.kind, layer.breaks) for layer in per_rank[0]["breaks"][SEQ_LEN // 2]]
            for layer in layers:
                assert not any(inside in reason for inside in INSIDE_A_SCHEDULE for reason in layer.reasons), layer


def _breaks_with_traced_schedules():
    """The tiny Llama's layers' break reasons at TSP = world size with ds_tsp's Functions left for dynamo to trace
    (``EagerFunction.apply`` not disabled), as they were before."""
    model = ds_tsp.inject(tiny_model("llama", dtype=torch.float32), ds_tsp.TSPTopology(dist.get_world_size()),
                          ds_tsp.TSPConfig(enabled=True, size=dist.get_world_size(), attention_backend="sdpa"))
    traced = vars(torch.autograd.Function)["apply"]  # the classmethod EagerFunction overrides
    input_ids = torch.randint(0, model.config.vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with mock.patch.object(EagerFunction, "apply", traced):
        return [reason for layer in ds_tsp.layer_graph_breaks(model, input_ids=input_ids) for reason in layer.reasons]


def test_a_schedule_traced_by_dynamo_is_caught(run_ranks):
    """The guard of the break check above: with the schedules traced, dynamo breaks inside them, at their
    asynchronous collectives, and the check sees it."""
    for reasons in run_ranks(2, _breaks_with_traced_schedules):
        assert any(inside in reason for inside in INSIDE_A_SCHEDULE for reason in reasons), reasons


def _trainer_losses(output_dir, compiled):
    """A TSPTrainer's logged losses at TSP = world size over the same rows, with and without the Trainer's
    ``torch_compile``, and the names of the parameters training left as they were."""
    from accelerate.state import AcceleratorState
    from transformers import TrainerCallback, TrainingArguments

    start = {}

    class Snapshot(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            start.update({name: p.detach().clone() for name, p in model.named_parameters()})

    from ds_tsp.runtime.trainer import configure_cpu_ranks

    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
            for ids in torch.randint(3, 61, (8, SEQ_LEN), generator=generator)]
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 1},
              "tsp": {"enabled": True, "size": dist.get_world_size(), "attention_backend": "sdpa"}}
    try:
        configure_cpu_ranks()
        args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=2, max_steps=4, learning_rate=LR,
                                 adam_epsilon=1.0, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                                 report_to=[], seed=0, disable_tqdm=True, deepspeed=config, torch_compile=compiled,
                                 accelerator_config={"use_configured_state": True})
        torch._dynamo.reset()
        trainer = ds_tsp.TSPTrainer(model=tiny_model("qwen3_5", dtype=torch.float32), args=args, train_dataset=rows,
                                    callbacks=[Snapshot()])
        trainer.train()
        unmoved = sorted(name for name, p in trainer.model_wrapped.module.named_parameters()
                         if torch.equal(p, start[name]))
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], unmoved
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_the_trainers_torch_compile_trains_as_eager(run_ranks, tmp_path):
    """The Trainer's ``torch_compile`` (accelerate's ``engine.compile()``) on a TSP Qwen3.5 (Gated DeltaNet and
    gated attention) at TSP 2, AdamW with an epsilon of 1 (so that Adam's normalisation does not blow float32
    rounding up on near-zero gradients): the same losses as without it, to float32's rounding floor, and every
    parameter moved."""
    (eager, eager_unmoved), _ = run_ranks(2, _trainer_losses, output_dir=str(tmp_path / "eager"), compiled=False,
                                          timeout_s=1200)
    (compiled, unmoved), _ = run_ranks(2, _trainer_losses, output_dir=str(tmp_path / "compiled"), compiled=True,
                                       timeout_s=1200)
    print(f"\nTrainer losses eager {eager}, torch_compile {compiled}; unmoved {eager_unmoved}, {unmoved}")
    assert len(eager) == len(compiled) == 4 and not eager_unmoved and not unmoved
    assert max(abs(a - b) for a, b in zip(eager, compiled)) <= ROUNDING_FLOOR * max(map(abs, eager))
