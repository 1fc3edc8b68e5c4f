"""What a config's numbers do not say about a decoder layer, read off Hugging
Face's own layer built on the meta device (no memory, no weights): how many
norms each layer holds and whether they carry biases (Llama's 2, Gemma-2's
and GLM-4's 4 in a sandwich, Cohere's 1 before its parallel blocks; layer
norms with biases: Nemotron's, Jais-2's), whether the dense MLP is gated
(Nemotron's, Arcee's and Jais-2's are not) and biased, whether the attention's
projections carry biases (ERNIE 4.5's ``use_bias``) and per-head q/k norms
with weights (Hunyuan's ``query_layernorm``). Each is the field of
``ModelShape`` the ring, the broadcast and the replicated gradients' all-reduce
count by, so the planner's bytes are the ones the TSP blocks move.

The planner is a leaf of the package and loads no torch until a config is
planned: torch and transformers are imported here, when a layer is built.
"""

import functools
import json

# The names the TSP blocks read these by (ds_tsp.injection.policy.MLP_NAMES with "mlp",
# ds_tsp.blocks.attention.module.QK_NORMS, ds_tsp.blocks.mlp.ACTIVATION_NAMES), which the planner, a leaf,
# does not import.
MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward")
QK_NORM_NAMES = ("q_norm", "k_norm", "query_layernorm", "key_layernorm")
ACTIVATION_NAMES = ("act_fn", "activation_fn")


def layer_anatomy(fields):
    """``{ModelShape field: value}`` read off the first decoder layer of the
    Hugging Face causal LM (or a vision-language model's text decoder) that
    ``fields`` (a config's dict, with its ``model_type``) describes; ``{}``
    where transformers cannot build it (a preset without a model type, a
    class it does not know)."""
    if "model_type" not in fields:
        return {}
    return dict(_anatomy(json.dumps(fields, sort_keys=True, default=str)))


@functools.lru_cache(maxsize=64)
def _anatomy(key):
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    fields = {name: value for name, value in json.loads(key).items() if name not in ("name", "architectures")}
    try:
        config = AutoConfig.for_model(**fields)
        with torch.device("meta"):
            if type(config) in AutoModelForCausalLM._model_mapping:
                layer = AutoModelForCausalLM.from_config(config).get_submodule("model.layers")[0]
            else:  # a vision-language model's text decoder (qwen2_vl_text): its model class alone
                layer = AutoModel.from_config(config).get_submodule("layers")[0]
    except Exception:  # noqa: BLE001 - any config transformers does not build: the config's fields alone
        return ()
    hidden = config.hidden_size
    norms = [module for name, module in layer.named_children()
             if "norm" in name and getattr(getattr(module, "weight", None), "shape", None) == (hidden,)]
    anatomy = {"norms_per_layer": len(norms),
               "norm_bias": any(getattr(norm, "bias", None) is not None for norm in norms)}
    attn = getattr(layer, "self_attn", None)
    if all(isinstance(getattr(attn, name, None), torch.nn.Linear) for name in ("q_proj", "o_proj")):
        anatomy["attention_bias"] = attn.q_proj.bias is not None
        anatomy["o_proj_bias"] = attn.o_proj.bias is not None
        per_head = [getattr(getattr(attn, name, None), "weight", None) for name in QK_NORM_NAMES]
        if any(weight is not None and weight.dim() == 1 and weight.numel() == attn.head_dim for weight in per_head):
            anatomy["qk_norm"] = True
    mlp = next((getattr(layer, name) for name in MLP_NAMES if hasattr(layer, name)), None)
    down = getattr(mlp, "down_proj", None)
    if isinstance(down, torch.nn.Linear) and any(hasattr(mlp, name) for name in ACTIVATION_NAMES):
        anatomy["mlp_gated"] = hasattr(mlp, "gate_proj") or hasattr(mlp, "gate_up_proj")
        anatomy["mlp_bias"] = down.bias is not None
    return tuple(anatomy.items())
