"""PEFT's LoRA adapters on TSP blocks: each adapter sharded the way its base weight is.

A LoRA projection computes ``x W^T + s (x A^T) B^T`` with the frozen base ``W``
``(out, in)``, ``A`` ``(r, in)``, ``B`` ``(out, r)`` and PEFT's scaling ``s``
(``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``). That is ``x W'^T``
with ``W' = W + s B A``, and a TSP rank's rows (or columns) of ``W'`` need only
its rows of ``B`` (or columns of ``A``):

* a projection split by output rows (``q/k/v_proj`` by head group,
  ``gate/up_proj`` by ``F`` rows, a latent attention's down and up
  projections): ``W'_j = W_j + s B_j A``: ``B`` split by the same rows, ``A``
  whole on every rank;
* one split by input columns (``o_proj``, ``down_proj``): ``W'_j = W_j + s B A_j``:
  ``A`` split by the same columns, ``B`` whole.

Each forward a block builds this rank's merged shard ``W'_j`` from its frozen
packed shard and its adapters (``LoRAShards.merge``: one ``(rows, r) x (r,
cols)`` product per adapted projection), and the schedules move and compute
with it exactly as they move the base shard without adapters: one collective
per step, the same bytes. Backward, the schedules deliver the merged shard's
gradient ``dW'_j`` (summed over every rank's tokens) to its owner as they
always do, and autograd takes it into the adapters: ``dB_j = s dW'_j A^T`` and
``dA_j = s B^T dW'_j`` are whole on the owner; the whole factor's
``s B_j^T dW'_j`` (or ``s dW'_j A_j^T``) is this rank's summand, summed over
the TSP group once, as a norm's gradient is (``sum_grads_over_group``).

The frozen base never gets a gradient; the merged shard lives from the
forward to the backward (the schedules keep their shard), one more copy of
this rank's ``1/D`` of the block's weights. ``lora_dropout`` would apply a
mask to ``x`` inside the adapter only, which a merged weight cannot, and is
refused; so are DoRA and every other PEFT layer than a plain LoRA ``Linear``.

``adapters_disabled`` switches every block's adapters off (the base shard
alone): what PEFT's ``disable_adapter`` gives, and what TRL's DPO and GRPO
take as the reference model when they train adapters without a ``ref_model``.
"""

import contextlib
import re

import torch
from torch import nn

from ds_tsp.blocks.latent.module import is_latent_attention
from ds_tsp.injection.policy import PolicyError, is_recurrent
from ds_tsp.parallel import comm

ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
             "kv_b_proj")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
           "kv_a_proj_with_mqa", "kv_b_proj")


class LoRAAdapter(nn.Module):
    """This rank's part of one projection's adapter: ``lora_A`` ``(r, in)`` and
    ``lora_B`` ``(out, r)`` of the rows or columns its base shard holds, and
    PEFT's ``scaling``. The split factor is tagged ``tensor_model_parallel``
    (its shards differ by rank); the whole one is replicated."""

    def __init__(self, lora_A, lora_B, scaling, split_by_rows):
        super().__init__()
        # A Parameter already: the A of a fused projection's adapter, one for all its parts.
        self.lora_A = lora_A if isinstance(lora_A, nn.Parameter) else nn.Parameter(lora_A)
        self.lora_B = nn.Parameter(lora_B)
        self.scaling, self.split_by_rows = scaling, split_by_rows
        (self.lora_B if split_by_rows else self.lora_A).tensor_model_parallel = True

    def delta(self, dtype):
        """``s B A`` ``(out, in)`` of this rank's rows or columns, in ``dtype``."""
        return (self.lora_B @ self.lora_A * self.scaling).to(dtype)

    def extra_repr(self):
        return f"r={self.lora_A.shape[0]}, scaling={self.scaling}, split_by={'rows' if self.split_by_rows else 'columns'}"


