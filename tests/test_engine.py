"""ds_tsp.initialize with DeepSpeed: ZeRO over DP, clipping, and the launcher."""

import copy
import json
import os
import re
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

import ds_tsp
from ds_tsp.parallel import comm
from ds_tsp.inference.generate import cached_forward
from ds_tsp.blocks.vocab import shard_rows
from float32_control import float32_bound, relative_errors
from models import COMMON, tiny_model
from parity import held_pieces
from scripts import start_script

STEPS = 3
MICRO_BATCH = 2
SEQ_LEN = 16
LR = {"sgd": 0.1, "adam": 1e-2}
# Distances are relative to max |w| per tensor, against the same training in float64, and bounded by what
# float32 does to the one-process control run on this machine (tests/float32_control.py).
# ZeRO-3 with every parameter partitioned (none kept whole for being small)
# and small buckets, so each is gathered and released around the TSP functions.
ZERO3_PARTITIONED = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 256,
                     "reduce_bucket_size": 256, "stage3_max_live_parameters": 1024}


def _optimizer(name, lr=None):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr or LR["sgd"])
    return lambda params: torch.optim.Adam(params, lr=lr or LR["adam"])


def _global_batches(vocab_size, dp_size):
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab_size, (dp_size * MICRO_BATCH, SEQ_LEN), generator=generator) for _ in range(STEPS)]


def _step(engine, batch):
    """One optimizer step on this data-parallel replica's micro-batch of ``batch``."""
    topo = engine.tsp_topology
    micro = batch[topo.dp_rank * MICRO_BATCH:(topo.dp_rank + 1) * MICRO_BATCH]
    loss = engine(input_ids=micro, labels=micro).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def _train_and_compare(tsp_size, zero_stage, optimizer, activation_checkpointing=False, config_optimizer=False,
                       wrong_shard=False, arch="llama", offload_optimizer=False, moe_schedule="ring",
                       dtype=torch.float32, tsp_options=None, lr=None):
    world = dist.get_world_size()
    dp_size = world // tsp_size
    # num_key_value_heads=2: at TSP=4 each key/value head serves two head groups
    # and is stored once, so the clipped norm counts it once.
    ref = tiny_model(arch, dtype=dtype)
    model = copy.deepcopy(ref)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": zero_stage, **(ZERO3_PARTITIONED if zero_stage == 3 else {})},
              "zero_allow_untested_optimizer": True,
              "tsp": {"enabled": True, "size": tsp_size, "attention_backend": "sdpa", "moe_schedule": moe_schedule,
                      **(tsp_options or {})}}
    if activation_checkpointing:
        # "cpu": each layer's checkpointed input waits for backward in host memory.
        config["activation_checkpointing"] = {"partition_activations": False,
                                              "cpu_checkpointing": activation_checkpointing == "cpu"}
    if offload_optimizer:  # ZeRO keeps optimizer states and fp32 master weights in host memory
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["zero_force_ds_cpu_optimizer"] = False  # the client's torch optimizer, not DeepSpeedCPUAdam
    client_optimizer = _optimizer(optimizer, lr)
    if config_optimizer:  # named in the config: DeepSpeed builds torch.optim.SGD itself
        assert optimizer == "sgd"
        config["optimizer"] = {"type": "SGD", "params": {"lr": LR["sgd"]}}
        client_optimizer = None
    engine, _, _, _ = ds_tsp.initialize(model=model, optimizer=client_optimizer, config=config)
    if wrong_shard and engine.tsp_topology.tsp_rank == 1:
        with torch.no_grad():  # ZeRO-0: the optimizer updates this very tensor
            engine.module.model.layers[0].mlp.packed.mul_(1.5)
    batches = _global_batches(ref.config.vocab_size, dp_size)
    # The float32 run's truth is the same training in float64; the one-process float32 run is the control that
    # says how far this machine's float32 rounding carries this computation (tests/float32_control.py).
    truth = copy.deepcopy(ref).double()
    losses, norms = [], []
    for batch in batches:
        losses.append(_step(engine, batch))
        # ZeRO-0 in fp32 clips without recording the norm; the weights still show it.
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    ref_losses, ref_norms = _reference_run(ref, _optimizer(optimizer, lr), batches, dp_size)
    _, exact_norms = _reference_run(truth, _optimizer(optimizer, lr), batches, dp_size)

    ref_params, exact_params = dict(ref.named_parameters()), dict(truth.named_parameters())
    partitioned = zero_stage == 3 and all(_released(param) for param in engine.module.parameters())
    with _gathered(engine, zero_stage):
        rel = _relative_to(engine.module, ref_params)
        rel_exact = _relative_to(engine.module, exact_params)
    control_rel = {name: _relative(ref_params[name].detach(), param.detach()) for name, param in exact_params.items()}
    generated = _generates_as_reference(engine.module, ref)
    recomputed = all(layer.gradient_checkpointing for layer in engine.module.model.layers)
    # ZeRO-1/2 and ZeRO-3 optimizers each say whether their states live in host memory.
    offloaded = bool(getattr(engine.optimizer, "cpu_offload", False) or getattr(engine.optimizer, "offload_optimizer",
                                                                                  False))
    return dict(rel=rel, rel_exact=rel_exact, control_rel=control_rel, losses=losses, ref_losses=ref_losses,
                norms=norms, ref_norms=ref_norms, exact_norms=exact_norms, recomputed=recomputed,
                partitioned=partitioned, offloaded=offloaded, generated=generated,
                optimizer_states=_optimizer_states(engine))


