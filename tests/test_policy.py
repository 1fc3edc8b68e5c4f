"""Support, or refuse before any weight moves, every variant of every accepted class.

Every causal LM the installed transformers ships runs through the policy on a
tiny config: each is exact against Hugging Face (float64 loss and every
gradient, D=2) or refused with a message naming what is not supported. Then the
table variants (biases, windows, RoPE types) and one test per refusal kind.
"""

import copy
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import transformers

import ds_tsp
from ds_tsp.config import TSPConfig
from ds_tsp.injection.policy import PolicyError, resolve_policy
from ds_tsp.parallel.topology import TSPTopology
from ds_tsp.blocks.vocab import VocabError
from float32_control import ROUNDING_FLOOR
from models import (ClampedDecoderLayer, LookAlikeDecoderLayer, ScaledLogitsForCausalLM, causal_lm_types, look_alike,
                    routes_in_float32, tiny_causal_lm, tiny_model)
from parity import TOLERANCE, check, reference_loss, shard_grad_diffs

# A float64 model whose routers compute in float32 (models.routes_in_float32) is float32-exact against HF at best:
# its routing weights are a float32 matmul of hidden_size terms (rounding ~ sqrt(hidden_size) u of their scale,
# 8u at the tiny configs' 64) then a softmax or sigmoid, and the sharded run rounds its rows in other places of the
# batch. That rounding moves the loss and every gradient linearly, so they are held to ROUNDING_FLOOR (64u, 8x
# that estimate) of each one's scale (shard_grad_diffs' relative): a wrong shard or route moves them by 1e-2 and up.
TABLE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "mistral": "MistralForCausalLM"}


