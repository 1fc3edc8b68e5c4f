"""A numerical check, at injection, of models accepted by shape only (``tsp.policy`` auto).

The policy tables say which forwards ds_tsp reproduces for the classes they
were audited for. A class accepted by shape may do more in its forward than
its modules show: a clamp, a position-dependent scale, an extra term, or
embeddings and logits scaled outside the layers. Before any weight moves,
``probe_layers`` runs the Hugging Face forward on a short float64 batch, with
every decoder layer but one (and the final norm and the head) replaced by
identities, and refuses the model on any difference beyond round-off in:

* the forward outside the layers: what reaches the first layer must be the
  embeddings fed in (times the config's ``embedding_multiplier``), and the
  logits what left the last layer (scaled or soft-capped where the config
  says so, as the TSP head does: ``LogitMap``);
* the probed layer's output against the TSP layer's, built by ``inject``'s
  own builder from a float64 copy of it and run on the same batch sharded over
  the TSP group, with the rotary tables the TSP forward computes.

One layer is probed per distinct kind (class and plain attributes: a sliding
window, a ``use_rope`` flag, a layer type), as a float64 copy with
seeded random weights: the check is of the forward, and it needs no weights
loaded (``from_pretrained`` reads block weights only as shards). Every rank
builds the same batch and the same copy; the differences are summed over
the TSP group, so all ranks reach the same verdict. Two rows of positions, one
from 0 and one far past ``max_position_embeddings``, expose position-dependent
scales.
"""

import contextlib
import copy
import inspect
import re

import torch
import torch.nn as nn
from transformers import LlamaConfig, PretrainedConfig

from ds_tsp.blocks.attention.module import qk_norm_names
from ds_tsp.blocks.latent.module import is_latent_attention
from ds_tsp.blocks.rotary import ComplexRotary, model_rotary, rotary_tables
from ds_tsp.blocks.vocab import LogitMap, embedding_multiplier, map_logits, scaled
from ds_tsp.injection.model import TSPBatch
from ds_tsp.injection.policy import PolicyError, is_recurrent, text_config
from ds_tsp.parallel import comm, layout
from ds_tsp.parallel.host_reads import host_read

# Relative to the largest output: float64 round-off of a reordered layer is
# ~1e-15; the smallest deviations a forward variant brings are orders larger.
TOLERANCE = 1e-9
# Hugging Face's eager attention takes its softmax in float32 whatever the
# model's dtype, so under it the reference is float32-exact only (~1e-7
# relative); a forward variant still moves the output by orders more.
EAGER_TOLERANCE = 1e-5
# Hugging Face's Gated DeltaNet (its torch path) runs its rule, decay and gated
# norm in float32 whatever the model's dtype: a layer holding one is compared
# as under eager attention.
LINEAR_TOLERANCE = EAGER_TOLERANCE
# HY-V3 adds its routed experts' and shared expert's outputs in float32 whatever the model's dtype
# (config.enable_moe_fp32_combine), the TSP block in float32 or wider: compared as under eager attention.
FLOAT32_COMBINE_TOLERANCE = EAGER_TOLERANCE
# Llama 4 rotates queries and keys by a complex64 table in float32 whatever the model's dtype, and torch's
# complex product rounds an element by the loop it falls in (the shape of the heads and tokens it is called on),
# so a TSP head group and Hugging Face's whole projection differ by float32 round-off (1.4e-8 measured at D=2):
# compared as under eager attention.
COMPLEX_ROTARY_TOLERANCE = EAGER_TOLERANCE
# Hugging Face's q/k norms over the whole projection (OLMo-2's kind: OLMo-Hybrid's under auto) compute in float32
# whatever the model's dtype; the TSP attention sums their squares over the ranks' head groups in float32 or wider:
# compared as under eager attention.
FLOAT32_NORM_TOLERANCE = EAGER_TOLERANCE
# Attention implementations that run float64 on any device; the probe runs any
# other (flash kernels take half precision on GPUs only) under SDPA, or eager
# where the class does not take SDPA.
FLOAT64_IMPLEMENTATIONS = ("sdpa", "eager")
SEED = 1234