def _reference_run(model, make_optimizer, batches, dp_size):
    """One process's training on the whole global batches: its losses and its clipped gradient norms."""
    optimizer = make_optimizer(list(model.parameters()))
    losses, norms = [], []
    for batch in batches:
        optimizer.zero_grad()
        loss = _replicas_loss(model, batch, dp_size)
        loss.backward()
        # DeepSpeed's default gradient_clipping is 1.0: clip the reference the same way.
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        losses.append(loss.item())
    return losses, norms


def assert_within_control(out, label):
    """The TSP run's weights and gradient norms, against the float64 truth, within what float32 rounding does to
    the one-process control run on this machine (tests/float32_control.py), printed with ``label``."""
    weights, weights_control = max(out["rel_exact"].values()), max(out["control_rel"].values())
    worst = max(out["rel_exact"], key=out["rel_exact"].get)
    norms = relative_errors(out["norms"], out["exact_norms"])
    norms_control = relative_errors(out["ref_norms"], out["exact_norms"])
    print(f"{label}: max rel |dw| against float64 {weights:.2e} ({worst}), the float32 control's {weights_control:.2e}"
          f"; grad-norm rel err by step {[f'{err:.1e}' for err in norms]}, the control's "
          f"{[f'{err:.1e}' for err in norms_control]}; losses {[round(v, 5) for v in out['losses']]} (one process "
          f"{[round(v, 5) for v in out['ref_losses']]})")
    assert weights <= float32_bound([weights_control])
    assert max(norms, default=0.0) <= float32_bound(norms_control)


def _optimizer_states(engine):
    """``{"experts" or "dense": elements}`` of the float32 partitions this
    rank's ZeRO 1-2 optimizer steps, its padding left out (None otherwise)."""
    optimizer = engine.optimizer
    if not hasattr(optimizer, "single_partition_of_fp32_groups"):
        return None
    held = {"experts": 0, "dense": 0}
    for index, partition in enumerate(optimizer.single_partition_of_fp32_groups):
        moe = bool(getattr(optimizer, "is_moe_param_group", None) and optimizer.is_moe_param_group[index])
        held["experts" if moe else "dense"] += partition.numel() - optimizer.groups_padding[index]
    return held


def _replicas_loss(model, batch, dp_size):
    """As under DDP: the mean of the replicas' losses. For a dense model that is the whole batch's loss; a
    mixture-of-experts model's load-balancing loss is over each replica's batch."""
    return sum(model(input_ids=micro, labels=micro).loss for micro in batch.split(MICRO_BATCH)) / dp_size


def _generates_as_reference(model, ref):
    """Whether the trained engine's model generates the reference's greedy
    tokens, or "refused" (ZeRO-3 keeps the shards partitioned); and one decode
    step's bytes by collective."""
    prompt = torch.arange(1, 9).unsqueeze(0)
    try:
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, pad_token_id=0)
    except ValueError as refusal:
        assert "ZeRO-3" in str(refusal) or "tsp.expert_parallel_size" in str(refusal), refusal
        return "refused", None
    logits, cache = cached_forward(model, prompt, logits_to_keep=1)
    comm.counter.reset()
    cached_forward(model, logits.argmax(dim=-1), cache=cache, logits_to_keep=1)
    same = torch.equal(tokens, ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                                            pad_token_id=0))
    return same, comm.counter.snapshot()


def _shared_memory_decode_step_bytes(tsp_size, batch=1, e=4):
    """``ds_tsp.inference.generate``'s decode-step bytes where DeepSpeed's shared-memory
    all-reduce carries them (float32: e = a = 4)."""
    hq, hkv = COMMON["num_attention_heads"] // tsp_size, max(COMMON["num_key_value_heads"] // tsp_size, 1)
    d, hidden = COMMON["head_dim"], COMMON["hidden_size"]
    per_layer = 2 * (tsp_size - 1) * batch * ((hq + 2 * hkv) * d + tsp_size * hq * (d + 1) + 2 * hidden) * e
    outside = 2 * (tsp_size - 1) * batch * (hidden + shard_rows(COMMON["vocab_size"], tsp_size)) * e
    return COMMON["num_hidden_layers"] * per_layer + outside


