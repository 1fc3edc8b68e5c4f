"""Analytic per-device cost model: memory, communication and FLOPs of DP, TP,
SP (Ulysses), CP (all-gather), TP+SP and TSP for a decoder LM (DESIGN.md 8).

Everything is per device and per optimizer step of one micro-batch ``B`` of
sequences of length ``S``, for a model replica spread over ``N`` devices (DP:
``N`` replicas of one device each). This module imports no torch.

Memory, in bytes, is a peak estimate: ``weights + grads + optimizer +
activations + logits + transient``.

* Model states: mixed precision is 16 B/param (2 bf16 weight, 2 bf16 grad, 12
  fp32 master + Adam m, v), fp32 is 4 + 4 + 8. ZeRO partitions them over the
  axis on which weights are replicated: DP's, and also the sequence axis of
  SP/CP/TP+SP, as DeepSpeed does for Ulysses (ALST). TP and TSP spend all ``N``
  devices on one replica: nothing is left for ZeRO to partition. TSP is
  planned twice: ``TSP(N)`` folds the vocabulary as ``tsp.vocab_parallel``
  (the default) does, ``ceil(V/N)`` rows of the embedding and the LM head per
  device; ``TSP(N) replicated vocab`` keeps both whole on every device.
* Activations are the tensors autograd saves for backward, counted tensor by
  tensor (Korthikanti et al. 2022, "Reducing Activation Recomputation", method).
  Their ``S*B*H*(34 + 5*a*S/H)`` bytes per layer is for a GPT layer (LayerNorm,
  4H GeLU MLP, dropout, softmax kept); the baselines here run the Hugging Face
  Llama layer with flash/SDPA attention, so the ``S^2`` term is absent (the
  kernel keeps a log-sum-exp instead) and the count is that layer's own, per
  token, ``e`` bytes per element:

      RMSNorm x2      2 * (4H + 4 + e*H)    fp32 copy of the input, 1/rms, normalised pre-weight
      q/k/v + MLP in  2 * e*H               the norms' outputs, saved by the projections
      attention       e*(nq + 2nkv)*d + e*nq*d + 4*nq     q, k, v (rotated), output, lse
      gated MLP       4 * e*F               gate, act(gate), up, act*up

  TP divides the head and ``F`` terms by ``t`` and keeps the rest replicated
  (AutoTP/Megatron without its sequence parallelism); Ulysses divides tokens
  by ``c`` and also saves the attention output before its return all-to-all;
  all-gather CP keeps the gathered full-sequence K/V. TSP is modelled by what
  ``ds_tsp.attention`` and ``ds_tsp.mlp`` actually save: the attention's local
  ``x``, ``q``, ``k``, ``v`` and, with its fused backward, each head group's
  output and lse (with flash-attn it recomputes them instead), the MLP's local
  ``x`` and each shard's gate and up projections, plus the same norms:
  ``8H + 8 + 4e*H + e*(nq + 2nkv)*d + 2e*F [+ e*nq*d + 4*nq]`` per local token. Both counts, with the
  embedding ids, cos/sin, final norm, LM-head input and loss, equal to the
  byte what ``torch.autograd.graph.saved_tensors_hooks`` sees on CPU
  (tests/test_plan.py; CPU SDPA saves the tensors flash attention does). The
  folded embedding saves no ids; the route it keeps instead (two int64 a
  token) is counted but not seen by the hooks.
  With activation checkpointing every layer keeps its input (``e*H`` per
  token, replicated over TP) and one layer is recomputed at a time.
* Logits: the model output ``e*V`` and the fp32 log-probabilities the loss
  saves, per local token (``V/t`` under TP's vocab-parallel head). TSP's folded
  vocabulary has neither: its fused LM head + loss saves the labels and the
  log-sum-exp only.
* Transient: the larger of the loss backward (dense logit gradients) and one
  layer's backward buffers; for TSP that is one head group's full-sequence K/V
  with its gradients, the weight shards in flight, the fp32 gradient reduces
  and ring accumulators, and one MLP shard's intermediates. The folded loss
  backward holds three fp32 logits tiles (``z``, softmax, ``dz``;
  ``tsp.logits_tile_mib`` each at most), the fp32 input gradient, two head
  shards and four fp32 shard-gradient buffers of the ring; the folded
  embedding's backward its shard's gradient in fp32 and the rows exchanged.

Communication is bytes RECEIVED per device, as ``ds_tsp.comm`` counts them
(ring algorithms): all-reduce of ``n`` bytes ``2(p-1)/p n``, all-gather and
reduce-scatter ``(p-1)/p`` of the full tensor, all-to-all ``(p-1)/p`` of the
local tensor, broadcast ``n`` per non-owner, reduce ``(p-1) n`` at the owner.
Per step = ``L * (forward + backward [+ forward again when checkpointing])``
plus the once-per-step syncs (embedding, LM head, replicated gradients, ZeRO);
for TSP, ``tsp_step_bytes_by_op`` per op, with the folded vocabulary's embedding
all-to-all and LM-head ring in ``tsp_vocab_bytes_by_op``.

FLOPs count matmuls (2 per multiply-add) and causal attention
(``2*B*S^2*nq*d`` forward); backward is 2x the matmuls and 2.5x attention
(flash); TSP adds the attention forward again when its backward is not fused,
and the LM head's forward again when the vocabulary is folded (the fused loss
recomputes its logits tile by tile).

The paper's setting (llama-7b shape, S = 128K, B = 1, 8 GPUs, bf16: 38.8 GB
TSP, 70.0 TP, 85.0 / 140.0 TP+SP) needs full activation checkpointing: without
it this model puts TP(8) at about 365 GB per GPU, past an MI300X's 192 GB, so
``--paper`` turns checkpointing on for every strategy. With it the estimates
keep the paper's order, TSP < TP < its TP+SP layouts; the measured peaks are
1.1-1.2x the estimates, TP's 0.98x (``format_table`` prints the comparison).
The paper describes TSP schedules for attention and the MLP only, so its TSP
is compared with ``TSP(8) replicated vocab``.
"""

import argparse
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path

