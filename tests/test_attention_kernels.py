"""The local attention kernels and ``auto``'s choice among them, on CPU.

The CUDA kernels (torch's flash and cuDNN ops, flash-attn) need a GPU. Here runs
everything that decides among them: the candidate lists and refusals, the parity
check against float64 attention (with the CPU kernels, and wrong kernels it must
refuse), the choice of the fastest (with a fake timer), and the adapter to
flash-attn's private forward/backward against the signatures of its 2.5, 2.6
and 2.6.3+ releases (fakes that compute attention exactly, in float64).
"""

import math
import types
from typing import Optional

import pytest
import torch

from ds_tsp.blocks.attention import kernels as ak
from ds_tsp.blocks.attention import selection as sel
from ds_tsp.blocks.attention.kernels import BlockwiseFlashKernel, FlashKernel, SDPAKernel, bottom_right_causal_mask
from ds_tsp.blocks.attention.selection import (PARITY_SHAPES, PARITY_TOLERANCE, AttentionProblem, AutoKernel,
                                               parity_errors, select_kernel)


@pytest.fixture(autouse=True)
def fresh_selection():
    sel._select_kernel.cache_clear()
    sel._announced.clear()
    yield
    sel._select_kernel.cache_clear()


def _worst_errors(kernel, dtype, head_dim, window):
    worst = {}
    for q_len, k_len in PARITY_SHAPES:
        problem = AttentionProblem.random(2, q_len, k_len, 8, 2, head_dim, window, dtype, "cpu")
        for name, error in parity_errors(kernel, problem).items():
            worst[name] = max(worst.get(name, 0.0), error)
    return worst


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 37])
def test_cpu_kernels_match_float64_attention(dtype, window):
    for kernel in (SDPAKernel(), BlockwiseFlashKernel(ak._CPUFlashOps())):
        worst = _worst_errors(kernel, dtype, 16, window)
        print(f"{type(kernel).__name__} {dtype} window={window}: " + ", ".join(f"{k} {e:.1e}"
                                                                            for k, e in worst.items()))
        assert max(worst.values()) <= PARITY_TOLERANCE[dtype], worst
        # The blockwise kernel's fused backward (it alone returns the lse) ran where it serves.
        assert ("lse" in worst) == (isinstance(kernel, BlockwiseFlashKernel) and window is None)


def _sink_attention_grads(kernel, q, k, v, sinks, grad, fused):
    """Output and the gradients of q, k, v and the sinks of ``kernel`` (a
    ``SinkKernel``): through its fused forward/backward and ``sink_gradient``,
    or autograd through its materialised ``attend``."""
    scale = q.shape[-1] ** -0.5
    if fused:
        out, lse = kernel.forward(q, k, v, scale, sinks=sinks)
        dq, dk, dv = kernel.backward(grad, q, k, v, out, lse, scale)
        return out, dq, dk, dv, kernel.sink_gradient(grad, out, lse, sinks)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    out, _ = kernel.attend(*leaves[:3], scale, sinks=leaves[3])
    return (out.detach(), *torch.autograd.grad(out, leaves, grad))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_sinks_after_a_fused_kernel_equal_the_sink_softmax(dtype):
    """DESIGN.md 6h: a sink applied after the fused kernel, from its
    log-sum-exp, forward and backward (the sinks' gradient included), equals
    the softmax with the sink column materialised, on a bottom-right causal
    block (12 queries, the last of 20 keys, grouped-query heads), float64 to
    round-off and bf16 to the kernels' bound; a sink shifted by 0.5 in the
    fused path moves the output far more (4e-2)."""
    generator = torch.Generator().manual_seed(5)
    q, k, v, grad = (torch.randn(2, length, heads, 8, generator=generator, dtype=torch.float64)
                     for length, heads in ((12, 4), (20, 2), (20, 2), (12, 4)))
    sinks = torch.randn(4, generator=generator, dtype=torch.float64)
    kernel = ak.SinkKernel(BlockwiseFlashKernel(ak._CPUFlashOps()))
    assert kernel.explicit_backward(8, None) and not kernel.explicit_backward(8, 5)
    reference = _sink_attention_grads(kernel, q, k, v, sinks, grad, fused=False)
    cast = [t.to(dtype) for t in (q, k, v, grad)]
    fused = _sink_attention_grads(kernel, *cast[:3], sinks, cast[3], fused=True)
    wrong = _sink_attention_grads(kernel, *cast[:3], sinks + 0.5, cast[3], fused=True)
    errors = {name: ((a.double() - b).abs().max() / b.abs().max()).item()
              for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), fused, reference)}
    moved = ((wrong[0].double() - reference[0]).abs().max() / reference[0].abs().max()).item()
    print(f"sinks after the fused kernel, {dtype}: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
          + f"; a sink 0.5 off moves the output {moved:.1e}")
    assert max(errors.values()) <= (1e-12 if dtype == torch.float64 else PARITY_TOLERANCE[dtype])
    assert moved > 1e10 * max(errors.values()) if dtype == torch.float64 else moved > PARITY_TOLERANCE[dtype]