def _released(param):
    """A ZeRO-3 parameter between steps: released, only this rank's partition
    (all of it at DP=1) kept aside."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return param.ds_status == ZeroParamStatus.NOT_AVAILABLE and param.numel() == 0


def _relative_to(module, ref_params):
    """``{name: relative distance}`` of every tensor ``module`` holds (a TSP
    shard: the pieces it holds) to the reference's Hugging Face parameters, by
    Hugging Face name."""
    detached = {name: param.detach() for name, param in ref_params.items()}
    return {name: _relative(value, expected) for name, _, value, expected in held_pieces(module, detached)}


def _relative(value, expected):
    return ((value.float() - expected).abs().max() / expected.abs().max()).item()


def _gathered(engine, zero_stage):
    import contextlib

    import deepspeed
    if zero_stage == 3:
        return deepspeed.zero.GatheredParameters(list(engine.module.parameters()))
    return contextlib.nullcontext()


@pytest.mark.parametrize("world, tsp_size, zero_stage, optimizer, activation_checkpointing, config_optimizer, arch, "
                         "offload_optimizer", [
    (4, 2, 1, "sgd", False, False, "llama", False), (4, 2, 2, "sgd", False, False, "llama", False),
    (4, 2, 1, "adam", False, False, "llama", False), (4, 2, 2, "adam", False, False, "llama", True),
    (4, 4, 0, "adam", False, False, "llama", False), (2, 2, 3, "sgd", False, False, "llama", False),
    (4, 2, 3, "adam", False, False, "qwen3", True),  # per-head norms: replicated, gathered, summed
    (4, 2, 1, "adam", True, False, "llama", False), (4, 2, 2, "sgd", False, True, "llama", False),
    (2, 2, 3, "adam", "cpu", False, "qwen3", True),  # states and checkpoints in host memory, ZeRO-3
    # Experts on the ring (a shared expert too) with the load-balancing loss, which is over each replica's
    # batch (as under DDP, and in the reference). Mixtral with Adam at DP=2 drifts to 1.2e-4 on its experts
    # though its gradient norms agree within 2.5e-7 at the first step and its SGD weights within 1e-7.
    (4, 2, 1, "adam", False, False, "qwen2_moe", False), (4, 2, 2, "adam", False, False, "qwen2_moe", False),
    (4, 2, 1, "sgd", False, False, "mixtral", False), (4, 2, 2, "sgd", False, False, "qwen3_moe", False),
    (4, 2, 0, "sgd", False, False, "qwen3_moe", False),
    (2, 2, 3, "adam", False, False, "mixtral", False),
    # GLM-4.5: a dense first layer, sigmoid routing with a score-correction bias (a buffer, broadcast, not
    # trained), an ungated shared expert on the ring; TSP 2 x DP 2 under ZeRO-2 and TSP 2 under ZeRO-3.
    (4, 2, 2, "adam", False, False, "glm4_moe", False), (2, 2, 3, "adam", False, False, "glm4_moe", False),
    # DeepSeek-V3: multi-head latent attention (YaRN's mscale on its scale) around GLM-4.5's kind of MoE.
    (4, 2, 2, "adam", False, False, "deepseek_v3", False), (2, 2, 3, "adam", False, False, "deepseek_v3", False),
    # DeepSeek-V3.2: its lightning indexer chooses each query's keys (its weights take no gradient, as in HF's).
    (4, 2, 2, "adam", False, False, "deepseek_v32", False),
    # GPT-OSS: attention sinks in the head groups' shards, biased experts (E, H, 2F), a router with a bias.
    (4, 2, 2, "adam", False, False, "gpt_oss", False), (2, 2, 3, "adam", False, False, "gpt_oss", False),
    # Qwen3.5: Gated DeltaNet layers (chunk maps and convolution halos exchanged per head group) and a gated
    # attention layer, as Hugging Face initialises them (tests/models.py HF_INIT: float32 cannot follow the
    # tests' usual init); SGD, whose updates do not magnify the zero-initialised norms' rounding as Adam's do.
    (4, 2, 2, "sgd", False, False, "qwen3_5_hf_init", False), (2, 2, 3, "sgd", False, False, "qwen3_5_hf_init", False),
    # Four replicated norms a layer (sandwich, Gemma's scaled embedding folded) under ZeRO-3; OLMo-2's q/k norms
    # over the projection (an extra round of shards and its weight-gradient reduces) under ZeRO-3 too.
    (4, 2, 3, "adam", False, False, "gemma2", False), (4, 2, 3, "adam", False, False, "olmo2", False),
    # Issue 62's families under ZeRO-2 over TSP 2 x DP 2: GLM-4 (its own interleaved rotary, gate_up_proj, sandwich
    # norms under its names) and ERNIE 4.5-MoE (its float32 rotary and router, a frozen score-correction bias).
    # (Cohere's and Granite's scaled logits keep the tiny models' gradient norms under the clipping threshold this
    # test must cross.)
    (4, 2, 2, "adam", False, False, "glm4", False), (4, 2, 2, "adam", False, False, "ernie4_5_moe", False),
    # Llama 4: chunked and NoPE layers, temperature-tuned queries, experts whose inputs the routing weights scale.
    (4, 2, 2, "adam", False, False, "llama4", False),
    # Gemma 4: full layers of wider heads whose keys are their values, normed values, layer_scalar; and its
    # experts beside every layer's MLP.
    (4, 2, 2, "adam", False, False, "gemma4", False), (4, 2, 2, "adam", False, False, "gemma4_moe", False),
    # Gemma 4's keys and values shared across layers and its per-layer inputs, under DeepSpeed's activation
    # checkpointing: each layer's shared keys and values are its checkpoint's second output or input, its
    # per-layer input one more input.
    (4, 2, 2, "adam", True, False, "gemma4_layer_inputs", False),
    # Granite-4.0-H: Mamba-2 mixers (the chunk maps, the halos and the B/C pieces over the group), a NoPE attention
    # layer, Granite's multipliers; TSP 2 x DP 2 under ZeRO-2 and TSP 2 under ZeRO-3.
    (4, 2, 2, "adam", False, False, "granitemoehybrid", False), (2, 2, 3, "adam", False, False, "granitemoehybrid", False),
    # Jamba's Mamba-1 mixers and MoE under ZeRO-3; LFM2-MoE's short convolutions and expert-biased router over TSP 2
    # x DP 2 under ZeRO-2.
    (2, 2, 3, "adam", False, False, "jamba", False), (4, 2, 2, "adam", False, False, "lfm2_moe", False),
])
def test_training_matches_a_single_process_run(run_ranks, world, tsp_size, zero_stage, optimizer,
                                               activation_checkpointing, config_optimizer, arch, offload_optimizer):
    for rank, out in enumerate(run_ranks(world, _train_and_compare, tsp_size=tsp_size, zero_stage=zero_stage,
                                         optimizer=optimizer, activation_checkpointing=activation_checkpointing,
                                         config_optimizer=config_optimizer, arch=arch,
                                         offload_optimizer=offload_optimizer)):
        assert_within_control(out, f"rank {rank} {arch} TSP={tsp_size} DP={world // tsp_size} ZeRO-{zero_stage}"
                                   f"{' optimizer offloaded' if offload_optimizer else ''} {optimizer}")
        assert max(out["ref_norms"]) > 1.0, "the test must exercise clipping"
        assert zero_stage == 0 or None not in out["norms"]
        assert out["recomputed"] == bool(activation_checkpointing)
        assert out["partitioned"] == (zero_stage == 3)
        assert out["offloaded"] == offload_optimizer
        generated, step_ops = out["generated"]
        assert generated == ("refused" if zero_stage == 3 else True)
        if world == tsp_size and zero_stage < 3:  # the TSP group is the world: DeepSpeed's shared-memory all-reduce
            assert set(step_ops) == {"all_reduce"}
            assert step_ops["all_reduce"]["received"] == _shared_memory_decode_step_bytes(tsp_size)
        elif step_ops is not None:
            assert set(step_ops) <= {"all_gather", "all_to_all"}


@pytest.mark.parametrize("world, zero_stage, arch", [(4, 2, "qwen2_moe"), (2, 3, "mixtral")])
def test_moe_all_to_all_trains_like_a_single_process(run_ranks, world, zero_stage, arch):
    """Tokens to their experts by all-to-all (experts at rest, their gradients
    summed where they live): TSP 2 x DP 2 under ZeRO-2 (Qwen2-MoE, its shared
    expert still on the ring) and TSP 2 under ZeRO-3 (Mixtral), Adam, as the
    ring's rows above."""
    for rank, out in enumerate(run_ranks(world, _train_and_compare, tsp_size=2, zero_stage=zero_stage,
                                         optimizer="adam", arch=arch, moe_schedule="all_to_all")):
        assert_within_control(out, f"rank {rank} all-to-all {arch} TSP=2 DP={world // 2} ZeRO-{zero_stage}")
        assert any("experts.gate_up_proj" in name for name in out["rel"])
        assert out["partitioned"] == (zero_stage == 3)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_tied_embeddings_train_like_a_single_process(run_ranks, zero_stage):
    """The folded vocabulary's one shard serves the embedding and the head; ZeRO
    reduces (and at stage 3 partitions and gathers) it like any parameter."""
    for rank, out in enumerate(run_ranks(4, _train_and_compare, tsp_size=2, zero_stage=zero_stage, optimizer="adam",
                                         arch="llama_tied")):
        assert_within_control(out, f"rank {rank} tied TSP=2 DP=2 ZeRO-{zero_stage}")
        assert "model.embed_tokens.weight" in out["rel"]


