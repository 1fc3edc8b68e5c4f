"""Tiny Hugging Face causal LMs built in code (no downloads), float64 by default."""

import contextlib
import inspect
import io
import os
import sys
import textwrap

import torch
from transformers import (AttentionInterface, AttentionMaskInterface, Gemma2Config, Gemma2ForCausalLM,
                          Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig, GemmaForCausalLM, Glm4MoeConfig,
                          Glm4MoeForCausalLM, LlamaConfig, MiniMaxM2Config, MiniMaxM2ForCausalLM, Dots1Config,
                          Dots1ForCausalLM, MellumConfig, MellumForCausalLM, GptOssConfig, GptOssForCausalLM,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Olmo2Config, Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM, OlmoeConfig, OlmoeForCausalLM,
                          Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
import torch.nn.functional as F
from transformers.masking_utils import eager_mask
from transformers.models.dots1.modeling_dots1 import Dots1TopkRouter
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.vaultgemma.modeling_vaultgemma import VaultGemmaRMSNorm
from transformers import (BambaConfig, BambaForCausalLM, GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM,
                          KimiLinearConfig, KimiLinearForCausalLM, NemotronHConfig, NemotronHForCausalLM,
                          OlmoHybridConfig, OlmoHybridForCausalLM)
from transformers import FalconH1Config, FalconH1ForCausalLM, JambaConfig, JambaForCausalLM
from transformers import (Lfm2Config, Lfm2ForCausalLM, Lfm2MoeConfig, Lfm2MoeForCausalLM, Lfm3Config,
                          Lfm3ForCausalLM)
from transformers import Gemma4ForCausalLM, Gemma4TextConfig
from transformers import (HyperCLOVAXConfig, HyperCLOVAXForCausalLM, Llama4ForCausalLM, Llama4TextConfig,
                          PhimoeConfig, PhimoeForCausalLM)
from transformers import (Cohere2Config, Cohere2ForCausalLM, Cohere2MoeConfig, Cohere2MoeForCausalLM, CohereConfig,
                          CohereForCausalLM, Ernie4_5Config, Ernie4_5ForCausalLM, Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM,
                          FlintConfig, FlintForCausalLM, GraniteMoeConfig, GraniteMoeForCausalLM, Glm4Config, Glm4ForCausalLM, GlmConfig, GlmForCausalLM,
                          HeliumConfig, HeliumForCausalLM, HunYuanDenseV1Config,
                          HunYuanDenseV1ForCausalLM, HunYuanMoEV1Config, HunYuanMoEV1ForCausalLM, Jais2Config,
                          Jais2ForCausalLM, Ministral3Config, NemotronConfig, NemotronForCausalLM,
                          Ministral3ForCausalLM, VaultGemmaConfig, VaultGemmaForCausalLM)
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.flex_olmo.modeling_flex_olmo import FlexOlmoRMSNorm
from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm, MiniMaxM2TopKRouter
from transformers.models.olmo3.modeling_olmo3 import Olmo3RMSNorm
from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, repeat_kv
from transformers.models.deepseek_v2 import modeling_deepseek_v2
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm, DeepseekV3TopkRouter
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteRMSNorm, Glm4MoeLiteTopkRouter
from transformers.models.mistral4.modeling_mistral4 import Mistral4RMSNorm
from transformers.models.youtu.modeling_youtu import YoutuRMSNorm
from transformers import (Qwen3NextConfig, Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,
                          Qwen3_5MoeTextConfig, Qwen3_5TextConfig)
from transformers.models.qwen3_next import modeling_qwen3_next
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.bamba import modeling_bamba
from transformers.models.falcon_h1 import modeling_falcon_h1
from transformers.models.jamba import modeling_jamba
from transformers.models.granitemoehybrid import modeling_granitemoehybrid
from transformers.models.nemotron_h import modeling_nemotron_h
from transformers.models.olmo_hybrid import modeling_olmo_hybrid
from transformers.models.kimi_linear import modeling_kimi_linear
from transformers.models.hy_v4 import modeling_hy_v4
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                          DeepseekV32Config, DeepseekV32ForCausalLM, Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM,
                          GlmMoeDsaConfig, GlmMoeDsaForCausalLM, HYV4Config, HYV4ForCausalLM, Mistral4Config,
                          Mistral4ForCausalLM, YoutuConfig, YoutuForCausalLM)

COMMON = dict(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=4, max_position_embeddings=128, attn_implementation="sdpa")


def eager_wide_softmax(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                       s_aux=None, **kwargs):
    """Hugging Face's eager attention (Gemma-2's: scores soft-capped before the
    mask; GPT-OSS's: a sink logit per head, ``s_aux``, joins the softmax) with
    the softmax in float32 or the model's dtype if wider: HF's own runs it in
    float32 even in a float64 model, which would make the reference
    float32-exact only."""
    scores = torch.matmul(query, repeat_kv(key, module.num_key_value_groups).transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    wide = torch.promote_types(scores.dtype, torch.float32)
    if s_aux is not None:
        sinks = s_aux.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1, dtype=wide)[..., :-1].to(query.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=wide).to(query.dtype)
    out = torch.matmul(probs, repeat_kv(value, module.num_key_value_groups))
    return out.transpose(1, 2).contiguous(), probs


AttentionInterface.register("eager_wide_softmax", eager_wide_softmax)
AttentionMaskInterface.register("eager_wide_softmax", eager_mask)  # additive float masks, as eager's


def rms_norm_in_the_wider_dtype(self, hidden_states):
    """OLMo-2/3's (OLMoE's, FlexOlmo's, MiniMax-M2's, OLMo-Hybrid's) RMSNorm as Hugging Face writes it, but in float32 or the
    input's dtype if wider: HF's computes in float32 even in a float64 model
    (and so its q/k norms make every number after them float32-exact only)."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)


Olmo2RMSNorm.forward = Olmo3RMSNorm.forward = OlmoeRMSNorm.forward = FlexOlmoRMSNorm.forward = \
    MiniMaxM2RMSNorm.forward = modeling_olmo_hybrid.OlmoHybridRMSNorm.forward = rms_norm_in_the_wider_dtype
# The MLA models' norms, whose latent norms (kv_a_layernorm, q_a_layernorm) are HF's float32 RMSNorm too.
DeepseekV3RMSNorm.forward = modeling_deepseek_v2.DeepseekV2RMSNorm.forward = Glm4MoeLiteRMSNorm.forward = \
    YoutuRMSNorm.forward = Mistral4RMSNorm.forward = rms_norm_in_the_wider_dtype


def deepseek_v2_rotary_in_the_wider_dtype(xq, xk, freqs_cis):
    """DeepSeek-V2's complex rotary embedding as Hugging Face writes it, but in
    complex128 for a float64 model: HF's rotates in complex64 whatever the dtype."""
    wide = torch.promote_types(xq.dtype, torch.float32)
    xq_ = torch.view_as_complex(xq.to(wide).reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.to(wide).reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.unsqueeze(1).to(xq_.dtype)
    return (torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk))


modeling_deepseek_v2.apply_rotary_emb = deepseek_v2_rotary_in_the_wider_dtype


