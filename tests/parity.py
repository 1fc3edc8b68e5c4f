"""Whole injected models against the unsharded Hugging Face model, float64: the
bodies and checks the model and vocabulary tests share."""

import contextlib
import copy
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ds_tsp
from ds_tsp.config import TSPConfig
from ds_tsp.blocks.input_norm import TiledInputNorm
from ds_tsp.blocks.packing import PackedShardMixin
from ds_tsp.blocks.tower import ShardedUnit
from ds_tsp.injection.policy import hf_path
from ds_tsp.runtime.offload import host_checkpoint
from ds_tsp.parallel.topology import TSPTopology
from models import tiny_model

# float64 throughout; sharding only reorders sums (rounding ~1e-15), while a
# wrong shard or position moves the loss by ~1e-2 (see the guard tests).
TOLERANCE = 1e-10
# What model_parity reports besides differences.
NOT_DIFFS = ("saved_bytes", "input_norm_recomputes")
# Models whose forward builds its attention masks without the position ids, so Hugging Face would attend
# across packed documents there (GPT-OSS in transformers 5.25): their reference gets the masks that HF's own
# mask functions build from the position ids, as its other models' forwards do.
MASKS_WITHOUT_POSITIONS = ("gpt_oss",)


def document_masks(model, input_ids, attention_mask, position_ids):
    """``{layer type: mask}`` of HF's ``create_causal_mask`` and
    ``create_sliding_window_causal_mask`` given the packed ``position_ids``."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kwargs = dict(config=model.config, inputs_embeds=model.get_input_embeddings()(input_ids),
                  attention_mask=attention_mask, cache=None, position_ids=position_ids)
    return {"full_attention": create_causal_mask(**kwargs),
            "sliding_attention": create_sliding_window_causal_mask(**kwargs)}


def reference_loss(model, input_ids, attention_mask=None, num_items_in_batch=None, position_ids=None, labels=None):
    """HF's causal-LM loss, but in float64 (HF upcasts logits to float32 only);
    with ``num_items_in_batch``, the sum over real tokens divided by it.
    Without a cache: only then does HF read packed documents from ``position_ids``.
    ``labels``: the input ids by default (-100 where no loss is taken)."""
    masks = attention_mask
    if position_ids is not None and model.config.model_type in MASKS_WITHOUT_POSITIONS:
        masks = document_masks(model, input_ids, attention_mask, position_ids)
    recurrent_types = {"linear_attention", "conv", "hybrid"}
    if position_ids is not None and recurrent_types & set(getattr(model.config, "layer_types", None) or ()):
        logits = per_document_logits(model, input_ids, position_ids)
    else:
        logits = model(input_ids=input_ids, attention_mask=masks, position_ids=position_ids, use_cache=False).logits
    labels = (input_ids if labels is None else labels)[:, 1:].clone()
    if attention_mask is not None:
        labels[attention_mask[:, 1:] == 0] = -100
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100, reduction=reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def per_document_logits(model, input_ids, position_ids):
    """The logits of packed rows with every document run alone: Hugging Face's
    linear-attention and short-convolution layers carry their state across
    packed documents (their torch path ignores the boundaries), so the
    reference for a state that restarts at each document is Hugging Face's
    model on each document."""
    rows = []
    for row, positions in zip(input_ids, position_ids):
        starts = [0] + [t for t in range(1, len(positions)) if positions[t] != positions[t - 1] + 1] + [len(row)]
        rows.append(torch.cat([model(input_ids=row[None, a:b], use_cache=False).logits[0]
                               for a, b in zip(starts, starts[1:])]))
    return torch.stack(rows)


def shard_grad_diffs(tsp_model, ref_model, relative=False):
    """Max |diff| of every gradient this rank holds against the matching piece of
    the reference's (a folded vocabulary's padding rows must get none); with
    ``relative``, each divided by the largest entry of the reference's whole
    gradient where that is above 1 (float64 round-off is relative to it)."""
    ref = {n: p.grad for n, p in ref_model.named_parameters()}

    def scale(name):
        return max(1.0, ref[name].abs().max().item()) if relative else 1.0

    hf_names = replicated_hf_names(tsp_model)
    diffs = {}
    for name, param in tsp_model.named_parameters():
        if not getattr(param, "tensor_model_parallel", False) and param.requires_grad:  # not a frozen buffer-like
            name = hf_names.get(id(param), name)  # parameter (ERNIE 4.5's e_score_correction_bias)
            if param.grad is None or ref[name] is None:  # unused by the forward (LLaVA's last tower layer)
                diffs[name] = 0.0 if param.grad is None and ref[name] is None else float("inf")
                continue
            diffs[name] = (param.grad - ref[name]).abs().max().item() / scale(name)
    policy = tsp_model.tsp_policy
    inputs = policy.model_inputs(tsp_model)  # a per-layer embedding (Gemma 4's), folded as the main one
    for name in (policy.embed_tokens, policy.lm_head, *([inputs.embed] if inputs else [])):
        module = tsp_model.get_submodule(name)
        if getattr(module.weight, "tensor_model_parallel", False):
            piece = module.shard_piece("weight")
            grad = module.weight.grad
            full_name = f"{name}.weight" if f"{name}.weight" in ref else f"{policy.embed_tokens}.weight"  # tied: one
            full = ref[full_name]
            if grad is None:  # a forward that never reached it (a guard's)
                diffs[f"{name}.weight"] = 0.0 if full is None else float("inf")
                continue
            diffs[f"{name}.weight"] = (grad[:piece[2]] - full.narrow(*piece)).abs().max().item() / scale(full_name)
            diffs[f"{name}.weight padding rows"] = grad[piece[2]:].abs().max().item() if piece[2] < len(grad) else 0.0
    for prefix, unit in sharded_units(tsp_model):  # a vision tower's units, 1/D of each per rank
        grads = {name: ref[f"{prefix}.{name}"] for name in unit.names}
        if unit.shard.grad is None:  # a unit the forward leaves unused: Hugging Face's tensors get none either
            diffs[f"{prefix}.shard"] = 0.0 if all(grad is None for grad in grads.values()) else float("inf")
            continue
        shapes = dict(zip(unit.names, unit.shapes))
        full = unit_slice(unit, {name: torch.zeros(shapes[name], dtype=unit.shard.grad.dtype) if grad is None else grad
                                 for name, grad in grads.items()})
        diffs[f"{prefix}.shard"] = (unit.shard.grad - full).abs().max().item()
    # Every TSP block of a layer, and a folded MoE block's shared expert (a TSP MLP inside it).
    blocks = [(hf_path(policy.layers, str(index), name, inner), block)
              for index, layer in enumerate(tsp_model.get_submodule(policy.layers))
              for name, outer in layer.hf_blocks().items()
              for inner, block in outer.named_modules() if isinstance(block, PackedShardMixin)]
    for prefix, block in blocks:
        for name, grad in block.spec.unpack(block.packed.grad).items():
            # A fused Hugging Face tensor (Phi-3's qkv_proj) holds the piece at shifted rows.
            hf_name, piece = block.hf_rows.hf_piece(name, block.shard_piece(name))
            full_name = f"{prefix}.{hf_name}"
            if ref[full_name] is None:  # no gradient in Hugging Face's (a lightning indexer's): zeros in the shard
                diffs[f"{prefix}.{name}"] = grad.abs().max().item()
                continue
            diffs[f"{prefix}.{name}"] = (grad - ref[full_name].narrow(*piece)).abs().max().item() / scale(full_name)
    return diffs


def sharded_units(tsp_model):
    """``[(name, ShardedUnit)]``: the units of a vision tower held 1/D per rank (``ds_tsp.blocks.tower``)."""
    return [(name, module) for name, module in tsp_model.named_modules() if isinstance(module, ShardedUnit)]


def unit_slice(unit, full):
    """This rank's slice of ``unit``'s flat vector, cut from the full tensors ``full`` (``{name in the unit: tensor}``)."""
    flat = torch.cat([full[name].reshape(-1) for name in unit.names])
    length, tsp_rank = unit.shard.numel(), dist.get_rank(unit.tsp_group)
    flat = torch.cat([flat, flat.new_zeros(length * dist.get_world_size(unit.tsp_group) - flat.numel())])
    return flat[tsp_rank * length:(tsp_rank + 1) * length]


def replicated_hf_names(tsp_model):
    """``{id(parameter): Hugging Face name}`` of the tensors the TSP blocks keep
    whole on every rank (o_proj / down_proj biases, q/k norms, routers)."""
    layers = tsp_model.tsp_policy.layers
    return {id(param): hf_path(layers, str(index), block_name, hf_name)
            for index, layer in enumerate(tsp_model.get_submodule(layers))
            for block_name, block in layer.hf_blocks().items()
            for hf_name, param in block.replicated_params().items()}


def held_pieces(tsp_model, full):
    """``[(Hugging Face name, parameter, value held here, the matching piece of
    full[name])]`` for every tensor the TSP model ``tsp_model`` holds: a
    shard's pieces (``sharded_pieces``), a replicated tensor whole, each under
    the name Hugging Face's model gives it (a TSP layer keeps its MLP as
    ``mlp`` whatever its ``mlp_name``, Granite-MoE's ``block_sparse_moe``, and
    experts beside it as ``moe``: ``TSPDecoderLayer.hf_prefixes``)."""
    layers = tsp_model.tsp_policy.layers
    hf_blocks = {f"{layers}.{index}.{attribute}": hf_path(layers, str(index), hf)
                 for index, layer in enumerate(tsp_model.get_submodule(layers))
                 for attribute, hf in layer.hf_prefixes().items()}
    replicated = replicated_hf_names(tsp_model)
    held, units = [], dict(sharded_units(tsp_model))
    for name, param in tsp_model.named_parameters():
        prefix = name.rsplit(".", 1)[0]
        if prefix in units:
            unit = units[prefix]
            held.append((name, param, param.detach(), unit_slice(unit, {n: full[f"{prefix}.{n}"] for n in unit.names})))
            continue
        hf_prefix = next((hf + prefix[len(tsp):] for tsp, hf in hf_blocks.items()
                          if prefix == tsp or prefix.startswith(f"{tsp}.")), prefix)
        if getattr(param, "tensor_model_parallel", False):
            pieces = sharded_pieces(tsp_model.get_submodule(prefix),
                                    {n.removeprefix(f"{hf_prefix}."): t for n, t in full.items()})
            held += [(f"{hf_prefix}.{n}", param, value, piece) for n, (value, piece) in pieces.items()]
        else:
            hf_name = replicated.get(id(param), hf_prefix + name[len(prefix):])
            held.append((hf_name, param, param.detach(), full[hf_name]))
    return held


def sharded_pieces(module, full):
    """``{name: (value held here, the matching piece of the full tensor)}`` for
    every sharded tensor of a TSP block or vocabulary shard; ``full[name]`` gives
    the reference's full tensor under the module's own Hugging Face names (a
    fused tensor's, such as Phi-3's qkv_proj, for the rows of its parts)."""
    pieces = {}
    for name, value in module.shard_tensors().items():
        piece = module.shard_piece(name)
        if piece is not None:
            hf_name, piece = module.hf_rows.hf_piece(name, piece) if hasattr(module, "hf_rows") else (name, piece)
            pieces[name] = (value, full[hf_name].narrow(*piece))
    return pieces


def packed_position_ids(documents):
    """Position ids ``(B, S)`` that restart at 0 for every document, from each
    row's document lengths (``[[5, 1, 10], [16]]``), as packing collators write them."""
    return torch.stack([torch.cat([torch.arange(length) for length in row]) for row in documents])


