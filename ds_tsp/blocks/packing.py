"""One flat buffer per weight shard, so moving a shard is one collective.

A ``PackSpec`` is an ordered list of named shapes; ``pack`` lays tensors out in
that order and ``unpack`` returns views into a flat buffer (a received shard or
its gradient) under the same names.
"""

import math

import torch

from ds_tsp.blocks.fused import FusedRows


class PackSpec:
    def __init__(self, shapes):
        """``shapes``: ordered ``{name: shape}`` of one rank's shard."""
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self.offsets = {}
        offset = 0
        for name, shape in self.shapes.items():
            self.offsets[name] = offset
            offset += math.prod(shape)
        self.numel = offset

    def pack(self, tensors):
        """Flat copy of ``tensors`` (a dict with exactly this spec's names and shapes)."""
        if set(tensors) != set(self.shapes):
            raise ValueError(f"shard tensors {sorted(tensors)} do not match the spec {list(self.shapes)}")
        for name, shape in self.shapes.items():
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"shard tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}")
        return torch.cat([tensors[name].reshape(-1) for name in self.shapes])

    def unpack(self, flat):
        """Views of ``flat`` under this spec's names."""
        if flat.numel() != self.numel:
            raise ValueError(f"flat shard has {flat.numel()} elements, the spec needs {self.numel}")
        return {name: flat.narrow(0, self.offsets[name], math.prod(shape)).view(shape)
                for name, shape in self.shapes.items()}


class PackedShardMixin:
    """Checkpoint access of a TSP block holding one packed shard (``packed``,
    laid out by ``spec``) and parameters every rank holds whole
    (``replicated_params()``, by Hugging Face name; ``replicated_tensors()``
    adds the persistent buffers every rank holds whole), as the attention, MLP and
    MoE blocks do: ``shard_names``, ``load_shard`` and ``shard_tensors``, and
    ``lora``, its ``ds_tsp.injection.lora.LoRAShards`` or None; ``hf_rows``, where its
    tensors lie in Hugging Face's fused ones (``ds_tsp.blocks.fused``; ``from_hf``
    sets it where the policy fuses any)."""

    hf_rows = FusedRows()

    def shard_names(self):
        """Hugging Face names of the tensors this module holds a part of."""
        return list(self.spec.shapes) + list(self.replicated_tensors())

    def replicated_tensors(self):
        """The parameters and persistent buffers every rank holds whole, by Hugging Face name."""
        return self.replicated_params()

    @torch.no_grad()
    def load_shard(self, tensors):
        """Copy this rank's pieces in (``{name: tensor}`` over ``shard_names()``)."""
        if set(tensors) != set(self.shard_names()):
            raise ValueError(f"{type(self).__name__} shard needs exactly {self.shard_names()}, got {sorted(tensors)}")
        self.packed.copy_(self.spec.pack({name: tensors[name] for name in self.spec.shapes}))
        for name, tensor in self.replicated_tensors().items():
            tensor.copy_(tensors[name])

    def shard_weights(self):
        """The packed shard the schedules compute with: ``packed``, merged with
        this rank's LoRA adapters where the block has them (``ds_tsp.injection.lora``)."""
        return self.packed if self.lora is None else self.lora.merge(self.packed)

    def shard_tensors(self):
        """This rank's pieces under Hugging Face names (views of the parameters)."""
        tensors = self.spec.unpack(self.packed.detach())
        tensors.update({name: tensor.detach() for name, tensor in self.replicated_tensors().items()})
        return tensors


def module_reader(module):
    """``read(name, piece)`` over a module's own parameters and persistent buffers: the tensor ``name``
    narrowed to ``piece = (dim, start, length)``, or whole when ``piece`` is None.
    Checkpoint readers offer the same signature over files."""
    params = module.state_dict(keep_vars=True)

    def read(name, piece):
        tensor = params[name].detach()
        return tensor if piece is None else tensor.narrow(*piece)

    return read
