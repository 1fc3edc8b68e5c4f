"""The short convolution over TSP ranks (ds_tsp.blocks.linear.conv) against Hugging Face's, float64."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_tsp.blocks.linear.conv import causal_conv
from ds_tsp.parallel import layout
from ds_tsp.parallel.topology import TSPTopology


def _sharded_conv(seq_len, layout_name, drop_halo=False):
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

    topo = TSPTopology(dist.get_world_size() if dist.is_initialized() else 1)
    D, r = topo.tsp_size, topo.tsp_rank
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, seq_len, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, seq_len, 6, generator=gen, dtype=torch.float64)
    out = causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation="silu").transpose(1, 2)
    expected = torch.autograd.grad((out * grad).sum(), (x, weight, bias))
    local = layout.shard(x.detach(), r, D, layout_name).requires_grad_()
    leaves = (local, weight.detach().requires_grad_(), bias.detach().requires_grad_())
    if drop_halo:  # the guard: no tokens from the preceding chunks
        from unittest import mock
        def no_halos(x, group, layout_name, width):
            return [x.new_zeros(x.shape[0], width, x.shape[2])] * 2

        with mock.patch("ds_tsp.blocks.linear.conv.halos", no_halos):
            mine = causal_conv(*leaves, topo.tsp_group, layout_name, activation=F.silu)
    else:
        mine = causal_conv(*leaves, topo.tsp_group, layout_name, activation=F.silu)
    grads = torch.autograd.grad((mine * layout.shard(grad, r, D, layout_name)).sum(), leaves)
    # The weights' gradients are this rank's tokens' part: summed over the group they are the whole.
    weight_grads = [g.clone() for g in grads[1:]]
    if D > 1:
        for g in weight_grads:
            dist.all_reduce(g, group=topo.tsp_group)
    return {"out": (mine - layout.shard(out.detach(), r, D, layout_name)).abs().max().item(),
            "x": (grads[0] - layout.shard(expected[0], r, D, layout_name)).abs().max().item(),
            "weight": (weight_grads[0] - expected[1]).abs().max().item(),
            "bias": (weight_grads[1] - expected[2]).abs().max().item()}


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_the_sharded_convolution_equals_hugging_faces(run_ranks, tsp_size):
    for seq_len in (8, 40):  # chunks of 1 and 5 tokens at D=4: the 3-token halo spans several chunks, or one
        for layout_name in ("zigzag", "contiguous"):
            worst = max(max(d.values()) for d in run_ranks(tsp_size, _sharded_conv, seq_len=seq_len,
                                                           layout_name=layout_name))
            print(f"D={tsp_size} S={seq_len} {layout_name}: max|diff| {worst:.2e}")
            assert worst < 1e-12


def test_a_dropped_halo_is_caught(run_ranks):
    worst = max(d["out"] for d in run_ranks(2, _sharded_conv, seq_len=40, layout_name="zigzag", drop_halo=True))
    print(f"halo dropped: max|out diff| {worst:.2e}")
    assert worst > 1e-3