@pytest.mark.parametrize("window", [None, 6])
def test_bidirectional_blocks_attend_to_every_key_of_the_block(window):
    """A bidirectional block (Gemma 3's image tokens: ``ahead`` keys of the
    block after its last query) in every CPU kernel, forward and backward
    (through the fused backward where a kernel has one; flash-attn's through
    fakes of its documented window semantics), equals float64
    softmax attention over every key, or every key after ``own - window``
    with a window, where query ``i`` is key ``i + Lk - Lq - ahead``; the causal
    block of the same tensors differs (0.1 or more)."""
    generator = torch.Generator().manual_seed(7)
    ahead, scale = 3, 8 ** -0.5
    q, k, v, grad = (torch.randn(2, length, heads, 8, generator=generator, dtype=torch.float64)
                     for length, heads in ((5, 4), (14, 2), (14, 2), (5, 4)))
    own = torch.arange(5).unsqueeze(1) + 14 - 5 - ahead
    keys = torch.arange(14).unsqueeze(0)
    allowed = torch.ones(5, 14, dtype=torch.bool) if window is None else keys > own - window
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    rep_k, rep_v = (t.repeat_interleave(2, dim=2) for t in leaves[1:])
    scores = torch.einsum("bqhd,bkhd->bhqk", leaves[0], rep_k) * scale
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), rep_v)
    reference = (expected.detach(), *torch.autograd.grad(expected, leaves, grad))
    sinks = torch.full((4,), -math.inf, dtype=torch.float64)  # a sink that takes no weight: plain attention
    for kernel in (SDPAKernel(), BlockwiseFlashKernel(ak._CPUFlashOps()), ak.SoftCappedKernel(1e9),
                   ak.SinkKernel(BlockwiseFlashKernel(ak._CPUFlashOps())),
                   FlashKernel(_interface(*RELEASES["2.6.3+"])), FlashKernel(_interface(*RELEASES["2.5"]))):
        options = {"sinks": sinks} if isinstance(kernel, ak.SinkKernel) else {}
        if window is None and hasattr(kernel, "explicit_backward"):
            out, lse = kernel.forward(q, k, v, scale, ahead=ahead, **options)
            got = (out, *kernel.backward(grad, q, k, v, out, lse, scale, ahead=ahead))
        else:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out, _ = kernel.attend(*leaves, scale, window, ahead=ahead, **options)
            got = (out.detach(), *torch.autograd.grad(out, leaves, grad))
        errors = [(a - b).abs().max().item() for a, b in zip(got, reference)]
        print(f"{type(kernel).__name__} bidirectional, window={window}: max errors {errors}")
        assert max(errors) <= 1e-12
        causal, _ = kernel.attend(q, k, v, scale, window, **options)
        assert (causal - reference[0]).abs().max() > 0.1


class TopLeftCausal(SDPAKernel):
    """SDPA's own ``is_causal`` for every block: top-left aligned, wrong when Lq < Lk."""

    def attend(self, q, k, v, scale, window=None, with_lse=False):
        out = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2), None