def test_the_comparison_catches_a_wrong_shard(run_ranks):
    per_rank = run_ranks(2, _train_and_compare, tsp_size=2, zero_stage=0, optimizer="sgd", wrong_shard=True)
    for out in per_rank:
        worst, bound = max(out["rel_exact"].values()), float32_bound(out["control_rel"].values())
        print(f"wrong shard: max rel |dw| {worst:.2e} against float64, bound {bound:.1e}")
        assert worst > 1e3 * bound


@pytest.mark.parametrize("section, match", [
    ({"sequence_parallel_size": 2}, r"sequence_parallel_size = 2 turns on DeepSpeed-Ulysses"),
    ({"tensor_parallel": {"autotp_size": 2}}, r"tensor_parallel.autotp_size = 2 turns on DeepSpeed AutoTP"),
    ({"activation_checkpointing": {"cpu_checkpointing": True}, "tsp": {"pipeline_stages": 2}},
     r"cpu_checkpointing = true is not supported with tsp.pipeline_stages = 2"),
])
def test_what_tsp_cannot_combine_with_is_refused(section, match):
    model = tiny_model("llama", dtype=torch.float32)
    section = dict(section)
    tsp = {"enabled": True, "size": 1, **section.pop("tsp", {})}
    with pytest.raises(ValueError, match=match):
        ds_tsp.initialize(model=model, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                          config={"train_micro_batch_size_per_gpu": 1, **section, "tsp": tsp})
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"  # refused before injection


