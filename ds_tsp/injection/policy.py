"""Which Hugging Face causal LMs ds_tsp can rewrite, and where their parts live.

One declarative table per architecture names its classes, its submodules and
the config attributes that change its forward, each with the values whose
forward the TSP model reproduces and why; how each projection's weight is
sharded is the table of the block that takes it (``head_groups.SHARD_DIMS``,
``mlp.SHARD_DIMS``), and where Hugging Face fuses several projections into one
tensor (Phi-3's ``qkv_proj``) the policy's ``fused`` table says which rows
hold which (``ds_tsp.blocks.fused``). The tables were written from an audit of the installed
transformers' forwards (CausalLM, Model, decoder layer, attention, MLP, norm,
rotary embedding); ``tests/test_policy.py`` runs every class transformers
ships through them.

The ``auto`` policy accepts any other decoder layer of the same shape; its
forward is then unknown, so its table refuses the known features Llama's
forward lacks and ``ds_tsp.injection.probe`` compares it numerically with the TSP layer
at injection. A model that does not fit is refused with the class, the
submodule or the config attribute at fault, before any weight moves: nothing
is ever converted approximately.
"""

import dataclasses
import inspect
import logging
import sys
from dataclasses import dataclass, field
from typing import Callable

from torch import nn
from transformers.activations import ACT2FN
from transformers.models.mixtral import modeling_mixtral

from ds_tsp.blocks.attention import module as attention
from ds_tsp.blocks.latent.module import is_latent_attention
from ds_tsp.blocks.linear.mamba2_module import (MAMBA2_MODULES, MAMBA2_SIZES, MAMBA2_TENSORS, has_gated_norm,
                                                is_mamba2)
from ds_tsp.blocks.linear.module import is_gated_delta_net, is_kda
from ds_tsp.blocks.linear.module import norm_name as linear_norm_name
from ds_tsp.blocks.linear.mamba1 import MAMBA1_MODULES, MAMBA1_NORMS, MAMBA1_TENSORS, is_mamba1
from ds_tsp.blocks.linear.short_conv import SHORT_CONV_MODULES, is_short_conv
from ds_tsp.blocks.mlp import mlp_activation
from ds_tsp.blocks.rotary import UNROTATED
from ds_tsp.blocks.moe import plan as moe_plan
from ds_tsp.blocks.moe.experts import flags_of as expert_flags


logger = logging.getLogger("ds_tsp")


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class Accepts:
    """The values of one config attribute whose forward ds_tsp reproduces:
    a tuple of values or a predicate; ``why`` says what the attribute does and
    why those values (only) are reproduced; ``fix`` how to get there, if any."""

    values: tuple | Callable
    why: str
    fix: str = ""

    def allows(self, value):
        return self.values(value) if callable(self.values) else value in self.values


def any_value(value):
    return True


# RoPE types whose tables the TSP model gets from the model's own rotary module
# (called with the whole sequence's largest position, see rotary.rotary_tables),
# each checked equal to HF's in float64 (tests/test_policy.py).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")


def rope_supported(params, partial_rotary=False):
    """Whether the TSP attention reproduces rotary embeddings of ``params``;
    ``partial_rotary``: whether the model's forward rotates only the first
    ``cos.shape[-1]`` dims of a head when its tables are shorter, as the TSP
    attention does (Phi-3's ``apply_rotary_pos_emb``), rather than failing."""
    if params is None:
        return True
    # Per-layer-type tables ({"full_attention": {...}, ...}) have no top-level type.
    if not isinstance(params, dict) or params.get("rope_type") not in ROPE_TYPES:
        return False
    # A partial rotary factor shortens the tables, except with "proportional",
    # whose tables keep the head's size.
    return (partial_rotary or params["rope_type"] == "proportional"
            or params.get("partial_rotary_factor", 1.0) in (None, 1, 1.0))


def rope_with_partial_rotary(params):
    return rope_supported(params, partial_rotary=True)


LAYER_TYPES = ("full_attention", "sliding_attention")
# Recurrent layers (ds_tsp.blocks.linear) among them: the hybrids' Gated DeltaNet (Qwen3.5, Qwen3-Next) and Mamba-2
# (Bamba, Granite-4.0-H), LFM's conv layers (gated short convolutions), Falcon-H1's hybrid layers (a Mamba-2 mixer
# beside the attention); Llama 4's chunked
# layers (attention within chunks of attention_chunk_size tokens: documents.chunked_documents).
# Layers of one block (Nemotron-H's) name their MLP and MoE layers too.
# DeepSeek's sparse attention: indexed_attention layers, a latent attention whose lightning indexer chooses each
# query's keys (ds_tsp.blocks.latent.indexer).
MIXER_TYPES = (*LAYER_TYPES, "linear_attention", "chunked_attention", "mlp", "moe", "conv", "hybrid",
               "indexed_attention")


def full_or_sliding(layer_types):
    return layer_types is None or all(kind in MIXER_TYPES for kind in layer_types)


def per_layer_type(params):
    """Whether RoPE ``params`` hold one table per layer type (Gemma-3: local and global RoPE)."""
    return isinstance(params, dict) and bool(params) and set(params) <= set(LAYER_TYPES)


def rope_per_layer_type(params, partial_rotary=False):
    """One supported table per layer type, or one for all."""
    if per_layer_type(params):
        return all(rope_supported(table, partial_rotary) for table in params.values())
    return rope_supported(params, partial_rotary)


NO_DROPOUT = (None, 0, 0.0)

# Read by every supported forward, whatever the class.
COMMON = {
    # Named first: a model with these fails on them before any other attribute (DeepSeek-V4's rotary too).
    "hc_mult": Accepts(any_value, "hyper-connections (HY-V4's hc_mult residual streams): each layer's attn_hc and "
                       "ffn_hc (HyperConnections) mix the streams per token as Hugging Face's modules, kept whole; "
                       "layers whose streams are mixed otherwise are refused as holding unexpected submodules"),
    "o_lora_rank": Accepts((None,), "a low-rank grouped output projection (DeepSeek-V4's o_lora_rank, o_groups) is "
                           "not built under TSP", "train this model with tsp.enabled false"),
    "compress_rates": Accepts((None,), "compressed attention (DeepSeek-V4's compressed sparse and heavily "
                              "compressed layers, keys compressed by these rates under their own rotary) is not "
                              "built under TSP", "train this model with tsp.enabled false"),
    "mlp_layer_types": Accepts(lambda kinds: "hash_moe" not in (kinds or ()), "hash-routed MoE layers "
                               "(DeepSeek-V4's hash_moe: a token's experts fixed by its id) are not built under TSP; "
                               "dense and sparse layers are", "train this model with tsp.enabled false"),
    "indexer_types": Accepts(lambda kinds: "shared" not in (kinds or ()) or kinds[0] == "full",
                             "a sparse attention layer reusing an earlier layer's choice of keys (\"shared\") needs "
                             "a layer with an indexer of its own (\"full\") before it",
                             "make the first entry of config.indexer_types \"full\""),
    "attention_dropout": Accepts(NO_DROPOUT, "the TSP attention applies no dropout",
                                 "set model.config.attention_dropout = 0.0 before ds_tsp (its numbers then match "
                                 "the unsharded model's), or leave tsp.enabled false"),
    "rope_parameters": Accepts(rope_supported, "the TSP model calls the model's own rotary embedding with the whole "
                               f"sequence's positions; rope_type {', '.join(ROPE_TYPES)} are checked equal to HF; "
                               "partial rotary factors (but with proportional) and per-layer-type tables are not"),
    "hidden_act": Accepts(any_value, "the TSP MLP calls the Hugging Face MLP's own act_fn"),
    "head_dim": Accepts(any_value, "read from the attention module"),
    "rms_norm_eps": Accepts(any_value, "the Hugging Face norm modules are kept as they are"),
    "tie_word_embeddings": Accepts(any_value, "a tied head shares the embedding's (vocabulary) shard"),
}
ATTENTION_BIAS = Accepts(any_value, "q/k/v biases are sharded with their heads; o_proj's is replicated and added once")
SLIDING = {
    "layer_types": Accepts(full_or_sliding, f"each layer's mask: {' or '.join(LAYER_TYPES)} are reproduced "
                           "(each layer's window is checked against the one HF's mask uses), chunked_attention "
                           "(Llama 4's) within chunks of attention_chunk_size tokens, and linear_attention "
                           "layers holding a Gated DeltaNet (Kimi Linear's KDA among them), a Mamba-2 or a Mamba-1 "
                           "mixer, conv layers (LFM's gated short convolutions) and hybrid layers (Falcon-H1's "
                           "attention and Mamba-2 side by side) are run by ds_tsp's, and indexed_attention layers "
                           "(DeepSeek-V3.2's and GLM-MoE-DSA's sparse attention: a latent attention whose "
                           "lightning indexer chooses each query's keys) by ds_tsp's indexer; DeepSeek-V4's "
                           "compressed attention layers are not built"),
    "sliding_window": Accepts(any_value, "the window of sliding_attention layers"),
    "use_sliding_window": Accepts(any_value, "read only to build layer_types and sliding_window"),
    "max_window_layers": Accepts(any_value, "read only to build layer_types"),
}
LLAMA = {**COMMON, "attention_bias": ATTENTION_BIAS,
         "mlp_bias": Accepts(any_value, "gate/up biases are sharded with their columns; down_proj's is replicated "
                             "and added once"),
         "pretraining_tp": Accepts(any_value, "no forward reads it in transformers 5")}
QWEN2 = {**COMMON, **SLIDING}  # q/k/v biases always, o_proj none: fixed by the class
QWEN3 = {**COMMON, **SLIDING, "attention_bias": ATTENTION_BIAS}
MISTRAL = {**COMMON, "sliding_window": Accepts(any_value, "one window for every layer (None: full causal)")}
PHI3 = {**MISTRAL,
        "rope_parameters": Accepts(rope_with_partial_rotary, "the TSP model calls the model's own rotary embedding "
                                   f"with the whole sequence's positions; rope_type {', '.join(ROPE_TYPES)} are "
                                   "checked equal to HF, and a partial rotary factor rotates the first dims of each "
                                   "head and passes the rest, as Phi-3's forward does; per-layer-type tables are not"),
        "partial_rotary_factor": Accepts(any_value, "read only into rope_parameters"),
        "original_max_position_embeddings": Accepts(any_value, "read by longrope's tables (the whole sequence's "
                                                    "length picks them) and by generate, which restarts the cache "
                                                    "past it"),
        "resid_pdrop": Accepts(NO_DROPOUT, "dropout of each block's output before the residual sum, which the TSP "
                               "layer does not apply", "set model.config.resid_pdrop = 0.0 before ds_tsp (its numbers "
                               "then match the unsharded model's in eval mode), or leave tsp.enabled false"),
        "embd_pdrop": Accepts(NO_DROPOUT, "embedding dropout (which transformers 5's Phi-3 forward does not apply); "
                              "refused so that a config asking for it is not trained without it",
                              "set model.config.embd_pdrop = 0.0 before ds_tsp, or leave tsp.enabled false")}
