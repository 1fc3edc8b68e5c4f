"""The planner's model shapes (ds_tsp.planning.shapes): presets, Hugging Face
configs, mixture-of-experts layers and TSP's shape rules, by hand and against
the models and modules themselves."""

import json
from dataclasses import replace

import pytest

from ds_tsp import planning as planner
from ds_tsp.blocks.attention.head_groups import HeadGroups
from plan_helpers import HEAD_DIM, HIDDEN, tiny_shape


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


def test_other_mixture_of_experts_configs_are_refused():
    with pytest.raises(ValueError, match=r"n_routed_experts = 64 .*: the planner models the mixture-of-experts "
                                         r"layers of mixtral, minimax_m2, gpt_oss, qwen2_moe, qwen3_moe, olmoe, "
                                         r"flex_olmo, glm4_moe, llama4_text, deepseek_v2, deepseek_v3, "
                                         r"glm4_moe_lite, mistral4, qwen3_next, qwen3_5_moe_text only"):
        planner.model_shape({**tiny_shape(), "model_type": "longcat_flash", "n_routed_experts": 64})
    with pytest.raises(ValueError, match=r"num_experts = 8 \(model_type 'jamba'\)"):
        planner.model_shape({**tiny_shape(), "model_type": "jamba", "num_experts": 8})
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        planner.model_shape({**tiny_shape(), "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2})