class LoRAShards(nn.Module):
    """The adapters of one TSP block, by projection name; ``merge(packed)``
    returns the block's merged packed shard (see the module docstring). Not a
    forward: ZeRO-3 gathers the adapters with their block (a leaf module),
    whose input needs a gradient, so they stay gathered until the block's
    backward has reached them; a forward of its own, on the frozen shard
    alone, would release them before."""

    def __init__(self, spec, adapters):
        super().__init__()
        self.spec = spec
        self.adapters = nn.ModuleDict(adapters)
        self.enabled = True

    def merge(self, packed):
        if not self.enabled:
            return packed
        views, pieces = self.spec.unpack(packed), []
        for name, view in views.items():
            projection, kind = name.rsplit(".", 1)
            adapter = self.adapters[projection] if projection in self.adapters and kind == "weight" else None
            pieces.append((view if adapter is None else view + adapter.delta(view.dtype)).reshape(-1))
        for projection, adapter in self.adapters.items():
            if f"{projection}.weight" not in views:
                # A rank holding no key/value heads (nkv < D): A is in its graph
                # all the same, so its gradient's sum over the group has this
                # rank's (zero) summand.
                pieces.append(adapter.lora_A.reshape(-1)[:0].to(packed.dtype))
        return torch.cat(pieces)


def shard_adapters(block, adapters):
    """Give the TSP ``block`` its ``LoRAShards`` from ``adapters``: ``{projection:
    (read, scaling)}``, ``read(factor, piece)`` returning ``lora_A`` or ``lora_B``
    cut to ``piece = (dim, start, length)`` (None: whole), from a model object
    (``model_reader``) or from PEFT's files (``checkpoint.adapters.AdapterFiles``).

    A fused projection's adapter (Phi-3's ``qkv_proj``: ``W + s B A`` over the
    rows of q, k and v) becomes one adapter per part, each with its rows of
    ``B`` (``ds_tsp.blocks.fused``) and all of them one ``A`` parameter."""
    if not adapters:
        return
    shards = {}
    for projection, (read, scaling) in adapters.items():
        renamed = block.hf_rows.parts(projection) if projection in block.hf_rows.totals else []
        if len(renamed) == 1:  # a projection under another name (Granite-4.0-H's output_linear for down_proj)
            projection = renamed[0]
        elif projection in block.hf_rows.totals:
            lora_A = nn.Parameter(read("lora_A", None).contiguous())
            for part in block.hf_rows.parts(projection):
                first_row = block.hf_rows.sources[f"{part}.weight"][1]
                shards[part] = _row_split_adapter(block, part, lora_A, scaling, lambda factor, piece, first=first_row:
                                                  read(factor, (0, first + piece[1], piece[2])))
            continue
        if projection in ROW_SPLIT:
            shards[projection] = _row_split_adapter(block, projection, read("lora_A", None).contiguous(), scaling,
                                                    read)
        else:
            _, start, length = block.shard_piece(f"{projection}.weight")
            shards[projection] = LoRAAdapter(read("lora_A", (1, start, length)).contiguous(),
                                             read("lora_B", None).contiguous(), scaling, False)
    block.lora = LoRAShards(block.spec, shards)


def _row_split_adapter(block, projection, lora_A, scaling, read):
    """The adapter of a projection split by rows: ``A`` whole, this rank's rows of ``B``."""
    _, start, length = block.shard_piece(f"{projection}.weight")
    if f"{projection}.weight" not in block.spec.shapes:  # a rank holding no key/value heads
        length = 0
    return LoRAAdapter(lora_A, read("lora_B", (0, start, length)).contiguous(), scaling, True)


def model_reader(lora_A, lora_B, tsp_group):
    """``read(factor, piece)`` over an adapter of a model object, which may
    differ between ranks in value (PEFT draws ``A`` at random): TSP rank 0's
    factors, broadcast once."""
    factors = {"lora_A": lora_A.detach().clone(), "lora_B": lora_B.detach().clone()}
    if comm.group_size(tsp_group) > 1:
        for tensor in factors.values():
            comm.broadcast(tensor, src=0, group=tsp_group)

    def read(factor, piece):
        return factors[factor] if piece is None else factors[factor].narrow(*piece).clone()

    return read


@contextlib.contextmanager
def adapters_disabled(model):
    """While the body runs, every TSP block of ``model`` computes with its
    frozen base shard alone, as PEFT's ``disable_adapter`` makes its LoRA
    layers compute with their base layers."""
    shards = [module for module in model.modules() if isinstance(module, LoRAShards)]
    enabled = [shard.enabled for shard in shards]
    for shard in shards:
        shard.enabled = False
    try:
        yield
    finally:
        for shard, was in zip(shards, enabled):
            shard.enabled = was


