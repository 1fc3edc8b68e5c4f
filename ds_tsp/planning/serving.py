"""Serving: the longest context each strategy holds per device for inference
(``ds-tsp plan --serve``), counting what stays resident while decoding: the
weights and the KV cache. Per device, in the serving dtype (``e`` bytes),
batch ``B``, context ``S`` tokens:

* single device: every weight; KV cache ``2 L B S nkv d e``;
* TP (DeepSpeed's tensor-parallel inference, AutoTP): query heads, MLP
  columns and the LM head's rows split ``D`` ways, the embedding and the norms
  whole; each device keeps (projections) and caches (every token's K and V)
  ``max(nkv/D, 1)`` key/value heads;
* TSP: every block's weights ``1/D`` (``tsp_attention_shard``, the MLP or
  experts ``/D``), the vocabulary folded (``ceil(V/D)`` rows of the embedding
  and the head), norms whole; each device caches all key/value heads of
  ``S/D`` tokens (``ds_tsp.inference.kv_cache``), plus one generated token of imbalance.

A hybrid's recurrent layers (``planning.recurrent``) cache no K/V: each
sequence keeps a state and its convolutions' last inputs, whatever the
context (``state_bytes``), whole on one device and under AutoTP (which leaves
the recurrent mixers whole), ``1/D`` on each TSP rank (its heads' or
channels').

The prefill's transient activations (freed before decoding) are not in it:
``benchmarks/inference.py`` measures them.
"""

from dataclasses import dataclass

from ds_tsp.planning.shapes import (
    PRECISIONS,
    model_shape,
    tsp_attention_shard,
    tsp_name,
    tsp_shape_problem,
    vocab_rows_per_rank,
)


