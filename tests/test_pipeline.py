"""Pipeline stages of TSP blocks against a single-process Hugging Face run."""

import copy
import os

import pytest
import torch
import torch.distributed as dist

import ds_tsp
from models import tiny_model
from float32_control import float32_bound, relative_errors
from parity import sharded_pieces

STEPS = 3
MICRO_BATCH = 2
MICRO_BATCHES = 2  # per step, per data-parallel replica
SEQ_LEN = 16
LR = 0.1
# float32: each run is measured against the same training in float64 and bounded by float32_bound of the
# one-process float32 control's distance to it, measured on this machine (tests/float32_control.py).


def _hf_name(pipe_name, num_layers, pipe=None):
    """``3.layer.mlp.packed`` (pipe layer 3) -> ``model.layers.2.mlp.packed``, the MLP under the layer's
    Hugging Face name where ``pipe`` (the pipeline module) gives it (Llama 4's ``feed_forward``)."""
    index, rest = pipe_name.split(".", 1)
    index = int(index)
    if index == 0:
        return f"model.{rest}"
    if index <= num_layers:
        rest = rest.removeprefix("layer.")
        if pipe is not None and rest.startswith("mlp."):
            rest = f"{pipe.get_submodule(f'{index}.layer').mlp_name}.{rest.removeprefix('mlp.')}"
        return f"model.layers.{index - 1}.{rest}"
    return rest if rest.startswith("lm_head") else f"model.{rest}"