class TSPPeftModelMixin:
    """Put in front of the class of a ``PeftModel`` whose Hugging Face model
    was injected (``take_adapters``): its LoRA layers are TSP blocks' adapters
    now, which PEFT's walk over its own layers no longer finds, so
    ``disable_adapter`` (TRL's reference model under PEFT) switches those off."""

    @contextlib.contextmanager
    def disable_adapter(self):
        with adapters_disabled(self.get_base_model()):
            yield


_TSP_PEFT_CLASSES = {}


def _tsp_peft_class(cls):
    if cls not in _TSP_PEFT_CLASSES:
        _TSP_PEFT_CLASSES[cls] = type(f"TSP{cls.__name__}", (TSPPeftModelMixin, cls), {})
    return _TSP_PEFT_CLASSES[cls]


def is_peft_model(model):
    """Whether ``model`` is one of PEFT's own modules (a ``PeftModel``, a LoRA layer, ...), or one of
    ``TSPPeftModelMixin``'s."""
    return any(cls.__module__.startswith("peft.") for cls in type(model).__mro__)


def holds_adapters(model):
    """Whether ``model`` is a ``PeftModel`` or holds PEFT's layers."""
    return any(is_peft_model(module) for module in model.modules())


def take_adapters(model):
    """``(hf_model, peft_config, adapters)``: for a ``PeftModel`` (or the
    Hugging Face model inside one), the Hugging Face model with each LoRA layer
    replaced by its base layer, PEFT's config of the adapter, and ``{module
    path: (lora_A, lora_B, scaling)}`` of the adapters; ``(model, None, {})``
    for a model without PEFT layers. Anything ds_tsp cannot shard exactly is
    refused by the option that made it, before any weight moves."""
    from peft.tuners.lora.layer import Linear as LoRALinear

    peft_configs = getattr(model, "peft_config", None)
    hf_model = model.base_model.model if is_peft_model(model) else model
    layers = {path: module for path, module in hf_model.named_modules() if is_peft_model(module)}
    if not layers and not is_peft_model(model):
        return model, None, {}
    if peft_configs is None:  # the inner model: PeftModel's config is on its LoRA layers' owner
        peft_configs = next((m.peft_config for m in hf_model.modules() if hasattr(m, "peft_config")), None)
    peft_config = one_lora_config(peft_configs)
    adapters = {}
    for path, layer in layers.items():
        if type(layer) is not LoRALinear:
            raise PolicyError(f"{path} is a PEFT {type(layer).__name__}: ds_tsp shards plain LoRA adapters on "
                              f"{', '.join(TARGETS)} only (modules_to_save, trainable_token_indices, "
                              "target_parameters and LoRA on embeddings or the LM head are not supported): drop "
                              "it from the PEFT config")
        adapters[path] = _lora_weights(path, layer)
    for path, layer in layers.items():
        hf_model.set_submodule(path, layer.get_base_layer())
    if is_peft_model(model) and hasattr(model, "disable_adapter"):  # the PeftModel around it, which its owner keeps
        model.__class__ = _tsp_peft_class(type(model))
    return hf_model, peft_config, adapters


def one_lora_config(peft_configs):
    if not peft_configs or len(peft_configs) != 1:
        raise PolicyError(f"the PEFT model holds adapters {sorted(peft_configs or {})}: ds_tsp shards exactly one; "
                          "delete the others (peft_model.delete_adapter(name)) or merge them first")
    (name, config), = peft_configs.items()
    if str(getattr(config.peft_type, "value", config.peft_type)) != "LORA":
        raise PolicyError(f"PEFT adapter {name!r} is {config.peft_type}: ds_tsp shards LoRA adapters only")
    refused = {"use_dora": "DoRA's column norms of W + sBA span every TSP shard",
               "layer_replication": "replicated layers share their base weights",
               "modules_to_save": "whole trainable copies of modules are not sharded",
               "trainable_token_indices": "trainable token rows are not sharded",
               "target_parameters": "adapters on raw parameters (MoE experts) are not sharded"}
    for option, reason in refused.items():
        if getattr(config, option, None):
            raise PolicyError(f"LoraConfig({option}={getattr(config, option)!r}) is not supported under TSP "
                              f"({reason}): leave {option} unset")
    if config.bias != "none":
        raise PolicyError(f"LoraConfig(bias={config.bias!r}) trains base biases, which TSP packs into frozen "
                          "shards: use bias=\"none\"")
    if config.lora_dropout:
        raise PolicyError(f"LoraConfig(lora_dropout={config.lora_dropout}) drops inputs of the adapter only, which "
                          "TSP's merged shard (W + s B A) cannot: set lora_dropout=0.0")
    return config


