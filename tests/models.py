"""Tiny Hugging Face causal LMs built in code (no downloads), float64 by default."""

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

COMMON = dict(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=4, max_position_embeddings=128, attn_implementation="sdpa")


def tiny_config(arch, **overrides):
    kwargs = {**COMMON, **overrides}
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
    raise ValueError(arch)


MODEL_CLASSES = {"llama": LlamaForCausalLM, "llama_tied": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM,
                 "mistral": MistralForCausalLM, "qwen3": Qwen3ForCausalLM}


def tiny_model(arch, seed=0, dtype=torch.float64, **overrides):
    torch.manual_seed(seed)
    model = MODEL_CLASSES[arch](tiny_config(arch, **overrides)).to(dtype)
    with torch.no_grad():
        # Larger than HF's 0.02 init so attention patterns and biases matter,
        # and norm weights away from 1 so a dropped norm would show.
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.2) if "norm" in name else param.normal_(0, 0.3)
    return model