# Mixture-of-experts routing: the TSP block runs Hugging Face's own router module
# (softmax dtype, top-k, norm_topk_prob, weights' dtype) on the local tokens.
MOE_ROUTING = {
    "num_experts_per_tok": Accepts(any_value, "top-k of Hugging Face's own router module, run on the local tokens"),
    "norm_topk_prob": Accepts(any_value, "read by Hugging Face's own router module"),
    "output_router_logits": Accepts(any_value, "the auxiliary load-balancing loss is computed over the whole "
                                    "sequence (ds_tsp.blocks.moe.load_balancing); router_logits are the local tokens'"),
    "router_aux_loss_coef": Accepts(any_value, "scales the auxiliary loss added to the loss, as HF's ForCausalLM does"),
}
# Dense layers among the MoE layers (Qwen2/3-MoE) become TSP gated MLPs.
SPARSE_LAYERS = {
    "mlp_only_layers": Accepts(any_value, "layers listed keep a dense MLP, which becomes a TSP gated MLP"),
    "decoder_sparse_step": Accepts(any_value, "layers off the step keep a dense MLP, which becomes a TSP gated MLP"),
}
# Gemma's forwards: (1 + w) RMSNorms and the embedding scaled by sqrt(H) are
# modules the TSP model keeps (the norms) or folds (the embedding, vocab.py).
GEMMA = {**COMMON, "attention_bias": ATTENTION_BIAS,
         "hidden_activation": Accepts(any_value, "the TSP MLP calls the Hugging Face MLP's own act_fn"),
         "use_bidirectional_attention": Accepts((None, False), "bidirectional attention; the TSP attention is "
                                                "causal", "leave use_bidirectional_attention unset for a causal LM")}
SOFT_CAPPING = {
    "attn_logit_softcapping": Accepts(any_value, "attention scores soft-capped, cap * tanh(s / cap), by ds_tsp's "
                                      "capped attention kernel (attention_kernels.SoftCappedKernel)"),
    "final_logit_softcapping": Accepts(any_value, "the final logits soft-capped inside the fused LM head + loss ring, "
                                       "and in the logits returned and generated from"),
    "query_pre_attn_scalar": Accepts(any_value, "the attention's scale, read from the attention module (scaling)"),
}
GEMMA2 = {**GEMMA, **SLIDING, **SOFT_CAPPING}
GEMMA3 = {**GEMMA2, "rope_parameters": Accepts(rope_per_layer_type, "the TSP model calls the model's own rotary "
                                               "embedding for each layer type with the whole sequence's positions; "
                                               f"rope_type {', '.join(ROPE_TYPES)} are checked equal to HF")}
# Gemma 4's text decoder: Gemma 3's layer with a weightless value norm, keys used as values on its full layers
# (attention_k_eq_v: no v_proj there), wider heads and fewer key/value heads on those layers (transformers'
# per-layer head_dim and num_key_value_heads, which the TSP attention reads layer by layer), proportional RoPE,
# the scale 1.0 its q/k norms take over, each layer's output times its layer_scalar buffer.
GEMMA4 = {**GEMMA3, "attention_k_eq_v": Accepts(any_value, "the full layers' keys before their norm and rotary "
                                                "are their values (no v_proj), as the TSP attention computes them"),
          "use_bidirectional_attention": Accepts((None, "vision"), "bidirectional attention over all tokens "
                                                 "(\"all\"); \"vision\" lets images see themselves in the "
                                                 "vision-language model, and leaves the causal LM causal",
                                                 "leave use_bidirectional_attention unset for a causal LM"),
          "use_double_wide_mlp": Accepts(any_value, "the key/value-sharing layers' MLP width, read from the module"),
          "hidden_size_per_layer_input": Accepts(any_value, "per-layer inputs (PerLayerInputs): a second embedding "
                                                 "folded by vocabulary, mixed by the decoder's own "
                                                 "project_per_layer_inputs, gated and added by every layer"),
          "num_kv_shared_layers": Accepts(any_value, "the last layers attend to the keys and values of the last "
                                          "earlier layer of their type, which hands its local tokens' on "
                                          "(TSPAttention.kv_sharing); each gathers them as its own"),
          "vocab_size_per_layer_input": Accepts(any_value, "read only with hidden_size_per_layer_input"),
          "enable_moe_block": Accepts(any_value, "experts beside the dense MLP (ExpertsBesideMLP): Hugging Face's "
                                      "router on the local tokens, the experts sharded as a TSP MoE block's"),
          "num_experts": Accepts(any_value, "read by the router and the experts' shapes"),
          "top_k_experts": Accepts(any_value, "read by Hugging Face's own router module"),
          "moe_intermediate_size": Accepts(any_value, "read from the experts' shapes")}
# OLMo-2/3: post-norms only; q/k RMSNorms over the whole projection width.
OLMO2 = {**COMMON, "attention_bias": ATTENTION_BIAS}
OLMO3 = {**OLMO2, **SLIDING, "rope_parameters": GEMMA3["rope_parameters"]}
MIXTRAL = {**MISTRAL, **MOE_ROUTING,
           "router_jitter_noise": Accepts(NO_DROPOUT, "multiplies the MoE input by random noise in training, which "
                                          "the TSP block does not apply",
                                          "build the model with router_jitter_noise = 0.0 before ds_tsp")}
QWEN2_MOE = {**COMMON, **SLIDING, **MOE_ROUTING, **SPARSE_LAYERS,
             "qkv_bias": Accepts(any_value, "q/k/v biases are sharded with their heads (o_proj has none)")}
QWEN3_MOE = {**COMMON, **MOE_ROUTING, **SPARSE_LAYERS, "attention_bias": ATTENTION_BIAS,
             "sliding_window": Accepts(any_value, "one window for every layer (None: full causal)"),
             "use_sliding_window": Accepts(any_value, "no forward reads it in transformers 5")}
# OLMoE: OLMo-2's q/k norms over the whole projection, pre-norms, a Qwen-style router; FlexOlmo: the same
# block under OLMo-2's post-norms.
OLMOE = {**OLMO2, **MOE_ROUTING,
         "clip_qkv": Accepts((None,), "clipping of q/k/v, which the TSP attention does not apply",
                             "build the model with clip_qkv = None, or leave tsp.enabled false")}
# MiniMax-M2: OLMo-2's q/k norms over the whole projection, a partial rotary factor (its checkpoints' rotary_dim)
# rotating each head's first dims as Phi-3's forward does, a sigmoid router handed the block's score-correction
# bias, no sliding window.
MINIMAX_M2 = {**COMMON, **MOE_ROUTING, "rope_parameters": PHI3["rope_parameters"],
              "partial_rotary_factor": PHI3["partial_rotary_factor"],
              "rotary_dim": Accepts(any_value, "read only into rope_parameters' partial_rotary_factor"),
              "router_jitter_noise": MIXTRAL["router_jitter_noise"]}
# A class accepted by shape: forward features Llama's lacks, named by the
# config attributes transformers' models use for them, are accepted only at
# the value that turns them off. What no attribute names, ds_tsp.injection.probe finds.
AUTO_CONFIG = {
    **COMMON,
    **SLIDING,
    # Soft-capping as Gemma 2's: the final logits inside the fused LM head + loss ring; the attention scores by
    # the capped kernel, from the attention module's attn_logit_softcapping (the probe compares the layer).
    "final_logit_softcapping": SOFT_CAPPING["final_logit_softcapping"],
    "attn_logit_softcapping": SOFT_CAPPING["attn_logit_softcapping"],
    # The final logits scaled inside the fused LM head + loss ring (vocab.LogitMap); the probe checks the logits.
    "logit_scale": Accepts(any_value, "the final logits multiplied by it inside the fused LM head + loss ring"),
    "logits_scaling": Accepts(any_value, "the final logits divided by it inside the fused LM head + loss ring"),
    # Granite's multipliers: the looked-up embeddings, and each block's output before the residual add, scaled as
    # its forward does (vocab.embedding_multiplier, TSPDecoderLayer.residual_multiplier); the probe checks both.
    "embedding_multiplier": Accepts(any_value, "the looked-up embeddings multiplied by it"),
    "residual_multiplier": Accepts(any_value, "each block's output multiplied by it before the residual add"),
    "query_pre_attn_scalar": SOFT_CAPPING["query_pre_attn_scalar"],
    "clip_qkv": Accepts((None,), "clipping of q/k/v, which the TSP attention does not apply"),
    # A partial rotary factor: the TSP attention rotates each head's first dims as Phi-3's and GLM-4.5's
    # forwards do; the probe finds a forward that rotates otherwise (interleaved pairs). Per-layer-type tables
    # (Mellum's) are taken per layer type, as Gemma-3's.
    "rope_parameters": Accepts(lambda params: rope_per_layer_type(params, partial_rotary=True),
                               "the TSP model calls the model's own rotary embedding with the whole sequence's "
                               f"positions (per layer type where it keeps one table each); rope_type "
                               f"{', '.join(ROPE_TYPES)} are checked equal to HF, and a partial rotary factor rotates "
                               "the first dims of each head; the probe compares the layer"),
    "partial_rotary_factor": Accepts(any_value, "read only into rope_parameters"),
    "use_parallel_residual": Accepts((None, False), "attention and MLP in parallel; the TSP layer runs them in turn"),
    "hidden_dropout": Accepts(NO_DROPOUT, "dropout, which the TSP layer does not apply"),
    "residual_dropout": Accepts(NO_DROPOUT, "dropout, which the TSP layer does not apply"),
    "resid_pdrop": Accepts(NO_DROPOUT, "dropout, which the TSP layer does not apply"),
    "embd_pdrop": Accepts(NO_DROPOUT, "dropout, which the TSP forward does not apply"),
    # Llama 4's attention: chunked layers, NoPE layers whose queries are scaled by their index in the row.
    "attention_chunk_size": Accepts(any_value, "the chunk of chunked_attention layers (Llama 4: a block-diagonal "
                                    "causal mask over chunks, cut at every row's and packed document's start)"),
    "no_rope_layers": Accepts(any_value, "layers without rotary embedding (0 in no_rope_layers: Llama 4's NoPE "
                              "layers), which the TSP attention runs without positions"),
    "attn_temperature_tuning": Accepts(any_value, "attention temperature tuning: Llama 4's NoPE layers scale their "
                                       "queries with each token's index in its row (rotary.TemperatureTuning)"),
    # Gemma 3n's and Gemma 4's features beyond Gemma 3's layer, named for the same reason: ds_tsp builds them for
    # Gemma 4's own classes only (GEMMA4).
    "hidden_size_per_layer_input": Accepts((None, 0), "per-layer input embeddings (Gemma 3n/4: a second embedding "
                                           "feeding every layer), which ds_tsp builds for Gemma4ForCausalLM only "
                                           "(tsp.policy gemma4_text)"),
    "num_kv_shared_layers": Accepts((None, 0), "key/value sharing across layers (Gemma 3n/4: the last layers attend "
                                    "to earlier layers' keys and values), which ds_tsp builds for Gemma4ForCausalLM "
                                    "only (tsp.policy gemma4_text)"),
    "attention_k_eq_v": Accepts((None, False), "keys used as values (Gemma 4), which only Gemma 4's policy reads"),
    "enable_moe_block": Accepts((None, False), "a mixture-of-experts block beside the dense MLP (Gemma 4), which "
                                "only Gemma 4's policy builds"),
}


def no_window(config, index):
    return None


def config_window(config, index):
    return getattr(config, "sliding_window", None)


def layer_types_window(config, index):
    return config.sliding_window if config.layer_types[index] == "sliding_attention" else None


def layer_type(config, index):
    """The rotary tables layer ``index`` takes where the model keeps one per layer type: its type's, or none
    (``UNROTATED``) for a layer of a type without tables (LFM3's conv layers)."""
    kind = config.layer_types[index]
    return kind if kind in config.rope_parameters else UNROTATED


# The norms (before, after) each block: None where there is none.
PRE_NORMS = {"attention": ("input_layernorm", None), "mlp": ("post_attention_layernorm", None)}
SANDWICH_NORMS = {"attention": ("input_layernorm", "post_attention_layernorm"),
                  "mlp": ("pre_feedforward_layernorm", "post_feedforward_layernorm")}