def parity(ref, tsp_size, seed=7, relative=False):
    """Max |diff| of the loss and of every gradient of ``ref`` injected at
    ``tsp_size`` against ``ref`` itself (B=2, S=13: padded at D=2). A model
    that runs HF's eager attention is injected (and probed) as it is and
    compared with eager_wide_softmax, the same attention with the softmax in
    float64: HF's own takes it in float32, a float32-exact reference. With
    ``relative``, each difference is over its scale (at least 1)."""
    input_ids = torch.randint(0, ref.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(seed))
    model = copy.deepcopy(ref)
    ds_tsp.inject(model, TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa"))
    if ref.config._attn_implementation == "eager":
        ref.set_attn_implementation("eager_wide_softmax")
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    ref_loss = reference_loss(ref, input_ids)
    ref_loss.backward()
    loss_scale = max(1.0, abs(ref_loss.item())) if relative else 1.0
    return {"loss": abs(loss.item() - ref_loss.item()) / loss_scale, **shard_grad_diffs(model, ref, relative)}


def exact_or_refused(model_types, attention=None, overrides=None):
    """On every rank, per model type: ``("exact", max |diff| of loss and every
    gradient against HF, its bound)`` or ``("refused", message)``, under the ``attention``
    implementation (default: the first the class takes of SDPA,
    eager_wide_softmax, eager) and with ``overrides[model_type]`` in its config."""
    verdicts = {}
    for model_type in model_types:
        try:
            model = tiny_causal_lm(model_type, requested=attention, **(overrides or {}).get(model_type, {}))
            float32_routing = routes_in_float32(model)
            diffs = parity(model, dist.get_world_size(), relative=float32_routing)
        except (PolicyError, VocabError) as error:
            verdicts[model_type] = ("refused", str(error))
            continue
        verdicts[model_type] = ("exact", max(diffs.values()), ROUNDING_FLOOR if float32_routing else TOLERANCE)
    return verdicts


def test_every_llama_shaped_class_is_exact_or_refused(run_ranks):
    start = time.perf_counter()
    rows, candidates = [], []
    for model_type, class_name in causal_lm_types():
        try:
            meta = tiny_causal_lm(model_type, device="meta")
        except Exception as error:  # exotic configs that tiny sizes do not fit
            rows.append((model_type, class_name, "skipped", f"not built on a tiny config: {type(error).__name__}: "
                         f"{(str(error).strip().splitlines() or [''])[0][:80]}"))
            continue
        try:
            layers = meta.get_submodule(resolve_policy(meta).layers)
            candidates.append((model_type, class_name, type(layers[0]).__name__))
        except PolicyError as error:
            rows.append((model_type, class_name, "refused", str(error)))
    scanned = time.perf_counter()
    # Each call checks every candidate class (minutes on 2 shared cores): a dead rank still fails it, later.
    per_rank = run_ranks(2, exact_or_refused, model_types=[t for t, _, _ in candidates], timeout_s=600)
    for model_type, class_name, layer_class in candidates:
        verdicts = {rank[model_type][0] for rank in per_rank}
        assert len(verdicts) == 1, (model_type, [rank[model_type] for rank in per_rank])
        verdict, detail = per_rank[0][model_type][:2]
        if verdict == "exact":
            worst, bound = max(rank[model_type][1] for rank in per_rank), per_rank[0][model_type][2]
            assert worst <= bound, (model_type, worst)
            detail = f"loss and every gradient within {worst:.1e} of HF" + (
                "" if bound == TOLERANCE else ", relative to their scale (its routers or hyper-connections compute in "
                f"float32: bound {bound:.1e})")
        else:
            assert class_name in detail or layer_class in detail, detail
        rows.append((model_type, class_name, verdict, detail))

    rows.sort()
    print(f"\n{'model_type':26} {'class':36} {'verdict':8} reason")
    for model_type, class_name, verdict, detail in rows:
        print(f"{model_type:26} {class_name:36} {verdict:8} {detail}")
    verdict_of = {model_type: verdict for model_type, _, verdict, _ in rows}
    counts = {kind: sum(v == kind for v in verdict_of.values()) for kind in ("exact", "refused", "skipped")}
    print(f"{len(rows)} classes of transformers {transformers.__version__}: "
          + ", ".join(f"{n} {kind}" for kind, n in counts.items())
          + f" in {time.perf_counter() - start:.1f} s ({scanned - start:.1f} s building and checking them all "
            "on the meta device)")
    assert documented_scan() == (transformers.__version__, counts), \
        "docs/architectures.md states another scan than this transformers': update its version and counts"
    for model_type in TABLE_ARCHITECTURES:  # the loop could not pass by refusing everything
        assert verdict_of[model_type] == "exact", model_type

    # No false refusal under HF's eager attention (float32 softmax): every class exact above is exact under it.
    exact = [model_type for model_type, verdict in verdict_of.items() if verdict == "exact"]
    under_eager = run_ranks(2, exact_or_refused, model_types=exact, attention="eager", timeout_s=600)
    print("\nunder attn_implementation='eager' (the TSP model probed under it; the reference's softmax in float64):")
    for model_type in exact:
        verdicts = [rank[model_type] for rank in under_eager]
        kind, detail = verdicts[0][:2]
        shown = f"within {max(v[1] for v in verdicts):.1e} of HF" if kind == "exact" else detail
        print(f"{model_type:26} {kind:8} {shown}")
        assert all(v[0] == "exact" and v[1] <= v[2] for v in verdicts), (model_type, verdicts)
    assert all(kind == "refused" for model_type, kind in verdict_of.items() if model_type in ("diffllama", "mimo_v2_flash"))


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_classes_probed_under_eager_and_sdpa_are_exact(run_ranks, tsp_size):
    """SmolLM3, Granite and Seed-OSS (accepted by the auto policy's probe) under
    HF's eager attention and SDPA: the probe accepts each, and loss and every
    gradient match HF (eager: HF's attention with a float64 softmax). Seed-OSS's
    config defaults to attention and residual dropout, refused by name; here they are off."""
    classes = ["smollm3", "granite", "seed_oss"]
    for attention in ("eager", "sdpa"):
        per_rank = run_ranks(tsp_size, exact_or_refused, model_types=classes, attention=attention,
                             overrides={"seed_oss": {"attention_dropout": 0.0, "residual_dropout": 0.0}})
        for model_type in classes:
            verdicts = [rank[model_type] for rank in per_rank]
            print(f"D={tsp_size} {model_type} under {attention}: {verdicts[0][0]} "
                  f"{max(v[1] for v in verdicts) if verdicts[0][0] == 'exact' else verdicts[0][1]}")
            assert all(v[0] == "exact" and v[1] <= TOLERANCE for v in verdicts), (model_type, attention, verdicts)


def test_a_refusal_under_eager_names_the_reference_precision():
    """The probe's tolerance follows the reference (under eager, float32's), and
    a layer that does more than Llama's is still refused under it, the message
    naming the attention implementation and the tolerance."""
    model = look_alike(ClampedDecoderLayer, attn_implementation="eager")
    with pytest.raises(PolicyError, match=r"ClampedDecoderLayer at model.layers.0\) was accepted by shape only.*"
                                          r"under Hugging Face's eager attention, against a tolerance of 1e-05 \(its "
                                          r"softmax runs in float32\)") as refusal:
        _inject(model)
    print(refusal.value)


def documented_scan():
    """The transformers version and the verdict counts ``docs/architectures.md`` states for this scan."""
    page = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                             "architectures.md")).read()
    found = re.search(r"Every causal LM of transformers ([\w.]+), .*?\*\*(\d+) exact\*\*.*?\*\*(\d+) refused\*\*"
                      r".*?and (\d+) that cannot be built", page, re.S)
    return found and (found[1], {"exact": int(found[2]), "refused": int(found[3]), "skipped": int(found[4])})


