"""PEFT LoRA models under TSP against the unsharded PEFT model, float64."""

import copy
import os

import pytest
import torch
import torch.distributed as dist

import ds_tsp
from ds_tsp.parallel import layout
from ds_tsp.config import TSPConfig
from ds_tsp.injection.lora import ROW_SPLIT
from ds_tsp.injection.policy import PolicyError
from ds_tsp.parallel.topology import TSPTopology
from float32_control import float32_bound, relative_errors
from models import tiny_model
from parity import TOLERANCE, reference_loss

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_ONLY = ("q_proj", "k_proj", "v_proj", "o_proj")
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3's modules
# A latent attention's (PEFT maps DeepSeek-V3's MLP names to its experts' raw parameters, which TSP refuses).
LATENT_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def peft_model(arch, targets, seed=0, model_overrides=None, dtype=torch.float64, **lora_options):
    """A tiny ``arch`` with LoRA on ``targets``; ``init_lora_weights=False``
    draws non-zero ``lora_B``, so the adapters change the forward."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False, **lora_options)
    return get_peft_model(tiny_model(arch, dtype=dtype, **(model_overrides or {})), config)


def adapter_pieces(tsp_model, reference):
    """``{name: (adapter tensor held here, the matching piece of the reference's)}``
    for every adapter factor of the TSP model, under PEFT's parameter names;
    ``reference(name)`` gives the reference's full tensor."""
    pieces, layers = {}, tsp_model.tsp_policy.layers
    for index, layer in enumerate(tsp_model.get_submodule(layers)):
        for block_name, hf_block in layer.hf_prefixes().items():  # the MLP under its own name (Granite's shared_mlp)
            block = getattr(layer, block_name)
            for projection, adapter in (getattr(block, "lora", None).adapters.items()
                                        if getattr(block, "lora", None) is not None else ()):
                piece = block.shard_piece(f"{projection}.weight")
                # A fused projection's adapter (Phi-3's qkv_proj): its parts' rows of B, one A.
                hf_projection, first_row = block.hf_rows.sources.get(f"{projection}.weight",
                                                                     (f"{projection}.weight", 0))
                for factor in ("lora_A", "lora_B"):
                    name = f"{layers}.{index}.{hf_block}.{hf_projection.removesuffix('.weight')}.{factor}"
                    full = reference(name)
                    if factor == "lora_B" and projection in ROW_SPLIT:
                        full = full.narrow(0, first_row + piece[1], piece[2])[:getattr(adapter, factor).shape[0]]
                        name += "" if hf_projection == f"{projection}.weight" else f" ({projection}'s rows)"
                    elif factor == "lora_A" and projection not in ROW_SPLIT:
                        full = full.narrow(1, piece[1], piece[2])
                    pieces[name] = (getattr(adapter, factor), full)
    return pieces


def lora_parity(arch, targets, batch=2, seq_len=13, inner=False, wrong_adapter=None, model_overrides=None,
                **lora_options):
    """On every rank: |loss - the PEFT model's loss| and the max |diff| of every
    adapter gradient held here against the matching piece of the PEFT model's;
    ``wrong_adapter``: a PEFT name whose factor the last rank scales by 1.5."""
    tsp_size = dist.get_world_size()
    ref = peft_model(arch, targets, model_overrides=model_overrides, **lora_options)
    model = copy.deepcopy(ref)
    input_ids = torch.randint(0, ref.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    topology = TSPTopology(tsp_size)
    tsp_model = ds_tsp.inject(model.base_model.model if inner else model, topology,
                              TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa"))
    if wrong_adapter and topology.tsp_rank == tsp_size - 1:
        with torch.no_grad():
            module, factor = wrong_adapter.rsplit(".", 1)
            layer, block_name, projection = module.rsplit(".", 2)
            block = getattr(tsp_model.get_submodule(layer), block_name)
            getattr(block.lora.adapters[projection], factor).mul_(1.5)
    return compare_adapter_gradients(tsp_model, ref, input_ids)


def compare_adapter_gradients(tsp_model, ref, input_ids):
    """One forward and backward of both models: |loss diff|, the max |diff| of
    every adapter gradient held here, what trains and what got a gradient
    though frozen (for ``check_lora``); ``in_file``: the reference's adapter elements."""
    out = tsp_model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    ref_loss = reference_loss(ref, input_ids)
    ref_loss.backward()
    ref_grads = {n.removeprefix("base_model.model.").replace(".default.weight", ""): p.grad
                 for n, p in ref.named_parameters() if p.requires_grad}
    diffs = {"loss": abs(out.loss.item() - ref_loss.item())}
    for name, (held, full) in adapter_pieces(tsp_model, ref_grads.get).items():
        if held.numel():
            diffs[name] = (held.grad - full).abs().max().item()
    trainable = [n for n, p in tsp_model.named_parameters() if p.requires_grad]
    frozen_grads = [n for n, p in tsp_model.named_parameters() if not p.requires_grad and p.grad is not None]
    return {"diffs": diffs, "adapters": len(ref_grads), "trainable": trainable, "frozen_grads": frozen_grads,
            "in_file": sum(p.numel() for p in ref_grads.values())}


def check_lora(per_rank, label):
    worst = {}
    for result in per_rank:
        assert result["frozen_grads"] == [], result["frozen_grads"]
        assert all(".lora." in name for name in result["trainable"]), result["trainable"]
        for key, value in result["diffs"].items():
            worst[key] = max(worst.get(key, 0.0), value)
    held = {key.split(" ")[0].rsplit(".", 1)[0] for key in worst if key != "loss"}
    assert 2 * len(held) == per_rank[0]["adapters"], (sorted(held), per_rank[0]["adapters"])
    name = max(worst, key=worst.get)
    print(f"{label}: max|diff| {worst[name]:.2e} ({name}), loss {worst['loss']:.2e}, {len(worst) - 1} adapter factors")
    for key, value in worst.items():
        assert value <= TOLERANCE, (key, value)
    return worst


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_loss_and_every_adapter_gradient_match_the_peft_model(run_ranks, tsp_size):
    """LoRA on every projection kind (nkv = 2 < D at D = 4), Qwen3's q/k norms,
    and a MoE model with adapters on its attention."""
    cases = [("llama", ALL_TARGETS, {}), ("qwen3", ALL_TARGETS, {"use_rslora": True}),
             # fused projections: one adapter on qkv_proj (on gate_up_proj) serves q, k and v (gate and up)
             ("phi3", FUSED_TARGETS, {}),
             # the auxiliary loss off: its float32 statistics are test_moe's (here: the cross-entropy's gradients)
             ("qwen2_moe", ATTENTION_ONLY, {"model_overrides": {"output_router_logits": False}}),
             # a latent attention: its down projections' rows (uneven at D = 4) and up projections' rows of B
             ("deepseek_v3_dense", LATENT_TARGETS, {}), ("deepseek_v2_lite", ("q_proj", "kv_b_proj", "o_proj"), {}),
             # a Gated DeltaNet hybrid: the gated attention's q_proj (2 head_dim rows a head), every layer's MLP
             ("qwen3_5", ALL_TARGETS, {}),
             # an ungated MLP (up and down only) beside GLM-4's fused gate_up_proj: both by the MLP's own names
             ("nemotron", ("q_proj", "v_proj", "up_proj", "down_proj"), {}),
             ("glm4", ("q_proj", "o_proj", "gate_up_proj", "down_proj"), {}),
             # Llama 4: chunked, NoPE and temperature-tuned layers, its weightless q/k norm after the complex rotary
             ("llama4", ATTENTION_ONLY, {}),
             # Gemma 4: full layers without v_proj (keys as values), layers reusing another's keys and values (no
             # k_proj, v_proj), per-layer inputs; and the dense MLP beside its experts
             ("gemma4_layer_inputs", ALL_TARGETS, {}), ("gemma4_moe", ALL_TARGETS, {}),
             # Granite-4.0-H: its NoPE attention beside Mamba-2 mixers (which take none), its shared MLP's gate and
             # up rows in input_linear, down_proj named output_linear (split by columns)
             ("granitemoehybrid", ("q_proj", "o_proj", "input_linear", "output_linear"), {}),
             # LFM2: its attention's o_proj named out_proj (as its convolutions' is: the path tells them apart) and
             # its MLP's w1/w3/w2, beside short convolutions (which take none)
             ("lfm2", ("q_proj", "self_attn.out_proj", "w1", "w2", "w3"), {})]
    for arch, targets, options in cases:
        per_rank = run_ranks(tsp_size, lora_parity, arch=arch, targets=targets, **options)
        check_lora(per_rank, f"D={tsp_size} {arch} LoRA on {','.join(targets)} {options}")


def test_the_inner_model_and_a_wrong_adapter_shard(run_ranks):
    per_rank = run_ranks(2, lora_parity, arch="mistral", targets=("q_proj", "down_proj"), inner=True)
    check_lora(per_rank, "D=2 mistral, the Hugging Face model inside the PeftModel")
    for wrong in ("model.layers.0.self_attn.q_proj.lora_B", "model.layers.1.mlp.down_proj.lora_A"):
        per_rank = run_ranks(2, lora_parity, arch="llama", targets=ALL_TARGETS, wrong_adapter=wrong)
        loss = max(result["diffs"]["loss"] for result in per_rank)
        print(f"{wrong} scaled by 1.5 on the last rank: loss moves {loss:.2e}")
        assert loss > 1e-4


def refusal(arch, targets, inner=False, **lora_options):
    model = peft_model(arch, targets, **lora_options)
    try:
        ds_tsp.inject(model.base_model.model if inner else model, TSPTopology(1), TSPConfig(enabled=True, size=1))
    except PolicyError as error:
        return str(error)
    return None


@pytest.mark.parametrize("targets, options, says", [
    (("q_proj",), {"lora_dropout": 0.1}, "lora_dropout"),
    (("q_proj",), {"use_dora": True}, "use_dora"),
    (("q_proj",), {"bias": "lora_only"}, "bias"),
    (("q_proj",), {"modules_to_save": ["lm_head"]}, "modules_to_save"),
    (("q_proj", "lm_head"), {}, "lm_head"),
    (("embed_tokens",), {}, "embed_tokens"),
])
def test_what_cannot_be_sharded_is_refused_by_name(run_ranks, targets, options, says):
    (message,) = run_ranks(1, refusal, arch="llama", targets=targets, **options)
    print(message)
    assert message is not None and says in message


def test_a_moe_models_expert_adapters_are_refused(run_ranks):
    (message,) = run_ranks(1, refusal, arch="qwen2_moe", targets=("q_proj", "gate_proj"))
    print(message)
    assert "shared_expert.gate_proj" in message and "target_modules" in message


@pytest.mark.parametrize("arch, targets, adapted", [("lfm2", ("out_proj",), "model.layers.0.conv.out_proj"),
                                                   ("jamba", ("in_proj",), "model.layers.0.mamba.in_proj")])
def test_adapters_on_a_recurrent_mixer_are_refused(run_ranks, arch, targets, adapted):
    """LoRA on a short convolution's or a Mamba mixer's projections: refused by the adapter's path, before any
    weight moves."""
    (message,) = run_ranks(1, refusal, arch=arch, targets=targets)
    print(message)
    assert message is not None and f"a LoRA adapter on {adapted}" in message and "target_modules" in message


# ------------------------------------------------------------ under the engine

STEPS, MICRO_BATCH, SEQ_LEN = 3, 2, 16


def frozen_weights(engine):
    """Copies of the frozen parameters, whole (ZeRO-3 partitions them too)."""
    import contextlib

    import deepspeed

    frozen = {name: param for name, param in engine.module.named_parameters() if not param.requires_grad}
    partitioned = [param for param in frozen.values() if hasattr(param, "ds_id")]
    with deepspeed.zero.GatheredParameters(partitioned) if partitioned else contextlib.nullcontext():
        return {name: param.detach().clone() for name, param in frozen.items()}


def lora_training(tsp_size, zero_stage, out_dir, arch="llama", targets=ALL_TARGETS):
    """AdamW on the adapters of a float32 LoRA model for STEPS steps, under the
    engine and on one process; then ``ds_tsp.save_pretrained`` and, on rank 0,
    the directory loaded by PEFT over a fresh base model."""
    from peft import PeftModel

    dp_size = dist.get_world_size() // tsp_size
    ref = peft_model(arch, targets, dtype=torch.float32)
    model = copy.deepcopy(ref)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True,
              "tsp": {"enabled": True, "size": tsp_size, "attention_backend": "sdpa"}}
    engine, *_ = ds_tsp.initialize(model=model, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
                                   config=config)
    frozen = frozen_weights(engine)
    # The parameters ZeRO's optimizer partitions and keeps float32 masters of.
    groups = getattr(engine.optimizer, "fp16_groups", None) or engine.optimizer.bit16_groups
    optimized = {id(param) for group in groups for param in group}
    in_optimizer = {"frozen": sum(id(p) in optimized for p in engine.module.parameters() if not p.requires_grad),
                    "adapters": sum(id(p) in optimized for p in engine.module.parameters() if p.requires_grad),
                    "all adapters": sum(p.requires_grad for p in engine.module.parameters())}
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(3)
    losses, ref_losses = [], []
    topology = engine.tsp_topology
    for _ in range(STEPS):
        batch = torch.randint(0, ref.config.vocab_size, (dp_size * MICRO_BATCH, SEQ_LEN), generator=generator)
        micro = batch[topology.dp_rank * MICRO_BATCH:(topology.dp_rank + 1) * MICRO_BATCH]
        loss = engine(input_ids=micro, labels=micro).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ref_opt.zero_grad()
        ref_loss = sum(ref(input_ids=m, labels=m).loss for m in batch.split(MICRO_BATCH)) / dp_size
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 1.0)  # DeepSpeed's default
        ref_opt.step()
        ref_losses.append(ref_loss.item())
    after = frozen_weights(engine)
    base_unchanged = after.keys() == frozen.keys() and all(torch.equal(after[n], frozen[n]) for n in frozen)
    probe = torch.randint(0, ref.config.vocab_size, (2, SEQ_LEN), generator=generator)
    with torch.no_grad():
        engine_loss = engine(input_ids=probe, labels=probe).loss.item()
        # Without labels the folded head returns the local tokens' full-vocabulary logits, in the layout's order.
        engine_logits = engine.module(input_ids=probe).logits
    ds_tsp.save_pretrained(engine, out_dir)
    result = {"losses": losses, "ref_losses": ref_losses, "base_unchanged": base_unchanged,
              "in_optimizer": in_optimizer}
    # Its DeepSpeed checkpoint resumes at this layout only: resharding it is refused by name.
    engine.save_checkpoint(os.path.join(out_dir, "checkpoint"))
    if dist.get_rank() == 0:
        from ds_tsp.checkpoint.formats import CheckpointError
        from ds_tsp.checkpoint.resharding import reshard
        try:
            reshard(os.path.join(out_dir, "checkpoint"), os.path.join(out_dir, "universal"))
        except CheckpointError as error:
            result["reshard_refused"] = str(error)
    loaded = PeftModel.from_pretrained(tiny_model(arch, dtype=torch.float32), out_dir)
    # The loaded model in float64 is the truth the engine's float32 numbers round; the loaded model itself, in
    # float32 on one process, is the control (tests/float32_control.py).
    exact = copy.deepcopy(loaded).double()
    with torch.no_grad():
        out, exact_logits = loaded(input_ids=probe, labels=probe), exact(input_ids=probe).logits
    logits = out.logits
    positions = layout.shard(torch.arange(SEQ_LEN).expand(probe.shape), topology.tsp_rank, tsp_size, "zigzag")
    own, own_exact = (full.gather(1, positions.unsqueeze(-1).expand(*positions.shape, full.shape[-1]))
                      for full in (logits, exact_logits))
    scale = own_exact.abs().max()
    result["logits"] = ((engine_logits.double() - own_exact).abs().max() / scale).item()
    result["logits_control"] = ((own.double() - own_exact).abs().max() / scale).item()
    if dist.get_rank() == 0:
        trained = {n: p for n, p in ref.named_parameters() if p.requires_grad}
        result["adapter_rel"] = max(((p - trained[n]).abs().max() / trained[n].abs().max()).item()
                                    for n, p in loaded.named_parameters() if n in trained)
        result["loaded_adapters"] = sum(1 for n in dict(loaded.named_parameters()) if n in trained)
        exact_loss = torch.nn.functional.cross_entropy(exact_logits[:, :-1].flatten(0, 1), probe[:, 1:].flatten())
        result["loss"], result["loss_control"] = relative_errors([engine_loss, out.loss.item()], [exact_loss.item()] * 2)
    return result


@pytest.mark.parametrize("world, tsp_size, zero_stage, arch, targets, tsp_adapter_params", [
    (4, 2, 2, "llama", ALL_TARGETS, 2 * 2 * len(ALL_TARGETS)),
    (2, 2, 3, "llama", ALL_TARGETS, 2 * 2 * len(ALL_TARGETS)),
    # Per layer: q, k and v's rows of B with the one A of qkv_proj, o_proj's A and B, gate and up's rows of B with
    # gate_up_proj's A, down_proj's A and B; saved as PEFT's qkv_proj and gate_up_proj adapters.
    (4, 2, 2, "phi3", FUSED_TARGETS, 2 * 11), (2, 2, 3, "phi3", FUSED_TARGETS, 2 * 11),
    # DeepSeek-V3's latent attention: its down and up projections' adapters, rows of B split
    (4, 2, 2, "deepseek_v3_dense", LATENT_TARGETS, 2 * 2 * len(LATENT_TARGETS)),
])
def test_lora_trains_like_one_process_and_saves_what_peft_loads(run_ranks, tmp_path, world, tsp_size, zero_stage,
                                                                arch, targets, tsp_adapter_params):
    """The base weights stay bit-identical, only the adapters reach ZeRO's
    optimizer (partitioned, with float32 masters), the losses follow the one-process
    PEFT model's, and PEFT loads the saved adapters with its logits."""
    per_rank = run_ranks(world, lora_training, tsp_size=tsp_size, zero_stage=zero_stage, out_dir=str(tmp_path),
                         arch=arch, targets=targets)
    first = per_rank[0]
    replicas = per_rank[::tsp_size]  # the micro-batch losses of each data-parallel replica, averaged
    losses = [sum(step) / len(replicas) for step in zip(*(result["losses"] for result in replicas))]
    print(f"TSP {tsp_size} x DP {world // tsp_size} ZeRO-{zero_stage}: losses {losses} vs one process "
          f"{first['ref_losses']}; saved adapters vs one process's {first['adapter_rel']:.1e} (relative); against "
          f"the loaded adapters in float64, the engine's loss {first['loss']:.1e} (the float32 loaded model's "
          f"{first['loss_control']:.1e}), every token's logits {max(r['logits'] for r in per_rank):.1e} (the float32 "
          f"loaded model's {max(r['logits_control'] for r in per_rank):.1e}), relative")
    for result in per_rank:
        assert result["base_unchanged"]
        counts = result["in_optimizer"]
        assert counts["frozen"] == 0 and counts["adapters"] == counts["all adapters"] == tsp_adapter_params
    assert losses == pytest.approx(first["ref_losses"], rel=1e-5)
    assert first["loaded_adapters"] == 2 * len(targets) * 2  # A and B of every target, 2 layers
    assert first["adapter_rel"] < 1e-4
    assert first["loss"] <= float32_bound([first["loss_control"]])
    assert "LoRA run's checkpoint" in first.get("reshard_refused", ""), first.get("reshard_refused")
    assert all(result["logits"] <= float32_bound([result["logits_control"]]) for result in per_rank)


# ------------------------------------------------------------------- planner

def adapter_numel(targets):
    tsp_size = dist.get_world_size()
    tsp_model = ds_tsp.inject(peft_model("llama", targets), TSPTopology(tsp_size),
                              TSPConfig(enabled=True, size=tsp_size))
    return sum(p.numel() for n, p in tsp_model.named_parameters() if ".lora." in n)


def test_the_planner_counts_the_adapters_each_rank_holds_and_freezes_the_base(run_ranks):
    from ds_tsp.planning import plan
    from ds_tsp.planning.shapes import lora_adapter_params, model_shape

    config = tiny_model("llama").config
    shape = model_shape(config)
    for targets in (ALL_TARGETS, ("q_proj", "down_proj")):
        held = run_ranks(2, adapter_numel, targets=targets)
        planned = shape.num_layers * lora_adapter_params(shape, 4, targets, 2)
        print(f"LoRA on {targets}: each rank holds {held}, planned {planned}")
        assert held == [planned] * 2
    full = {p.name: p for p in plan(config, 4096, 1, 2, "bf16")}
    lora = {p.name: p for p in plan(config, 4096, 1, 2, "bf16", lora_rank=4, lora_targets=ALL_TARGETS)}
    for name, plan_full in full.items():
        adapters = lora[name].memory["grads"] / 2  # bf16 gradients of the adapters only
        assert lora[name].memory["weights"] == pytest.approx(plan_full.memory["weights"] + 2 * adapters)
        assert lora[name].memory["optimizer"] == pytest.approx(12 * adapters)
        assert lora[name].memory["grads"] < plan_full.memory["grads"]
    # Where a layer's backward sets the peak (checkpointed layers, small logits tiles), full fine-tuning's model
    # states there lack the embedding's gradient, made after every layer's backward; a LoRA run's frozen
    # embedding has none to lack.
    for lora_rank, lacking in ((0, -(-shape.vocab_size // 2) * shape.hidden_size * 2), (4, 0)):
        tsp = {p.name: p for p in plan(config, 4096, 1, 2, "bf16", zero_stage=1, activation_checkpointing=True,
                                       logits_tile_mib=0.01, lora_rank=lora_rank,
                                       lora_targets=ALL_TARGETS)}["TSP(2)"]
        assert "MLP intermediates" in tsp.terms  # the layer's backward binds
        states = sum(tsp.memory[k] for k in ("weights", "grads", "optimizer"))
        assert tsp.terms["model states"] == states - lacking


def pipeline_refusal():
    config = {"train_micro_batch_size_per_gpu": 1, "tsp": {"enabled": True, "size": 1, "pipeline_stages": 2}}
    try:
        ds_tsp.initialize(model=peft_model("llama", ("q_proj",)), config=config,
                          optimizer=lambda params: torch.optim.AdamW(params))
    except ValueError as error:
        return str(error)
    return None


def test_pipeline_stages_with_adapters_are_refused(run_ranks):
    messages = run_ranks(2, pipeline_refusal)
    print(messages[0])
    assert all(m is not None and "pipeline_stages = 2 with PEFT adapters" in m for m in messages)


# ------------------------------------------------- an adapter directory, by slices

def adapter_directory_parity(base_dir, adapter_dir):
    """``ds_tsp.from_pretrained(base_dir, ..., adapter=adapter_dir)`` against
    PEFT's own load of the same directories: loss and adapter gradients, and
    the adapter elements this rank read against those it holds and those the
    file holds."""
    from unittest import mock

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ds_tsp.checkpoint.adapters import AdapterFiles

    tsp_size = dist.get_world_size()
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir, is_trainable=True)
    reads, reader = [], AdapterFiles._reader

    def counted(self, path):
        read = reader(self, path)

        def read_and_count(factor, piece):
            out = read(factor, piece)
            reads.append(out.numel())
            return out
        return read_and_count

    with mock.patch.object(AdapterFiles, "_reader", counted):
        tsp_model = ds_tsp.from_pretrained(base_dir, TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size),
                                           adapter=adapter_dir)
    input_ids = torch.randint(0, ref.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    tsp_model.train()
    result = compare_adapter_gradients(tsp_model, ref, input_ids)
    held = sum(p.numel() for n, p in tsp_model.named_parameters() if ".lora." in n)
    return {**result, "read": sum(reads), "held": held}


@pytest.mark.parametrize("arch, targets", [("llama", ALL_TARGETS), ("phi3", FUSED_TARGETS)])
def test_an_adapter_directory_loads_onto_a_tsp_model_by_slices(run_ranks, tmp_path, arch, targets):
    """Each rank reads only its slices: of a fused projection's adapter (Phi-3's
    qkv_proj), its parts' rows of B and the one A."""
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    tiny_model(arch).save_pretrained(base_dir)  # the base peft_model wraps
    peft_model(arch, targets).save_pretrained(adapter_dir)
    for tsp_size in (2, 4):
        per_rank = run_ranks(tsp_size, adapter_directory_parity, base_dir=str(base_dir), adapter_dir=str(adapter_dir))
        check_lora(per_rank, f"D={tsp_size} {arch} from_pretrained(base, adapter=PEFT's directory)")
        for result in per_rank:
            assert result["read"] == result["held"] < result["in_file"], result
        print(f"  adapter elements read per rank {[r['read'] for r in per_rank]} of {per_rank[0]['in_file']}")
