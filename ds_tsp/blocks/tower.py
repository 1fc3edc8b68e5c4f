"""A vision tower's weights held 1/D per rank of the TSP group (FSDP-style), DESIGN.md 6m.

The tower's work is per image and split over the group (``ds_tsp.blocks.visual``),
so for the tower the TSP group is data parallelism: its weights need not be
whole on every rank between uses. Each unit of the tower (a block, the patch
embedding, the merger: ``tower_units``) becomes a ``ShardedUnit``: its
parameters flattened in registration order into one vector, padded to a
multiple of D, of which this rank keeps one slice. The unit's forward
all-gathers the vector (backward: the gradient reduce-scattered, summed over
the group, each rank's covering its own images), runs the Hugging Face module
on the gathered tensors and lets them go:
per rank the tower's parameters, gradients and optimizer states are 1/D of
its total plus at most D - 1 padding elements a unit, and its full weights
live one unit at a time.
"""

import math

import torch
import torch.utils.checkpoint
from torch import nn

from ds_tsp.parallel import comm
from ds_tsp.parallel.mappings import gather_rows


class ShardedUnit(nn.Module):
    """One tower unit's parameters, this rank's ``1/D`` slice of their flat
    vector (the parameter ``shard``), around the Hugging Face module ``unit``,
    which keeps its buffers and holds no parameter of its own. ``names`` and
    ``shapes`` say where each Hugging Face tensor sits in the vector."""

    def __init__(self, unit, group):
        super().__init__()
        params = dict(unit.named_parameters())
        if len({p.requires_grad for p in params.values()}) > 1:
            frozen = sorted(name for name, p in params.items() if not p.requires_grad)
            raise ValueError(f"{type(unit).__name__}: {frozen} are frozen but its other parameters are not; ds_tsp "
                             "holds a tower unit's parameters in one shard, which trains all or none: freeze the "
                             "whole unit or none of it")
        self.names, self.shapes = list(params), [tuple(p.shape) for p in params.values()]
        self.numel, self.tsp_group = sum(p.numel() for p in params.values()), group
        tsp_size, tsp_rank = comm.group_size(group), comm.group_rank(group)
        length = math.ceil(self.numel / tsp_size)
        flat = torch.cat([p.detach().reshape(-1) for p in params.values()])
        flat = torch.cat([flat, flat.new_zeros(length * tsp_size - self.numel)])
        self.shard = nn.Parameter(flat[tsp_rank * length:(tsp_rank + 1) * length].clone(),
                                  requires_grad=any(p.requires_grad for p in params.values()))
        self.shard.tensor_model_parallel = True  # counted on every TSP rank in gradient norms
        # Each tensor becomes a plain attribute of its module, None at rest and the gathered tensor while the
        # unit runs: no hook on a submodule (ZeRO-3's fetches) meets a parameter it did not make, and the module
        # stays registered for those that look for it by class (Hugging Face's hidden-state capture).
        # Every name a tensor goes by (a tied one by each), with the index of its tensor.
        self.aliases = [(name, self.names.index(next(n for n, p in params.items() if p is param)))
                        for name, param in unit.named_parameters(remove_duplicate=False)]
        for name, _ in self.aliases:
            owner, _, leaf = name.rpartition(".")
            module = unit.get_submodule(owner)
            del module._parameters[leaf]
            module.__dict__[leaf] = None
        self.unit = unit

    def extra_repr(self):
        return f"{self.numel} parameters, {self.shard.numel()} held here"

    def __getattr__(self, name):
        """What the Hugging Face module holds, read through the unit in its
        place: a parameter of the module itself (Pixtral reads its patch
        convolution's ``weight.dtype``) as a stand-in of its shape, dtype and
        device (its values live in the shards), anything else as it is."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "unit" not in self._modules:  # still being built
                raise
            unit = self._modules["unit"]
        if name in self.names:
            return self._parameters["shard"].detach()[:1].expand(self.shapes[self.names.index(name)])
        return getattr(unit, name)

    def held_pieces(self):
        """``[(Hugging Face name, numel)]`` of the tensors this rank's slice
        holds elements of, in order; the padding counts as the last tensor's."""
        length = self.shard.numel()
        start, held, offset = comm.group_rank(self.tsp_group) * length, [], 0
        for name, shape in zip(self.names, self.shapes):
            size = math.prod(shape)
            overlap = min(start + length, offset + size) - max(start, offset)
            if overlap > 0:
                held.append([name, overlap])
            offset += size
        padding = start + length - max(start, self.numel)
        if padding > 0:
            if not held or held[-1][0] != self.names[-1]:
                held.append([self.names[-1], 0])
            held[-1][1] += padding
        return [tuple(piece) for piece in held]

    def full_tensors(self, flat=None):
        """``{Hugging Face name: tensor}`` of the unit, cut from its whole flat
        vector ``flat`` (by default gathered: collective over the group)."""
        flat = gather_rows(self.shard, self.tsp_group)[:self.numel] if flat is None else flat
        return unit_tensors(self.names, self.shapes, flat)

    def forward(self, *args, **kwargs):
        """The unit on its gathered tensors. Where the unit recomputes itself in
        backward (Hugging Face's gradient checkpointing of a tower block), the
        gather is recomputed with it: the unit checkpointed alone would run
        again without its tensors."""
        if getattr(self.unit, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._run, *args, use_reentrant=False, **kwargs)
        return self._run(*args, **kwargs)

    def _run(self, *args, **kwargs):
        owners = [(self.unit.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], index)
                  for name, index in self.aliases]
        recomputes = getattr(self.unit, "gradient_checkpointing", None)
        try:
            tensors = list(self.full_tensors().values())
            for owner, leaf, index in owners:
                owner.__dict__[leaf] = tensors[index]
            if recomputes:
                self.unit.gradient_checkpointing = False
            return self.unit(*args, **kwargs)
        finally:  # the full tensors live on in autograd's graph only, as long as backward needs them
            for owner, leaf, _ in owners:
                owner.__dict__[leaf] = None
            if recomputes:
                self.unit.gradient_checkpointing = recomputes


