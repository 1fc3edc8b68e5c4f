"""Checkpoints that travel: two Adam steps at one TSP x DP x PP layout and ZeRO
stage, save, ``ds-tsp reshard``, rebuild at another layout from a model with
different weights, load, two more steps; against one float64 process's four
steps with the same global batches and learning-rate schedule."""

import os

import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.lr_schedules import WarmupLR
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from transformers import AutoModelForCausalLM

import ds_tsp
from ds_tsp.checkpoint import CheckpointError
from ds_tsp.cli import main
from ds_tsp.blocks.packing import PackedShardMixin
from ds_tsp.injection.pipeline import hf_prefixes
from ds_tsp.injection.policy import hf_path
from ds_tsp.blocks.vocab import VocabParallelEmbedding, VocabParallelLMHead
from float32_control import float32_bound, relative_errors
from models import tiny_model

SEQ_LEN = 16
GLOBAL_BATCH = 4
# The first step moves the weights too (warmup_min_lr > 0), so the checkpoint holds trained weights.
LR = dict(warmup_min_lr=1e-3, warmup_max_lr=1e-2, warmup_num_steps=6)
# float32 engines against the float64 reference over four Adam steps, each distance (weights, moments, losses)
# within what float32 does to the one-process control run (tests/float32_control.py): the moments carry the
# gradients' float32 error (twice over in exp_avg_sq ~ g^2), most in the experts, whose gradients sum few tokens,
# and a Gated DeltaNet hybrid's gradients are 1.7e-6 off float64 (a Llama's ~1e-7); the control sees the same.


def _batches(vocab_size):
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab_size, (GLOBAL_BATCH, SEQ_LEN), generator=generator) for _ in range(4)]


def _engine(arch, layout, seed, universal=False, **overrides):
    tsp, zero, pp = layout["tsp"], layout["zero"], layout.get("pp", 1)
    dp = dist.get_world_size() // (tsp * pp)
    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": zero}, "scheduler": {"type": "WarmupLR", "params": LR},
              "steps_per_print": 1000,
              "tsp": {"enabled": True, "size": tsp, "pipeline_stages": pp, "attention_backend": "sdpa",
                      "vocab_parallel": layout.get("vocab_parallel", True),
                      "expert_parallel_size": layout.get("ep")}}
    if layout.get("offload"):
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    if universal:
        config["checkpoint"] = {"load_universal": True}
    model = tiny_model(arch, seed=seed, dtype=torch.float32, **overrides)
    engine, *_ = ds_tsp.initialize(model=model, config=config, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2))
    return engine


def _step(engine, batch):
    topology = engine.tsp_topology
    mine = batch.chunk(topology.dp_size)[topology.dp_rank]
    if topology.pp_size > 1:  # the last stage's loss, averaged over the replicas, on every rank
        return engine.train_batch(data_iter=iter([(mine, mine)])).item()
    loss = engine(input_ids=mine, labels=mine).loss
    engine.backward(loss)
    engine.step()
    # The global batch's loss: every replica has as many tokens.
    total = loss.detach().double().reshape(1)
    dist.all_reduce(total, group=topology.dp_group)
    return total.item() / topology.dp_size


def _reference(arch, batches, dtype=torch.float64, **overrides):
    """One process (the same float32 draws as the engines' seed 0), four Adam steps: in float64 the truth, in
    float32 the control (tests/float32_control.py)."""
    model = tiny_model(arch, seed=0, dtype=torch.float32, **overrides).to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = WarmupLR(optimizer, **LR)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    states = {"fp32": {n: p.detach() for n, p in model.named_parameters()}}
    for key in ("exp_avg", "exp_avg_sq"):
        states[key] = {n: optimizer.state[p][key] for n, p in model.named_parameters()}
    return losses, states, scheduler.get_last_lr()[0]


