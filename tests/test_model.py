"""Whole injected models against the unsharded Hugging Face model, float64."""

from unittest import mock

import pytest
import torch

import ds_tsp
from ds_tsp.config import TSPConfig
from ds_tsp.blocks.fused import FusedRows
from ds_tsp.blocks.attention.schedule import attention_backward as REAL_ATTENTION_BACKWARD
from ds_tsp.blocks.attention.schedule import shared_heads as REAL_SHARED_HEADS
from ds_tsp.blocks.layer_inputs import local_layer_inputs as REAL_LOCAL_LAYER_INPUTS
from ds_tsp.injection.inject import tsp_layer as REAL_TSP_LAYER
from ds_tsp.injection.policy import PolicyError
from ds_tsp.parallel.topology import TSPTopology
from distributed import RankFailure
from float32_control import ROUNDING_FLOOR
from models import tiny_model
from parity import NOT_DIFFS, TOLERANCE, check, check_caught, model_parity


# Fused projections (Phi-3's qkv_proj and gate_up_proj, read at shifted rows),
# padded and packed, the vocabulary folded and not; Phi-4-mini's shape rotates
# 3/4 of each head under longrope: its short factors for 13 tokens, its long
# ones for a packed row of 19, past original_max_position_embeddings = 16.
FUSED_CASES = [dict(arch="phi3", batch=2, seq_len=13),
               dict(arch="phi3", batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]], vocab_parallel=False),
               dict(arch="phi4_mini", batch=2, seq_len=13, vocab_parallel=False),
               dict(arch="phi4_mini", batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]])]


def parity_without_probe(patch, **kwargs):
    """``model_parity`` under ``patch``, which makes one piece of the TSP model wrong; injection's probe, which
    refuses each such piece, skipped."""
    with patch, mock.patch("ds_tsp.injection.inject.probe_layers"):
        return model_parity(**kwargs)


def check_moved(per_rank, label):
    """The guards' verdict: a deliberately wrong piece moved some loss or gradient by far more than the tolerance."""
    worst = max(value for rank in per_rank for key, value in rank.items() if key not in NOT_DIFFS)
    print(f"{label}: max diff {worst:.2e}, loss moved {max(rank['loss'] for rank in per_rank):.2e}")
    assert worst > 1e-3


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_loss_and_every_gradient_match_hugging_face(run_ranks, tsp_size):
    for arch in ("llama", "qwen2", "mistral", "qwen3"):
        for batch, seq_len in ((1, 16), (2, 13)):  # 13 needs padding at every D > 0
            per_rank = run_ranks(tsp_size, model_parity, arch=arch, batch=batch, seq_len=seq_len)
            check(per_rank, f"D={tsp_size} {arch} B={batch} S={seq_len}")
    for case in FUSED_CASES:
        check(run_ranks(tsp_size, model_parity, **case), f"D={tsp_size} {case}")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_gemma_and_olmo_families_match_hugging_face(run_ranks, tsp_size):
    """Gemma, Gemma-2 (sandwich norms, soft-capped scores and logits, sliding
    layers, a query_pre_attn_scalar scale), Gemma-3 (per-head q/k norms, a
    RoPE table per layer type), VaultGemma (Gemma-2's features under pre-norms,
    taken by the auto policy and its probe), OLMo-2 (post-norms, q/k norms over
    the whole projection: their RMS spans every rank's heads) and OLMo-3
    (OLMo-2's with sliding layers): padded, packed, vocabulary folded or not."""
    cases = (dict(batch=2, seq_len=13), dict(batch=1, seq_len=16, vocab_parallel=False),
             dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]))
    for arch in ("gemma", "gemma2", "gemma3", "vaultgemma", "olmo2", "olmo3"):
        for case in cases:
            per_rank = run_ranks(tsp_size, model_parity, arch=arch, **case)
            check(per_rank, f"D={tsp_size} {arch} {case}")


def test_a_wrong_shard_of_gemma2_or_olmo2_is_caught(run_ranks):
    for arch, wrong_shard in (("gemma2", "model.layers.1.self_attn"), ("gemma2", "lm_head"),
                              ("vaultgemma", "model.layers.0.mlp"), ("olmo2", "model.layers.0.self_attn")):
        per_rank = run_ranks(2, model_parity, arch=arch, batch=2, seq_len=13, wrong_shard=wrong_shard)
        check_moved(per_rank, f"{arch}, {wrong_shard} scaled on the last rank")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_hunyuan_dense_and_moe_match_hugging_face(run_ranks, tsp_size):
    """Hunyuan's per-head q/k norms run on the rotated queries and keys (its
    query_layernorm / key_layernorm), taken by the auto policy; its MoE's shared
    expert is shared_mlp: padded, packed, vocabulary folded or not."""
    cases = (dict(batch=2, seq_len=13), dict(batch=1, seq_len=16, vocab_parallel=False),
             dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]))
    for arch in ("hunyuan_v1_dense", "hunyuan_v1_moe"):
        for case in cases:
            check(run_ranks(tsp_size, model_parity, arch=arch, **case), f"D={tsp_size} {arch} {case}")


