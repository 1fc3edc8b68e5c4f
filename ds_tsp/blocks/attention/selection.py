"""Which attention kernel serves a layer (``tsp.attention_backend``).

Explicit backends (``"sdpa"``, ``"cudnn"``, ``"flash"``; the kernels are in
``ds_tsp.blocks.attention.kernels``) are used as asked, or refused with the reason.
``"auto"`` is ``"sdpa"`` where nothing else serves the device and dtype (CPU,
CUDA float32); otherwise ``AutoKernel`` picks, per head size and windowed or
not, the fastest candidate that passes a parity check against float64
attention, on first use: group rank 0 checks and times them and broadcasts
its choice, so the ranks of a layer's group run the same kernel.
"""

import dataclasses
import functools
import importlib.util
import logging
import time

import torch

from ds_tsp.blocks.attention.kernels import (
    BlockwiseFlashKernel,
    CUDNNOps,
    FlashKernel,
    SDPAKernel,
    bottom_right_causal_mask,
    flash_ops,
)
from ds_tsp.parallel import comm, host_reads

logger = logging.getLogger("ds_tsp")

BACKENDS = ("auto", "sdpa", "cudnn", "flash")


# ---- which backends serve a device and dtype ----

def flash_unavailable_reason(device, dtype):
    """Why flash-attn cannot serve this device and dtype, or None if it can."""
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (pip install ds_tsp[flash] on a CUDA machine)"
    if torch.device(device).type != "cuda":
        return f"flash-attn needs a CUDA device, the model is on {torch.device(device).type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs float16 or bfloat16, the model is {dtype}"
    return None


def cudnn_unavailable_reason(device, dtype):
    """Why torch's cuDNN attention cannot serve this device and dtype, or None if it can."""
    if torch.device(device).type != "cuda":
        return f"cuDNN attention needs a CUDA device, the model is on {torch.device(device).type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"cuDNN attention needs float16 or bfloat16, the model is {dtype}"
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return f"torch {torch.__version__} has no cuDNN attention ops"
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None or version < 8900:
        return f"cuDNN attention needs cuDNN >= 8.9.0, torch has {version}"
    return None


def _sdpa_kernel(device, dtype):
    ops = flash_ops(device, dtype)
    return SDPAKernel() if ops is None else BlockwiseFlashKernel(ops)


# The backends besides "sdpa", in auto's order of preference: (why not, kernel).
_FUSED_BACKENDS = {
    "flash": (flash_unavailable_reason, FlashKernel),
    "cudnn": (cudnn_unavailable_reason, lambda: BlockwiseFlashKernel(CUDNNOps(), name="cudnn")),
}


def auto_candidates(device, dtype):
    """The kernels ``auto`` chooses among on this device and dtype, in order of
    preference (``"sdpa"`` always last), and why the others cannot serve."""
    candidates, reasons = {}, []
    for name, (unavailable_reason, make) in _FUSED_BACKENDS.items():
        reason = unavailable_reason(device, dtype)
        if reason:
            reasons.append(reason)
            continue
        try:
            candidates[name] = make()
        except ImportError as error:  # installed but broken (e.g. built for another torch): not a candidate
            reasons.append(f"{name} cannot be imported ({error})")
    candidates["sdpa"] = _sdpa_kernel(device, dtype)
    return candidates, reasons


# ---- auto: parity check and timing ----

@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """One block of attention as the TSP layer calls a kernel: queries the last
    ``Lq`` positions of the keys, strided slices of longer tensors."""

    q: torch.Tensor  # (B, Lq, hq, d)
    k: torch.Tensor  # (B, Lk, hkv, d)
    v: torch.Tensor
    grad_out: torch.Tensor  # (B, Lq, hq, d)
    scale: float
    window: int | None

    @classmethod
    def random(cls, batch, q_len, k_len, heads, kv_heads, head_dim, window, dtype, device, seed=0):
        # Its own generator, so the check leaves the model's random state alone.
        generator = torch.Generator().manual_seed(seed)

        def draw(length, num_heads, keep):  # a slice of a longer tensor, as the layer's tiles are
            full = torch.randn(batch, length + 8, num_heads, head_dim, generator=generator)
            return full[:, keep].to(device=device, dtype=dtype)

        q = draw(q_len, heads, slice(8, None))
        k, v = draw(k_len, kv_heads, slice(None, k_len)), draw(k_len, kv_heads, slice(None, k_len))
        grad_out = draw(q_len, heads, slice(8, None))
        return cls(q, k, v, grad_out, head_dim ** -0.5, window)