POST_NORMS = {"attention": (None, "post_attention_layernorm"), "mlp": (None, "post_feedforward_layernorm")}
# Pre-norms with the MLP's under Gemma 2's name (VaultGemma).
PRE_FEEDFORWARD_NORMS = {"attention": ("input_layernorm", None), "mlp": ("pre_feedforward_layernorm", None)}
# Pre-norms with the MLP's under Bamba's name.
PRE_FF_NORMS = {"attention": ("input_layernorm", None), "mlp": ("pre_ff_layernorm", None)}
# One norm feeding the attention and the MLP side by side (Cohere's parallel block: DecoderPolicy.parallel_blocks).
PARALLEL_NORMS = {"attention": ("input_layernorm", None), "mlp": (None, None)}
# Sandwich norms under HyperCLOVA X's names: post_norm1 after the attention, post_norm2 after the MLP.
HYPERCLOVAX_SANDWICH_NORMS = {"attention": ("input_layernorm", "post_norm1"),
                              "mlp": ("post_attention_layernorm", "post_norm2")}
# Sandwich norms under GLM-4's names: post_attention_layernorm is the norm BEFORE the MLP there.
GLM4_SANDWICH_NORMS = {"attention": ("input_layernorm", "post_self_attn_layernorm"),
                       "mlp": ("post_attention_layernorm", "post_mlp_layernorm")}
# LFM's: operator_norm before the token mixer, ffn_norm before the MLP; LFM3's sandwich norms after each
# (nn.Identity where its config turns them off).
LFM_NORMS = {"attention": ("operator_norm", None), "mlp": ("ffn_norm", None)}
LFM_SANDWICH_NORMS = {"attention": ("operator_norm", "post_operator_norm"), "mlp": ("ffn_norm", "post_ffn_norm")}


def hf_path(*parts):
    """A Hugging Face module or tensor name from its parts, the empty ones left
    out (a TSP block whose tensors are its layer's own has the prefix "")."""
    return ".".join(part for part in parts if part)


@dataclass(frozen=True)
class ExpertsBesideMLP:
    """A mixture of experts beside a layer's dense MLP, on the same feed-forward
    branch, the two outputs summed. Gemma 4's: a ``router`` and ``experts``
    (fused 3-D tensors) that are the layer's own children (``block`` ""), routed
    on the branch's input, the experts run on ``input_norm`` of it, the MLP's
    output normed by ``mlp_norm`` and the experts' by ``experts_norm`` before
    the sum. Granite-4.0-H's: a sparse MoE block of its own (``block``), run on
    the MLP's normed input, the outputs summed as they are (no norms)."""

    block: str = ""
    router: str = "router"
    experts: str = "experts"
    input_norm: str | None = "pre_feedforward_layernorm_2"
    mlp_norm: str | None = "post_feedforward_layernorm_1"
    experts_norm: str | None = "post_feedforward_layernorm_2"

    def parts(self):
        """The layer's children the TSP experts block holds (replicated or sharded)."""
        return (self.block,) if self.block else tuple(p for p in (self.router, self.experts, self.input_norm) if p)

    def norms(self):
        """The layer's children the TSP layer keeps as they are."""
        return tuple(name for name in (self.mlp_norm, self.experts_norm) if name)

    def hf_block(self, layer):
        """The Hugging Face module holding the router and experts: ``block``, or the layer itself."""
        return getattr(layer, self.block, None) if self.block else layer


# Granite-4.0-H's MoE block beside its shared MLP (the layer's MLP): its output and the MLP's summed.
GRANITE_EXPERTS = ExpertsBesideMLP(block="block_sparse_moe", input_norm=None, mlp_norm=None, experts_norm=None)


@dataclass(frozen=True)
class PerLayerInputs:
    """Per-layer inputs (Gemma 4's): a second embedding ``embed`` (vocabulary
    rows of every layer's input side by side), which the TSP model folds by
    vocabulary as the main one; the decoder's own ``project_per_layer_inputs``
    mixes it with a projection of the embedded tokens into each layer's input,
    which the layer gates (``gate``, its ``activation``), projects back
    (``projection``), norms (``norm``) and adds to its output."""

    embed: str = "model.embed_tokens_per_layer"
    gate: str = "per_layer_input_gate"
    activation: str = "act_fn"
    projection: str = "per_layer_projection"
    norm: str = "post_per_layer_input_norm"

    def layer_parts(self):
        """The layer's children that apply its input, kept whole on every rank."""
        return self.gate, self.projection, self.norm


@dataclass(frozen=True)
class HyperConnections:
    """Hyper-connections (HY-V4's): the residual stream is ``hc_mult`` streams
    ``(B, S, hc_mult, H)``, the embedding repeated; before each block the
    layer's ``attention`` (or ``mlp``) module mixes them per token into the
    block's input and weights (``post``) by which the block's output joins each
    stream; the model's ``head`` module mixes them back into one before the
    final norm. All per token: the modules run as Hugging Face's, whole on
    every rank."""

    attention: str = "attn_hc"
    mlp: str = "ffn_hc"
    head: str = "model.hc_head"

    def layer_parts(self):
        """The layer's children that mix its streams, kept whole on every rank."""
        return self.attention, self.mlp


@dataclass(frozen=True)
class DecoderPolicy:
    name: str
    layer_class: str | None  # None: any class of the right shape (auto)
    model_class: str | None = None  # the causal LM whose forward ``config`` was audited for
    # {attribute: Accepts} over the attributes that change the forward; the
    # others are read by no part of it (or only for sizes, checked elsewhere).
    config: dict = field(default_factory=lambda: AUTO_CONFIG, hash=False)
    # The sliding window HF's mask gives layer ``index``; None: unknown (auto).
    hf_window: Callable | None = None
    layers: str = "model.layers"
    embed_tokens: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    rotary_emb: str | None = "model.rotary_emb"  # None: the model has none (NoPE: Granite-4.0-H's, Nemotron-H's)
    lm_head: str = "lm_head"
    attention: str = "self_attn"
    # Where a hybrid's recurrent layers hold their mixer instead of an attention, or beside it (Falcon-H1's)
    # (ds_tsp.blocks.linear): a Gated DeltaNet (Qwen3.5's linear_attn), a Mamba-2 or Mamba-1 mixer (Bamba's,
    # Granite-4.0-H's, Jamba's mamba) or a gated short convolution (LFM's conv).
    recurrent: tuple = ("linear_attn", "mamba", "conv")
    mlp: str = "mlp"
    # The names of the norms (before, after) the "attention" and the "mlp" block.
    norm_layout: dict = field(default_factory=lambda: PRE_NORMS, hash=False)
    # The rotary tables layer ``index`` takes, where the model keeps one per layer type (Gemma-3); None: one for all.
    rotary_kind: Callable | None = None
    # q/k norms "per head" (Qwen3, Gemma-3) or over the whole "projection" (OLMo-2), where there are any.
    qk_norm_width: str = "head"
    # The gated MLP's activation module, by its attribute name; None: the MLP holds none and applies silu (LFM's).
    activation: str | None = "act_fn"
    # Fused projections, per block (``attention``, ``mlp``): ``{fused projection:
    # the logical projections whose rows it holds, in row order}`` (``ds_tsp.blocks.fused``).
    fused: dict = field(default_factory=dict, hash=False)
    # The attention and the MLP side by side off the attention's norm, both added to the layer's input (Cohere's).
    parallel_blocks: bool = False
    # The dense MLP gated, down(act(gate(x)) * up(x)), or not, down(act(up(x))) (Nemotron's, Arcee's).
    gated_mlp: bool = True
    # The sparse MoE block class at ``mlp`` (``ds_tsp.blocks.moe.module``); a layer may hold it
    # or a dense gated MLP. None: dense MLPs only.
    sparse_mlp: str | None = None
    # A mixture of experts beside the dense MLP, held by the layer itself (Gemma 4's), or None.
    experts_beside_mlp: ExpertsBesideMLP | None = None
    # Per-layer inputs from a second embedding (Gemma 4's), where the model has them, or None.
    per_layer_inputs: PerLayerInputs | None = None
    # Hyper-connections (HY-V4's), where the model has them.
    hyper_connections: HyperConnections = HyperConnections()
    # One block a layer (Nemotron-H's): its token mixer or its MLP under this name, after the layer's one norm
    # (``norm_layout``'s first), the layer's kind by what the block is; None: a mixer and an MLP every layer.
    single_block: str | None = None
    # Layers of two classes with their norms laid out differently (OLMo-Hybrid's post-norm attention layers beside
    # pre-norm linear ones): each layer's layout is the first of AUTO_LAYOUTS whose norms it holds (auto only).
    layouts_by_layer: bool = False

    def model_inputs(self, model):
        """The ``PerLayerInputs`` of ``model`` where it has a per-layer embedding, else None."""
        inputs = self.per_layer_inputs
        return inputs if inputs is not None and get_submodule(model, inputs.embed) is not None else None

    def model_streams(self, model):
        """The ``HyperConnections`` of ``model`` where its residual is several streams, else None."""
        hyper = self.hyper_connections
        return hyper if get_submodule(model, hyper.head) is not None else None

    def layer_streams(self, layer):
        """The ``HyperConnections`` of a decoder ``layer`` that mixes streams, else None."""
        hyper = self.hyper_connections
        return hyper if isinstance(getattr(layer, hyper.attention, None), nn.Module) else None

    def layer_inputs(self, layer):
        """The ``PerLayerInputs`` of a decoder ``layer`` that takes one, else None."""
        inputs = self.per_layer_inputs
        return inputs if inputs is not None and getattr(layer, inputs.gate, None) is not None else None

    def beside(self, layer):
        """The ``ExpertsBesideMLP`` of ``layer`` where it holds experts beside its MLP, else None."""
        beside = self.experts_beside_mlp
        if beside is None or not isinstance(beside.hf_block(layer), nn.Module):
            return None
        return beside if isinstance(getattr(beside.hf_block(layer), beside.experts, None), nn.Module) else None

    def experts_prefix(self, layer):
        """The Hugging Face prefix of the experts ``layer`` holds beside its MLP: their block's, or "" where
        their tensors are the layer's own (and where there are none)."""
        beside = self.beside(layer)
        return "" if beside is None else beside.block

    def block_prefixes(self, layer):
        """The Hugging Face prefixes, under ``layer``, of the tensors its TSP blocks hold (those the blocks read
        and write, rather than the layer's norms): the mixer's, the MLP's and those of experts beside it."""
        beside = self.beside(layer)
        return tuple(name for name in (self.mixer(layer), self.side_mixer(layer), self.mlp_of(layer),
                                       *(beside.parts() if beside else ()))
                     if name is not None)

    def mixer(self, layer):
        """The name of ``layer``'s token mixer: its recurrent mixer where it holds one alone, else its attention;
        None for a single-block layer holding an MLP."""
        if self.single_block is not None:
            return self.single_block if is_token_mixer(layer.get_submodule(self.single_block)) else None
        if self.side_mixer(layer) is not None:
            return self.attention
        return next((name for name in self.recurrent if getattr(layer, name, None) is not None), self.attention)

    def side_mixer(self, layer):
        """The name of the recurrent mixer ``layer`` runs beside its attention, off the same norm (Falcon-H1's
        ``mamba``), or None."""
        if self.single_block is not None or getattr(layer, self.attention, None) is None:
            return None
        return next((name for name in self.recurrent if is_recurrent(getattr(layer, name, None))), None)

    def mlp_of(self, layer):
        """The name of ``layer``'s MLP (or MoE block); None for a single-block layer holding a token mixer."""
        if self.single_block is not None:
            return None if is_token_mixer(layer.get_submodule(self.single_block)) else self.single_block
        return self.mlp

    def layout_of(self, layer):
        """The norms ``(before, after)`` each block of ``layer``: ``norm_layout``, but a single-block layer's
        one norm before the block it holds."""
        if self.layouts_by_layer:
            return next((layout.norm_layout for layout in AUTO_LAYOUTS
                         if all(hasattr(layer, norm) for norm in layout.norm_names())), self.norm_layout)
        if self.single_block is None:
            return self.norm_layout
        norm = self.norm_names()[0]
        mixes = self.mixer(layer) is not None
        return {"attention": (norm if mixes else None, None), "mlp": (None if mixes else norm, None)}

    def rotary_module(self, model):
        """``model``'s rotary embedding module, or None where it has none."""
        return None if self.rotary_emb is None else model.get_submodule(self.rotary_emb)

    def norm_names(self):
        """The names of a layer's norms, in the order the layer applies them."""
        return [name for pair in self.norm_layout.values() for name in pair if name is not None]

    def mlp_projections(self):
        """The dense MLP's logical projections."""
        return MLP_PROJECTIONS if self.gated_mlp else UNGATED_MLP_PROJECTIONS

    def hf_projections(self, block, projections):
        """``projections`` of ``block`` as its Hugging Face module holds them: those this policy fuses under
        their fused tensor's name, once."""
        holder = {part: fused for fused, parts in self.fused.get(block, {}).items() for part in parts}
        return tuple(dict.fromkeys(holder.get(name, name) for name in projections))

    def is_sparse(self, mlp_module):
        """Whether ``mlp_module`` (a layer's ``mlp``) is this policy's sparse MoE block; under
        ``auto``, any block holding ``experts`` with a fused 3-D ``down_proj`` (``check_sparse_block``
        says whether ds_tsp takes it)."""
        if self.layer_class is None:
            down = getattr(getattr(mlp_module, "experts", None), "down_proj", None)
            return isinstance(down, nn.Parameter) and down.dim() == 3
        return self.sparse_mlp is not None and type(mlp_module).__name__ == self.sparse_mlp