def _float64_steps(zero_stage):
    """Two SGD steps of a float64 tiny Llama at TSP = world size: the losses, or the error raised."""
    model = tiny_model("llama", dtype=torch.float64)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "zero_optimization": {"stage": zero_stage},
              "zero_allow_untested_optimizer": True,
              "tsp": {"enabled": True, "size": dist.get_world_size(), "attention_backend": "sdpa"}}
    engine, *_ = ds_tsp.initialize(model=model, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                                   config=config)
    batch = torch.randint(0, model.config.vocab_size, (MICRO_BATCH, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    try:
        for _ in range(2):
            losses.append(_step(engine, batch))
    except ValueError as err:
        return str(err)
    return losses


def test_float64_gradients_at_zero_0_are_refused_by_key(run_ranks):
    """DeepSpeed's ZeRO-0 reduction asserts on float64 gradients from inside DeepSpeed; a TSP engine names the
    key to change instead, and ZeRO-1, which the message points to, trains the same model."""
    for refusal in run_ranks(2, _float64_steps, zero_stage=0):
        assert refusal.startswith("zero_optimization.stage 0: DeepSpeed's gradient reduction takes") and \
            "torch.float64: set zero_optimization.stage to 1" in refusal, refusal
    for losses in run_ranks(2, _float64_steps, zero_stage=1):
        assert len(losses) == 2 and losses[1] < losses[0], losses


def _decay_groups(model, no_decay_for_biases=True):
    """AdamW groups as the Hugging Face Trainer builds them: no decay on biases and norm weights."""
    names = [n for n, _ in model.named_parameters()]
    excluded = {n for n in names if "norm" in n or (no_decay_for_biases and n.endswith("bias"))}
    params = dict(model.named_parameters())
    return [{"params": [params[n] for n in names if n not in excluded], "weight_decay": 0.5},
            {"params": [params[n] for n in names if n in excluded], "weight_decay": 0.0}]


def _client_optimizer_run(zero_stage, as_model_parameters):
    """TSP x DP with an AdamW built on the unsharded Qwen2 (q/k/v biases: each
    packed attention shard mixes decayed weights and undecayed biases), or its
    groups given as model_parameters, against one process's AdamW on the same
    groups, and against one that (wrongly) decays the biases too."""
    world = dist.get_world_size()
    ref = tiny_model("qwen2", dtype=torch.float32)
    model = copy.deepcopy(ref)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": zero_stage, **(ZERO3_PARTITIONED if zero_stage == 3 else {})},
              "zero_allow_untested_optimizer": True, "tsp": {"enabled": True, "size": 2, "attention_backend": "sdpa"}}
    lr = 3e-2
    if as_model_parameters:
        engine, *_ = ds_tsp.initialize(model=model, model_parameters=_decay_groups(model), config=config,
                                       optimizer=lambda groups: torch.optim.AdamW(groups, lr=lr))
    else:
        optimizer = torch.optim.AdamW(_decay_groups(model), lr=lr)
        engine, *_ = ds_tsp.initialize(model=model, optimizer=optimizer, config=config)
    batches = _global_batches(ref.config.vocab_size, world // 2)
    for batch in batches:
        _step(engine, batch)
    wrong = _adamw_trained(copy.deepcopy(ref).double(), lambda m: _decay_groups(m, False), lr, batches)
    with _gathered(engine, zero_stage):
        result = _against_truth(engine.module, ref, _decay_groups, lr, batches)
        result["biases decayed"] = max(_relative_to(engine.module, dict(wrong.named_parameters())).values())
    return result


def _adamw_trained(model, groups, lr, batches):
    """``model`` after one process's AdamW steps over ``groups(model)`` on the whole global batches."""
    optimizer = torch.optim.AdamW(groups(model), lr=lr)
    for batch in batches:
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
    return model


def _against_truth(module, ref, groups, lr, batches):
    """The TSP ``module``'s largest relative distance to one process's float64 AdamW run (the truth), and the
    float32 control's (the same run in float32) to it."""
    truth = _adamw_trained(copy.deepcopy(ref).double(), groups, lr, batches)
    control = _adamw_trained(ref, groups, lr, batches)
    exact = dict(truth.named_parameters())
    return {"tsp": max(_relative_to(module, exact).values()),
            "control": max(_relative(control.get_parameter(name).detach(), p.detach()) for name, p in exact.items())}


@pytest.mark.parametrize("world, zero_stage, as_model_parameters",
                         [(4, 1, False), (4, 2, True), (2, 0, False), (4, 3, False)])
def test_an_optimizer_built_on_the_unsharded_model_is_rebuilt_over_the_shards(run_ranks, world, zero_stage,
                                                                            as_model_parameters):
    per_rank = run_ranks(world, _client_optimizer_run, zero_stage=zero_stage, as_model_parameters=as_model_parameters)
    distances = {label: max(d[label] for d in per_rank) for label in per_rank[0]}
    bound = float32_bound([distances["control"]])
    print(f"TSP=2 DP={world // 2} ZeRO-{zero_stage}: max rel |dw| against float64 {distances['tsp']:.1e}, the float32 "
          f"control's {distances['control']:.1e} (bound {bound:.1e}), against decayed biases "
          f"{distances['biases decayed']:.1e}")
    assert distances["tsp"] <= bound
    assert distances["biases decayed"] >= 10 * bound


def _fused_projections_under_a_client_optimizer():
    """Phi-3 with an AdamW built on the unsharded model, whose parameters are
    qkv_proj and gate_up_proj: each packed shard, holding their rows, joins it."""
    ref = tiny_model("phi3", dtype=torch.float32)
    model = copy.deepcopy(ref)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "tsp": {"enabled": True, "size": 2, "attention_backend": "sdpa"}}
    engine, *_ = ds_tsp.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-2),
                                   config=config)
    batches = _global_batches(ref.config.vocab_size, dist.get_world_size() // 2)
    for batch in batches:
        _step(engine, batch)
    return _against_truth(engine.module, ref, lambda m: m.parameters(), 3e-2, batches)


def test_an_optimizer_over_fused_projections_is_rebuilt_over_their_rows(run_ranks):
    for rank, out in enumerate(run_ranks(4, _fused_projections_under_a_client_optimizer)):
        print(f"rank {rank} phi3 TSP=2 DP=2 ZeRO-1, AdamW over the unsharded model: max rel |dw| against float64 "
              f"{out['tsp']:.2e}, the float32 control's {out['control']:.2e}")
        assert out["tsp"] <= float32_bound([out["control"]])


def test_an_optimizer_that_already_stepped_is_refused():
    model = tiny_model("llama", dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    optimizer.step()
    with pytest.raises(ValueError, match="already taken a step"):
        ds_tsp.initialize(model=model, optimizer=optimizer,
                          config={"train_micro_batch_size_per_gpu": 1, "tsp": {"enabled": True, "size": 1}})
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"  # refused before injection


def test_example_trains_under_the_deepspeed_launcher(tmp_path, own_processes):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", "29517", os.path.join(root, "examples", "train.py"),
           "--deepspeed_config", os.path.join(root, "ds_configs", "tsp2_cpu.json"), "--steps", "20", "--log-every",
           "5"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{\"step\"")]
    print("\n".join(json.dumps(r) for r in records))
    assert len(records) == 4
    # The example's last line: mean loss of the first 5 steps -> of the last 5.
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    assert last < first - 0.5


def _losses(engine, batches):
    return [_step(engine, batch) for batch in batches]


def _save_and_resume(checkpoint_dir):
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "zero_optimization": {"stage": 1},
              "tsp": {"enabled": True, "size": 2, "attention_backend": "sdpa"}}

    def fresh_engine():
        engine, *_ = ds_tsp.initialize(model=tiny_model("llama", dtype=torch.float32),
                                       optimizer=_optimizer("adam"), config=config)
        return engine

    generator = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 61, (2 * MICRO_BATCH, SEQ_LEN), generator=generator) for _ in range(4)]
    uninterrupted = _losses(fresh_engine(), batches)
    first = fresh_engine()
    before = _losses(first, batches[:2])
    first.save_checkpoint(checkpoint_dir, tag="step2")
    resumed = fresh_engine()
    resumed.load_checkpoint(checkpoint_dir, tag="step2")
    return dict(uninterrupted=uninterrupted, resumed=before + _losses(resumed, batches[2:]))


