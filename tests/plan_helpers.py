"""What the planner's tests (tests/test_plan_*.py) share: small model shapes
built in code, the saved-tensor count, the TSP paper's plans."""

import torch

from ds_tsp import planning as planner

# Small shapes: H=16, F=32, nq=4, nkv=2, d=4, S=16, B=2.
HIDDEN, INTER, HEAD_DIM, SEQ, BATCH = 16, 32, 4, 16, 2

HOST_GB = planner.ALST_HOST_MEMORY_GB


def tiny_shape(num_heads=4, num_kv_heads=2, bias=False, layers=1):
    return dict(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers, num_attention_heads=num_heads,
                num_key_value_heads=num_kv_heads, head_dim=HEAD_DIM, vocab_size=61, attention_bias=bias,
                mlp_bias=bias)


def tiny_moe_shape(**overrides):
    """Qwen2-MoE-like sizes for the byte formulas: E=4 experts of F_e=8, top-2, a shared expert of F_s=16."""
    return {**tiny_shape(layers=2), "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16, **overrides}


def saved_bytes(params, run):
    """Bytes of the storages autograd saves for backward while ``run()`` runs, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in params}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(saved.values())


def paper_plans(checkpointing=True):
    return {p.name: p for p in planner.plan("llama-7b", 131072, 1, 8, "bf16", activation_checkpointing=checkpointing)}


def tiny_hybrid_shape(**overrides):
    """Qwen3.5's tiny shape (tests/models.py's HYBRID_TINY) without building its config: 3 Gated DeltaNet layers
    of 4 key and 8 value heads of 4 and a 4-tap convolution, then a gated attention layer of heads of 8."""
    return {**tiny_shape(layers=4), "model_type": "qwen3_5_text", "head_dim": 8, "linear_num_key_heads": 4,
            "linear_num_value_heads": 8, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
            "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25, **overrides}
