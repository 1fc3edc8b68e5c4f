"""What the planner knows of a model and a run: the decoder's sizes
(``ModelShape``, from a preset or a Hugging Face config, mixture-of-experts
models included), the bytes of each number (``Precision``), the run's options
(``Setting``), and how TSP cuts a model (which sizes it refuses, each rank's
attention shard, the folded vocabulary's rows and logits tiles). Imports no
torch."""

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ds_tsp.planning.anatomy import layer_anatomy
from ds_tsp.planning.recurrent import GatedDeltaNet, KimiDeltaAttention, Mamba1, Mamba2, ShortConvolution

GB = 1e9
FLOAT32 = 4
INT64 = 8

PRESETS = {
    # The paper's "7B dense": 32 layers, hidden 4096.
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, head_dim=128, vocab_size=32000, tie_word_embeddings=False),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    # ALST's model (DESIGN.md 9): the shape of Llama-3-8B; only its RoPE scaling differs, which costs no memory.
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    # GLM-4-32B-0414 (its Hugging Face config), 32.6B parameters: 61 layers, 48 query and 2 key/value heads of 128,
    # half of each head rotary on interleaved pairs, gate and up fused in gate_up_proj, sandwich norms.
    "glm-4-32b": dict(model_type="glm4", hidden_size=6144, intermediate_size=23040, num_hidden_layers=61,
                      num_attention_heads=48, num_key_value_heads=2, head_dim=128, partial_rotary_factor=0.5,
                      vocab_size=151552, tie_word_embeddings=False),
    # Gemma 4 31B's text decoder, the largest dense one (its configs, several readers agreeing): 50 sliding layers
    # of 16 key/value heads of 256 (window 1024) and 10 full ones of 4 key/value heads of 512 whose keys are
    # their values, a tied head soft-capped at 30.
    "gemma-4-31b": dict(model_type="gemma4_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
                        num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512,
                        num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024,
                        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10, vocab_size=262144,
                        tie_word_embeddings=True, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
                        num_kv_shared_layers=0),
    # Gemma 4 26B-A4B's: 30 layers (5 full), each a dense MLP of 2112 beside 128 experts of 704 (top-8).
    "gemma-4-26b-a4b": dict(model_type="gemma4_text", hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                            num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=1024,
                            layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5, vocab_size=262144,
                            tie_word_embeddings=True, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
                            num_kv_shared_layers=0, enable_moe_block=True, num_experts=128, top_k_experts=8,
                            moe_intermediate_size=704),
    # Command A's shape (Cohere2, 111B: two readers of its config agreeing): attention and MLP side by side off one
    # layer norm, three sliding layers (window 4096) to one full layer without positions, logits times 0.25.
    "command-a": dict(model_type="cohere2", hidden_size=12288, intermediate_size=36864, num_hidden_layers=64,
                      num_attention_heads=96, num_key_value_heads=8, head_dim=128, sliding_window=4096,
                      layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 16, vocab_size=256000,
                      tie_word_embeddings=True, logit_scale=0.25),
    # Mixture of experts, as their Hugging Face configs give them: 30.5B parameters, 3.3B active per token.
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # 46.7B parameters, 12.9B active per token.
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                         tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2),
    # 106B parameters, 12B active per token: a dense first layer, 128 sigmoid-routed experts and one shared.
    "glm-4.5-air": dict(model_type="glm4_moe", hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
                        num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=151552,
                        tie_word_embeddings=False, attention_bias=True, n_routed_experts=128, num_experts_per_tok=8,
                        moe_intermediate_size=1408, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True),
    # 116.8B parameters, 5.1B active per token as its model card counts (the LM head, not the embedding):
    # 128 biased experts, attention sinks, sliding and full layers.
    "gpt-oss-120b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                         tie_word_embeddings=False, attention_bias=True, num_local_experts=128, num_experts_per_tok=4,
                         sliding_window=128),
    # 235.1B parameters, 22.2B active per token: 128 experts of 1536 (top-8), no shared expert, in all 94 layers
    # (no layer uses its intermediate_size), 64 query and 4 key/value heads of 128 with Qwen3's q/k norms.
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                            tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=1536, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # 671B parameters, 37B active per token: multi-head latent attention (kv_lora_rank 512 and a 64-wide rotary key,
    # 128 heads of 192 / 128 once expanded), 3 dense layers, then 256 routed experts (top-8) and one shared.
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, vocab_size=129280,
                        tie_word_embeddings=False, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
                        moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3, norm_topk_prob=True),
    # DeepSeek-V3.2: DeepSeek-V3's shape with a lightning indexer in every layer (64 heads of 128, the first 64 dims
    # rotated), each query attending to its top 2048 keys (DeepSeek's sparse attention).
    "deepseek-v3.2": dict(model_type="deepseek_v32", hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                          num_attention_heads=128, num_key_value_heads=128, vocab_size=129280,
                          tie_word_embeddings=False, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                          qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
                          moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3,
                          norm_topk_prob=True, index_n_heads=64, index_head_dim=128, index_topk=2048),
    # About 1T parameters, 32B active per token: DeepSeek-V3's architecture with 64 heads, 384 experts, one dense layer.
    "kimi-k2": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                    num_attention_heads=64, num_key_value_heads=64, vocab_size=163840, tie_word_embeddings=False,
                    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    n_routed_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                    first_k_dense_replace=1, norm_topk_prob=True),
    # 107.8B parameters (the text model), 17.2B active per token: 16 experts, top-1, and a shared expert in every
    # layer. ds_tsp's policy refuses Llama 4 today (docs/limitations.md); the planner shows what TSP would hold.
    "llama-4-scout": dict(model_type="llama4_text", hidden_size=5120, intermediate_size=8192,
                          intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40,
                          num_key_value_heads=8, head_dim=128, vocab_size=202048, tie_word_embeddings=False,
                          num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1),
    # Gated DeltaNet hybrids (DESIGN.md 6j): three linear-attention layers, then one gated full-attention layer.
    # Qwen3-Next-80B-A3B: 79.67B parameters, 3.87B active per token; 512 experts of 512 (top-10) and a gated shared
    # expert in every layer (no layer uses its intermediate_size), linear layers of 16 key and 32 value heads of 128.
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", hidden_size=2048, intermediate_size=5120,
                               num_hidden_layers=48, full_attention_interval=4, num_attention_heads=16,
                               num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25, vocab_size=151936,
                               tie_word_embeddings=False, linear_num_key_heads=16, linear_num_value_heads=32,
                               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                               num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
                               mlp_only_layers=[]),
    # Qwen3.5-27B's text model: 26.90B parameters, dense; linear layers of 16 key and 48 value heads of 128. Its
    # config.json's text_config as several public copies quote it (not read from the model's repository): the vision
    # tower and the multi-token-prediction layer are not counted.
    "qwen3.5-27b": dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        full_attention_interval=4, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                        partial_rotary_factor=0.25, vocab_size=248320, tie_word_embeddings=False,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4),
    # Qwen3.5-27B as the vision-language model it ships as: the text model above and its vision tower, a
    # Qwen3-VL-style tower of 27 blocks, 1152 wide (4304 MLP, 16 heads), 16 x 16 patches, 2 frames a temporal
    # patch, 2 x 2 patches merged into a token of 5120, no deepstack features: its config.json's vision_config as
    # public copies quote it (an MLX conversion's config.json with this text_config, a written review of the
    # model's config, and ports checking a checkpoint against depth 27 / 1152 / 4304 / out_hidden_size 5120), not
    # read from the model's repository.
    "qwen3.5-27b-vl": dict(model_type="qwen3_5", text_config=None,
                           vision_config=dict(model_type="qwen3_5", depth=27, hidden_size=1152,
                                              intermediate_size=4304, num_heads=16, patch_size=16,
                                              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=5120,
                                              num_position_embeddings=2304, deepstack_visual_indexes=[])),
    # Qwen3-VL-8B-Instruct: a Qwen3 decoder of 36 layers (4096 wide, 12288 MLP, 32 query and 8 key/value heads
    # of 128, q/k norms, vocabulary 151936, untied) and a tower of 27 blocks, 1152 wide (4304 MLP, 16 heads),
    # 16 x 16 patches, 2 frames a temporal patch, 2 x 2 patches merged into a token of 4096, deepstack features
    # of blocks 8, 16 and 24 added to the first decoder layers: its config.json as several public copies quote it
    # (TensorRT-LLM's Qwen3-VL-8B-Instruct test config, other ports' tests), not read from the model's repository.
    "qwen3-vl-8b": dict(model_type="qwen3_vl",
                        text_config=dict(model_type="qwen3_vl_text", hidden_size=4096, intermediate_size=12288,
                                         num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                         head_dim=128, vocab_size=151936, tie_word_embeddings=False),
                        vision_config=dict(model_type="qwen3_vl", depth=27, hidden_size=1152,
                                           intermediate_size=4304, num_heads=16, patch_size=16,
                                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=4096,
                                           num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24]),
                        tie_word_embeddings=False),
    # Qwen3.5-397B-A17B's text model: 396.35B parameters, 17.35B active per token; 512 experts of 1024 (top-10) and
    # a gated shared expert of 1024 in every layer, linear layers of 16 key and 64 value heads of 128. Its
    # config.json's text_config as public code quotes it (THUDM/slime's scripts/models/qwen3.5-397B-A17B.sh,
    # mlx-community's model card): the vision tower and the multi-token-prediction layer are not counted.
    "qwen3.5-397b-a17b": dict(model_type="qwen3_5_moe_text", hidden_size=4096, num_hidden_layers=60,
                              full_attention_interval=4, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
                              partial_rotary_factor=0.25, vocab_size=248320, tie_word_embeddings=False,
                              linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
                              linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
                              num_experts_per_tok=10, moe_intermediate_size=1024,
                              shared_expert_intermediate_size=1024),
    # Mamba-2 and KDA hybrids (DESIGN.md 6n). Nemotron-H-8B's shape (its released config): 52 layers of one block,
    # 24 Mamba-2 mixers (128 heads of 64, 8 groups of state 128), 4 NoPE attention layers (32 query and 8
    # key/value heads of 128) and 24 ungated relu2 MLPs of 21504; 8.1B parameters.
    "nemotron-h-8b": dict(model_type="nemotron_h", hidden_size=4096, intermediate_size=21504, num_hidden_layers=52,
                          hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072,
                          tie_word_embeddings=False, mamba_num_heads=128, mamba_head_dim=64, n_groups=8,
                          ssm_state_size=128, conv_kernel=4, chunk_size=128, use_conv_bias=True, use_bias=False,
                          mlp_bias=False),
    # Granite-4.0-H-Small's (its released config): 40 layers, 36 Mamba-2 mixers (128 heads of 64, one group of
    # state 128) and 4 NoPE attention layers, each beside 72 experts of 768 (top-10) and a shared MLP of 1536;
    # 32.2B parameters, 8.8B active per token.
    "granite-4.0-h-small": dict(model_type="granitemoehybrid", hidden_size=4096, intermediate_size=768,
                                shared_intermediate_size=1536, num_hidden_layers=40, num_attention_heads=32,
                                num_key_value_heads=8, vocab_size=100352, tie_word_embeddings=True,
                                num_local_experts=72, num_experts_per_tok=10,
                                layer_types=(["mamba"] * 5 + ["attention"] + ["mamba"] * 4) * 4, mamba_n_heads=128,
                                mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4,
                                mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
                                position_embedding_type="nope"),
    # Kimi-Linear-48B-A3B's, as transformers' KimiLinearConfig gives it: 27 layers, 21 KDA (32 heads of 128) and
    # 6 multi-head latent attention layers without rotary positions, 256 experts of 1024 (top-8) and a shared one
    # after a dense first layer of 9216; 49.1B parameters, 3.5B active per token (the embedding's included).
    "kimi-linear-48b-a3b": dict(model_type="kimi_linear", hidden_size=2304, intermediate_size=9216,
                                num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32,
                                layer_types=["linear_attention"] * 4 + (["full_attention"] + ["linear_attention"] * 3)
                                * 5 + ["full_attention", "linear_attention", "linear_attention"],
                                vocab_size=163840, tie_word_embeddings=False, kv_lora_rank=512, q_lora_rank=None,
                                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, linear_num_heads=32,
                                linear_head_dim=128, linear_conv_kernel_dim=4, num_experts=256,
                                num_experts_per_token=8, moe_intermediate_size=1024, num_shared_experts=1,
                                first_k_dense_replace=1, moe_renormalize=True),
}
# The Qwen3.5-27B vision-language model's decoder is the text preset's.
PRESETS["qwen3.5-27b-vl"]["text_config"] = PRESETS["qwen3.5-27b"]