class _StandIn(nn.Module):
    """A module standing in for ``original`` (kept outside the module tree): the
    plain attributes the model's forward reads of its layers (Nemotron-H's
    ``block_type``) are the original's."""

    def __init__(self, original=None):
        super().__init__()
        object.__setattr__(self, "_original", original)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original")
            if original is None or name.startswith("_"):
                raise
            return getattr(original, name)


class _PassThrough(_StandIn):
    """A decoder layer (or norm, or head) that returns its input; in a tuple
    with ``extra`` Nones after it for a layer whose forward returns a tuple its
    model unpacks (Bamba's ``hidden_states, attn_weights``) or indexes
    (Falcon-H1's ``layer_outputs[0]``: none after it); whole for None."""

    def __init__(self, extra=None, original=None):
        super().__init__(original)
        self.extra = extra

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states if self.extra is None else (hidden_states, *[None] * self.extra)


def _tuple_extras(decoder):
    """How many outputs ``decoder``'s forward unpacks from each layer's after the hidden states (Bamba's
    ``hidden_states, attn_weights = decoder_layer(...)``), 0 where it indexes the first of a tuple
    (Falcon-H1's ``layer_outputs[0]``), None where it takes the layer's output whole."""
    try:
        source = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return None
    unpacked = re.search(r"^\s*((?:\w+\s*,\s*)+\w+)\s*=\s*decoder_layer\(", source, re.MULTILINE)
    if unpacked is not None:
        return unpacked[1].count(",")
    named = re.search(r"^\s*(\w+)\s*=\s*decoder_layer\(", source, re.MULTILINE)
    return 0 if named is not None and re.search(rf"\b{named[1]}\[0\]", source) else None


class _Recorder(_StandIn):
    """Runs ``layer`` and keeps its input and output hidden states."""

    def __init__(self, layer):
        super().__init__(layer)
        self.layer = layer

    def forward(self, hidden_states, *args, **kwargs):
        out = self.layer(hidden_states, *args, **kwargs)
        self.seen = hidden_states, out if torch.is_tensor(out) else out[0]
        return out