def gemma_rms_norm_in_the_wider_dtype(self, x):
    """Gemma's ``(1 + w)`` RMSNorm as Hugging Face writes it, but in float32
    or the input's dtype if wider: HF's multiplies by its weight in float32
    even in a float64 model, so its weight's gradient, a sum over tokens, is
    float32-rounded and depends on the order of that sum."""
    wide = torch.promote_types(x.dtype, torch.float32)
    return (self._norm(x.to(wide)) * (1.0 + self.weight.to(wide))).type_as(x)


GemmaRMSNorm.forward = Gemma2RMSNorm.forward = Gemma3RMSNorm.forward = VaultGemmaRMSNorm.forward = \
    gemma_rms_norm_in_the_wider_dtype
def glm_router_in_the_wider_dtype(self, hidden_states):
    """GLM-4.5's router (DeepSeek-V3's) as Hugging Face writes it, but in
    float32 or the model's dtype if wider: HF's casts the tokens and its weight
    to float32 even in a float64 model, and a float32 matmul rounds a row
    differently with its place in the batch (``routes_in_float32``), so every
    number after it would be float32-exact only."""
    wide = torch.promote_types(hidden_states.dtype, torch.float32)
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.type(wide), self.weight.type(wide))
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    group_scores = scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0]
    group_idx = torch.topk(group_scores.sum(dim=-1), k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores[..., 0]).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.reshape(-1, self.num_experts).bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True) + 1e-20
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


# One router, four copies.
Glm4MoeTopkRouter.forward = Dots1TopkRouter.forward = DeepseekV3TopkRouter.forward = Glm4MoeLiteTopkRouter.forward = \
    glm_router_in_the_wider_dtype


def minimax_router_in_the_wider_dtype(self, hidden_states, e_score_correction_bias):
    """MiniMax-M2's router as Hugging Face writes it, but its sigmoid in float32
    or the model's dtype if wider: HF's takes it in float32 even in a float64
    model, and a vectorised float32 sigmoid rounds an element differently with
    its place in the batch (a packed batch at D=2 moved a gradient by 4e-10)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.to(self.weight.dtype), self.weight)
    routing_weights = torch.sigmoid(router_logits.to(torch.promote_types(router_logits.dtype, torch.float32)))
    scores_for_choice = routing_weights + e_score_correction_bias
    _, top_k_index = torch.topk(scores_for_choice, self.top_k, dim=-1, sorted=False)
    top_k_weights = routing_weights.gather(1, top_k_index)
    top_k_weights /= top_k_weights.sum(dim=-1, keepdim=True)
    return router_logits, top_k_weights, top_k_index


MiniMaxM2TopKRouter.forward = minimax_router_in_the_wider_dtype


def widened(function, replacements, module=None):
    """Hugging Face's ``function`` itself, recompiled in its module with each of
    ``replacements`` (``{text: new text}``) made in its source: how these tests
    widen the float32 casts of Gated DeltaNet's torch reference to the model's
    dtype without rewriting its arithmetic. The decorators are dropped. A
    function transformers wraps in a kernel hub module is named by ``module``
    and its name (``function`` a string) and read from the module's source."""
    if module is None:
        module, source = sys.modules[function.__module__], textwrap.dedent(inspect.getsource(function))
        name = function.__name__
    else:
        name, text = function, inspect.getsource(module)
        start = text.index(f"\ndef {name}(") + 1
        end = text.find("\n@", start)
        source = text[start:end if end > 0 else None]
    source = source[source.index("def "):]
    for old, new in replacements.items():
        if old not in source:
            raise AssertionError(f"{name} no longer holds {old!r}: re-audit the widening")
        source = source.replace(old, new)
    defined = {}
    exec(compile(source, f"<widened {name}>", "exec"), module.__dict__, defined)  # the module's own globals
    return defined[name]


