"""The model ``compare.py`` trains, as a Hugging Face config: Llama (dense),
Qwen3-MoE (``moe``, Hugging Face's default grouped experts, no load-balancing
loss: ``output_router_logits`` false as in its config), DeepSeek-V3's
multi-head latent attention over dense MLPs (``mla``; with ``--index-topk``
DeepSeek-V3.2's, its lightning indexer on), a Qwen3.5-shaped
Gated DeltaNet hybrid (``hybrid``) or a Nemotron-H-shaped Mamba-2 hybrid
(``nemotron``). ``compare.py`` builds it and
``report.py`` plans it, from the same fields."""

from transformers import (DeepseekV3Config, DeepseekV32Config, LlamaConfig, NemotronHConfig, Qwen3MoeConfig,
                          Qwen3_5TextConfig)


def add_model_arguments(parser, vocab=32000):
    """The benchmark model's sizes as command-line options (``compare.py``'s defaults), for the scripts
    that train it beside ``compare.py``."""
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1376, help="the dense MLP's")
    parser.add_argument("--vocab", type=int, default=vocab)


def model_config(args):
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=max(args.seq_lens), tie_word_embeddings=False, attn_implementation="sdpa")
    if getattr(args, "model", "dense") == "mla":
        return mla_config(common, args.hidden // args.heads, getattr(args, "index_topk", 0))
    if getattr(args, "model", "dense") == "hybrid":
        return hybrid_config(common, args.hidden // args.heads)
    if getattr(args, "model", "dense") == "nemotron":
        return nemotron_config(common, args.hidden // args.heads)
    if getattr(args, "model", "dense") == "moe":
        return Qwen3MoeConfig(**common, head_dim=args.hidden // args.heads, num_experts=args.experts,
                              num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_intermediate,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return LlamaConfig(**common)


def mla_config(common, head_dim, index_topk=0):
    """DeepSeek-V3's attention at the benchmark's width, in its proportions: per head a no-position part of half
    ``head_dim``, a rotary part of half that and values as wide as the first (128 / 64 / 128 in DeepSeek-V3), a
    key/value latent four no-position parts wide (512) and a query latent of a quarter of the hidden size (1536
    of 7168); every head its own key/value head once expanded; every layer's MLP dense. With ``index_topk``:
    DeepSeek-V3.2's, a lightning indexer of 16 heads (DeepSeek-V3.2's 64), each ``head_dim`` wide, choosing
    ``index_topk`` keys a query. Fewer index heads tie: a key scores exactly 0 when every head's relu is 0 (one
    in 2^heads), and at 4 heads about 100 queries a layer of 2048 tokens tie at the ``index_topk``-th score,
    where Hugging Face's ``torch.topk`` and ds_tsp break the tie differently (``docs/limitations.md``)."""
    nope = head_dim // 2
    sizes = dict(q_lora_rank=common["hidden_size"] // 4, kv_lora_rank=2 * head_dim, qk_nope_head_dim=nope,
                 qk_rope_head_dim=nope // 2, v_head_dim=nope, first_k_dense_replace=common["num_hidden_layers"],
                 num_nextn_predict_layers=0)
    fields = {**common, "num_key_value_heads": common["num_attention_heads"]}
    if index_topk:
        return DeepseekV32Config(**fields, **sizes, index_n_heads=16, index_head_dim=head_dim, index_topk=index_topk)
    return DeepseekV3Config(**fields, **sizes, head_dim=nope // 2, rope_interleave=True)


def nemotron_config(common, head_dim):
    """Nemotron-H at the benchmark's width, in its proportions: its layers one block each, Mamba-2 mixers and
    MLPs alternating with one NoPE attention layer a quarter of the way ("M-M*-M-" over the benchmark's depth
    doubled: every layer of the other rows becomes a mixer and an MLP); Mamba-2 heads of ``head_dim`` over twice
    the hidden size, 8 groups of state 128 (Nemotron-H 8B's), a 4-tap convolution; ungated relu2 MLPs."""
    layers = 2 * common["num_hidden_layers"]
    pattern = ["full_attention" if i == layers // 4 else "linear_attention" if i % 2 == 0 else "mlp"
               for i in range(layers)]
    hidden = common["hidden_size"]
    return NemotronHConfig(**{**common, "num_hidden_layers": layers}, head_dim=head_dim, layers_block_type=pattern,
                           mamba_num_heads=2 * hidden // head_dim, mamba_head_dim=head_dim, n_groups=8,
                           ssm_state_size=128, conv_kernel=4, chunk_size=128, mlp_hidden_act="relu2")


def hybrid_config(common, head_dim):
    """Qwen3.5's text model at the benchmark's width, in its proportions: three Gated DeltaNet layers to one
    gated full-attention layer (a quarter of each head rotary); the linear layers' key heads half as many as
    the attention heads and their value heads twice the key heads (16 / 32 of 128 in Qwen3.5's default), both
    ``head_dim`` wide, a 4-tap convolution; dense MLPs."""
    heads = common["num_attention_heads"]
    return Qwen3_5TextConfig(**common, head_dim=head_dim, linear_num_key_heads=heads // 2,
                             linear_num_value_heads=heads, linear_key_head_dim=head_dim,
                             linear_value_head_dim=head_dim, linear_conv_kernel_dim=4, full_attention_interval=4)
