"""The model ``compare.py`` trains, as a Hugging Face config: Llama (dense) or
Qwen3-MoE (``moe``, Hugging Face's default grouped experts, no load-balancing
loss: ``output_router_logits`` false as in its config). ``compare.py`` builds
it and ``report.py`` plans it, from the same fields."""

from transformers import LlamaConfig, Qwen3MoeConfig


def model_config(args):
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=max(args.seq_lens), tie_word_embeddings=False, attn_implementation="sdpa")
    if getattr(args, "model", "dense") == "moe":
        return Qwen3MoeConfig(**common, head_dim=args.hidden // args.heads, num_experts=args.experts,
                              num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_intermediate,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return LlamaConfig(**common)