def widen_float32_casts(modeling):
    """The reference's float32 casts in the modeling module ``modeling`` (once)
    in float32 or the model's dtype if wider, where HF casts to float32 even in
    a float64 model, so that a float64 reference is float64-exact:
    Gated DeltaNet's chunked rule and its layers' decay and gated norms, Mamba-2's scan (a
    split of the sequence at any token then differs by about 2e-7), their
    (1 + w) RMSNorms (Gemma's), RMS and layer norms multiplying by their weight
    in float32 (Helium's, Cohere's: their weight's gradient, a float32 sum over
    tokens, depends on its order), a rotary function rotating in float32
    (ERNIE 4.5's, Cohere's, Llama 4's over its complex table), and Llama 4's
    and Gemma 4's norms normalising in float32 and Llama 4's router's sigmoid;
    HY-V4's hyper-connections (their mixing matmul rounds a token's row with
    its place in the batch), its layers joining the streams and its router."""
    if getattr(modeling, "_ds_tsp_widened", False):
        return
    if hasattr(modeling, "torch_chunk_gated_delta_rule"):
        for rule in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            setattr(modeling, rule, widened(rule, {"torch.float32": "torch.promote_types(initial_dtype, torch.float32)"},
                                            modeling))
    for scan in ("mamba2_chunk_scan", "mamba2_scan_forward", "mamba2_selective_state_update"):  # Mamba-2's torch
        # path: its scan, its A and its decode step
        if hasattr(modeling, scan):
            setattr(modeling, scan, widened(scan, {".float()": ".to(torch.promote_types(hidden_states.dtype, "
                                                                "torch.float32))"}, modeling))
    if hasattr(modeling, "mamba_scan_forward"):  # Mamba-1's (Jamba's) torch path: its scan, A, D and dt's bias
        for scan in ("mamba_scan_forward", "mamba_selective_scan", "mamba_selective_state_update"):
            setattr(modeling, scan, widened(scan, {".float()": ".to(torch.promote_types(hidden_states.dtype, "
                                                                "torch.float32))"}, modeling))
    if hasattr(modeling, "chunk_kimi_delta_attention"):  # Kimi Linear's KDA, its decay and its forget gate
        for rule, extra in (("chunk_kimi_delta_attention", {".exp().float()": ".exp()"}),
                            ("recurrent_kimi_delta_attention", {})):
            setattr(modeling, rule, widened(rule, {"torch.float32": "torch.promote_types(initial_dtype, torch.float32)",
                                                   **extra}, modeling))
        gate = modeling.KimiLinearForgetGate
        gate.forward = widened(gate.forward, {".float()": ".to(torch.promote_types(hidden_states.dtype, "
                                                          "torch.float32))"})
        kda = modeling.KimiLinearDeltaAttention  # its cache's state in float32
        kda.forward = widened(kda.forward, {".to(torch.float32)": ".to(torch.promote_types(hidden_states.dtype, "
                                                                  "torch.float32))"})
    text = inspect.getsource(modeling)  # the rotary function's source, also where a kernel hub wraps it
    start = text.find("\ndef apply_rotary_pos_emb(")
    if start >= 0 and ".float()" in text[start:text.find("\n\n\n", start)]:
        modeling.apply_rotary_pos_emb = widened(
            "apply_rotary_pos_emb", {".float()": ".to(torch.promote_types(q.dtype, torch.float32))"}, modeling)
    complex_rotary = getattr(modeling, "apply_rotary_emb", None)  # Llama 4's, over a complex table
    if complex_rotary is not None and "xq.float()" in inspect.getsource(complex_rotary):
        modeling.apply_rotary_emb = widened(complex_rotary, {
            f"{x}.float()": f"{x}.to(torch.promote_types({x}.dtype, torch.float32))" for x in ("xq", "xk")})
    classes = {cls: name for name, cls in reversed(list(vars(modeling).items())) if isinstance(cls, type)}
    for cls, name in classes.items():  # each class once, under its first name (Llama4TextL2Norm is an alias)
        if cls.__module__ != modeling.__name__ or "forward" not in vars(cls):
            continue
        try:
            source = inspect.getsource(cls.forward)
        except OSError:  # widened above (Kimi Linear's forget gate)
            continue
        if name.endswith("Router") and "router_scores.float()" in source:  # Llama 4's sigmoid
            cls.forward = widened(cls.forward, {"router_scores.float()": "router_scores.to(torch.promote_types("
                                                                          "router_scores.dtype, torch.float32))",
                                                # recompiled outside its class, super() has no class to start from
                                                "super().forward(": "nn.Linear.forward(self, "})
        elif name.endswith("Router") and "hidden_states.type(torch.float32)" in source:  # Nemotron-H's, in float32
            cls.forward = widened(cls.forward, {"torch.float32": "torch.promote_types(hidden_states.dtype, torch.float32)"})
        elif name.endswith("ForCausalLM") and "logits = self.lm_head(hidden_states).float()" in source:  # Nemotron-H's
            cls.forward = widened(cls.forward, {"logits = self.lm_head(hidden_states).float()":
                                                "logits = self.lm_head(hidden_states)"})
        elif name.endswith("GatedDeltaNet") and "self.A_log.float()" in source and "a.float()" in source:
            cls.forward = widened(cls.forward, {
                "self.A_log.float()": "self.A_log.to(torch.promote_types(a.dtype, torch.float32))",
                "a.float()": "a.to(torch.promote_types(a.dtype, torch.float32))"})
        elif name.endswith("GatedDeltaNet") and "self.a_proj(hidden_states).float()" in source:  # OLMo-Hybrid's
            cls.forward = widened(cls.forward, {
                "self.A_log.float()": "self.A_log.to(torch.promote_types(hidden_states.dtype, torch.float32))",
                "self.a_proj(hidden_states).float()": "self.a_proj(hidden_states).to(torch.promote_types("
                                                      "hidden_states.dtype, torch.float32))"})
        elif name.endswith(("HyperConnection", "HyperHead", "UnweightedRMSNorm")) and ".float()" in source:
            streams = list(inspect.signature(cls.forward).parameters)[1]  # HY-V4's: the streams they mix
            cls.forward = widened(cls.forward, {".float()": f".to(torch.promote_types({streams}.dtype, torch.float32))"})
        elif name.endswith("DecoderLayer") and "residual.float()" in source:  # HY-V4's streams joined in float32
            cls.forward = widened(cls.forward, {".float()": ".to(torch.promote_types(dtype, torch.float32))"})
        elif name.endswith("RMSNormGated") and "torch.float32" in source:
            cls.forward = widened(cls.forward, {"torch.float32": "torch.promote_types(input_dtype, torch.float32)"})
        elif name.endswith("RMSNorm") and "(1.0 + self.weight.float())" in source:
            cls.forward = gemma_rms_norm_in_the_wider_dtype
        elif name.endswith(("RMSNorm", "LayerNorm")) and "self.weight.to(torch.float32) * hidden_states" in source:
            cls.forward = widened(cls.forward, {"torch.float32": "torch.promote_types(input_dtype, torch.float32)"})
        elif name.endswith("RMSNorm") and "self._norm(x.float())" in source:  # Llama 4's, with and without weight
            cls.forward = widened(cls.forward, {"x.float()": "x.to(torch.promote_types(x.dtype, torch.float32))"})
        elif name.endswith("RMSNorm") and "self._norm(hidden_states.float())" in source:  # Gemma 4's, both ways
            cls.forward = widened(cls.forward, {
                "hidden_states.float()": "hidden_states.to(torch.promote_types(hidden_states.dtype, torch.float32))",
                "self.weight.float()": "self.weight.to(torch.promote_types(self.weight.dtype, torch.float32))"})
    modeling._ds_tsp_widened = True


for modeling in (modeling_qwen3_next, modeling_qwen3_5, modeling_qwen3_5_moe, modeling_bamba,
                 modeling_granitemoehybrid, modeling_nemotron_h, modeling_falcon_h1, modeling_olmo_hybrid,
                 modeling_kimi_linear, modeling_jamba, modeling_hy_v4):
    widen_float32_casts(modeling)


# Gemma-2/3 at sizes where every feature bites: a window shorter than the test
# sequences on alternating layers, an attention scale of 1/sqrt(head_dim), caps
# the scores and logits reach.
GEMMA2_TINY = dict(sliding_window=5, query_pre_attn_scalar=4, attn_logit_softcapping=1.5,
                   final_logit_softcapping=2.0, attn_implementation="eager_wide_softmax")
GEMMA4_TINY = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=5,
                   global_head_dim=8, num_global_key_value_heads=1, attention_k_eq_v=True,
                   final_logit_softcapping=2.0, hidden_size_per_layer_input=0,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                       "rope_theta": 1000.0}})