# How TSP attention gets its backward: "fused" saves each head group's output
# and log-sum-exp and runs the fused backward (every backend of
# ds_tsp.blocks.attention.kernels for full causal attention: torch's flash ops on CPU
# and CUDA fp16/bf16, cuDNN, flash-attn); "recompute" saves q, k, v only and
# runs the attention forward again under autograd (fp32 on CUDA, sliding windows).
TSP_ATTENTION_BACKWARDS = ("fused", "recompute")

# ``tsp.logits_tile_mib``: the largest fp32 logits tile of the fused LM head + loss.
DEFAULT_LOGITS_TILE_MIB = 32.0

# ``tsp.token_tile``'s default in the runtime: the most local tokens one MLP
# ring step or one attention query tile processes at once (0: no tiling).
DEFAULT_TOKEN_TILE = 8192

# Ranks that share one host's memory (pinned checkpoints, offloaded optimizer).
DEFAULT_DEVICES_PER_NODE = 8


# Model types whose q/k norms span the whole projection (ds_tsp.blocks.rotary.ProjectionNormPiece).
PROJECTION_QK_NORMS = ("olmo2", "olmo3", "olmoe", "flex_olmo", "minimax_m2")

@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder LM that the cost model needs (Hugging Face names).

    A mixture-of-experts model (Mixtral, Qwen2/3-MoE, OLMoE, GLM-4.5) has
    ``moe_layers`` sparse layers, each a router (``E x H``, replicated), ``E``
    routed experts of ``expert_size`` (gated MLPs, no biases) of which every
    token uses ``experts_per_token`` (``k``), and optionally a shared expert of
    ``shared_expert_size``, with its sigmoid gate (``1 x H``, replicated:
    Qwen2-MoE) or without (GLM-4.5, ``shared_expert_gate`` False); its
    other ``num_layers - moe_layers`` layers have a dense MLP of
    ``intermediate_size``. Per-layer sizes take ``sparse``: which kind of layer.
    A Gated DeltaNet hybrid's layers differ in their token mixer too, attention
    or linear attention (``mixer_kinds``), independently: what depends on the
    mixer takes ``linear``.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2); sharded with their heads
    mlp_bias: bool = False  # gate/up biases sharded, down bias replicated
    mlp_gated: bool = True  # down(act(gate(x)) * up(x)); False: down(act(up(x))) (Nemotron's, Jais-2's)
    norms_per_layer: int = 2  # each layer's norms of H, replicated (Gemma-2's and GLM-4's sandwich: 4; Cohere's 1)
    norm_bias: bool = False  # layer norms with biases (Nemotron's, Jais-2's), the final norm's too
    sliding_window: int | None = None
    name: str = "custom"
    qk_norm: bool = False  # q/k RMSNorm weights, replicated: per head (Qwen3) or ...
    qk_norm_spans_projection: bool = False  # ... over the whole projection (OLMo-2/3: one more round of shards)
    num_experts: int = 0  # E; 0: a dense model
    experts_per_token: int = 0  # k, the router's top-k
    expert_size: int = 0  # F of one routed expert
    shared_expert_size: int = 0  # Qwen2-MoE's, GLM-4.5's shared expert, 0 where there is none
    shared_expert_gate: bool = True  # the shared expert's output times sigmoid of a 1 x H gate (Qwen2-MoE)
    moe_layers: int = 0
    renormalise_top_k: bool = False  # the top-k weights divided by their sum (Mixtral; Qwen's norm_topk_prob)
    router_weights_fp32: bool = False  # the routing weights stay float32 (Mixtral); else the model dtype
    output_router_logits: bool = False  # the load-balancing loss is computed (the config's output_router_logits)
    expert_bias: bool = False  # the experts' gate/up and down biases (GPT-OSS): 2 F_e + H more per expert
    router_bias: bool = False  # the router's bias (GPT-OSS), replicated
    attention_sinks: bool = False  # a sink logit per query head (GPT-OSS), sharded with the heads
    o_proj_bias: bool = False  # o_proj's bias (Llama's and GPT-OSS's attention_bias), replicated
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Mistral 4; kv_lora_rank 0: none). Its heads are
    # num_kv_heads = num_heads of head_dim = qk_nope_head_dim + qk_rope_head_dim once expanded (the baselines'
    # per-head K/V; values are v_head_dim). q_lora_rank 0: queries straight from the hidden states.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek's sparse attention (DeepSeek-V3.2, GLM-MoE-DSA; index_heads 0: none): a latent attention whose
    # lightning indexer (index_heads heads of index_head_dim, from the query latent and the hidden states) chooses
    # each query's index_topk keys; shared_index_layers of the layers reuse an earlier layer's choice (no indexer).
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    shared_index_layers: int = 0
    # Hybrids of recurrent layers (DESIGN.md 6j, 6n): linear_layers of the num_layers mix tokens by the recurrent
    # mixer ``recurrent`` (a ds_tsp.planning.recurrent class: Gated DeltaNet, KDA, Mamba-2, Mamba-1, LFM's short
    # convolution); the others attend.
    linear_layers: int = 0
    recurrent: GatedDeltaNet | KimiDeltaAttention | Mamba2 | Mamba1 | ShortConvolution | None = None
    # Layers of one block (Nemotron-H's), each with its own norms: a token mixer alone, or a feed-forward block alone.
    mixer_only_layers: int = 0
    ffn_only_layers: int = 0
    # Gemma 4's full-attention layers: global_layers of the num_layers attend with heads of their own size
    # (global_head_dim, global_num_kv_heads), their keys their values where global_values_from_keys (no v_proj);
    # mixer_view gives their shape.
    global_layers: int = 0
    global_head_dim: int = 0
    global_num_kv_heads: int = 0
    global_values_from_keys: bool = False
    values_from_keys: bool = False  # the attention's keys (before their norm) are its values: no v_proj
    router_scales: bool = False  # the router scales its input per channel and its weights per expert (Gemma 4's)
    attention_output_gate: bool = False  # q_proj yields each head's query and output gate: 2 * head_dim rows a head
    partial_rotary_factor: float = 1.0  # the share of a head that rotates: cos/sin are that wide (0: NoPE)
    norm_in_float32: bool = False  # RMSNorms scale by 1 + w in float32 (Qwen3-Next's, Qwen3.5's), in float32 out
    norm_weight_in_float32: bool = False  # RMSNorms scale by w in float32, cast back (Nemotron-H's)

    @property
    def is_hybrid(self):
        return self.linear_layers > 0

    @property
    def one_block_layers(self):
        """Every layer a token mixer or a feed-forward block, each with its own ``norms_per_layer`` norms."""
        return self.mixer_only_layers + self.ffn_only_layers == self.num_layers

    @property
    def mixer_kinds(self):
        """``((kind, count), ...)``: how many layers mix tokens by each kind of token mixer, none empty:
        "attention", "global_attention" (Gemma 4's full layers, heads of their own size),
        "shared_index_attention" (a sparse attention reusing an earlier layer's choice) and "linear" (the
        recurrent mixer). ``mixer_view`` gives a kind's shape and whether it is linear."""
        kinds = (("attention", self.num_layers - self.linear_layers - self.global_layers - self.ffn_only_layers
                  - self.shared_index_layers), ("global_attention", self.global_layers),
                 ("shared_index_attention", self.shared_index_layers), ("linear", self.linear_layers))
        return tuple((kind, count) for kind, count in kinds if count)

    @property
    def mixer_groups(self):
        """``((shape, linear, count), ...)``: each kind of token mixer as ``mixer_view`` gives it, and its count."""
        return tuple((*self.mixer_view(kind), count) for kind, count in self.mixer_kinds)

    def mixer_view(self, kind):
        """``(shape, linear)`` of a kind of token mixer (``mixer_kinds``): the shape its per-layer sizes are read
        from (this one, or for Gemma 4's full layers this one with their head sizes), and whether it is the
        recurrent mixer."""
        if kind == "shared_index_attention":  # attends to an earlier layer's choice: no indexer of its own
            return dataclasses.replace(self, index_heads=0, index_head_dim=0, shared_index_layers=0), False
        if kind == "global_attention":
            return dataclasses.replace(self, head_dim=self.global_head_dim, num_kv_heads=self.global_num_kv_heads,
                                       values_from_keys=self.global_values_from_keys, sliding_window=None,
                                       global_layers=0), False
        return self, kind == "linear"

    def mixer_params(self, linear=False):
        """The token mixer's split weights: ``attention_params`` or the recurrent mixer's."""
        return self.recurrent.params if linear else self.attention_params

    @property
    def rotary_dim(self):
        """The rotated dims of a head: the width of the cos/sin tables."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_width(self):
        """Rows of ``q_proj`` a query head has: its query, and its output gate where there is one."""
        return 2 * self.head_dim if self.attention_output_gate else self.head_dim

    @property
    def is_latent(self):
        return self.kv_lora_rank > 0

    @property
    def value_dim(self):
        """A value head's size: ``head_dim``, or a latent attention's ``v_head_dim``."""
        return self.v_head_dim or self.head_dim

    @property
    def latent_width(self):
        """Elements of one token's latent and rotary key: what TSP gathers along the sequence."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def latent_down_rows(self):
        """The down projections' output rows, each cut over the TSP group: ``q_a_proj``'s (if any), then
        ``kv_a_proj_with_mqa``'s."""
        return tuple(rows for rows in (self.q_lora_rank, self.latent_width) if rows)

    def indexer_rows(self):
        """The lightning indexer's split projections, ``(rows, inputs)`` each, their rows cut over the TSP group:
        ``wq_b`` (from the query latent) and ``wk`` (from the hidden states); none without an indexer."""
        if not self.index_heads:
            return ()
        return ((self.index_heads * self.index_head_dim, self.q_lora_rank), (self.index_head_dim, self.hidden_size))

    @property
    def indexer_params(self):
        """The lightning indexer's split weights (``indexer_rows``); it takes no gradient."""
        return sum(rows * inputs for rows, inputs in self.indexer_rows())

    def latent_head_params(self, heads):
        """Elements of ``heads`` query heads' rows of the up projections and ``o_proj`` columns."""
        q_input = self.q_lora_rank or self.hidden_size
        return heads * (self.head_dim * q_input + (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank
                        + self.v_head_dim * self.hidden_size)

    @property
    def is_moe(self):
        return self.moe_layers > 0

    @property
    def layer_kinds(self):
        """``((sparse, count), ...)``: how many layers of each kind, dense first, none empty."""
        kinds = ((False, self.num_layers - self.moe_layers - self.mixer_only_layers), (True, self.moe_layers))
        return tuple((sparse, count) for sparse, count in kinds if count)

    @property
    def attention_params(self):
        """``Wa``: q, k, v, o projections (and q/k/v biases, and the sinks: one per query head); a latent
        attention's down projections (and their biases), up projections and ``o_proj``."""
        if self.is_latent:
            down = sum(self.latent_down_rows()) * (self.hidden_size + int(self.attention_bias))
            return down + self.latent_head_params(self.num_heads) + self.indexer_params
        H, d, nq, nkv = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
        rows = nq * self.q_width + self.kv_projections * nkv * d
        return H * rows + nq * d * H + (rows if self.attention_bias else 0) + (nq if self.attention_sinks else 0)

    @property
    def kv_projections(self):
        """The key and value projections an attention holds: 2, or 1 where its keys are its values."""
        return 1 if self.values_from_keys else 2

    @property
    def mlp_params(self):
        """``Wm``: gate, up, down (and gate/up biases) of a dense layer's MLP."""
        H, F = self.hidden_size, self.intermediate_size
        inputs = 2 if self.mlp_gated else 1  # gate and up, or up alone
        return (inputs + 1) * H * F + (inputs * F if self.mlp_bias else 0)

    @property
    def expert_params(self):
        """One routed expert: gate, up, down of ``expert_size`` (and their biases)."""
        bias = 2 * self.expert_size + self.hidden_size if self.expert_bias else 0
        return 3 * self.hidden_size * self.expert_size + bias

    @property
    def shared_expert_params(self):
        return 3 * self.hidden_size * self.shared_expert_size

    @property
    def router_params(self):
        """A sparse layer's replicated routing: the router (and its bias) and the shared expert's gate."""
        return self.num_experts * (self.hidden_size + int(self.router_bias)) + \
            (self.hidden_size if self.gated_shared_expert else 0)

    @property
    def gated_shared_expert(self):
        return bool(self.shared_expert_size) and self.shared_expert_gate

    def ffn_params(self, sparse=False):
        """The feed-forward block's parameters that TSP (and TP) shard: ``Wm``, or
        ``E`` experts and the shared expert (``Wx = 3H (E F_e + F_s)``)."""
        return self.num_experts * self.expert_params + self.shared_expert_params if sparse else self.mlp_params

    def active_ffn_params(self, sparse=False):
        """The sharded feed-forward parameters one token multiplies by: ``k``
        experts and the shared expert, in a sparse layer (its routing is in
        ``layer_replicated_params``)."""
        if not sparse:
            return self.mlp_params
        return self.experts_per_token * self.expert_params + self.shared_expert_params

    def layer_replicated_params(self, sparse=False, linear=False):
        """Per layer, what no strategy shards: two RMSNorm weights, Qwen3's q/k
        norms (a Gated DeltaNet's gated norm), and the dense MLP's down bias or the sparse layer's routing."""
        return sum(self.replicated_tensors(sparse, linear))

    def replicated_tensors(self, sparse=False, linear=False):
        """Sizes of the tensors of one layer that every TSP rank holds whole, in
        elements, one entry a tensor (ds_tsp sums each one's gradient over the group)."""
        return self.ffn_replicated_tensors(sparse) + self.mixer_replicated_tensors(linear)

    def mixer_replicated_tensors(self, linear=False, untrained=True):
        """The token mixer's whole tensors: an attention's q/k norms (a latent attention's latents' norms, and
        its lightning indexer's key norm and head weights unless ``untrained`` is False: they take no gradient)
        and ``o_proj``'s bias, or the recurrent mixer's (``replicated_tensors``); in a layer of one block, its
        norms."""
        norms = self.norm_tensors * self.norms_per_layer if self.one_block_layers else []
        if linear:
            return norms + self.recurrent.replicated_tensors
        if self.is_latent:  # and a lightning indexer's key norm (weight, bias) and head weights
            qk_norms = [rows for rows in (self.q_lora_rank, self.kv_lora_rank) if rows]
            if self.index_heads and untrained:
                qk_norms += [self.index_head_dim] * 2 + [self.index_heads * self.hidden_size]
        elif self.qk_norm_spans_projection:
            qk_norms = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim]
        else:
            qk_norms = [self.head_dim] * 2 if self.qk_norm else []
        return norms + qk_norms + ([self.hidden_size] if self.o_proj_bias else [])

    def ffn_replicated_tensors(self, sparse=False):
        """The rest of a layer's whole tensors: its norms (and their biases), and the dense MLP's down bias or the
        sparse layer's router (and its bias) and shared-expert gate."""
        H = self.hidden_size
        norms = self.norm_tensors * self.norms_per_layer
        if sparse:
            return norms + [self.num_experts * H] + ([self.num_experts] if self.router_bias else []) + \
                ([H] if self.gated_shared_expert else []) + ([H, self.num_experts] if self.router_scales else [])
        return norms + ([H] if self.mlp_bias else [])

    @property
    def norm_tensors(self):
        """One norm's tensors: its weight, and its bias where the norms have one."""
        return [self.hidden_size] * (2 if self.norm_bias else 1)

    @property
    def embedding_params(self):
        """Embedding and LM head (one matrix when tied), plus the final norm."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + sum(self.norm_tensors)

    def _layers_sum(self, ffn):
        mixers = sum(count * (view.mixer_params(linear) + sum(view.mixer_replicated_tensors(linear)))
                     for view, linear, count in self.mixer_groups)
        return mixers + sum(count * (ffn(sparse) + sum(self.ffn_replicated_tensors(sparse)))
                            for sparse, count in self.layer_kinds)

    @property
    def params(self):
        """Every parameter (Hugging Face's ``sum(p.numel())``)."""
        return self._layers_sum(self.ffn_params) + self.embedding_params

    @property
    def active_params(self):
        """The parameters one token uses: ``params`` less the routed experts it
        skips (``E - k`` per sparse layer); ``params`` for a dense model."""
        return self._layers_sum(self.active_ffn_params) + self.embedding_params

    @property
    def routed_expert_params(self):
        """Every routed expert of every sparse layer (the shared experts not included)."""
        return self.moe_layers * self.num_experts * self.expert_params


@dataclass(frozen=True)
class Precision:
    element: int  # activations, weights moved, K/V
    accumulate: int  # fp32 sums: TSP gradient reduces and ring accumulators, log-probs
    weight: int  # bytes per parameter
    grad: int
    optimizer: int  # fp32 master weights and Adam's two moments (fp32 runs: the moments only)


PRECISIONS = {
    "bf16": Precision(element=2, accumulate=4, weight=2, grad=2, optimizer=12),
    "fp16": Precision(element=2, accumulate=4, weight=2, grad=2, optimizer=12),
    "fp32": Precision(element=4, accumulate=4, weight=4, grad=4, optimizer=8),
}


@dataclass(frozen=True)
class Setting:
    model: ModelShape
    seq_len: int
    micro_batch: int
    devices: int
    dtype: str
    zero_stage: int
    activation_checkpointing: bool
    tsp_attention_backward: str  # "fused" or "recompute", see TSP_ATTENTION_BACKWARDS
    logits_tile_mib: float = DEFAULT_LOGITS_TILE_MIB  # tsp.logits_tile_mib, for the folded vocabulary
    token_tile: int = 0  # tsp.token_tile (0: no tiling), TSP layers only
    fp32_accumulators: bool = True  # tsp.fp32_accumulators
    recompute_norms: bool = False  # tsp.recompute_norms
    offload_activations: bool = False  # activation_checkpointing.cpu_checkpointing: checkpoints in host memory
    prefetch_checkpoints: bool = False  # tsp.prefetch_checkpoints: the next offloaded input back early (TSP only)
    offload_optimizer: bool = False  # zero_optimization.offload_optimizer.device "cpu"
    devices_per_node: int = DEFAULT_DEVICES_PER_NODE
    lora_rank: int = 0  # LoRA adapters of this rank on lora_targets, the base frozen (0: full fine-tuning)
    lora_targets: tuple = ()
    # The TSP rows' layout: a TSP group of tsp_size (None: every device) and devices / tsp_size data-parallel
    # replicas; each sparse layer's experts over expert_parallel_size consecutive ranks (None: the TSP group).
    tsp_size: int | None = None
    expert_parallel_size: int | None = None
    moe_schedule: str = "ring"  # tsp.moe_schedule of the TSP rows: "ring", "all_to_all" or "auto"
    # A vision-language model's visual tokens: its tower (visual.VisionShape; None: the text decoder alone),
    # visual_tokens of each sequence's seq_len placeholders, frame_tokens of them a frame (an image).
    vision: object = None
    visual_tokens: int = 0
    frame_tokens: int = 0

    @property
    def precision(self):
        return PRECISIONS[self.dtype]

    @property
    def patches(self):
        """The tower's patches in one micro-batch: its visual tokens' merged patches."""
        return self.micro_batch * self.visual_tokens * self.vision.patches_per_token if self.vision else 0

    @property
    def tsp_group_size(self):
        """``D``: the TSP rows' group, every device unless ``tsp_size`` says fewer."""
        return self.tsp_size or self.devices

    @property
    def tsp_replicas(self):
        """``dp``: the data-parallel replicas of the TSP rows, ``devices / D``."""
        return self.devices // self.tsp_group_size

    @property
    def expert_group_size(self):
        """``ep``: the ranks splitting a sparse layer's experts, ``D`` unless ``expert_parallel_size`` folds
        replicas in."""
        return self.expert_parallel_size or self.tsp_group_size

    @property
    def expert_replicas(self):
        """The expert-data-parallel group's size, ``dp * D / ep``: ranks holding the same experts."""
        return self.devices // self.expert_group_size

    @property
    def ranks_per_node(self):
        return min(self.devices, self.devices_per_node)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
                "kv_a_proj_with_mqa", "kv_b_proj")
