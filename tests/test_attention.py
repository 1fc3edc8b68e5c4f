"""TSP attention against the unsharded Hugging Face attention module, float64."""

import math

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, Olmo2Config, Qwen2Config, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from ds_tsp.parallel import comm, layout
from ds_tsp.blocks.attention.module import TSPAttention
from ds_tsp.blocks.attention.head_groups import slice_full_tensor
from ds_tsp.blocks.attention.kernels import bottom_right_causal_mask
from ds_tsp.blocks.attention.selection import select_kernel
from ds_tsp.parallel.topology import TSPTopology

# float64 end to end: the sharded schedule only reorders sums, so differences
# are rounding noise around 1e-15; 1e-10 leaves room without hiding a bug
# (a wrong shard or position is off by ~1e-1, see the guard test).
TOLERANCE = 1e-10
SEQ_LEN = 16
HIDDEN = 16
HEAD_DIM = 4


def _config(arch, num_heads, num_kv_heads, sliding_window=None):
    # sdpa, not eager: eager softmaxes in float32.
    common = dict(hidden_size=HIDDEN, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  head_dim=HEAD_DIM, max_position_embeddings=64, attn_implementation="sdpa")
    if arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=sliding_window is not None,
                             sliding_window=sliding_window, max_window_layers=0)
    elif arch == "qwen3":
        config = Qwen3Config(**common)
    elif arch == "olmo2":  # q/k norms over the whole projection
        config = Olmo2Config(**common)
    else:
        config = LlamaConfig(**common, attention_bias=arch == "llama_bias")
    return config


def _reference(arch, config, batch, layout_name):
    """The full HF module, a full input and upstream gradient, seeded identically on every rank."""
    torch.manual_seed(1234)
    attn = {"qwen2": Qwen2Attention, "qwen3": Qwen3Attention, "olmo2": Olmo2Attention}.get(arch, LlamaAttention)(
        config, layer_idx=0).double()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0, 0.3)
    x = torch.randn(batch, SEQ_LEN, HIDDEN, dtype=torch.float64)
    grad_y = torch.randn(batch, SEQ_LEN, HIDDEN, dtype=torch.float64)
    return attn, x, grad_y


def _hf_forward_backward(attn, config, x, grad_y):
    x = x.clone().requires_grad_()
    pos = torch.arange(SEQ_LEN).unsqueeze(0).expand(x.shape[0], -1)
    cos_sin = LlamaRotaryEmbedding(config)(x, pos)
    window = attn.sliding_window if hasattr(attn, "sliding_window") else None
    allowed = bottom_right_causal_mask(SEQ_LEN, SEQ_LEN, window)
    mask = torch.zeros(SEQ_LEN, SEQ_LEN, dtype=x.dtype).masked_fill(~allowed, float("-inf"))
    y, _ = attn(x, position_embeddings=cos_sin, attention_mask=mask.expand(x.shape[0], 1, -1, -1))
    y.backward(grad_y)
    return y.detach(), x.grad, {n: p.grad for n, p in attn.named_parameters()}


def _tsp_forward_backward(attn, config, x, grad_y, topo, layout_name, overlap, wrong_shard=False):
    D, r = topo.tsp_size, topo.tsp_rank
    tsp = TSPAttention.from_hf(attn, config, topo.tsp_group, layout_name=layout_name, backend="sdpa",
                               overlap=overlap)
    if wrong_shard and r == D - 1:
        params = dict(attn.named_parameters())
        tsp.load_shard({n: slice_full_tensor(n, params[n].detach(), tsp.heads, 0) if n in tsp.spec.shapes
                        else params[n].detach() for n in tsp.shard_names()})
    x_local = layout.shard(x, r, D, layout_name).clone().requires_grad_()
    pos = layout.positions(r, D, layout_name, SEQ_LEN).unsqueeze(0).expand(x.shape[0], -1)
    cos_sin = LlamaRotaryEmbedding(config)(x_local, pos)
    y_local = tsp(x_local, cos_sin)
    y_local.backward(layout.shard(grad_y, r, D, layout_name))
    return tsp, y_local.detach(), x_local.grad