# Phi-4-mini's shape: fused projections, GQA, 3/4 of each head rotary under
# longrope (its short factors up to original_max_position_embeddings tokens,
# its long ones past), a tied head.
PHI4_MINI = dict(hidden_size=32, head_dim=8, tie_word_embeddings=True, original_max_position_embeddings=16,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "short_factor": [1.0, 1.5, 2.0], "long_factor": [2.0, 3.0, 5.0]})
PHI3_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_config(arch, **overrides):
    kwargs = {**COMMON, **(PHI4_MINI if arch == "phi4_mini" else {}), **overrides}
    if arch == "llama":
        return LlamaConfig(**kwargs)
    if arch == "llama_tied":
        return LlamaConfig(**kwargs, tie_word_embeddings=True)
    if arch == "qwen2":  # q/k/v biases
        return Qwen2Config(**kwargs)
    if arch == "mistral":  # sliding window shorter than the test sequences
        return MistralConfig(**{"sliding_window": 5, **kwargs})
    if arch == "qwen3":  # per-head q/k norms
        return Qwen3Config(**kwargs)
    if arch == "gemma":  # its embedding scales the looked-up rows by sqrt(H); (1 + w) norms; tied head
        return GemmaConfig(**kwargs)
    if arch == "gemma2":  # Gemma's, plus sandwich norms, soft-capped scores and logits, sliding layers
        return Gemma2Config(**{**kwargs, **GEMMA2_TINY, **overrides})
    if arch == "gemma3":  # Gemma-2's with per-head q/k norms, a RoPE table per layer type, no score cap
        return Gemma3TextConfig(**{**kwargs, **GEMMA2_TINY, "attn_logit_softcapping": None,
                                   "layer_types": ["sliding_attention", "full_attention"],
                                   "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                       "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                          "rope_theta": 1000.0}},
                                   **overrides})
    if arch == "gemma4":  # Gemma 4 text: Gemma 3's layer with a weightless value norm and scale 1; full layers
        # with wider heads (8) and one key/value head whose keys are also its values; proportional RoPE rotating a
        # quarter of their heads; soft-capped logits.
        return Gemma4TextConfig(**{**kwargs, **GEMMA4_TINY, **overrides})
    if arch == "gemma4_shared_kv":  # the last two layers attend to the keys and values of the first two (Gemma 4
        # E2B's and E4B's, whose key/value-sharing layers take double-wide MLPs)
        return Gemma4TextConfig(**{**kwargs, **GEMMA4_TINY, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
                                   **overrides})
    if arch == "gemma4_layer_inputs":  # and per-layer inputs (4 a layer) from a second embedding, as E2B's and
        # E4B's beside their shared keys and values
        return Gemma4TextConfig(**{**kwargs, **GEMMA4_TINY, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
                                   "hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": kwargs["vocab_size"],
                                   **overrides})
    if arch == "gemma4_moe":  # and 4 experts (top-2) beside every layer's MLP, as Gemma 4's 26B-A4B
        return Gemma4TextConfig(**{**kwargs, **GEMMA4_TINY, "enable_moe_block": True, "num_experts": 4,
                                   "top_k_experts": 2, "moe_intermediate_size": 8, "experts_implementation": "eager",
                                   **overrides})
    if arch == "vaultgemma":  # Gemma-2's scale, soft-capped scores and logits and sliding layers, pre-norms only
        return VaultGemmaConfig(**{**kwargs, **GEMMA2_TINY, **overrides})  # (the auto policy's; issue 62)
    if arch == "hunyuan_v1_dense":  # per-head q/k norms after the rotary embedding; auto policy (issue 62)
        return HunYuanDenseV1Config(**kwargs)
    if arch == "ernie4_5":  # the rotary embedding on interleaved pairs, in float32 (widened); q/k/v/o and MLP
        return Ernie4_5Config(**{"use_bias": True, **kwargs})  # biases; auto policy (issue 62)
    if arch == "glm":  # interleaved pairs on half of each head, q/k/v biases, gate/up fused (gate_up_proj); auto
        return GlmConfig(**{**PHI3_TOKENS, **kwargs, "head_dim": overrides.get("head_dim", 8)})
    if arch == "glm4":  # GLM's, with sandwich norms under its own names (post_self_attn_layernorm, post_mlp_layernorm)
        return Glm4Config(**{**PHI3_TOKENS, **kwargs, "head_dim": overrides.get("head_dim", 8)})
    if arch == "cohere":  # attention and MLP side by side off one layer norm, interleaved pairs rotated in float32
        # (widened), logits scaled by logit_scale; auto policy (issue 62)
        return CohereConfig(**{**PHI3_TOKENS, "logit_scale": 0.25, **kwargs})
    if arch == "cohere2":  # Cohere's layer; rotary sliding layers, full layers without positions (Command A's)
        return Cohere2Config(**{**PHI3_TOKENS, "logit_scale": 0.25, "sliding_window": 5,
                                "layer_types": ["sliding_attention", "full_attention"], **kwargs})
    if arch == "nemotron":  # an ungated MLP, down(relu2(up(x))); layer norms (1 + w) with biases; half of each head
        return NemotronConfig(**{**PHI3_TOKENS, "partial_rotary_factor": 0.5, **kwargs})  # rotary; auto policy
    if arch == "jais2":  # an ungated MLP with biases, q/k/v/o biases; auto policy
        return Jais2Config(**{**PHI3_TOKENS, **kwargs})
    if arch == "helium":  # the rotary embedding on interleaved pairs; auto policy (issue 62)
        return HeliumConfig(**kwargs)
    if arch == "flint":  # rotary sliding layers, full layers without positions (NoPE); sinks; q/k norms; auto policy
        return FlintConfig(**{"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"], **kwargs,
                              "attn_implementation": "eager_wide_softmax"})  # HF's only attention with sinks
    if arch == "ministral3":  # queries scaled by position (llama_4_scaling_beta), past 4 tokens here; auto policy
        return Ministral3Config(**{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                       "llama_4_scaling_beta": 0.5,
                                                       "original_max_position_embeddings": 4}, **kwargs})
    if arch == "olmo2":  # post-norms only; q/k norms over the whole projection
        return Olmo2Config(**kwargs)
    if arch == "olmo3":  # OLMo-2's, with sliding layers and a RoPE table per layer type
        return Olmo3Config(**{**kwargs, "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"],
                              "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                  "full_attention": {"rope_type": "default", "rope_theta": 1000.0}},
                              **overrides})
    if arch in ("phi3", "phi4_mini"):  # fused qkv_proj and gate_up_proj
        return Phi3Config(**{**PHI3_TOKENS, **kwargs})
    # HF's eager expert loop: its default grouped_mm takes no float64.
    moe = {"experts_implementation": "eager", "num_experts_per_tok": 2, "output_router_logits": True,
           "router_aux_loss_coef": 0.1, **kwargs}
    if arch == "mixtral":  # 4 experts, always-normalised top-2 weights kept in float32
        return MixtralConfig(**{"num_local_experts": 4, **moe})
    if arch == "qwen2_moe":  # 4 experts of 8, a shared expert of 16 with its sigmoid gate, q/k/v biases
        return Qwen2MoeConfig(**{"num_experts": 4, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16,
                                 **moe})
    if arch == "qwen3_moe":  # 8 experts of 8, renormalised top-2 (norm_topk_prob)
        return Qwen3MoeConfig(**{"num_experts": 8, "moe_intermediate_size": 8, "norm_topk_prob": True, **moe})
    if arch == "glm4_moe":  # a dense first layer; 4 sigmoid-routed experts of 8 in 2 groups, one chosen (group-limited
        # top-2), a score-correction bias, routed scaling; an ungated shared expert of 8; q/k norms; half of each
        # head rotary. No load-balancing loss (HF's forward adds none).
        return Glm4MoeConfig(**{"n_routed_experts": 4, "moe_intermediate_size": 8, "n_shared_experts": 1,
                                "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
                                "routed_scaling_factor": 2.5, "use_qk_norm": True, **moe})
    if arch == "olmoe":  # 4 experts of intermediate_size, softmax top-2; q/k norms over the whole projection
        return OlmoeConfig(**{"num_experts": 4, **moe})
    if arch == "minimax_m2":  # 4 sigmoid-routed experts, the block's score-correction bias handed to its router;
        # q/k norms over the whole projection; half of each head rotary (its checkpoints' rotary_dim)
        return MiniMaxM2Config(**{"num_local_experts": 4, "rotary_dim": 2, **moe})
    if arch == "dots1":  # GLM-4.5's block (sigmoid group-limited routing, an ungated shared expert, a dense first
        # layer) under per-head q/k norms; taken by the auto policy and its probe
        return Dots1Config(**{"n_routed_experts": 4, "moe_intermediate_size": 8, "n_shared_experts": 1,
                              "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
                              "routed_scaling_factor": 2.0, **moe})
    if arch == "hunyuan_v1_moe":  # Hunyuan's attention; 4 experts, softmax top-2 renormalised, a shared MLP
        # (shared_mlp) added to them; auto policy
        return HunYuanMoEV1Config(**{"num_experts": 4, "moe_topk": 2, **moe})
    if arch == "ernie4_5_moe":  # ERNIE 4.5's attention; 4 experts, softmax top-2 with a score-correction bias, a
        # shared expert; a dense first layer. Its load-balancing loss is Mixtral's (test_moe's); none here, as the
        # reference loss (parity.reference_loss) is the cross-entropy alone
        return Ernie4_5_MoeConfig(**{"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 8,
                                     "moe_num_shared_experts": 1, "moe_layer_start_index": 1, **moe,
                                     "output_router_logits": False})
    if arch == "granitemoe":  # the MoE block at block_sparse_moe (files: input_linear / output_linear), 4 experts
        # top-2, Granite's embedding, attention, residual and logit multipliers (embedding x residual != 1: the norms'
        # scale invariance would make a dropped one of either look alike); auto policy
        return GraniteMoeConfig(**{"num_local_experts": 4, "embedding_multiplier": 2.0, "attention_multiplier": 0.3,
                                   "residual_multiplier": 0.3, "logits_scaling": 4.0, **moe,
                                   "output_router_logits": False})
    if arch == "cohere2_moe":  # Cohere2's attention; 4 softmax-routed experts top-2 in the parallel block
        return Cohere2MoeConfig(**{**PHI3_TOKENS, "logit_scale": 0.25, "sliding_window": 5, "num_experts": 4,
                                   "layer_types": ["sliding_attention", "full_attention"], **moe,
                                   "output_router_logits": False})
    if arch == "hyperclovax":  # sandwich norms under its own names (post_norm1, post_norm2); Granite's embedding and
        # residual multipliers, the attention's, and logits MULTIPLIED by logits_scaling; auto policy
        return HyperCLOVAXConfig(**{**kwargs, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                                    "logits_scaling": 4.0, **overrides})
    if arch == "phimoe":  # PhiMoE's sparsemixer router with jitter 0: its Gumbel sampling in training then always
        # picks the top score (the others are masked to -inf), so training routes deterministically; auto policy
        return PhimoeConfig(**{"num_local_experts": 4, **moe, "router_jitter_noise": 0.0, "input_jitter_noise": 0.0,
                               "output_router_logits": False, **overrides})
    if arch == "llama4":  # Llama 4 text: chunked layers (chunks of 3 tokens here) rotating by its complex table,
        # a weightless q/k norm after the rotary; a NoPE layer whose queries temperature tuning scales from 1 token
        # on (floor_scale 2); a dense first layer, then MoE layers of 4 experts top-2 with a shared expert, the
        # routing weights scaling the experts' inputs. No load-balancing loss (HF's forward adds none).
        return Llama4TextConfig(**{**moe, "num_hidden_layers": 3, "num_local_experts": 4, "intermediate_size_mlp": 24,
                                   "attention_chunk_size": 3, "no_rope_layers": [1, 0, 1], "moe_layers": [1, 2],
                                   "floor_scale": 2, "attn_scale": 0.5, "output_router_logits": False, **overrides})
    if arch == "mellum":  # Qwen3-MoE's block; sliding and full layers, a RoPE table per layer type; auto policy
        return MellumConfig(**{"num_experts": 4, "moe_intermediate_size": 8, "sliding_window": 5,
                               "layer_types": ["sliding_attention", "full_attention"], **moe})
    if arch == "gpt_oss":  # attention sinks, q/k/v/o biases, sliding and full layers, YaRN; 4 experts (E, H, 2F)
        # with interleaved gate/up columns and biases, a SwiGLU clamped at 1 (the test's activations reach it), a
        # router with a bias. HF's eager attention (its only one with sinks) softmaxes in the model's dtype.
        return GptOssConfig(**{"num_local_experts": 4, "sliding_window": 5, "swiglu_limit": 1.0,
                               "layer_types": ["sliding_attention", "full_attention"],
                               "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                   "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                   "original_max_position_embeddings": 32},
                               **moe, "attn_implementation": "eager"})
    if arch in MLA_ARCHS or arch in SPARSE_MLA_ARCHS:
        return mla_config(arch, kwargs)
    if arch in HYBRID_ARCHS:
        config_class, extra = HYBRID_ARCHS[arch]
        return config_class(**{**kwargs, **HYBRID_TINY, **extra, **overrides})
    raise ValueError(arch)


