"""Mamba-2 hybrids (Bamba, Granite-4.0-H dense and MoE, Nemotron-H, Falcon-H1) under TSP against the unsharded
Hugging Face model, float64, with Hugging Face's float32 casts of the scan widened to float64 (tests/models.py)."""

import pytest

from ds_tsp.blocks.linear.mamba2_module import TSPMamba2
from ds_tsp.planning.communication import mamba2_bytes_by_op
from models import tiny_model
from parity import check, check_caught, model_parity
from recurrent_checks import check_left_padding_refused, layer_bytes, no_halo_parity, wrong_map_parity

# Right- and left-padded, packed (documents restarting the positions: every state restarts at each, and the
# convolution's window stops there) and many 8-token SSM chunks (45 tokens: chunks of 5 or 6 tokens a rank at D = 4,
# not a multiple of the SSM chunk).
CASES = (dict(batch=2, seq_len=13, right_padding=3), dict(batch=2, seq_len=16, left_padding=5),
         dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]), dict(batch=1, seq_len=45))
ARCHS = ("bamba", "granitemoehybrid", "granitemoehybrid_moe", "nemotron_h", "falcon_h1")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_mamba2_hybrids_match_hugging_face(run_ranks, tsp_size):
    """Loss and every gradient, relative to the largest entry of the reference's where it is above 1."""
    for arch in ARCHS:
        for case in CASES:
            check(run_ranks(tsp_size, model_parity, arch=arch, relative=True, **case), f"D={tsp_size} {arch} {case}")


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_variants_match_hugging_face(run_ranks, tsp_size):
    """Bamba with one group of B/C rows for every head (its default, its gated norm over the whole inner width),
    and with biased projections (mamba_proj_bias), right-padded; Falcon-H1 with its mixers' gated norm, normed
    before the gate (mamba_norm_before_gate, its default) and after, padded and packed."""
    variants = (("bamba", {"mamba_n_groups": 1}, CASES[1]), ("bamba", {"mamba_n_groups": 1}, CASES[0]),
                ("bamba", {"mamba_proj_bias": True}, CASES[0]), ("falcon_h1_norm", {}, CASES[1]),
                ("falcon_h1_norm", {}, CASES[2]), ("falcon_h1_norm", {"mamba_norm_before_gate": False}, CASES[0]))
    for arch, overrides, case in variants:
        check(run_ranks(tsp_size, model_parity, arch=arch, relative=True, model_overrides=overrides, **case),
              f"D={tsp_size} {arch} {overrides} {case}")


def test_left_padding_with_a_biased_in_proj_is_refused():
    """Hugging Face's convolution carries a biased in_proj's output at the padding into the first real tokens
    (its loss moves 5.4e-2 from the rows moved left): refused by name, in training and in generation."""
    check_left_padding_refused("bamba", "model.layers.0.mamba", mamba_proj_bias=True)


def test_granite_moe_load_balancing_loss(run_ranks):
    """Granite-4.0-H's MoE beside its shared MLP with output_router_logits: the loss with Hugging Face's auxiliary
    loss over the whole sequence, and every gradient, at D = 2 under both MoE schedules (test_moe's harness)."""
    from test_moe import SCHEDULES, check_case, moe_parity

    case = ("granitemoehybrid_moe", 2, 13, 3, "random", {"output_router_logits": True, "router_aux_loss_coef": 0.1})
    per_rank = run_ranks(2, moe_parity, cases=[case])
    for i, schedule in enumerate(SCHEDULES):
        grads = check_case([rank[i] for rank in per_rank], f"D=2 {schedule} granitemoehybrid_moe, its aux loss")
        assert "block_sparse_moe.experts.gate_up_proj" in " ".join(grads)


@pytest.mark.parametrize("arch", ["bamba", "granitemoehybrid", "granitemoehybrid_moe", "nemotron_h", "falcon_h1",
                                  "falcon_h1_norm"])
def test_generate_gives_hugging_face_tokens(run_ranks, arch):
    """At D = 2: greedy tokens and every step's logits against Hugging Face's (its float32 casts widened), and
    greedy, beam search and penalties on left-padded prompts (each row's state after its own last token); each
    rank keeps its heads' Mamba-2 states and half of the attention layer's tokens."""
    from test_generate import check_recurrent_generation

    # At D = 4 each norm group's heads lie on two ranks (its sums of squares all-reduced).
    check_recurrent_generation(run_ranks, arch, (2, 4) if arch == "bamba" else (2,))


def test_a_wrong_map_halo_or_shard_is_caught(run_ranks):
    """Bamba's mixer, and Falcon-H1's beside its attention (a wrong shard there moves the summed branch)."""
    mixer = "model.layers.0.mamba"
    for label, body, kwargs in (("chunk map 1% off", wrong_map_parity, {"arch": "bamba"}),
                                ("halo dropped", no_halo_parity, {"arch": "bamba"}),
                                ("head group scaled", model_parity, {"arch": "bamba", "wrong_shard": mixer}),
                                ("Falcon-H1's side mixer scaled", model_parity, {"arch": "falcon_h1",
                                                                                  "wrong_shard": mixer})):
        check_caught(run_ranks(2, body, batch=2, seq_len=13, relative=True, **kwargs), label)


def test_bytes_equal_the_planner_and_do_not_grow_with_the_sequence(run_ranks):
    """At D = 4 every op of a Mamba-2 layer moves what ``mamba2_bytes_by_op`` says, the same at S = 256 and
    S = 4096: its three pieces' broadcasts, the convolution's halos (2 chunks x 3 tokens of every channel) and
    the chunks' state maps (2 x 8 heads x (1 + n p)) and, backward, their gradients."""
    config = tiny_model("bamba").config
    sizes = (config.hidden_size, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
             config.mamba_d_state, config.mamba_d_conv)
    for seq_len in (256, 4096):
        for forward, both in run_ranks(4, layer_bytes, arch="bamba", path="model.layers.0.mamba",
                                             block_class=TSPMamba2, seq_len=seq_len):
            planned = {direction: mamba2_bytes_by_op(*sizes, 1, seq_len // 4, 4, 8, direction,
                                                     conv_bias=config.mamba_conv_bias)
                       for direction in ("forward", "both")}
            print(f"S={seq_len}: forward {forward}, planned {planned['forward']}; fwd+bwd {both}, "
                  f"planned {planned['both']}")
            assert forward == planned["forward"] and both == planned["both"]