# Which projections split by output rows under TSP and TP (their lora_B splits, lora_A is whole).
LORA_ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                  "kv_b_proj")


def lora_adapter_params(m, rank, targets, shards, sparse=False):
    """Parameters of one layer's LoRA adapters that one of ``shards`` ranks
    holds (TSP's and TP's split: the factor on the split side by ``shards``,
    the other whole); a sparse layer's MLP takes none (ds_tsp refuses them),
    but the dense MLP beside Gemma 4's experts (its planned shared expert)
    does. ``m``: the layer's mixer's shape (``ModelShape.mixer_view``); keys
    used as values have no ``v_proj`` to adapt."""
    H, d = m.hidden_size, m.head_dim
    F = m.shared_expert_size if sparse and m.router_scales else m.intermediate_size
    sparse = sparse and not m.router_scales
    sizes = {"q_proj": (H, m.num_heads * d), "k_proj": (H, m.num_kv_heads * d),
             "v_proj": (H, 0 if m.values_from_keys else m.num_kv_heads * d),
             "o_proj": (m.num_heads * m.value_dim, H), "gate_proj": (H, F), "up_proj": (H, F), "down_proj": (F, H)}
    if m.is_latent:  # a latent attention's projections (a query latent or q_proj)
        sizes.update({"q_a_proj": (H, m.q_lora_rank), "q_b_proj": (m.q_lora_rank, m.num_heads * d),
                      "kv_a_proj_with_mqa": (H, m.latent_width),
                      "kv_b_proj": (m.kv_lora_rank, m.num_heads * (m.qk_nope_head_dim + m.v_head_dim))})
    total = 0
    for name in targets:
        if sparse and name in ("gate_proj", "up_proj", "down_proj"):
            continue
        if name not in sizes or not all(sizes[name]):  # not in this model (k_proj of a latent attention, ...)
            continue
        fan_in, fan_out = sizes[name]
        total += rank * (fan_in + fan_out / shards) if name in LORA_ROW_SPLIT else rank * (fan_in / shards + fan_out)
    return total