# Gated DeltaNet hybrids at tiny sizes, their real layer pattern (three linear layers, then a gated full-attention
# layer with per-head q/k norms and a quarter of each head rotary): 4 key heads of 4 (whole heads on each of 4 ranks),
# 8 value heads of 4 (two a key head), a 4-tap convolution. Qwen3-Next and Qwen3.5-MoE: 4 experts of 8, top-2, a
# gated shared expert of 16.
HYBRID_TINY = dict(num_hidden_layers=4, head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8,
                   linear_key_head_dim=4, linear_value_head_dim=4, linear_conv_kernel_dim=4)
HYBRID_MOE = dict(num_experts=4, moe_intermediate_size=8, shared_expert_intermediate_size=16, num_experts_per_tok=2,
                  experts_implementation="eager")
# Mamba-2 hybrids at tiny sizes: 8 heads of 4 (two a rank at D = 4) in 2 groups of state 4, 8-token SSM chunks (the
# tests' sequences span several), a 4-tap convolution with bias; an attention layer third of four.
MAMBA2_TINY = dict(num_hidden_layers=4, mamba_n_heads=8, mamba_d_head=4, mamba_n_groups=2, mamba_d_state=4,
                   mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)
FALCON_H1_TINY = dict(num_hidden_layers=3, mamba_d_ssm=32, mamba_n_heads=8, mamba_d_head=4, mamba_n_groups=2,
                      mamba_d_state=4, mamba_d_conv=4, mamba_chunk_size=8, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 2.0],
                      ssm_in_multiplier=0.7, ssm_out_multiplier=1.3, attention_in_multiplier=0.9,
                      attention_out_multiplier=1.1, key_multiplier=0.6, mlp_multipliers=[1.4, 0.75],
                      embedding_multiplier=1.5, lm_head_multiplier=0.8, pad_token_id=0)
GRANITE_MULTIPLIERS = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
                           logits_scaling=3.0)