def model_parity(arch, batch, seq_len, layout="zigzag", right_padding=0, wrong_shard=None, checkpointing=False,
                 num_items_in_batch=None, model_overrides=None, documents=None, cu_seq_lens=False,
                 ignore_documents=False, relative=False, left_padding=0, **tsp_options):
    """On every rank: |loss - HF loss|, the gradient diffs of ``shard_grad_diffs``,
    the bytes saved for backward and how many times an attention recomputed its
    input norm in backward (``ds_tsp.blocks.input_norm``), both of which ``check`` ignores.

    ``wrong_shard``: None, or the module path (``model.layers.0.mlp``,
    ``lm_head``, ...) whose shard the last rank scales by 1.5, to show the check
    fails. ``documents``: each row's packed document lengths, given to both
    models as restarting position ids (and, with ``cu_seq_lens``, to TSP also
    as flash-attention's ``cu_seq_lens_q/k``, as ``DataCollatorWithFlattening`` does). ``tsp_options`` go to
    ``TSPConfig`` (``vocab_parallel``, ...). ``ignore_documents``: TSP attends
    each row as one sequence (the guard for ``documents``). ``relative``:
    gradient differences relative to the reference gradient's largest entry
    where it is above 1 (``shard_grad_diffs``). ``left_padding``: the last row's
    first tokens are padding, as generation and TRL's trainers pad (its first
    real token takes no loss: Hugging Face predicts it from padding)."""
    tsp_size = dist.get_world_size()
    torch.manual_seed(7)
    ref = tiny_model(arch, **(model_overrides or {}))
    input_ids = torch.randint(0, ref.config.vocab_size, (batch, seq_len))
    attention_mask = None
    if right_padding:
        attention_mask = torch.ones_like(input_ids)
        attention_mask[0, -right_padding:] = 0
    labels = input_ids
    if left_padding:
        attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        attention_mask[-1, :left_padding] = 0
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[-1, left_padding] = -100
    position_ids = None if documents is None else packed_position_ids(documents)
    packing = {"position_ids": position_ids}
    if cu_seq_lens:
        cumulative = torch.tensor([0] + documents[0]).cumsum(0)
        packing = {**packing, "cu_seq_lens_q": cumulative, "cu_seq_lens_k": cumulative,
                   "max_length_q": max(documents[0]), "max_length_k": max(documents[0])}
    model = copy.deepcopy(ref)
    topo = TSPTopology(tsp_size)
    ds_tsp.inject(model, topo, TSPConfig(enabled=True, size=tsp_size, layout=layout, attention_backend="sdpa",
                                         **tsp_options))
    if wrong_shard and topo.tsp_rank == tsp_size - 1:
        with torch.no_grad():
            next(model.get_submodule(wrong_shard).parameters()).mul_(1.5)
    if checkpointing == "host":  # ds_tsp's cpu_checkpointing: layer inputs wait in host memory
        model.train()
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=host_checkpoint)
    elif checkpointing:
        model.train()
        model.activation_checkpointing_enable()
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    one_sequence_per_row = mock.patch("ds_tsp.injection.model.document_starts", return_value=None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            (one_sequence_per_row if ignore_documents else contextlib.nullcontext()):
        out = model(input_ids=input_ids, labels=labels, attention_mask=attention_mask,
                    num_items_in_batch=num_items_in_batch, **packing)
    recomputes, norm_backward = [], TiledInputNorm.backward
    with mock.patch.object(TiledInputNorm, "backward", autospec=True,
                           side_effect=lambda *args: (recomputes.append(1), norm_backward(*args))[1]):
        out.loss.backward()
    ref_loss = reference_loss(ref, input_ids, attention_mask, num_items_in_batch, position_ids, labels)
    ref_loss.backward()
    diffs = {"loss": abs(out.loss.item() - ref_loss.item()), "saved_bytes": sum(saved.values()),
             "input_norm_recomputes": len(recomputes)}
    diffs.update(shard_grad_diffs(model, ref, relative))
    return diffs


def check(per_rank, label, bound=TOLERANCE):
    """Every difference ``model_parity`` reports within ``bound`` (``TOLERANCE``; a float32 router's
    ``ROUNDING_FLOOR`` for differences relative to their scale)."""
    # Ranks that do not hold a replicated key/value head report no k/v entries.
    worst = {k: max(d[k] for d in per_rank if k in d) for k in set().union(*per_rank) if k not in NOT_DIFFS}
    name = max(worst, key=worst.get)
    print(f"{label}: max|diff| {worst[name]:.2e} ({name}), loss {worst['loss']:.2e}")
    for key, value in worst.items():
        assert value <= bound, (key, value)


def check_caught(per_rank, label):
    """The guard's verdict: a deliberately wrong piece moved the loss by far more than ``TOLERANCE``."""
    loss = max(d["loss"] for d in per_rank)
    worst = max(v for d in per_rank for k, v in d.items() if k not in NOT_DIFFS)
    print(f"{label}: |loss diff| {loss:.2e}, max|diff| {worst:.2e}")
    assert loss > 1e3 * TOLERANCE