def _max_diffs(arch, num_heads, num_kv_heads, batch, layout_name, overlap, sliding_window=None, wrong_shard=False):
    """On every rank: max |diff| of output, input grad and this rank's weight-grad shards."""
    topo = TSPTopology(dist.get_world_size())
    D, r = topo.tsp_size, topo.tsp_rank
    config = _config(arch, num_heads, num_kv_heads, sliding_window)
    attn, x, grad_y = _reference(arch, config, batch, layout_name)
    tsp, y_local, dx_local = _tsp_forward_backward(attn, config, x, grad_y, topo, layout_name, overlap, wrong_shard)
    y_ref, dx_ref, grads_ref = _hf_forward_backward(attn, config, x, grad_y)
    diffs = {"out": (y_local - layout.shard(y_ref, r, D, layout_name)).abs().max().item(),
             "grad_x": (dx_local - layout.shard(dx_ref, r, D, layout_name)).abs().max().item()}
    for name, grad in tsp.spec.unpack(tsp.packed.grad).items():
        diffs[name] = (grad - slice_full_tensor(name, grads_ref[name], tsp.heads, r)).abs().max().item()
    for name, param in tsp.replicated_params().items():
        # Replicated: each rank holds its tokens' part; the model sums it over the group.
        grad = param.grad.clone()
        dist.all_reduce(grad)
        diffs[name] = (grad - grads_ref[name]).abs().max().item()
    return diffs


CASES = [  # (arch, nq, nkv, sliding_window): MHA, GQA 2:1, 4:1 (nkv < D at D=4), nkv=1, biases, q/k norms
    ("llama", 4, 4, None), ("llama", 8, 4, None), ("llama", 8, 2, None), ("llama", 4, 1, None),
    ("llama_bias", 8, 4, None), ("qwen2", 8, 2, None), ("qwen2", 4, 4, 5), ("qwen3", 8, 2, None),
]


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
@pytest.mark.parametrize("layout_name, overlap", [("zigzag", True), ("contiguous", False)])
def test_matches_hugging_face_attention(run_ranks, tsp_size, layout_name, overlap):
    for arch, nq, nkv, window in CASES:
        for batch in (1, 2):
            per_rank = run_ranks(tsp_size, _max_diffs, arch=arch, num_heads=nq, num_kv_heads=nkv, batch=batch,
                                 layout_name=layout_name, overlap=overlap, sliding_window=window)
            # Ranks that do not hold a replicated key/value head report no k/v entries.
            worst = {k: max(d[k] for d in per_rank if k in d) for k in set().union(*per_rank)}
            print(f"D={tsp_size} {layout_name} overlap={overlap} {arch} nq={nq} nkv={nkv} window={window} "
                  f"B={batch}: max|diff| {max(worst.values()):.2e}")
            assert max(worst.values()) <= TOLERANCE, worst


def test_a_wrong_shard_is_caught(run_ranks):
    per_rank = run_ranks(2, _max_diffs, arch="llama", num_heads=8, num_kv_heads=4, batch=1, layout_name="zigzag",
                         overlap=True, wrong_shard=True)
    worst = max(max(d.values()) for d in per_rank)
    print(f"wrong shard: max|diff| {worst:.2e}")
    assert worst > 1e3 * TOLERANCE


def _bytes_and_saved(num_heads, num_kv_heads, batch, arch="llama"):
    topo = TSPTopology(dist.get_world_size())
    D, r = topo.tsp_size, topo.tsp_rank
    config = _config(arch, num_heads, num_kv_heads)
    attn, x, grad_y = _reference(arch, config, batch, "zigzag")
    tsp = TSPAttention.from_hf(attn, config, topo.tsp_group, backend="sdpa")
    x_local = layout.shard(x, r, D, "zigzag").clone().requires_grad_()
    pos = layout.positions(r, D, "zigzag", SEQ_LEN).unsqueeze(0).expand(batch, -1)
    cos_sin = LlamaRotaryEmbedding(config)(x_local, pos)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    comm.counter.reset()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = tsp(x_local, cos_sin)
    forward = comm.counter.snapshot()
    y.backward(torch.ones_like(y))
    return dict(forward_received=sum(c["received"] for c in forward.values()),
                total_received=comm.counter.received(), ops=sorted(comm.counter.snapshot()),
                by_op={op: counts["received"] for op, counts in comm.counter.snapshot().items()},
                saved_bytes=sum(saved.values()), shard_bytes=tsp.packed.numel() * 8, rank=r,
                all_shards_numel=sum(spec.numel for spec in tsp.specs),
                qk_rows_numel=sum(math.prod(tsp.spec.shapes[name]) for name in ("q_proj.weight", "k_proj.weight")
                                  if name in tsp.spec.shapes))