HYBRID_ARCHS = {"qwen3_next": (Qwen3NextConfig, HYBRID_MOE),
                "qwen3_next_dense": (Qwen3NextConfig, {"num_experts": 0}),
                "qwen3_5": (Qwen3_5TextConfig, {}),
                "qwen3_5_moe": (Qwen3_5MoeTextConfig, HYBRID_MOE),
                # Kimi Linear: KDA (a decay per key channel, 4 heads of 4) beside an MLA layer; a dense MLP, then
                # its MoE (4 experts of 8, top-2, sigmoid group-limited routing, a shared expert).
                "kimi_linear": (KimiLinearConfig, dict(
                    num_hidden_layers=4, layer_types=["linear_attention", "linear_attention", "full_attention",
                                                      "linear_attention"],
                    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_num_heads=4, linear_head_dim=4,
                    linear_conv_kernel_dim=4, kv_lora_rank=6, q_lora_rank=None, qk_rope_head_dim=2,
                    qk_nope_head_dim=4, v_head_dim=6, num_key_value_heads=4, num_local_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=8, n_shared_experts=1, n_group=2, topk_group=1,
                    experts_implementation="eager", pad_token_id=0)),
                # OLMo-Hybrid: one Linear per projection, negative eigenvalues (beta up to 2), post-norm attention
                # layers with q/k norms over the projection beside pre-norm linear ones.
                "olmo_hybrid": (OlmoHybridConfig, {"linear_allow_neg_eigval": True, "pad_token_id": 0, "layer_types": [
                    "linear_attention", "linear_attention", "full_attention", "linear_attention"]}),
                "bamba": (BambaConfig, {**MAMBA2_TINY, "attn_layer_indices": [2]}),
                # Nemotron-H: one block a layer (Mamba-2, MLP, NoPE attention, MoE: its pattern's letters), ungated
                # relu2 MLPs and experts, a sigmoid group-limited router with a shared expert.
                "nemotron_h": (NemotronHConfig, dict(
                    layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "moe"],
                    mamba_num_heads=8, mamba_head_dim=4, n_groups=2, ssm_state_size=4, conv_kernel=4, chunk_size=8,
                    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, n_group=2, topk_group=1,
                    moe_shared_expert_intermediate_size=16, routed_scaling_factor=1.5, experts_implementation="eager")),
                # Nemotron-H's dense layers alone (the planner does not model its ungated experts).
                "nemotron_h_dense": (NemotronHConfig, dict(
                    layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention"],
                    mamba_num_heads=8, mamba_head_dim=4, n_groups=2, ssm_state_size=4, conv_kernel=4, chunk_size=8)),
                # Granite-4.0-H: NoPE, Granite's multipliers; its MoE (4 experts of 8, top-2) beside the shared MLP.
                "granitemoehybrid": (GraniteMoeHybridConfig, {**MAMBA2_TINY, **GRANITE_MULTIPLIERS,
                                                              "num_local_experts": 0, "position_embedding_type": "nope",
                                                              "layer_types": ["mamba", "mamba", "attention", "mamba"]}),
                "granitemoehybrid_moe": (GraniteMoeHybridConfig, {
                    **MAMBA2_TINY, **GRANITE_MULTIPLIERS, "num_local_experts": 4, "num_experts_per_tok": 2,
                    "intermediate_size": 8, "shared_intermediate_size": 16, "position_embedding_type": "rope",
                    "layer_types": ["mamba", "attention", "mamba", "mamba"], "experts_implementation": "eager"}),
                # LFM2: gated short convolutions (kernel 3) beside attention layers with q/k layernorms; the MLP's
                # silu a function. LFM2-MoE: its sigmoid router with an expert bias after a dense first layer, its
                # rotary named pos_emb. LFM3: kernel 4, sandwich norms, a sigmoid gate a head (g_proj), a sliding
                # layer and a full one rotating half of each head (proportional), no rotary table for conv layers.
                "lfm2": (Lfm2Config, {"layer_types": ["conv", "full_attention", "conv"], "num_hidden_layers": 3,
                                      "pad_token_id": 0}),
                "lfm2_biased": (Lfm2Config, {"layer_types": ["conv", "full_attention", "conv"], "num_hidden_layers": 3,
                                             "pad_token_id": 0, "conv_bias": True}),
                "lfm2_moe": (Lfm2MoeConfig, {"layer_types": ["conv", "full_attention", "conv", "full_attention"],
                                             "num_hidden_layers": 4, "num_dense_layers": 1, "num_experts": 4,
                                             "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                                             "use_expert_bias": True, "routed_scaling_factor": 1.5, "pad_token_id": 0,
                                             "experts_implementation": "eager"}),
                "lfm3": (Lfm3Config, {"layer_types": ["conv", "sliding_attention", "conv", "full_attention"],
                                      "num_hidden_layers": 4, "sliding_window": 5, "conv_L_cache": 4,
                                      "pad_token_id": 0}),
                # Falcon-H1: a Mamba-2 mixer (8 heads of 4, 2 groups of state 4) beside the attention in every
                # layer, off one norm, and its multipliers: of each in_proj part (mup_vector), of the mixers' inputs
                # and outputs, the keys, the MLP's gate and output, the embedding and the logits. Without the
                # mixer's gated norm (its default), and, in falcon_h1_norm, with it (normed before the gate).
                "falcon_h1": (FalconH1Config, FALCON_H1_TINY),
                "falcon_h1_norm": (FalconH1Config, {**FALCON_H1_TINY, "mamba_rms_norm": True}),
                # Jamba: Mamba-1 mixers (32 channels, state 4, time-step rank 4) around a NoPE attention layer,
                # its MoE (4 experts, top-2) on every other layer.
                "jamba": (JambaConfig, {"num_hidden_layers": 4, "attn_layer_period": 4, "attn_layer_offset": 2,
                                        "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4,
                                        "num_experts_per_tok": 2, "mamba_d_state": 4, "mamba_d_conv": 4,
                                        "mamba_expand": 2, "mamba_dt_rank": 4, "pad_token_id": 0,
                                        "experts_implementation": "eager"})}


# Multi-head latent attention at tiny sizes: query, key and value heads of three sizes (4 + 2 rotary, 6), latents
# of 6 whose rows split unevenly over 4 ranks, every head its own key/value head. DeepSeek-V3: YaRN with its mscale
# on the softmax scale, a dense first layer, then its MoE (GLM-4.5's sigmoid group-limited router); DeepSeek-V2-Lite:
# no query latent, DeepSeek-V2's complex rotary; GLM-4.7-Flash (glm4_moe_lite): interleaved rotary and MoE; Mistral 4:
# its queries scaled by position (Llama 4's, past original_max_position_embeddings = 8, so from the test sequences'
# ninth token), a softmax router; Youtu: a dense MLA model. The auto policy and its probe take all of them.
MLA_TINY = dict(num_key_value_heads=4, head_dim=2, q_lora_rank=6, kv_lora_rank=6, qk_nope_head_dim=4,
                qk_rope_head_dim=2, v_head_dim=6, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MLA_MOE = dict(n_routed_experts=4, moe_intermediate_size=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
               topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, experts_implementation="eager")
MLA_ARCHS = {
    "deepseek_v3": (DeepseekV3Config, {**MLA_MOE, "first_k_dense_replace": 1, "rope_interleave": True,
                                       "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                           "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                                           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}),
    "deepseek_v3_dense": (DeepseekV3Config, {"first_k_dense_replace": 2}),
    # attention_bias: biased down projections and o_proj; Llama's rotate-half rotary instead of interleaved pairs
    "deepseek_v3_biased": (DeepseekV3Config, {"first_k_dense_replace": 2, "attention_bias": True,
                                              "rope_interleave": False}),
    "deepseek_v2_lite": (DeepseekV2Config, {"q_lora_rank": None, "first_k_dense_replace": 2}),
    "glm4_moe_lite": (Glm4MoeLiteConfig, {**MLA_MOE, "first_k_dense_replace": 1}),
    "mistral4": (Mistral4Config, {**MLA_MOE, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                                  "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                      "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                      "llama_4_scaling_beta": 0.1, "partial_rotary_factor": 1.0}}),
    "youtu": (YoutuConfig, {}),
}


# DeepSeek's sparse attention on the tiny MLA layers: a lightning indexer of 8 heads of 8 (the first 2 dims
# rotated), each query attending to its top 5 keys, fewer than the test sequences hold, so that the choice matters.
# DeepSeek-V3.2: half-split rotary in the indexer, interleaved in the attention; GLM-MoE-DSA: interleaved in both,
# and its last two layers reuse the first's choice (indexer_types "shared").
DSA_TINY = dict(index_n_heads=8, index_head_dim=8, index_topk=5)
SPARSE_MLA_ARCHS = {
    "deepseek_v32": (DeepseekV32Config, {**MLA_MOE, **DSA_TINY, "first_k_dense_replace": 1}),
    "glm_moe_dsa": (GlmMoeDsaConfig, {**MLA_MOE, **DSA_TINY, "first_k_dense_replace": 1, "num_hidden_layers": 3,
                                      "indexer_types": ["full", "shared", "shared"]}),
    # HY-V4: its indexer rotates its heads' last dims and scales its head weights; its attention gates its output
    # and softmaxes with a sink logit a head; 3 hyper-connected residual streams; its second layer reuses the first's
    # choice; its eager attention (it takes no SDPA), whose softmax runs in the model's dtype.
    "hy_v4": (HYV4Config, {**MLA_MOE, **DSA_TINY, "hc_mult": 3, "indexer_types": ["full", "shared"],
                           "mlp_layer_types": ["dense", "sparse"], "attn_implementation": "eager"}),
}


