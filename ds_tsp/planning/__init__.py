"""The analytic planner behind ``ds-tsp plan``: per-device memory,
communication and FLOPs of DP, TP, SP (Ulysses), CP (all-gather), TP+SP and
TSP for a decoder LM (DESIGN.md 8), dense or mixture-of-experts (Mixtral,
Qwen2-MoE, Qwen3-MoE: DESIGN.md 6c; experts folded across data-parallel
replicas: 6k), with latent attention (6i), Gated
DeltaNet layers (Qwen3-Next, Qwen3.5: 6j), KDA, Mamba-2, Mamba-1 or short
convolutions (Kimi Linear, Nemotron-H, Granite-4.0-H, Bamba, Jamba, LFM2: 6n),
the longest sequence each trains, and
each one's step time on a cluster. Imports no torch.

One module per concern, in the order they build on one another:

| module | holds |
|---|---|
| ``recurrent`` | the recurrent mixers (Gated DeltaNet, KDA, Mamba-2, Mamba-1, short convolutions): their costs |
| ``shapes`` | model sizes (presets, HF configs, MoE layers), precisions, the run's ``Setting``, how TSP cuts a model |
| ``communication`` | bytes each TSP rank receives per op, per layer and per step, as ``parallel.comm`` counts them; |
| | a MoE layer's expert ring against the token all-to-all |
| ``memory`` | the memory terms: saved tensors, model states, transients, offloads to host memory |
| ``plan_types`` | ``StrategyPlan``, ``CommPart`` and the names of the kinds of communication |
| ``flops`` | FLOPs per device per step, and the attention's part |
| ``tsp_plan`` | ``plan_tsp``: one TSP rank's memory, communication and FLOPs, folded vocabulary or not |
| ``baselines`` | ``plan_baseline``: DP, TP, SP (Ulysses), CP (all-gather), TP+SP as Hugging Face layers |
| ``strategies`` | the entry points: ``plan`` (all of them), ``plan_autotp``, ``plan_alst``, ``recommend`` |
| ``longest`` | ``max_seq_len``: the longest trainable sequence per strategy and its binding term |
| ``serving`` | ``serving_plans``: the weights and KV cache each strategy keeps for inference, the longest context |
| ``anchors`` | published numbers: the TSP paper's peaks, ALST's lengths, Ulysses' and Megatron CP's throughput |
| ``timing`` | step time per strategy from FLOPs, links and overlap, its bound, and the throughput anchors |
| ``tables`` | Markdown tables, a MoE model's facts and the memory-against-length plot |
| ``visual`` | a vision-language model's tower: its size, memory per device and bytes per TSP rank |
| ``cli`` | the ``ds-tsp plan`` options and command |
"""

import importlib

from ds_tsp.planning.anchors import (
    ALST_DEVICE_GB,
    ALST_HOST_MEMORY_GB,
    ALST_MODEL,
    ALST_PUBLISHED,
    PAPER_DEVICE_GB,
    PAPER_LABELS,
    PAPER_PEAK_GB,
    PAPER_SETTING,
    TIME_ANCHORS,
)
from ds_tsp.planning.communication import (
    DIRECTIONS,
    MOE_SCHEDULES,
    cheaper_moe_schedule,
    delta_net_bytes_by_op,
    moe_block_bytes_by_op,
    moe_crossover_tokens,
    tsp_bytes_by_op,
    tsp_bytes_per_layer,
    tsp_layers_bytes_by_op,
    tsp_moe_bytes_by_op,
    tsp_moe_schedule,
    tsp_step_bytes_by_op,
    tsp_vocab_bytes_by_op,
)
from ds_tsp.planning.longest import LongestSequence, longest_fitting, max_seq_len
from ds_tsp.planning.memory import HEAD_BACKWARD, MEMORY_PARTS
from ds_tsp.planning.plan_types import CommPart, StrategyPlan
from ds_tsp.planning.serving import ServingPlan, format_serving_table, serving_plans
from ds_tsp.planning.shapes import (
    DEFAULT_DEVICES_PER_NODE,
    DEFAULT_LOGITS_TILE_MIB,
    DEFAULT_TOKEN_TILE,
    FLOAT32,
    GB,
    INT64,
    MOE_MODEL_TYPES,
    PRECISIONS,
    PRESETS,
    TSP_ATTENTION_BACKWARDS,
    ModelShape,
    Precision,
    Setting,
    expert_parallel_sizes,
    logits_tile_tokens,
    model_shape,
    tsp_name,
    tsp_shape_problem,
    vocab_rows_per_rank,
)
from ds_tsp.planning.strategies import (
    TSP_MOE_SCHEDULES,
    alst_name,
    best_expert_parallel_size,
    plan,
    plan_alst,
    plan_autotp,
    recommend,
)
from ds_tsp.planning.timing import DEFAULT_CLUSTER, Cluster, StepTime, compare_anchors, step_time

__all__ = [
    "ALST_DEVICE_GB", "ALST_HOST_MEMORY_GB", "ALST_MODEL", "ALST_PUBLISHED", "DEFAULT_CLUSTER",
    "DEFAULT_DEVICES_PER_NODE", "DEFAULT_LOGITS_TILE_MIB", "DEFAULT_TOKEN_TILE", "DIRECTIONS", "FLOAT32", "GB",
    "HEAD_BACKWARD", "INT64", "MEMORY_PARTS", "MOE_MODEL_TYPES", "MOE_SCHEDULES", "PAPER_DEVICE_GB", "PAPER_LABELS",
    "PAPER_PEAK_GB", "PAPER_SETTING", "PRECISIONS", "PRESETS", "TIME_ANCHORS", "TSP_ATTENTION_BACKWARDS",
    "TSP_MOE_SCHEDULES", "Cluster",
    "CommPart", "LongestSequence", "ModelShape", "Precision", "ServingPlan", "Setting", "StepTime", "StrategyPlan",
    "add_plan_arguments", "alst_name", "best_expert_parallel_size", "cheaper_moe_schedule",
    "compare_anchors", "delta_net_bytes_by_op", "expert_parallel_sizes",
    "format_longest_table", "format_moe_facts", "format_serving_table", "format_table", "format_time_anchors",
    "format_tower_table",
    "logits_tile_tokens", "longest_fitting", "max_seq_len", "model_shape", "moe_block_bytes_by_op",
    "moe_crossover_tokens", "moe_facts", "plan", "plan_alst", "plan_autotp", "plot_memory_vs_seq", "recommend",
    "run_plan", "serving_plans", "step_time", "tsp_bytes_by_op", "tsp_bytes_per_layer", "tsp_layers_bytes_by_op",
    "tsp_moe_bytes_by_op",
    "tsp_moe_schedule", "tsp_name", "tsp_shape_problem", "tsp_step_bytes_by_op", "tsp_vocab_bytes_by_op",
    "vocab_rows_per_rank",
]

# The command line and the tables load on first use: the blocks' and the engine's imports need neither.
_LAZY = {"add_plan_arguments": "cli", "run_plan": "cli", "format_longest_table": "tables",
         "format_moe_facts": "tables", "format_table": "tables", "format_time_anchors": "tables",
         "format_tower_table": "tables",
         "moe_facts": "tables", "plot_memory_vs_seq": "tables"}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'ds_tsp.planning' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