def _norms_before_the_rotary(**kwargs):
    """``model_parity`` with Hunyuan's q/k norms applied before the rotary
    embedding, as Qwen3's are; injection's probe, which refuses that, skipped."""
    return parity_without_probe(mock.patch("ds_tsp.blocks.rotary.norms_after_rotary", lambda norm: False), **kwargs)


def test_hunyuan_norms_before_the_rotary_are_caught(run_ranks):
    per_rank = run_ranks(2, _norms_before_the_rotary, arch="hunyuan_v1_dense", batch=2, seq_len=13)
    check_moved(per_rank, "Hunyuan's q/k norms before the rotary embedding")


# Rotary conventions other than Llama's, by the model's own function (issue 62): ERNIE 4.5 (dense, MoE) and Helium
# rotate interleaved pairs, GLM and GLM-4 on half of each head (their gate/up fused, GLM-4's sandwich norms under
# its own names), Flint's full layers take no positions (NoPE), Ministral 3 scales its queries by position.
ROTARY_ARCHS = ("ernie4_5", "ernie4_5_moe", "helium", "glm", "glm4", "flint", "ministral3")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_rotary_conventions_match_hugging_face(run_ranks, tsp_size):
    """Padded, packed, vocabulary folded or not; ERNIE 4.5-MoE's routers compute in float32 (its gradients are
    held relative to their scale, as the class scan holds them)."""
    cases = (dict(batch=2, seq_len=13), dict(batch=1, seq_len=16, vocab_parallel=False),
             dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]))
    for arch in ROTARY_ARCHS:
        for case in cases:
            relative = arch == "ernie4_5_moe"
            check(run_ranks(tsp_size, model_parity, arch=arch, relative=relative, **case),
                  f"D={tsp_size} {arch} {case}", ROUNDING_FLOOR if relative else TOLERANCE)


def _rotary_wrong(wrong, **kwargs):
    """``model_parity`` with one rotary piece wrong (``wrong``): the interleaved pairs rotated as halves, every
    layer rotated (Flint's NoPE layers too), or the query scale dropped; injection's probe, which refuses each
    of them, skipped."""
    from ds_tsp.blocks import rotary
    patches = {"halves": mock.patch("ds_tsp.blocks.attention.module.model_rotary", lambda attn, halves: rotary.ROTATE_HALF),
               "nope": mock.patch("ds_tsp.blocks.rotary.rotates", lambda attn: True),
               "scale": mock.patch("ds_tsp.blocks.attention.module.query_scale_of", lambda attn, config: None)}
    return parity_without_probe(patches[wrong], **kwargs)


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_granite_moe_matches_hugging_face(run_ranks, tsp_size):
    """Granite-MoE's experts at block_sparse_moe (the auto policy finds the block by that name); its embedding,
    attention, residual and logit multipliers. Its router casts a float64 matmul to float32, which rounds each row
    alone, so the TSP run routes to the same float32 weights and is held to float64's tolerance."""
    cases = (dict(batch=2, seq_len=13), dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]))
    for case in cases:
        check(run_ranks(tsp_size, model_parity, arch="granitemoe", **case), f"D={tsp_size} granitemoe {case}")


def _granite_multiplier_dropped(multiplier, **kwargs):
    """``model_parity`` with one of Granite's multipliers left out of the TSP forward; injection's probe, which
    refuses that, skipped."""
    patches = {"embedding": mock.patch("ds_tsp.injection.model.embedding_multiplier", lambda config: 1.0),
               "residual": mock.patch("ds_tsp.injection.model.scaled", lambda hidden, multiplier: hidden)}
    return parity_without_probe(patches[multiplier], **kwargs)


@pytest.mark.parametrize("multiplier", ["embedding", "residual"])
def test_a_dropped_granite_multiplier_is_caught(run_ranks, multiplier):
    per_rank = run_ranks(2, _granite_multiplier_dropped, multiplier=multiplier, arch="granitemoe", batch=2,
                         seq_len=13)
    check_moved(per_rank, f"Granite-MoE without its {multiplier} multiplier")


