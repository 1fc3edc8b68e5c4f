"""Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid) and Kimi Linear's KDA under TSP against the unsharded Hugging Face
model, float64, with Hugging Face's float32 casts of the linear layers widened to float64 (tests/models.py)."""

import dataclasses
from unittest import mock

import pytest

from ds_tsp.blocks.linear import schedule
from ds_tsp.blocks.linear.module import TSPGatedDeltaNet
from ds_tsp.injection.policy import PolicyError
from ds_tsp.parallel.topology import TSPTopology
from ds_tsp.planning.communication import delta_net_bytes_by_op, kda_bytes_by_op
from models import tiny_causal_lm, tiny_model
from parity import check, check_caught, model_parity
from recurrent_checks import layer_bytes, no_halo_parity, wrong_map_parity

# Padded (13 tokens, the last 3 of a row masked), packed (documents restarting the positions: the state restarts
# at each) and longer than a 64-token chunk of the rule without being a multiple of it.
CASES = (dict(batch=2, seq_len=13, right_padding=3), dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]),
         dict(batch=1, seq_len=72))


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_hybrids_match_hugging_face(run_ranks, tsp_size):
    """Loss and every gradient of every hybrid class. Gradients are compared relative to the largest entry of
    the reference's (where it is above 1): the first tokens of a document reach the l2 norm of the rule with
    small queries, so these tiny models' gradients reach ~150, and Hugging Face's own gradients move by
    2.9e-10 between its chunk sizes 64 and 2."""
    for arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear"):
        for case in CASES:
            check(run_ranks(tsp_size, model_parity, arch=arch, relative=True, **case), f"D={tsp_size} {arch} {case}")


def _beta_in_zero_one(**kwargs):
    """``model_parity`` with OLMo-Hybrid's negative eigenvalues dropped (beta in [0, 1], not [0, 2])."""
    with mock.patch.object(TSPGatedDeltaNet, "plan", lambda self, x, documents=None: dataclasses.replace(
            plan_of(self, x, documents), beta_scale=1.0)), mock.patch("ds_tsp.injection.inject.probe_layers"):
        return model_parity(**kwargs)


plan_of = TSPGatedDeltaNet.plan


def test_negative_eigenvalues_are_needed(run_ranks):
    check_caught(run_ranks(2, _beta_in_zero_one, arch="olmo_hybrid", batch=2, seq_len=13, relative=True),
                 "OLMo-Hybrid's beta in [0, 1]")


def test_a_wrong_map_halo_or_shard_is_caught(run_ranks):
    for arch, mixer in (("qwen3_5", "linear_attn"), ("kimi_linear", "self_attn")):
        for label, body, kwargs in (("chunk map 1% off", wrong_map_parity, {}), ("halo dropped", no_halo_parity, {}),
                                    ("head group scaled", model_parity, {"wrong_shard": f"model.layers.0.{mixer}"})):
            check_caught(run_ranks(2, body, arch=arch, batch=2, seq_len=13, relative=True, **kwargs),
                         f"{arch}: {label}")


def _per_head_decay(**kwargs):
    """``model_parity`` with KDA's decay one a head (its channels' mean), not one a key channel."""
    inputs = schedule.kda_inputs

    def averaged(*args):
        *rest, g = inputs(*args)
        return (*rest, g.mean(-1, keepdim=True).expand_as(g))

    with mock.patch.object(schedule, "kda_inputs", averaged), mock.patch("ds_tsp.injection.inject.probe_layers"):
        return model_parity(**kwargs)


def test_a_decay_per_head_is_caught(run_ranks):
    check_caught(run_ranks(2, _per_head_decay, arch="kimi_linear", batch=2, seq_len=13, relative=True),
                 "KDA's decay per head, not per key channel")