# Each variant of the table architectures' configs that changes the forward.
ROPE = {"rope_theta": 10000.0}
TABLE_VARIANTS = [
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"pretraining_tp": 2}),
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    ("qwen3", {"attention_bias": True, "use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0}),
    ("mistral", {"sliding_window": None}),
    # Phi-3: a sliding window for every layer (Phi-3-mini's 2047), half of each head rotary under the default rope.
    ("phi3", {"sliding_window": 5}),
    ("phi3", {"rope_parameters": {**ROPE, "rope_type": "default", "partial_rotary_factor": 0.5}}),
    # RoPE types, with lengths past their original context so scaling acts.
    ("llama", {"rope_parameters": {**ROPE, "rope_type": "linear", "factor": 2.0}}),
    ("llama", {"max_position_embeddings": 8, "rope_parameters": {**ROPE, "rope_type": "dynamic", "factor": 2.0}}),
    ("llama", {"max_position_embeddings": 32, "rope_parameters": {
        **ROPE, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}}),
    ("llama", {"max_position_embeddings": 32, "rope_parameters": {
        **ROPE, "rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 4.0],
        "original_max_position_embeddings": 8}}),
    ("llama", {"rope_parameters": {**ROPE, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}),
    ("llama", {"rope_parameters": {**ROPE, "rope_type": "proportional", "factor": 2.0,
                                   "partial_rotary_factor": 0.5}}),
]


def test_the_config_names_every_policy_table():
    from ds_tsp.config import POLICY_NAMES
    from ds_tsp.injection.policy import POLICIES

    assert POLICY_NAMES == tuple(POLICIES)


def table_variants_parity(variants):
    return [parity(tiny_model(arch, **overrides), dist.get_world_size()) for arch, overrides in variants]


def test_every_table_variant_and_rope_type_matches_hugging_face(run_ranks):
    from ds_tsp.injection.policy import ROPE_TYPES

    tested = {v[1]["rope_parameters"]["rope_type"] for v in TABLE_VARIANTS if "rope_parameters" in v[1]}
    assert tested | {"default"} == set(ROPE_TYPES)  # the default is every other test's
    per_rank = run_ranks(2, table_variants_parity, variants=TABLE_VARIANTS)
    for index, (arch, overrides) in enumerate(TABLE_VARIANTS):
        check([rank[index] for rank in per_rank], f"D=2 {arch} {overrides}")


def _inject(model, **options):
    return ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True, attention_backend="sdpa", **options))


@pytest.mark.parametrize("arch, overrides, match", [
    ("llama", {"rope_parameters": {**ROPE, "rope_type": "default", "partial_rotary_factor": 0.5}},
     r"config.rope_parameters = .*partial_rotary_factor.*partial rotary factors"),
    ("qwen2", {"attention_dropout": 0.1}, r"config.attention_dropout = 0.1.*set model.config.attention_dropout = 0.0"),
    ("phi3", {"resid_pdrop": 0.1}, r"config.resid_pdrop = 0.1.*set model.config.resid_pdrop = 0.0"),
    ("gemma3", {"use_bidirectional_attention": True},
     r"config.use_bidirectional_attention = True.*leave use_bidirectional_attention unset"),
])
def test_a_config_value_outside_the_table_is_refused_by_name(arch, overrides, match):
    model = tiny_model(arch, **overrides)
    with pytest.raises(PolicyError, match=match):
        _inject(model)
    assert type(model.model.layers[0]).__name__ != "TSPDecoderLayer"