# Errors are relative to the float64 reference's largest magnitude, per tensor.
# The fused kernels round probabilities and products to the input dtype (unit
# roundoff 2^-8 in bf16, 2^-11 in fp16) and a few roundoffs add up in the
# gradients; a wrong mask, scale, merge or layout is off by O(1).
PARITY_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-10}

# Parity problems: both block kinds (the square causal block alone, and a key
# prefix before it), ragged lengths across the CUDA kernels' 128-wide tiles,
# grouped-query heads 4:1, batch 2 (so row slices are strided); the window cuts
# into both the prefix and the square.
PARITY_SHAPES = ((80, 80), (80, 208))
PARITY_HEADS, PARITY_KV_HEADS, PARITY_WINDOW = 8, 2, 37

# Timing: one query tile over twice its keys, at a size where CUDA kernels are
# compute-bound; small on CPU.
TIMING_SHAPES = {"cuda": dict(batch=1, q_len=2048, k_len=4096, heads=8, kv_heads=2),
                 "cpu": dict(batch=1, q_len=128, k_len=256, heads=8, kv_heads=2)}

# Timings this close are noise: the earlier candidate keeps its place.
TIMING_MARGIN = 1.05


def _explicit(kernel, head_dim, window):
    return hasattr(kernel, "explicit_backward") and kernel.explicit_backward(head_dim, window)


def _strided(t, dim):
    """``t`` as a strided view of a longer tensor, as the layer hands saved slices to the backward."""
    return torch.cat([t, t], dim=dim).narrow(dim, 0, t.shape[dim])


def training_step(kernel, problem, strided_saved=False):
    """What the TSP layer computes with ``kernel`` for one block in training:
    ``{"out", "dq", "dk", "dv"}`` and, with the fused backward, ``"lse"``. The
    fused backward runs against the saved output and log-sum-exp where the
    kernel offers it (handed strided slices with ``strided_saved``), else
    autograd through a recomputed forward."""
    q, k, v, grad_out, scale, window = (problem.q, problem.k, problem.v, problem.grad_out, problem.scale,
                                        problem.window)
    if _explicit(kernel, q.shape[-1], window):
        out, lse = kernel.forward(q, k, v, scale)
        saved = (_strided(out, 1), _strided(lse, -1)) if strided_saved else (out, lse)
        dq, dk, dv = kernel.backward(grad_out, q, k, v, *saved, scale)
        return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    with torch.no_grad():
        out, _ = kernel.attend(q, k, v, scale, window)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        recomputed, _ = kernel.attend(*leaves, scale, window)
        dq, dk, dv = torch.autograd.grad(recomputed, leaves, grad_out)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def reference_attention(problem):
    """``{"out", "lse", "dq", "dk", "dv"}`` of ``problem`` in float64 on the CPU:
    matmul, bottom-right causal mask, softmax."""
    q, k, v, grad_out = (t.detach().to("cpu", torch.float64) for t in (problem.q, problem.k, problem.v,
                                                                       problem.grad_out))
    rep = q.shape[2] // k.shape[2]
    with torch.enable_grad():
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(rep, 2)) * problem.scale
        allowed = bottom_right_causal_mask(q.shape[1], k.shape[1], problem.window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.repeat_interleave(rep, 2))
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    return {"out": out.detach(), "lse": scores.detach().logsumexp(-1), "dq": dq, "dk": dk, "dv": dv}