# Cohere (Command R), Cohere2 (Command A) and Cohere2-MoE: attention and MLP side by side off one norm, the logits
# scaled in the folded head, interleaved pairs rotated in float32, Cohere2's full layers without positions.
COHERE_ARCHS = ("cohere", "cohere2", "cohere2_moe")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_cohere_families_match_hugging_face(run_ranks, tsp_size):
    cases = (dict(batch=2, seq_len=13), dict(batch=1, seq_len=16, vocab_parallel=False),
             dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]))
    for arch in COHERE_ARCHS:
        for case in cases:
            check(run_ranks(tsp_size, model_parity, arch=arch, **case), f"D={tsp_size} {arch} {case}")


def sequential_blocks(layer, hidden, run_attention, run_mlp, run_attention_with_norm=None, **_):
    """``TSPDecoderLayer.blocks`` ignoring ``parallel``: the MLP after the attention, on its output."""
    return layer.branch("mlp", layer.branch("attention", hidden, run_attention, run_attention_with_norm), run_mlp)


def _cohere_wrong(wrong, **kwargs):
    """``model_parity`` with Cohere's blocks run one after the other, or its logits left unscaled; injection's
    probe, which refuses either, skipped."""
    patches = {"sequential": mock.patch("ds_tsp.injection.model.TSPDecoderLayer.blocks", sequential_blocks),
               "unscaled": mock.patch("ds_tsp.injection.model.LogitMap.of", lambda config: None)}
    return parity_without_probe(patches[wrong], **kwargs)


@pytest.mark.parametrize("wrong", ["sequential", "unscaled"])
def test_a_wrong_cohere_block_is_caught(run_ranks, wrong):
    per_rank = run_ranks(2, _cohere_wrong, wrong=wrong, arch="cohere", batch=2, seq_len=13)
    check_moved(per_rank, f"Cohere with its blocks {wrong}")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_ungated_mlps_match_hugging_face(run_ranks, tsp_size):
    """Nemotron's and Jais-2's MLPs, down(act(up(x))) (Jais-2's with biases), on the MLP ring without a gate."""
    cases = (dict(batch=2, seq_len=13), dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]))
    for arch in ("nemotron", "jais2"):
        for case in cases:
            check(run_ranks(tsp_size, model_parity, arch=arch, **case), f"D={tsp_size} {arch} {case}")


def test_a_wrong_ungated_mlp_shard_is_caught(run_ranks):
    per_rank = run_ranks(2, model_parity, arch="jais2", batch=2, seq_len=13, wrong_shard="model.layers.0.mlp")
    check_caught(per_rank, "Jais-2's MLP shard scaled on one rank")


@pytest.mark.parametrize("arch, wrong", [("ernie4_5", "halves"), ("glm4", "halves"), ("flint", "nope"),
                                         ("ministral3", "scale")])
def test_a_wrong_rotary_convention_is_caught(run_ranks, arch, wrong):
    per_rank = run_ranks(2, _rotary_wrong, wrong=wrong, arch=arch, batch=2, seq_len=13)
    check_moved(per_rank, f"{arch} with the rotary {wrong} wrong")


PACKED = dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]])


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_llama4_matches_hugging_face(run_ranks, tsp_size):
    """Llama 4 text: chunked layers (chunks of 3 tokens, cut at every row's and document's start) rotating by its
    complex table with a weightless q/k norm after it, a NoPE layer with temperature-tuned queries, a dense layer
    and MoE layers whose routing weights scale the experts' inputs, under both expert schedules; padded, packed,
    the vocabulary folded or not; left-padded rows moved, keeping each token's chunk and cache position."""
    cases = (dict(batch=2, seq_len=13), dict(batch=2, seq_len=13, right_padding=3),
             dict(batch=2, seq_len=13, left_padding=4), dict(batch=1, seq_len=16, vocab_parallel=False), PACKED)
    for case in cases:
        for schedule in ("ring", "all_to_all"):
            check(run_ranks(tsp_size, model_parity, arch="llama4", moe_schedule=schedule, **case),
                  f"D={tsp_size} llama4 {schedule} {case}")


# The released checkpoints' settings: Scout's top-1 routing and llama3 RoPE; Maverick's dense layers between MoE
# ones, without the q/k norm or temperature tuning.
LLAMA4_RELEASED = {"scout": dict(num_experts_per_tok=1, rope_parameters={
                       "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
                   "maverick": dict(num_experts_per_tok=1, moe_layers=[1], use_qk_norm=False,
                                    attn_temperature_tuning=False)}


@pytest.mark.parametrize("released", sorted(LLAMA4_RELEASED))
def test_llama4_as_released_matches_hugging_face(run_ranks, released):
    for case in (dict(batch=2, seq_len=13, right_padding=3), dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]])):
        check(run_ranks(2, model_parity, arch="llama4", model_overrides=LLAMA4_RELEASED[released], **case),
              f"D=2 llama4 as {released} {case}")