def probe_layers(model, policy, topology, tsp_config, build, device=None):
    """Refuse ``model`` (accepted by ``policy`` auto) unless its forward equals the
    TSP model's on a probe batch; ``build`` is ``inject.tsp_layer``. Collective
    over ``topology.tsp_group``."""
    layers = model.get_submodule(policy.layers)
    # A model on the meta device is probed where the group's collectives run (the accelerator under NCCL).
    device = torch.device(device or next((p.device for p in layers[0].parameters() if not p.is_meta),
                                         comm.group_device(topology.tsp_group)))
    probed = {}
    for index, layer in enumerate(layers):
        # A layer attending to an earlier layer's chosen keys (GLM-MoE-DSA's shared indexer layers) cannot run
        # alone; it is the layer with an indexer of its own, the choice given (tests/test_sparse_attention.py).
        mixer = policy.mixer(layer)
        if not getattr(layer.get_submodule(mixer) if mixer else None, "skip_topk", False):
            probed.setdefault(_signature(layer), index)
    # Float64 throughout, so torch SDPA: this checks the layer's forward, not a kernel.
    probe_config = tsp_config.model_copy(update={"attention_backend": "sdpa"})
    implementation = getattr(text_config(model), "_attn_implementation", None) or "eager"
    if implementation not in FLOAT64_IMPLEMENTATIONS:
        # SDPA where the class takes it; GPT-OSS does not (SDPA has no sinks): its eager attention then.
        implementation = "sdpa" if getattr(type(model), "_supports_sdpa", True) else "eager"
    base_tolerance = EAGER_TOLERANCE if implementation == "eager" else TOLERANCE
    base_reference = (f"under Hugging Face's {implementation} attention, against a tolerance of {base_tolerance:.0e}"
                      + (" (its softmax runs in float32)" if implementation == "eager" else ""))
    logit_map = LogitMap.of(text_config(model))
    for index in probed.values():
        with _probe_settings(model, implementation):
            outside, inside = _probe(model, policy, topology, probe_config, build, index, device)
        where = f"{type(model).__name__} ({type(layers[index]).__name__} at {policy.layers}.{index})"
        tolerance, reference = base_tolerance, base_reference
        mixer, mlp = policy.mixer(layers[index]), policy.mlp_of(layers[index])
        if mixer is not None and is_recurrent(layers[index].get_submodule(mixer)):
            tolerance = max(tolerance, LINEAR_TOLERANCE)
            reference += f" ({tolerance:.0e} for a recurrent layer, whose rule Hugging Face runs in float32)"
        elif getattr(text_config(model), "enable_moe_fp32_combine", False) and mlp is not None and policy.is_sparse(
                layers[index].get_submodule(mlp)):
            tolerance = max(tolerance, FLOAT32_COMBINE_TOLERANCE)
            reference += (f" ({tolerance:.0e} for a layer whose experts Hugging Face adds in float32, "
                          "config.enable_moe_fp32_combine)")
        attn = None if mixer is None else layers[index].get_submodule(mixer)
        if attn is not None and not is_recurrent(attn) and not is_latent_attention(attn) and \
                isinstance(model_rotary(attn), ComplexRotary):
            tolerance = max(tolerance, COMPLEX_ROTARY_TOLERANCE)
            reference += (f" ({tolerance:.0e} for a layer rotating by a complex table in float32, Llama 4's "
                          "apply_rotary_emb)")
        if attn is not None and not is_recurrent(attn) and not is_latent_attention(attn) and \
                _float32_projection_norms(attn):
            tolerance = max(tolerance, FLOAT32_NORM_TOLERANCE)
            reference += (f" ({tolerance:.0e} for q/k norms over the whole projection, which Hugging Face computes "
                          "in float32 and the TSP attention from every rank's sums of squares)")
        if not outside <= tolerance:  # NaN too: a forward the probe cannot read is not accepted
            head = "lm_head" if logit_map is None else f"lm_head -> {logit_map}"
            raise PolicyError(f"{where} was accepted by shape only (tsp.policy auto), but its forward outside the "
                              f"decoder layers differs from embed -> layers -> norm -> {head} (relative "
                              f"difference {outside:.1e} on a float64 probe {reference}), e.g. scales embeddings "
                              "or logits: ds_tsp does not support it")
        if not inside <= tolerance:
            raise PolicyError(f"{where} was accepted by shape only (tsp.policy auto), but its decoder layer's "
                              f"forward differs from the TSP layer's (relative difference {inside:.1e} on a float64 "
                              f"probe {reference}): it does more than Llama's layer, so ds_tsp does not support it"
                              f"{unaudited_features(text_config(model), policy)}")


def unaudited_features(config, policy):
    """For a refusal: the attributes of ``config`` that neither Llama's config
    has nor ``policy`` audits, among which the feature the TSP layer lacks is
    likely named; empty where there are none."""
    known = {*LlamaConfig().to_dict(), *PretrainedConfig().to_dict(), *policy.config}
    names = sorted(name for name in config.to_dict() if name not in known and not name.startswith("_"))
    return f" (its config's attributes that ds_tsp does not audit, one of which likely names it: {names})" \
        if names else ""


@contextlib.contextmanager
def _probe_settings(model, implementation):
    """Within the block, the model (and the copies of its layers the probe
    makes, which share its config until copied) runs the attention
    ``implementation``, a mixture of experts its eager loop (HF's default
    grouped_mm takes no float64; the probe checks the forward, not a kernel)
    and no load-balancing loss (its layers but one are pass-throughs, which
    record no router logits)."""
    config = text_config(model)
    overrides = {"_attn_implementation": implementation, "_experts_implementation": "eager",
                 "output_router_logits": False}
    # The attention implementation always; the MoE settings where the config has them (a dense model's has none).
    saved = {key: getattr(config, key, None) for key in overrides}
    changed = [key for key in overrides if key == "_attn_implementation" or saved[key] is not None]
    for key in changed:
        setattr(config, key, overrides[key])
    try:
        yield
    finally:
        for key in changed:
            setattr(config, key, saved[key])