POLICIES = {
    "llama": DecoderPolicy("llama", "LlamaDecoderLayer", "LlamaForCausalLM", LLAMA, no_window),
    "qwen2": DecoderPolicy("qwen2", "Qwen2DecoderLayer", "Qwen2ForCausalLM", QWEN2, layer_types_window),
    "mistral": DecoderPolicy("mistral", "MistralDecoderLayer", "MistralForCausalLM", MISTRAL, config_window),
    "qwen3": DecoderPolicy("qwen3", "Qwen3DecoderLayer", "Qwen3ForCausalLM", QWEN3, layer_types_window),
    "phi3": DecoderPolicy("phi3", "Phi3DecoderLayer", "Phi3ForCausalLM", PHI3, config_window,
                          activation="activation_fn",
                          fused={"self_attn": {"qkv_proj": ("q_proj", "k_proj", "v_proj")},
                                 "mlp": {"gate_up_proj": ("gate_proj", "up_proj")}}),
    "mixtral": DecoderPolicy("mixtral", "MixtralDecoderLayer", "MixtralForCausalLM", MIXTRAL, config_window,
                             sparse_mlp="MixtralSparseMoeBlock"),
    "qwen2_moe": DecoderPolicy("qwen2_moe", "Qwen2MoeDecoderLayer", "Qwen2MoeForCausalLM", QWEN2_MOE,
                               layer_types_window, sparse_mlp="Qwen2MoeSparseMoeBlock"),
    "qwen3_moe": DecoderPolicy("qwen3_moe", "Qwen3MoeDecoderLayer", "Qwen3MoeForCausalLM", QWEN3_MOE, config_window,
                               sparse_mlp="Qwen3MoeSparseMoeBlock"),
    "gemma": DecoderPolicy("gemma", "GemmaDecoderLayer", "GemmaForCausalLM", GEMMA, no_window),
    "gemma2": DecoderPolicy("gemma2", "Gemma2DecoderLayer", "Gemma2ForCausalLM", GEMMA2, layer_types_window,
                            norm_layout=SANDWICH_NORMS),
    "gemma3_text": DecoderPolicy("gemma3_text", "Gemma3DecoderLayer", "Gemma3ForCausalLM", GEMMA3, layer_types_window,
                                 norm_layout=SANDWICH_NORMS, rotary_kind=layer_type),
    "gemma4_text": DecoderPolicy("gemma4_text", "Gemma4TextDecoderLayer", "Gemma4ForCausalLM", GEMMA4,
                                 layer_types_window, norm_layout=SANDWICH_NORMS, rotary_kind=layer_type,
                                 experts_beside_mlp=ExpertsBesideMLP(), per_layer_inputs=PerLayerInputs()),
    "olmo2": DecoderPolicy("olmo2", "Olmo2DecoderLayer", "Olmo2ForCausalLM", OLMO2, no_window, norm_layout=POST_NORMS,
                           qk_norm_width="projection"),
    "olmoe": DecoderPolicy("olmoe", "OlmoeDecoderLayer", "OlmoeForCausalLM", OLMOE, no_window,
                           qk_norm_width="projection", sparse_mlp="OlmoeSparseMoeBlock"),
    "flex_olmo": DecoderPolicy("flex_olmo", "FlexOlmoDecoderLayer", "FlexOlmoForCausalLM", OLMOE, no_window,
                               norm_layout=POST_NORMS, qk_norm_width="projection", sparse_mlp="FlexOlmoSparseMoeBlock"),
    "minimax_m2": DecoderPolicy("minimax_m2", "MiniMaxM2DecoderLayer", "MiniMaxM2ForCausalLM", MINIMAX_M2, no_window,
                                qk_norm_width="projection", sparse_mlp="MiniMaxM2SparseMoeBlock"),
    "olmo3": DecoderPolicy("olmo3", "Olmo3DecoderLayer", "Olmo3ForCausalLM", OLMO3, layer_types_window,
                           norm_layout=POST_NORMS, rotary_kind=layer_type, qk_norm_width="projection"),
}
AUTO = DecoderPolicy("auto", None)
# Auto with the norms after each block only (OLMo-2's layout, FlexOlmo's), chosen by the layer's norms.
AUTO_POST_NORMS = DecoderPolicy("auto", None, norm_layout=POST_NORMS)
AUTO_PRE_FEEDFORWARD_NORMS = DecoderPolicy("auto", None, norm_layout=PRE_FEEDFORWARD_NORMS)
# Auto's layouts by their norms' names, the most norms first: the first a layer holds every norm of is its layout.
AUTO_LAYOUTS = (DecoderPolicy("auto", None, norm_layout=GLM4_SANDWICH_NORMS),
                DecoderPolicy("auto", None, norm_layout=LFM_SANDWICH_NORMS),
                DecoderPolicy("auto", None, norm_layout=LFM_NORMS),
                DecoderPolicy("auto", None, norm_layout=HYPERCLOVAX_SANDWICH_NORMS),
                DecoderPolicy("auto", None, norm_layout=SANDWICH_NORMS), AUTO, AUTO_POST_NORMS,
                AUTO_PRE_FEEDFORWARD_NORMS, DecoderPolicy("auto", None, norm_layout=PRE_FF_NORMS),
                DecoderPolicy("auto", None, norm_layout=PARALLEL_NORMS, parallel_blocks=True))
# Auto's layers of one block (Nemotron-H's): an attention, a Mamba-2 mixer, an MLP or an MoE block at ``mixer``,
# after the layer's one ``norm``.
SINGLE_BLOCK = DecoderPolicy("auto", None, attention="mixer", mlp="mixer", recurrent=(), single_block="mixer",
                             norm_layout={"attention": ("norm", None), "mlp": (None, None)})
# Where a layer without an ``mlp`` keeps its MLP or MoE block (Granite-MoE's, Mixtral's old name; Llama 4's and
# Bamba's; Granite-4.0-H's dense MLP).
MLP_NAMES = ("block_sparse_moe", "feed_forward", "shared_mlp")
# Where a decoder without a ``norm`` keeps its final norm (Bamba's and Falcon-H1's, Nemotron-H's, LFM's), and without an
# ``embed_tokens`` its embedding (Nemotron-H's).
FINAL_NORM_NAMES = ("final_layernorm", "norm_f", "embedding_norm")  # the last: LFM's
EMBEDDING_NAME = "embeddings"
# Where a decoder without a ``rotary_emb`` keeps its rotary embedding (LFM2-MoE's).
ROTARY_NAMES = ("pos_emb",)
# Auto's gated MLP with its gate and up rows in one tensor (GLM's gate_up_proj: the gate's rows, then the up's).
FUSED_GATE_UP = {"mlp": {"gate_up_proj": ("gate_proj", "up_proj")}}
# Granite-4.0-H's shared MLP: gate and up rows in input_linear, down_proj named output_linear.
GRANITE_LINEARS = {"input_linear": ("gate_proj", "up_proj"), "output_linear": ("down_proj",)}
# LFM's MLP: w2(silu(w1(x)) * w3(x)), its activation a function, not a module.
LFM_LINEARS = {"w1": ("gate_proj",), "w3": ("up_proj",), "w2": ("down_proj",)}
# LFM2's attention: o_proj named out_proj.
OUT_PROJ = {"out_proj": ("o_proj",)}

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Tensors a decoder layer may hold itself, which the TSP layer keeps: Gemma 4's layer_scalar, its output's factor.
LAYER_TENSORS = ("layer_scalar",)
# Per-head query/key norms (Qwen3's, Hunyuan's after the rotary embedding): optional, but both of a pair or neither.
ATTENTION_NORMS = tuple(attention.QK_NORMS)
# Tensors an attention module may hold itself, which the TSP attention shards with its heads: GPT-OSS's sinks.
ATTENTION_TENSORS = ("sinks",)
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
UNGATED_MLP_PROJECTIONS = ("up_proj", "down_proj")


def is_recurrent(module):
    """Whether ``module`` is a recurrent token mixer ds_tsp builds (``ds_tsp.blocks.linear``)."""
    return is_gated_delta_net(module) or is_mamba2(module) or is_short_conv(module) or is_mamba1(module)


def is_token_mixer(module):
    """Whether ``module`` mixes tokens (an attention, a latent attention or a recurrent mixer), not an MLP."""
    return is_recurrent(module) or is_latent_attention(module) or isinstance(getattr(module, "o_proj", None), nn.Module)


