"""Bodies the recurrent layers' tests share (Gated DeltaNet, KDA, Mamba-2, Mamba-1, short convolutions): the
guards that break one piece of the chunk-map schedule on purpose, one layer's bytes by op, and the refusal of
left padding where a biased in_proj would leak it."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from ds_tsp.blocks.linear import recurrence
from ds_tsp.parallel import comm, layout
from ds_tsp.parallel.topology import TSPTopology
from models import tiny_model
from parity import model_parity


def wrong_map_parity(**kwargs):
    """``model_parity`` with every chunk's state map off by 1% (its ``U``), as exchanged."""
    gather_maps = recurrence.gather_maps

    def wrong(*args):
        return [(T, U * 1.01) for T, U in gather_maps(*args)]

    with mock.patch.object(recurrence, "gather_maps", wrong), mock.patch("ds_tsp.injection.inject.probe_layers"):
        return model_parity(**kwargs)


def no_halo_parity(**kwargs):
    """``model_parity`` with the convolution's halos dropped (zeros before every chunk)."""
    def no_halos(x, group, layout_name, width):
        return [x.new_zeros(x.shape[0], width, x.shape[2])] * 2

    with mock.patch("ds_tsp.blocks.linear.conv.halos", no_halos), mock.patch("ds_tsp.injection.inject.probe_layers"):
        return model_parity(**kwargs)


def layer_bytes(arch, path, block_class, seq_len):
    """One recurrent layer's forward and backward on this rank's tokens: the bytes it received, by op, forward
    and forward + backward. ``path``: the Hugging Face mixer's path in ``arch``'s tiny model; ``block_class``: the
    TSP block built from it."""
    topo = TSPTopology(dist.get_world_size())
    D, r = topo.tsp_size, topo.tsp_rank
    model = tiny_model(arch)
    tsp = block_class.from_hf(model.get_submodule(path), model.config, topo.tsp_group)
    torch.manual_seed(1)
    x = layout.shard(torch.randn(1, seq_len, model.config.hidden_size, dtype=torch.float64), r, D, "zigzag")
    x.requires_grad_()
    comm.counter.reset()
    y = tsp(x)
    forward = {op: counts["received"] for op, counts in comm.counter.snapshot().items()}
    y.backward(torch.ones_like(y))
    return forward, {op: counts["received"] for op, counts in comm.counter.snapshot().items()}


def check_left_padding_refused(arch, mixer_path, **overrides):
    """``arch`` with a biased ``in_proj`` (``overrides``) refuses left-padded rows by name, naming the first such
    mixer (``mixer_path``), in training and in generation, and runs rows without padding."""
    import ds_tsp
    from ds_tsp.config import TSPConfig

    model = tiny_model(arch, **overrides)
    ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True, size=1, attention_backend="sdpa"))
    input_ids = torch.randint(3, 61, (2, 8))
    mask = torch.ones_like(input_ids)
    mask[1, :3] = 0
    labels = input_ids.masked_fill(mask == 0, -100)
    labels[1, 3] = -100  # the first real token, which Hugging Face predicts from padding
    refusal = rf"left-padded rows with Mamba or short-convolution mixers whose in_proj has a bias \({mixer_path}"
    with pytest.raises(ValueError, match=refusal):
        model(input_ids=input_ids, attention_mask=mask, labels=labels)
    with pytest.raises(ValueError, match=refusal):
        model.generate(input_ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    model(input_ids=input_ids, labels=input_ids)  # no padding: runs