def model_fields(model):
    """The config's fields ``model_shape`` reads (a preset's, a config's); ``{}`` for a ``ModelShape``."""
    return {} if isinstance(model, ModelShape) else _shape_fields(model)


def _shape_fields(model):
    if isinstance(model, str):
        if model in PRESETS:
            return {**PRESETS[model], "name": model}
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a Hugging Face "
                             f"config directory or JSON file")
        fields = json.loads(path.read_text())
        fields.setdefault("name", path.parent.name if path.name == "config.json" else path.stem)
        return fields
    if isinstance(model, Mapping):
        return dict(model)
    if hasattr(model, "to_dict"):  # a transformers PretrainedConfig
        fields = model.to_dict()
        fields.setdefault("name", getattr(model, "name_or_path", "") or getattr(model, "model_type", "custom"))
        return fields
    raise TypeError(f"model must be a preset name, a config path, a dict or a Hugging Face config, not {type(model)}")


# Gemma 4's text decoder: full layers with heads of their own size (global_attention_fields), its mixture of
# experts beside every layer's dense MLP (planned as an ungated shared expert of intermediate_size: the same
# weights, ring and bytes), a router scaling its input and its weights per expert.
GEMMA4_MODEL_TYPES = ("gemma4_text",)
# Mixture-of-experts model types the planner knows (ds_tsp.injection.policy runs them and others of their
# kind), and the keys by which other MoE configs are recognised and refused.
MOE_MODEL_TYPES = ("mixtral", "minimax_m2", "gpt_oss", "qwen2_moe", "qwen3_moe", "olmoe", "flex_olmo", "glm4_moe",
                   "llama4_text", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "mistral4", "qwen3_next",
                   "qwen3_5_moe_text", "phimoe", "granitemoe", "hunyuan_v1_moe", "cohere2_moe", "ernie4_5_moe",
                   "deepseek_v32", "glm_moe_dsa", *GEMMA4_MODEL_TYPES)