def latent_projections(attn):
    """The submodules of a multi-head latent attention (``ds_tsp.blocks.latent``):
    a query latent and its norm, or a plain query projection where it has none."""
    queries = ("q_a_proj", "q_a_layernorm", "q_b_proj") if getattr(attn, "q_a_proj", None) is not None else ("q_proj",)
    extras = tuple(name for name in ("indexer", "gate_proj") if getattr(attn, name, None) is not None)
    return (*queries, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj", *extras)


# A policy's parts that live in the text decoder (``model.*`` in a causal LM).
DECODER_PARTS = ("layers", "embed_tokens", "final_norm", "rotary_emb")


def decoder_path(model):
    """Where ``model`` keeps its text decoder: ``model`` in a causal LM, the
    language model's path in a vision-language model (``model.language_model``:
    the module its ``get_decoder()`` returns)."""
    if get_submodule(model, AUTO.layers) is not None or not hasattr(model, "get_decoder"):
        return "model"
    decoder = model.get_decoder()
    return next((name for name, module in model.named_modules() if module is decoder and name), "model")


# The vision-language families ds_tsp trains, each with where it keeps its tower (and projector), which ds_tsp
# holds 1/D per rank: Qwen's (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5), recognised by its tower and M-RoPE;
# LLaVA's (LLaVA 1.5: a CLIP-style tower, a projector, whole images of one size), Gemma 3's (a SigLIP tower, a
# pooling projector, LLaVA's layout, images attending to themselves both ways) and Mistral 3's (a Pixtral tower
# over images of their own sizes, a patch-merging projector), by their model types.
VISION_TOWERS = {"qwen": ("model.visual",), "llava": ("model.vision_tower", "model.multi_modal_projector"),
                 "gemma3": ("model.vision_tower", "model.multi_modal_projector"),
                 "mistral3": ("model.vision_tower", "model.multi_modal_projector")}
LLAVA_TYPES = ("llava",)
TYPED_FAMILIES = ("gemma3", "mistral3")  # families known by their model type alone


def vision_family(model):
    """The family (``VISION_TOWERS``) of a vision-language ``model``, or a
    refusal naming what it holds, before any weight moves."""
    inner, name = getattr(model, "model", None), type(model).__name__
    tower = getattr(inner, "visual", None)
    if tower is not None and hasattr(inner, "get_rope_index") and hasattr(tower, "spatial_merge_size"):
        return "qwen"
    if model.config.model_type in LLAVA_TYPES:
        return "llava"
    if model.config.model_type in TYPED_FAMILIES:
        return model.config.model_type
    held = [child for child, _ in (inner or model).named_children()]
    raise PolicyError(f"{name} is a vision-language model whose vision tower ds_tsp does not split yet (it holds "
                      f"{held}): ds_tsp trains Qwen's (a model.visual tower over pixel_values with image_grid_thw, "
                      f"and get_rope_index's M-RoPE positions), LLaVA's (model_type {' or '.join(LLAVA_TYPES)}), "
                      "Gemma 3's and Mistral 3's; train its text decoder alone (the causal LM of its text_config) "
                      "or leave tsp.enabled false")


def text_config(model):
    """The config of ``model``'s text decoder: its own, or a vision-language model's ``text_config``."""
    return model.config.get_text_config()


def get_submodule(model, path):
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _from_transformers(obj):
    return type(obj).__module__.startswith("transformers.")


def refuse_adapters(model):
    """Only ``ds_tsp.inject`` (``ds_tsp.injection.lora.take_adapters``) shards PEFT
    adapters: anywhere else a model holding them is refused by name rather
    than half-converted."""
    wrapped = next((module for module in model.modules() if type(module).__module__.startswith("peft.")), None)
    if wrapped is not None:
        raise PolicyError(f"{type(model).__name__} holds PEFT adapters ({type(wrapped).__name__}): hand the "
                          "PeftModel to ds_tsp.inject or ds_tsp.initialize, which shard them (ds_tsp.injection.lora)")


def resolve_policy(model, name="auto"):
    """The policy for ``model`` (``tsp.policy``), after checking its config and
    every layer fit it. A table applies only to the transformers classes it was
    written for; any other class of the same shape gets ``auto``."""
    if name != "auto" and name not in POLICIES:
        raise PolicyError(f"tsp.policy = {name!r} is unknown: choose \"auto\" or one of {sorted(POLICIES)}")
    refuse_adapters(model)
    model_class = type(model).__name__
    decoder = decoder_path(model)
    layers = get_submodule(model, f"{decoder}.layers")
    if layers is None or len(layers) == 0:
        raise PolicyError(f"{model_class} has no decoder layers at '{decoder}.layers': ds_tsp converts Hugging Face "
                          "causal LMs shaped like LlamaForCausalLM, and vision-language models holding one "
                          "(get_decoder())")
    config = text_config(model)
    if decoder != "model" and getattr(model.config, "vision_config", None) is None:
        raise PolicyError(f"{model_class} keeps its decoder layers at '{decoder}.layers' and is no vision-language "
                          f"model ({type(layers[0]).__name__}: a state-space model without attention, Mamba's or "
                          "Mamba-2's, keeps its blocks there): ds_tsp converts causal LMs shaped like "
                          "LlamaForCausalLM and the hybrids among them (Mamba-2 mixers beside attention layers under "
                          "model.layers: Bamba, Granite-4.0-H, Nemotron-H); train it with tsp.enabled false")
    if decoder != "model":
        vision_family(model)
    layer_class = type(layers[0]).__name__
    if name == "auto":
        audited = _from_transformers(model) and _from_transformers(layers[0])
        policy = next((p for p in POLICIES.values() if audited and p.layer_class == layer_class
                       and p.model_class == model_class), AUTO)
    else:
        policy = POLICIES[name]
    if policy is AUTO:
        policy = auto_layout(layers)
        policy = with_mlp_names(policy, layers)
        attentions = [get_submodule(layer, policy.attention) for layer in layers]
        attn = next((a for a in attentions if a is not None and not is_recurrent(a) and not is_latent_attention(a)),
                    None)
        if attn is not None and not hasattr(attn, "o_proj") and isinstance(getattr(attn, "out_proj", None), nn.Linear):
            policy = dataclasses.replace(policy, fused={**policy.fused, policy.attention: OUT_PROJ})
        final_norm = next((name for name in FINAL_NORM_NAMES if get_submodule(model, f"{decoder}.{name}") is not None
                           and get_submodule(model, f"{decoder}.norm") is None), None)
        if final_norm is not None:
            policy = dataclasses.replace(policy, final_norm=f"model.{final_norm}")
        if get_submodule(model, f"{decoder}.embed_tokens") is None and \
                get_submodule(model, f"{decoder}.{EMBEDDING_NAME}") is not None:
            policy = dataclasses.replace(policy, embed_tokens=f"model.{EMBEDDING_NAME}")
        if get_submodule(model, f"{decoder}.rotary_emb") is None:  # another name (LFM2-MoE's), or no positions
            rotary = next((name for name in ROTARY_NAMES if get_submodule(model, f"{decoder}.{name}") is not None),
                          None)
            # NoPE: the probe finds an attention that rotates all the same
            policy = dataclasses.replace(policy, rotary_emb=None if rotary is None else f"model.{rotary}")
    check_linear_layers(model_class, config, layers, policy)
    if decoder != "model":
        policy = dataclasses.replace(policy, **{part: f"{decoder}.{getattr(policy, part).removeprefix('model.')}"
                                                for part in DECODER_PARTS if getattr(policy, part) is not None})
    if policy.layer_class is None and per_layer_type(getattr(config, "rope_parameters", None)) and \
            getattr(config, "layer_types", None):
        policy = dataclasses.replace(policy, rotary_kind=layer_type)
    for path in (policy.embed_tokens, policy.final_norm, policy.rotary_emb, policy.lm_head):
        if path is not None and get_submodule(model, path) is None:
            raise PolicyError(f"{model_class} has no '{path}': ds_tsp cannot convert it")
    if policy.model_class not in (None, model_class):
        raise PolicyError(f"tsp.policy = {name!r} converts {policy.model_class}, whose forward its table was "
                          f"written for, but the model is a {model_class}: set tsp.policy to \"auto\"")
    # The config first: a feature it names (Llama 4's chunked attention) is a clearer refusal than the layer
    # shapes that feature comes with.
    check_config(model_class, config, policy)
    check_float32_tensors(model, layers, policy)
    for index, layer in enumerate(layers):
        check_layer(policy, layer, f"{policy.layers}.{index}")
    mlps = [get_submodule(layer, policy.mlp_of(layer)) for layer in layers if policy.mlp_of(layer) is not None]
    if any(mlp is not None and policy.is_sparse(mlp) for mlp in mlps):
        check_load_balancing(type(model), config)
    for index, layer in enumerate(layers):
        check_window(policy, layer, config, index, f"{policy.layers}.{index}")
    return policy


def auto_layout(layers):
    """Auto's policy for ``layers`` by the names they hold: one block a layer (``SINGLE_BLOCK``), or the layout
    of norms whose every name the first layer holds (``AUTO_LAYOUTS``), with its MLP where the layer keeps it
    (``MLP_NAMES``) and Granite-4.0-H's MoE beside its shared MLP."""
    if getattr(layers[0], SINGLE_BLOCK.single_block, None) is not None:
        return SINGLE_BLOCK
    policy = next((layout for layout in AUTO_LAYOUTS if all(hasattr(layers[0], norm)
                                                          for norm in layout.norm_names())), AUTO)
    if not hasattr(layers[0], policy.mlp):
        policy = dataclasses.replace(policy, mlp=next(
            (n for n in MLP_NAMES if getattr(layers[0], n, None) is not None), policy.mlp))
    if getattr(layers[0], "shared_mlp", None) is not None and \
            any(getattr(layer, GRANITE_EXPERTS.block, None) is not None for layer in layers):
        policy = dataclasses.replace(policy, mlp="shared_mlp", experts_beside_mlp=GRANITE_EXPERTS)
    if len({type(layer) for layer in layers}) > 1:
        policy = dataclasses.replace(policy, layouts_by_layer=True)
    return policy


def check_float32_tensors(model, layers, policy):
    """Refuse a model whose class keeps a tensor a TSP mixer packs with its
    weights in float32 (``_keep_in_fp32_modules_strict``: Flint's sinks, Kimi
    Linear's ``dt_bias``) while the model is narrower: the packed shard would
    round it to the weights' dtype, which Hugging Face's model does not."""
    kept = set(getattr(type(model), "_keep_in_fp32_modules_strict", None) or ()) | set(
        getattr(type(model), "_keep_in_fp32_modules", None) or ())
    dtype = getattr(model, "dtype", None)
    mixers = [layer.get_submodule(policy.mixer(layer)) for layer in layers if policy.mixer(layer) is not None
              and get_submodule(layer, policy.mixer(layer)) is not None]
    packed = sorted(name for name in kept & {*ATTENTION_TENSORS, *DELTA_NET_TENSORS, *MAMBA2_TENSORS}
                    if any(name.rpartition(".")[2] in {n.rpartition(".")[2] for n, _ in mixer.named_parameters()}
                           for mixer in mixers))
    if packed and dtype is not None and dtype.is_floating_point and dtype.itemsize < 4:
        raise PolicyError(f"{type(model).__name__} keeps its token mixers' {packed} in float32 "
                          f"(_keep_in_fp32_modules_strict) while the model is {dtype}; the TSP blocks pack them "
                          "with their weights, in their dtype: load the model in float32 (torch_dtype=torch.float32) "
                          "and train it under bf16 autocast, or leave tsp.enabled false")


def with_mlp_names(policy, layers):
    """The auto ``policy`` with its dense MLPs' names as the first dense MLP of
    ``layers`` holds them: gate and up rows fused in ``gate_up_proj`` (GLM's,
    ``FUSED_GATE_UP``), no gate at all (Nemotron's, Arcee's: ``gated_mlp``), the
    activation module named ``activation_fn`` (GLM's, Phi-3's). The probe then
    checks the layer computes what these names say."""
    mlps = [get_submodule(layer, policy.mlp_of(layer)) for layer in layers if policy.mlp_of(layer) is not None]
    mlp = next((mlp for mlp in mlps if mlp is not None and not policy.is_sparse(mlp)), None)
    if mlp is None:
        return policy
    if not hasattr(mlp, "gate_proj") and isinstance(getattr(mlp, "gate_up_proj", None), nn.Linear):
        policy = dataclasses.replace(policy, fused=FUSED_GATE_UP)
    elif all(isinstance(getattr(mlp, name, None), nn.Linear) for name in GRANITE_LINEARS):
        policy = dataclasses.replace(policy, fused={policy.mlp: GRANITE_LINEARS})
    elif all(isinstance(getattr(mlp, name, None), nn.Linear) for name in LFM_LINEARS):
        policy = dataclasses.replace(policy, fused={policy.mlp: LFM_LINEARS})
    elif not hasattr(mlp, "gate_proj") and all(isinstance(getattr(mlp, name, None), nn.Linear)
                                               for name in UNGATED_MLP_PROJECTIONS):
        policy = dataclasses.replace(policy, gated_mlp=False)
    if not hasattr(mlp, policy.activation):  # another name, or none (LFM's silu: the probe checks it)
        policy = dataclasses.replace(policy, activation=next(
            (name for name in ("activation_fn", "activation") if hasattr(mlp, name)), None))
    return policy


def load_balancing_loss(model_class):
    """How the causal LM ``model_class``'s forward adds a load-balancing loss:
    "switch" (Mixtral's ``load_balancing_loss_func``, which
    ``ds_tsp.blocks.moe.load_balancing`` computes over the whole sequence),
    None (it adds none: GLM-4.5, DeepSeek-V3), or "other"."""
    owner = next((klass for klass in model_class.__mro__ if "forward" in vars(klass)
                  and not klass.__module__.startswith("ds_tsp.")
                  and "load_balancing_loss_func" in _source(klass.forward)), None)  # a subclass may call super()
    if owner is None:
        return None
    ours = getattr(sys.modules[owner.__module__], "load_balancing_loss_func", None)
    if ours is not None and inspect.getsource(ours) == inspect.getsource(modeling_mixtral.load_balancing_loss_func):
        return "switch"
    return "other"


def _source(function):
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):  # defined where no source is kept
        return ""