def mla_config(arch, kwargs):
    config_class, extra = {**MLA_ARCHS, **SPARSE_MLA_ARCHS}[arch]
    return config_class(**{**kwargs, **MLA_TINY, **extra})


MODEL_CLASSES = {"llama": LlamaForCausalLM, "llama_tied": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM,
                 "gemma": GemmaForCausalLM, "gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM,
                 "gemma4": Gemma4ForCausalLM, "gemma4_moe": Gemma4ForCausalLM, "gemma4_shared_kv": Gemma4ForCausalLM,
                 "gemma4_layer_inputs": Gemma4ForCausalLM,
                 "vaultgemma": VaultGemmaForCausalLM, "hunyuan_v1_dense": HunYuanDenseV1ForCausalLM,
                 "hunyuan_v1_moe": HunYuanMoEV1ForCausalLM, "ernie4_5": Ernie4_5ForCausalLM,
                 "ernie4_5_moe": Ernie4_5_MoeForCausalLM, "helium": HeliumForCausalLM, "flint": FlintForCausalLM,
                 "ministral3": Ministral3ForCausalLM, "glm": GlmForCausalLM, "glm4": Glm4ForCausalLM,
                 "granitemoe": GraniteMoeForCausalLM, "cohere": CohereForCausalLM, "cohere2": Cohere2ForCausalLM,
                 "cohere2_moe": Cohere2MoeForCausalLM, "llama4": Llama4ForCausalLM, "phimoe": PhimoeForCausalLM,
                 "hyperclovax": HyperCLOVAXForCausalLM, "nemotron": NemotronForCausalLM, "jais2": Jais2ForCausalLM,
                 "mistral": MistralForCausalLM, "qwen3": Qwen3ForCausalLM, "mixtral": MixtralForCausalLM,
                 "qwen2_moe": Qwen2MoeForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "phi3": Phi3ForCausalLM,
                 "phi4_mini": Phi3ForCausalLM, "olmo2": Olmo2ForCausalLM, "olmo3": Olmo3ForCausalLM,
                 "glm4_moe": Glm4MoeForCausalLM, "olmoe": OlmoeForCausalLM, "minimax_m2": MiniMaxM2ForCausalLM,
                 "dots1": Dots1ForCausalLM, "mellum": MellumForCausalLM, "gpt_oss": GptOssForCausalLM,
                 "deepseek_v3": DeepseekV3ForCausalLM, "deepseek_v3_dense": DeepseekV3ForCausalLM,
                 "deepseek_v3_biased": DeepseekV3ForCausalLM,
                 "deepseek_v2_lite": DeepseekV2ForCausalLM, "glm4_moe_lite": Glm4MoeLiteForCausalLM,
                 "mistral4": Mistral4ForCausalLM, "youtu": YoutuForCausalLM, "deepseek_v32": DeepseekV32ForCausalLM,
                 "glm_moe_dsa": GlmMoeDsaForCausalLM, "hy_v4": HYV4ForCausalLM, "qwen3_next": Qwen3NextForCausalLM,
                 "qwen3_next_dense": Qwen3NextForCausalLM,
                 "qwen3_5": Qwen3_5ForCausalLM, "qwen3_5_moe": Qwen3_5MoeForCausalLM, "bamba": BambaForCausalLM,
                 "granitemoehybrid": GraniteMoeHybridForCausalLM, "granitemoehybrid_moe": GraniteMoeHybridForCausalLM,
                 "nemotron_h": NemotronHForCausalLM, "nemotron_h_dense": NemotronHForCausalLM,
                 "olmo_hybrid": OlmoHybridForCausalLM, "kimi_linear": KimiLinearForCausalLM, "lfm2": Lfm2ForCausalLM,
                 "lfm2_moe": Lfm2MoeForCausalLM, "lfm3": Lfm3ForCausalLM, "lfm2_biased": Lfm2ForCausalLM,
                 "jamba": JambaForCausalLM, "falcon_h1": FalconH1ForCausalLM, "falcon_h1_norm": FalconH1ForCausalLM}
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "minimax_m2", "gpt_oss")
# Those whose checkpoints hold one tensor per expert (transformers' conversion mapping): GPT-OSS's hold them fused.
PER_EXPERT_FILE_ARCHS = tuple(arch for arch in MOE_ARCHS if arch != "gpt_oss")


# Gated DeltaNet hybrids as Hugging Face initialises them (std 0.05) for float32 training runs, but their decay
# rates A from U(0.2, 1) (HF's: U(0, 16), A_log = log A): under the tests' N(0, 0.3) some tokens reach the rule's
# l2 norm with near-zero queries, and float32 training follows float64 only to ~1e-2 after 3 Adam steps at every
# seed tried (one process as TSP); with HF's decays the state forgets nearly all of it at each token, and the
# gradients of A_log, dt_bias and in_proj_a are float32 noise (1e-4 of their size), which Adam's moments magnify.
# With these, float32 gradients are within 2e-6 of float64's, tensor by tensor.
HF_INIT = {"qwen3_5_hf_init": ("qwen3_5", 0.05, (0.2, 1.0))}