def _llama4_wrong(wrong, **kwargs):
    """``model_parity`` with one of Llama 4's pieces wrong: its chunked layers attending causally over the whole
    row, its NoPE layer's queries not temperature-tuned, or its routing weights scaling the experts' outputs;
    injection's probe, which refuses each, skipped."""
    patches = {"chunks": mock.patch("ds_tsp.blocks.attention.module.attention_chunk_of", lambda attn, config: None),
               "temperature": mock.patch("ds_tsp.blocks.attention.module.query_scale_of", lambda attn, config: None),
               "output_weights": mock.patch("ds_tsp.blocks.moe.module.scales_expert_inputs", lambda moe: False),
               "temperature_at_position_ids": mock.patch("ds_tsp.blocks.rotary.TemperatureTuning.reads",
                                                         "position_ids")}
    return parity_without_probe(patches[wrong], **kwargs)


# Temperature tuning read at the position ids, which packed documents restart, instead of each token's index in
# its row: only packed rows tell the two apart.
@pytest.mark.parametrize("wrong, case", [("chunks", dict(batch=2, seq_len=13)),
                                         ("temperature", dict(batch=2, seq_len=13)),
                                         ("output_weights", dict(batch=2, seq_len=13)),
                                         ("temperature_at_position_ids", PACKED)])
def test_a_wrong_llama4_piece_is_caught(run_ranks, wrong, case):
    per_rank = run_ranks(2, _llama4_wrong, wrong=wrong, arch="llama4", **case)
    check_moved(per_rank, f"Llama 4 with its {wrong} wrong")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_gemma4_matches_hugging_face(run_ranks, tsp_size):
    """Gemma 4 text: sliding layers of 4-wide heads, full layers of 8-wide heads with one key/value head whose
    keys (before their norm and rotary) are its values, every layer's values normed without a weight,
    proportional RoPE on the full layers, each layer's output times its layer_scalar; padded both ways, packed,
    the vocabulary folded or not."""
    # The released configs' use_bidirectional_attention "vision" leaves the text model causal.
    cases = (dict(batch=2, seq_len=13, right_padding=3), dict(batch=2, seq_len=13, left_padding=4), PACKED,
             dict(batch=1, seq_len=16, vocab_parallel=False),
             dict(batch=2, seq_len=13, model_overrides={"use_bidirectional_attention": "vision"}))
    for case in cases:
        check(run_ranks(tsp_size, model_parity, arch="gemma4", **case), f"D={tsp_size} gemma4 {case}")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_gemma4_experts_beside_the_mlp_match_hugging_face(run_ranks, tsp_size):
    """Gemma 4's MoE layers (26B-A4B's): beside each dense MLP, Hugging Face's router on the branch's input (its
    own weightless norm, scale and per-expert scales) and 4 experts (top-2) on pre_feedforward_layernorm_2 of
    it, the two outputs normed apart and summed; under both expert schedules, padded and packed."""
    for case in (dict(batch=2, seq_len=13, right_padding=3), PACKED):
        for schedule in ("ring", "all_to_all"):
            check(run_ranks(tsp_size, model_parity, arch="gemma4_moe", moe_schedule=schedule, **case),
                  f"D={tsp_size} gemma4_moe {schedule} {case}")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_gemma4_shared_keys_and_values_match_hugging_face(run_ranks, tsp_size):
    """Gemma 4's key/value sharing (E2B's and E4B's): its last two layers (a sliding and a full one, double-wide
    MLPs) attend to the keys and values of the last earlier layer of their type, which hands its local tokens' on;
    the gradients of those keys and values flow back into the layer that made them; padded, packed, and under
    activation checkpointing (each layer's shared keys and values are its checkpoint's input or output)."""
    for case in (dict(batch=2, seq_len=13, right_padding=3), PACKED, dict(batch=2, seq_len=13, checkpointing=True)):
        check(run_ranks(tsp_size, model_parity, arch="gemma4_shared_kv", **case), f"D={tsp_size} gemma4 shared {case}")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_gemma4_per_layer_inputs_match_hugging_face(run_ranks, tsp_size):
    """Gemma 4's per-layer inputs (E2B's and E4B's, beside their shared keys and values): a second embedding of
    4 values a layer, folded by vocabulary, mixed with the projected embeddings by the decoder's own
    project_per_layer_inputs, gated, projected, normed and added by every layer; padded, packed, unfolded."""
    for case in (dict(batch=2, seq_len=13, right_padding=3), PACKED, dict(batch=1, seq_len=16, vocab_parallel=False)):
        check(run_ranks(tsp_size, model_parity, arch="gemma4_layer_inputs", **case),
              f"D={tsp_size} gemma4 layer inputs {case}")


def _zero_layer_inputs(*args):
    inputs = REAL_LOCAL_LAYER_INPUTS(*args)
    return torch.zeros_like(inputs)