@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 8), (8, 4), (8, 2), (8, 1)])
def test_bytes_equal_the_design_formula(run_ranks, num_heads, num_kv_heads):
    B, S, H, d, elem = 2, SEQ_LEN, HIDDEN, HEAD_DIM, 8
    Wa = H * (num_heads + 2 * num_kv_heads) * d + num_heads * d * H
    for D in (2, 4):
        kv = (D - 1) * 2 * B * S * num_kv_heads * d // D  # K/V all-gather, received per rank
        for out in run_ranks(D, _bytes_and_saved, num_heads=num_heads, num_kv_heads=num_kv_heads, batch=B):
            own = out["shard_bytes"] // elem
            # Each rank receives every other rank's shard: (D-1)/D * Wa when
            # shards are equal; with nkv < D a key/value head is stored once,
            # on the first rank of the heads that share it.
            forward = (Wa - own + kv) * elem
            # Backward: shards re-broadcast and K/V re-gathered (= forward
            # again), the reduce-scatter of dK, dV, and the reduce of the own
            # shard's gradient from the other D-1 ranks.
            total = 2 * forward + (kv + (D - 1) * own) * elem
            print(f"D={D} nq={num_heads} nkv={num_kv_heads} rank {out['rank']}: forward {out['forward_received']} "
                  f"B (formula {forward}), fwd+bwd {out['total_received']} B (formula {total})")
            assert out["all_shards_numel"] == Wa
            if num_kv_heads >= D:
                assert forward == (D - 1) * (Wa + 2 * B * S * num_kv_heads * d) // D * elem
            assert out["forward_received"] == forward
            assert out["total_received"] == total
            assert out["ops"] == ["all_gather", "broadcast", "reduce", "reduce_scatter"]


