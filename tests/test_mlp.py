"""TSP gated MLP (ring schedule) against the unsharded Hugging Face LlamaMLP.

Every rank builds the same seeded full MLP, input and upstream gradient, keeps
its zigzag tokens and its weight shard, and returns its local output, input
gradient and shard gradients; the parent reassembles them and compares with
the HF module in float64. The bound 1e-10 is many orders above float64
round-off for these sizes (sums of at most a few hundred terms of magnitude
~1, reordered by the ring: ~1e-14) and far below any real error (a wrong
slice moves results by ~1e-1, see the guard test).
"""

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from ds_tsp.parallel import comm
from ds_tsp.parallel.layout import shard, unshard
from ds_tsp.blocks.mlp import SHARD_DIMS, TSPGatedMLP, shard_spec
from ds_tsp.parallel.topology import TSPTopology

HIDDEN, SEQ = 16, 24  # SEQ is a multiple of 2*D for D = 1..4
BOUND = 1e-10
LAYOUT = "zigzag"
ACTIVATIONS = {  # name: (config.hidden_act, mlp_bias)
    "silu": ("silu", False),
    "gelu_tanh": ("gelu_pytorch_tanh", False),
    "silu_bias": ("silu", True),
}
# (batch, overlap, token_tile): 5 tokens cut every D's local tokens into several tiles, the last ragged.
CASES = [(batch, overlap, 0) for batch in (1, 2) for overlap in (True, False)] + [(2, True, 5), (1, False, 5)]


def _intermediate(tsp_size):
    return 24 if tsp_size == 3 else 32


def _reference(tsp_size, activation, batch):
    """The full HF MLP, input and upstream gradient; identical on every rank."""
    hidden_act, bias = ACTIVATIONS[activation]
    torch.manual_seed(1234)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=_intermediate(tsp_size), hidden_act=hidden_act,
                         mlp_bias=bias, num_attention_heads=4, num_key_value_heads=4)
    mlp = LlamaMLP(config).double()
    x = torch.randn(batch, SEQ, HIDDEN, dtype=torch.float64)
    grad_y = torch.randn(batch, SEQ, HIDDEN, dtype=torch.float64)
    return mlp, x, grad_y


def _tsp_run(tsp_size, activation, cases, wrong_shard=False):
    topo = TSPTopology(tsp_size)
    r, D = topo.tsp_rank, topo.tsp_size
    results = []
    for batch, overlap, token_tile in cases:
        mlp, x, grad_y = _reference(D, activation, batch)
        module = TSPGatedMLP.from_hf(mlp, topo.tsp_group, overlap=overlap, token_tile=token_tile)
        if wrong_shard and r == 1:
            module.load_shard(_other_slice(mlp, D, module))
        x_local = shard(x, r, D, LAYOUT).requires_grad_()
        out = module(x_local)
        out.backward(shard(grad_y, r, D, LAYOUT))
        results.append({
            "out": out.detach(),
            "grad_x": x_local.grad,
            "grads": {name: g.clone() for name, g in module.spec.unpack(module.packed.grad).items()},
            "down_bias_grad": None if module.down_bias is None else module.down_bias.grad.clone(),
        })
    return results


def _other_slice(mlp, tsp_size, module):
    """Rank 0's slice of the full weights: a plausible but wrong shard for rank 1."""
    f = mlp.intermediate_size // tsp_size
    full = dict(mlp.named_parameters())
    tensors = {name: full[name].detach().narrow(SHARD_DIMS[name], 0, f) for name in module.spec.shapes}
    if module.down_bias is not None:
        tensors["down_proj.bias"] = full["down_proj.bias"].detach()
    return tensors


def _max_diffs(results, tsp_size, activation, batch):
    mlp, x, grad_y = _reference(tsp_size, activation, batch)
    x.requires_grad_()
    out = mlp(x)
    out.backward(grad_y)
    full = dict(mlp.named_parameters())
    diffs = {
        "out": unshard(torch.stack([res["out"] for res in results]), tsp_size, LAYOUT) - out.detach(),
        "grad_x": unshard(torch.stack([res["grad_x"] for res in results]), tsp_size, LAYOUT) - x.grad,
    }
    for name in results[0]["grads"]:
        gathered = torch.cat([res["grads"][name] for res in results], dim=SHARD_DIMS[name])
        diffs[name] = gathered - full[name].grad
    if results[0]["down_bias_grad"] is not None:
        # Replicated parameter: the caller sums its per-rank grads over the group.
        diffs["down_proj.bias"] = sum(res["down_bias_grad"] for res in results) - full["down_proj.bias"].grad
    return {name: d.abs().max().item() for name, d in diffs.items()}


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("tsp_size", [1, 2, 3, 4])
def test_matches_hf_mlp(run_ranks, tsp_size, activation):
    per_rank = run_ranks(tsp_size, _tsp_run, tsp_size=tsp_size, activation=activation, cases=CASES)
    for i, (batch, overlap, token_tile) in enumerate(CASES):
        diffs = _max_diffs([res[i] for res in per_rank], tsp_size, activation, batch)
        print(f"D={tsp_size} {activation} batch={batch} overlap={overlap} token_tile={token_tile}: max |diff| "
              + ", ".join(f"{name} {d:.2e}" for name, d in diffs.items()))
        assert max(diffs.values()) <= BOUND, diffs