def test_resume_from_a_checkpoint_reproduces_the_losses(run_ranks, tmp_path):
    for rank, out in enumerate(run_ranks(4, _save_and_resume, checkpoint_dir=str(tmp_path / "ckpt"))):
        print(f"rank {rank}: uninterrupted {out['uninterrupted']}, resumed {out['resumed']}")
        assert out["resumed"] == out["uninterrupted"]
    # Each TSP rank wrote its own shard of the model (model-parallel files).
    names = sorted(os.listdir(tmp_path / "ckpt" / "step2"))
    assert [n for n in names if n.startswith("mp_rank")] == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]


def test_a_dead_rank_fails_its_peer_instead_of_hanging(tmp_path):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_that_dies.py")
    start = time.monotonic()
    started = [start_script([script, rank, tmp_path / "rdzv"], env={**os.environ, "OMP_NUM_THREADS": "1"})
               for rank in range(2)]
    procs = [s.wait(timeout=120) for s in started]
    elapsed = time.monotonic() - start
    outputs = [p.stdout + p.stderr for p in procs]
    print(f"survivor exited {procs[0].returncode} after {elapsed:.1f} s: {outputs[0].strip().splitlines()[-1]}")
    assert procs[1].returncode == 3, outputs[1]
    assert procs[0].returncode != 0, outputs[0]
    assert elapsed < 60