def unit_tensors(names, shapes, flat):
    """``{name: tensor}`` cut from a unit's whole flat vector ``flat`` (its tensors ``names`` of ``shapes``,
    in order; padding past them ignored)."""
    sizes = [math.prod(shape) for shape in shapes]
    return {name: piece.view(shape) for name, shape, piece in zip(names, shapes, flat[:sum(sizes)].split(sizes))}


def tower_units(tower, prefix=""):
    """``{name in the tower: module}`` of the units to shard: each child that
    holds parameters, a ``ModuleList``'s children (the blocks) one by one, and
    within a child that holds a ``ModuleList`` (CLIP's encoder) its own units.
    Parameters of a module it descends into stay whole (and replicated)."""
    units = {}
    for name, child in tower.named_children():
        if isinstance(child, nn.ModuleList):
            units.update({f"{prefix}{name}.{index}": block for index, block in child.named_children()
                          if any(True for _ in block.parameters())})
        elif any(isinstance(module, nn.ModuleList) for module in child.modules()):
            units.update(tower_units(child, f"{prefix}{name}."))
        elif any(True for _ in child.parameters()):
            units[f"{prefix}{name}"] = child
    return units


def unit_paths(model, path):
    """``{path in model: module}`` of the units of the tower at ``path`` of ``model``
    (``tower_units``); a tower without blocks that holds parameters of its own
    (Gemma 3's projector: a norm, a pooling and a bare projection matrix) is one unit."""
    tower = model.get_submodule(path)
    if any(True for _ in tower.parameters(recurse=False)) and \
            not any(isinstance(module, nn.ModuleList) for module in tower.modules()):
        return {path: tower}
    return {f"{path}.{name}": unit for name, unit in tower_units(tower).items()}


def shard_tower(model, path, group):
    """Replace every unit of the tower at ``path`` of ``model`` (``unit_paths``)
    by its ``ShardedUnit`` over the TSP ``group``. At a group of one nothing changes."""
    if comm.group_size(group) == 1:
        return
    for name, unit in unit_paths(model, path).items():
        model.set_submodule(name, ShardedUnit(unit, group))


def join_units(model, paths, states):
    """``{Hugging Face name: tensor}`` of the tower units at ``paths`` of the unsharded ``model`` (a meta
    model will do), from every TSP rank's saved state (``{name: tensor}``, in rank order), which holds each
    unit's slice as ``<unit>.shard`` and its buffers under ``<unit>.unit.``: the slices joined in rank
    order and cut into the unit's tensors, as ``ShardedUnit`` made them."""
    full = {}
    for path in paths:
        for name, unit in unit_paths(model, path).items():
            params = dict(unit.named_parameters())
            flat = torch.cat([state[f"{name}.shard"].reshape(-1) for state in states])
            tensors = unit_tensors(list(params), [p.shape for p in params.values()], flat)
            full.update({f"{name}.{tensor}": value for tensor, value in tensors.items()})
            buffers = f"{name}.unit."  # ShardedUnit keeps the Hugging Face module as ``unit``
            full.update({f"{name}.{key.removeprefix(buffers)}": value for key, value in states[0].items()
                         if key.startswith(buffers)})
    return full