def _lora_weights(path, layer):
    (adapter,) = layer.active_adapters if len(layer.active_adapters) == 1 else (None,)
    if adapter is None or layer.disable_adapters or layer.merged:
        raise PolicyError(f"{path}: ds_tsp shards one active, unmerged LoRA adapter (active: "
                          f"{layer.active_adapters}, merged: {layer.merged}, disabled: {layer.disable_adapters})")
    for option in ("use_dora", "lora_bias"):
        if getattr(layer, option).get(adapter):
            raise PolicyError(f"{path}: LoraConfig({option}=True) is not supported under TSP: leave it False")
    if getattr(layer, "lora_variant", {}).get(adapter) is not None:
        raise PolicyError(f"{path}: the LoRA variant {type(layer.lora_variant[adapter]).__name__} is not supported "
                          "under TSP: use plain LoRA")
    if layer.fan_in_fan_out:
        raise PolicyError(f"{path}: LoraConfig(fan_in_fan_out=True) (Conv1D layers) is not supported under TSP")
    if not isinstance(layer.lora_dropout[adapter], nn.Identity):
        raise PolicyError(f"{path}: lora_dropout > 0 is not supported under TSP: set lora_dropout=0.0")
    return layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, layer.scaling[adapter]


ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# A multi-head latent attention's (ds_tsp.blocks.latent): a query latent or a plain query projection.
LATENT_TARGETS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def check_adapter_paths(adapters, policy, layers):
    """Refuse adapters anywhere but on the projections TSP shards: a decoder
    layer's attention and dense MLP (a sparse MLP's experts are fused tensors),
    as the model's modules hold them (Phi-3's fused ``qkv_proj``, ``gate_up_proj``)."""
    attention = policy.hf_projections(policy.attention, ATTENTION_TARGETS)
    mlp = policy.hf_projections(policy.mlp, MLP_TARGETS)
    allowed = set()
    for index, layer in enumerate(layers):
        prefix = f"{policy.layers}.{index}"
        mixer, mlp_name = policy.mixer(layer), policy.mlp_of(layer)
        if mixer is not None and not is_recurrent(layer.get_submodule(mixer)):  # none on a hybrid's recurrent mixer
            latent = is_latent_attention(layer.get_submodule(mixer))
            allowed |= {f"{prefix}.{mixer}.{name}" for name in (LATENT_TARGETS if latent else attention)}
        if mlp_name is not None and not policy.is_sparse(layer.get_submodule(mlp_name)):
            allowed |= {f"{prefix}.{mlp_name}.{name}" for name in mlp}
    for path in adapters:
        if path not in allowed:
            raise PolicyError(f"a LoRA adapter on {path}: ds_tsp shards adapters on the decoder layers' "
                              f"{', '.join(attention)} (a latent attention's {', '.join(LATENT_TARGETS)}; none on "
                              f"a recurrent mixer's) and a dense MLP's {', '.join(mlp)}: drop it from "
                              "LoraConfig(target_modules=...)")


def block_adapters(adapters, prefix):
    """The adapters under module path ``prefix``, by their path below it."""
    return {path[len(prefix) + 1:]: weights for path, weights in adapters.items() if path.startswith(f"{prefix}.")}


def peft_parameter_name(name):
    """What a PEFT model's parameter is called in the TSP model's terms (the
    Hugging Face module path): ``model.layers.0.self_attn.q_proj.lora_A`` for
    PEFT's ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``,
    ``...q_proj.weight`` for its ``...q_proj.base_layer.weight``."""
    name = re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1", name.removeprefix("base_model.model."))
    return name.replace(".base_layer.", ".")


def adapter_parameter_name(model, module_name, param_name):
    """The same for a parameter of the injected ``model``'s ``LoRAAdapter`` at
    ``module_name`` (``model.layers.0.self_attn.lora.adapters.q_proj``): named
    by the projection the Hugging Face module holds (Phi-3's ``qkv_proj`` for
    its q, k and v parts)."""
    block_name, _, projection = module_name.partition(".lora.adapters.")
    hf_projection = model.get_submodule(block_name).hf_rows.hf_name(f"{projection}.weight").removesuffix(".weight")
    return f"{block_name}.{hf_projection}.{param_name}"