GB = 1e9

PRESETS = {
    # The paper's "7B dense": 32 layers, hidden 4096.
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, head_dim=128, vocab_size=32000, tie_word_embeddings=False),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
}

# Peak GB per GPU reported by the paper: llama-7b shape, S = 128K, B = 1, 8 MI300X per replica.
# Its two TP+SP layouts are not named in DESIGN.md; their model states 16P/t leave
# about 31 GB of activations at t=2 x c=4 (85.0) and at t=1 x c=8 (140.0), so they
# are placed there (t=4 x c=2 would leave 58 GB, twice the other two). The paper
# describes TSP schedules for attention and the gated MLP only, so its TSP is
# set beside ds_tsp's TSP with the embedding and LM head whole on every rank.
PAPER_SETTING = dict(model="llama-7b", seq_len=131072, micro_batch=1, devices=8, dtype="bf16")
PAPER_PEAK_GB = {"TSP(8) replicated vocab": 38.8, "TP(8)": 70.0, "TP+SP(2x4)": 85.0, "SP-Ulysses(8)": 140.0}
PAPER_LABELS = {"SP-Ulysses(8)": "TP+SP t=1 x c=8"}
PAPER_DEVICE_GB = 192  # MI300X

# How TSP attention gets its backward: "fused" saves each head group's output
# and log-sum-exp and runs the fused flash backward (ds_tsp's torch-flash
# kernels: CPU, and CUDA fp16/bf16 without flash-attn, for full causal attention
# with head_dim <= 256); "recompute" saves q, k, v only and runs the attention
# forward again under autograd (flash-attn, fp32 on CUDA, sliding windows).
TSP_ATTENTION_BACKWARDS = ("fused", "recompute")

# ``tsp.logits_tile_mib``: the largest fp32 logits tile of the fused LM head + loss.
DEFAULT_LOGITS_TILE_MIB = 32.0

MEMORY_PARTS = ("weights", "grads", "optimizer", "activations", "logits", "transient")
FLOAT32 = 4
INT64 = 8


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
    optimizer: int


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

    @property
    def precision(self):
        return PRECISIONS[self.dtype]


@dataclass
class StrategyPlan:
    """One strategy's per-device costs. Bytes are per device; communication is
    bytes received per device; FLOPs per device per optimizer step."""

    name: str  # e.g. "TP+SP(2x4)"
    layout: str  # e.g. "tp=2 x sp=4"
    memory: dict  # MEMORY_PARTS -> bytes
    comm_forward_per_layer: float
    comm_backward_per_layer: float
    comm_per_step: float
    flops_per_step: float
    tokens_per_device: float  # tokens whose activations this device holds (B*S/c; B*S/D for TSP)
    setting: Setting
    feasible: bool = True
    notes: str = ""
    detail: dict = field(default_factory=dict)  # named pieces of the memory terms, bytes

    @property
    def total(self):
        return sum(self.memory.values())


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


def model_shape(model):
    """``ModelShape`` from a preset name, a Hugging Face config (object, dict,
    directory or JSON file) or a ``ModelShape``."""
    if isinstance(model, ModelShape):
        return model
    fields = _shape_fields(model)
    if isinstance(fields.get("text_config"), dict):  # multimodal configs nest the decoder's
        fields = {**fields, **fields["text_config"]}
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


# --- TSP: the exact byte counts of ds_tsp.attention and ds_tsp.mlp ------------------------------

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


def _tsp_attention_shard(m, tsp_size, tsp_rank):
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


DIRECTIONS = ("forward", "backward", "both")


def _by_direction(forward, backward, direction):
    """``forward``, ``backward`` or their sum, per op; int where whole."""
    counts = {"forward": forward, "backward": backward,
              "both": {op: forward.get(op, 0) + backward.get(op, 0) for op in {**forward, **backward}}}[direction]
    return {op: int(v) if Fraction(v).denominator == 1 else float(v) for op, v in counts.items()}