def _model_name(module):
    """The model's name of a module name of ``module`` (a pipeline's: ``3.layer.mlp`` -> ``model.layers.2.mlp``;
    experts beside an MLP, ``model.layers.2.moe`` -> ``model.layers.2``: TSPDecoderLayer.hf_prefixes)."""
    if not hasattr(module, "tsp_model_config"):
        layers = module.tsp_policy.layers
        to_model = {f"{layers}.{index}.{attribute}.": f"{hf_path(layers, str(index), hf)}."
                    for index, layer in enumerate(module.get_submodule(layers))
                    for attribute, hf in layer.hf_prefixes().items()}
    else:
        names = hf_prefixes(module.tsp_policy, module.tsp_model_config.num_hidden_layers)
        to_model = {f"{pipe}.": f"{model}." for pipe, model in names.items()}

    def rename(name):
        prefix = next((p for p in to_model if f"{name}.".startswith(p)), None)
        return name if prefix is None else (to_model[prefix] + f"{name}."[len(prefix):]).rstrip(".")
    return rename


def _held(module):
    """``[(parameter, [(Hugging Face name, piece or None, view of the parameter's values)])]``."""
    out = []
    rename = _model_name(module)
    for prefix, block in ((rename(prefix), block) for prefix, block in module.named_modules()):
        if isinstance(block, PackedShardMixin):
            # A fused Hugging Face tensor (a Gated DeltaNet's in_proj_qkv, conv1d) holds a piece at shifted rows.
            hf_pieces = {n: block.hf_rows.hf_piece(n, block.shard_piece(n)) for n in block.spec.shapes}
            out.append((block.packed, [(f"{prefix}.{hf_pieces[n][0]}", hf_pieces[n][1],
                                        lambda t, n=n, b=block: b.spec.unpack(t.reshape(-1))[n])
                                       for n in block.spec.shapes]))
            out += [(p, [(f"{prefix}.{n}", None, lambda t: t)]) for n, p in block.replicated_params().items()]
        elif isinstance(block, (VocabParallelEmbedding, VocabParallelLMHead)) and not getattr(block, "tied", False):
            piece = block.shard_piece("weight")
            out.append((block.weight, [(f"{prefix}.weight", piece, lambda t, length=piece[2]: t[:length])]))
        elif not isinstance(block, (VocabParallelEmbedding, VocabParallelLMHead)) and "norm" in prefix.rsplit(".")[-1]:
            out += [(p, [(f"{prefix}.{n}", None, lambda t: t)]) for n, p in block.named_parameters(recurse=False)]
    return out


def _distance(engine, states, key):
    """Max relative distance of this rank's float32 master (``fp32``) or Adam moment to the reference's."""
    worst = 0.0
    for param, pieces in _held(engine.module):
        values = safe_get_full_fp32_param(param) if key == "fp32" else safe_get_full_optimizer_state(param, key)
        for name, piece, view in pieces:
            expected = states[key][name]
            expected = expected if piece is None else expected.narrow(*piece)
            worst = max(worst, _relative(view(values), expected))
    return worst