def test_kda_bytes_equal_the_planner_and_do_not_grow_with_the_sequence(run_ranks):
    """At D = 4 every op of a KDA layer moves what ``kda_bytes_by_op`` says, the same at S = 256 and S = 4096."""
    config = tiny_model("kimi_linear").config
    sizes = (config.hidden_size, config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim)
    for seq_len in (256, 4096):
        for forward, both in run_ranks(4, layer_bytes, arch="kimi_linear", path="model.layers.0.self_attn",
                                             block_class=TSPGatedDeltaNet, seq_len=seq_len):
            planned = {direction: kda_bytes_by_op(*sizes, 1, seq_len // 4, 4, 8, direction)
                       for direction in ("forward", "both")}
            print(f"KDA S={seq_len}: forward {forward}, planned {planned['forward']}; fwd+bwd {both}, "
                  f"planned {planned['both']}")
            assert forward == planned["forward"] and both == planned["both"]


def test_bytes_equal_the_planner_and_do_not_grow_with_the_sequence(run_ranks):
    """At D = 4 every op of a layer moves what ``delta_net_bytes_by_op`` says, the same at S = 256 and
    S = 4096: the head groups' broadcasts, the convolution's halos (2 chunks x 3 tokens) and the chunks'
    state maps (2 x 2 value heads x dk (dk + dv) per rank and head group) and, backward, their gradients."""
    config = tiny_model("qwen3_5").config
    sizes = (config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
             config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim)
    for seq_len in (256, 4096):
        for forward, both in run_ranks(4, layer_bytes, arch="qwen3_5", path="model.layers.0.linear_attn",
                                             block_class=TSPGatedDeltaNet, seq_len=seq_len):
            planned = {direction: delta_net_bytes_by_op(*sizes, 1, seq_len // 4, 4, 8, direction)
                       for direction in ("forward", "both")}
            print(f"S={seq_len}: forward {forward}, planned {planned['forward']}; fwd+bwd {both}, "
                  f"planned {planned['both']}")
            assert forward == planned["forward"] and both == planned["both"]


@pytest.mark.parametrize("overrides, refusal", [
    ({"layers_block_type": ["mamba", "hybrid", "hybrid"]},
     r"linear_attention layer holding ZambaMambaMixer, not a recurrent mixer"),
    ({}, r"hybrid layer \(ZambaHybridLayer\) that does not hold a recurrent mixer beside its attention")])
def test_other_linear_layers_are_refused_by_name(overrides, refusal):
    """Zamba's Mamba mixer (its own heads of Mamba-1, not Jamba's shape) and its hybrid layers (a shared transformer
    block, not a mixer beside the attention): refused before any weight moves, naming the class."""
    import ds_tsp
    from ds_tsp.config import TSPConfig

    with pytest.raises(PolicyError, match=refusal):
        ds_tsp.inject(tiny_causal_lm("zamba", device="meta", **overrides), TSPTopology(1),
                      TSPConfig(enabled=True, size=1))


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear"])
def test_generate_gives_hugging_face_tokens(run_ranks, arch):
    """At D = 2: greedy tokens and every step's logits against Hugging Face's (its float32 casts widened), and
    greedy, beam search and penalties on left-padded prompts (each row's state after its own last token); each
    rank keeps its head group's Gated DeltaNet states and half of the attention layer's tokens."""
    from test_generate import check_recurrent_generation

    check_recurrent_generation(run_ranks, arch)


def test_multi_token_prediction_layers_are_named_as_not_built(caplog):
    """Qwen3.5's and Qwen3-Next's checkpoints describe one (mtp_num_hidden_layers); Hugging Face's model builds
    none (its loader drops the mtp.* weights), and neither does ds_tsp: the model is taken, and the log says so."""
    import ds_tsp
    from ds_tsp.config import TSPConfig

    model = tiny_model("qwen3_5", mtp_num_hidden_layers=1)
    with caplog.at_level("WARNING", logger="ds_tsp"):
        ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True, size=1, attention_backend="sdpa"))
    assert "mtp_num_hidden_layers = 1 multi-token-prediction layer(s) are not built" in caplog.text