def parity_errors(kernel, problem):
    """Largest error of every tensor the TSP layer reads from ``kernel`` in a
    training step on ``problem`` (``out``, ``dq``, ``dk``, ``dv``, and ``lse``
    with the fused backward), relative to the float64 reference's largest magnitude."""
    reference = reference_attention(problem)
    errors = {}
    for name, tensor in training_step(kernel, problem, strided_saved=True).items():
        error = (tensor.detach().to("cpu", torch.float64) - reference[name]).abs().max() / reference[name].abs().max()
        errors[name] = error.item()
    return errors


def device_timer(device, repeats=3):
    """``timer(name, run)``: seconds per ``run()`` on ``device``, after one warm-up
    run (cuDNN graph builds, allocator growth)."""
    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timer(name, run):
        run()
        synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        synchronize()
        return (time.perf_counter() - start) / repeats

    return timer


class AutoKernel:
    """``tsp.attention_backend = "auto"`` where several kernels serve a device and
    dtype. Per head size and windowed or not, on first use: every candidate runs
    the parity problems as the TSP layer would in training (``training_step``) and
    is refused beyond ``PARITY_TOLERANCE`` against float64 attention or if it
    fails; the passing ones are timed on a training step (``timer(name, run)``,
    tests pass a fake one) and the fastest serves from then on, said once in the
    log. The parity problems have grouped-query heads 4:1 whatever the layer's
    ratio: it is not known before the first block runs. Over a ``group`` of
    several ranks, rank 0 alone checks and times and broadcasts its choice:
    timings differ from rank to rank, and ranks running different kernels
    would differ in their numerics (and one whose check refused every kernel
    would stop while the others wait for it).
    """

    name = "auto"

    def __init__(self, device, dtype, candidates, timer=None, group=None):
        self.device, self.dtype, self.group = torch.device(device), dtype, group
        self.candidates = candidates  # {name: kernel}, in order of preference
        self.timer = timer or device_timer(self.device)
        self.choices = {}  # (head_dim, windowed) -> name

    def kernel_for(self, head_dim, window):
        key = (head_dim, window is not None)
        if key not in self.choices:
            # The first use may come under no_grad, inference mode or autocast:
            # the check runs in the model's dtype with autograd, as training does.
            with torch.inference_mode(False), torch.enable_grad(), torch.autocast(self.device.type, enabled=False):
                self.choices[key] = self._agreed_choice(*key)
        return self.candidates[self.choices[key]]

    def explicit_backward(self, head_dim, window):
        return _explicit(self.kernel_for(head_dim, window), head_dim, window)

    def attend(self, q, k, v, scale, window=None, with_lse=False, **ahead):
        return self.kernel_for(q.shape[-1], window).attend(q, k, v, scale, window, with_lse, **ahead)

    def forward(self, q, k, v, scale, **ahead):
        return self.kernel_for(q.shape[-1], None).forward(q, k, v, scale, **ahead)

    def backward(self, grad_out, q, k, v, out, lse, scale, **ahead):
        return self.kernel_for(q.shape[-1], None).backward(grad_out, q, k, v, out, lse, scale, **ahead)

    def _agreed_choice(self, head_dim, windowed):
        """Group rank 0's ``_choose``, broadcast (an int64 on ``comm.group_device``, one host read)."""
        if comm.group_size(self.group) == 1:
            return self._choose(head_dim, windowed)
        names, refusal = list(self.candidates), None
        index = torch.tensor([-1], dtype=torch.int64, device=comm.group_device(self.group))
        if comm.group_rank(self.group) == 0:
            try:
                index.fill_(names.index(self._choose(head_dim, windowed)))
            except RuntimeError as error:  # no kernel passed: every rank hears of it and stops
                refusal = error
        comm.broadcast(index, 0, self.group)
        if refusal is not None:
            raise refusal
        chosen = int(host_reads.host_read(index, reason="attention kernel choice"))
        if chosen < 0:
            raise RuntimeError(f"tsp.attention_backend = \"auto\": no attention kernel passed its parity check on "
                               f"group rank 0 (head_dim {head_dim}, {'sliding window' if windowed else 'full causal'}; "
                               f"its log says why); set tsp.attention_backend to one of {BACKENDS[1:]} to use it "
                               "without the check")
        return names[chosen]

    def _choose(self, head_dim, windowed):
        tolerance = PARITY_TOLERANCE[self.dtype]
        problems = [AttentionProblem.random(2, q_len, k_len, PARITY_HEADS, PARITY_KV_HEADS, head_dim,
                                            PARITY_WINDOW if windowed else None, self.dtype, self.device)
                    for q_len, k_len in PARITY_SHAPES]
        shape = TIMING_SHAPES.get(self.device.type, TIMING_SHAPES["cpu"])
        timing = AttentionProblem.random(**shape, head_dim=head_dim, window=shape["q_len"] // 2 if windowed else None,
                                         dtype=self.dtype, device=self.device)
        times, refused = {}, {}
        for name, kernel in self.candidates.items():
            try:
                errors = [parity_errors(kernel, problem) for problem in problems]
            except (RuntimeError, TypeError, ValueError) as error:  # cannot run this shape: refused like a wrong one
                refused[name] = f"{type(error).__name__}: {error}"
                continue
            wrong = {k: e for errs in errors for k, e in errs.items() if not e <= tolerance}  # NaN is wrong too
            if wrong:
                refused[name] = ", ".join(f"{k} off by {e:.1e}" for k, e in wrong.items()) + f" (> {tolerance:g})"
                continue
            times[name] = self.timer(name, functools.partial(training_step, kernel, timing))
        where = (f"{self.device.type} {str(self.dtype).removeprefix('torch.')}, head_dim {head_dim}, "
                 f"{'sliding window' if windowed else 'full causal'}")
        refusals = "; ".join(f"{name}: {why}" for name, why in refused.items())
        if not times:
            raise RuntimeError(f"tsp.attention_backend = \"auto\": no attention kernel passed its parity check on "
                               f"{where} ({refusals}); set tsp.attention_backend to one of {BACKENDS[1:]} to use it "
                               "without the check")
        fastest = min(times.values())
        choice = next(name for name, seconds in times.items() if seconds <= fastest * TIMING_MARGIN)
        logger.info("tsp.attention_backend auto on %s: %s (%s)%s", where, choice,
                    ", ".join(f"{name} {seconds * 1e3:.3g} ms" for name, seconds in times.items()),
                    f"; refused {refusals}" if refused else "")
        return choice