# Mixtral's kind: num_local_experts of intermediate_size in every layer, no shared expert.
MIXTRAL_KIND = ("mixtral", "minimax_m2", "gpt_oss", "phimoe", "granitemoe")
# Qwen's kind: experts of moe_intermediate_size, sparse layers by decoder_sparse_step and mlp_only_layers, a shared
# expert with its sigmoid gate.
QWEN_MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text")
# Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5 and Qwen3.5-MoE, whose multimodal configs nest these as text_config):
# layer_types, or every full_attention_interval-th layer attention and the others linear; their attention gated by
# q_proj's second half, with per-head q/k norms; their RMSNorms Gemma's, 1 + w in float32.
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")  # the last: ERNIE 4.5's
# DeepSeek-V3's kind (GLM-4.5, GLM-4.7-Flash, DeepSeek-V2, Mistral 4 and Kimi-K2, whose model_type is DeepSeek-V3's;
# DeepSeek-V3.2 and GLM-MoE-DSA, the same with sparse attention):
# group-limited routers (sigmoid or softmax) computing in float32 but Mistral 4's, the first layers dense, an
# ungated shared expert of n_shared_experts routed experts' size, no load-balancing loss in Hugging Face's forward.
DEEPSEEK_V3_KIND = ("glm4_moe", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "mistral4", "deepseek_v32",
                    "glm_moe_dsa")
# o_proj takes the attention_bias too (Llama's, GPT-OSS's), not only q/k/v.
O_PROJ_BIAS_MODEL_TYPES = ("llama", "gpt_oss")


def _lfm2_mlp_size(fields):
    """LFM2's MLP width: ``intermediate_size``, with ``block_auto_adjust_ff_dim`` two thirds of it times
    ``block_ffn_dim_multiplier`` rounded up to ``block_multiple_of`` (``Lfm2MLP``'s rule)."""
    size = fields["intermediate_size"]
    if fields.get("block_auto_adjust_ff_dim"):
        size = int(2 * size / 3)
        if fields.get("block_ffn_dim_multiplier") is not None:
            multiple = fields.get("block_multiple_of") or 1
            size = multiple * -(-int(fields["block_ffn_dim_multiplier"] * size) // multiple)
    return size


def _recurrent_hybrid_moe_fields(fields, experts):
    """Granite-4.0-H's experts (of ``intermediate_size``, beside the shared MLP, every layer), Kimi Linear's
    (sigmoid-routed after a dense prefix, an ungated shared expert), Jamba's (of ``intermediate_size``, every
    ``expert_layer_period``-th layer from ``expert_layer_offset``, the top-k weights not renormalised) or
    LFM2-MoE's (sigmoid-routed after ``num_dense_layers``)."""
    model_type, layers = fields["model_type"], fields["num_hidden_layers"]
    if model_type == "jamba":
        period, offset = fields["expert_layer_period"], fields["expert_layer_offset"]
        return dict(num_experts=experts["num_experts"], experts_per_token=fields["num_experts_per_tok"],
                    expert_size=fields["intermediate_size"],
                    moe_layers=sum(i % period == offset for i in range(layers)),
                    output_router_logits=bool(fields.get("output_router_logits")))
    if model_type == "lfm2_moe":
        return dict(num_experts=experts["num_experts"], experts_per_token=fields["num_experts_per_tok"],
                    expert_size=fields["moe_intermediate_size"],
                    moe_layers=layers - (fields.get("num_dense_layers") or 0),
                    renormalise_top_k=bool(fields.get("norm_topk_prob")), router_weights_fp32=True)
    if model_type == "granitemoehybrid":
        return dict(num_experts=experts["num_local_experts"], experts_per_token=fields["num_experts_per_tok"],
                    expert_size=fields["intermediate_size"],
                    shared_expert_size=fields.get("shared_intermediate_size") or 0, shared_expert_gate=False,
                    moe_layers=fields["num_hidden_layers"], renormalise_top_k=True,
                    output_router_logits=bool(fields.get("output_router_logits")))
    first_dense = fields.get("first_k_dense_replace") or 0
    types = fields.get("mlp_layer_types") or ["dense" if i < first_dense else "sparse" for i in range(layers)]
    size = fields["moe_intermediate_size"]
    return dict(num_experts=experts["num_experts"],
                experts_per_token=fields.get("num_experts_per_token") or fields["num_experts_per_tok"],
                expert_size=size, shared_expert_size=size * (fields.get("num_shared_experts") or 0),
                shared_expert_gate=False, moe_layers=types.count("sparse"),
                renormalise_top_k=bool(fields.get("moe_renormalize", True)), router_weights_fp32=True)


def _moe_fields(fields):
    """The ``ModelShape`` fields of a mixture-of-experts config: Mixtral and
    MiniMax-M2 (``num_local_experts``, every layer sparse, experts of
    ``intermediate_size``, top-k always renormalised, routing weights kept
    float32; MiniMax-M2's score-correction bias is a buffer), Qwen2/3-MoE and
    OLMoE (``num_experts``, experts of ``moe_intermediate_size`` or
    ``intermediate_size``, layer ``i`` sparse unless in ``mlp_only_layers`` or
    off ``decoder_sparse_step``, ``norm_topk_prob``, Qwen2-MoE's gated
    ``shared_expert_intermediate_size``) or GLM-4.5 (``n_routed_experts``,
    layers from ``first_k_dense_replace`` on sparse, an ungated shared expert);
    ``{}`` for a dense config. Other MoE configs are refused."""
    experts = {key: fields[key] for key in MOE_KEYS if (fields.get(key) or 0) > 0}
    model_type = fields.get("model_type")
    if model_type == "granitemoehybrid" and not experts:  # the dense Granite-4.0-H: its shared MLP alone
        return dict(dense_size=fields["shared_intermediate_size"])
    if model_type == "lfm2":  # its MLP's width, as Lfm2MLP adjusts it
        return dict(dense_size=_lfm2_mlp_size(fields))
    if not experts or model_type == "nemotron_h":  # Nemotron-H's MoE layers are refused with its layer pattern
        return {}
    if model_type in ("granitemoehybrid", "kimi_linear", "jamba", "lfm2_moe"):
        return _recurrent_hybrid_moe_fields(fields, experts)
    if model_type in GEMMA4_MODEL_TYPES:  # num_experts is read only with enable_moe_block
        if not fields.get("enable_moe_block"):
            return {}
        return dict(num_experts=experts["num_experts"], experts_per_token=fields["top_k_experts"],
                    expert_size=fields["moe_intermediate_size"], shared_expert_size=fields["intermediate_size"],
                    shared_expert_gate=False, moe_layers=fields["num_hidden_layers"], renormalise_top_k=True,
                    router_weights_fp32=True, router_scales=True)
    if model_type == "hunyuan_v1_moe":  # experts of intermediate_size beside a shared MLP of it, every layer
        top_k = fields["moe_topk"]
        if isinstance(top_k, list) and len(set(top_k)) > 1:
            raise ValueError(f"model config has moe_topk = {top_k}: the planner models one top-k for every layer")
        return dict(num_experts=experts["num_experts"], experts_per_token=top_k[0] if isinstance(top_k, list)
                    else top_k, expert_size=fields["intermediate_size"], shared_expert_size=fields["intermediate_size"],
                    shared_expert_gate=False, moe_layers=fields["num_hidden_layers"], renormalise_top_k=True)
    if model_type == "cohere2_moe":  # the dense prefix (mlp_layer_types) of prefix_dense_intermediate_size
        types = fields.get("mlp_layer_types") or ["dense" if i < (fields.get("first_k_dense_replace") or 0)
                                                  else "sparse" for i in range(fields["num_hidden_layers"])]
        return dict(num_experts=experts["num_experts"], experts_per_token=fields["num_experts_per_tok"],
                    expert_size=fields["intermediate_size"],
                    shared_expert_size=fields["intermediate_size"] * (fields.get("num_shared_experts") or 0),
                    shared_expert_gate=False, moe_layers=types.count("sparse"),
                    renormalise_top_k=bool(fields.get("norm_topk_prob")),
                    dense_size=fields.get("prefix_dense_intermediate_size") or fields["intermediate_size"])
    if model_type == "ernie4_5_moe":  # sparse from moe_layer_start_index to moe_layer_end_index, every interval
        layers = fields["num_hidden_layers"]
        end = fields.get("moe_layer_end_index", -1)
        end = layers - 1 if end == -1 else end
        sparse = [i for i in range(layers) if (i + 1) % (fields.get("moe_layer_interval") or 1) == 0
                  and fields.get("moe_layer_start_index", 1) <= i <= end]
        return dict(num_experts=experts["moe_num_experts"], experts_per_token=fields["moe_k"],
                    expert_size=fields["moe_intermediate_size"],
                    shared_expert_size=fields["moe_intermediate_size"] * (fields.get("moe_num_shared_experts") or 0),
                    shared_expert_gate=False, moe_layers=len(sparse), renormalise_top_k=True,
                    output_router_logits=bool(fields.get("output_router_logits")))
    if model_type not in (None, *MOE_MODEL_TYPES) or (model_type is None and "n_routed_experts" in experts):
        key, value = next(iter(experts.items()))
        raise ValueError(f"model config has {key} = {value} (model_type {model_type!r}): the planner models the "
                         f"mixture-of-experts layers of {', '.join(MOE_MODEL_TYPES)} only")
    qwen = "moe_intermediate_size" in fields if model_type is None else model_type in QWEN_MOE_MODEL_TYPES
    mixtral = not qwen and ("num_local_experts" in experts if model_type is None else model_type in MIXTRAL_KIND)
    num_experts = experts.get("n_routed_experts") or experts.get("num_experts") or experts.get("num_local_experts")
    layers = fields["num_hidden_layers"]
    if model_type == "llama4_text":  # sparse layers listed (or every interleave_moe_layer_step-th), experts and an
        # ungated shared expert of intermediate_size (dense layers: intermediate_size_mlp), a sigmoid top-k router
        step = fields.get("interleave_moe_layer_step") or 1
        sparse = fields.get("moe_layers") or [i for i in range(layers) if (i + 1) % step == 0]
        return dict(num_experts=num_experts, experts_per_token=fields["num_experts_per_tok"],
                    expert_size=fields["intermediate_size"], shared_expert_size=fields["intermediate_size"],
                    shared_expert_gate=False, moe_layers=len(sparse),
                    output_router_logits=bool(fields.get("output_router_logits")))
    if model_type in DEEPSEEK_V3_KIND:
        return dict(num_experts=num_experts, experts_per_token=fields["num_experts_per_tok"],
                    expert_size=fields["moe_intermediate_size"],
                    shared_expert_size=fields["moe_intermediate_size"] * (fields.get("n_shared_experts") or 0),
                    shared_expert_gate=False, moe_layers=layers - (fields.get("first_k_dense_replace") or 0),
                    renormalise_top_k=bool(fields.get("norm_topk_prob")), router_weights_fp32=model_type != "mistral4")
    if mixtral:  # GPT-OSS: biased experts and router, its softmax over the top-k in the model's dtype
        gpt_oss = model_type == "gpt_oss"
        return dict(num_experts=num_experts, experts_per_token=fields["num_experts_per_tok"],
                    expert_size=fields["intermediate_size"], moe_layers=layers, renormalise_top_k=True,
                    router_weights_fp32=not gpt_oss, output_router_logits=bool(fields.get("output_router_logits")),
                    expert_bias=gpt_oss, router_bias=gpt_oss)
    step, dense = fields.get("decoder_sparse_step") or 1, set(fields.get("mlp_only_layers") or ())
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    return dict(num_experts=num_experts, experts_per_token=fields["num_experts_per_tok"],
                expert_size=fields["moe_intermediate_size" if qwen else "intermediate_size"],
                shared_expert_size=fields.get("shared_expert_intermediate_size") or 0, moe_layers=len(sparse),
                # Qwen3.5-MoE's router always renormalises (its config has no norm_topk_prob)
                renormalise_top_k=bool(fields.get("norm_topk_prob", model_type == "qwen3_5_moe_text")),
                output_router_logits=bool(fields.get("output_router_logits")))


def _latent_fields(fields):
    """A multi-head latent attention's sizes (``ModelShape``'s), its heads as they are expanded; none without one."""
    if not fields.get("kv_lora_rank"):
        return {}
    nope, rope = fields["qk_nope_head_dim"], fields["qk_rope_head_dim"]
    indexer = {}
    if "indexed_attention" in (fields.get("layer_types") or ()) or fields.get("index_topk"):
        # DeepSeek's sparse attention: every layer's own indexer, but where indexer_types says "shared".
        indexer = dict(index_heads=fields["index_n_heads"], index_head_dim=fields["index_head_dim"],
                       index_topk=fields["index_topk"],
                       shared_index_layers=list(fields.get("indexer_types") or ()).count("shared"))
    return dict(kv_lora_rank=fields["kv_lora_rank"], q_lora_rank=fields.get("q_lora_rank") or 0,
                qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=fields["v_head_dim"],
                num_kv_heads=fields["num_attention_heads"], head_dim=nope + rope, **indexer)


# Layer types, as the configs spell them, whose token mixer is recurrent, attends, or whose layer holds a
# feed-forward block alone (Nemotron-H's "mlp" and "moe"; its pattern's "M", "*", "-" and "E").
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "M", "conv")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention", "*",
                         "indexed_attention")
