"""The planner's model shapes (ds_tsp.planning.shapes): presets, Hugging Face
configs, mixture-of-experts layers and TSP's shape rules, by hand and against
the models and modules themselves."""

import json
from dataclasses import replace

import pytest

from ds_tsp import planning as planner
from ds_tsp.blocks.attention.head_groups import HeadGroups
from plan_helpers import HEAD_DIM, HIDDEN, tiny_hybrid_shape, tiny_shape


def test_logits_tile_tokens():
    # 32 MiB of fp32 logits over Vs = 16032 (llama3's 128256 over 8) rows: 523 tokens; capped by the local tokens.
    assert planner.logits_tile_tokens(16032, 16384) == 33554432 // (4 * 16032) == 523
    assert planner.logits_tile_tokens(16032, 100) == 100
    assert planner.logits_tile_tokens(16032, 16384, logits_tile_mib=0.01) == 1
    assert planner.logits_tile_tokens(16, 1000, logits_tile_mib=0.5) == 1000
    assert planner.logits_tile_tokens(16, 10000, logits_tile_mib=0.5) == 2**19 // 64


def test_tsp_shape_rules_are_the_attention_modules():
    for num_heads in (4, 6, 8, 12):
        for num_kv_heads in (1, 2, 3, 4, 6):
            for D in (1, 2, 3, 4, 8):
                try:
                    HeadGroups(num_heads, num_kv_heads, HEAD_DIM, D)
                    refused = False
                except ValueError:
                    refused = True
                m = planner.model_shape({**tiny_shape(num_heads, num_kv_heads), "intermediate_size": 24 * D})
                assert (planner.tsp_shape_problem(m, D) is not None) == refused, (num_heads, num_kv_heads, D)


def test_model_from_config_object_dict_and_directory(tmp_path):
    preset = planner.model_shape("llama-7b")
    fields = dict(planner.PRESETS["llama-7b"])
    (tmp_path / "config.json").write_text(json.dumps(fields))
    shapes = [planner.model_shape(source) for source in (str(tmp_path), str(tmp_path / "config.json"), fields)]
    assert len({replace(shape, name="") for shape in shapes}) == 1 and shapes[0].name == tmp_path.name
    assert planner.model_shape(fields).params == preset.params
    from models import tiny_config

    hf = planner.model_shape(tiny_config("llama_tied"))
    assert (hf.head_dim, hf.num_kv_heads, hf.tie_word_embeddings) == (4, 2, True)
    with pytest.raises(ValueError, match="neither a preset"):
        planner.model_shape("no-such-model")


def test_llama3_1_8b_preset_is_its_config():
    m = planner.model_shape("llama3.1-8b")
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size, m.vocab_size) == \
        (4096, 32, 32, 8, 14336, 128256)
    assert f"{m.params / 1e9:.2f}" == "8.03"


@pytest.mark.parametrize("arch, overrides", [("mixtral", {}), ("qwen2_moe", {}), ("qwen3_moe", {}),
                                             ("qwen2_moe", dict(num_hidden_layers=4, mlp_only_layers=[0],
                                                                decoder_sparse_step=2)),
                                             ("qwen3_moe", dict(num_hidden_layers=3, decoder_sparse_step=2)),
                                             ("qwen3", {}), ("gpt_oss", {})])