def _pipeline_run(tsp_size, checkpoint_dir=None, resume=False, activation_checkpointing=False, wrong_shard=False,
                  zero_stage=1, save_dir=None, arch="llama", seq_len=SEQ_LEN, model_overrides=None):
    world = dist.get_world_size()
    stages = 2
    dp_size = world // (stages * tsp_size)
    ref = tiny_model(arch, dtype=torch.float32, **(model_overrides or {}))
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": MICRO_BATCHES,
              "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 1000, "tsp": {"enabled": True, "size": tsp_size, "pipeline_stages": stages, "attention_backend": "sdpa"}}
    if activation_checkpointing:
        config["activation_checkpointing"] = {"partition_activations": False}
    engine, *_ = ds_tsp.initialize(model=copy.deepcopy(ref), config=config,
                                   optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    topo = engine.tsp_topology
    if wrong_shard and topo.tsp_rank == 1 and engine.is_first_stage():
        with torch.no_grad():  # ZeRO-0: the optimizer updates this very tensor
            engine.module.get_submodule("1.layer.mlp").packed.mul_(1.5)
    generator = torch.Generator().manual_seed(11)
    per_step = dp_size * MICRO_BATCHES * MICRO_BATCH
    batches = [torch.randint(0, ref.config.vocab_size, (per_step, seq_len), generator=generator)
               for _ in range(STEPS)]

    def micro_batches(batch):
        mine = batch.view(dp_size, MICRO_BATCHES, MICRO_BATCH, seq_len)[topo.dp_rank]
        return iter([(ids, ids) for ids in mine])

    losses = []
    for step, batch in enumerate(batches):
        if resume and step == 1:
            engine.save_checkpoint(checkpoint_dir, tag="step1")
            engine, *_ = ds_tsp.initialize(model=tiny_model(arch, dtype=torch.float32, **(model_overrides or {})),
                                           config=config,
                                           optimizer=lambda params: torch.optim.SGD(params, lr=LR))
            engine.load_checkpoint(checkpoint_dir, tag="step1")
        losses.append(engine.train_batch(data_iter=micro_batches(batch)).item())

    # The truth is the same training in float64; the one-process float32 run (ref) is the control.
    truth = copy.deepcopy(ref).double()
    ref_losses, exact_losses = [], []
    for model, model_losses in ((ref, ref_losses), (truth, exact_losses)):
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for batch in batches:
            opt.zero_grad()
            # The mean of the micro-batches' losses, as the pipeline's (a mixture-of-experts model's load-balancing
            # loss is over each micro-batch); for a dense model, the whole batch's loss.
            micros = batch.split(MICRO_BATCH)
            loss = sum(model(input_ids=micro, labels=micro).loss for micro in micros) / len(micros)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's default clipping
            opt.step()
            model_losses.append(loss.item())

    ref_params = {n: p.detach() for n, p in truth.named_parameters()}
    control_rel = {n: ((ref.get_parameter(n).detach() - p).abs().max() / p.abs().max()).item()
                   for n, p in ref_params.items()}
    if save_dir is not None:
        ds_tsp.save_pretrained(engine, save_dir, max_shard_size="8KB")
        engine.save_checkpoint(save_dir + "-deepspeed")
        return dict(ref_params=ref_params if dist.get_rank() == 0 else None, control_rel=control_rel)
    num_layers = ref.config.num_hidden_layers
    rel = {}
    for pipe_name, param in engine.module.named_parameters():
        name = _hf_name(pipe_name, num_layers, engine.module)
        if getattr(param, "tensor_model_parallel", False):
            block = engine.module.get_submodule(pipe_name.rsplit(".", 1)[0])
            block_prefix = name.rsplit(".", 1)[0]
            pieces = sharded_pieces(block, {n.removeprefix(f"{block_prefix}."): p for n, p in ref_params.items()})
            for piece, (value, expected) in pieces.items():
                rel[f"{block_prefix}.{piece}"] = ((value - expected).abs().max() / expected.abs().max()).item()
        else:  # a TSP block's replicated tensors under their Hugging Face names (o_proj's bias: o_bias)
            owner = engine.module.get_submodule(pipe_name.rsplit(".", 1)[0])
            replicated = getattr(owner, "replicated_params", dict)()
            name = next((f"{name.rsplit('.', 1)[0]}.{hf}" for hf, p in replicated.items() if p is param), name)
            expected = ref_params[name]
            rel[name] = ((param.detach() - expected).abs().max() / expected.abs().max()).item()
    return dict(losses=losses, ref_losses=ref_losses, exact_losses=exact_losses, rel=rel, control_rel=control_rel,
                stage=engine.stage_id,
                engine=type(engine).__name__, checkpoint_interval=engine.module.activation_checkpoint_interval)


@pytest.mark.parametrize("tsp_size, activation_checkpointing, arch, seq_len, model_overrides", [
    (2, False, "llama", SEQ_LEN, None), (1, False, "llama", SEQ_LEN, None), (2, True, "llama", SEQ_LEN, None),
    # Experts on the ring and the load-balancing loss over both stages' layers (a shared expert in Qwen2-MoE),
    # over 14 tokens padded to 16: the statistics must leave TSP's padding out.
    (2, False, "qwen2_moe", 14, None), (2, True, "mixtral", SEQ_LEN, None),
    # Sandwich norms and soft-capped scores on each stage, the last stage's loss of soft-capped logits (untied:
    # a pipeline refuses tied embeddings across stages); OLMo-3's RoPE table per layer type and q/k norms over
    # the projection, each stage computing its own layers' tables.
    (2, False, "gemma2", SEQ_LEN, {"tie_word_embeddings": False}), (2, True, "olmo3", SEQ_LEN, None),
    # GPT-OSS: attention sinks in each stage's head-group shards, GPT-OSS's rotary tables, biased experts.
    (2, False, "gpt_oss", SEQ_LEN, None), (2, False, "glm4_moe", SEQ_LEN, None),
    # Mistral 4's latent attention: each stage recomputes its tables and hands its layers the positions that scale
    # their queries.
    (2, False, "mistral4", SEQ_LEN, None),
    # Llama 4: each stage's chunked layers cut their chunks, its NoPE layer tunes its queries at the tokens' indices.
    (2, False, "llama4", SEQ_LEN, {"num_hidden_layers": 4, "no_rope_layers": [1, 0, 1, 0], "moe_layers": [1, 2, 3]}),
])
def test_pipeline_matches_a_single_process_run(run_ranks, tsp_size, activation_checkpointing, arch, seq_len,
                                               model_overrides):
    covered = set()
    for rank, out in enumerate(run_ranks(4, _pipeline_run, tsp_size=tsp_size,
                                         activation_checkpointing=activation_checkpointing, arch=arch,
                                         seq_len=seq_len, model_overrides=model_overrides)):
        worst = max(out["rel"], key=out["rel"].get)
        control = max(out["control_rel"].values())
        loss_err = max(relative_errors(out["losses"], out["exact_losses"]))
        loss_control = relative_errors(out["ref_losses"], out["exact_losses"])
        print(f"rank {rank} {arch} PP=2 TSP={tsp_size} stage {out['stage']}: max rel |dw| against float64 "
              f"{out['rel'][worst]:.2e} ({worst}), the float32 control's {control:.2e} (bound "
              f"{float32_bound([control]):.2e}); loss rel err {loss_err:.2e}, the control's {max(loss_control):.2e} "
              f"(bound {float32_bound(loss_control):.2e}); losses {[round(v, 5) for v in out['losses']]}")
        assert out["engine"] == "PipelineEngine"
        assert out["checkpoint_interval"] == int(activation_checkpointing)
        assert out["rel"][worst] <= float32_bound([control]) and loss_err <= float32_bound(loss_control)
        covered |= set(out["rel"])
    # Between them the stages hold every tensor of the model.
    assert {n.rsplit(".", 1)[0] for n in covered} >= {"model.embed_tokens", "lm_head", "model.norm"}


def test_the_comparison_catches_a_wrong_shard(run_ranks):
    per_rank = run_ranks(4, _pipeline_run, tsp_size=2, wrong_shard=True, zero_stage=0)
    worst = max(max(out["rel"].values()) for out in per_rank)
    bound = max(float32_bound(out["control_rel"].values()) for out in per_rank)
    print(f"wrong shard: max rel |dw| against float64 {worst:.2e}, the float32 bound {bound:.2e}")
    assert worst > 1e3 * bound


def test_pipeline_resume_reproduces_the_losses(run_ranks, tmp_path):
    plain = run_ranks(4, _pipeline_run, tsp_size=2)
    resumed = run_ranks(4, _pipeline_run, tsp_size=2, checkpoint_dir=str(tmp_path / "pipe"), resume=True)
    for a, b in zip(plain, resumed):
        print(f"uninterrupted {a['losses']}, resumed {b['losses']}")
        assert a["losses"] == b["losses"]


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe", "glm4_moe"])
def test_save_pretrained_writes_every_stage(run_ranks, tmp_path, arch, capsys):
    """PP=2 x TSP=2: the Hugging Face directory holds both stages' layers, the
    final norm and the head, as trained (against the single-process run)."""
    from transformers import AutoModelForCausalLM

    save_dir = str(tmp_path / "saved")
    first = run_ranks(4, _pipeline_run, tsp_size=2, save_dir=save_dir, arch=arch)[0]
    ref_params, control = first["ref_params"], max(first["control_rel"].values())
    bound = float32_bound([control])
    assert os.path.isfile(os.path.join(save_dir, "model.safetensors.index.json"))  # several 8 KB files
    saved = dict(AutoModelForCausalLM.from_pretrained(save_dir, experts_implementation="eager").named_parameters())
    initial = dict(tiny_model(arch, dtype=torch.float32).named_parameters())
    assert saved.keys() == ref_params.keys()
    rel = {n: ((saved[n] - p).abs().max() / p.abs().max()).item() for n, p in ref_params.items()}
    moved = {n: ((initial[n] - p).abs().max() / p.abs().max()).item() for n, p in ref_params.items()}
    worst = max(rel, key=rel.get)
    with capsys.disabled():  # capsys reads the CLI's refusal below
        print(f"saved vs trained in float64: max rel {rel[worst]:.2e} ({worst}), the float32 control's {control:.2e} "
              f"(bound {bound:.2e}); training moved every tensor by >= {min(moved.values()):.2e}")
    assert rel[worst] <= bound
    # The guard: a stage left out, or saved untrained, would be this far off.
    assert min(moved.values()) > 100 * bound
    # ds-tsp export joins the stages' layer files of the DeepSpeed checkpoint into the same tensors.
    from ds_tsp.cli import main
    exported = str(tmp_path / "exported")
    assert main(["export", "--checkpoint", save_dir + "-deepspeed", "--model", save_dir, "--out", exported]) == 0
    again = AutoModelForCausalLM.from_pretrained(exported, experts_implementation="eager").state_dict()
    assert all(torch.equal(again[n], p) for n, p in saved.items())
    # Its float32 master weights go through DeepSpeed's universal converter, which moves Adam's state only:
    # this SGD run's is refused by name (tests/test_reshard.py exports an Adam run's).
    assert main(["export", "--checkpoint", save_dir + "-deepspeed", "--model", save_dir, "--out",
                 str(tmp_path / "master"), "--fp32-master"]) == 1
    assert "move Adam's (exp_avg, exp_avg_sq)" in capsys.readouterr().err


def test_layers_that_do_not_split_are_refused():
    from ds_tsp.config import TSPConfig
    from ds_tsp.injection.pipeline import build_pipeline
    from ds_tsp.parallel.topology import TSPTopology

    model = ds_tsp.inject(tiny_model("llama", num_hidden_layers=3), TSPTopology(1), TSPConfig(enabled=True))
    with pytest.raises(ValueError, match="num_hidden_layers = 3 does not split evenly over tsp.pipeline_stages = 2"):
        build_pipeline(model, TSPTopology(1), TSPConfig(enabled=True, pipeline_stages=2))


def test_checkpointed_mixture_of_experts_stages_use_the_non_reentrant_checkpoint():
    """Their stages pass the load-balancing statistics beside the hidden state,
    which DeepSpeed's reentrant checkpoint cannot run backward for."""
    from ds_tsp.config import TSPConfig
    from ds_tsp.injection.pipeline import check_pipeline_stages

    config, tsp_config = tiny_model("mixtral").config, TSPConfig(enabled=True, pipeline_stages=2)
    ds_config = {"activation_checkpointing": {"partition_activations": False}}
    check_pipeline_stages(config, tsp_config, ds_config)
    assert ds_config["pipeline"]["use_reentrant"] is False
    ds_config["pipeline"]["use_reentrant"] = True
    with pytest.raises(ValueError, match="pipeline.use_reentrant = true: .* set pipeline.use_reentrant to false"):
        check_pipeline_stages(config, tsp_config, ds_config)


@pytest.mark.parametrize("arch, key", [("gemma4_shared_kv", "num_kv_shared_layers = 2"),
                                       ("gemma4_layer_inputs", "hidden_size_per_layer_input = 4")])
def test_layers_taking_more_than_the_hidden_state_are_refused(arch, key):
    """Gemma 4's keys and values shared across layers and its per-layer inputs would cross pipeline stages."""
    from ds_tsp.config import TSPConfig
    from ds_tsp.injection.pipeline import check_pipeline_stages

    with pytest.raises(ValueError, match=rf"tsp.pipeline_stages = 2 .*{key}.*train it with tsp.pipeline_stages 1"):
        check_pipeline_stages(tiny_model(arch).config, TSPConfig(enabled=True, pipeline_stages=2))