def _move(arch, source, target, root, corrupt_moments=False, overrides=None):
    """On every rank: two steps at ``source``, save, reshard (rank 0), two steps at ``target``."""
    overrides = overrides or {}
    batches = _batches(tiny_model(arch, **overrides).config.vocab_size)
    engine = _engine(arch, source, seed=0, **overrides)
    losses = [_step(engine, batch) for batch in batches[:2]]
    engine.save_checkpoint(os.path.join(root, "saved"))
    if dist.get_rank() == 0:
        assert main(["reshard", "--checkpoint", os.path.join(root, "saved"), "--out",
                     os.path.join(root, "universal")]) == 0
        if corrupt_moments:  # the guard: one block's moments rolled onto other elements (another shard's)
            folder = os.path.join(root, "universal", "global_step2", "zero", "model.layers.0.self_attn.packed")
            for key in ("exp_avg", "exp_avg_sq"):
                state = torch.load(os.path.join(folder, f"{key}.pt"), weights_only=False)
                state["param"] = state["param"].roll(state["param"].numel() // 2)
                torch.save(state, os.path.join(folder, f"{key}.pt"))
    dist.barrier()
    del engine
    moved = _engine(arch, target, seed=1, universal=True, **overrides)
    moved.load_checkpoint(os.path.join(root, "universal"))
    steps_after_load = moved.global_steps
    losses += [_step(moved, batch) for batch in batches[2:]]
    reference_losses, states, reference_lr = _reference(arch, batches, **overrides)
    control_losses, control_states, _ = _reference(arch, batches, dtype=torch.float32, **overrides)
    control = {key: max(_relative(control_states[key][name], truth) for name, truth in states[key].items())
               for key in ("fp32", "exp_avg", "exp_avg_sq")}
    control["losses"] = max(relative_errors(control_losses, reference_losses))
    return dict(losses=losses, reference_losses=reference_losses, steps=(steps_after_load, moved.global_steps),
                lr=(moved.get_lr()[0], reference_lr), control=control,
                **{key: _distance(moved, states, key) for key in ("fp32", "exp_avg", "exp_avg_sq")})


def _relative(value, truth):
    return ((value.double() - truth).abs().max() / truth.abs().max()).item()


def _worst(per_rank):
    """Rank 0's losses, steps and LR (every rank's are the same), every rank's largest distances."""
    return {**per_rank[0], **{key: max(out[key] for out in per_rank) for key in ("fp32", "exp_avg", "exp_avg_sq")}}


MOVES = {
    "tsp2xdp2-to-tsp4": ("llama", dict(tsp=2, zero=1), dict(tsp=4, zero=1), None),
    "tsp4-to-tsp2xdp2": ("llama", dict(tsp=4, zero=1), dict(tsp=2, zero=1), None),
    "zero2-tsp2xdp2-to-tsp4": ("qwen2", dict(tsp=2, zero=2), dict(tsp=4, zero=2), None),
    "zero1-to-zero3": ("qwen3", dict(tsp=2, zero=1), dict(tsp=2, zero=3), None),
    "zero1-to-zero2-offloaded": ("llama", dict(tsp=2, zero=1), dict(tsp=4, zero=2, offload=True), None),
    # Without the load-balancing loss, which DP ranks take over their own batches (as DDP does), not the global one.
    "moe-tsp2-to-tsp4": ("qwen3_moe", dict(tsp=2, zero=1), dict(tsp=4, zero=1), dict(output_router_logits=False)),
    # Experts folded over both replicas (a quarter a rank, their ZeRO groups DeepSpeed's MoE ones) to experts
    # over the TSP group, and back: ds_tsp joins the folded experts, DeepSpeed's converter the rest.
    "moe-folded-ep4-to-tsp2xdp2": ("qwen3_moe", dict(tsp=2, zero=1, ep=4), dict(tsp=2, zero=2),
                                   dict(output_router_logits=False)),
    "moe-tsp4-to-folded-ep4": ("qwen3_moe", dict(tsp=4, zero=2), dict(tsp=2, zero=1, ep=4),
                               dict(output_router_logits=False)),
    # A folded block's shared expert is a TSP MLP of its own: folded to folded, over 4 ranks to 2.
    "shared-expert-folded-ep4-to-ep2": ("qwen2_moe", dict(tsp=2, zero=1, ep=4), dict(tsp=1, zero=2, ep=2),
                                        dict(output_router_logits=False)),
    "shared-expert-zero2-to-zero1": ("qwen2_moe", dict(tsp=2, zero=2), dict(tsp=4, zero=1),
                                     dict(output_router_logits=False)),
    # Multi-head latent attention (its down projections' rows uneven at TSP 4) around DeepSeek-V3's MoE, whose
    # routers' score-correction biases are buffers, which DeepSpeed's universal loader does not restore (the
    # resumed engine is built from another seed: ds_tsp puts them back).
    "mla-tsp2xdp2-to-tsp4": ("deepseek_v3", dict(tsp=2, zero=1), dict(tsp=4, zero=2), None),
    # Gated DeltaNet layers (each rank's key heads' rows of in_proj_qkv and conv1d in three pieces) and gated
    # attention, as Hugging Face initialises them (tests/models.py HF_INIT). Its float32 gradients are within
    # 1.7e-6 of float64's tensor by tensor (a Llama's: ~1e-7), so two float32 runs' Adam weights and moments can
    # differ by twice the usual bounds (HYBRID_SCALE) with their losses within 6e-8.
    "hybrid-tsp2xdp2-to-tsp4": ("qwen3_5_hf_init", dict(tsp=2, zero=1), dict(tsp=4, zero=2), None),
    # Gemma 4's experts beside the MLP (a TSP MoE block holding the layer's own router and experts); its per-layer
    # embedding folded by vocabulary beside the main one, and its keys and values shared across layers.
    "gemma4-experts-tsp2xdp2-to-tsp4": ("gemma4_moe", dict(tsp=2, zero=1), dict(tsp=4, zero=2), None),
    "gemma4-layer-inputs-tsp4-to-tsp2xdp2": ("gemma4_layer_inputs", dict(tsp=4, zero=2), dict(tsp=2, zero=1), None),
    # Granite-4.0-H's Mamba-2 mixers (each rank's heads' rows of in_proj in five pieces, conv1d's in three) and its MoE
    # beside the shared MLP; TSP 2 x DP 2 to TSP 4 and back.
    "mamba2-tsp2xdp2-to-tsp4": ("granitemoehybrid_moe", dict(tsp=2, zero=1), dict(tsp=4, zero=2),
                                dict(output_router_logits=False)),
    "mamba2-tsp4-to-tsp2xdp2": ("granitemoehybrid", dict(tsp=4, zero=2), dict(tsp=2, zero=1), None),
    # 61 rows: 31 per rank at TSP 2 (one padding row), 16 at TSP 4 (three).
    "pp2xtsp2-to-tsp4": ("llama", dict(tsp=2, zero=1, pp=2), dict(tsp=4, zero=1), None),
    "tsp4-to-pp2xtsp2": ("llama", dict(tsp=4, zero=1), dict(tsp=2, zero=1, pp=2), None),
    "replicated-vocab-tsp2xdp2-to-tsp4": ("llama", dict(tsp=2, zero=1, vocab_parallel=False),
                                          dict(tsp=4, zero=2, vocab_parallel=False), None),
    # 61 rows whole, then 16 per rank (three padding rows), under ZeRO 1 and 3.
    "replicated-vocab-to-folded": ("llama", dict(tsp=2, zero=1, vocab_parallel=False), dict(tsp=4, zero=1), None),
    "folded-vocab-to-replicated-zero3": ("llama", dict(tsp=4, zero=1), dict(tsp=2, zero=3, vocab_parallel=False),
                                         None),
    "folded-vocab-uneven-zero3-to-zero2": ("llama_tied", dict(tsp=2, zero=3), dict(tsp=4, zero=2), None),
}


@pytest.mark.parametrize("move", list(MOVES))
def test_a_checkpoint_resumes_on_another_layout(run_ranks, tmp_path, move):
    arch, source, target, overrides = MOVES[move]
    out = _worst(run_ranks(4, _move, arch=arch, source=source, target=target, root=str(tmp_path),
                           overrides=overrides))
    rel_losses = max(abs(a - b) / abs(b) for a, b in zip(out["losses"], out["reference_losses"]))
    control = out["control"]
    print(f"{move}: losses {[round(v, 7) for v in out['losses']]} vs {[round(v, 7) for v in out['reference_losses']]}"
          f" (max rel {rel_losses:.1e}); max rel weights {out['fp32']:.1e}, exp_avg {out['exp_avg']:.1e}, "
          f"exp_avg_sq {out['exp_avg_sq']:.1e}; the float32 control's {control}; steps {out['steps']}, lr {out['lr']}")
    assert rel_losses <= float32_bound([control["losses"]])
    assert all(out[key] <= float32_bound([control[key]]) for key in ("fp32", "exp_avg", "exp_avg_sq"))
    assert out["steps"] == (2, 4)
    assert out["lr"][0] == pytest.approx(out["lr"][1], rel=1e-12)
    if source.get("pp", 1) > 1:
        # ds-tsp export of the stages: the weights of their layer files, and the float32 master of their ZeRO
        # files through the converter, which float32 training keeps equal.
        model_dir = str(tmp_path / "hf")
        tiny_model(arch, dtype=torch.float32).save_pretrained(model_dir)
        exported = {}
        for flags in ([], ["--fp32-master"]):
            out_dir = str(tmp_path / f"export{len(flags)}")
            assert main(["export", "--checkpoint", str(tmp_path / "saved"), "--model", model_dir, "--out", out_dir,
                         *flags]) == 0
            exported[len(flags)] = AutoModelForCausalLM.from_pretrained(out_dir).state_dict()
        assert exported[0].keys() == exported[1].keys()
        assert all(torch.equal(exported[0][n], exported[1][n]) for n in exported[0])
        assert not torch.equal(exported[1]["model.norm.weight"], tiny_model(arch, dtype=torch.float32).model.norm.weight)


def test_moments_of_the_wrong_shard_are_caught(run_ranks, tmp_path):
    out = _worst(run_ranks(4, _move, arch="llama", source=dict(tsp=2, zero=1), target=dict(tsp=4, zero=1),
                           root=str(tmp_path), corrupt_moments=True))
    bound = float32_bound([out["control"]["fp32"]])
    print(f"moments rolled onto other elements: max rel weights {out['fp32']:.1e}, exp_avg {out['exp_avg']:.1e}, "
          f"bound {bound:.1e}")
    assert out["fp32"] > 100 * bound


def _plain_load(root):
    """Save at TSP 2 x DP 2, then load into a TSP 4 engine without resharding,
    and the resharded checkpoint without load_universal."""
    engine = _engine("llama", dict(tsp=2, zero=1), seed=0)
    _step(engine, _batches(61)[0])
    engine.save_checkpoint(os.path.join(root, "saved"))
    if dist.get_rank() == 0:
        assert main(["reshard", "--checkpoint", os.path.join(root, "saved"), "--out",
                     os.path.join(root, "universal")]) == 0
    dist.barrier()
    other = _engine("llama", dict(tsp=4, zero=1), seed=1)
    before = [p.detach().clone() for p in other.module.parameters()]
    errors = []
    for folder in ("saved", "universal"):
        with pytest.raises(CheckpointError) as refused:
            other.load_checkpoint(os.path.join(root, folder))
        errors.append(str(refused.value))
    untouched = all(torch.equal(a, b) for a, b in zip(before, other.module.parameters()))
    return errors, untouched


def test_a_plain_load_at_another_layout_is_refused_before_anything_is_read(run_ranks, tmp_path):
    (wrong_layout, universal), untouched = run_ranks(4, _plain_load, root=str(tmp_path))[0]
    print(wrong_layout)
    assert "saved at tsp 2 x dp 2 x pp 1, ZeRO-1, this engine is tsp 4 x dp 1 x pp 1, ZeRO-1" in wrong_layout
    assert f"ds-tsp reshard --checkpoint {tmp_path / 'saved'} --tag global_step1" in wrong_layout
    assert "load_universal" in wrong_layout and "load_universal" in universal
    assert untouched



@pytest.mark.parametrize("saved_folded", [True, False])
def test_shared_experts_do_not_cross_between_folded_and_unfolded_layouts(tmp_path, saved_folded):
    """A folded block keeps its shared expert's universal tensors apart from
    the routed ones, an unfolded one packs them together: a universal load
    across the two is refused by name, not left to DeepSpeed's size checks."""
    from ds_tsp.checkpoint.resharding import load_refusal, write_layout

    folder = tmp_path / "global_step2"
    folder.mkdir()
    layout = dict(tsp=2, dp=2, pp=1, zero_stage=1, lora=False)
    write_layout(str(folder), {**layout, "ep": 4 if saved_folded else 2, "folded_shared": saved_folded},
                 universal=True)
    refusal = load_refusal(str(tmp_path), "global_step2", {**layout, "ep": 2 if saved_folded else 4,
                                                            "folded_shared": not saved_folded}, universal=True)
    assert refusal is not None and "shared experts" in refusal and "tsp.expert_parallel_size" in refusal
    assert load_refusal(str(tmp_path), "global_step2", {**layout, "ep": 4, "folded_shared": saved_folded},
                        universal=True) is None