def test_a_fused_kernel_for_soft_capped_scores_is_refused_by_name():
    model = tiny_model("gemma2")
    with pytest.raises(ValueError, match=r"tsp.attention_backend = 'flash' cannot soft-cap attention scores "
                                         r"\(attn_logit_softcapping = 1.5\).*\"auto\" or \"sdpa\""):
        ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True, attention_backend="flash"))


def test_a_rope_type_outside_the_table_is_refused():
    model = tiny_model("llama")
    model.config.rope_parameters = {"full_attention": {**ROPE, "rope_type": "default"}}  # per layer type
    with pytest.raises(PolicyError, match=r"config.rope_parameters = \{'full_attention'.*per-layer-type"):
        _inject(model)


def test_a_window_the_architecture_does_not_read_is_refused():
    # LlamaModel never reads config.sliding_window; the TSP attention would.
    model = tiny_model("llama")
    model.config.sliding_window = 4
    with pytest.raises(PolicyError, match=r"LlamaDecoderLayer at model.layers.0: the Hugging Face forward masks "
                                          r"with sliding window None, but the TSP attention would take 4"):
        _inject(model)


def test_an_auto_feature_away_from_its_neutral_value_is_refused_by_name():
    model = look_alike(LookAlikeDecoderLayer)
    model.config.clip_qkv = 8.0
    with pytest.raises(PolicyError, match=r"config.clip_qkv = 8.0.*clipping of q/k/v.*'auto'"):
        _inject(model)


def test_q_k_norms_with_a_weight_per_head_are_refused_by_name():
    """Cohere's use_qk_norm holds a (heads, head_dim) weight: refused by name before the probe runs the layer."""
    model = tiny_model("cohere", use_qk_norm=True)
    with pytest.raises(PolicyError, match=r"CohereDecoderLayer at model.layers.0.self_attn.q_norm holds a weight per "
                                          r"head \(\(4, 4\): Cohere's use_qk_norm\)"):
        _inject(model)


@pytest.mark.parametrize("arch, kept", [("flint", "sinks"), ("kimi_linear", "dt_bias")])
def test_a_tensor_kept_in_float32_is_not_packed_into_a_narrower_shard(arch, kept):
    """Flint keeps its attention sinks, Kimi Linear its KDA's dt_bias in float32 whatever the model's dtype; the
    TSP blocks pack them with their weights, so a bfloat16 model is refused by name (in float32 each converts, and
    is exact: test_model, test_linear_attention)."""
    model = tiny_model(arch, dtype=torch.bfloat16)
    with pytest.raises(PolicyError, match=rf"{type(model).__name__} keeps its token mixers' \['{kept}'\] in float32 "
                                          r"\(_keep_in_fp32_modules_strict\) while the model is torch.bfloat16"):
        _inject(model)


def test_a_soft_cap_the_forward_does_not_apply_is_refused_by_the_probe():
    """The auto policy takes config.final_logit_softcapping (the TSP head caps the logits, as Gemma's forwards
    do); the probe checks the class's forward does: Llama's, with the attribute set, does not."""
    model = look_alike(LookAlikeDecoderLayer)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(PolicyError, match=r"outside the decoder layers differs from embed -> layers -> norm -> "
                                          r"lm_head -> soft-cap at 30.0 \(config.final_logit_softcapping\)"):
        _inject(model)


def test_gemma4_configs_ds_tsp_does_not_build_are_refused_by_name():
    """An assistant model (every layer reusing keys and values none computes), and a per-layer embedding of
    another vocabulary than the main one folded beside it: refused naming the key and the fix."""
    with pytest.raises(PolicyError, match=r"num_kv_shared_layers = 4 of its 4 layers: every layer reuses keys and "
                                          r"values none of them computes"):
        resolve_policy(tiny_model("gemma4", num_kv_shared_layers=4))
    with pytest.raises(PolicyError, match=r"vocab_size_per_layer_input = 53 beside vocab_size = 61: .* set "
                                          r"tsp.vocab_parallel to false"):
        _inject(tiny_model("gemma4_layer_inputs", vocab_size_per_layer_input=53))