def _train_save_and_gather(model_dir, checkpoint_dir, gathered_dir, tsp_options):
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "zero_optimization": {"stage": 1},
              "tsp": {"enabled": True, "size": 2, "attention_backend": "sdpa", **tsp_options}}
    engine, *_ = ds_tsp.initialize(model=model_dir, optimizer=_optimizer("adam"), config=config)
    _losses(engine, [torch.randint(0, 61, (2 * MICRO_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(2))])
    engine.save_checkpoint(checkpoint_dir)
    ds_tsp.save_pretrained(engine.module, gathered_dir)


# MoE: per-expert files, as transformers writes them; Phi-3: fused qkv_proj and gate_up_proj, joined from their rows.
# Experts folded over both replicas (with Qwen2-MoE's shared expert a TSP MLP of its own) export from the float32
# masters: the model states hold replica 0's experts, and a plain export is refused.
@pytest.mark.parametrize("arch, tsp_options", [("llama", {}), ("qwen2_moe", {}), ("phi3", {}), ("deepseek_v3", {}),
                                               ("gemma4_moe", {}), ("gemma4_layer_inputs", {}), ("granitemoe", {}),
                                               ("qwen2_moe", {"expert_parallel_size": 4}), ("jamba", {}),
                                               ("lfm2_biased", {})])
def test_export_turns_a_deepspeed_checkpoint_into_hugging_face(run_ranks, tmp_path, arch, tsp_options):
    from safetensors.torch import load_file

    from ds_tsp.cli import main as cli

    tiny_model(arch, dtype=torch.float32).save_pretrained(tmp_path / "hf")
    run_ranks(4, _train_save_and_gather, model_dir=str(tmp_path / "hf"), checkpoint_dir=str(tmp_path / "ds"),
              gathered_dir=str(tmp_path / "gathered"), tsp_options=tsp_options)
    flags = ["--fp32-master"] if tsp_options else []
    if tsp_options:
        assert cli(["export", "--checkpoint", str(tmp_path / "ds"), "--model", str(tmp_path / "hf"),
                    "--out", str(tmp_path / "exported")]) == 1  # the model states hold replica 0's experts
    assert cli(["export", "--checkpoint", str(tmp_path / "ds"), "--model", str(tmp_path / "hf"),
                "--out", str(tmp_path / "exported"), *flags]) == 0
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    gathered = load_file(tmp_path / "gathered" / "model.safetensors")
    original = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == gathered.keys() == original.keys()
    assert all(torch.equal(exported[n], gathered[n]) for n in exported)
    assert not all(torch.equal(exported[n], original[n]) for n in exported), "training changed nothing?"
    assert cli(["export", "--checkpoint", str(tmp_path / "ds"), "--model", str(tmp_path / "hf"),
                "--out", str(tmp_path / "exported")]) == 1  # exists: refused without --force


def _bf16_and_fp32_losses():
    losses = {}
    for dtype in ("bf16", "fp32"):
        config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "zero_optimization": {"stage": 1},
                  "bf16": {"enabled": dtype == "bf16"}, "tsp": {"enabled": True, "size": 2}}
        engine, *_ = ds_tsp.initialize(model=tiny_model("llama", dtype=torch.float32), config=config,
                                       optimizer=_optimizer("adam"))
        losses[dtype] = _losses(engine, _global_batches(61, engine.tsp_topology.dp_size))
        losses[f"{dtype}_param_dtype"] = str(next(engine.module.parameters()).dtype)
    return losses