def _signature(layer):
    """What tells a layer's forward from another's of the same class: the class
    and plain attributes (a sliding window, a ``use_rope`` flag, a layer type) of
    each of its modules, but its index."""
    return tuple((path, type(module).__name__,
                  tuple(sorted((key, value) for key, value in vars(module).items()
                               if isinstance(value, (bool, int, float, str, type(None)))
                               and not key.startswith("_") and key != "layer_idx")))
                 for path, module in layer.named_modules())


def _probe(model, policy, topology, tsp_config, build, index, device):
    """``(outside, inside)``: the relative differences of one probe, summed over the TSP group."""
    tsp_rank, tsp_size = topology.tsp_rank, topology.tsp_size
    generator = torch.Generator().manual_seed(SEED)
    batch, seq_len = 2, 2 * tsp_size * max(1, -(-8 // (2 * tsp_size)))
    config = text_config(model)
    hidden = torch.randn(batch, seq_len, config.hidden_size, generator=generator, dtype=torch.float64)
    hidden = hidden.to(device)
    far = 4 * max(getattr(config, "max_position_embeddings", 0) or 0,
                  (getattr(config, "rope_parameters", None) or {}).get("original_max_position_embeddings", 0))
    positions = torch.arange(seq_len, device=device) + torch.tensor([[0], [far]], device=device)

    layers = model.get_submodule(policy.layers)
    recorder = _Recorder(_float64_copy(layers[index], device, generator))
    # The rotary module may keep state between calls (dynamic RoPE): probe a copy.
    rotary = copy.deepcopy(policy.rotary_module(model))
    with torch.no_grad():
        try:
            with _swapped(model, policy, index, recorder, rotary):
                logits = model(inputs_embeds=hidden, position_ids=positions, use_cache=False).logits
        except Exception as error:
            raise PolicyError(f"{type(model).__name__} was accepted by shape only (tsp.policy auto), but its forward "
                              f"could not run on the float64 probe ({type(error).__name__}: {error}): ds_tsp does "
                              "not support it") from error
        layer_in, layer_out = recorder.seen
        # The final logits mapped as the TSP head does (LogitMap: scaled, soft-capped), nothing else; in the
        # dtype the model hands them out in (Nemotron-H's in float32 whatever its own: the TSP head's loss and
        # logits take the model's, float32 or wider inside).
        expected = map_logits(layer_out, LogitMap.of(config)).to(logits.dtype)
        # What reaches the first layer: the embeddings fed in, times the model's embedding_multiplier where its
        # forward scales embeddings it is given (Granite's), not only those it looks up (Falcon-H1's).
        decoder = model.get_submodule(policy.layers.rpartition(".")[0])
        multiplier = embedding_multiplier(config) if _scales_given_embeddings(decoder) else 1.0
        embedded = scaled(hidden, multiplier)
        if policy.model_streams(model) is not None:  # the layers take hc_mult streams, the embedding repeated
            embedded = embedded.unsqueeze(2).expand_as(layer_in)
        outside = torch.maximum(_relative(layer_in, embedded), _relative(logits.to(layer_out.dtype), expected))

        tsp_layer = build(recorder.layer, config, policy, topology, tsp_config, device=device,
                          rotary_kind=policy.rotary_kind(config, index) if policy.rotary_kind else None)
        shard = TSPBatch(torch.zeros(batch, seq_len, dtype=torch.long, device=device), None, positions, None,
                         tsp_rank, tsp_size, tsp_config.layout)
        local = layout.shard(layer_in, tsp_rank, tsp_size, tsp_config.layout)  # what the HF layer saw
        tables = rotary_tables(rotary, local, shard.position_ids, shard.max_position, tsp_layer.rotary_kind)
        try:
            mine = tsp_layer(local, tables, positions=shard.position_ids, cache_positions=shard.cache_positions)
            if isinstance(mine, tuple):  # the layer also hands on what a later layer shares (kv_sharing "store")
                mine = mine[0]
        except (TypeError, ValueError, RuntimeError) as error:  # e.g. a router that returns something else
            raise PolicyError(f"{type(model).__name__} was accepted by shape only (tsp.policy auto), but the TSP "
                              f"layer built from its {type(recorder.layer).__name__} could not run on the probe "
                              f"({type(error).__name__}: {error}): ds_tsp does not support it") from error
        inside = _relative(mine, layout.shard(layer_out, tsp_rank, tsp_size, tsp_config.layout))
    verdict = torch.stack([outside, inside]).to(torch.float64).to(comm.group_device(topology.tsp_group))
    comm.all_reduce(verdict, topology.tsp_group)
    return host_read(verdict, "probe").tolist()


def _scales_given_embeddings(decoder):
    """Whether ``decoder`` multiplies the embeddings it is given by its embedding_multiplier, not only those it
    looks up (Falcon-H1's ``embed_tokens(input_ids) * self.embedding_multiplier``)."""
    return "embed_tokens(input_ids) * self.embedding_multiplier" not in _forward_source(decoder)


def _float32_projection_norms(attn):
    """Whether ``attn``'s q/k norms span its whole projection (wider than a head) and compute in float32."""
    names, _ = qk_norm_names(attn)
    norms = [getattr(attn, name, None) for name in names or ()]
    return any(norm.weight.numel() != getattr(attn, "head_dim", 0) and "torch.float32" in _forward_source(norm)
               for norm in norms if getattr(norm, "weight", None) is not None)


def _forward_source(module):
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def _relative(actual, expected):
    """The largest difference relative to the largest ``expected`` entry, a 0-dim tensor where they are."""
    scale = expected.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return (actual - expected).abs().max() / scale


@contextlib.contextmanager
def _swapped(model, policy, index, recorder, rotary):
    """Within the block, the model's decoder layers, final norm and head (and the
    module mixing hyper-connected streams) are pass-throughs but layer ``index``
    (``recorder``), and its rotary module is ``rotary``; everything is put back on exit."""
    layers = model.get_submodule(policy.layers)
    saved_layers = list(layers)
    extras = _tuple_extras(model.get_submodule(policy.layers.rpartition(".")[0]))
    head = _PassThrough()
    head.register_buffer("weight", torch.empty(0, dtype=torch.float64))  # the dtype a forward may cast to (HY-V4's)
    streams = policy.model_streams(model)  # the module mixing hyper-connected streams into one, passed through too
    stand_ins = {policy.final_norm: _PassThrough(), policy.lm_head: head,
                 **({} if policy.rotary_emb is None else {policy.rotary_emb: rotary}),
                 **({} if streams is None else {streams.head: _PassThrough()})}
    saved = {path: model.get_submodule(path) for path in stand_ins}
    try:
        for i in range(len(layers)):
            layers[i] = recorder if i == index else _PassThrough(extras, saved_layers[i])
        for path, module in stand_ins.items():
            model.set_submodule(path, module)
        yield
    finally:
        for i, layer in enumerate(saved_layers):
            layers[i] = layer
        for path, module in saved.items():
            model.set_submodule(path, module)


def _float64_copy(layer, device, generator):
    """A float64 copy of ``layer`` on ``device`` with seeded random parameters:
    the probe checks the forward as a function, and random weights at a scale
    that keeps activations of order one make every term of it count (a model's
    own weights may hide one: zero biases, unit norms). Buffers are copied."""
    probe = copy.deepcopy(layer)
    for module in probe.modules():
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is None:
                continue
            if name in module._parameters or tensor.is_meta:
                value = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
                if tensor.dim() >= 2:
                    value /= tensor.shape[-1] ** 0.5
                else:  # norm weights near one, biases and scales near zero
                    value = 1 + 0.2 * value if name == "weight" else 0.2 * value
            else:
                value = tensor.detach().to(torch.float64 if tensor.is_floating_point() else tensor.dtype)
            if name in module._parameters:
                module._parameters[name] = nn.Parameter(value.to(device), requires_grad=False)
            else:
                module._buffers[name] = value.to(device)
    return probe