class StaleLSE(BlockwiseFlashKernel):
    """Right output and lse, but a backward against a shifted lse: only the gradients are wrong."""

    def backward(self, grad_out, q, k, v, out, lse, scale):
        return super().backward(grad_out, q, k, v, out, lse + 0.5, scale)


class Broken(SDPAKernel):
    def attend(self, q, k, v, scale, window=None, with_lse=False):
        raise RuntimeError("no kernel for this shape")


class TiledHeads(ak._CPUFlashOps):
    """Takes fewer key/value heads but pairs query head h with key/value head
    h mod hkv (the heads tiled, not repeated): right shapes, wrong heads."""

    def forward(self, q, k, v, causal, scale):
        rep = q.shape[1] // k.shape[1]
        return super().forward(q, k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1), causal, scale)

    def backward(self, grad_out, q, k, v, out, lse, causal, scale):
        rep = q.shape[1] // k.shape[1]
        dq, dk, dv = super().backward(grad_out, q, k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1), out, lse,
                                      causal, scale)
        return dq, dk.unflatten(1, (rep, -1)).sum(1), dv.unflatten(1, (rep, -1)).sum(1)


class NoGroupedQuery(ak._CPUFlashOps):
    def forward(self, q, k, v, causal, scale):
        if k.shape[1] != q.shape[1]:
            raise RuntimeError("number of heads in key/value must equal the number of heads in query")
        return super().forward(q, k, v, causal, scale)


@pytest.mark.parametrize("ops, native", [(ak._CPUFlashOps(), True), (TiledHeads(), False),
                                         (NoGroupedQuery(), False)])
def test_grouped_query_heads_go_to_the_kernel_only_where_it_pairs_them_right(ops, native):
    assert ak.takes_grouped_query(ops, "cpu", torch.float32) is native
    # Either way the blockwise kernel gives the right attention: the probe decides who repeats the heads.
    worst = _worst_errors(BlockwiseFlashKernel(ops), torch.float64, 16, None)
    assert max(worst.values()) <= PARITY_TOLERANCE[torch.float64], worst


def _cpu_candidates(*names):
    kernels = {"top_left": TopLeftCausal(), "stale_lse": StaleLSE(ak._CPUFlashOps()), "broken": Broken(),
               "plain": SDPAKernel(), "blockwise": BlockwiseFlashKernel(ak._CPUFlashOps())}
    return {name: kernels[name] for name in names}


class FakeTimer:
    def __init__(self, seconds):
        self.seconds, self.timed = seconds, []

    def __call__(self, name, run):
        self.timed.append(name)
        return self.seconds[name]