def test_gemma4_shared_keys_and_values_refuse_host_checkpoints(run_ranks):
    with pytest.raises(RankFailure, match=r"cpu_checkpointing .* keys and values shared across layers"):
        run_ranks(2, model_parity, arch="gemma4_shared_kv", batch=2, seq_len=13, checkpointing="host")


def _zero_shared_heads(plan, shared, j):
    k, v = REAL_SHARED_HEADS(plan, shared, j)
    return torch.zeros_like(k), torch.zeros_like(v)


def _shared_gradient_dropped(*args):
    args = list(args)
    if len(args) > 10 and args[10] is not None:  # the gradient of a storing layer's keys and values
        args[10] = torch.zeros_like(args[10])
    return REAL_ATTENTION_BACKWARD(*args)


def _without_layer_scalar(layer, *args, **kwargs):
    layer._buffers.pop("layer_scalar", None)
    return REAL_TSP_LAYER(layer, *args, **kwargs)


def _gemma4_wrong(wrong, **kwargs):
    """``model_parity`` with one of Gemma 4's pieces wrong."""
    patches = {"value_norm": mock.patch("ds_tsp.blocks.attention.schedule.attended_values", lambda plan, v: v),
               "layer_scalar": mock.patch("ds_tsp.injection.inject.tsp_layer", _without_layer_scalar),
               "experts_input_norm": mock.patch("ds_tsp.blocks.moe.module.TSPSparseMoE.expert_inputs",
                                                lambda self, x: x),
               "shared_kv": mock.patch("ds_tsp.blocks.attention.schedule.shared_heads", _zero_shared_heads),
               "shared_kv_gradient": mock.patch("ds_tsp.blocks.attention.schedule.attention_backward",
                                                _shared_gradient_dropped),
               "layer_inputs": mock.patch("ds_tsp.injection.model.local_layer_inputs", _zero_layer_inputs)}
    with patches[wrong]:
        return model_parity(**kwargs)


@pytest.mark.parametrize("wrong, arch", [("value_norm", "gemma4"), ("layer_scalar", "gemma4"),
                                         ("experts_input_norm", "gemma4_moe"), ("shared_kv", "gemma4_shared_kv"),
                                         ("shared_kv_gradient", "gemma4_shared_kv"),
                                         ("layer_inputs", "gemma4_layer_inputs")])
def test_a_wrong_gemma4_piece_is_caught(run_ranks, wrong, arch):
    """Gemma 4's values not normed, its layers' outputs not times their layer_scalar, its experts run on the
    branch's input rather than their own norm of it, the shared keys and values dropped (zeros) or their
    gradient not flowing back to the layer that made them, the per-layer inputs missing (zeros)."""
    check_moved(run_ranks(2, _gemma4_wrong, wrong=wrong, arch=arch, batch=2, seq_len=13), f"Gemma 4's {wrong}")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_hyperclovax_matches_hugging_face(run_ranks, tsp_size):
    """HyperCLOVA X: sandwich norms under its own names, Granite's multipliers, logits multiplied by
    logits_scaling (Granite's divides); padded and packed."""
    cases = (dict(batch=2, seq_len=13, right_padding=3), dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]))
    for case in cases:
        check(run_ranks(tsp_size, model_parity, arch="hyperclovax", **case), f"D={tsp_size} hyperclovax {case}")


def _logits_scaling_divided(**kwargs):
    """``model_parity`` with HyperCLOVA X's logits divided by logits_scaling, as Granite's are."""
    return parity_without_probe(mock.patch("ds_tsp.blocks.vocab.multiplies_logits_scaling", lambda cls: False),
                                **kwargs)


def test_hyperclovax_logits_divided_is_caught(run_ranks):
    per_rank = run_ranks(2, _logits_scaling_divided, arch="hyperclovax", batch=2, seq_len=13)
    check_moved(per_rank, "HyperCLOVA X's logits divided by logits_scaling")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_phimoe_with_jitter_zero_matches_hugging_face(run_ranks, tsp_size):
    """PhiMoE's sparsemixer router, Hugging Face's own module on the local tokens: with router_jitter_noise 0 its
    training-time Gumbel sampling always picks the top score, so the routes are HF's; padded and packed."""
    cases = (dict(batch=2, seq_len=13, right_padding=3), dict(batch=2, seq_len=19, documents=[[6, 1, 8, 4], [19]]))
    for case in cases:
        check(run_ranks(tsp_size, model_parity, arch="phimoe", **case), f"D={tsp_size} phimoe {case}")