def check_load_balancing(model_class, config):
    """Refuse a mixture-of-experts model whose forward would add a load-balancing loss ds_tsp does not compute."""
    if getattr(config, "output_router_logits", False) and load_balancing_loss(model_class) == "other":
        raise PolicyError(f"{model_class.__name__} adds a load-balancing loss other than Mixtral's "
                          "load_balancing_loss_func when config.output_router_logits is set, which ds_tsp does not "
                          "compute: set model.config.output_router_logits = False")


# Where checkpoints count their multi-token-prediction layers: DeepSeek-V3's and GLM-4.5's, Qwen3.5's and
# Qwen3-Next's.
MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def warn_unbuilt(model_class, config):
    """Say what a checkpoint describes that neither Hugging Face's model nor
    ds_tsp builds: multi-token-prediction layers (``MTP_KEYS``), whose weights
    Hugging Face's loader drops, so training learns the next-token loss alone,
    as Hugging Face's does."""
    for key in MTP_KEYS:
        layers = getattr(config, key, None)
        if layers:
            logger.warning("%s: config.%s = %s multi-token-prediction layer(s) are not built, by Hugging Face's "
                           "model nor by ds_tsp: their weights are neither loaded nor trained, and the loss is the "
                           "next-token loss alone", model_class, key, layers)


# What a heterogeneous config (transformers' per-layer attributes) may set per layer: the TSP attention reads its
# heads off the layer's config (``attention.heads_config``), as Gemma 4's full layers' wider heads and fewer
# key/value heads.
PER_LAYER_ATTRIBUTES = ("head_dim", "num_key_value_heads")


def check_config(model_class, config, policy):
    """Refuse any config attribute of ``policy``'s table whose value the TSP forward does not reproduce."""
    warn_unbuilt(model_class, config)
    # A heterogeneous config refuses global reads of what it sets per layer, and what the TSP layers read once.
    per_layer = sorted(config.per_layer_attributes or ()) if getattr(config, "is_heterogeneous", False) else []
    for key, accepts in policy.config.items():
        if key in per_layer:
            continue
        value = getattr(config, key, None)
        if not accepts.allows(value):
            fix = f": {accepts.fix}" if accepts.fix else ""
            raise PolicyError(f"{model_class} has config.{key} = {value!r}, which ds_tsp does not reproduce "
                              f"({accepts.why}){fix}; tsp.policy {policy.name!r}")
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if shared and shared >= config.num_hidden_layers:
        raise PolicyError(f"{model_class} has config.num_kv_shared_layers = {shared} of its {config.num_hidden_layers} "
                          "layers: every layer reuses keys and values none of them computes (an assistant model "
                          "reading another model's), which ds_tsp does not build: train it with tsp.enabled false")
    unread = [key for key in per_layer if key not in PER_LAYER_ATTRIBUTES]
    if unread:
        raise PolicyError(f"{model_class} has a heterogeneous config setting {unread} per layer, which ds_tsp does "
                          f"not convert: the TSP layers read only {list(PER_LAYER_ATTRIBUTES)} layer by layer")


def check_window(policy, layer, config, index, where):
    """The sliding window the TSP attention will use must be the one HF's mask uses for this layer."""
    if policy.hf_window is None or policy.mixer(layer) != policy.attention:
        return  # auto: ds_tsp.injection.probe compares the layer as a whole; a Gated DeltaNet has no window
    tsp_window = attention.sliding_window_of(layer.get_submodule(policy.attention), config)
    hf_window = policy.hf_window(config, index)
    if tsp_window != hf_window:
        raise PolicyError(f"{type(layer).__name__} at {where}: the Hugging Face forward masks with sliding window "
                          f"{hf_window}, but the TSP attention would take {tsp_window} (from the attention module's "
                          "or the config's sliding_window): set config.sliding_window to match the model, or "
                          "remove the attribute the architecture does not read")


def _holds_tensors(module):
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def check_own_tensors(module, where, layer_class, known=()):
    """Refuse parameters and buffers set directly on a module the TSP layer
    rebuilds (an extra per-head scale, say) other than ``known`` ones (an
    attention's ``sinks``): only its known submodules carry over."""
    own = [name for name, tensor in (*module._parameters.items(), *module._buffers.items())
           if tensor is not None and name not in known]
    if own:
        raise PolicyError(f"{layer_class} at {where} holds {own} directly (parameters or buffers outside any "
                          "known submodule), which the TSP layer would drop: this layer is not supported")


def check_layer(policy, layer, where):
    """Refuse a decoder layer that is not exactly a token mixer (attention, or a
    hybrid's recurrent mixer, or both side by side) + gated MLP + the policy's norms,
    or one of the two where the policy's layers hold one block (``single_block``)."""
    layer_class = type(layer).__name__
    if policy.layer_class is not None and layer_class != policy.layer_class:
        raise PolicyError(f"{where} is a {layer_class}, but tsp.policy = {policy.name!r} converts "
                          f"{policy.layer_class}: set tsp.policy to \"auto\" or the matching architecture")
    children = dict(layer.named_children())
    mixer, mlp = policy.mixer(layer), policy.mlp_of(layer)
    attn = children.get(mixer) if mixer is not None else None
    linear = attn is not None and is_recurrent(attn)
    side = policy.side_mixer(layer)
    recurrent = {name: recurrent_parts(children[name], f"{where}.{name}", layer_class)
                 for name in (mixer if linear else None, side) if name is not None}
    sparse = mlp in children and policy.is_sparse(children[mlp])
    latent = not linear and attn is not None and is_latent_attention(attn)
    if linear:
        mixer_parts = recurrent[mixer][0]
    elif latent:
        mixer_parts = latent_projections(attn)
    else:
        mixer_parts = policy.hf_projections(policy.attention, ATTENTION_PROJECTIONS)
        if attention.values_from_keys(attn):
            mixer_parts = tuple(p for p in mixer_parts if p != "v_proj")
        if attention.reuses_kv(attn):  # an earlier layer's keys and values
            mixer_parts = tuple(p for p in mixer_parts if p not in ("k_proj", "v_proj"))
        if attention.has_head_gate(attn):  # LFM3's gate a head
            mixer_parts = (*mixer_parts, "g_proj")
    expected = {**({} if mixer is None else {mixer: mixer_parts}),
                **{name: parts for name, (parts, _) in recurrent.items()},
                **({} if mlp is None else
                   {mlp: () if sparse else policy.hf_projections(policy.mlp, policy.mlp_projections())}),
                **{name: () for pair in policy.layout_of(layer).values() for name in pair if name is not None}}
    beside = policy.beside(layer)
    if beside is not None:
        check_experts_beside(layer, beside, where, layer_class)
        expected.update(dict.fromkeys((*beside.parts(), *beside.norms()), ()))
    inputs = policy.layer_inputs(layer)
    if inputs is not None:
        expected.update(dict.fromkeys(inputs.layer_parts(), ()))
    streams = policy.layer_streams(layer)
    if streams is not None:
        expected.update(dict.fromkeys(streams.layer_parts(), ()))
    check_own_tensors(layer, where, layer_class, LAYER_TENSORS)
    for child, projections in expected.items():
        if (sparse and child == mlp) or (beside is not None and child in beside.parts()):
            continue  # check_sparse_block below, check_experts_beside above
        if child not in children:
            raise PolicyError(f"{layer_class} at {where} has no '{child}' submodule: cannot convert it to a TSP layer")
        module = children[child]
        grandchildren = {n for n, m in module.named_children() if _holds_tensors(m)}
        missing = [p for p in projections if p not in grandchildren]
        # One pair of q/k norms at most: the first present is the pair the TSP attention takes, another is unexpected;
        # a layer reusing an earlier layer's keys has the query's alone.
        attends = child == mixer and not linear and not latent
        pair = next((pair for pair in ATTENTION_NORMS if grandchildren & set(pair)), ()) if attends else ()
        pair = set(pair[:1] if pair and attention.reuses_kv(module) else pair)
        unexpected = sorted(grandchildren - set(projections) - pair)
        missing += sorted(pair - grandchildren)
        if missing:
            holds = f" (it holds {unexpected}, projections under names ds_tsp does not read)" if unexpected else ""
            raise PolicyError(f"{layer_class} at {where}.{child} lacks {missing}{holds}: cannot convert it to a TSP "
                              "layer")
        if unexpected:
            raise PolicyError(f"{layer_class} at {where}.{child} has unexpected submodule(s) {unexpected} "
                              "that the TSP block would ignore: this layer is not supported")
        if projections and child in recurrent:
            check_own_tensors(module, f"{where}.{child}", layer_class, recurrent[child][1])
        elif projections:
            check_own_tensors(module, f"{where}.{child}", layer_class, ATTENTION_TENSORS if child == mixer else ())
            if latent and child == mixer:
                _check_latent_biases(module, f"{where}.{child}", layer_class)
                _check_indexer(module, f"{where}.{child}", layer_class)
            else:
                _check_biases(module, projections, f"{where}.{child}", layer_class)
    for name in children:
        if name not in expected and _holds_tensors(children[name]):
            raise PolicyError(f"{layer_class} at {where} has an unexpected submodule '{name}' "
                              "that the TSP layer would ignore: this layer is not supported")
    if attn is not None and not latent and not linear:
        # The latent attention reads its head sizes from the config (shards.LatentShapes).
        if not isinstance(getattr(attn, "head_dim", None), int):
            raise PolicyError(f"{layer_class} at {where}.{mixer} has no integer head_dim, which the TSP "
                              "attention reads to split heads: this layer is not supported")
        check_qk_norms(policy, attn, f"{where}.{mixer}", layer_class)
    if sparse:
        check_sparse_block(children[mlp], f"{where}.{mlp}", layer_class, policy.layer_class is None)
    elif mlp is not None and policy.activation is not None and not hasattr(children[mlp], policy.activation):
        raise PolicyError(f"{layer_class} at {where}.{mlp} has no {policy.activation}: not a gated MLP "
                          "ds_tsp knows")