def test_the_wrong_kernels_are_refused_and_the_fastest_right_one_serves(caplog):
    caplog.set_level("INFO", logger="ds_tsp")
    # The guard: each wrong kernel is off by far more than the tolerance.
    assert max(_worst_errors(TopLeftCausal(), torch.float32, 16, None).values()) > 1e-1
    stale = _worst_errors(StaleLSE(ak._CPUFlashOps()), torch.float32, 16, None)
    assert max(stale[k] for k in ("out", "lse")) <= 1e-5 < 1e-1 < min(stale[k] for k in ("dq", "dk", "dv"))

    # The wrong ones are also the "fastest": the parity check, not the clock, rules them out.
    timer = FakeTimer({"top_left": 0.1, "stale_lse": 0.1, "broken": 0.1, "plain": 2.0, "blockwise": 1.0})
    auto = AutoKernel("cpu", torch.float32, _cpu_candidates("top_left", "stale_lse", "broken", "plain", "blockwise"),
                      timer=timer)
    assert auto.explicit_backward(16, None)
    assert timer.timed == ["plain", "blockwise"] and auto.choices == {(16, False): "blockwise"}
    [message] = [r.getMessage() for r in caplog.records if "tsp.attention_backend auto on" in r.getMessage()]
    print(message)
    assert message.startswith("tsp.attention_backend auto on cpu float32, head_dim 16, full causal: blockwise")
    assert "top_left: out off by" in message and "stale_lse: dq off by" in message
    assert "broken: RuntimeError: no kernel for this shape" in message

    # Calls go to the chosen kernel.
    problem = AttentionProblem.random(2, 80, 208, 8, 2, 16, None, torch.float32, "cpu")
    blockwise = auto.candidates["blockwise"]
    out, lse = auto.forward(problem.q, problem.k, problem.v, problem.scale)
    assert torch.equal(out, blockwise.forward(problem.q, problem.k, problem.v, problem.scale)[0])
    grads = auto.backward(problem.grad_out, problem.q, problem.k, problem.v, out, lse, problem.scale)
    expected = blockwise.backward(problem.grad_out, problem.q, problem.k, problem.v, out, lse, problem.scale)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_timings_within_the_margin_keep_the_earlier_candidate_and_choices_are_cached():
    candidates = _cpu_candidates("plain", "blockwise")
    auto = AutoKernel("cpu", torch.float32, candidates, timer=FakeTimer({"plain": 1.0, "blockwise": 1.04}))
    assert not auto.explicit_backward(16, None)  # plain SDPA: the layer recomputes in backward
    auto = AutoKernel("cpu", torch.float32, candidates, timer=FakeTimer({"plain": 1.0, "blockwise": 0.9}))
    assert auto.explicit_backward(16, None)
    # Per head size and windowed or not; each timed once.
    assert not auto.explicit_backward(16, 5) and not auto.explicit_backward(16, 9)
    auto.explicit_backward(8, None)
    assert auto.choices == {(16, False): "blockwise", (16, True): "blockwise", (8, False): "blockwise"}
    assert auto.timer.timed == ["plain", "blockwise"] * 3
    problem = AttentionProblem.random(1, 6, 10, 4, 2, 16, 5, torch.float32, "cpu")
    out, _ = auto.attend(problem.q, problem.k, problem.v, problem.scale, window=5)
    assert torch.equal(out, candidates["blockwise"].attend(problem.q, problem.k, problem.v, problem.scale, 5)[0])


def test_no_passing_candidate_is_an_error_naming_the_fix():
    auto = AutoKernel("cpu", torch.float32, _cpu_candidates("top_left", "broken"), timer=FakeTimer({}))
    with pytest.raises(RuntimeError, match=r"tsp.attention_backend = \"auto\": no attention kernel passed its parity "
                                           r"check on cpu float32, head_dim 16, full causal \(top_left: out off by .*"
                                           r"set tsp.attention_backend to one of"):
        auto.explicit_backward(16, None)


def test_the_check_leaves_the_callers_state_alone():
    """The first use may come in an inference forward or under autocast, mid-training:
    the check still runs with autograd in the model's dtype and does not touch the RNG."""
    rng = torch.get_rng_state()
    auto = AutoKernel("cpu", torch.bfloat16, _cpu_candidates("plain", "blockwise"),
                      timer=FakeTimer({"plain": 2.0, "blockwise": 1.0}))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.float16):
        assert auto.explicit_backward(16, None)
    assert torch.equal(torch.get_rng_state(), rng)


def test_device_timer_measures_runs():
    calls = []
    seconds = sel.device_timer(torch.device("cpu"), repeats=2)("x", lambda: calls.append(1))
    assert len(calls) == 3 and 0 <= seconds < 1  # one warm-up, two timed


def test_backends_that_cannot_serve_are_refused_with_the_fix():
    with pytest.raises(RuntimeError, match=r"tsp.attention_backend = \"cudnn\" cannot be used: cuDNN attention needs "
                                           r"a CUDA device, the model is on cpu; set tsp.attention_backend to "
                                           r"\"auto\" or \"sdpa\""):
        select_kernel("cudnn", "cpu", torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"tsp.attention_backend = \"flash\" cannot be used"):
        select_kernel("flash", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match=r"'xformers': choose one of \('auto', 'sdpa', 'cudnn', 'flash'\)"):
        select_kernel("xformers", "cpu", torch.float32)
    assert sel.cudnn_unavailable_reason("cuda", torch.float32) == ("cuDNN attention needs float16 or bfloat16, "
                                                                  "the model is torch.float32")
    sdpa = select_kernel("sdpa", "cpu", torch.float32)
    assert isinstance(sdpa, BlockwiseFlashKernel) and sdpa.name == "sdpa"