def test_gemma4_bidirectional_attention_is_refused_by_name():
    """Gemma 4 as an encoder (use_bidirectional_attention "all": every token sees every other) is refused naming
    the key; its other features, transformers' defaults included (per-layer inputs), are built."""
    with pytest.raises(PolicyError, match=r"use_bidirectional_attention = 'all'.*leave use_bidirectional_attention "
                                          r"unset for a causal LM"):
        resolve_policy(tiny_causal_lm("gemma4_text", device="meta", use_bidirectional_attention="all"))
    assert resolve_policy(tiny_causal_lm("gemma4_text", device="meta")).name == "gemma4_text"


@pytest.mark.parametrize("where, kind", [("self_attn", "parameter"), ("mlp", "buffer"), ("", "parameter")])
def test_tensors_directly_on_a_layer_module_are_refused_with_their_path(where, kind):
    model = tiny_model("llama")
    module = model.model.layers[1].get_submodule(where)
    if kind == "parameter":
        module.head_scale = nn.Parameter(torch.ones(4, dtype=torch.float64))
    else:
        module.register_buffer("head_scale", torch.ones(4, dtype=torch.float64))
    path = "model.layers.1" + (f".{where}" if where else "")
    with pytest.raises(PolicyError, match=rf"LlamaDecoderLayer at {path} holds \['head_scale'\] directly"):
        _inject(model)


def test_biases_on_some_projections_only_are_refused():
    model = tiny_model("llama")
    model.model.layers[0].self_attn.k_proj.bias = nn.Parameter(torch.zeros(8, dtype=torch.float64))
    with pytest.raises(PolicyError, match=r"has biases on \['k_proj'\] but not on \['q_proj', 'v_proj'\]"):
        _inject(model)


def test_the_probe_refuses_a_look_alike_layer_whose_forward_clamps():
    model = look_alike(ClampedDecoderLayer)
    with pytest.raises(PolicyError, match=r"ClampedDecoderLayer at model.layers.0\) was accepted by shape only.*"
                                          r"decoder layer's forward differs from the TSP layer's"):
        _inject(model)
    assert type(model.model.layers[0]) is ClampedDecoderLayer  # nothing moved


def test_the_probe_refuses_a_model_that_scales_its_logits():
    model = look_alike(LookAlikeDecoderLayer, model_class=ScaledLogitsForCausalLM)
    with pytest.raises(PolicyError, match=r"ScaledLogitsForCausalLM .*forward outside the decoder layers differs"):
        _inject(model)
    assert type(model.model.layers[0]) is LookAlikeDecoderLayer


def probe_verdicts():
    """A genuine look-alike at D=2 is exact; a clamping one is refused on every rank."""
    tsp_size = dist.get_world_size()
    clamped = look_alike(ClampedDecoderLayer)
    try:
        ds_tsp.inject(clamped, TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size))
        refused = None
    except PolicyError as error:
        refused = str(error)
    return refused, parity(look_alike(LookAlikeDecoderLayer), tsp_size)


def test_the_probe_accepts_a_genuine_look_alike_and_all_ranks_agree(run_ranks):
    per_rank = run_ranks(2, probe_verdicts)
    assert all(refused and "ClampedDecoderLayer" in refused for refused, _ in per_rank)
    check([diffs for _, diffs in per_rank], "D=2 class-renamed Llama layer (auto policy, probed)")


def test_one_pair_of_qk_norms_or_none():
    """Qwen3's q/k norms with a second pair under Hunyuan's names beside them, or a query norm without its key
    norm: the TSP attention takes one whole pair, so the rest is named, not dropped."""
    model = tiny_model("qwen3")
    attn = model.model.layers[0].self_attn
    attn.query_layernorm, attn.key_layernorm = copy.deepcopy(attn.q_norm), copy.deepcopy(attn.k_norm)
    with pytest.raises(PolicyError, match=r"unexpected submodule\(s\) \['key_layernorm', 'query_layernorm'\]"):
        _inject(model)
    model = tiny_model("qwen3")
    del model.model.layers[0].self_attn.k_norm
    with pytest.raises(PolicyError, match=r"self_attn lacks \['k_norm'\]"):
        _inject(model)