def test_phimoe_with_jitter_is_refused_by_name():
    from models import tiny_model
    model = tiny_model("phimoe", router_jitter_noise=0.01)
    with pytest.raises(PolicyError, match="router_jitter_noise"):
        ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True, size=1))


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_tied_embeddings_contiguous_layout_and_right_padding(run_ranks, tsp_size):
    per_rank = run_ranks(tsp_size, model_parity, arch="llama_tied", batch=2, seq_len=19, layout="contiguous",
                         right_padding=5)
    check(per_rank, f"D={tsp_size} tied contiguous right-padded")


# Dynamic RoPE rescales its frequencies from the largest position id, here
# beyond max_position_embeddings: tables built from each rank's own positions
# alone would differ between ranks and from HF.
DYNAMIC_ROPE = {"max_position_embeddings": 8,
                "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_sequence_dependent_rope_sees_the_whole_sequence(run_ranks, tsp_size):
    for batch, seq_len in ((1, 16), (2, 13)):
        per_rank = run_ranks(tsp_size, model_parity, arch="llama", batch=batch, seq_len=seq_len,
                             model_overrides=DYNAMIC_ROPE)
        check(per_rank, f"D={tsp_size} dynamic RoPE B={batch} S={seq_len}")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_token_tiles_change_no_number(run_ranks, tsp_size):
    """tsp.token_tile smaller than the local tokens: several query tiles and MLP
    tiles per layer, a ragged last one, windows and packed documents, sums in
    the model dtype (tsp.fp32_accumulators off)."""
    cases = [dict(arch="llama", batch=2, seq_len=29, token_tile=5), dict(arch="mistral", batch=1, seq_len=29,
             token_tile=3), dict(arch="qwen3", batch=2, seq_len=19, token_tile=3, documents=[[6, 1, 8, 4], [19]]),
             # the soft-capped kernel on ragged query tiles of a window; q/k norms over the projection, tiled
             dict(arch="gemma2", batch=2, seq_len=19, token_tile=3, documents=[[6, 1, 8, 4], [19]]),
             dict(arch="olmo2", batch=2, seq_len=29, token_tile=5, overlap=False)]
    for case in cases:
        per_rank = run_ranks(tsp_size, model_parity, fp32_accumulators=False, **case)
        check(per_rank, f"D={tsp_size} {case}")
    # Activation checkpoints in host memory (cpu_checkpointing) with tiles.
    per_rank = run_ranks(tsp_size, model_parity, checkpointing="host", **cases[0])
    check(per_rank, f"D={tsp_size} {cases[0]} checkpoints in host memory")


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_recomputed_norms_change_no_number(run_ranks, tsp_size):
    """tsp.recompute_norms: the attention runs its layer's input norm inside and
    norms a token tile at a time in backward (ds_tsp.blocks.input_norm); every other
    norm keeps only its input and runs again in backward. Alone and inside
    recomputed layers (DeepSpeed's reentrant checkpoints, host memory), with
    ragged token tiles, a sliding window, packed documents, Gemma-2's sandwich
    norms of (1 + w) and soft-capped scores."""
    for checkpointing in (False, True, "host"):  # none, DeepSpeed's reentrant layer checkpoints, host memory
        plain = run_ranks(tsp_size, model_parity, arch="qwen3", batch=2, seq_len=13, checkpointing=checkpointing)
        recomputed = run_ranks(tsp_size, model_parity, arch="qwen3", batch=2, seq_len=13,
                               checkpointing=checkpointing, recompute_norms=True)
        check(recomputed, f"D={tsp_size} qwen3 recomputed norms, checkpointing {checkpointing}")
        for rank, (a, b) in enumerate(zip(plain, recomputed)):
            print(f"rank {rank}: saved for backward {a['saved_bytes']} B, {b['saved_bytes']} B with the norms "
                  "recomputed")
            # Each norm's float32 copy of its input (B, S/D, H) at least, three norms without layer checkpoints.
            assert b["saved_bytes"] < a["saved_bytes"]
            # One recompute in every layer's attention backward (two layers), none with the norms as modules.
            assert (a["input_norm_recomputes"], b["input_norm_recomputes"]) == (0, 2)
    documents = [[6, 1, 8, 4], [19]]
    for case in (dict(arch="llama", batch=2, seq_len=29, token_tile=5, checkpointing=True),
                 dict(arch="mistral", batch=1, seq_len=29, token_tile=3, checkpointing="host"),
                 dict(arch="qwen3", batch=2, seq_len=19, token_tile=3, documents=documents, checkpointing=True),
                 dict(arch="gemma2", batch=2, seq_len=19, token_tile=4, documents=documents, checkpointing="host")):
        per_rank = run_ranks(tsp_size, model_parity, recompute_norms=True, **case)
        check(per_rank, f"D={tsp_size} recomputed norms {case}")
        assert all(rank["input_norm_recomputes"] == 2 for rank in per_rank)


def test_recomputed_input_norm_guard(run_ranks):
    """The check above fails when the attention's input norm is wrong: its
    weight scaled on the last rank moves the numbers far past the tolerance."""
    per_rank = run_ranks(2, model_parity, arch="llama", batch=2, seq_len=29, token_tile=5, checkpointing=True,
                         recompute_norms=True, wrong_shard="model.layers.1.input_layernorm")
    worst = max(v for d in per_rank for k, v in d.items() if k not in NOT_DIFFS)
    print(f"input norm scaled by 1.5 on the last rank: max|diff| {worst:.2e}")
    assert worst > 1e-3


def test_prefetched_host_checkpoints_come_back_one_layer_ahead(monkeypatch):
    """tsp.prefetch_checkpoints: each layer's backward first takes its own input
    back, then starts the layer below's (on CUDA, on a side stream: a no-op on
    CPU, so the order is recorded here); numbers as without."""
    from ds_tsp.runtime.offload import HostCopy, host_checkpoint_function

    events, made = [], []
    original_init, original_prefetch, original_to_device = HostCopy.__init__, HostCopy.prefetch, HostCopy.to_device

    def init(self, *args):
        original_init(self, *args)
        made.append(self)

    monkeypatch.setattr(HostCopy, "__init__", init)
    monkeypatch.setattr(HostCopy, "prefetch", lambda self: (events.append(("prefetch", made.index(self))),
                                                            original_prefetch(self)))
    monkeypatch.setattr(HostCopy, "to_device", lambda self: (events.append(("back", made.index(self))),
                                                             original_to_device(self))[1])
    losses = {}
    for prefetch in (False, True):  # "auto" decides the same per shape: tested below
        torch.manual_seed(0)
        model = ds_tsp.inject(tiny_model("llama", num_hidden_layers=3), TSPTopology(1),
                              TSPConfig(enabled=True, attention_backend="sdpa"))
        model.train()
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=host_checkpoint_function(prefetch))
        input_ids = torch.randint(0, model.config.vocab_size, (2, 16))
        events.clear(), made.clear()
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        losses[prefetch] = (loss.item(), [p.grad.clone() for p in model.parameters()])
        print(f"prefetch={prefetch}: {events}")
        expected = [("back", 2), ("prefetch", 1), ("back", 1), ("prefetch", 0), ("back", 0)] if prefetch else \
            [("back", 2), ("back", 1), ("back", 0)]
        assert events == expected
    assert losses[True][0] == losses[False][0]
    assert all(torch.equal(a, b) for a, b in zip(losses[True][1], losses[False][1]))