def test_auto_candidates():
    candidates, reasons = sel.auto_candidates("cpu", torch.bfloat16)
    assert list(candidates) == ["sdpa"] and isinstance(candidates["sdpa"], BlockwiseFlashKernel)
    assert [r.split(" ")[0] for r in reasons] == ["flash-attn", "cuDNN"]
    candidates, _ = sel.auto_candidates("cuda", torch.float32)  # no fused torch op takes fp32 on CUDA
    assert type(candidates["sdpa"]) is SDPAKernel


def test_auto_races_where_several_backends_serve(monkeypatch):
    # A stand-in for a CUDA machine with cuDNN: only the candidate list is built, nothing runs.
    monkeypatch.setitem(sel._FUSED_BACKENDS, "cudnn", (lambda device, dtype: None, lambda: SDPAKernel()))
    auto = select_kernel("auto", "cuda", torch.bfloat16)
    assert isinstance(auto, AutoKernel) and list(auto.candidates) == ["cudnn", "sdpa"]
    assert isinstance(auto.candidates["sdpa"].ops, ak._CUDAFlashOps)


class RecordingFlash(BlockwiseFlashKernel):
    """A stand-in for flash-attn on the CPU (torch's CPU flash ops), recording the dtypes it computes in."""

    def __init__(self):
        super().__init__(ak._CPUFlashOps(), name="flash")
        self.dtypes = []

    def forward(self, q, k, v, scale):
        self.dtypes.append(q.dtype)
        return super().forward(q, k, v, scale)


