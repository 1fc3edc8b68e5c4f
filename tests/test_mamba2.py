"""Mamba-2 hybrids (Bamba, Granite-4.0-H dense and MoE, Nemotron-H) under TSP against the unsharded Hugging Face model, float64, with Hugging Face's float32
casts of the scan widened to float64 (tests/models.py)."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from ds_tsp.blocks.linear import recurrence
from ds_tsp.blocks.linear.mamba2_module import TSPMamba2
from ds_tsp.parallel import comm, layout
from ds_tsp.parallel.topology import TSPTopology
from ds_tsp.planning.communication import mamba2_bytes_by_op
from models import tiny_model
from parity import TOLERANCE, check, check_caught, model_parity

# Right- and left-padded, packed (documents restarting the positions: every state restarts at each, and the
# convolution's window stops there) and many 8-token SSM chunks (45 tokens: chunks of 5 or 6 tokens a rank at D = 4,
# not a multiple of the SSM chunk).
CASES = (dict(batch=2, seq_len=13, right_padding=3), dict(batch=2, seq_len=16, left_padding=5),
         dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]), dict(batch=1, seq_len=45))
ARCHS = ("bamba", "granitemoehybrid", "granitemoehybrid_moe", "nemotron_h")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_mamba2_hybrids_match_hugging_face(run_ranks, tsp_size):
    """Loss and every gradient, relative to the largest entry of the reference's where it is above 1."""
    for arch in ARCHS:
        for case in CASES:
            check(run_ranks(tsp_size, model_parity, arch=arch, relative=True, **case), f"D={tsp_size} {arch} {case}")


def test_granite_moe_load_balancing_loss(run_ranks):
    """Granite-4.0-H's MoE beside its shared MLP with output_router_logits: the loss with Hugging Face's auxiliary
    loss over the whole sequence, and every gradient, at D = 2 under both MoE schedules (test_moe's harness)."""
    from test_moe import SCHEDULES, check_case, moe_parity

    case = ("granitemoehybrid_moe", 2, 13, 3, "random", {"output_router_logits": True, "router_aux_loss_coef": 0.1})
    per_rank = run_ranks(2, moe_parity, cases=[case])
    for i, schedule in enumerate(SCHEDULES):
        grads = check_case([rank[i] for rank in per_rank], f"D=2 {schedule} granitemoehybrid_moe, its aux loss")
        assert "block_sparse_moe.experts.gate_up_proj" in " ".join(grads)


@pytest.mark.parametrize("arch", ["bamba", "granitemoehybrid", "granitemoehybrid_moe", "nemotron_h"])
def test_generate_gives_hugging_face_tokens(run_ranks, arch):
    """At D = 2: greedy tokens and every step's logits against Hugging Face's (its float32 casts widened), and
    greedy, beam search and penalties on left-padded prompts (each row's state after its own last token); each
    rank keeps its heads' Mamba-2 states and half of the attention layer's tokens."""
    from test_generate import _hf_reference, _prompts, _run_generate, check_strategies_on_left_padded_prompts

    prompts = _prompts(2, seed=9)
    ref_tokens, ref_logits = _hf_reference(arch, prompts, max_new_tokens=8)
    # At D = 4 each norm group's heads lie on two ranks (its sums of squares all-reduced).
    for tsp_size in (2, 4) if arch == "bamba" else (2,):
        per_rank = run_ranks(tsp_size, _run_generate, arch=arch, input_ids=prompts, max_new_tokens=8)
        diff = max((r["logits"] - ref_logits).abs().max().item() for r in per_rank)
        print(f"D={tsp_size} {arch}: max|logit diff| {diff:.2e}; cache {[r['cache_bytes'] for r in per_rank]} B")
        assert all(torch.equal(r["sequences"], ref_tokens) for r in per_rank)
        assert diff <= TOLERANCE
    check_strategies_on_left_padded_prompts(run_ranks, arch)


def _wrong_map(**kwargs):
    """``model_parity`` with every chunk's state map off by 1% (its ``U``), as exchanged."""
    gather_maps = recurrence.gather_maps

    def wrong(*args):
        return [(T, U * 1.01) for T, U in gather_maps(*args)]

    with mock.patch.object(recurrence, "gather_maps", wrong), mock.patch("ds_tsp.injection.inject.probe_layers"):
        return model_parity(**kwargs)


def _no_halo(**kwargs):
    """``model_parity`` with the convolution's halos dropped (zeros before every chunk)."""
    def no_halos(x, group, layout_name, width):
        return [x.new_zeros(x.shape[0], width, x.shape[2])] * 2

    with mock.patch("ds_tsp.blocks.linear.conv.halos", no_halos), mock.patch("ds_tsp.injection.inject.probe_layers"):
        return model_parity(**kwargs)


def test_a_wrong_map_halo_or_shard_is_caught(run_ranks):
    for label, body, kwargs in (("chunk map 1% off", _wrong_map, {}), ("halo dropped", _no_halo, {}),
                                ("head group scaled", model_parity, {"wrong_shard": "model.layers.0.mamba"})):
        check_caught(run_ranks(2, body, arch="bamba", batch=2, seq_len=13, relative=True, **kwargs), label)


def _layer_bytes(seq_len):
    """One Mamba-2 mixer's forward and backward on this rank's tokens: the bytes it received, by op."""
    topo = TSPTopology(dist.get_world_size())
    D, r = topo.tsp_size, topo.tsp_rank
    model = tiny_model("bamba")
    tsp = TSPMamba2.from_hf(model.model.layers[0].mamba, model.config, topo.tsp_group)
    torch.manual_seed(1)
    x = layout.shard(torch.randn(1, seq_len, model.config.hidden_size, dtype=torch.float64), r, D, "zigzag")
    x.requires_grad_()
    comm.counter.reset()
    y = tsp(x)
    forward = {op: counts["received"] for op, counts in comm.counter.snapshot().items()}
    y.backward(torch.ones_like(y))
    return forward, {op: counts["received"] for op, counts in comm.counter.snapshot().items()}


def test_bytes_equal_the_planner_and_do_not_grow_with_the_sequence(run_ranks):
    """At D = 4 every op of a Mamba-2 layer moves what ``mamba2_bytes_by_op`` says, the same at S = 256 and
    S = 4096: its three pieces' broadcasts, the convolution's halos (2 chunks x 3 tokens of every channel) and
    the chunks' state maps (2 x 8 heads x (1 + n p)) and, backward, their gradients."""
    config = tiny_model("bamba").config
    sizes = (config.hidden_size, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
             config.mamba_d_state, config.mamba_d_conv)
    for seq_len in (256, 4096):
        for forward, both in run_ranks(4, _layer_bytes, seq_len=seq_len):
            planned = {direction: mamba2_bytes_by_op(*sizes, 1, seq_len // 4, 4, 8, direction,
                                                     conv_bias=config.mamba_conv_bias)
                       for direction in ("forward", "both")}
            print(f"S={seq_len}: forward {forward}, planned {planned['forward']}; fwd+bwd {both}, "
                  f"planned {planned['both']}")
            assert forward == planned["forward"] and both == planned["both"]
