"""Whole injected models against the unsharded Hugging Face model, float64."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ds_tsp
from ds_tsp.config import TSPConfig
from ds_tsp.policy import PolicyError
from ds_tsp.topology import TSPTopology
from models import tiny_model

# float64 throughout; sharding only reorders sums (rounding ~1e-15), while a
# wrong shard or position moves the loss by ~1e-2 (see the guard test).
TOLERANCE = 1e-10


def reference_loss(model, input_ids, attention_mask=None):
    """HF's causal-LM loss, but in float64 (HF upcasts logits to float32 only)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    labels = input_ids[:, 1:].clone()
    if attention_mask is not None:
        labels[attention_mask[:, 1:] == 0] = -100
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)


def shard_grad_diffs(tsp_model, ref_model):
    """Max |diff| of every gradient this rank holds against the matching piece of the reference's."""
    ref = {n: p.grad for n, p in ref_model.named_parameters()}
    diffs = {}
    for name, param in tsp_model.named_parameters():
        if not getattr(param, "tensor_model_parallel", False):
            diffs[name] = (param.grad - ref[name]).abs().max().item()
    for index, layer in enumerate(tsp_model.model.layers):
        for block_name in ("self_attn", "mlp"):
            block = getattr(layer, block_name)
            grads = block.spec.unpack(block.packed.grad)
            for name, grad in grads.items():
                piece = block.shard_piece(name)
                full = ref[f"model.layers.{index}.{block_name}.{name}"]
                diffs[f"model.layers.{index}.{block_name}.{name}"] = (grad - full.narrow(*piece)).abs().max().item()
    return diffs


def _parity(arch, batch, seq_len, layout="zigzag", right_padding=0, wrong_shard=False, checkpointing=False):
    tsp_size = dist.get_world_size()
    torch.manual_seed(7)
    ref = tiny_model(arch)
    input_ids = torch.randint(0, ref.config.vocab_size, (batch, seq_len))
    attention_mask = None
    if right_padding:
        attention_mask = torch.ones_like(input_ids)
        attention_mask[0, -right_padding:] = 0
    model = copy.deepcopy(ref)
    topo = TSPTopology(tsp_size)
    ds_tsp.inject(model, topo, TSPConfig(enabled=True, size=tsp_size, layout=layout, attention_backend="sdpa"))
    if wrong_shard and topo.tsp_rank == tsp_size - 1:
        with torch.no_grad():
            model.model.layers[0].mlp.packed.mul_(1.5)
    if checkpointing:
        model.train()
        model.activation_checkpointing_enable()
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=input_ids, labels=input_ids, attention_mask=attention_mask)
    out.loss.backward()
    ref_loss = reference_loss(ref, input_ids, attention_mask)
    ref_loss.backward()
    diffs = {"loss": abs(out.loss.item() - ref_loss.item()), "saved_bytes": -sum(saved.values())}
    diffs.update(shard_grad_diffs(model, ref))
    return diffs


def _check(per_rank, label):
    # Ranks that do not hold a replicated key/value head report no k/v entries.
    worst = {k: max(d[k] for d in per_rank if k in d) for k in set().union(*per_rank) if k != "saved_bytes"}
    name = max(worst, key=worst.get)
    print(f"{label}: max|diff| {worst[name]:.2e} ({name}), loss {worst['loss']:.2e}")
    assert worst[name] <= TOLERANCE, (name, worst[name])


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_loss_and_every_gradient_match_hugging_face(run_ranks, tsp_size):
    for arch in ("llama", "qwen2", "mistral", "qwen3"):
        for batch, seq_len in ((1, 16), (2, 13)):  # 13 needs padding at every D > 0
            per_rank = run_ranks(tsp_size, _parity, arch=arch, batch=batch, seq_len=seq_len)
            _check(per_rank, f"D={tsp_size} {arch} B={batch} S={seq_len}")


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_tied_embeddings_contiguous_layout_and_right_padding(run_ranks, tsp_size):
    per_rank = run_ranks(tsp_size, _parity, arch="llama_tied", batch=2, seq_len=19, layout="contiguous",
                         right_padding=5)
    _check(per_rank, f"D={tsp_size} tied contiguous right-padded")


def test_activation_checkpointing_recomputes_exactly(run_ranks):
    plain = run_ranks(2, _parity, arch="qwen2", batch=2, seq_len=32)
    recomputed = run_ranks(2, _parity, arch="qwen2", batch=2, seq_len=32, checkpointing=True)
    _check(recomputed, "D=2 qwen2 with activation checkpointing")
    for rank, (a, b) in enumerate(zip(plain, recomputed)):
        print(f"rank {rank}: saved for backward {-a['saved_bytes']} B plain, {-b['saved_bytes']} B checkpointed")
        assert -b["saved_bytes"] < 0.6 * -a["saved_bytes"]


def test_a_wrong_shard_is_caught(run_ranks):
    per_rank = run_ranks(2, _parity, arch="llama", batch=1, seq_len=16, wrong_shard=True)
    worst = max(v for d in per_rank for k, v in d.items() if k != "saved_bytes")
    print(f"wrong shard: max|diff| {worst:.2e}")
    assert worst > 1e3 * TOLERANCE


def test_unsupported_blocks_are_refused_with_the_class_name():
    from transformers import Phi3Config, Phi3ForCausalLM

    # Phi-3 fuses q/k/v (and gate/up) into single projections.
    model = Phi3ForCausalLM(Phi3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0))
    with pytest.raises(PolicyError, match=r"Phi3DecoderLayer at model.layers.0.self_attn lacks "
                                          r"\['q_proj', 'k_proj', 'v_proj'\]"):
        ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True))
    with pytest.raises(PolicyError, match="is a Phi3DecoderLayer, but tsp.policy = 'llama' converts"):
        ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True, policy="llama"))
    assert type(model).__name__ == "Phi3ForCausalLM"


def test_left_padding_is_refused():
    model = ds_tsp.inject(tiny_model("llama"), TSPTopology(1), TSPConfig(enabled=True))
    ids = torch.zeros(1, 8, dtype=torch.long)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="right padding only"):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match=r"does not support \['output_attentions'\]"):
        model(input_ids=ids, output_attentions=True)