# ---- selection ----

_announced = set()


def select_kernel(backend, device, dtype, group=None):
    """The kernel for ``tsp.attention_backend`` on ``device`` computing in
    ``dtype``: the layer's compute dtype (``amp.compute_dtype`` of its weights,
    autocast's where autocast is on), not its input's. Explicit backends are
    used as asked, or refused with the reason; ``auto`` says once in the log
    when only torch SDPA serves, and what ``AutoKernel`` chose otherwise, the
    same on every rank of ``group`` (the layer's TSP group). Cached: every
    layer asks on every forward."""
    return _select_kernel(backend, torch.device(device).type, dtype, group)


@functools.lru_cache(maxsize=None)
def _select_kernel(backend, device, dtype, group):
    if backend not in BACKENDS:
        raise ValueError(f"tsp.attention_backend = {backend!r}: choose one of {BACKENDS}")
    if backend == "sdpa":
        return _sdpa_kernel(device, dtype)
    if backend in _FUSED_BACKENDS:
        unavailable_reason, make = _FUSED_BACKENDS[backend]
        reason = unavailable_reason(device, dtype)
        if reason:
            raise RuntimeError(f"tsp.attention_backend = \"{backend}\" cannot be used: {reason}; "
                               "set tsp.attention_backend to \"auto\" or \"sdpa\"")
        return make()
    candidates, reasons = auto_candidates(device, dtype)
    if len(candidates) > 1:
        return AutoKernel(device, dtype, candidates, group=group)
    reason = "; ".join(reasons)
    if reason not in _announced:
        _announced.add(reason)
        logger.info("tsp.attention_backend auto: using torch SDPA because %s", reason)
    return candidates["sdpa"]