def test_under_autocast_the_kernel_is_chosen_by_the_compute_dtype(monkeypatch):
    """float32 weights under bf16 autocast compute attention in bf16: the
    ``"flash"`` backend (which takes fp16/bf16 only; its CUDA check stubbed) serves
    them, and sees bf16. Without autocast the same layer is refused, as the old
    choice by the input's dtype (float32 under autocast too) refused it always."""
    from ds_tsp.blocks.attention.module import TSPAttention

    flash = RecordingFlash()
    only_half = lambda device, dtype: (None if dtype in (torch.float16, torch.bfloat16)
                                       else f"flash-attn needs float16 or bfloat16, the model is {dtype}")
    monkeypatch.setitem(sel._FUSED_BACKENDS, "flash", (only_half, lambda: flash))
    torch.manual_seed(0)
    attn = TSPAttention(32, 4, 2, 8, None, backend="flash", dtype=torch.float32)
    attn.packed.data.normal_(0, 0.2)
    x = torch.randn(2, 6, 32, requires_grad=True)
    angles = torch.arange(6.0).view(1, 6, 1) * torch.linspace(0.1, 1.0, 8)
    rotary = (angles.cos().expand(2, -1, -1), angles.sin().expand(2, -1, -1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(x, rotary)
    out.float().sum().backward()
    assert flash.dtypes == [torch.bfloat16] and out.dtype == torch.bfloat16
    assert attn.packed.grad.dtype == torch.float32 and torch.isfinite(attn.packed.grad).all()
    with pytest.raises(RuntimeError, match=r"\"flash\" cannot be used: flash-attn needs float16 or bfloat16, the "
                                           r"model is torch.float32"):
        attn(x, rotary)


def auto_choice_on_ranks():
    """Each rank's timer favours another kernel; what each rank's own check
    would choose, and what the group runs. Then rank 0's check refuses every
    kernel: every rank stops, each with the reason it knows."""
    import torch.distributed as dist

    rank = dist.get_rank()
    seconds = {"plain": 1.0, "blockwise": 2.0} if rank == 0 else {"plain": 2.0, "blockwise": 1.0}
    auto = AutoKernel("cpu", torch.float32, _cpu_candidates("plain", "blockwise"), timer=FakeTimer(seconds),
                      group=dist.group.WORLD)
    own = auto._choose(16, False)
    auto.timer.timed.clear()
    auto.explicit_backward(16, None)
    names = ("top_left", "broken") if rank == 0 else ("plain",)
    refusing = AutoKernel("cpu", torch.float32, _cpu_candidates(*names), timer=FakeTimer({"plain": 1.0}),
                          group=dist.group.WORLD)
    try:
        refusing.explicit_backward(16, None)
        refusal = None
    except RuntimeError as error:
        refusal = str(error)
    return own, auto.choices[(16, False)], auto.timer.timed, refusal


def test_auto_choice_is_rank_zeros_on_every_rank(run_ranks):
    results = run_ranks(2, auto_choice_on_ranks)
    # The guard: alone, the ranks would choose differently.
    assert [own for own, *_ in results] == ["plain", "blockwise"]
    assert [chosen for _, chosen, _, _ in results] == ["plain", "plain"]
    assert [timed for *_, timed, _ in results] == [["plain", "blockwise"], []]  # rank 0 alone times
    refusals = [refusal for *_, refusal in results]
    assert refusals[0].startswith("tsp.attention_backend = \"auto\": no attention kernel passed its parity check on "
                                  "cpu float32")
    assert refusals[1].startswith("tsp.attention_backend = \"auto\": no attention kernel passed its parity check on "
                                  "group rank 0 (head_dim 16, full causal; its log says why)")


# ---- flash-attn's private API, by release (fakes computing exact attention) ----

def _flash_mask(q_len, k_len, causal, left, right):
    """flash-attn's documented mask: query ``i`` sees keys ``[i + Lk - Lq - left, i + Lk - Lq + right]`` (-1:
    unbounded), and none after ``i + Lk - Lq`` when causal."""
    diagonal = torch.arange(q_len).unsqueeze(1) + k_len - q_len
    keys = torch.arange(k_len).unsqueeze(0)
    allowed = torch.ones(q_len, k_len, dtype=torch.bool)
    if causal:
        allowed &= keys <= diagonal
    if left >= 0:
        allowed &= keys >= diagonal - left
    if right >= 0:
        allowed &= keys <= diagonal + right
    return allowed


def _attention(q, k, v, scale, window_left, causal=True, window_right=-1):
    """Float64 probabilities, scores' lse and repeated k/v heads for flash-attn's layout (B, L, h, d)."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 2), v.double().repeat_interleave(rep, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~_flash_mask(q.shape[1], k.shape[1], causal, window_left, window_right), -math.inf)
    return scores, scores.logsumexp(-1), q, k, v


def _forward(q, k, v, scale, causal, window_left):
    scores, lse, _, _, v64 = _attention(q, k, v, scale, window_left, causal)
    out = torch.einsum("bhqk,bkhd->bqhd", (scores - lse.unsqueeze(-1)).exp(), v64)
    return out.to(q.dtype), lse  # lse kept in float64, so the adapter's plumbing is checked to 1e-10


def _backward(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, window_left):
    """Flash attention's backward: from the given output and log-sum-exp, as the kernel does."""
    scores, _, q64, k64, v64 = _attention(q, k, v, scale, window_left, causal)
    probs = (scores - lse.double().unsqueeze(-1)).exp()
    dout, out = dout.double(), out.double()
    d_scores = probs * (torch.einsum("bqhd,bkhd->bhqk", dout, v64)
                        - (dout * out).sum(-1).transpose(1, 2).unsqueeze(-1))
    rep = q.shape[2] // k.shape[2]
    dq.copy_(torch.einsum("bhqk,bkhd->bqhd", d_scores, k64) * scale)
    dk.copy_((torch.einsum("bhqk,bqhd->bkhd", d_scores, q64) * scale).unflatten(2, (-1, rep)).sum(3))
    dv.copy_(torch.einsum("bhqk,bqhd->bkhd", probs, dout).unflatten(2, (-1, rep)).sum(3))


def _flash_attn_func(q, k, v, softmax_scale, causal, window_size, return_attn_probs):
    assert return_attn_probs
    scores, lse, _, _, _ = _attention(q, k, v, softmax_scale, window_size[0], causal, window_size[1])
    rep = q.shape[2] // k.shape[2]
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1).to(q.dtype), v.repeat_interleave(rep, 2))
    return out, lse, None