FFN_ONLY_LAYER_TYPES = ("mlp", "moe", "-", "E")
# Model types whose recurrent layers the planner models, by kind: Gated DeltaNet (HYBRID_MODEL_TYPES), Kimi
# Linear's KDA, Mamba-2, Jamba's Mamba-1, LFM2's short convolutions.
MAMBA2_MODEL_TYPES = ("nemotron_h", "granitemoehybrid", "bamba")
SHORT_CONV_MODEL_TYPES = ("lfm2", "lfm2_moe")
PLANNED_RECURRENT_MODEL_TYPES = (*HYBRID_MODEL_TYPES, "kimi_linear", *MAMBA2_MODEL_TYPES, "jamba",
                                 *SHORT_CONV_MODEL_TYPES)
# Config fields that declare a recurrent token mixer: Mamba-2's and Mamba-1's (mamba_*, Nemotron-H's
# ssm_state_size) and LFM's short convolutions (conv_L_cache).
RECURRENT_MIXER_FIELDS = ("mamba_", "ssm_state_size", "conv_L_cache")


# Recurrent hybrids whose released checkpoints' configs name or leave out what transformers' config class fills in:
# Kimi Linear's linear_attn_config (1-based layer lists) and first dense layer, LFM2's block_ff_dim, tie_embedding
# and full_attn_idxs, Jamba's layer periods and offsets, Nemotron-H's hybrid_override_pattern.
CHECKPOINT_NAMED_TYPES = ("kimi_linear", "lfm2", "lfm2_moe", "jamba", "nemotron_h")


def _as_transformers_reads_it(fields):
    """``fields`` as transformers' config class for their model type reads them (its defaults filled in)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(**{k: v for k, v in fields.items() if k not in ("name", "architectures")})
    except Exception as error:  # noqa: BLE001 - transformers' own validation, named in the refusal
        raise ValueError(f"model config ({fields['model_type']}) is refused by transformers' config class: "
                         f"{error}") from None
    return {**config.to_dict(), "name": fields.get("name", "custom")}


def _layer_types(fields):
    """The config's kind of each layer (``layer_types``, ``layers_block_type``, Nemotron-H's
    ``hybrid_override_pattern``, Bamba's ``attn_layer_indices``), or None where it names none."""
    model_type, layers = fields.get("model_type"), fields.get("num_hidden_layers")
    if model_type == "nemotron_h" and isinstance(fields.get("hybrid_override_pattern"), str):
        return list(fields["hybrid_override_pattern"])
    for key in ("layer_types", "layers_block_type"):
        if isinstance(fields.get(key), (list, tuple)):
            return list(fields[key])
    if model_type == "bamba":
        return ["attention" if i in (fields.get("attn_layer_indices") or ()) else "mamba" for i in range(layers)]
    if model_type == "jamba":
        period, offset = fields["attn_layer_period"], fields["attn_layer_offset"]  # as transformers fills them
        return ["attention" if i % period == offset else "mamba" for i in range(layers)]
    if model_type in HYBRID_MODEL_TYPES:  # as their configs fill it in
        interval = fields.get("full_attention_interval") or 4
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    return None