def test_moe_parameters_by_hand_and_against_the_hf_model(arch, overrides):
    from models import MODEL_CLASSES, tiny_config

    config = tiny_config(arch, **overrides)
    m = planner.model_shape(config.to_dict())
    hf = MODEL_CLASSES[arch](config)
    numel = sum(p.numel() for p in hf.parameters())
    # By hand, H=16, V=61 untied, nq=4, nkv=2, d=4 (Wa = 768 + q/k/v biases 32 for Qwen2-MoE), norms 2H a layer
    # and H at the end, the embedding and LM head 2*61*16 = 1952 (+ 16 final norm).
    H, outside = HIDDEN, 2 * 61 * HIDDEN + HIDDEN
    # GPT-OSS: q/k/v biases 32, o_proj's bias 16 (replicated), 4 sinks.
    wa = 768 + (32 if arch == "qwen2_moe" else 0) + (32 + H + 4 if arch == "gpt_oss" else 0)
    qk_norms = 2 * HEAD_DIM if arch.startswith("qwen3") else 0
    layer = wa + 2 * H + qk_norms
    expected = {  # (total, active, sparse layers)
        # 2 sparse layers: router 4x16, 4 experts of 3*16*32 (F_e = intermediate_size); top-2 active.
        "mixtral": (2 * (layer + 4 * H + 4 * 3 * H * 32), 2 * (layer + 4 * H + 2 * 3 * H * 32), 2),
        # router 4x16 + shared-expert gate 1x16; 4 experts of 3*16*8 and a shared expert of 3*16*16.
        "qwen2_moe": (2 * (layer + 5 * H + 4 * 384 + 768), 2 * (layer + 5 * H + 2 * 384 + 768), 2),
        # router 8x16, 8 experts of 3*16*8.
        "qwen3_moe": (2 * (layer + 8 * H + 8 * 384), 2 * (layer + 8 * H + 2 * 384), 2),
        "qwen3": (2 * (layer + 3 * H * 32),) * 2 + (0,),
        # router 4x16 with its bias 4; 4 experts of 3*16*32 with biases 2*32 + 16; top-2 active.
        "gpt_oss": (2 * (layer + 4 * H + 4 + 4 * (3 * H * 32 + 80)), 2 * (layer + 4 * H + 4 + 2 * (3 * H * 32 + 80)),
                    2),
    }[arch]
    if overrides.get("mlp_only_layers"):  # 4 layers: 0 dense (listed), 1 sparse, 2 dense (off the step), 3 sparse
        expected = (expected[0] + 2 * (layer + 3 * H * 32), expected[1] + 2 * (layer + 3 * H * 32), 2)
    if overrides.get("num_hidden_layers") == 3:  # layers 0 and 2 dense (off the step of 2), layer 1 sparse
        expected = (expected[0] // 2 + 2 * (layer + 3 * H * 32), expected[1] // 2 + 2 * (layer + 3 * H * 32), 1)
    total, active, sparse = expected
    print(f"{arch} {overrides}: planner {m.params} total / {m.active_params} active, by hand {total + outside} / "
          f"{active + outside}, Hugging Face sum(p.numel()) {numel}")
    assert m.params == total + outside == numel
    assert m.active_params == active + outside and m.moe_layers == sparse
    assert m.routed_expert_params == sparse * m.num_experts * m.expert_params
    assert m.is_moe == (arch != "qwen3") and m.qk_norm == arch.startswith("qwen3")


def test_moe_presets_match_their_published_sizes():
    # Qwen3-30B-A3B: "30.5B in total and 3.3B activated" (3.35B, rounded down in the name and the model card);
    # Mixtral 8x7B: 46.7B, 12.9B active per token.
    qwen = planner.model_shape("qwen3-30b-a3b")
    assert (f"{qwen.params / 1e9:.1f}", f"{qwen.active_params / 1e9:.2f}") == ("30.5", "3.35")
    mixtral = planner.model_shape("mixtral-8x7b")
    assert (f"{mixtral.params / 1e9:.1f}", f"{mixtral.active_params / 1e9:.1f}") == ("46.7", "12.9")
    assert mixtral.moe_layers == 32 and mixtral.renormalise_top_k and mixtral.router_weights_fp32
    # GLM-4.5-Air: "106 billion total parameters"; 45 MoE layers after one dense, a shared expert without a
    # gate, so each sparse layer replicates its router only.
    glm = planner.model_shape("glm-4.5-air")
    assert 106e9 <= glm.params < 107e9
    assert glm.moe_layers == 45 and glm.shared_expert_size == 1408 and not glm.gated_shared_expert
    assert glm.router_params == 128 * 4096
    # GPT-OSS-120B: "116.83B total, 5.13B active" (OpenAI's model card counts the LM head as active, not the
    # 0.58B embedding); 36 sparse layers of 128 biased experts, 64 sinks a layer.
    gpt_oss = planner.model_shape("gpt-oss-120b")
    embedding = 201088 * 2880
    assert (f"{gpt_oss.params / 1e9:.2f}", f"{(gpt_oss.active_params - embedding) / 1e9:.2f}") == ("116.83", "5.13")
    assert gpt_oss.moe_layers == 36 and gpt_oss.expert_bias and gpt_oss.router_bias and gpt_oss.attention_sinks
    # Llama-4-Scout, "17B active parameters, 16 experts"; its text model's total is Hugging Face's sum(numel).
    import torch
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    with torch.device("meta"):
        numel = sum(p.numel() for p in Llama4ForCausalLM(Llama4TextConfig()).parameters())
    scout = planner.model_shape("llama-4-scout")
    assert scout.params == numel and f"{scout.active_params / 1e9:.0f}" == "17"
    assert scout.moe_layers == 48 and scout.shared_expert_size == 8192 and not scout.gated_shared_expert
    assert scout.intermediate_size == 16384 and not scout.qk_norm  # dense MLPs' size; a weightless q/k norm


def test_gemma4_and_command_a_presets_are_hugging_faces_models():
    """Gemma 4 31B and 26B-A4B: every parameter Hugging Face's text model holds, built on the meta device from the
    presets (full layers of their own head sizes, keys as values; experts beside every MLP), and the model card's
    "30.7B" and "25.2B total, 3.8B active"; Command A's shape: Hugging Face's Cohere2 model, "111B"."""
    import torch
    from transformers import Cohere2Config, Cohere2ForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig

    for name, config_class, model_class, published in (
            ("gemma-4-31b", Gemma4TextConfig, Gemma4ForCausalLM, ("30.7", "30.7")),
            ("gemma-4-26b-a4b", Gemma4TextConfig, Gemma4ForCausalLM, ("25.2", "3.8")),
            ("command-a", Cohere2Config, Cohere2ForCausalLM, ("111.1", "111.1"))):
        fields = {k: v for k, v in planner.PRESETS[name].items() if k != "model_type"}
        with torch.device("meta"):
            numel = sum(p.numel() for p in model_class(config_class(**fields)).parameters())
        m = planner.model_shape(name)
        print(f"{name}: {m.params:,} parameters planned, Hugging Face's {numel:,}; {m.active_params / 1e9:.2f}B active")
        assert m.params == numel
        assert (f"{m.params / 1e9:.1f}", f"{m.active_params / 1e9:.1f}") == published
    gemma = planner.model_shape("gemma-4-31b")
    assert gemma.mixer_kinds == (("attention", 50), ("global_attention", 10))
    assert (gemma.global_head_dim, gemma.global_num_kv_heads, gemma.global_values_from_keys) == (512, 4, True)


def test_gemma4_layers_the_planner_does_not_model_are_refused():
    for key in ("hidden_size_per_layer_input", "num_kv_shared_layers"):
        with pytest.raises(ValueError, match=rf"{key} = 2: the planner does not model Gemma 4's per-layer inputs"):
            planner.model_shape({**planner.PRESETS["gemma-4-31b"], key: 2})


@pytest.mark.parametrize("arch", ["falcon_h1", "lfm3", "olmo_hybrid"])
def test_recurrent_mixers_the_planner_does_not_model_are_refused(arch):
    """Falcon-H1's side-by-side mixers, LFM3's and OLMo-Hybrid's hybrids (which ds_tsp trains) are refused by
    name, not planned as models of attention layers alone."""
    from models import tiny_config

    with pytest.raises(ValueError, match=rf"\(model_type '{arch}'\): the planner models the recurrent layers of "
                                         r"qwen3_next, qwen3_5_text, qwen3_5_moe_text, kimi_linear, nemotron_h, "
                                         r"granitemoehybrid, bamba, jamba, lfm2, lfm2_moe only"):
        planner.model_shape(tiny_config(arch).to_dict())
    # Nemotron-H's ungated experts are not modelled: its MoE layers are refused by name.
    with pytest.raises(ValueError, match=r"Nemotron-H mixture-of-experts layers \(layers_block_type 'moe'\)"):
        planner.model_shape(tiny_config("nemotron_h").to_dict())


def test_other_mixture_of_experts_configs_are_refused():
    with pytest.raises(ValueError, match=r"n_routed_experts = 64 .*: the planner models the mixture-of-experts "
                                         r"layers of mixtral, minimax_m2, gpt_oss, qwen2_moe, qwen3_moe, olmoe, "
                                         r"flex_olmo, glm4_moe, llama4_text, deepseek_v2, deepseek_v3, "
                                         r"glm4_moe_lite, mistral4, qwen3_next, qwen3_5_moe_text, phimoe, "
                                         r"granitemoe, hunyuan_v1_moe, cohere2_moe, ernie4_5_moe, deepseek_v32, "
                                         r"glm_moe_dsa, gemma4_text only"):
        planner.model_shape({**tiny_shape(), "model_type": "longcat_flash", "n_routed_experts": 64})
    with pytest.raises(ValueError, match=r"num_experts = 8 \(model_type 'dbrx'\)"):
        planner.model_shape({**tiny_shape(), "model_type": "dbrx", "num_experts": 8})
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        planner.model_shape({**tiny_shape(), "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2})


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_next_dense", "qwen3_5", "qwen3_5_moe"])
def test_hybrid_parameters_by_hand_and_against_the_hf_model(arch):
    from models import MODEL_CLASSES, tiny_config

    config = tiny_config(arch)
    m = planner.model_shape(config.to_dict())
    numel = sum(p.numel() for p in MODEL_CLASSES[arch](config).parameters())
    # tests/models.py's HYBRID_TINY, H=16: layers 0-2 Gated DeltaNet (4 key and 8 value heads of 4: in_proj
    # 16 * (2*16 + 2*32 + 2*8), conv (2*16 + 32) * 4 taps, A_log and dt_bias 2*8, out_proj 32*16, gated norm 4),
    # layer 3 gated attention (q_proj 16 * 2*4*8 with the gate, k/v 2 * 16*2*8, o_proj 32*16, q/k norms 2*8).
    H = HIDDEN
    linear = H * (2 * 16 + 2 * 32 + 2 * 8) + (2 * 16 + 32) * 4 + 2 * 8 + 32 * H + 4
    attention = H * 2 * 4 * 8 + 2 * H * 2 * 8 + 32 * H + 2 * 8
    # Dense: the MLP 3*16*32; sparse (Qwen3-Next, Qwen3.5-MoE): router 4x16, 4 experts of 3*16*8 (top-2), a shared
    # expert of 3*16*16 and its gate 1x16. Every layer's two norms 2H.
    moe = "dense" not in arch and arch != "qwen3_5"
    ffn, active = (4 * H + 4 * 384 + 768 + H, 4 * H + 2 * 384 + 768 + H) if moe else (3 * H * 32,) * 2
    outside = 2 * 61 * H + H
    print(f"{arch}: planner {m.params} / {m.active_params}, Hugging Face {numel}")
    assert m.params == 3 * linear + attention + 4 * (ffn + 2 * H) + outside == numel
    assert m.active_params == 3 * linear + attention + 4 * (active + 2 * H) + outside
    assert (m.linear_layers, m.moe_layers, m.attention_output_gate, m.qk_norm) == (3, 4 if moe else 0, True, True)
    assert m.rotary_dim == 2  # a quarter of each head of 8 rotates


@pytest.mark.parametrize("arch", ["bamba", "granitemoehybrid", "granitemoehybrid_moe", "nemotron_h_dense",
                                  "kimi_linear", "jamba", "lfm2", "lfm2_biased", "lfm2_moe"])
def test_recurrent_hybrid_parameters_by_hand_and_against_the_hf_model(arch):
    from models import MODEL_CLASSES, tiny_config

    config = tiny_config(arch)
    m = planner.model_shape(config.to_dict())
    numel = sum(p.numel() for p in MODEL_CLASSES[arch](config).parameters())
    print(f"{arch}: planner {m.params} / {m.active_params}, Hugging Face {numel}; {m.mixer_kinds} {m.layer_kinds}")
    assert m.params == numel
    H = HIDDEN
    if arch == "jamba":
        # Mamba-1, 32 channels of state 4, dt rank 4: in_proj 16 * 2*32, the 4-tap convolution and its bias 5*32,
        # x_proj 32 * (4 + 2*4), dt_proj and its bias 5*32, A_log 32*4, D 32, out_proj 32*16; its dt, B and C
        # norms whole.
        assert m.recurrent.params == H * 64 + 5 * 32 + 32 * 12 + 5 * 32 + 32 * 4 + 32 + 32 * H
        assert m.recurrent.replicated_tensors == [4, 4, 4]
        return
    if arch.startswith("lfm2"):
        # The gated short convolution over 16 channels: in_proj 16 * 3*16, 3 taps, out_proj 16*16 (biases on
        # in_proj and the taps split, out_proj's whole, where conv_bias).
        bias = arch == "lfm2_biased"
        assert m.recurrent.params == (H + bias) * 3 * H + (3 + bias) * H + H * H
        assert m.recurrent.replicated_tensors == ([H] if bias else []) and m.qk_norm
        return
    if arch == "kimi_linear":
        # KDA, 4 heads of 4 (R = 16 rows): q/k/v 3*16*16 and their 4-tap convolutions 3*16*4, f_b/g_b 2*16*4,
        # dt_bias 16, A_log 4, b_proj 4*16, o_proj 16*16; kept whole: f_a/g_a 2*16*4 and the gated norm 4.
        assert m.recurrent.params == 3 * H * 16 + 3 * 16 * 4 + 2 * 16 * 4 + 16 + 4 + 4 * H + 16 * H
        assert m.recurrent.replicated_tensors == [H * 4, H * 4, 4]
        return
    # Mamba-2, 8 heads of 4 (d_inner 32), 2 groups of state 4: in_proj 16 * (2*32 + 2*8 + 8), the 4-tap
    # convolution and its bias (32 + 2*8) * 5, dt_bias, A_log, D 3*8, out_proj 32*16; the gated norm 32 whole.
    assert m.recurrent.params == H * (2 * 32 + 2 * 8 + 8) + 5 * (32 + 16) + 3 * 8 + 32 * H
    assert m.recurrent.replicated_tensors == [32]
    if arch == "nemotron_h_dense":  # one block a layer, each with its norm: 2 Mamba-2, 1 attention, 2 MLPs
        assert (m.mixer_kinds, m.layer_kinds, m.one_block_layers) == ((("attention", 1), ("linear", 2)),
                                                                      ((False, 2),), True)
        assert m.mixer_replicated_tensors(linear=True) == [H, 32] and not m.mlp_gated


def test_mamba2_and_kda_presets_by_hand():
    """Nemotron-H-8B's, Granite-4.0-H-Small's and Kimi-Linear-48B-A3B's sizes, counted by hand."""
    m = planner.model_shape("nemotron-h-8b")
    H, di, bc, nh = 4096, 8192, 1024, 128
    mamba = H * (2 * di + 2 * bc + nh) + 5 * (di + 2 * bc) + 3 * nh + di * H + di
    attention = H * (32 + 2 * 8) * 128 + 32 * 128 * H
    mlp = 2 * H * 21504  # ungated relu2: up and down
    assert m.params == 24 * mamba + 4 * attention + 24 * mlp + 52 * H + 2 * 131072 * H + H
    assert f"{m.params / 1e9:.1f}" == "8.1" and (m.mixer_only_layers, m.ffn_only_layers) == (28, 24)
    m = planner.model_shape("granite-4.0-h-small")
    mamba = H * (2 * di + 2 * 128 + nh) + 5 * (di + 2 * 128) + 3 * nh + di * H + di
    attention = H * (32 + 2 * 8) * 128 + 32 * 128 * H
    sparse = 72 * H + 72 * 3 * H * 768 + 3 * H * 1536  # router, experts, the shared MLP
    assert m.params == 36 * mamba + 4 * attention + 40 * (sparse + 2 * H) + 100352 * H + H
    assert (f"{m.params / 1e9:.1f}", f"{m.active_params / 1e9:.1f}") == ("32.2", "8.8")
    m = planner.model_shape("kimi-linear-48b-a3b")
    assert (m.linear_layers, m.is_latent, m.moe_layers, m.num_experts) == (21, True, 26, 256)
    assert f"{m.params / 1e9:.1f}" == "49.1"


def test_tsp_refuses_a_size_that_splits_a_mamba2_head_or_its_state_rows():
    from ds_tsp.blocks.linear.mamba2_shards import Mamba2Shapes

    # The planner's rule is the block's (mamba2_shards.Mamba2Shapes): whole heads, and 1/D of the B and C rows.
    for heads, groups, state in ((8, 2, 4), (6, 1, 4), (12, 3, 2)):
        for D in (1, 2, 3, 4, 8):
            try:
                Mamba2Shapes(HIDDEN, heads, 4, groups, state, 4, D)
                refused = False
            except ValueError:
                refused = True
            m = planner.model_shape({**tiny_shape(layers=4), "model_type": "bamba", "attn_layer_indices": [1],
                                     "num_attention_heads": 24, "num_key_value_heads": 24, "intermediate_size": 24 * 8,
                                     "mamba_n_heads": heads, "mamba_d_head": 4, "mamba_n_groups": groups,
                                     "mamba_d_state": state})
            assert (planner.tsp_shape_problem(m, D) is not None) == refused, (heads, groups, state, D)


def test_hybrid_presets_by_hand():
    def attention(H, nq, nkv, d=256):  # gated: q_proj's 2 d rows a head, then k, v, o_proj; per-head q/k norms
        return H * nq * 2 * d + 2 * H * nkv * d + nq * d * H + 2 * d

    def linear(H, nk, nv, d=128):  # in_proj (q, k, v, z, b, a), a 4-tap conv, A_log and dt_bias, out_proj, its norm
        return H * (2 * nk * d + 2 * nv * d + 2 * nv) + (2 * nk * d + nv * d) * 4 + 2 * nv + nv * d * H + d

    def sparse(H, E, F, k):  # (total, active): router, E experts (k active) and a gated shared expert of F
        return E * H + E * 3 * H * F + 3 * H * F + H, E * H + k * 3 * H * F + 3 * H * F + H

    # (H, layers, attention heads, key/value heads, linear key and value heads, V, feed-forward (total, active))
    cases = {"qwen3-next-80b-a3b": (2048, 48, 16, 2, 16, 32, 151936, sparse(2048, 512, 512, 10)),
             "qwen3.5-27b": (5120, 64, 24, 4, 16, 48, 248320, (3 * 5120 * 17408,) * 2),
             "qwen3.5-397b-a17b": (4096, 60, 32, 2, 16, 64, 248320, sparse(4096, 512, 1024, 10))}
    published = {"qwen3-next-80b-a3b": ("79.67", "3.87"), "qwen3.5-27b": ("26.90", "26.90"),
                 "qwen3.5-397b-a17b": ("396.35", "17.35")}
    for name, (H, L, nq, nkv, nk, nv, V, ffn) in cases.items():
        m = planner.model_shape(name)
        mixers = L // 4 * attention(H, nq, nkv) + 3 * L // 4 * linear(H, nk, nv)  # every 4th layer attends
        outside = 2 * V * H + H
        assert m.params == mixers + L * (ffn[0] + 2 * H) + outside
        assert m.active_params == mixers + L * (ffn[1] + 2 * H) + outside
        # As the presets' comments give them (the text models: no vision tower, no multi-token prediction layer).
        assert (f"{m.params / 1e9:.2f}", f"{m.active_params / 1e9:.2f}") == published[name]
        assert m.linear_layers == 3 * L // 4 and m.attention_output_gate and m.rotary_dim == 64


def test_hybrid_configs_are_read_from_layer_types_or_the_interval():
    text = {**tiny_hybrid_shape(), "model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16}
    del text["intermediate_size"]  # Qwen3.5-MoE's config has none: every layer is sparse
    by_interval = planner.model_shape(text)
    nested = planner.model_shape({"model_type": "qwen3_5_moe", "text_config": text})  # the multimodal config
    listed = planner.model_shape({**text, "layer_types": ["linear_attention", "full_attention"] * 2})
    assert by_interval == nested and by_interval.mixer_kinds == (("attention", 1), ("linear", 3))
    assert listed.mixer_kinds == (("attention", 2), ("linear", 2)) and by_interval.renormalise_top_k
    assert by_interval.moe_layers == 4 and by_interval.intermediate_size == 0
    with pytest.raises(ValueError, match=r"3 recurrent layers \(linear_attention\) \(model_type 'olmo_hybrid'\): "
                                         r"the planner models the recurrent layers of qwen3_next"):
        planner.model_shape({**tiny_hybrid_shape(), "model_type": "olmo_hybrid",
                             "layer_types": ["linear_attention"] * 3 + ["full_attention"]})


def test_tsp_refuses_a_size_that_splits_a_linear_key_head():
    from ds_tsp.blocks.linear.shards import DeltaNetShapes

    # The planner's rule is the block's (linear.shards.DeltaNetShapes): whole key heads on every rank.
    for num_k_heads in (2, 4, 6):
        for D in (1, 2, 3, 4, 8):
            try:
                DeltaNetShapes(HIDDEN, num_k_heads, 2 * num_k_heads, 4, 4, 4, D, interleaved=False)
                refused = False
            except ValueError:
                refused = True
            m = planner.model_shape(tiny_hybrid_shape(num_attention_heads=24, num_key_value_heads=24,
                                                      intermediate_size=24 * 8, linear_num_key_heads=num_k_heads,
                                                      linear_num_value_heads=2 * num_k_heads))
            assert (planner.tsp_shape_problem(m, D) is not None) == refused, (num_k_heads, D)
    # Qwen3.5-27B: 24 attention heads and 4 key/value heads fold over 8 ranks, its 16 linear key heads too; over 12
    # the attention would (each key/value head on 3 ranks), its linear layers not.
    m = planner.model_shape("qwen3.5-27b")
    assert planner.tsp_shape_problem(m, 8) is None
    assert planner.tsp_shape_problem(m, 12) == \
        "linear_num_key_heads 16 is not divisible by 12: a rank owns whole key heads of the Gated DeltaNet layers"
    tsp = {p.name: p for p in planner.plan(m, 131072, 1, 12)}["TSP(12)"]
    assert not tsp.feasible and "linear_num_key_heads 16" in tsp.notes


@pytest.mark.parametrize("raw", [
    # Kimi Linear's released config: its KDA sizes and 1-based layer lists in linear_attn_config.
    dict(model_type="kimi_linear", num_hidden_layers=8, hidden_size=16, intermediate_size=32, num_attention_heads=4,
         pad_token_id=0,
         vocab_size=61, kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
         num_experts=4, num_experts_per_token=2, moe_intermediate_size=8, num_shared_experts=1,
         linear_attn_config={"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "num_heads": 4,
                             "head_dim": 4, "short_conv_kernel_size": 4}),
    # LFM2's: block_ff_dim, tie_embedding and full_attn_idxs rather than transformers' names.
    dict(model_type="lfm2", num_hidden_layers=4, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
         vocab_size=61, block_ff_dim=48, block_multiple_of=8, tie_embedding=True, full_attn_idxs=[2],
         conv_L_cache=3),
    # Jamba's: its attention and expert layers by transformers' default periods and offsets.
    dict(model_type="jamba", num_hidden_layers=8, hidden_size=16, intermediate_size=32, num_attention_heads=4,
         num_key_value_heads=2, vocab_size=61, num_experts=4, num_experts_per_tok=2, mamba_d_state=4,
         mamba_dt_rank=4)])
def test_released_recurrent_configs_are_read_as_transformers_reads_them(raw):
    """A checkpoint's own config.json, not transformers' to_dict(): the planner's layers and parameters are
    those of the model transformers builds from it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    m = planner.model_shape(raw)
    with torch.device("meta"):
        numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw)).parameters())
    print(f"{raw['model_type']}: {m.mixer_kinds} {m.layer_kinds}, planner {m.params}, Hugging Face {numel}")
    assert m.is_hybrid and m.params == numel
