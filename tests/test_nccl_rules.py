"""NCCL's rules, enforced on CPU by a dry run (``nccl_rules.DryRun``, issue 60).

The model lives on the meta device, the accelerator's stand-in, under torch's
fake process group: injection, ``from_pretrained``, ``ds_tsp.initialize`` with
DeepSpeed's engine, a training forward and backward (and the optimizer step)
and a generation step (prefill and one decode step) must put every
collective's tensors on the model's device (a CPU tensor there fails on NCCL).
A training step's host reads stay within one per micro-batch plus one per
mixture-of-experts layer; a prefill's within four (the prompt and its check,
the sampling state, the embedding's route) and a decode step's within two (its
check, its token ids), plus one per mixture-of-experts layer. Each case prints
the collectives by device and the host reads by reason.
"""

import copy
import os
import weakref
from unittest import mock

import deepspeed.utils.groups
import pytest
import torch
import torch.distributed as dist

import ds_tsp
from ds_tsp.blocks.attention.schedule import HeadGroupGrads
from ds_tsp.blocks.moe.module import TSPSparseMoE
from ds_tsp.checkpoint import from_pretrained
from ds_tsp.config import TSPConfig
from ds_tsp.injection import inject as inject_module
from ds_tsp.injection import model as model_module
from ds_tsp.parallel import comm
from ds_tsp.parallel.topology import TSPTopology
from models import MODEL_CLASSES, tiny_config, tiny_model
from nccl_rules import DryRun, fake_world, meta_accelerator

BATCH, SEQ, PROMPT = 2, 16, 8

# name: (arch, world size, TSP size, config options, generation covered: folded experts refuse generation)
CASES = {
    "attention, TSP 2": ("llama", 2, 2, {}, True),
    "attention, TSP 4": ("llama", 4, 4, {}, True),
    "attention, TSP 2 x DP 2, replicated head": ("qwen3", 4, 2, {"vocab_parallel": False}, True),
    "latent attention and experts, TSP 2": ("deepseek_v3", 2, 2, {}, True),
    "sparse attention (DeepSeek-V3.2's indexer), TSP 2": ("deepseek_v32", 2, 2, {}, True),
    "Gated DeltaNet, TSP 2": ("qwen3_5", 2, 2, {}, True),
    "Mamba-2 beside the attention (Falcon-H1), TSP 2": ("falcon_h1_norm", 2, 2, {}, True),
    "Mamba-2 mixers and experts (Granite-4.0-H), TSP 4": ("granitemoehybrid_moe", 4, 4, {}, True),
    "Mamba-1 mixers and experts (Jamba), TSP 2": ("jamba", 2, 2, {}, True),
    "short convolutions and experts (LFM2-MoE), TSP 2": ("lfm2_moe", 2, 2, {}, True),
    "experts by all-to-all, TSP 2": ("qwen3_moe", 2, 2, {"moe_schedule": "all_to_all"}, True),
    "experts on the ring, TSP 2": ("qwen3_moe", 2, 2, {"moe_schedule": "ring"}, True),
    "folded experts, TSP 2 x DP 2, ep 4": ("qwen3_moe", 4, 2, {"expert_parallel_size": 4}, False),
}