def _recurrent_fields(fields):
    """A hybrid's recurrent mixer and its layer pattern (``ModelShape``'s ``linear_layers``, ``recurrent``,
    ``mixer_only_layers``, ``ffn_only_layers``): Qwen3-Next's and Qwen3.5's Gated DeltaNet, Kimi Linear's KDA,
    the Mamba-2 of Nemotron-H (layers of one block), Granite-4.0-H and Bamba; none for a model without
    recurrent layers. Other recurrent mixers (Mamba-1, short convolutions, Falcon-H1's side mixers) are
    refused by name, rather than planned as attention layers alone."""
    model_type = fields.get("model_type")
    types = _layer_types(fields) or []
    unknown = sorted({kind for kind in types if isinstance(kind, str)} - {
        *RECURRENT_LAYER_TYPES, *ATTENTION_LAYER_TYPES, *FFN_ONLY_LAYER_TYPES})
    declared = sorted(key for key in fields if key.startswith(RECURRENT_MIXER_FIELDS))
    linear = sum(kind in RECURRENT_LAYER_TYPES for kind in types)
    if model_type not in PLANNED_RECURRENT_MODEL_TYPES and (unknown or declared or linear):
        recurrent = sorted({kind for kind in types if kind in RECURRENT_LAYER_TYPES})
        what = f"{unknown} layers" if unknown else f"{linear} recurrent layers ({', '.join(recurrent)})" \
            if linear else f"recurrent mixers ({', '.join(declared[:3])})"
        raise ValueError(f"model config has {what} (model_type {model_type!r}): the planner models the recurrent "
                         f"layers of {', '.join(PLANNED_RECURRENT_MODEL_TYPES)} only, not yet OLMo-Hybrid's "
                         "DeltaNet, LFM3's or Falcon-H1's layers (ds_tsp trains them); plan one of those of the "
                         "same sizes")
    if not linear:
        return {}
    if model_type == "nemotron_h" and ("E" in types or "moe" in types):
        raise ValueError("model config has Nemotron-H mixture-of-experts layers (layers_block_type 'moe'): the "
                         "planner does not model their ungated experts yet (ds_tsp trains them); plan the dense "
                         "Nemotron-H")
    pattern = dict(linear_layers=linear)
    if model_type == "nemotron_h":
        if all(kind not in FFN_ONLY_LAYER_TYPES for kind in types):
            raise ValueError(f"model config's layers_block_type {types} holds no 'mlp' layer: the planner models "
                             "Nemotron-H patterns of token mixers and MLPs both (every released one)")
        pattern.update(mixer_only_layers=sum(kind not in FFN_ONLY_LAYER_TYPES for kind in types),
                       ffn_only_layers=sum(kind in FFN_ONLY_LAYER_TYPES for kind in types), mlp_gated=False,
                       norms_per_layer=1, norm_weight_in_float32=True)
    return {**pattern, **_recurrent_mixer(fields)}


def _recurrent_mixer(fields):
    """``{"recurrent": mixer, ...}``: the recurrent mixer a planned hybrid's config describes, and what its
    model type implies of the rest (Qwen's gated attention and float32 norms)."""
    model_type, H = fields["model_type"], fields["hidden_size"]
    if model_type in HYBRID_MODEL_TYPES:
        return dict(recurrent=GatedDeltaNet(H, fields["linear_num_key_heads"], fields["linear_num_value_heads"],
                                            fields["linear_key_head_dim"], fields["linear_value_head_dim"],
                                            fields.get("linear_conv_kernel_dim") or 4),
                    attention_output_gate=True, norm_in_float32=True)
    if model_type == "kimi_linear":  # transformers' names, else the released config's linear_attn_config
        kda = fields.get("linear_attn_config") or {}
        return dict(recurrent=KimiDeltaAttention.of(
            H, fields.get("linear_num_heads") or kda["num_heads"], fields.get("linear_head_dim") or kda["head_dim"],
            fields.get("linear_conv_kernel_dim") or kda.get("short_conv_kernel_size") or 4))
    if model_type == "nemotron_h":
        return dict(recurrent=Mamba2(H, fields["mamba_num_heads"], fields["mamba_head_dim"], fields["n_groups"],
                                     fields["ssm_state_size"], fields["conv_kernel"], fields.get("chunk_size") or 128,
                                     conv_bias=bool(fields.get("use_conv_bias", True)),
                                     proj_bias=bool(fields.get("use_bias", False))))
    if model_type == "jamba":
        dt_rank = fields.get("mamba_dt_rank") or "auto"
        return dict(recurrent=Mamba1(H, (fields.get("mamba_expand") or 2) * H, fields.get("mamba_d_state") or 16,
                                     -(-H // 16) if dt_rank == "auto" else dt_rank, fields.get("mamba_d_conv") or 4,
                                     conv_bias=bool(fields.get("mamba_conv_bias", True)),
                                     proj_bias=bool(fields.get("mamba_proj_bias", False))))
    if model_type in SHORT_CONV_MODEL_TYPES:
        return dict(recurrent=ShortConvolution(H, fields.get("conv_L_cache") or 3, bool(fields.get("conv_bias"))))
    # Granite-4.0-H's and Bamba's mamba_* fields
    heads = fields.get("mamba_n_heads") or 128
    return dict(recurrent=Mamba2(H, heads, fields.get("mamba_d_head") or (fields.get("mamba_expand") or 2) * H // heads,
                                 fields.get("mamba_n_groups") or 1, fields.get("mamba_d_state") or 256,
                                 fields.get("mamba_d_conv") or 4, fields.get("mamba_chunk_size") or 256,
                                 conv_bias=bool(fields.get("mamba_conv_bias", True)),
                                 proj_bias=bool(fields.get("mamba_proj_bias", False))))


def _global_attention_fields(fields):
    """Gemma 4's full layers' sizes (``ModelShape``'s ``global_*``): their head size and key/value heads, from
    transformers' ``per_layer_config`` or the released configs' ``global_head_dim`` and
    ``num_global_key_value_heads`` (the latter taken only with ``attention_k_eq_v``, as transformers reads it);
    none for other models. Per-layer inputs and shared keys and values are refused: not planned yet."""
    if fields.get("model_type") not in GEMMA4_MODEL_TYPES:
        return {}
    for key in ("hidden_size_per_layer_input", "num_kv_shared_layers"):
        if fields.get(key):
            raise ValueError(f"model config has {key} = {fields[key]}: the planner does not model Gemma 4's "
                             "per-layer inputs or its keys and values shared across layers yet (ds_tsp trains "
                             "them); plan a shape without them, as Gemma 4's 31B and 26B-A4B")
    layers = fields["num_hidden_layers"]
    types = fields.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 or i == layers - 1
                                          else "sliding_attention" for i in range(layers)]
    full = [index for index, kind in enumerate(types) if kind == "full_attention"]
    overrides = {int(index): dict(sizes) for index, sizes in (fields.get("per_layer_config") or {}).items()}
    if overrides:
        if sorted(overrides) != full or len({tuple(sorted(sizes.items())) for sizes in overrides.values()}) > 1:
            raise ValueError(f"model config's per_layer_config {fields['per_layer_config']} is not one set of "
                             "sizes for every full_attention layer: the planner models Gemma 4's layout only")
        sizes = overrides[full[0]]
    else:
        sizes = {"head_dim": fields.get("global_head_dim") or fields["head_dim"]}
        if fields.get("attention_k_eq_v") and fields.get("num_global_key_value_heads"):
            sizes["num_key_value_heads"] = fields["num_global_key_value_heads"]
    return dict(global_layers=len(full), global_head_dim=sizes.get("head_dim", fields["head_dim"]),
                global_num_kv_heads=sizes.get("num_key_value_heads", fields["num_key_value_heads"]),
                global_values_from_keys=bool(fields.get("attention_k_eq_v")))


# Models whose attention has no rotary embedding (NoPE): Nemotron-H's, Kimi Linear's latent attention, Jamba's;
# Granite-4.0-H's where its position_embedding_type is "nope".
NOPE_MODEL_TYPES = ("nemotron_h", "kimi_linear", "jamba")


def _partial_rotary_factor(fields):
    """The rotated share of a head, where the config names one (top level or in ``rope_parameters``); 0 for an
    attention without positions (``NOPE_MODEL_TYPES``)."""
    if fields.get("model_type") in NOPE_MODEL_TYPES or fields.get("position_embedding_type") == "nope":
        return 0.0
    rope = fields.get("rope_parameters") if isinstance(fields.get("rope_parameters"), dict) else {}
    return fields.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0


def _attention_bias(fields):
    """q/k/v biases: ``attention_bias``, else ``qkv_bias`` (Qwen2-MoE in transformers 5),
    else Qwen2's and Qwen2-MoE's (which always had them)."""
    for key in ("attention_bias", "qkv_bias"):
        if fields.get(key) is not None:
            return bool(fields[key])
    return fields.get("model_type") in ("qwen2", "qwen2_moe")


