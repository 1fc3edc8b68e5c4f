"""Jamba's Mamba-1 mixers under TSP against the unsharded Hugging Face model, float64, with Hugging Face's float32
casts of the scan widened to float64 (tests/models.py)."""

import pytest

from ds_tsp.blocks.linear.mamba1 import TSPMamba1
from ds_tsp.planning.communication import mamba1_bytes_by_op
from models import tiny_model
from parity import check, check_caught, model_parity
from recurrent_checks import layer_bytes, no_halo_parity, wrong_map_parity

# Right- and left-padded, packed (every state restarts at each document, and the convolution's window stops there)
# and 45 tokens (chunks of 5 or 6 tokens a rank at D = 4).
CASES = (dict(batch=2, seq_len=13, right_padding=3), dict(batch=2, seq_len=16, left_padding=5),
         dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]), dict(batch=1, seq_len=45))


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_jamba_matches_hugging_face(run_ranks, tsp_size):
    """Loss and every gradient (its MoE layers' too), relative to the largest entry of the reference's where it is
    above 1; and biased projections (mamba_proj_bias), right-padded."""
    for case in CASES:
        check(run_ranks(tsp_size, model_parity, arch="jamba", relative=True, **case), f"D={tsp_size} jamba {case}")
    if tsp_size > 1:
        check(run_ranks(tsp_size, model_parity, arch="jamba", relative=True, model_overrides={"mamba_proj_bias": True},
                        **CASES[0]), f"D={tsp_size} jamba mamba_proj_bias {CASES[0]}")


def test_generate_gives_hugging_face_tokens(run_ranks):
    """At D = 2: greedy tokens and every step's logits against Hugging Face's (its float32 casts widened), and
    greedy, beam search and penalties on left-padded prompts (each row's state after its own last token); each
    rank keeps its channels' Mamba-1 states and half of the attention layer's tokens."""
    from test_generate import check_recurrent_generation

    check_recurrent_generation(run_ranks, "jamba")


def test_a_wrong_map_halo_or_shard_is_caught(run_ranks):
    for label, body, kwargs in (("chunk map 1% off", wrong_map_parity, {}), ("halo dropped", no_halo_parity, {}),
                                ("channel group scaled", model_parity, {"wrong_shard": "model.layers.0.mamba"})):
        check_caught(run_ranks(2, body, arch="jamba", batch=2, seq_len=13, relative=True, **kwargs), label)


def test_bytes_equal_the_planner_and_do_not_grow_with_the_sequence(run_ranks):
    """At D = 4 every op of a Mamba-1 layer moves what ``mamba1_bytes_by_op`` says, the same at S = 256 and
    S = 4096: its three pieces' broadcasts, the convolution's halos (2 chunks x 3 tokens of every channel) and
    the chunks' state maps (2 x 2 x d_inner x n: an elementwise T and U) and, backward, their gradients."""
    config = tiny_model("jamba").config
    sizes = (config.hidden_size, config.mamba_expand * config.hidden_size, config.mamba_d_state,
             config.mamba_dt_rank, config.mamba_d_conv)
    for seq_len in (256, 4096):
        for forward, both in run_ranks(4, layer_bytes, arch="jamba", path="model.layers.0.mamba",
                                       block_class=TSPMamba1, seq_len=seq_len):
            planned = {direction: mamba1_bytes_by_op(*sizes, 1, seq_len // 4, 4, 8, direction,
                                                     conv_bias=config.mamba_conv_bias)
                       for direction in ("forward", "both")}
            print(f"S={seq_len}: forward {forward}, planned {planned['forward']}; fwd+bwd {both}, "
                  f"planned {planned['both']}")
            assert forward == planned["forward"] and both == planned["both"]
