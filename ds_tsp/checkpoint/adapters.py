"""A TSP model's LoRA adapters as PEFT's adapter directory: ``adapter_config.json``
and ``adapter_model.safetensors`` under the names ``PeftModel.save_pretrained``
writes, which ``PeftModel.from_pretrained`` loads on one process; and such a
directory read onto a TSP model (``AdapterFiles``), each rank reading only
its slices.

Every adapter factor is small (``r`` rows or columns), so each block's
adapters are gathered whole over its TSP group (under ZeRO-3 over its
data-parallel group first) and global rank 0 writes them all in one file.
"""

import contextlib
import copy
import os

import deepspeed
import torch
from safetensors.torch import save_file

from ds_tsp.checkpoint.formats import ADAPTER_CONFIG, ADAPTER_WEIGHTS, CheckpointError, open_safetensors
from ds_tsp.checkpoint.staging import SharedSave, staged_together
from ds_tsp.injection.lora import ROW_SPLIT, one_lora_config
from ds_tsp.parallel import comm


def gather_pieces(tensor, group):
    """Every rank's ``tensor`` in rank order; the ranks' shapes may differ (a
    rank holding no key/value heads has no rows of their ``lora_B``)."""
    shapes = comm.all_gather_objects(tuple(tensor.shape), group)
    pieces = []
    for owner, shape in enumerate(shapes):
        piece = tensor.detach().contiguous() if owner == comm.group_rank(group) else tensor.new_empty(shape)
        if piece.numel():
            comm.broadcast(piece, src=owner, group=group)
        pieces.append(piece)
    return pieces


def full_adapter(block, projection, adapter):
    """The whole ``(lora_A, lora_B)`` of one projection: the split factor's
    pieces joined in rank order, the whole one this rank's."""
    if projection in ROW_SPLIT:
        return adapter.lora_A.detach(), torch.cat(gather_pieces(adapter.lora_B, block.tsp_group), dim=0)
    return torch.cat(gather_pieces(adapter.lora_A, block.tsp_group), dim=1), adapter.lora_B.detach()


def adapter_blocks(model):
    """``[(module path, TSP block)]`` of the blocks holding adapters, in the model's order."""
    policy = model.tsp_policy
    blocks = []
    for index, layer in enumerate(model.get_submodule(policy.layers)):
        for name, block in ((layer.mixer_name, layer.token_mixer), (layer.mlp_name, layer.mlp)):
            if block is not None and block.lora is not None:
                blocks.append((f"{policy.layers}.{index}.{name}", block))
    return blocks


def adapter_state_dict(model):
    """``{PEFT name: whole tensor}`` of every adapter, on every rank that gathers
    (collective over each block's TSP group, and its data-parallel group where
    ZeRO-3 partitions the adapters)."""
    state = {}
    for prefix, block in adapter_blocks(model):
        params = [p for p in block.lora.parameters() if hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(params) if params else contextlib.nullcontext():
            # Under the projection the Hugging Face module holds: a fused one's
            # parts (in row order) share its A and stack their rows of B.
            for projection, adapter in block.lora.adapters.items():
                lora_A, lora_B = full_adapter(block, projection, adapter)
                hf_projection = block.hf_rows.hf_name(f"{projection}.weight").removesuffix(".weight")
                name = f"base_model.model.{prefix}.{hf_projection}.lora_"
                state[f"{name}A.weight"] = lora_A.cpu().clone()
                B = lora_B.cpu().clone()
                state[f"{name}B.weight"] = torch.cat([state[f"{name}B.weight"], B]) if f"{name}B.weight" in state else B
    return state


def _out_dir_refusal(out_dir, overwrite):
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        return f"save_pretrained: {out_dir} exists and is not a directory: choose another out_dir"
    if os.path.exists(os.path.join(out_dir, ADAPTER_WEIGHTS)) and not overwrite:
        return (f"save_pretrained: {out_dir} already holds adapters ({ADAPTER_WEIGHTS}): pass overwrite=True to "
                "replace them, or choose another out_dir")
    return None


def save_adapters(model, out_dir, overwrite=False):
    """Write PEFT's adapter directory of the TSP ``model`` (see the module
    docstring): its files are replaced with ``overwrite``, the directory's
    other files kept. Collective: every rank calls it; global rank 0 writes
    beside ``out_dir`` and swaps the files in once every rank agrees
    (``staging.staged_together``: a failed write raises on every rank)."""
    topology = model.tsp_topology
    refusal = comm.all_gather_objects(_out_dir_refusal(out_dir, overwrite) if topology.rank == 0 else None, None)[0]
    if refusal is not None:
        raise CheckpointError(refusal)
    partitioned = any(hasattr(p, "ds_id") for _, block in adapter_blocks(model) for p in block.lora.parameters())
    state = adapter_state_dict(model) if topology.dp_rank == 0 or partitioned else {}
    save = SharedSave(f"ds_tsp.save_pretrained (adapters) to {os.path.abspath(out_dir)}")
    with staged_together(out_dir, save, topology.rank == 0,
                         replaced=lambda name: name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)) as staging:
        if staging is not None:
            weights = os.path.join(staging, ADAPTER_WEIGHTS)
            save.write(weights, save_file, state, weights, metadata={"format": "pt"})
            config = copy.deepcopy(model.tsp_peft_config)
            config.inference_mode = True  # as PeftModel.save_pretrained writes it
            if config.base_model_name_or_path is None:
                config.base_model_name_or_path = getattr(model.config, "_name_or_path", None) or None
            save.write(os.path.join(staging, ADAPTER_CONFIG), config.save_pretrained, staging)


class AdapterFiles:
    """PEFT's adapter directory ``path`` as ``ds_tsp.inject`` takes it
    (``adapter_files``): its ``LoraConfig`` (checked as a ``PeftModel``'s is)
    and, by ``adapters()``, a reader per adapter that reads only the piece a
    TSP rank holds."""

    PREFIX = "base_model.model."

    def __init__(self, path):
        from peft import PeftConfig

        weights = os.path.join(path, ADAPTER_WEIGHTS)
        if not os.path.isfile(weights):
            raise CheckpointError(f"{path} holds no {ADAPTER_WEIGHTS}: pass the directory PeftModel.save_pretrained "
                                  "or ds_tsp.save_pretrained wrote")
        self.config = one_lora_config({"default": PeftConfig.from_pretrained(path)})
        if self.config.rank_pattern or self.config.alpha_pattern:
            raise CheckpointError(f"{path}: LoraConfig(rank_pattern=..., alpha_pattern=...) is not read onto a TSP "
                                  "model: load it with PeftModel.from_pretrained and hand ds_tsp that model")
        self.file = open_safetensors(weights)

    def adapters(self):
        """``{module path: (read, scaling)}`` (``ds_tsp.injection.lora.shard_adapters``)."""
        config = self.config
        scaling = config.lora_alpha / (config.r ** 0.5 if config.use_rslora else config.r)
        paths = sorted({key[len(self.PREFIX):].removesuffix(".lora_A.weight") for key in self.file.keys()
                        if key.startswith(self.PREFIX) and key.endswith(".lora_A.weight")})
        return {path: (self._reader(path), scaling) for path in paths}

    def _reader(self, path):
        def read(factor, piece):
            tensor = self.file.get_slice(f"{self.PREFIX}{path}.{factor}.weight")
            if piece is None:
                return tensor[:]
            dim, start, length = piece
            return tensor[start:start + length] if dim == 0 else tensor[:, start:start + length]
        return read