def tsp_bytes_by_op(model, seq_len, micro_batch, tsp_size, elem_bytes, direction, tsp_rank=None):
    """Bytes one rank receives in one TSP decoder layer (attention + MLP), per
    ``comm`` op name, as ``comm.counter`` counts them; ``direction`` is
    "forward", "backward" or "both".

    Forward: the other ranks' attention shards (``broadcast``), ``(D-1)/D`` of the
    MLP weights (``ring``) and ``(D-1)/D`` of the full-sequence K/V (``all_gather``):
    ``(D-1)/D * (Wa + Wm + 2*B*S*nkv*d)`` elements averaged over ranks. Backward:
    the same again (shards re-sent, K/V re-gathered), plus the ``reduce`` of this
    rank's own attention-shard gradient from the other ``D-1`` ranks and the
    ``D-1`` ring hops of MLP gradient accumulators, both in ``max(elem, 4)``
    bytes (sums in fp32 or wider), and the ``reduce_scatter`` of dK, dV in
    ``elem`` bytes. With ``nkv < D`` a key/value head is stored once, on the
    first rank of the heads sharing it, so shards differ by rank:
    ``tsp_rank=None`` gives the mean over ranks (own shard ``Wa/D``), a rank its
    exact count. Values are int when whole (always, for a given rank).
    """
    m = model_shape(model)
    D, e = tsp_size, elem_bytes
    acc = max(e, FLOAT32)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
    problem = tsp_shape_problem(m, D)
    if problem:
        raise ValueError(f"TSP cannot shard this model over {D} ranks: {problem}")
    if D == 1:
        return {}
    if seq_len % D:
        raise ValueError(f"seq_len {seq_len} is not a multiple of tsp_size {D}")
    own = Fraction(m.attention_params, D) if tsp_rank is None else _tsp_attention_shard(m, D, tsp_rank)
    mlp = Fraction((D - 1) * m.mlp_params, D)
    kv = (D - 1) * 2 * micro_batch * (seq_len // D) * m.num_kv_heads * m.head_dim
    forward = {"broadcast": e * (m.attention_params - own), "ring": e * mlp, "all_gather": e * kv}
    backward = {**forward, "ring": (e + acc) * mlp, "reduce": acc * (D - 1) * own, "reduce_scatter": e * kv}
    return _by_direction(forward, backward, direction)


def tsp_bytes_per_layer(model, seq_len, micro_batch, tsp_size, elem_bytes, direction, tsp_rank=None):
    """Total of ``tsp_bytes_by_op``: bytes one rank receives in one TSP layer
    (forward ``(D-1)/D * (Wa + Wm + 2*B*S*nkv*d) * elem`` on average)."""
    total = sum(Fraction(v) for v in tsp_bytes_by_op(model, seq_len, micro_batch, tsp_size, elem_bytes, direction,
                                                      tsp_rank).values())
    return int(total) if total.denominator == 1 else float(total)


# --- TSP outside the blocks: the folded vocabulary and the parameters every rank holds whole ------

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


def tsp_vocab_bytes_by_op(model, seq_len, micro_batch, tsp_size, elem_bytes, direction, rows_exchanged=None):
    """Bytes one rank receives for the folded vocabulary in one training step,
    per ``comm`` op name; ``direction`` is "forward", "backward" or "both".

    ``all_to_all``, the embedding: forward, the rows of this rank's local tokens
    that other ranks own; backward, the gradients of this rank's own rows for
    the other ranks' local tokens; ``H*elem`` bytes a token. ``rows_exchanged``
    is that pair of token counts for one batch (forward: this rank's local ids
    ``i`` with ``i // Vs != rank``; backward: the other ranks' local ids with
    ``i // Vs == rank``); by default the expected ``(D-1)/D * B*S/D`` each, for
    ids spread evenly over the vocabulary, which is also the mean over ranks.

    ``ring``, the fused LM head + loss: forward, ``D-1`` hops of a head shard
    (``Vs*H*elem``); backward, the same again plus ``D-1`` hops of its gradient
    accumulator in ``max(elem, 4)`` bytes. Tied models send the one shard.
    The loss's all-reduce is in ``tsp_step_bytes_by_op``, both settings have it.
    """
    m = model_shape(model)
    D, e, H = tsp_size, elem_bytes, m.hidden_size
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
    if D == 1:
        return {}
    if seq_len % D:
        raise ValueError(f"seq_len {seq_len} is not a multiple of tsp_size {D}")
    if rows_exchanged is None:
        expected = Fraction((D - 1) * micro_batch * seq_len, D * D)
        rows_exchanged = (expected, expected)
    shard = vocab_rows_per_rank(m.vocab_size, D) * H
    forward = {"all_to_all": rows_exchanged[0] * H * e, "ring": (D - 1) * shard * e}
    backward = {"all_to_all": rows_exchanged[1] * H * e, "ring": (D - 1) * shard * (e + max(e, FLOAT32))}
    return _by_direction(forward, backward, direction)


def _all_reduced(nbytes, group_size):
    """Bytes ``comm.all_reduce`` counts as received for one tensor of ``nbytes``."""
    return 2 * (group_size - 1) * nbytes // group_size


def tsp_step_bytes_by_op(model, seq_len, micro_batch, tsp_size, elem_bytes, *, vocab_parallel=True,
                         activation_checkpointing=False, tsp_rank=None, rows_exchanged=None):
    """Bytes one rank receives in one training step (forward and backward of one
    micro-batch), per ``comm`` op name, as ``comm.counter`` counts them.

    The layers: ``L`` times ``tsp_bytes_by_op(..., "both")``, plus its forward
    again with activation checkpointing. With ``vocab_parallel`` (the default),
    ``tsp_vocab_bytes_by_op(..., "both", rows_exchanged)``. ``all_reduce``: the
    loss (one scalar in ``max(elem, 4)`` bytes) and the gradients of what every
    rank holds whole, one all-reduce per tensor in ``elem`` bytes: the norms
    (and MLP down biases), and without ``vocab_parallel`` the embedding and the
    LM head too. ``tsp_rank`` is as in ``tsp_bytes_by_op``.
    """
    m = model_shape(model)
    D, e, H, L = tsp_size, elem_bytes, m.hidden_size, m.num_layers
    if D == 1:
        return {}
    counts = {op: L * v for op, v in tsp_bytes_by_op(m, seq_len, micro_batch, D, e, "both", tsp_rank).items()}
    if activation_checkpointing:  # every layer's forward runs again in backward
        for op, v in tsp_bytes_by_op(m, seq_len, micro_batch, D, e, "forward", tsp_rank).items():
            counts[op] += L * v
    if vocab_parallel:
        for op, v in tsp_vocab_bytes_by_op(m, seq_len, micro_batch, D, e, "both", rows_exchanged).items():
            counts[op] = counts.get(op, 0) + v
    whole = [H] * (2 * L + 1) + [H] * (L if m.mlp_bias else 0)  # norms, final norm, MLP down biases
    if not vocab_parallel:
        whole += [m.vocab_size * H] * (1 if m.tie_word_embeddings else 2)
    counts["all_reduce"] = _all_reduced(max(e, FLOAT32), D) + sum(_all_reduced(numel * e, D) for numel in whole)
    return counts


def _tsp_layer_saved_per_token(m, e, attention_backward):
    """Bytes ds_tsp's decoder layer saves per local token: two RMSNorms, the
    attention's local x, q, k, v (and, with the fused backward, its output and
    log-sum-exp in fp32 or wider), the MLP's local x and every shard's gate and
    up projections (``F`` values each over the D steps)."""
    H, nq = m.hidden_size, m.num_heads
    saved = 2 * (4 * H + 4 + e * H) + 2 * e * H + e * (nq + 2 * m.num_kv_heads) * m.head_dim
    saved += 2 * e * m.intermediate_size
    if attention_backward == "fused":
        saved += e * nq * m.head_dim + max(e, FLOAT32) * nq
    return saved


def _hf_layer_saved_per_token(m, e, t, ulysses):
    """Bytes a Hugging Face Llama layer saves per token (flash attention, no
    dropout), heads and F split over ``t`` tensor-parallel ranks."""
    H, d, nq = m.hidden_size, m.head_dim, m.num_heads
    replicated = 2 * (4 * H + 4 + e * H) + 2 * e * H
    attention = e * (nq + 2 * m.num_kv_heads) * d + e * nq * d + FLOAT32 * nq + (e * nq * d if ulysses else 0)
    return replicated + (attention + 4 * e * m.intermediate_size) / t


def _model_level_saved(m, e, tokens, rope_rows):
    """Outside the layers: input ids, cos/sin (``rope_rows`` rows of ``d``), the
    final norm and the LM head's input."""
    H = m.hidden_size
    return tokens * (INT64 + 4 * H + 4 + 2 * e * H) + rope_rows * 2 * m.head_dim * e


def _logits(m, p, tokens, vocab_shards):
    """(saved, held): labels and fp32 log-probs the loss saves, and the logits
    output the model returns."""
    vocab = m.vocab_size / vocab_shards
    return tokens * (INT64 + p.accumulate * vocab) + p.accumulate, tokens * p.element * vocab


def _model_states(params, p, zero_stage, zero_group):
    weights, grads, optimizer = params * p.weight, params * p.grad, params * p.optimizer
    if zero_group > 1:
        optimizer /= zero_group if zero_stage >= 1 else 1
        grads /= zero_group if zero_stage >= 2 else 1
        weights /= zero_group if zero_stage >= 3 else 1
    return {"weights": weights, "grads": grads, "optimizer": optimizer}


def _flops(m, setting, B, S, share, tsp, fused_head=False):
    """FLOPs per device per step: the replica's total for ``B`` sequences of ``S``
    times ``share``; ``fused_head``: the LM head + loss recomputes the logits in backward."""
    L, T = m.num_layers, B * S
    attn = 2 * B * S * S * m.num_heads * m.head_dim  # causal: half of QK^T and PV
    mm_attn, mm_mlp = 2 * T * m.attention_params, 2 * T * m.mlp_params
    head = 2 * T * m.vocab_size * m.hidden_size
    forward = L * (mm_attn + mm_mlp + attn) + head
    backward = L * (2 * (mm_attn + mm_mlp) + 2.5 * attn) + (3 if fused_head else 2) * head
    if tsp and setting.tsp_attention_backward == "recompute":  # the attention forward runs again
        backward += L * attn
    recompute = L * (mm_attn + mm_mlp + attn) if setting.activation_checkpointing else 0
    return (forward + backward + recompute) * share


HEAD_BACKWARD = ("logits_tiles", "grad_hidden", "head_shards_in_flight", "head_grad_accumulators")


def _tsp_vocab_memory(m, p, tsp_size, tokens, logits_tile_mib):
    """The folded vocabulary: what its fused LM head + loss saves for backward
    (labels and the log-sum-exp), and the named pieces of the head's backward
    transient (``HEAD_BACKWARD``) and of the embedding's."""
    H, e, acc = m.hidden_size, p.element, p.accumulate
    rows = vocab_rows_per_rank(m.vocab_size, tsp_size)
    tile = logits_tile_tokens(rows, tokens, logits_tile_mib)
    saved = tokens * (INT64 + acc)
    transient = {
        "logits_tiles": 3 * tile * rows * FLOAT32,  # z, softmax(z), dz of one token tile, fp32
        "grad_hidden": tokens * H * acc,
        "head_shards_in_flight": 2 * rows * H * e,  # the shard in use and the next one arriving
        # ring.ring_gradients: the own shard's partial kept for the end, the
        # accumulator travelling, the one arriving and this step's partial
        "head_grad_accumulators": 4 * rows * H * acc,
        # the local tokens' row gradients in owner order and the rows returned
        # (N expected), the shard's gradient summed in fp32 and cast back
        "embedding_backward": 2 * tokens * H * e + rows * H * (acc + e),
    }
    return saved, transient


def _plan_tsp(setting, vocab_parallel):
    """TSP: ds_tsp's blocks, with the vocabulary folded (``tsp.vocab_parallel``) or
    the embedding and LM head whole on every rank."""
    m, p, D = setting.model, setting.precision, setting.devices
    e, acc, B, L, H = p.element, p.accumulate, setting.micro_batch, m.num_layers, m.hidden_size
    problem = tsp_shape_problem(m, D)
    S = -(-setting.seq_len // (2 * D)) * 2 * D  # zigzag pads to a multiple of 2D
    tokens = B * S // D
    attn_shard = max(_tsp_attention_shard(m, D, r) for r in range(D))
    mlp_shard = m.mlp_params / D
    vocab_rows = vocab_rows_per_rank(m.vocab_size, D) if vocab_parallel else m.vocab_size
    vocab = vocab_rows * H * (1 if m.tie_word_embeddings else 2)
    states = _model_states(L * (attn_shard + mlp_shard + m.layer_replicated_params) + H + vocab, p,
                           setting.zero_stage, 1)

    layer_saved = tokens * _tsp_layer_saved_per_token(m, e, setting.tsp_attention_backward)
    # cos/sin of the local tokens plus, per sequence, the row of the largest position (model.rotary_tables)
    model_saved = _model_level_saved(m, e, tokens, rope_rows=tokens + B)
    if setting.activation_checkpointing:
        layers = L * tokens * e * H + layer_saved
    else:
        layers = L * layer_saved
    if vocab_parallel:  # no logits tensor: the loss saves labels and the log-sum-exp
        logits_saved, vocab_transient = _tsp_vocab_memory(m, p, D, tokens, setting.logits_tile_mib)
        logits_held = 0
        loss_backward = sum(vocab_transient[k] for k in HEAD_BACKWARD)
        # The embedding's backward keeps its route on ctx, not as saved tensors: the ids of its own rows that
        # every rank's tokens use (N expected) and the local tokens' order, instead of the ids nn.Embedding saves.
        model_saved -= tokens * INT64
        route = 2 * tokens * INT64
    else:
        logits_saved, logits_held = _logits(m, p, tokens, 1)
        vocab_transient = {"loss_backward": tokens * m.vocab_size * (2 * acc + e)}
        loss_backward = vocab_transient["loss_backward"]
        route = 0

    kv_heads = max(m.num_kv_heads // D, 1)
    detail = {
        "saved_for_backward": (model_saved + L * layer_saved + logits_saved
                               if not setting.activation_checkpointing else None),
        "embedding_route": route,
        "logits_output": logits_held,
        # backward of one head group: K, V, the gather buffer, the two dK/dV
        # copies in the model dtype and their fp32 sums, over the full sequence
        "kv_head_group": 2 * B * S * kv_heads * m.head_dim * (4 * e + acc),
        "weight_shards_in_flight": 2 * (attn_shard + mlp_shard) * e,
        # every head group's gradient reduce stays posted until the layer ends
        "attention_grad_reduces": m.attention_params * acc,
        "mlp_accumulators": 3 * mlp_shard * acc,  # travelling, arriving, own partial
        "mlp_shard_intermediates": 6 * tokens * (m.intermediate_size / D) * e,
        "grad_x": tokens * H * (acc + 2 * e),
        **vocab_transient,
    }
    layer_backward = sum(detail[k] for k in ("kv_head_group", "weight_shards_in_flight", "attention_grad_reduces",
                                              "mlp_accumulators", "mlp_shard_intermediates", "grad_x"))
    # The loss's backward (folded: the head's ring) is the first thing backward
    # runs, before any parameter holds a gradient: it overlaps the gradients'
    # memory rather than adding to it. The embedding's runs last, with all of them.
    loss_backward_beyond_grads = max(loss_backward - states["grads"], 0)
    memory = {**states, "activations": model_saved + route + layers, "logits": logits_saved + logits_held,
              "transient": max(layer_backward, loss_backward_beyond_grads,
                               vocab_transient.get("embedding_backward", 0))}

    if problem:
        forward = backward = per_step = float("nan")
    else:
        forward = tsp_bytes_per_layer(m, S, B, D, e, "forward")
        backward = tsp_bytes_per_layer(m, S, B, D, e, "backward")
        per_step = sum(tsp_step_bytes_by_op(m, S, B, D, e, vocab_parallel=vocab_parallel,
                                            activation_checkpointing=setting.activation_checkpointing).values())
    notes = problem or ("" if S == setting.seq_len else f"sequence padded to {S}")
    return StrategyPlan(tsp_name(D, vocab_parallel), f"tsp={D}, vocab_parallel={str(vocab_parallel).lower()}",
                        memory, forward, backward, per_step,
                        _flops(m, setting, B, S, 1 / D, tsp=True, fused_head=vocab_parallel), tokens, setting,
                        feasible=problem is None, notes=notes, detail=detail)


def _baseline_problem(m, t, c, kind, seq_len):
    nq, nkv = m.num_heads, m.num_kv_heads
    if nq % t or (nkv % t and t % nkv) or m.intermediate_size % t:
        return f"heads {nq}/{nkv} or intermediate_size {m.intermediate_size} do not split over tp={t}"
    if kind == "ulysses" and (nq // t) % c:
        return f"{nq // t} query heads per TP rank do not split over sp={c}"
    if kind == "allgather" and seq_len % (2 * c):
        return f"seq_len {seq_len} is not a multiple of 2*cp = {2 * c}"
    return None


def _plan_baseline(setting, name, layout, t, c, dp, kind):
    """DP, TP, SP (Ulysses), CP (all-gather) and TP+SP: Hugging Face layers with
    heads and F split over ``t``, tokens over ``c``, ``dp`` replicas."""
    m, p = setting.model, setting.precision
    e, acc, B, S, L, H = p.element, p.accumulate, setting.micro_batch, setting.seq_len, m.num_layers, m.hidden_size
    d, nq = m.head_dim, m.num_heads
    kv_heads = max(m.num_kv_heads / t, 1)  # replicated when fewer than t
    tokens = B * S / c
    replica_group = c * dp  # ranks holding the same weights: gradient sync and ZeRO
    layer_params = (m.attention_params - 2 * m.num_kv_heads * d * H) / t + 2 * kv_heads * d * H + \
        m.mlp_params / t + m.layer_replicated_params
    embedding = m.embedding_params / t
    states = _model_states(L * layer_params + embedding, p, setting.zero_stage, replica_group)

    layer_saved = tokens * _hf_layer_saved_per_token(m, e, t, ulysses=kind == "ulysses" and c > 1)
    if kind == "allgather" and c > 1:  # the gathered full-sequence K/V replaces the local one
        layer_saved += (B * S - tokens) * 2 * kv_heads * d * e
    model_saved = _model_level_saved(m, e, tokens, rope_rows=S / c)  # HF rotary: one row per position
    layers = (L * tokens * e * H + layer_saved) if setting.activation_checkpointing else L * layer_saved
    logits_saved, logits_held = _logits(m, p, tokens, t)

    detail = {
        "saved_for_backward": (model_saved + L * layer_saved + logits_saved
                               if not setting.activation_checkpointing else None),
        "logits_output": logits_held,
        "mlp_grads": 3 * tokens * m.intermediate_size / t * e,
        "grad_x": 2 * tokens * H * e,
        "all_to_all_buffers": tokens * (nq / t + 2 * kv_heads) * d * e if kind == "ulysses" and c > 1 else 0,
        "full_kv_grads": 2 * B * S * 2 * kv_heads * d * e if kind == "allgather" and c > 1 else 0,
        "zero3_gathered_layers": 2 * layer_params * e if setting.zero_stage >= 3 and replica_group > 1 else 0,
        "loss_backward": tokens * m.vocab_size / t * (2 * acc + e),
    }
    layer_backward = sum(detail[k] for k in ("mlp_grads", "grad_x", "all_to_all_buffers", "full_kv_grads",
                                              "zero3_gathered_layers"))
    memory = {**states, "activations": model_saved + layers, "logits": logits_saved + logits_held,
              "transient": max(layer_backward, detail["loss_backward"])}

    def all_reduce(group, nbytes):
        return 2 * (group - 1) / group * nbytes

    def gather(group, nbytes):  # all-gather / reduce-scatter / all-to-all: (p-1)/p of the full tensor
        return (group - 1) / group * nbytes

    forward = all_reduce(t, tokens * H * e) * 2  # after attention and after the MLP
    if kind == "ulysses":
        forward += gather(c, tokens * (2 * nq / t + 2 * kv_heads) * d * e)  # q, k, v in; output back
    if kind == "allgather":
        forward += gather(c, B * S * 2 * kv_heads * d * e)
    zero3 = setting.zero_stage >= 3 and replica_group > 1
    if zero3:
        forward += gather(replica_group, layer_params * e)
    backward = forward  # input-gradient all-reduces, reversed all-to-alls, dK/dV reduce-scatter, re-gather
    if setting.zero_stage >= 1:
        backward += gather(replica_group, layer_params * p.grad)  # reduce-scatter of gradients
    else:
        backward += all_reduce(replica_group, layer_params * p.grad)
    recompute = forward if setting.activation_checkpointing else 0
    per_step = L * (forward + backward + recompute)
    per_step += 2 * all_reduce(t, tokens * H * e)  # vocab-parallel embedding output, LM-head input grad
    per_step += (gather if setting.zero_stage >= 1 else all_reduce)(replica_group, embedding * p.grad)
    if setting.zero_stage in (1, 2):  # updated weights gathered back after the step
        per_step += gather(replica_group, (L * layer_params + embedding) * e)
    if zero3:
        per_step += 2 * gather(replica_group, embedding * e)

    problem = _baseline_problem(m, t, c, kind, S)
    return StrategyPlan(name, layout, memory, forward, backward, per_step,
                        _flops(m, setting, B, S, 1 / (t * c), tsp=False), tokens, setting,
                        feasible=problem is None, notes=problem or "", detail=detail)


def plan(model, seq_len, micro_batch, devices, dtype="bf16", zero_stage=0, activation_checkpointing=False,
         tsp_attention_backward=None, logits_tile_mib=DEFAULT_LOGITS_TILE_MIB):
    """Per-device costs of every strategy on ``devices`` devices: DP, TP, SP
    (Ulysses), CP (all-gather), TP+SP for every ``t x c = devices`` with both
    above 1, and TSP with the embedding and LM head whole on every rank and
    with them folded (``tsp_name``). See the module docstring for what is counted.

    ``tsp_attention_backward`` ("fused" or "recompute", see
    ``TSP_ATTENTION_BACKWARDS``) defaults to what ds_tsp's own kernels do:
    fused for full causal attention with ``head_dim <= 256``.
    ``logits_tile_mib`` is ``tsp.logits_tile_mib``."""
    if dtype not in PRECISIONS:
        raise ValueError(f"dtype must be one of {', '.join(PRECISIONS)}, not {dtype!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, not {zero_stage!r}")
    for label, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("devices", devices)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be an integer >= 1, not {value!r}")
    m = model_shape(model)
    if tsp_attention_backward is None:
        tsp_attention_backward = "fused" if m.sliding_window is None and m.head_dim <= 256 else "recompute"
    if tsp_attention_backward not in TSP_ATTENTION_BACKWARDS:
        raise ValueError(f"tsp_attention_backward must be one of {TSP_ATTENTION_BACKWARDS}, "
                         f"not {tsp_attention_backward!r}")
    if not logits_tile_mib > 0:
        raise ValueError(f"logits_tile_mib must be > 0, not {logits_tile_mib!r}")
    setting = Setting(m, seq_len, micro_batch, devices, dtype, zero_stage, bool(activation_checkpointing),
                      tsp_attention_backward, logits_tile_mib)
    N = devices
    plans = [_plan_baseline(setting, f"DP({N})", f"dp={N}", 1, 1, N, "none"),
             _plan_baseline(setting, f"TP({N})", f"tp={N}", N, 1, 1, "none"),
             _plan_baseline(setting, f"SP-Ulysses({N})", f"sp={N}", 1, N, 1, "ulysses"),
             _plan_baseline(setting, f"CP-allgather({N})", f"cp={N}", 1, N, 1, "allgather")]
    for t in range(2, N):
        if N % t == 0:
            plans.append(_plan_baseline(setting, f"TP+SP({t}x{N // t})", f"tp={t} x sp={N // t}", t, N // t, 1,
                                        "ulysses"))
    plans += [_plan_tsp(setting, vocab_parallel=False), _plan_tsp(setting, vocab_parallel=True)]
    return plans


def recommend(plans, memory_per_device_bytes):
    """The feasible plans whose peak fits ``memory_per_device_bytes``, best first:
    fewest bytes received per FLOP computed (the step's communication against
    its compute; one fast interconnect is assumed for all ``N`` devices, so a
    layout that would spill across nodes is not penalised), then least memory."""
    fits = [p for p in plans if p.feasible and p.total <= memory_per_device_bytes]
    return sorted(fits, key=lambda p: (p.comm_per_step / p.flops_per_step, p.total))


def _gb(nbytes):
    return f"{nbytes / GB:.1f}"


def _paper_footer(plans, paper):
    setting = plans[0].setting
    by_name = {p.name: p for p in plans}
    lines = []
    expected = {**PAPER_SETTING, "model": model_shape(PAPER_SETTING["model"])}
    ours = dict(model=replace(setting.model, name=expected["model"].name), seq_len=setting.seq_len,
                micro_batch=setting.micro_batch, devices=setting.devices, dtype=setting.dtype)
    if ours != expected:
        lines.append("WARNING: the paper's numbers are for llama-7b, S=131072, B=1, 8 devices, bf16; this table "
                     "is for another setting, so the two columns do not compare.")
    ratios = {n: paper[n] * GB / by_name[n].total for n in paper if n in by_name}
    if ratios:
        lines.append(f"Paper column: peak GB/GPU measured on MI300X by the paper; its 140.0 GB layout is TP+SP with "
                     f"t=1 x c=8 (= SP-Ulysses(8) here) and its 85.0 GB layout t=2 x c=4, inferred from their model "
                     f"states (16P/t = {16 * setting.model.params / 2 / GB:.0f} and "
                     f"{16 * setting.model.params / GB:.0f} GB leave about 31 GB of activations each).")
        lines.append("Difference, measured / estimated: " + ", ".join(f"{n} {r:.2f}x" for n, r in ratios.items()) +
                     ". The estimate counts tensors only: no caching-allocator reserve or fragmentation, no "
                     "RCCL/NCCL or kernel workspaces, no fp32 gradient-accumulation buffers, and it models ds_tsp's "
                     "TSP, not the paper's implementation, whose buffers are not published.")
    if setting.activation_checkpointing:
        unckpt = {p.name: p for p in plan(setting.model, setting.seq_len, setting.micro_batch, setting.devices,
                                          setting.dtype, setting.zero_stage, activation_checkpointing=False,
                                          tsp_attention_backward=setting.tsp_attention_backward)}
        tp = unckpt.get(f"TP({setting.devices})")
        lines.append(f"Assumed, as the paper must: full activation checkpointing for every strategy; without it "
                     f"TP({setting.devices}) alone would need {_gb(tp.total)} GB per GPU "
                     f"(> {PAPER_DEVICE_GB} GB on an MI300X) against the paper's 70.0.")
    tsp, tp = by_name.get(tsp_name(setting.devices, False)), by_name.get(f"TP({setting.devices})")
    paper_hybrids = sorted((p for p in plans if p.name in paper and p not in (tsp, tp)), key=lambda p: p.total)
    folded = by_name.get(tsp_name(setting.devices))
    if tsp and folded:
        lines.append(f"The paper describes TSP schedules for attention and the gated MLP only, so its TSP is set "
                     f"beside {tsp.name}; with the vocabulary folded as well (ds_tsp's default) {folded.name} "
                     f"needs {_gb(folded.total)} GB.")
    if tsp and tp and paper_hybrids:
        holds = tsp.total < tp.total < paper_hybrids[0].total
        lines.append(f"Ordering TSP < TP < the paper's TP+SP layouts: {'reproduced' if holds else 'NOT reproduced'} "
                     f"({_gb(tsp.total)} < {_gb(tp.total)} < "
                     f"{' / '.join(_gb(p.total) for p in paper_hybrids)} GB).")
        for hybrid in (p for p in plans if p.name.startswith("TP+SP") and p.name not in paper):
            if hybrid.total <= tp.total:
                states = sum(hybrid.memory[k] - tp.memory[k] for k in ("weights", "grads", "optimizer"))
                lines.append(f"{hybrid.name} ({hybrid.layout}), not one of the paper's layouts, comes out below "
                             f"TP({setting.devices}) here ({_gb(hybrid.total)} GB): splitting the sequence saves "
                             f"{_gb(tp.memory['activations'] - hybrid.memory['activations'])} GB of TP's replicated "
                             f"activations for {_gb(states)} GB more model states.")
    return lines


def format_table(plans, paper=None):
    """Markdown table of ``plans`` (from one ``plan`` call) with a footer of the
    assumptions; ``paper`` (``{plan name: GB}``, e.g. ``PAPER_PEAK_GB``) adds a column."""
    setting = plans[0].setting
    m, p = setting.model, setting.precision
    head = ["strategy", "layout", "weights", "grads", "optim", "activ", "logits", "transient", "**peak GB**"]
    if paper:
        head.append("paper GB")
    head += ["fwd MB/layer", "bwd MB/layer", "GB/step", "TFLOP/step"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for plan_ in plans:
        cells = [plan_.name + ("" if plan_.feasible else " (infeasible)"), plan_.layout]
        cells += [_gb(plan_.memory[k]) for k in MEMORY_PARTS] + [f"**{_gb(plan_.total)}**"]
        if paper:
            value = paper.get(plan_.name)
            cells.append("" if value is None else f"{value:.1f}" + (f" ({PAPER_LABELS[plan_.name]})"
                                                                      if plan_.name in PAPER_LABELS else ""))
        cells += [f"{plan_.comm_forward_per_layer / 1e6:.1f}", f"{plan_.comm_backward_per_layer / 1e6:.1f}",
                  f"{plan_.comm_per_step / GB:.1f}", f"{plan_.flops_per_step / 1e12:.0f}"]
        rows.append("| " + " | ".join(cells) + " |")
    footer = [
        f"{m.name}: {m.params / 1e9:.2f}B params, L={m.num_layers}, H={m.hidden_size}, F={m.intermediate_size}, "
        f"heads {m.num_heads}/{m.num_kv_heads}, d={m.head_dim}, "
        f"V={m.vocab_size}; S={setting.seq_len}, B={setting.micro_batch}, {setting.devices} devices, "
        f"{setting.dtype}, ZeRO-{setting.zero_stage}, activation checkpointing "
        f"{'on' if setting.activation_checkpointing else 'off'}, TSP attention backward "
        f"{setting.tsp_attention_backward}.",
        f"Memory per device, GB = 1e9 B: model states {p.weight + p.grad + p.optimizer} B/param "
        f"({p.weight} weight + {p.grad} grad + {p.optimizer} optimizer), ZeRO over the weight-replica axis only; "
        f"activations = tensors saved for backward (HF Llama layer, flash attention, for the baselines; "
        f"ds_tsp's own saved tensors for TSP); logits = output + fp32 log-probs; transient = max(loss backward, "
        f"one layer's backward buffers).",
        f"TSP vocabulary: {tsp_name(setting.devices)} folds it (tsp.vocab_parallel, the default): each rank holds "
        f"ceil(V/D) rows of the embedding and the LM head, and the fused head + loss keeps no logits, only the labels "
        f"and fp32 log-sum-exp, with {setting.logits_tile_mib:g} MiB fp32 logits tiles (tsp.logits_tile_mib); "
        f"{tsp_name(setting.devices, False)} keeps both whole on every rank (vocab_parallel false).",
        "Communication: bytes received per device (ring all-reduce 2(p-1)/p, all-gather / reduce-scatter / "
        "all-to-all (p-1)/p, broadcast 1 per non-owner, reduce (p-1) at the owner); per step = L x (fwd + bwd"
        + (" + recomputed fwd" if setting.activation_checkpointing else "") + ") + embedding/head/replicated syncs.",
        "TSP per layer (elements, x dtype bytes): fwd (D-1)/D (Wa + Wm + 2BS nkv d); bwd = fwd + (D-1)/D (Wa + Wm) "
        "in fp32 (gradient reduce, ring accumulators) + (D-1)/D 2BS nkv d (dK, dV reduce-scatter). Folded vocabulary, "
        "per step: embedding all-to-all (D-1)/D BSH/D fwd and bwd, LM-head ring (D-1) ceil(V/D) H fwd and bwd + the "
        "same in fp32 bwd (gradient accumulators); replicated vocabulary: the embedding and head gradients "
        "all-reduced instead.",
    ]
    if paper:
        footer += _paper_footer(plans, paper)
    return "\n".join(rows) + "\n\n" + "\n".join(f"* {line}" for line in footer) + "\n"


def plot_memory_vs_seq(model, seq_lens, devices, path, micro_batch=1, dtype="bf16", zero_stage=0,
                       activation_checkpointing=False, memory_per_device_bytes=None, tsp_attention_backward=None,
                       logits_tile_mib=DEFAULT_LOGITS_TILE_MIB):
    """PNG at ``path``: per-device peak memory against sequence length, one line
    per strategy (log-log), with the device memory as a dashed line if given."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    seq_lens = sorted(seq_lens)
    curves = {}
    for seq_len in seq_lens:
        for plan_ in plan(model, seq_len, micro_batch, devices, dtype, zero_stage, activation_checkpointing,
                          tsp_attention_backward, logits_tile_mib):
            curves.setdefault(plan_.name, []).append(plan_.total / GB)
    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, totals in curves.items():
        ax.plot(seq_lens, totals, marker="o", label=name, linewidth=2.5 if name.startswith("TSP") else 1.2)
    if memory_per_device_bytes:
        ax.axhline(memory_per_device_bytes / GB, color="black", linestyle="--", label="device memory")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak memory per device (GB)")
    ax.set_title(f"{model_shape(model).name}, {devices} devices, B={micro_batch}, {dtype}, ZeRO-{zero_stage}"
                 + (", checkpointing" if activation_checkpointing else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _tokens(text):
    """An integer with an optional K/M suffix (powers of 2): 131072, 128K, 1M."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a positive integer like 131072 or 128K, got {text!r}")
    value = int(match.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[match.group(2).lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def add_plan_arguments(parser):
    """Options of ``ds-tsp plan``."""
    parser.add_argument("--model", default="llama-7b",
                        help=f"preset ({', '.join(PRESETS)}), or a Hugging Face config directory or JSON file "
                             f"(default: llama-7b)")
    parser.add_argument("--seq-len", type=_tokens, default=131072, help="tokens per sequence, e.g. 131072 or 128K")
    parser.add_argument("--micro-batch", type=_positive_int, default=1, help="sequences per micro-batch (default 1)")
    parser.add_argument("--devices", type=_positive_int, default=8, help="devices per model replica, N (default 8)")
    parser.add_argument("--dtype", choices=tuple(PRECISIONS), default="bf16", help="training precision")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0,
                        help="ZeRO stage over the weight-replica axis (default 0)")
    parser.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="recompute each layer in backward (default: off, on with --paper)")
    parser.add_argument("--tsp-attention-backward", choices=TSP_ATTENTION_BACKWARDS,
                        help="fused: TSP attention saves its output and lse (ds_tsp's torch-flash kernels); "
                             "recompute: it runs the forward again (flash-attn). Default: fused unless the model "
                             "has a sliding window or head_dim > 256")
    parser.add_argument("--logits-tile-mib", type=_positive_float, default=DEFAULT_LOGITS_TILE_MIB,
                        help="tsp.logits_tile_mib: the largest fp32 logits tile of TSP's fused LM head + loss "
                             f"(default {DEFAULT_LOGITS_TILE_MIB:g})")
    parser.add_argument("--memory-gb", type=float, help="device memory in GB: list the strategies that fit, best first")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of peak memory against sequence length")
    parser.add_argument("--paper", action="store_true",
                        help="print the paper's measured peaks (38.8 / 70.0 / 85.0-140.0 GB) beside the estimates")
    return parser


def run_plan(args, out=None):
    """``ds-tsp plan``: print the table (and recommendation, plot); returns the exit status."""
    out = out or sys.stdout
    checkpointing = args.activation_checkpointing
    if checkpointing is None:
        checkpointing = bool(args.paper)
    try:
        plans = plan(args.model, args.seq_len, args.micro_batch, args.devices, args.dtype, args.zero_stage,
                     checkpointing, args.tsp_attention_backward, args.logits_tile_mib)
        print(format_table(plans, PAPER_PEAK_GB if args.paper else None), file=out)
        if args.memory_gb is not None:
            fits = recommend(plans, args.memory_gb * GB)
            if fits:
                print(f"Fit in {args.memory_gb:g} GB, fewest bytes received per FLOP first: "
                      + ", ".join(f"{p.name} ({_gb(p.total)} GB)" for p in fits), file=out)
                print(f"Recommended: {fits[0].name} ({fits[0].layout})", file=out)
            else:
                best = min((p for p in plans if p.feasible), key=lambda p: p.total)
                print(f"Nothing fits in {args.memory_gb:g} GB; the smallest is {best.name} at {_gb(best.total)} GB "
                      f"(try activation checkpointing, more devices or a shorter sequence)", file=out)
        if args.plot:
            seq_lens = [args.seq_len >> k for k in range(6, -1, -1) if args.seq_len >> k >= 2 * args.devices]
            plot_memory_vs_seq(args.model, seq_lens, args.devices, args.plot, args.micro_batch, args.dtype,
                               args.zero_stage, checkpointing,
                               None if args.memory_gb is None else args.memory_gb * GB, args.tsp_attention_backward,
                               args.logits_tile_mib)
            print(f"Wrote {args.plot}", file=out)
    except (ValueError, OSError) as err:
        print(f"ds-tsp plan: error: {err}", file=sys.stderr)
        return 1
    return 0