def test_auto_prefetch_where_the_planner_fits_one_more_input():
    """tsp.prefetch_checkpoints "auto" (the default): prefetch where the
    planner's peak of the run at the micro-batch's shape, with one more layer
    input on the device, fits the device's memory; never without a device
    memory to fit (CPU) or a dtype the planner models."""
    from ds_tsp.runtime.engine import planner_run
    from ds_tsp.planning.strategies import make_setting
    from ds_tsp.planning.tsp_plan import plan_tsp
    from ds_tsp.runtime.prefetch import PrefetchWhenAffordable

    assert TSPConfig(enabled=True).prefetch_checkpoints == "auto"
    config = tiny_model("llama").config
    run = planner_run({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
                      TSPConfig(enabled=True, recompute_norms=True))
    assert run["zero_stage"] == 2 and run["offload_optimizer"] and run["recompute_norms"]
    hidden = torch.zeros(1, 512, config.hidden_size, dtype=torch.bfloat16)  # D = 2: a sequence of 1024
    peaks = {prefetch: plan_tsp(make_setting(config, 1024, 1, 2, "bf16", activation_checkpointing=True,
                                             offload_activations=True, prefetch_checkpoints=prefetch, **run),
                                vocab_parallel=True).total for prefetch in (False, True)}
    assert peaks[True] - peaks[False] == 512 * config.hidden_size * 2
    for memory, expected in ((peaks[True], True), (peaks[True] - 1, False), (None, False)):
        decide = PrefetchWhenAffordable(config, 2, True, run, device_memory=lambda device: memory)
        assert decide(hidden) is expected and decide.decided == {(tuple(hidden.shape), hidden.dtype,
                                                                  hidden.device): expected}
    ample = PrefetchWhenAffordable(config, 2, True, run, device_memory=lambda device: 1 << 40)
    assert not ample(hidden.double())
    # CPU tensors under the default device memory: nothing to overlap.
    assert not PrefetchWhenAffordable(config, 2, True, run)(hidden)


def test_prefetch_without_host_checkpoints_is_refused():
    from ds_tsp.runtime.engine import _check_activation_checkpointing

    with pytest.raises(ValueError, match="tsp.prefetch_checkpoints = true .* "
                                         "activation_checkpointing.cpu_checkpointing"):
        _check_activation_checkpointing({"activation_checkpointing": {}}, TSPConfig(enabled=True,
                                                                                   prefetch_checkpoints=True))


def test_activation_checkpointing_recomputes_exactly(run_ranks):
    plain = run_ranks(2, model_parity, arch="qwen2", batch=2, seq_len=32)
    recomputed = run_ranks(2, model_parity, arch="qwen2", batch=2, seq_len=32, checkpointing=True)
    on_host = run_ranks(2, model_parity, arch="qwen2", batch=2, seq_len=32, checkpointing="host")
    check(recomputed, "D=2 qwen2 with activation checkpointing")
    check(on_host, "D=2 qwen2 with activation checkpoints in host memory")
    layer_inputs = 2 * 2 * 32 // 2 * 16 * 8  # two layers' (B, S/D, H) float64 inputs
    for rank, (a, b, c) in enumerate(zip(plain, recomputed, on_host)):
        print(f"rank {rank}: saved for backward {a['saved_bytes']} B plain, {b['saved_bytes']} B checkpointed, "
              f"{c['saved_bytes']} B checkpointed with the layer inputs in host memory")
        assert b["saved_bytes"] < 0.6 * a["saved_bytes"]
        assert c["saved_bytes"] <= b["saved_bytes"] - layer_inputs


def test_a_wrong_shard_is_caught(run_ranks):
    per_rank = run_ranks(2, model_parity, arch="llama", batch=1, seq_len=16, wrong_shard="model.layers.0.mlp")
    worst = max(v for d in per_rank for k, v in d.items() if k not in NOT_DIFFS)
    print(f"wrong shard: max|diff| {worst:.2e}")
    assert worst > 1e3 * TOLERANCE


def _k_rows_read_from_the_q_offset(**kwargs):
    """``model_parity`` with every k_proj shard read from qkv_proj's query rows."""
    right_of = FusedRows.of

    def wrong(table, rows):
        right = right_of(table, rows)
        return FusedRows({**right.sources, **{f"k_proj.{kind}": right.sources[f"q_proj.{kind}"]
                                              for kind in ("weight", "bias") if f"k_proj.{kind}" in right.sources}},
                         right.totals)

    with mock.patch.object(FusedRows, "of", wrong):
        return model_parity(**kwargs)


def test_a_fused_shard_read_from_the_wrong_rows_is_caught(run_ranks):
    per_rank = run_ranks(2, _k_rows_read_from_the_q_offset, arch="phi3", batch=2, seq_len=13)
    loss = max(d["loss"] for d in per_rank)
    print(f"k rows read from the q offset: |loss diff| {loss:.2e}")
    assert loss > 1e3 * TOLERANCE


def test_unsupported_blocks_are_refused_with_the_class_name():
    from transformers import StableLmConfig, StableLmForCausalLM

    # StableLM's decoder layer has Llama's shape but computes otherwise: the probe refuses it by class.
    model = StableLmForCausalLM(StableLmConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               pad_token_id=0))
    with pytest.raises(PolicyError, match=r"StableLmForCausalLM \(StableLmDecoderLayer at model.layers.0\) was "
                                          r"accepted by shape only"):
        ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True))
    # The table's model class is checked before the config and the layers: the refusal names both classes.
    with pytest.raises(PolicyError, match=r"tsp.policy = 'llama' converts LlamaForCausalLM.*but the model is a "
                                          r"StableLmForCausalLM: set tsp.policy to \"auto\""):
        ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True, policy="llama"))
    assert type(model).__name__ == "StableLmForCausalLM"


def test_left_padding_is_refused_where_the_moved_rows_would_show():
    """Left padding runs moved to the right (the loss and TRL's fused head:
    test_token_scores); the local tokens' logits would show the move, a mask
    with a hole inside a row is refused, and so is a label that Hugging Face
    would predict from a padding token."""
    model = ds_tsp.inject(tiny_model("llama"), TSPTopology(1), TSPConfig(enabled=True, vocab_parallel=False))
    ids = torch.ones(1, 8, dtype=torch.long)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="attention_mask pads rows on the left.*pad on the right for the local "
                                         "tokens' logits"):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="real tokens in one run"):
        model(input_ids=ids, attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="first real token of a left-padded row"):
        model(input_ids=ids, attention_mask=mask, labels=ids, fused_lm_head=True)
    with pytest.raises(ValueError, match=r"does not support \['output_attentions'\]"):
        model(input_ids=ids, output_attentions=True)


def test_attention_dropout_is_refused_before_any_weight_moves():
    model = tiny_model("llama", attention_dropout=0.1)
    with pytest.raises(PolicyError, match=r"config.attention_dropout = 0.1.*set model.config.attention_dropout = 0.0"):
        ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True))
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"
