"""Which Hugging Face causal LMs ds_tsp can rewrite, and where their parts live.

One declarative table per architecture names the decoder-layer class and its
submodules; how each projection's weight is sharded is the table of the block
that takes it (``attention.SHARD_DIMS``, ``mlp.SHARD_DIMS``). The ``auto``
policy accepts any decoder layer of the same shape. A model that does not fit
is refused with the class and the submodule at fault, before any weight moves:
nothing is ever converted approximately.
"""

from dataclasses import dataclass

from . import attention, mlp


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class DecoderPolicy:
    name: str
    layer_class: str | None  # None: any class of the right shape (auto)
    layers: str = "model.layers"
    embed_tokens: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    rotary_emb: str = "model.rotary_emb"
    lm_head: str = "lm_head"
    attention: str = "self_attn"
    mlp: str = "mlp"
    input_norm: str = "input_layernorm"
    post_attention_norm: str = "post_attention_layernorm"

    @property
    def sharding(self):
        """``{submodule: {weight name: split dim}}``; everything else is replicated."""
        return {self.attention: attention.SHARD_DIMS, self.mlp: mlp.SHARD_DIMS}


POLICIES = {
    "llama": DecoderPolicy("llama", "LlamaDecoderLayer"),
    "qwen2": DecoderPolicy("qwen2", "Qwen2DecoderLayer"),
    "mistral": DecoderPolicy("mistral", "MistralDecoderLayer"),
    "qwen3": DecoderPolicy("qwen3", "Qwen3DecoderLayer"),
}
AUTO = DecoderPolicy("auto", None)

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Per-head query/key norms (Qwen3): optional, but both or neither.
ATTENTION_NORMS = ("q_norm", "k_norm")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

# Config attributes of architectures whose forward does more than
# embed -> blocks -> norm -> lm_head, which the TSP forward would skip.
UNSUPPORTED_CONFIG_FEATURES = {
    "final_logit_softcapping": "logit soft-capping",
    "attn_logit_softcapping": "attention-logit soft-capping",
    "logit_scale": "logit scaling",
    "logits_scaling": "logit scaling",
    "embedding_multiplier": "embedding scaling",
    "residual_multiplier": "residual scaling",
    "query_pre_attn_scalar": "a non-standard attention scale",
}


def get_submodule(model, path):
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def resolve_policy(model, name="auto"):
    """The policy for ``model`` (``tsp.policy``), after checking every layer fits it."""
    if name != "auto" and name not in POLICIES:
        raise PolicyError(f"tsp.policy = {name!r} is unknown: choose \"auto\" or one of {sorted(POLICIES)}")
    model_class = type(model).__name__
    layers = get_submodule(model, AUTO.layers)
    if layers is None or len(layers) == 0:
        raise PolicyError(f"{model_class} has no decoder layers at '{AUTO.layers}': ds_tsp converts Hugging Face "
                          "causal LMs shaped like LlamaForCausalLM")
    layer_class = type(layers[0]).__name__
    if name == "auto":
        policy = next((p for p in POLICIES.values() if p.layer_class == layer_class), AUTO)
    else:
        policy = POLICIES[name]
    for path in (policy.embed_tokens, policy.final_norm, policy.rotary_emb, policy.lm_head):
        if get_submodule(model, path) is None:
            raise PolicyError(f"{model_class} has no '{path}': ds_tsp cannot convert it")
    for key, feature in UNSUPPORTED_CONFIG_FEATURES.items():
        if getattr(model.config, key, None) not in (None, 1, 1.0):
            raise PolicyError(f"{model_class} uses {feature} (config.{key} = {getattr(model.config, key)}), "
                              "which the TSP forward does not reproduce: this architecture is not supported")
    dropout = getattr(model.config, "attention_dropout", 0.0) or 0.0
    if dropout:
        raise PolicyError(f"{model_class} has config.attention_dropout = {dropout}, which the TSP attention does not "
                          "apply: set model.config.attention_dropout = 0.0 before ds_tsp (its numbers then match "
                          "the unsharded model's), or leave tsp.enabled false")
    for index, layer in enumerate(layers):
        check_layer(policy, layer, f"{policy.layers}.{index}")
    return policy


def check_layer(policy, layer, where):
    """Refuse a decoder layer that is not exactly attention + gated MLP + two norms."""
    layer_class = type(layer).__name__
    if policy.layer_class is not None and layer_class != policy.layer_class:
        raise PolicyError(f"{where} is a {layer_class}, but tsp.policy = {policy.name!r} converts "
                          f"{policy.layer_class}: set tsp.policy to \"auto\" or the matching architecture")
    expected = {policy.attention: ATTENTION_PROJECTIONS, policy.mlp: MLP_PROJECTIONS,
                policy.input_norm: (), policy.post_attention_norm: ()}
    children = dict(layer.named_children())
    for child, projections in expected.items():
        if child not in children:
            raise PolicyError(f"{layer_class} at {where} has no '{child}' submodule: cannot convert it to a TSP layer")
        module = children[child]
        grandchildren = {n for n, m in module.named_children() if any(True for _ in m.parameters())}
        missing = [p for p in projections if p not in grandchildren]
        allowed = set(projections) | (set(ATTENTION_NORMS) if child == policy.attention else set())
        unexpected = sorted(grandchildren - allowed)
        if child == policy.attention and len(grandchildren & set(ATTENTION_NORMS)) == 1:
            missing += sorted(set(ATTENTION_NORMS) - grandchildren)
        if missing:
            raise PolicyError(f"{layer_class} at {where}.{child} lacks {missing}: cannot convert it to a TSP layer")
        if unexpected:
            raise PolicyError(f"{layer_class} at {where}.{child} has unexpected submodule(s) {unexpected} "
                              "that the TSP block would ignore: this layer is not supported")
    for name in children:
        if name not in expected and any(True for _ in children[name].parameters()):
            raise PolicyError(f"{layer_class} at {where} has an unexpected submodule '{name}' "
                              "that the TSP layer would ignore: this layer is not supported")
    if not hasattr(children[policy.mlp], "act_fn"):
        raise PolicyError(f"{layer_class} at {where}.{policy.mlp} has no act_fn: not a gated MLP ds_tsp knows")