# A Gated DeltaNet's submodules, in either of Hugging Face's layouts (ds_tsp.blocks.linear.shards), and the
# tensors it holds itself.
DELTA_NET_INPUTS = {"interleaved": ("in_proj_qkvz", "in_proj_ba"),
                    "split": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
                    "separate": ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj")}
DELTA_NET_TENSORS = ("A_log", "dt_bias")
# Kimi Linear's KDA's submodules (its decay's tensors in forget_gate).
KDA_MODULES = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_norm",
               "o_proj")


def delta_net_projections(module):
    """The submodules of a Gated DeltaNet (``ds_tsp.blocks.linear``) in its layout."""
    if is_kda(module):  # Kimi Linear's
        return KDA_MODULES
    if hasattr(module, "q_proj"):  # OLMo-Hybrid's
        return (*DELTA_NET_INPUTS["separate"], "conv1d", "o_norm", "o_proj")
    inputs = DELTA_NET_INPUTS["interleaved" if hasattr(module, "in_proj_qkvz") else "split"]
    return (*inputs, "conv1d", "norm", "out_proj")


def check_linear_layers(model_class, config, layers, policy):
    """Refuse first, by name, a model whose ``linear_attention`` layers (its
    config's ``layer_types``) hold anything but a recurrent mixer ds_tsp builds
    (``is_recurrent``), or whose ``hybrid`` layers hold none beside their
    attention: the clearest reason, before the parts such a model lacks."""
    for index, kind in enumerate(getattr(config, "layer_types", None) or ()):
        if kind == "hybrid" and index < len(layers) and policy.side_mixer(layers[index]) is None:
            raise PolicyError(f"{model_class}: layer {index} is a hybrid layer ({type(layers[index]).__name__}) that "
                              "does not hold a recurrent mixer beside its attention (Falcon-H1's mamba beside "
                              "self_attn): Zamba's shared transformer blocks are not built under TSP; train this "
                              "model with tsp.enabled false")
        if kind != "linear_attention" or index >= len(layers):
            continue
        layer = layers[index]
        name = policy.mixer(layer)
        mixer = None if name is None else get_submodule(layer, name)
        if mixer is None or not is_recurrent(mixer):
            raise PolicyError(f"{model_class}: layer {index} is a linear_attention layer holding "
                              f"{type(mixer or layer).__name__}, not a recurrent mixer of the kinds ds_tsp builds: a "
                              "Gated DeltaNet (in_proj_qkvz/in_proj_ba, in_proj_qkv/in_proj_z/in_proj_b/in_proj_a or "
                              "q/k/v/g/b/a_proj: Qwen3-Next's, Qwen3.5's, OLMo-Hybrid's; Kimi Linear's KDA), a "
                              "Mamba-2 mixer (in_proj, conv1d, dt_bias, A_log, D, a gated norm: Bamba's, "
                              "Granite-4.0-H's, Nemotron-H's) or a Mamba-1 mixer of Jamba's shape (x_proj, dt_proj, "
                              "its dt/B/C norms): train this model with tsp.enabled false")


def check_mamba2(module, where, layer_class):
    """A Mamba-2 mixer ds_tsp builds: integer sizes, ``in_proj`` rows packing
    ``z, x, B, C, dt``, a depthwise causal convolution over the ``x, B, C``
    channels, heads in whole groups, a gated norm over the inner width in
    ``n_groups`` groups, and an activation transformers names."""
    kind = type(module).__name__
    if not all(isinstance(getattr(module, name, None), int) for name in MAMBA2_SIZES) or \
            getattr(module, "activation", None) not in ACT2FN:
        raise PolicyError(f"{layer_class} at {where} ({kind}) lacks a Mamba-2 mixer's integer {MAMBA2_SIZES} or an "
                          "activation transformers names: ds_tsp does not build it")
    d_inner, state_rows = module.num_heads * module.head_dim, module.n_groups * module.ssm_state_size
    conv, channels = module.conv1d, d_inner + 2 * state_rows
    rows = 2 * d_inner + 2 * state_rows + module.num_heads
    if module.intermediate_size != d_inner or module.in_proj.out_features != rows or module.num_heads % module.n_groups:
        raise PolicyError(f"{layer_class} at {where} ({kind}): in_proj has {module.in_proj.out_features} rows, not "
                          f"z, x, B, C and dt's {rows}, or its {module.num_heads} heads of {module.head_dim} are not "
                          f"its intermediate_size {module.intermediate_size} in {module.n_groups} whole groups: "
                          "ds_tsp does not build it")
    if conv.groups != channels or conv.in_channels != channels or conv.padding[0] != conv.kernel_size[0] - 1:
        raise PolicyError(f"{layer_class} at {where} ({kind}) has a convolution {conv} that is not depthwise and "
                          f"causal over its {channels} x/B/C channels: ds_tsp does not build it")
    norm = module.norm
    if isinstance(norm, nn.Identity):  # Falcon-H1's with mamba_rms_norm off: the output gated by silu(z) alone
        return
    if not has_gated_norm(module):
        raise PolicyError(f"{layer_class} at {where}.norm ({type(norm).__name__}) is neither a gated norm with a "
                          "weight nor nn.Identity: ds_tsp does not build it; train this model with tsp.enabled false")
    if norm.weight.numel() != d_inner or (getattr(norm, "group_size", None) != d_inner // module.n_groups
                                          and getattr(norm, "n_groups", None) != module.n_groups):
        raise PolicyError(f"{layer_class} at {where}.norm ({type(norm).__name__}) is not a gated norm over "
                          f"the {d_inner} inner features in {module.n_groups} groups: ds_tsp does not build it; "
                          "train this model with tsp.enabled false")


def recurrent_parts(module, where, layer_class):
    """``(submodules, own tensors)`` of a recurrent mixer ds_tsp builds, once its kind's checks pass."""
    if is_mamba2(module):
        check_mamba2(module, where, layer_class)
        modules = MAMBA2_MODULES if has_gated_norm(module) else tuple(m for m in MAMBA2_MODULES if m != "norm")
        return modules, (*MAMBA2_TENSORS, "mup_vector")  # Falcon-H1's multipliers of in_proj's rows
    if is_mamba1(module):
        check_mamba1(module, where, layer_class)
        return (*MAMBA1_MODULES, *MAMBA1_NORMS), MAMBA1_TENSORS
    if is_short_conv(module):
        check_short_conv(module, where, layer_class)
        return SHORT_CONV_MODULES, ()
    check_delta_net(module, where, layer_class)
    return delta_net_projections(module), DELTA_NET_TENSORS


def check_mamba1(module, where, layer_class):
    """A Mamba-1 mixer ds_tsp builds: ``in_proj`` rows packing ``x`` and ``z``, a depthwise causal convolution
    over ``x``, ``x_proj`` to the time-step rank and ``B``, ``C`` without a bias, a biased ``dt_proj`` back to the
    channels, and an activation transformers names."""
    kind, d = type(module).__name__, module.out_proj.in_features
    conv, n, rank = module.conv1d, module.A_log.shape[-1], module.dt_proj.in_features
    if getattr(module, "activation", None) not in ACT2FN or module.in_proj.out_features != 2 * d or \
            module.x_proj.out_features != rank + 2 * n or module.x_proj.bias is not None or \
            module.dt_proj.bias is None or module.dt_proj.out_features != d or tuple(module.A_log.shape) != (d, n):
        raise PolicyError(f"{layer_class} at {where} ({kind}) is not a Mamba-1 mixer of Jamba's shape (in_proj "
                          "packing x and z, x_proj to dt, B and C without a bias, a biased dt_proj, A_log per "
                          "channel and state entry, an activation transformers names): ds_tsp does not build it; "
                          "train this model with tsp.enabled false")
    if conv.groups != d or conv.in_channels != d or conv.padding[0] != conv.kernel_size[0] - 1:
        raise PolicyError(f"{layer_class} at {where} ({kind}) has a convolution {conv} that is not depthwise and "
                          f"causal over its {d} channels: ds_tsp does not build it; train this model with "
                          "tsp.enabled false")


def check_short_conv(module, where, layer_class):
    """A gated short convolution ds_tsp builds: its convolution causal (padded by ``kernel - 1``, Hugging Face's
    forward keeping the first outputs) and undilated, with no activation."""
    conv = module.conv
    if conv.padding[0] != conv.kernel_size[0] - 1 or conv.dilation[0] != 1 or conv.stride[0] != 1 or \
            getattr(module, "activation", None) is not None:
        raise PolicyError(f"{layer_class} at {where} ({type(module).__name__}) has a convolution {conv} that is not "
                          "causal, undilated and without activation: ds_tsp does not build it; train this model "
                          "with tsp.enabled false")