def test_bf16_training_follows_fp32(run_ranks):
    for rank, out in enumerate(run_ranks(4, _bf16_and_fp32_losses)):
        print(f"rank {rank}: bf16 {out['bf16']}, fp32 {out['fp32']}")
        assert out["bf16_param_dtype"] == "torch.bfloat16" and out["fp32_param_dtype"] == "torch.float32"
        # bf16 keeps 8 mantissa bits: losses agree to ~1e-2, not to fp32 rounding.
        assert max(abs(a - b) for a, b in zip(out["bf16"], out["fp32"])) < 5e-2


def _one_step_over_uneven_padding(world_tsp_size, accumulation, global_mean):
    """One SGD step of TSP x DP with ``accumulation`` micro-steps whose
    micro-batches hold very different numbers of real tokens (right padding).
    With ``global_mean``, ``ds_tsp.num_items_in_batch`` is passed. Returns the
    weights' relative distance to one process's step on the global batch's
    mean over all target tokens, and on the mean of the micro-batch means."""
    world = dist.get_world_size()
    dp_size = world // world_tsp_size
    ref = tiny_model("llama", dtype=torch.float32)
    model = copy.deepcopy(ref)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
              "tsp": {"enabled": True, "size": world_tsp_size, "attention_backend": "sdpa"}}
    engine, _, _, _ = ds_tsp.initialize(model=model, optimizer=_optimizer("sgd"), config=config)
    topo = engine.tsp_topology
    generator = torch.Generator().manual_seed(11)
    count = dp_size * accumulation * MICRO_BATCH
    input_ids = torch.randint(0, ref.config.vocab_size, (count, SEQ_LEN), generator=generator)
    lengths = torch.tensor([2, SEQ_LEN, 3, SEQ_LEN, SEQ_LEN, 4, 5, SEQ_LEN])[:count]  # real tokens per row
    attention_mask = (torch.arange(SEQ_LEN) < lengths[:, None]).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    micro_rows = [slice(i, i + MICRO_BATCH) for i in range(0, count, MICRO_BATCH)]  # replica-major

    window = [(input_ids[r], attention_mask[r]) for r in micro_rows[topo.dp_rank * accumulation:][:accumulation]]
    num_items = ds_tsp.num_items_in_batch(engine, window) if global_mean else None
    for ids, mask in window:
        engine.backward(engine(input_ids=ids, labels=ids, attention_mask=mask, num_items_in_batch=num_items).loss)
        engine.step()

    references = {"global token mean": ref(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss,
                  "mean of micro-batch means": torch.stack([
                      ref(input_ids=input_ids[r], attention_mask=attention_mask[r], labels=labels[r]).loss
                      for r in micro_rows]).mean()}
    distances = {}
    for name, loss in references.items():
        stepped = copy.deepcopy(ref)
        grads = torch.autograd.grad(loss, list(ref.parameters()), retain_graph=True)
        with torch.no_grad():
            for param, grad in zip(stepped.parameters(), grads):
                param -= LR["sgd"] * grad
        distances[name] = max(_relative_to(engine.module, dict(stepped.named_parameters())).values())
    return distances


@pytest.mark.parametrize("global_mean", [True, False])
def test_loss_over_data_parallel_ranks_and_accumulation_steps(run_ranks, global_mean):
    """TSP=2 x DP=2, 2 accumulation steps, rows with 2 to 16 real tokens: the
    step is the one-process step on the global token mean with
    ``ds_tsp.num_items_in_batch``, and on the mean of micro-batch means
    without; the two steps are far apart."""
    per_rank = run_ranks(4, _one_step_over_uneven_padding, world_tsp_size=2, accumulation=2,
                         global_mean=global_mean)
    distances = {name: max(d[name] for d in per_rank) for name in per_rank[0]}
    print(f"num_items_in_batch {'given' if global_mean else 'not given'}: max rel |dw| to each reference "
          + ", ".join(f"{name} {value:.1e}" for name, value in distances.items()))
    expected = "global token mean" if global_mean else "mean of micro-batch means"
    other = next(name for name in distances if name != expected)
    # float32: summation order moves the weights by ~1e-7 relative.
    assert distances[expected] <= 1e-6
    assert distances[other] >= 1e-3