@dataclass(frozen=True)
class ServingPlan:
    """One strategy's resident bytes per device: ``weights`` and the KV cache,
    ``kv_per_token`` bytes per context token (the whole batch)."""

    name: str
    weights: float
    kv_per_token: float
    tokens_per_device_divisor: int = 1  # TSP: each device caches 1/D of the tokens
    problem: str | None = None  # why the strategy cannot serve the model
    recurrent_state: float = 0  # a hybrid's recurrent layers' states, whatever the context (the whole batch)

    def kv_cache(self, context):
        """KV cache bytes per device at ``context`` tokens."""
        if self.tokens_per_device_divisor == 1:
            return self.kv_per_token * context
        return self.kv_per_token * (-(-context // self.tokens_per_device_divisor) + 1)

    def longest_context(self, memory_bytes):
        """The most context tokens whose weights, recurrent states and KV cache fit ``memory_bytes`` per device
        (0: none)."""
        resident = self.weights + self.recurrent_state
        if self.problem or memory_bytes <= resident:
            return 0
        per_device = int((memory_bytes - resident) // self.kv_per_token)
        if self.tokens_per_device_divisor == 1:
            return per_device
        return max(per_device - 1, 0) * self.tokens_per_device_divisor

    def as_dict(self, memory_bytes=None):
        out = {"name": self.name, "weights_bytes": self.weights, "kv_bytes_per_token": self.kv_per_token,
               "kv_tokens_per_device": f"1/{self.tokens_per_device_divisor}",
               "recurrent_state_bytes": self.recurrent_state, "problem": self.problem}
        if memory_bytes is not None:
            out["longest_context"] = self.longest_context(memory_bytes)
        return out


def serving_plans(model, devices, micro_batch=1, dtype="bf16"):
    """``[ServingPlan]``: one device, then TP and TSP over ``devices``."""
    m = model_shape(model)
    e, D, H = PRECISIONS[dtype].element, devices, m.hidden_size
    # Each kind of attention layer with its own heads (Gemma 4's full layers): (shape, layers). A hybrid's
    # recurrent layers cache no K/V: a state a sequence, whatever the context.
    kinds = [(view, count) for view, linear, count in m.mixer_groups if not linear]
    state = m.linear_layers * micro_batch * m.recurrent.state_bytes(e) if m.is_hybrid else 0
    recurrent = m.linear_layers * m.recurrent.params if m.is_hybrid else 0

    def kv_token(heads):  # K and V of every layer, ``heads(view)`` key/value heads of each
        return sum(2 * count * micro_batch * view.head_dim * e * heads(view) for view, count in kinds)

    layers_replicated = sum(count * sum(m.ffn_replicated_tensors(sparse)) for sparse, count in m.layer_kinds) + \
        sum(count * sum(view.mixer_replicated_tensors(linear)) for view, linear, count in m.mixer_groups)
    single = ServingPlan("single device", m.params * e, kv_token(lambda view: view.num_kv_heads),
                         recurrent_state=state)
    plans = [single]
    if D == 1:
        return plans

    # AutoTP splits q/o and a dense MLP D ways (a sparse block stays whole: the MoE models' tp_plans name their
    # attention only, and a recurrent mixer whole with its states); with fewer key/value heads than devices each
    # keeps one whole.
    def tp_attention(view):
        kv_params = view.kv_projections * view.num_kv_heads * view.head_dim * (H + (1 if view.attention_bias else 0))
        return (view.attention_params - kv_params) / D + kv_params * max(view.num_kv_heads // D, 1) / view.num_kv_heads

    tp_ffn = sum(count * m.ffn_params(sparse) / (1 if sparse else D) for sparse, count in m.layer_kinds)
    tp_problem = f"num_attention_heads {m.num_heads} is not divisible by {D}" if m.num_heads % D else None
    vocab = m.vocab_size * H
    # AutoTP splits an untied LM head by rows; the embedding (and a head tied to it) stays whole.
    tp_weights = (sum(count * tp_attention(view) for view, count in kinds) + recurrent + tp_ffn + layers_replicated
                  + vocab + (0 if m.tie_word_embeddings else vocab / D) + H) * e
    plans.append(ServingPlan(f"TP({D})", tp_weights, kv_token(lambda view: max(view.num_kv_heads // D, 1)),
                             problem=tp_problem, recurrent_state=state))

    tsp_problem = tsp_shape_problem(m, D)
    attention = 0 if tsp_problem else sum(count * max(tsp_attention_shard(view, D, r) for r in range(D))
                                          for view, count in kinds)
    ffn = sum(count * m.ffn_params(sparse) for sparse, count in m.layer_kinds) / D
    vocab_rows = vocab_rows_per_rank(m.vocab_size, D) * H * (1 if m.tie_word_embeddings else 2)
    tsp_weights = (attention + recurrent / D + ffn + layers_replicated + vocab_rows + H) * e
    # Each rank keeps its head group's (or channels') states (ds_tsp.inference's recurrent cache layers).
    plans.append(ServingPlan(tsp_name(D), tsp_weights, kv_token(lambda view: view.num_kv_heads),
                             tokens_per_device_divisor=D, problem=tsp_problem, recurrent_state=state / D))
    return plans


def format_serving_table(plans, memory_gb, model_name, micro_batch, dtype):
    """Markdown: per strategy, resident weights, KV cache per 1K tokens and the longest context."""
    gb = 1e9
    lines = [f"Serving {model_name}, batch {micro_batch}, {dtype}, on {memory_gb:g} GB per device "
             "(weights + KV cache; the prefill's transient activations are not counted):", "",
             "| strategy | weights GB / device | recurrent states GB / device | KV cache GB / device / 1K tokens "
             "| longest context |",
             "|---|---|---|---|---|"]
    for p in plans:
        if p.problem:
            lines.append(f"| {p.name} | - | - | - | cannot serve it: {p.problem} |")
            continue
        per_1k = p.kv_per_token * 1024 / p.tokens_per_device_divisor / gb
        longest = p.longest_context(memory_gb * gb)
        lines.append(f"| {p.name} | {p.weights / gb:.2f} | {p.recurrent_state / gb:.4f} | {per_1k:.4f} | "
                     f"{f'{longest:,}' if longest else 'the weights do not fit'} |")
    return "\n".join(lines)
