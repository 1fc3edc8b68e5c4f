"""``ds_tsp.inject``: rewrite a Hugging Face causal LM into a TSP model, in place."""

from .attention import TSPAttention
from .mappings import sum_grads_over_group
from .mlp import TSPGatedMLP
from .model import TSPCausalLMMixin, TSPDecoderLayer
from .policy import resolve_policy
from .vocab import VocabParallelEmbedding, VocabParallelLMHead, check_foldable


def inject(model, topology, tsp_config, read=None, device=None):
    """Turn ``model`` (e.g. a ``LlamaForCausalLM``) into a TSP model and return it.

    ``read(full_name, piece)`` supplies each tensor or this rank's piece of it
    (``piece = (dim, start, length)``, None for whole); by default the model's
    own parameters are sliced. The steps run in this order:

    1. resolve the policy and check every layer (and, with
       ``tsp.vocab_parallel``, the embedding and head) fits it, before any
       weight moves;
    2. replace every decoder layer by a TSP layer holding only this rank's
       shards (the full HF layer is dropped, freeing its weights);
    3. with ``tsp.vocab_parallel``, replace the embedding and the LM head by
       this rank's vocabulary rows (one shard for both when tied);
    4. make replicated parameters' gradients sum over the TSP group once;
    5. give the model the TSP forward (HF calling convention, full sequence in).
    """
    policy = resolve_policy(model, tsp_config.policy)
    if tsp_config.vocab_parallel:
        check_foldable(model.get_submodule(policy.embed_tokens), model.get_submodule(policy.lm_head),
                       type(model).__name__)
    layers = model.get_submodule(policy.layers)
    for index, layer in enumerate(layers):
        prefix = f"{policy.layers}.{index}"
        layers[index] = tsp_layer(layer, model.config, policy, topology, tsp_config,
                                  read=_prefixed(read, prefix), device=device)
    if tsp_config.vocab_parallel:
        fold_vocabulary(model, policy, topology, tsp_config, read=read, device=device)

    replicated = [p for p in model.parameters() if not getattr(p, "tensor_model_parallel", False)]
    sum_grads_over_group(replicated, topology.tsp_group)

    model.__class__ = _tsp_class(type(model))
    model.tsp_topology, model.tsp_config, model.tsp_policy = topology, tsp_config, policy
    return model


def tsp_layer(layer, config, policy, topology, tsp_config, read=None, device=None):
    """A ``TSPDecoderLayer`` from one Hugging Face decoder layer (norms kept as they are)."""
    attention = layer.get_submodule(policy.attention)
    mlp = layer.get_submodule(policy.mlp)
    return TSPDecoderLayer(
        layer.get_submodule(policy.input_norm),
        TSPAttention.from_hf(attention, config, topology.tsp_group, layout_name=tsp_config.layout,
                             backend=tsp_config.attention_backend, overlap=tsp_config.overlap,
                             read=_prefixed(read, policy.attention), device=device),
        layer.get_submodule(policy.post_attention_norm),
        TSPGatedMLP.from_hf(mlp, topology.tsp_group, overlap=tsp_config.overlap, read=_prefixed(read, policy.mlp),
                            device=device),
    )


def fold_vocabulary(model, policy, topology, tsp_config, read=None, device=None):
    """Replace the embedding and the LM head by this rank's vocabulary rows
    (``ds_tsp.vocab``); a tied head shares the embedding's shard."""
    embed, lm_head = model.get_submodule(policy.embed_tokens), model.get_submodule(policy.lm_head)
    folded_embed = VocabParallelEmbedding.from_hf(embed, topology.tsp_group, read=_prefixed(read, policy.embed_tokens),
                                                  device=device)
    tied_to = folded_embed if lm_head.weight is embed.weight else None
    folded_head = VocabParallelLMHead.from_hf(lm_head, topology.tsp_group, tsp_config.logits_tile_mib,
                                              tsp_config.overlap, tied_to=tied_to,
                                              read=_prefixed(read, policy.lm_head), device=device)
    model.set_submodule(policy.embed_tokens, folded_embed)
    model.set_submodule(policy.lm_head, folded_head)


def _prefixed(read, prefix):
    if read is None:
        return None
    return lambda name, piece: read(f"{prefix}.{name}", piece)


_TSP_CLASSES = {}


def _tsp_class(cls):
    """``TSP<cls>``: the HF class with the TSP forward in front, so the model
    stays an instance of its own class (``isinstance``, ``config``, ...)."""
    if issubclass(cls, TSPCausalLMMixin):
        raise ValueError(f"{cls.__name__} is already a TSP model: inject it once")
    if cls not in _TSP_CLASSES:
        _TSP_CLASSES[cls] = type(f"TSP{cls.__name__}", (TSPCausalLMMixin, cls), {})
    return _TSP_CLASSES[cls]