def tiny_model(arch, seed=0, dtype=torch.float64, **overrides):
    torch.manual_seed(seed)
    if arch in HF_INIT:
        base, std, decay_rates = HF_INIT[arch]
        model = MODEL_CLASSES[base](tiny_config(base, initializer_range=std, **overrides))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("A_log"):
                    param.copy_(torch.empty_like(param).uniform_(*decay_rates).log())
                elif name.endswith("norm.weight"):  # off HF's zeros ((1 + w) norms): Adam's first steps on a
                    param.add_(0.1 * torch.randn_like(param))  # zero tensor compare mostly rounding
        return model.to(dtype)
    model = MODEL_CLASSES[arch](tiny_config(arch, **overrides))
    widen_float32_casts(sys.modules[type(model).__module__])
    model = model.to(dtype)
    with torch.no_grad():
        # Larger than HF's 0.02 init so attention patterns and biases matter,
        # and norm weights away from 1 so a dropped norm would show.
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.2) if "norm" in name else param.normal_(0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # a router's, so that it moves the routing
                buffer.normal_(0, 0.3)
            if name.endswith("layer_scalar"):  # Gemma 4's, off 1 so that a dropped one would show
                buffer.normal_(1.0, 0.2)
    return model


def num_experts(config):
    """``E`` under whichever name the config keeps it."""
    return next(getattr(config, key) for key in ("num_local_experts", "num_experts", "n_routed_experts")
                if getattr(config, key, None))


# ---------------------------------------------- every causal LM transformers ships

def causal_lm_types():
    """``(model_type, class name)`` of every causal LM the installed transformers maps."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [(model_type, names if isinstance(names, str) else names[0])
            for model_type, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()]


# Tiny sizes only; every other attribute keeps its config class's default.
TINY_SIZES = dict(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=4, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, attn_implementation="sdpa",
                  experts_implementation="eager")  # MoE models: grouped_mm takes no float64


# Where TINY_SIZES make a class's own forward degenerate, or leave it large: StableLM rotates
# partial_rotary_factor (0.25) of each head, one dim of a 4-wide head, on which Hugging Face's forward widens the
# head to 5; 8-wide heads rotate 2.
# Gemma 3's causal LM is its vision-language model, whose composite config takes tiny sizes in its parts: the
# decoder's TINY_SIZES, a SigLIP tower of one block over 8 x 8 images pooled to 16 tokens, the image
# placeholders at the top of the vocabulary (the scan's text-only rows may hold them: no image replaces them).
# Mamba-2 mixers whose default heads (128 of 64) are not the tiny inner width (2 x 16): 8 heads of 4, 2 groups of state
# 4, 8-token SSM chunks; the hybrids' layer patterns at two or three layers.
MAMBA2_TINY_TYPES = dict(mamba_n_heads=8, mamba_d_head=4, mamba_n_groups=2, mamba_d_state=4, mamba_chunk_size=8)
TINY_TYPE_SIZES = {"stablelm": dict(hidden_size=32),
                   "bamba": MAMBA2_TINY_TYPES, "granitemoehybrid": MAMBA2_TINY_TYPES,
                   "mamba2": dict(num_heads=8, head_dim=4, n_groups=2, state_size=4, chunk_size=8, expand=2),
                   "zamba2": dict(n_mamba_heads=8, mamba_headdim=4, mamba_ngroups=2, mamba_d_state=4, chunk_size=8,
                                  layers_block_type=["mamba", "hybrid"]),
                   # Zamba's shared transformer is tied across its hybrid layers: two of them, a Mamba layer between.
                   "zamba": dict(layers_block_type=["hybrid", "mamba", "hybrid"], num_hidden_layers=3, mamba_dt_rank=4,
                                 attn_layer_period=2, attn_layer_offset=0),
                   "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
                   # Gemma 4's full layers (512-wide heads by default) and per-layer embedding (262,144 rows of 256
                   # a layer by default) at tiny sizes too.
                   "gemma4_text": dict(global_head_dim=8, hidden_size_per_layer_input=4, vocab_size_per_layer_input=61),
                   "gemma3": dict(text_config={**{k: v for k, v in TINY_SIZES.items() if "implementation" not in k},
                                               "model_type": "gemma3_text"},
                                  vision_config=dict(model_type="siglip_vision_model", hidden_size=16,
                                                     intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                     image_size=8, patch_size=2, vision_use_head=False),
                                  mm_tokens_per_image=16, image_token_id=60, boi_token_id=58, eoi_token_id=59)}

# A mixture of experts at tiny sizes too: each attribute its config has (under its name or an alias) is set.
TINY_MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=8, shared_expert_intermediate_size=8, n_shared_experts=1)


def tiny_causal_lm(model_type, seed=0, dtype=torch.float64, device=None, requested=None, **overrides):
    """The causal LM of ``model_type`` on a tiny config, initialised as
    ``tiny_model``, with the ``requested`` attention implementation (default: the first
    of SDPA, eager_wide_softmax and eager that the class takes)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    # float64 SDPA is exact; HF's eager softmaxes in float32, eager_wide_softmax in float64 (for
    # the classes without SDPA; a few build their own attention and take eager only).
    for attention in (requested,) if requested else ("sdpa", "eager_wide_softmax", "eager"):
        # Some constructors print their config when they fail.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            config = CONFIG_MAPPING[model_type](**{**TINY_SIZES, **TINY_TYPE_SIZES.get(model_type, {}),
                                                   "attn_implementation": attention, **overrides})
            for key, value in TINY_MOE.items():
                if hasattr(config, key) and key not in overrides:
                    setattr(config, key, value)
            if getattr(config, "kv_lora_rank", None):  # latent attention: every head its own key/value head,
                # the rotary tables as wide as the rotary key
                for key, value in (("num_key_value_heads", config.num_attention_heads),
                                   ("head_dim", config.qk_rope_head_dim)):
                    if key not in overrides:
                        setattr(config, key, value)
            torch.manual_seed(seed)
            try:
                with torch.device(device or "cpu"):
                    model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
                break
            except (ValueError, KeyError) as error:
                unsupported = isinstance(error, KeyError) or "does not support an attention implementation" in str(
                    error)
                if attention in ("eager", requested) or not unsupported:
                    raise
    if device == "meta":
        return model
    widen_float32_casts(sys.modules[type(model).__module__])
    model = model.to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.2) if "norm" in name else param.normal_(0, 0.3)
    return model


def routes_in_float32(model):
    """Whether a float64 ``model``'s mixture-of-experts routers compute their
    logits in float32: DeepSeek-V3-style routers (GLM-4.5, EXAONE-MoE) do
    whatever the model's dtype, and a float32 matmul rounds a row
    differently with its place in the batch (measured: one token of
    EXAONE-MoE's block moves by 7e-8 when a padding row is inserted before it),
    so Hugging Face's own output for a token is float32-exact only, and so is
    any sharded run against it."""
    for block in model.modules():
        router = next((getattr(block, name) for name in ("gate", "router") if hasattr(block, name)), None)
        down = getattr(getattr(block, "experts", None), "down_proj", None)
        if router is None or not isinstance(down, torch.nn.Parameter) or down.dim() != 3:
            continue
        from ds_tsp.blocks.moe.experts import flags_of
        from ds_tsp.blocks.moe.plan import router_inputs

        hidden = down.shape[2 if flags_of(block.experts)["is_transposed"] else 1]
        with torch.no_grad():
            routed = router(torch.zeros(1, hidden, dtype=down.dtype, device=down.device),
                            *(getattr(block, name) for name in router_inputs(block, router)))
        if routed[0].dtype == torch.float32 and down.dtype == torch.float64:
            return True
    return False


# ------------------------------------------------ look-alikes of Llama's layer

class LookAlikeDecoderLayer(LlamaDecoderLayer):
    """Llama's layer under another name, as a remote-code model would ship it."""


class ClampedDecoderLayer(LlamaDecoderLayer):
    """Llama's layer, shape and all, but its forward clamps the output."""

    def forward(self, hidden_states, *args, **kwargs):
        return super().forward(hidden_states, *args, **kwargs).clamp(-1.0, 1.0)


class ScaledLogitsForCausalLM(LlamaForCausalLM):
    """Llama, but its forward scales the logits outside the decoder layers."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out


def look_alike(layer_class, model_class=LlamaForCausalLM, seed=0, **overrides):
    """``tiny_model("llama")`` with every decoder layer (and the model) re-classed."""
    model = tiny_model("llama", seed=seed, **overrides)
    model.__class__ = model_class
    for layer in model.model.layers:
        layer.__class__ = layer_class
    return model


def chat_tokenizer():
    """examples/chat.py's byte-level tokenizer with a ChatML-like template, built in code."""
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    if examples not in sys.path:  # chat.py imports its neighbour train.py as the examples do
        sys.path.append(examples)
    from chat import byte_chat_tokenizer

    return byte_chat_tokenizer()
