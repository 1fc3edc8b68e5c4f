"""LFM's gated short-convolution hybrids (LFM2, LFM2-MoE, LFM3) under TSP against the unsharded Hugging Face model,
float64."""

import pytest

from ds_tsp.blocks.linear.short_conv import TSPShortConv
from ds_tsp.planning.communication import short_conv_bytes_by_op
from models import tiny_model
from parity import check, check_caught, model_parity
from recurrent_checks import check_left_padding_refused, layer_bytes, no_halo_parity

# Right- and left-padded, packed (the convolution's window stops at each document's start, as Hugging Face's model
# run on each document alone) and long enough that every rank's chunks need halos from other ranks at D = 4.
CASES = (dict(batch=2, seq_len=13, right_padding=3), dict(batch=2, seq_len=16, left_padding=5),
         dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]), dict(batch=1, seq_len=45))
ARCHS = ("lfm2", "lfm2_moe", "lfm3")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_lfm_hybrids_match_hugging_face(run_ranks, tsp_size):
    """Loss and every gradient, relative to the largest entry of the reference's where it is above 1."""
    for arch in ARCHS:
        for case in CASES:
            check(run_ranks(tsp_size, model_parity, arch=arch, relative=True, **case), f"D={tsp_size} {arch} {case}")


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_biased_convolutions_match_hugging_face(run_ranks, tsp_size):
    """conv_bias: biases on in_proj (split with its rows), the convolution (with its channels) and out_proj
    (whole), right-padded and packed."""
    for case in (CASES[0], CASES[2]):
        check(run_ranks(tsp_size, model_parity, arch="lfm2", relative=True, model_overrides={"conv_bias": True},
                        **case), f"D={tsp_size} lfm2 conv_bias {case}")


def test_left_padding_with_a_biased_in_proj_is_refused():
    """Hugging Face's convolution carries a biased in_proj's output at the padding into the first real tokens:
    refused by name, in training and in generation."""
    check_left_padding_refused("lfm2", "model.layers.0.conv", conv_bias=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_gives_hugging_face_tokens(run_ranks, arch):
    """At D = 2: greedy tokens and every step's logits against Hugging Face's, and greedy, beam search and
    penalties on left-padded prompts (each row's window after its own last token); each rank keeps its channels'
    convolution windows and half of the attention layers' tokens."""
    from test_generate import check_recurrent_generation

    check_recurrent_generation(run_ranks, arch)


def test_a_dropped_halo_or_wrong_shard_is_caught(run_ranks):
    for label, body, kwargs in (("halo dropped", no_halo_parity, {}),
                                ("channel group scaled", model_parity, {"wrong_shard": "model.layers.0.conv"})):
        check_caught(run_ranks(2, body, arch="lfm2", batch=2, seq_len=13, relative=True, **kwargs), label)


def test_bytes_equal_the_planner_and_do_not_grow_with_the_sequence(run_ranks):
    """At D = 4 every op of a short-convolution layer moves what ``short_conv_bytes_by_op`` says, the same at
    S = 256 and S = 4096: its three pieces' broadcasts and the convolution's halos (2 chunks x 2 tokens of every
    channel) and, backward, their gradients."""
    config = tiny_model("lfm2").config
    for seq_len in (256, 4096):
        for forward, both in run_ranks(4, layer_bytes, arch="lfm2", path="model.layers.0.conv",
                                       block_class=TSPShortConv, seq_len=seq_len):
            planned = {direction: short_conv_bytes_by_op(config.hidden_size, config.conv_L_cache, 1, seq_len // 4, 4,
                                                         8, direction, bias=config.conv_bias)
                       for direction in ("forward", "both")}
            print(f"S={seq_len}: forward {forward}, planned {planned['forward']}; fwd+bwd {both}, "
                  f"planned {planned['both']}")
            assert forward == planned["forward"] and both == planned["both"]