def _fixed(dropout_p, softcap=0.0, alibi_slopes=None, deterministic=False, return_softmax=False):
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and not deterministic and not return_softmax


def _v2_5_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    _fixed(dropout_p, alibi_slopes=alibi_slopes, return_softmax=return_softmax)
    out, lse = _forward(q, k, v, softmax_scale, causal, window_size[0])
    return out, q, k, v, out, lse, None, None


def _v2_5_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, deterministic, rng_state=None):
    _fixed(dropout_p, alibi_slopes=alibi_slopes, deterministic=deterministic)
    _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size[0])
    return dq, dk, dv, None


def _v2_6_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    _fixed(dropout_p, softcap, alibi_slopes, return_softmax=return_softmax)
    out, lse = _forward(q, k, v, softmax_scale, causal, window_size[0])
    return out, q, k, v, out, lse, None, None


def _v2_6_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                   softcap, alibi_slopes, deterministic, rng_state=None):
    _fixed(dropout_p, softcap, alibi_slopes, deterministic)
    _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size[0])
    return dq, dk, dv, None


# 2.6.3+ registers them as torch custom ops, whose Python signature is (*args, **kwargs).
@torch.library.custom_op("ds_tsp_tests::flash_attn_forward", mutates_args=())
def _v2_7_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                  causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                  alibi_slopes: Optional[torch.Tensor], return_softmax: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _fixed(dropout_p, softcap, alibi_slopes, return_softmax=return_softmax)
    out, lse = _forward(q, k, v, softmax_scale, causal, window_size_left)
    return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("ds_tsp_tests::flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _v2_7_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                   dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
                   window_size_left: int, window_size_right: int, softcap: float,
                   alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                   rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    _fixed(dropout_p, softcap, alibi_slopes, deterministic)
    _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size_left)
    return torch.empty(0)


def _unknown_forward(q, k, v, qv, softmax_scale, causal):  # a future signature with a new required input
    raise AssertionError("must not be called")


RELEASES = {"2.5": (_v2_5_forward, _v2_5_backward), "2.6": (_v2_6_forward, _v2_6_backward),
            "2.6.3+": (_v2_7_forward, _v2_7_backward)}


def _interface(forward, backward):
    return types.SimpleNamespace(_flash_attn_forward=forward, _flash_attn_backward=backward,
                                 flash_attn_func=_flash_attn_func)


@pytest.mark.parametrize("release", sorted(RELEASES))
@pytest.mark.parametrize("window", [None, 37])
def test_flash_attn_private_api_by_release(release, window):
    kernel = FlashKernel(_interface(*RELEASES[release]))
    assert kernel.explicit_backward(16, None) and not kernel.explicit_backward(12, None)
    worst = _worst_errors(kernel, torch.float64, 16, window)
    print(f"flash-attn {release} window={window}: " + ", ".join(f"{k} {e:.1e}" for k, e in worst.items()))
    assert max(worst.values()) <= PARITY_TOLERANCE[torch.float64]
    assert ("lse" in worst) == (window is None)  # the fused backward ran where it serves


def test_an_unknown_flash_attn_api_is_refused_clearly(caplog):
    caplog.set_level("WARNING", logger="ds_tsp")
    kernel = FlashKernel(_interface(_unknown_forward, _v2_6_backward))
    assert not kernel.explicit_backward(16, None)
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith("tsp.attention_backend flash: flash-attn's _flash_attn_forward takes ['q', 'k', 'v', "
                              "'qv', 'softmax_scale', 'causal'], not the 2.5-2.8 parameters ds_tsp knows "
                              "(unknown ['qv'], missing [])")
    assert message.endswith("attention backward recomputes the forward")
    # Its public attention still serves, with autograd.
    assert max(_worst_errors(kernel, torch.float64, 16, None).values()) <= PARITY_TOLERANCE[torch.float64]
