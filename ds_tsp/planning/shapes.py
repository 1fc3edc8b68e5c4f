"""What the planner knows of a model and a run: the decoder's sizes
(``ModelShape``, from a preset or a Hugging Face config), the bytes of each
number (``Precision``), the run's options (``Setting``), and how TSP cuts a
model (which sizes it refuses, each rank's attention shard, the folded
vocabulary's rows and logits tiles). Imports no torch."""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

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
}

# How TSP attention gets its backward: "fused" saves each head group's output
# and log-sum-exp and runs the fused backward (every backend of
# ds_tsp.attention_kernels for full causal attention: torch's flash ops on CPU
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


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder LM that the cost model needs (Hugging Face names)."""

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
    sliding_window: int | None = None
    name: str = "custom"

    @property
    def attention_params(self):
        """``Wa``: q, k, v, o projections (and q/k/v biases)."""
        H, d, nq, nkv = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
        return H * (nq + 2 * nkv) * d + nq * d * H + ((nq + 2 * nkv) * d if self.attention_bias else 0)

    @property
    def mlp_params(self):
        """``Wm``: gate, up, down (and gate/up biases)."""
        H, F = self.hidden_size, self.intermediate_size
        return 3 * H * F + (2 * F if self.mlp_bias else 0)

    @property
    def layer_replicated_params(self):
        """Per layer, what no strategy shards: two RMSNorm weights (and the down bias)."""
        return 2 * self.hidden_size + (self.hidden_size if self.mlp_bias else 0)

    @property
    def embedding_params(self):
        """Embedding and LM head (one matrix when tied), plus the final norm."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @property
    def params(self):
        return self.num_layers * (self.attention_params + self.mlp_params + self.layer_replicated_params) + \
            self.embedding_params


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
    offload_activations: bool = False  # activation_checkpointing.cpu_checkpointing: checkpoints in host memory
    offload_optimizer: bool = False  # zero_optimization.offload_optimizer.device "cpu"
    devices_per_node: int = DEFAULT_DEVICES_PER_NODE

    @property
    def precision(self):
        return PRECISIONS[self.dtype]

    @property
    def ranks_per_node(self):
        return min(self.devices, self.devices_per_node)


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


# Config keys of mixture-of-experts models (Mixtral; Qwen2/3-MoE and others).
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def model_shape(model):
    """``ModelShape`` from a preset name, a Hugging Face config (object, dict,
    directory or JSON file) or a ``ModelShape``."""
    if isinstance(model, ModelShape):
        return model
    fields = _shape_fields(model)
    if isinstance(fields.get("text_config"), dict):  # multimodal configs nest the decoder's
        fields = {**fields, **fields["text_config"]}
    experts = {key: fields[key] for key in MOE_KEYS if (fields.get(key) or 0) > 1}
    if experts:
        key, value = next(iter(experts.items()))
        raise ValueError(f"model config has {key} = {value}: the planner models dense decoder layers only, and "
                         "would count one expert's MLP for the whole layer; mixture-of-experts models are not "
                         "planned yet")
    try:
        heads = fields["num_attention_heads"]
        return ModelShape(
            hidden_size=fields["hidden_size"], intermediate_size=fields["intermediate_size"],
            num_layers=fields["num_hidden_layers"], num_heads=heads,
            num_kv_heads=fields.get("num_key_value_heads") or heads,
            head_dim=fields.get("head_dim") or fields["hidden_size"] // heads, vocab_size=fields["vocab_size"],
            tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
            attention_bias=bool(fields.get("attention_bias", fields.get("model_type") == "qwen2")),
            mlp_bias=bool(fields.get("mlp_bias", False)),
            sliding_window=fields.get("sliding_window") if fields.get("use_sliding_window", True) else None,
            name=str(fields.get("name", "custom")))
    except KeyError as err:
        raise ValueError(f"model config has no {err.args[0]!r}: the planner needs hidden_size, intermediate_size, "
                         f"num_hidden_layers, num_attention_heads and vocab_size") from None


# --- how TSP cuts a model ------------------------------------------------------------------------

def tsp_shape_problem(m, tsp_size):
    """Why TSP cannot run ``m`` at ``tsp_size`` (the rules of ``attention.HeadGroups``
    and ``mlp.shard_spec``), or None."""
    D, nq, nkv = tsp_size, m.num_heads, m.num_kv_heads
    if nq % D:
        return f"num_attention_heads {nq} is not divisible by {D}"
    if nq % nkv:
        return f"num_attention_heads {nq} is not a multiple of num_key_value_heads {nkv}"
    if (nkv >= D and nkv % D) or (nkv < D and D % nkv):
        return f"num_key_value_heads {nkv} and {D} do not divide one another"
    if m.intermediate_size % D:
        return f"intermediate_size {m.intermediate_size} is not divisible by {D}"
    return None


def tsp_attention_shard(m, tsp_size, tsp_rank):
    """Elements of rank ``tsp_rank``'s packed attention shard: its query heads and
    ``o_proj`` columns, and the key/value heads where it is their holder."""
    D, d, H = tsp_size, m.head_dim, m.hidden_size
    q_heads, kv_heads = m.num_heads // D, max(m.num_kv_heads // D, 1)
    bias = 1 if m.attention_bias else 0
    own = q_heads * d * (2 * H + bias)
    kv_replicas = max(D // m.num_kv_heads, 1)
    if tsp_rank % kv_replicas == 0:
        own += 2 * kv_heads * d * (H + bias)
    return own


def tsp_name(tsp_size, vocab_parallel=True):
    """The plan's name: ``TSP(D)`` with the folded vocabulary (``tsp.vocab_parallel``,
    the default), ``TSP(D) replicated vocab`` without it."""
    return f"TSP({tsp_size})" + ("" if vocab_parallel else " replicated vocab")


def vocab_rows_per_rank(vocab_size, tsp_size):
    """``Vs = ceil(V/D)``: embedding (and LM head) rows per rank under the folded
    vocabulary; ``V`` is padded to ``D*Vs`` with rows no token uses."""
    return -(-vocab_size // tsp_size)


def logits_tile_tokens(vocab_rows, local_tokens, logits_tile_mib=DEFAULT_LOGITS_TILE_MIB):
    """Tokens in the largest logits tile of the fused LM head + loss: the most
    whose fp32 ``(tokens, Vs)`` logits fit ``logits_tile_mib`` (as
    ``vocab.tile_tokens`` rounds), at least 1, at most the local tokens."""
    return min(local_tokens, max(1, int(logits_tile_mib * 2**20) // (FLOAT32 * vocab_rows)))