def test_check_catches_a_wrong_shard(run_ranks):
    case = [(2, True, 0)]
    per_rank = run_ranks(2, _tsp_run, tsp_size=2, activation="silu", cases=case, wrong_shard=True)
    diffs = _max_diffs([res[0] for res in per_rank], 2, "silu", batch=2)
    print(f"wrong shard on rank 1: max |diff| {diffs}")
    assert diffs["out"] > 1e3 * BOUND and diffs["grad_x"] > 1e3 * BOUND, diffs


def test_indivisible_intermediate_size_is_refused():
    with pytest.raises(ValueError, match=r"intermediate_size 30 is not divisible by tsp.size 4"):
        shard_spec(HIDDEN, 30, 4, bias=False)


def test_spec_and_tags():
    module = TSPGatedMLP(HIDDEN, 32, nn.SiLU(), None, bias=True, dtype=torch.float64)
    assert set(module.spec.shapes) == set(SHARD_DIMS)
    assert set(TSPGatedMLP(HIDDEN, 32, nn.SiLU(), None).spec.shapes) == {
        "gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    assert module.packed.tensor_model_parallel is True
    assert module.packed.dim() == 1 and module.packed.numel() == 3 * HIDDEN * 32 + 2 * 32
    assert set(module.shard_tensors()) == set(SHARD_DIMS) | {"down_proj.bias"}


@pytest.mark.parametrize("token_tile", [0, 4])
def test_no_local_tokens_give_zero_gradients(token_tile):
    """The ring writes its sums from the first tile on (no zero fill): with no
    tokens the output is empty and the weight gradient zero, not whatever the
    uninitialised buffers held."""
    module = TSPGatedMLP(HIDDEN, 32, nn.SiLU(), None, bias=True, token_tile=token_tile, dtype=torch.float64)
    x = torch.zeros(2, 0, HIDDEN, dtype=torch.float64, requires_grad=True)
    y = module(x)
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape
    assert torch.equal(module.packed.grad, torch.zeros_like(module.packed))


def _counted(tsp_size, dtype, bias):
    topo = TSPTopology(tsp_size)
    dtype = getattr(torch, dtype)
    torch.manual_seed(topo.tsp_rank)
    module = TSPGatedMLP(HIDDEN, 32, nn.SiLU(), topo.tsp_group, bias=bias, dtype=dtype)
    x = torch.randn(2, SEQ // tsp_size, HIDDEN, dtype=dtype, requires_grad=True)
    comm.counter.reset()
    out = module(x)
    forward = comm.counter.snapshot()
    out.backward(torch.randn_like(out))
    return forward, comm.counter.snapshot()


@pytest.mark.parametrize("dtype, bias", [("float64", True), ("bfloat16", False)])
@pytest.mark.parametrize("tsp_size", [2, 4])
def test_ring_bytes(run_ranks, tsp_size, dtype, bias):
    D, F = tsp_size, 32
    element = getattr(torch, dtype).itemsize
    accumulator = max(element, 4)  # float32, or float64 for float64 parameters
    sharded_numel = 3 * HIDDEN * F + (2 * F if bias else 0)  # down_proj.bias is replicated, never moved
    weight_hops = (D - 1) * sharded_numel // D * element  # (D-1)/D of the sharded weights
    accumulator_hops = (D - 1) * sharded_numel // D * accumulator
    for forward, total in run_ranks(D, _counted, tsp_size=D, dtype=dtype, bias=bias):
        assert list(forward) == ["ring"] and list(total) == ["ring"]
        assert forward["ring"]["received"] == forward["ring"]["sent"] == weight_hops
        assert total["ring"]["received"] == total["ring"]["sent"] == 2 * weight_hops + accumulator_hops
        assert forward["ring"]["calls"] == D - 1 and total["ring"]["calls"] == 3 * (D - 1)
    print(f"D={D} {dtype}: forward {weight_hops} B, forward+backward {2 * weight_hops + accumulator_hops} B")


def _saved_bytes(tsp_size, token_tile=0):
    topo = TSPTopology(tsp_size)
    mlp, x, _ = _reference(tsp_size, "silu", batch=2)
    module = TSPGatedMLP.from_hf(mlp, topo.tsp_group, token_tile=token_tile)
    x_local = shard(x, topo.tsp_rank, tsp_size, LAYOUT).requires_grad_()
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x_local)
    return sum(storages.values()), module.packed.numel() * module.packed.element_size()


def test_saved_activations_scale_as_one_over_d(run_ranks):
    (unsharded, _), = run_ranks(1, _saved_bytes, tsp_size=1)
    for D in (2, 4):
        for saved, shard_bytes in run_ranks(D, _saved_bytes, tsp_size=D):
            print(f"D={D}: saved {saved} B per rank, bound {unsharded} / {D} + {shard_bytes} (D=1: {unsharded} B)")
            assert saved <= unsharded / D + shard_bytes


def test_token_tiles_save_only_the_input(run_ranks):
    """With several tiles the forward keeps no gate/up projections (backward
    recomputes them a tile at a time): only the local input and the own shard."""
    for D in (1, 2):
        for saved, shard_bytes in run_ranks(D, _saved_bytes, tsp_size=D, token_tile=5):
            input_bytes = 2 * SEQ // D * HIDDEN * 8
            print(f"D={D} token_tile=5: saved {saved} B per rank = input {input_bytes} + shard {shard_bytes}")
            assert saved == input_bytes + shard_bytes