@pytest.fixture
def fake_group():
    """A fake world of the size asked for, torn down after the test."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")

    def start(world_size):
        fake_world(world_size)
    # DeepSpeed keeps its groups (the mpu, the expert groups) in module globals: an engine built here leaves
    # them naming this fake world's groups, so they are put back as they were.
    groups = {name: copy.copy(value) for name, value in vars(deepspeed.utils.groups).items()
              if name == "mpu" or name.isupper() and name.endswith(("GROUP", "GROUP_RANKS"))}
    yield start
    vars(deepspeed.utils.groups).update(groups)
    if dist.is_initialized():
        dist.destroy_process_group()


def meta_model(arch):
    with torch.device("meta"):
        return MODEL_CLASSES[arch](tiny_config(arch))


def config(tsp_size, options):
    return TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa", **{"vocab_parallel": True, **options})


def routed_rows(model, tokens_per_rank):
    return tokens_per_rank * (getattr(model.config, "num_experts_per_tok", 0) or 0)


def no_probe():
    """The probe of models taken by shape (latent attention, Gated DeltaNet) runs
    Hugging Face's own forward, which reads the host (``.item()``) and so
    cannot run on the meta device: it is left out here."""
    return mock.patch.object(inject_module, "probe_layers", lambda *args, **kwargs: None)


@pytest.mark.parametrize("case", list(CASES))
def test_every_collective_is_on_the_model_device(fake_group, case):
    arch, world_size, tsp_size, options, generates = CASES[case]
    fake_group(world_size)
    model, tsp_config = meta_model(arch), config(tsp_size, options)
    with DryRun() as dry, no_probe():
        ds_tsp.inject(model, TSPTopology.of(tsp_config), tsp_config)
    print(dry.report(f"{case}, inject"))
    assert dry.misplaced == [] and dry.by_device  # collectives seen, none off the device

    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding
    moe_layers = sum(isinstance(m, TSPSparseMoE) for m in model.modules())
    model.train()
    with DryRun(routed_rows=routed_rows(model, BATCH * SEQ // tsp_size)) as dry:
        ids_on, mask_on = dry.on_device(ids), dry.on_device(mask)
        model(input_ids=ids_on, labels=ids_on, attention_mask=mask_on).loss.backward()
    print(dry.report(f"{case}, training step ({moe_layers} MoE layers)"))
    assert dry.misplaced == [] and dry.by_device
    assert dry.host_reads["batch"] == 1  # the batch and its check's fingerprints, in one read
    assert sum(dry.host_reads.values()) <= 1 + moe_layers

    if not generates:
        return
    model.eval()
    with DryRun(routed_rows=routed_rows(model, BATCH * PROMPT // tsp_size)) as dry, torch.no_grad():
        prompt = dry.on_device(ids[:, :PROMPT])
        out = model(prompt, attention_mask=dry.on_device(torch.ones(BATCH, PROMPT, dtype=torch.long)),
                    use_cache=True, logits_to_keep=1)
    print(dry.report(f"{case}, prefill"))
    assert dry.misplaced == [] and dry.by_device
    # The prompt with its check, the sampling generator's state and the embedding's route; one per MoE layer.
    assert sum(dry.host_reads.values()) <= 4 + moe_layers
    with DryRun(routed_rows=routed_rows(model, BATCH)) as dry, torch.no_grad():
        model(out.logits[:, -1].argmax(-1, keepdim=True), cache=out.cache, use_cache=True, logits_to_keep=1,
              attention_mask=dry.on_device(torch.ones(BATCH, PROMPT + 1, dtype=torch.long)))
    print(dry.report(f"{case}, one decode step"))
    assert dry.misplaced == [] and dry.by_device
    # The step's check and its token ids; one per MoE layer.
    assert sum(dry.host_reads.values()) <= 2 + moe_layers


# name: (arch, world size, TSP size, ZeRO stage, tsp options, from a checkpoint directory). ZeRO-0 runs the
# optimizer step too; ZeRO-1 and 2 stop after backward, where DeepSpeed's step reads the gradient norm on the host
# (its own sync, legal under NCCL). ZeRO-3 is not built on the meta device: DeepSpeed copies its partitions.
ENGINE_CASES = {
    "attention, TSP 2, ZeRO-0": ("llama", 2, 2, 0, {}, False),
    "attention, TSP 2 x DP 2, ZeRO-1, replicated head": ("qwen3", 4, 2, 1, {"vocab_parallel": False}, False),
    "latent attention and experts from a directory, TSP 2, ZeRO-0": ("deepseek_v3", 2, 2, 0, {}, True),
    "Gated DeltaNet, TSP 2 x DP 2, ZeRO-2": ("qwen3_5", 4, 2, 2, {}, False),
    "folded experts, TSP 2 x DP 2, ep 4, ZeRO-2": ("qwen3_moe", 4, 2, 2, {"expert_parallel_size": 4}, False),
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_initialize_and_a_training_step_keep_every_collective_on_the_device(fake_group, monkeypatch, tmp_path,
                                                                            case):
    """``ds_tsp.initialize`` end to end: its checks, injection or ``from_pretrained``, DeepSpeed's engine (its
    model broadcast, ZeRO's partitions and gradient reduction) and TSP's hooks on it, with DeepSpeed's
    accelerator answering the meta device as CUDA's answers ``cuda``."""
    arch, world_size, tsp_size, stage, options, from_directory = ENGINE_CASES[case]
    fake_group(world_size)
    monkeypatch.setenv("LOCAL_RANK", "0")
    model = meta_model(arch)
    if from_directory:
        tiny_model(arch, dtype=torch.float32).save_pretrained(tmp_path)
        model = str(tmp_path)
    ds_config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
                 "zero_optimization": {"stage": stage},
                 "tsp": {"enabled": True, "size": tsp_size, "attention_backend": "sdpa", **options}}
    with DryRun() as dry, meta_accelerator(), no_probe():
        engine, *_ = ds_tsp.initialize(model=model, config=ds_config)
    print(dry.report(f"{case}, initialize"))
    assert dry.misplaced == [] and dry.by_device
    assert {p.device.type for p in engine.module.parameters()} == {"meta"}

    ids = torch.randint(0, engine.module.config.vocab_size, (BATCH, SEQ))
    moe_layers = sum(isinstance(m, TSPSparseMoE) for m in engine.module.modules())
    with DryRun(routed_rows=routed_rows(engine.module, BATCH * SEQ // tsp_size)) as dry, meta_accelerator():
        ids_on = dry.on_device(ids)
        engine.backward(engine(input_ids=ids_on, labels=ids_on).loss)
        if stage == 0:
            engine.step()
    print(dry.report(f"{case}, training step ({moe_layers} MoE layers)"))
    assert dry.misplaced == [] and dry.by_device
    assert dry.host_reads["batch"] == 1 and sum(dry.host_reads.values()) <= 1 + moe_layers


def test_at_most_two_other_head_groups_gradients_are_held(fake_group):
    """At TSP 4 a rank's attention backward computes a weight gradient for every
    owner's shard: at the layer's end it still holds its own and at most two
    others' (``ReducesInFlight``), not one per head group."""
    fake_group(4)
    model, tsp_config = meta_model("llama"), config(4, {})
    with DryRun():
        ds_tsp.inject(model, TSPTopology.of(tsp_config), tsp_config)
    buffers, held_at_end = {}, []  # id -> a weak reference, of every buffer allocated
    shard, own_shard = HeadGroupGrads.shard, HeadGroupGrads.own_shard

    def recorded_shard(self, j):
        views = shard(self, j)
        buffers.setdefault(id(self.shards[j]), weakref.ref(self.shards[j]))
        return views

    def recorded_own_shard(self):
        held_at_end.append(sum(buffer() is not None for buffer in buffers.values()))
        buffers.clear()
        return own_shard(self)

    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    with DryRun() as dry, mock.patch.object(HeadGroupGrads, "shard", recorded_shard), \
            mock.patch.object(HeadGroupGrads, "own_shard", recorded_own_shard):
        ids_on = dry.on_device(ids)
        model(input_ids=ids_on, labels=ids_on).loss.backward()
    print(f"weight-gradient buffers held at each attention backward's end: {held_at_end}")
    assert len(held_at_end) == model.config.num_hidden_layers and max(held_at_end) <= 3


def test_from_pretrained_builds_on_the_group_device(fake_group, tmp_path):
    """``from_pretrained`` with no device reads onto ``comm.group_device`` (meta
    here, the accelerator under NCCL) and checks the ranks there."""
    tiny_model("llama").save_pretrained(tmp_path)
    fake_group(2)
    tsp_config = config(2, {})
    with DryRun() as dry:
        model = from_pretrained(tmp_path, TSPTopology.of(tsp_config), tsp_config)
    print(dry.report("from_pretrained"))
    assert dry.misplaced == [] and dry.by_device
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_a_collective_off_the_device_is_caught(fake_group):
    """The guard: the model check's digest on the CPU, as ``check_same_model``
    built it before issue 60, is two misplaced tensors of one all-gather."""
    fake_group(2)
    model, tsp_config = meta_model("llama"), config(2, {})
    with DryRun() as dry, mock.patch.object(comm, "group_device", lambda group: torch.device("cpu")):
        ds_tsp.inject(model, TSPTopology.of(tsp_config), tsp_config)
    print(dry.report("digest on the CPU"))
    assert [device for _, device, _ in dry.misplaced] == ["cpu", "cpu"]  # the digest and its gathered copy
    assert all(where.startswith("injection" + os.sep + "consistency.py") for _, _, where in dry.misplaced)


def test_a_host_read_outside_the_helper_is_caught(fake_group):
    """A host read in the step that bypasses ``host_reads`` (a ``float()`` of
    the loss sum) stops the dry run, as it would wait for a GPU."""
    fake_group(2)
    model, tsp_config = meta_model("llama"), config(2, {})
    with DryRun():
        ds_tsp.inject(model, TSPTopology.of(tsp_config), tsp_config)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    with DryRun() as dry, mock.patch.object(model_module, "sum_over_group", side_effect=lambda t, group: t * float(t)):
        ids_on = dry.on_device(ids)
        with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
            model(input_ids=ids_on, labels=ids_on)