def model_shape(model):
    """``ModelShape`` from a preset name, a Hugging Face config (object, dict,
    directory or JSON file) or a ``ModelShape``."""
    if isinstance(model, ModelShape):
        return model
    fields = _shape_fields(model)
    decoder_fields = fields
    if isinstance(fields.get("text_config"), dict):  # multimodal configs nest the decoder's
        fields, decoder_fields = {**fields, **fields["text_config"]}, fields["text_config"]
    if fields.get("model_type") in CHECKPOINT_NAMED_TYPES:
        fields = _as_transformers_reads_it(fields)
    if fields.get("model_type") == "nemotron_h" and "num_hidden_layers" not in fields:  # transformers' config
        fields = {**fields, "num_hidden_layers": len(_layer_types(fields) or ())}
    try:
        heads = fields["num_attention_heads"]
        llama4 = fields.get("model_type") == "llama4_text"  # its dense layers' MLP: intermediate_size_mlp
        recurrent = _recurrent_fields(fields)  # first: an unplanned recurrent mixer is named before its experts
        latent, moe = _latent_fields(fields), _moe_fields(fields)
        # Qwen3.5-MoE's config has no intermediate_size: every layer is sparse
        every_layer_sparse = moe.get("moe_layers") == fields["num_hidden_layers"]
        dense_size = moe.pop("dense_size", None)  # a dense layer's MLP of another size (Cohere2-MoE's prefix)
        shape = ModelShape(
            hidden_size=fields["hidden_size"],
            intermediate_size=dense_size or ((fields.get("intermediate_size") or 0) if every_layer_sparse and not llama4
                                             else fields["intermediate_size_mlp" if llama4 else "intermediate_size"]),
            num_layers=fields["num_hidden_layers"], num_heads=heads,
            num_kv_heads=latent.get("num_kv_heads") or fields.get("num_key_value_heads") or heads,
            head_dim=latent.get("head_dim") or fields.get("head_dim") or fields["hidden_size"] // heads,
            vocab_size=fields["vocab_size"],
            tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(fields), mlp_bias=bool(fields.get("mlp_bias", False)),
            sliding_window=fields.get("sliding_window") if fields.get("use_sliding_window", True) else None,
            name=str(fields.get("name", "custom")),
            qk_norm=fields.get("model_type") in ("qwen3", "qwen3_moe", *HYBRID_MODEL_TYPES, *PROJECTION_QK_NORMS,
                                                 *SHORT_CONV_MODEL_TYPES,
                                                 *GEMMA4_MODEL_TYPES)
            or (bool(fields.get("use_qk_norm")) and not llama4),  # GLM-4.5's switch; Llama 4's norm has no weight
            qk_norm_spans_projection=fields.get("model_type") in PROJECTION_QK_NORMS,
            attention_sinks=fields.get("model_type") == "gpt_oss",
            # A latent attention's o_proj takes attention_bias as its down projections do (every MLA class).
            o_proj_bias=_attention_bias(fields) and (fields.get("model_type") in O_PROJ_BIAS_MODEL_TYPES
                                                     or bool(latent)),
            partial_rotary_factor=_partial_rotary_factor(fields), **moe, **recurrent,
            **_global_attention_fields(fields),
            **{k: v for k, v in latent.items() if k not in ("num_kv_heads", "head_dim")})
        # What the config does not say (norms, biases, an ungated MLP), read off Hugging Face's layer.
        return dataclasses.replace(shape, **layer_anatomy(decoder_fields))
    except KeyError as err:
        raise ValueError(f"model config has no {err.args[0]!r}: the planner needs hidden_size, intermediate_size, "
                         f"num_hidden_layers, num_attention_heads and vocab_size (for mixture-of-experts "
                         f"models, num_experts_per_tok and moe_intermediate_size; for Gated DeltaNet hybrids, "
                         f"linear_num_key_heads, linear_num_value_heads, linear_key_head_dim and "
                         f"linear_value_head_dim)") from None


# --- how TSP cuts a model ------------------------------------------------------------------------

def tsp_shape_problem(m, tsp_size):
    """Why TSP cannot run ``m`` at ``tsp_size`` (the rules of ``head_groups.HeadGroups``,
    ``linear.shards.DeltaNetShapes``, ``mlp.shard_spec`` and ``moe.shard_spec``), or None."""
    D, nq, nkv = tsp_size, m.num_heads, m.num_kv_heads
    if nq % D:
        return f"num_attention_heads {nq} is not divisible by {D}"
    if m.is_latent and min(m.latent_down_rows()) < D:
        return f"a latent down projection of {min(m.latent_down_rows())} rows cannot give each of {D} ranks a row"
    if m.index_heads and m.index_head_dim < D:
        return f"the indexer's key projection of {m.index_head_dim} rows cannot give each of {D} ranks a row"
    for kind, _ in m.mixer_kinds:  # each kind of attention layer its own key/value heads (Gemma 4's full layers)
        view, linear = m.mixer_view(kind)
        nkv, which = view.num_kv_heads, "" if kind == "attention" else f" of the {kind} layers"
        if linear:
            continue
        if nq % nkv:
            return f"num_attention_heads {nq} is not a multiple of num_key_value_heads {nkv}{which}"
        if (nkv >= D and nkv % D) or (nkv < D and D % nkv):
            return f"num_key_value_heads {nkv}{which} and {D} do not divide one another"
    problem = m.recurrent.shape_problem(D) if m.is_hybrid else None
    if problem:
        return problem
    if m.num_layers > m.moe_layers + m.mixer_only_layers and m.intermediate_size % D:
        return f"intermediate_size {m.intermediate_size} is not divisible by {D}"
    if m.is_moe and m.num_experts % D:
        return f"num_experts {m.num_experts} is not divisible by {D}: every rank holds E/D whole experts"
    if m.is_moe and m.shared_expert_size % D:
        return f"shared_expert_intermediate_size {m.shared_expert_size} is not divisible by {D}"
    return None


def expert_parallel_sizes(m, tsp_size, devices):
    """The sizes ``tsp.expert_parallel_size`` may take for ``m`` on ``devices`` ranks in TSP groups of
    ``tsp_size``: multiples of ``D`` dividing ``devices`` (``D x dp``) and, folded, the experts of a layer."""
    return [ep for ep in range(tsp_size, devices + 1, tsp_size)
            if devices % ep == 0 and (ep == tsp_size or m.is_moe and m.num_experts % ep == 0)]


def tsp_qk_rows(m, tsp_size, tsp_rank):
    """Elements of the q and k rows (weights and biases) of rank ``tsp_rank``'s
    attention shard: what the round of a projection norm's sums of squares
    reduces to it in backward."""
    D, d, H = tsp_size, m.head_dim, m.hidden_size
    bias = 1 if m.attention_bias else 0
    rows = m.num_heads // D * d
    if tsp_rank % max(D // m.num_kv_heads, 1) == 0:
        rows += max(m.num_kv_heads // D, 1) * d
    return rows * (H + bias)


def tsp_attention_shard(m, tsp_size, tsp_rank):
    """Elements of rank ``tsp_rank``'s packed attention shard: its query heads and
    ``o_proj`` columns, and the key/value heads where it is their holder; a latent
    attention's: its rows of the down projections and its head group."""
    D, d, H = tsp_size, m.head_dim, m.hidden_size
    if m.is_latent:
        rows = sum((tsp_rank + 1) * total // D - tsp_rank * total // D for total in m.latent_down_rows())
        return rows * (H + int(m.attention_bias)) + m.latent_head_params(m.num_heads // D) + \
            tsp_indexer_shard(m, D, tsp_rank)
    q_heads, kv_heads = m.num_heads // D, max(m.num_kv_heads // D, 1)
    bias = 1 if m.attention_bias else 0
    own = q_heads * (m.q_width * (H + bias) + d * H) + (q_heads if m.attention_sinks else 0)
    kv_replicas = max(D // m.num_kv_heads, 1)
    if tsp_rank % kv_replicas == 0:
        own += m.kv_projections * kv_heads * d * (H + bias)
    return own


def tsp_indexer_shard(m, tsp_size, tsp_rank):
    """Elements of rank ``tsp_rank``'s lightning indexer piece: its rows of ``wq_b`` and ``wk``."""
    D = tsp_size
    return sum(((tsp_rank + 1) * rows // D - tsp_rank * rows // D) * inputs for rows, inputs in m.indexer_rows())


def tsp_mixer_shard(m, tsp_size, linear=False):
    """Elements of the largest packed shard of a layer's token mixer: an attention's (``tsp_attention_shard``)
    or the recurrent mixer's ``1/D`` of its split weights (every rank's the same)."""
    if linear:
        return m.recurrent.params // tsp_size
    return max(tsp_attention_shard(m, tsp_size, r) for r in range(tsp_size))


def padded_length(seq_len, tsp_size):
    """``seq_len`` right-padded to ``2 * tsp_size`` zigzag chunks, as ``ds_tsp.parallel.layout``
    pads a batch (the planner imports no torch code, so it keeps its own copy; a test holds them equal)."""
    multiple = 2 * tsp_size
    return -(-seq_len // multiple) * multiple


def tsp_name(tsp_size, vocab_parallel=True, data_parallel=1, expert_parallel_size=None):
    """The plan's name: ``TSP(D)`` with the folded vocabulary (``tsp.vocab_parallel``,
    the default), ``TSP(D) replicated vocab`` without it; ``TSP(D) x DP(dp)``
    beside data-parallel replicas, ``, EP(ep)`` where the experts fold across them."""
    name = f"TSP({tsp_size})" + (f" x DP({data_parallel})" if data_parallel > 1 else "")
    if expert_parallel_size and expert_parallel_size > tsp_size:
        name += f", EP({expert_parallel_size})"
    return name + ("" if vocab_parallel else " replicated vocab")


def vocab_rows_per_rank(vocab_size, tsp_size):
    """``Vs = ceil(V/D)``: embedding (and LM head) rows per rank under the folded
    vocabulary; ``V`` is padded to ``D*Vs`` with rows no token uses."""
    return -(-vocab_size // tsp_size)


def logits_tile_tokens(vocab_rows, local_tokens, logits_tile_mib=DEFAULT_LOGITS_TILE_MIB):
    """Tokens in the largest logits tile of the fused LM head + loss: the most
    whose fp32 ``(tokens, Vs)`` logits fit ``logits_tile_mib`` (as
    ``vocab.tile_tokens`` rounds), at least 1, at most the local tokens."""
    return min(local_tokens, max(1, int(logits_tile_mib * 2**20) // (FLOAT32 * vocab_rows)))