def check_delta_net(module, where, layer_class):
    """A Gated DeltaNet ds_tsp builds: unbiased projections, a depthwise causal
    convolution over the queries', keys' and values' channels, a gated norm of
    one value head's width, and Hugging Face's head sizes; any other linear
    layer (Mamba-1's) is refused by name; Kimi Linear's KDA is checked by ``check_kda``."""
    kind = type(module).__name__
    if not is_gated_delta_net(module):
        raise PolicyError(f"{layer_class} at {where} is a {kind}, a linear-attention layer ds_tsp does not build "
                          "under TSP (it builds Gated DeltaNet layers fed by in_proj_qkvz/in_proj_ba, "
                          "in_proj_qkv/in_proj_z/in_proj_b/in_proj_a or q/k/v/g/b/a_proj: Qwen3-Next's, Qwen3.5's, "
                          "OLMo-Hybrid's): train this model with tsp.enabled false")
    if is_kda(module):
        check_kda(module, where, layer_class)
        return
    sizes = ("hidden_size", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
    if not all(isinstance(getattr(module, name, None), int) for name in sizes) or not isinstance(
            getattr(module, "activation", None), str):
        raise PolicyError(f"{layer_class} at {where} ({kind}) lacks Gated DeltaNet's integer {sizes} or its "
                          "activation name: ds_tsp does not build it")
    norm = linear_norm_name(module)
    biased = [name for name in delta_net_projections(module) if name not in ("conv1d", norm)
              and getattr(module.get_submodule(name), "bias", None) is not None]
    conv, channels = module.conv1d, 2 * module.num_k_heads * module.head_k_dim + module.num_v_heads * module.head_v_dim
    if biased or conv.groups != channels or conv.in_channels != channels or conv.padding[0] != conv.kernel_size[0] - 1:
        raise PolicyError(f"{layer_class} at {where} ({kind}) has biases on {biased} or a convolution "
                          f"{conv} that is not depthwise and causal over its {channels} query/key/value channels: "
                          "ds_tsp does not build it")
    if module.get_submodule(norm).weight.numel() != module.head_v_dim:
        raise PolicyError(f"{layer_class} at {where}.{norm} normalises {module.get_submodule(norm).weight.numel()} "
                          f"features, not one value head's {module.head_v_dim}: ds_tsp does not build it")


def check_kda(module, where, layer_class):
    """Kimi Linear's KDA as ds_tsp builds it: integer sizes, unbiased projections of ``num_heads`` heads of
    ``head_dim`` (gates' down projections to one head's width), a depthwise causal convolution over the
    queries', keys' and values' channels and a gated norm of one head's width."""
    kind = type(module).__name__
    sizes = ("hidden_size", "num_heads", "head_dim")
    if not all(isinstance(getattr(module, name, None), int) for name in sizes) or \
            not isinstance(getattr(module, "activation", None), str):
        raise PolicyError(f"{layer_class} at {where} ({kind}) lacks KDA's integer {sizes} or its activation name: "
                          "ds_tsp does not build it")
    rows, d, gate = module.num_heads * module.head_dim, module.head_dim, module.forget_gate
    shapes = {"q_proj": (rows, module.hidden_size), "k_proj": (rows, module.hidden_size),
              "v_proj": (rows, module.hidden_size), "b_proj": (module.num_heads, module.hidden_size),
              "g_a_proj": (d, module.hidden_size), "g_b_proj": (rows, d), "o_proj": (module.hidden_size, rows),
              "forget_gate.f_a_proj": (d, module.hidden_size), "forget_gate.f_b_proj": (rows, d)}
    wrong = [name for name, shape in shapes.items() if tuple(module.get_submodule(name).weight.shape) != shape
             or module.get_submodule(name).bias is not None]
    conv = module.conv1d
    if wrong or conv.bias is not None or conv.groups != 3 * rows or conv.padding[0] != conv.kernel_size[0] - 1 or \
            tuple(gate.dt_bias.shape) != (rows,) or gate.A_log.numel() != module.num_heads or \
            module.o_norm.weight.numel() != d:
        raise PolicyError(f"{layer_class} at {where} ({kind}) is not KDA of the shape ds_tsp builds ({wrong} of "
                          "another shape or biased, or its convolution biased, or it, dt_bias, A_log or o_norm of "
                          "another width)")


def check_qk_norms(policy, attn, where, layer_class):
    """q/k norms normalise each head (``head_dim`` features), or the whole
    projection where the policy's audited forward does (OLMo-2); under
    ``auto`` either, as the norms' widths say, and per head after the rotary
    embedding under Hunyuan's names (the probe compares the forward)."""
    names, after_rotary = attention.qk_norm_names(attn)
    if names is None:
        return
    if after_rotary and policy.layer_class is not None:
        raise PolicyError(f"{layer_class} at {where} norms queries and keys after the rotary embedding ({names}), "
                          f"which tsp.policy {policy.name!r} was not written for: use tsp.policy \"auto\"")
    for name, projection in zip(names, ("q_proj", "k_proj")):
        if attention.reuses_kv(attn) and projection == "k_proj":
            continue  # an earlier layer's keys, normed there
        weight = getattr(getattr(attn, name), "weight", None)
        if weight is None:  # a weightless norm (Llama 4's L2 norm): per head, as the probe checks
            continue
        if weight.dim() != 1:
            raise PolicyError(f"{layer_class} at {where}.{name} holds a weight per head ({tuple(weight.shape)}: "
                              "Cohere's use_qk_norm), which the TSP attention's q/k norms, one weight for every head "
                              "or one over the projection, do not carry: set config.use_qk_norm false only for a "
                              "model trained without it, or leave tsp.enabled false")
        width = weight.numel()
        spans_projection = policy.qk_norm_width == "projection" or (
            policy.layer_class is None and width == attn.get_submodule(projection).out_features)
        expected = attn.get_submodule(projection).out_features if spans_projection else attn.head_dim
        if after_rotary and spans_projection:
            raise PolicyError(f"{layer_class} at {where}.{name} normalises the whole {projection} after the rotary "
                              "embedding; the TSP attention norms the rotated queries and keys per head only: this "
                              "layer is not supported")
        if width != expected:
            kind = f"over the whole {projection} ({expected} features)" if spans_projection else \
                f"per head (head_dim = {expected} features)"
            raise PolicyError(f"{layer_class} at {where}.{name} normalises {width} features, but under tsp.policy "
                              f"{policy.name!r} the TSP attention norms queries and keys {kind}: this layer is not "
                              "supported")


def check_sparse_block(block, where, layer_class, auto=False):
    """Refuse a sparse MoE block that is not a router (``gate`` or ``router``) +
    fused experts (+ a shared expert, an MLP without biases, gated or not, at
    ``shared_expert`` with or without its gate, a Linear H -> 1 without bias, or
    at ``shared_experts``). Under ``auto`` the router's and the block's
    forwards are unknown: ``ds_tsp.injection.probe`` compares them with HF's."""
    block_class = type(block).__name__
    children = {n for n, m in block.named_children() if _holds_tensors(m)}
    routers = sorted(children & set(moe_plan.ROUTER_NAMES))
    shared = sorted(children & set(moe_plan.SHARED_NAMES))
    missing = [] if routers else [" or ".join(moe_plan.ROUTER_NAMES)]
    missing += [] if "experts" in children else ["experts"]
    if moe_plan.SHARED_GATE in children and shared != ["shared_expert"]:
        missing.append("shared_expert")
    unexpected = sorted(children - set(moe_plan.ROUTER_NAMES) - set(moe_plan.SHARED_NAMES)
                        - {"experts", moe_plan.SHARED_GATE}) + routers[1:] + shared[1:]
    if missing or unexpected:
        raise PolicyError(f"{layer_class} at {where} ({block_class}) lacks {missing} or has unexpected submodules "
                          f"{unexpected}: not a sparse MoE block ds_tsp knows")
    router = block.get_submodule(routers[0])
    handed = set(moe_plan.router_inputs(block, router))
    own = [name for name, tensor in (*block._parameters.items(), *block._buffers.items())
           if tensor is not None and name not in handed]
    if own:
        raise PolicyError(f"{layer_class} at {where} holds {own} directly (parameters or buffers outside any known "
                          "submodule, not handed to its router), which the TSP block would drop: this block is not "
                          "supported")
    for noise in ("jitter_noise", "input_jitter_noise", "router_jitter_noise"):
        if getattr(block, noise, 0):
            raise PolicyError(f"{layer_class} at {where} multiplies its input by random {noise} "
                              f"({getattr(block, noise)}) in training, which no sharded run can reproduce: build the "
                              f"model with router_jitter_noise = 0.0 (and input_jitter_noise = 0.0)")
    _check_experts(block.experts, f"{where}.experts", layer_class)
    if not auto and {n for n, _ in router.named_parameters()} != {"weight"}:
        raise PolicyError(f"{layer_class} at {where}.{routers[0]} is not a router with one weight (E, H)")
    if shared:
        expert = block.get_submodule(shared[0])
        grandchildren = {n for n, m in expert.named_children() if _holds_tensors(m)}
        if grandchildren not in (set(MLP_PROJECTIONS), set(UNGATED_MLP_PROJECTIONS)) or mlp_activation(expert) is None \
                or any(getattr(expert.get_submodule(p), "bias", None) is not None for p in grandchildren):
            raise PolicyError(f"{layer_class} at {where}.{shared[0]} is not an MLP (gated or not) without biases")
        check_own_tensors(expert, f"{where}.{shared[0]}", layer_class)
    gate = getattr(block, moe_plan.SHARED_GATE, None)
    if gate is not None and (not isinstance(gate, nn.Linear) or gate.out_features != 1 or gate.bias is not None):
        raise PolicyError(f"{layer_class} at {where}.{moe_plan.SHARED_GATE} is not a Linear(H, 1) without bias")


def check_experts_beside(layer, beside, where, layer_class):
    """Experts beside the MLP (``ExpertsBesideMLP``): a router returning Hugging Face's (scores, weights,
    indices), experts as transformers 5 lays them out, and the norms around them."""
    block = beside.hf_block(layer)
    missing = [name for name in beside.norms() if getattr(layer, name, None) is None] + \
        [name for name in (beside.router, beside.experts, beside.input_norm)
         if name and getattr(block, name, None) is None]
    if missing:
        raise PolicyError(f"{layer_class} at {where} holds {beside.experts} beside its MLP but lacks {missing}: "
                          "not a layout of experts beside an MLP ds_tsp knows (Gemma 4's, Granite-4.0-H's)")
    experts = hf_path(beside.block, beside.experts)
    _check_experts(layer.get_submodule(experts), f"{where}.{experts}", layer_class)


def _check_experts(experts, where, layer_class):
    """The experts as transformers 5 describes them (``ds_tsp.blocks.moe.experts``):
    3-D tensors of ``E`` experts named by its flags (``gate_up_proj`` or
    ``up_proj``, ``down_proj``, their ``_bias`` with ``has_bias``), computed
    by the module's own ``_apply_gate`` (or ``act_fn`` without a gate), no
    norm after the experts."""
    flags = expert_flags(experts)
    if flags["has_post_expert_norm"]:
        raise PolicyError(f"{layer_class} at {where} ({type(experts).__name__}) norms each expert's output "
                          "(has_post_expert_norm): this expert layout is not supported yet")
    up = "gate_up_proj" if flags["has_gate"] else "up_proj"
    expected = {up, "down_proj"} | ({f"{up}_bias", "down_proj_bias"} if flags["has_bias"] else set())
    tensors = {n: t for n, t in experts.named_parameters()}
    # Gated: the module's own _apply_gate, or act_fn over the halves of gate_up_proj (Llama 4's experts).
    activation = "_apply_gate" if flags["has_gate"] and hasattr(experts, "_apply_gate") else "act_fn"
    if set(tensors) != expected or any(tensors[n].dim() != (2 if n.endswith("_bias") else 3) for n in expected) \
            or len({t.shape[0] for t in tensors.values()}) != 1 or not hasattr(experts, activation):
        raise PolicyError(f"{layer_class} at {where} holds {sorted((n, tuple(t.shape)) for n, t in tensors.items())}: "
                          f"ds_tsp takes the 3-D tensors {sorted(expected)} of E experts and an {activation}, as "
                          f"transformers 5 lays them out under the flags {flags}")


def _check_latent_biases(module, where, layer_class):
    """A latent attention packs its down projections' biases together (``attention_bias``: both or none) and
    takes none on its per-head projections (no Hugging Face class has them)."""
    down = {p: module.get_submodule(p).bias is not None for p in ("q_a_proj", "kv_a_proj_with_mqa")
            if getattr(module, p, None) is not None}
    heads = [p for p in ("q_proj", "q_b_proj", "kv_b_proj", "gate_proj")
             if getattr(getattr(module, p, None), "bias", None) is not None]
    if len(set(down.values())) > 1 or heads:
        raise PolicyError(f"{layer_class} at {where} has biases on {[p for p, b in down.items() if b] + heads}: the "
                          "TSP latent attention takes biases on q_a_proj and kv_a_proj_with_mqa together, and none on "
                          "q_proj, q_b_proj, kv_b_proj or gate_proj")


# A lightning indexer's parts (ds_tsp.blocks.latent.indexer): its query and key projections, whose rows TSP splits,
# the key's LayerNorm and the head weights, kept whole.
INDEXER_PARTS = ("wq_b", "wk", "k_norm", "weights_proj")


def _check_indexer(module, where, layer_class):
    """A latent attention's lightning indexer must be DeepSeek-V3.2's: its four parts, bias-free projections."""
    indexer = getattr(module, "indexer", None)
    if indexer is None:
        return
    parts = {name for name, child in indexer.named_children() if _holds_tensors(child)}
    if parts != set(INDEXER_PARTS) or any(getattr(getattr(indexer, name), "bias", None) is not None
                                          for name in ("wq_b", "wk", "weights_proj")):
        raise PolicyError(f"{layer_class} at {where}.indexer holds {sorted(parts)}: the TSP indexer takes "
                          f"{list(INDEXER_PARTS)}, its projections without biases; this indexer is not supported")
    check_own_tensors(indexer, f"{where}.indexer", layer_class)


def _check_biases(module, projections, where, layer_class):
    """The TSP blocks pack q/k/v (and gate/up/down) biases together: all or none."""
    together = [p for p in projections if p != "o_proj"]
    has_bias = {p: getattr(module.get_submodule(p), "bias", None) is not None for p in together}
    if len(set(has_bias.values())) > 1:
        raise PolicyError(f"{layer_class} at {where} has biases on {[p for p, b in has_bias.items() if b]} but not "
                          f"on {[p for p, b in has_bias.items() if not b]}: the TSP block takes all or none")
