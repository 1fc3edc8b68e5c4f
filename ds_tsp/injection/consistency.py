"""Every rank of a TSP group holds one model and sees one micro-batch.

A TSP group splits the work of one model on one micro-batch: rank ``j``'s
tokens and shards add up to the unsharded model only if every rank started
from the same model and was fed the same micro-batch. Nothing in the
arithmetic notices when they were not, so this is checked where it can go
wrong:

* ranks that built the model differently (another vocabulary after
  ``resize_token_embeddings``, another config) are refused at injection,
  before any weight moves, naming the first tensor that differs;
* replicated weights and buffers are broadcast from TSP rank 0, so ranks whose
  weights differ only in value (unseeded initialisation) start identical;
* every micro-batch (``tsp.check_batch: "always"``, the default; ``"first"``
  checks only the first, ``"never"`` none) is compared across the group by a
  fingerprint taken on the device, in one all-gather of a few int64 per
  micro-batch read on the host with the batch's own host copy, and a
  difference is refused, naming the ranks and the inputs, with its likely
  cause.
"""

import hashlib

import torch

from ds_tsp.parallel import comm
from ds_tsp.parallel.host_reads import host_read


class RankMismatchError(RuntimeError):
    pass


def _structure(model):
    """``[(name, shape, dtype)]`` of every parameter and buffer, in order."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors]


def check_same_model(model, group):
    """Refuse, before any weight moves, ranks of ``group`` whose models differ in
    any tensor's name, shape or dtype. One 8-byte all-gather; the full lists
    travel only to explain a mismatch."""
    if comm.group_size(group) == 1:
        return
    structure = _structure(model)
    digest = hashlib.sha256(repr(structure).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64,
                        device=comm.group_device(group))
    gathered, _ = comm.all_gather(mine, group, counted_as="model_check")
    if bool(host_read((gathered == mine).all(), "model check")):
        return
    every = comm.all_gather_objects(structure, group)
    rank = comm.group_rank(group)
    theirs = next(r for r, s in enumerate(every) if s != structure)
    here = {name: f"{shape} {dtype}" for name, shape, dtype in structure}
    there = {name: f"{shape} {dtype}" for name, shape, dtype in every[theirs]}
    name = next((n for n in dict.fromkeys([*here, *there]) if here.get(n) != there.get(n)), None)
    what = ("the same tensors in another order" if name is None else
            f"{name} is {here.get(name, 'absent')} here and {there.get(name, 'absent')} there")
    raise RankMismatchError(f"TSP rank {rank} and TSP rank {theirs} hold different models: {what}. Every rank of a "
                            "TSP group must build the same model (same config, same resize_token_embeddings) "
                            "before ds_tsp injects it")


def broadcast_replicated(model, group):
    """Copy every replicated parameter and buffer (the ones not tagged
    ``tensor_model_parallel``) from TSP rank 0 to the rest of ``group``."""
    if comm.group_size(group) == 1:
        return
    tensors = [p for p in model.parameters() if not getattr(p, "tensor_model_parallel", False)]
    tensors += list(model.buffers())
    with torch.no_grad():
        for tensor in tensors:
            comm.broadcast(tensor.data, src=0, group=group)


def batch_fingerprint(tensors, device):
    """``(4 * len(tensors),)`` int64 on ``device``: per tensor (or None) its
    number of dims, its number of elements, the sum of its values and a
    position-weighted sum, so that a shifted or reordered batch differs too.
    Computed where the tensors are, with no host read."""
    parts = []
    for tensor in tensors:
        if tensor is None:
            parts.append(torch.full((4,), -1, dtype=torch.int64, device=device))
            continue
        flat = tensor.detach().reshape(-1).to(torch.int64)
        weights = torch.arange(1, flat.numel() + 1, device=flat.device) % 1_000_003
        parts.append(torch.stack([flat.new_full((), tensor.dim()), flat.new_full((), flat.numel()),
                                  flat.sum(), (flat * weights).sum()]).to(device))
    return torch.cat(parts)


def gather_batch_fingerprints(named_tensors, group):
    """``(D, 4 * len(named_tensors))``: every rank's fingerprint of its
    micro-batch (``{name: tensor or None}``), all-gathered on the group's device;
    no host read, so the caller reads it with the batch (``verify_batch``)."""
    mine = batch_fingerprint(list(named_tensors.values()), comm.group_device(group))
    gathered, _ = comm.all_gather(mine, group, counted_as="batch_check")
    return gathered


def verify_batch(gathered, names, group):
    """Refuse a micro-batch that differs between the ranks of ``group``, from
    the host copy of ``gather_batch_fingerprints``'s result."""
    different = [r for r in range(len(gathered)) if not torch.equal(gathered[r], gathered[0])]
    if not different:
        return
    names = [name for i, name in enumerate(names)
             if not torch.equal(gathered[different[0]][4 * i:4 * i + 4], gathered[0][4 * i:4 * i + 4])]
    raise RankMismatchError(
        f"TSP ranks {different} (global ranks {[comm.global_rank(group, r) for r in different]}) received a "
        f"different micro-batch than TSP rank 0 (global rank {comm.global_rank(group, 0)}) in {names}: every rank of a "
        "TSP group must get the same full micro-batch. The likely cause is a sampler or data loader that shards "
        "over the world (DistributedSampler(num_replicas=world_size)) instead of over the data-parallel ranks: use "
        "num_replicas=engine.tsp_topology.dp_size, rank=engine.tsp_topology.dp_rank, or pass training_data= to "
        "ds_tsp.initialize, whose loader shards over data-parallel ranks only")


def check_same_batch(named_tensors, group):
    """Refuse a micro-batch that differs between the ranks of ``group``;
    ``named_tensors``: ``{name: tensor or None}`` as the forward received them
    (host copies, or on the device). One all-gather and one host read."""
    if comm.group_size(group) == 1:
        return
    gathered = host_read(gather_batch_fingerprints(named_tensors, group), "batch check")
    verify_batch(gathered, list(named_tensors), group)


class BatchCheck:
    """``tsp.check_batch``: compare the micro-batch across ``group`` on every
    call (``"always"``), on the ``"first"`` call, or ``"never"``. Calling it
    checks at once; ``gather`` and ``verify`` split the check around the
    host copy the forward makes of its batch, which then carries the
    fingerprints too (one host read per micro-batch for both)."""

    def __init__(self, when, group):
        self.when, self.group, self.checked = when, group, False

    def _due(self):
        return comm.group_size(self.group) > 1 and (
            self.when == "always" or (self.when == "first" and not self.checked))

    def __call__(self, **named_tensors):
        if self._due():
            check_same_batch(named_tensors, self.group)
            self.checked = True

    def gather(self, **named_tensors):
        """Every rank's fingerprint on the device (None when no check is due):
        pass its host copy to ``verify``."""
        return gather_batch_fingerprints(named_tensors, self.group) if self._due() else None

    def verify(self, gathered, names):
        if gathered is not None:
            verify_batch(gathered, list(names), self.group)
            self.checked = True