@pytest.mark.parametrize("num_kv_heads", [8, 2])
def test_norms_over_the_projection_send_the_shards_round_once_more(run_ranks, num_kv_heads):
    """OLMo-2's q/k norms: the sums of squares over every head group take one
    more round of the shards ahead of the attention's, in forward and in
    backward, where the q and k rows' weight gradients go to their owners too;
    the planner counts the same bytes, op by op."""
    from ds_tsp.planning import ModelShape, tsp_bytes_by_op

    B, S, H, d, nq, elem = 2, SEQ_LEN, HIDDEN, HEAD_DIM, 8, 8
    Wa = H * (nq + 2 * num_kv_heads) * d + nq * d * H
    shape = ModelShape(hidden_size=H, intermediate_size=4 * H, num_layers=1, num_heads=nq, num_kv_heads=num_kv_heads,
                       head_dim=d, vocab_size=64, qk_norm=True, qk_norm_spans_projection=True)
    for D in (2, 4):
        kv = (D - 1) * 2 * B * S * num_kv_heads * d // D
        for out in run_ranks(D, _bytes_and_saved, num_heads=nq, num_kv_heads=num_kv_heads, batch=B, arch="olmo2"):
            others = Wa - out["shard_bytes"] // elem  # every other rank's shard, broadcast
            forward = (2 * others + kv) * elem
            backward = (2 * others + 2 * kv + (D - 1) * (out["shard_bytes"] // elem + out["qk_rows_numel"])) * elem
            print(f"D={D} nkv={num_kv_heads} rank {out['rank']}: forward {out['forward_received']} B (formula "
                  f"{forward}), fwd+bwd {out['total_received']} B (formula {forward + backward})")
            assert out["forward_received"] == forward
            assert out["total_received"] == forward + backward
            planned = tsp_bytes_by_op(shape, S, B, D, elem, "both", tsp_rank=out["rank"])
            planned.pop("ring")  # the MLP's
            assert planned == out["by_op"]


def test_saved_for_backward_scales_as_one_over_d(run_ranks):
    single = run_ranks(1, _bytes_and_saved, num_heads=8, num_kv_heads=4, batch=2)[0]
    for D in (2, 4):
        for out in run_ranks(D, _bytes_and_saved, num_heads=8, num_kv_heads=4, batch=2):
            bound = single["saved_bytes"] / D + 2 * out["shard_bytes"]
            print(f"D={D} rank {out['rank']}: saved {out['saved_bytes']} B, bound {bound:.0f} B "
                  f"(D=1: {single['saved_bytes']} B)")
            assert out["saved_bytes"] <= bound


def test_heads_that_tsp_cannot_serve_are_refused():
    from ds_tsp.blocks.attention.head_groups import HeadGroups
    with pytest.raises(ValueError, match="num_attention_heads = 6 is not divisible by tsp.size = 4"):
        HeadGroups(6, 6, 4, 4)
    with pytest.raises(ValueError, match="num_key_value_heads = 6 is not divisible by tsp.size = 4"):
        HeadGroups(12, 6, 4, 4)
    with pytest.raises(ValueError, match="num_key_value_heads = 3 < tsp.size = 4"):
        HeadGroups(12, 3, 4, 4)


def test_auto_backend_falls_back_to_sdpa_on_cpu_and_says_so(caplog):
    from ds_tsp.blocks.attention import selection as attention_selection

    attention_selection._select_kernel.cache_clear()
    attention_selection._announced.clear()
    caplog.set_level("INFO", logger="ds_tsp")
    assert select_kernel("auto", "cpu", torch.float32).name == "sdpa"
    assert select_kernel("auto", "cpu", torch.bfloat16).name == "sdpa"
    messages = [r.getMessage() for r in caplog.records if "using torch SDPA" in r.getMessage()]
    assert len(messages) == 1 and "flash-attn is not installed" in messages[0]
    with pytest.raises(RuntimeError, match="tsp.attention_backend = \"flash\" cannot be used"):
        select_kernel("flash", "cpu", torch.bfloat16)


def _schedule(overlap):
    """The order in which one layer's forward and backward start and finish
    their K/V all-gathers and dK/dV reduce-scatters and run their head groups'
    attention, on this rank (D = 2, a key/value head per rank)."""
    from unittest import mock

    from ds_tsp.blocks.attention import schedule as attention

    events = []

    def logged(name, fn):
        def run(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        return run

    def pending(name, fn):
        def start(*args, **kwargs):
            events.append(f"start {name}")
            op = fn(*args, **kwargs)
            return comm.Pending(None, logged(f"wait {name}", op.wait))
        return start

    patches = [mock.patch.object(attention, "gather_kv", pending("gather", attention.gather_kv)),
               mock.patch.object(attention, "scatter_kv_grads", pending("scatter", attention.scatter_kv_grads)),
               mock.patch.object(attention, "attend_local_chunks", logged("attend", attention.attend_local_chunks)),
               mock.patch.object(attention, "attend_local_chunks_backward",
                                 logged("attend backward", attention.attend_local_chunks_backward))]
    config = _config("llama", 4, 2)
    attn, x, grad_y = _reference("llama", config, 1, "zigzag")
    for patch in patches:
        patch.start()
    try:
        _tsp_forward_backward(attn, config, x, grad_y, TSPTopology(2), "zigzag", overlap)
    finally:
        for patch in patches:
            patch.stop()
    return events


def test_overlap_puts_the_next_groups_collectives_under_this_groups_compute(run_ranks):
    """With ``overlap`` the K/V gather of group 1 starts before group 0 attends,
    and group 0's dK/dV reduce-scatter is waited on only after group 1's
    attention backward; without it, each collective finishes before the next
    group's compute."""
    # The fused backward (explicit) is the CPU default: no recompute in backward.
    overlapped = ["start gather", "start gather", "wait gather", "attend", "wait gather", "attend",  # forward
                  "start gather", "start gather", "wait gather", "attend backward", "start scatter",
                  "wait gather", "attend backward", "wait scatter", "start scatter", "wait scatter"]
    serial = ["start gather", "wait gather", "attend", "start gather", "wait gather", "attend",
              "start gather", "wait gather", "attend backward", "start scatter", "wait scatter",
              "start gather", "wait gather", "attend backward", "start scatter", "wait scatter"]
    for overlap, expected in ((True, overlapped), (False, serial)):
        for events in run_ranks(2, _schedule, overlap=overlap):
            print(f"overlap={overlap}: {events}")
            assert events == expected
