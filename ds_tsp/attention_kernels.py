"""Local attention kernels behind one small interface.

``kernel.attend(q, k, v, scale, window, with_lse)`` takes queries ``(B, Lq, hq, d)`` that
are the LAST ``Lq`` positions of the keys ``(B, Lk, hkv, d)`` (bottom-right
causal alignment: query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``, and
``j > i + Lk - Lq - window`` with a sliding window) and returns the output
``(B, Lq, hq, d)`` and, when ``with_lse``, the log-sum-exp ``(B, hq, Lq)`` in
float32 (else None). The output is differentiable by autograd; the log-sum-exp
is for merging partial attention (decoding), not for training. ``hkv`` may
divide ``hq`` (grouped-query).

For training, a kernel may also offer ``explicit_backward(head_dim, window)`` and then
``forward(q, k, v, scale) -> (out, lse)`` and ``backward(grad_out, q, k, v,
out, lse, scale) -> (dq, dk, dv)``: the TSP backward then saves the output and
log-sum-exp of the local queries and runs the fused backward directly, instead
of recomputing the attention forward under autograd.
"""

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger("ds_tsp")

BACKENDS = ("auto", "sdpa", "flash")


def bottom_right_causal_mask(q_len, k_len, window=None, device=None):
    """``(Lq, Lk)`` bool, True where a query may attend to a key."""
    q_pos = torch.arange(q_len, device=device).unsqueeze(1) + (k_len - q_len)
    k_pos = torch.arange(k_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


class SDPAKernel:
    """torch's ``scaled_dot_product_attention``: runs on every device and dtype."""

    name = "sdpa"

    def attend(self, q, k, v, scale, window=None, with_lse=False):
        q_len, k_len = q.shape[1], k.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, L, d)
        if q_len == k_len and window is None:
            mask, is_causal = None, True
        else:
            mask, is_causal = bottom_right_causal_mask(q_len, k_len, window, q.device), False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        lse = None
        if with_lse:
            # SDPA does not return it; materialising the scores is fine for the
            # short query blocks of decoding, which is the only user.
            with torch.no_grad():
                lse = _log_sum_exp(q, k, scale, bottom_right_causal_mask(q_len, k_len, window, q.device))
        return out.transpose(1, 2), lse


class _CPUFlashOps:
    """torch's fused CPU flash kernels (any float dtype, float64 included)."""

    def supports(self, head_dim):
        return True

    def forward(self, q, k, v, causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)


class _CUDAFlashOps:
    """torch's fused CUDA flash kernels (float16/bfloat16, dense batches)."""

    def supports(self, head_dim):
        return head_dim <= 256 and head_dim % 8 == 0

    def forward(self, q, k, v, causal, scale):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, causal, scale):
        # Dense batches without dropout: no sequence offsets (None, as the
        # forward returns them), and an RNG state that is never read.
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
        offset = torch.zeros((), dtype=torch.uint64, device=q.device)
        # The kernel reads the log-sum-exp (and gradients) as dense: slices of
        # a longer sequence must be copied first.
        grad_out, q, k, v, out, lse = (t.contiguous() for t in (grad_out, q, k, v, out, lse))
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
            scale=scale)


def _flash_ops(device, dtype):
    device = torch.device(device).type
    if device == "cpu":
        return _CPUFlashOps()
    if device == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return _CUDAFlashOps()
    return None


class BlockwiseFlashKernel(SDPAKernel):
    """SDPA plus an explicit backward for full causal attention (no window).

    A bottom-right causal block is a full block (the keys before the queries'
    own chunk) plus a square causal block (their own chunk): one fused flash
    call each, merged by log-sum-exp. Backward runs each block's fused
    backward against the MERGED output and log-sum-exp, which gives the exact
    gradient of the merged attention (ring-flash-attention's pattern).
    """

    def __init__(self, ops):
        self.ops = ops

    def explicit_backward(self, head_dim, window):
        """Whether ``forward``/``backward`` serve this layer: full causal
        attention (no window) at a head size the fused kernels take."""
        return window is None and self.ops.supports(head_dim)

    def forward(self, q, k, v, scale):
        q, k, v = _heads_first(q, k, v)
        out = lse = None
        for k_block, v_block, causal in _blocks(q, k, v):
            block_out, block_lse = self.ops.forward(q, k_block, v_block, causal, scale)
            out, lse = _merge(out, lse, block_out, block_lse)
        return out.to(q.dtype).transpose(1, 2), lse

    def backward(self, grad_out, q, k, v, out, lse, scale):
        rep = q.shape[2] // k.shape[2]
        q, k, v = _heads_first(q, k, v)
        grad_out, out = grad_out.transpose(1, 2), out.transpose(1, 2)
        lse = lse.to(self._lse_dtype(q))
        # The two blocks' query gradients add up in float32 (or wider), cast once.
        grad_q = torch.zeros_like(q, dtype=torch.promote_types(q.dtype, torch.float32))
        grad_k, grad_v = [], []
        for k_block, v_block, causal in _blocks(q, k, v):
            dq, dk, dv = self.ops.backward(grad_out, q, k_block, v_block, out, lse, causal, scale)
            grad_q += dq
            grad_k.append(dk)
            grad_v.append(dv)
        grad_k, grad_v = torch.cat(grad_k, dim=2), torch.cat(grad_v, dim=2)
        if rep > 1:  # fold the repeated key/value heads back onto their group
            grad_k = grad_k.unflatten(1, (-1, rep)).sum(2)
            grad_v = grad_v.unflatten(1, (-1, rep)).sum(2)
        return grad_q.to(q.dtype).transpose(1, 2), grad_k.transpose(1, 2), grad_v.transpose(1, 2)

    @staticmethod
    def _lse_dtype(q):
        return torch.promote_types(q.dtype, torch.float32) if q.device.type == "cpu" else torch.float32


def _heads_first(q, k, v):
    """``(B, L, h, d)`` -> ``(B, h, L, d)``, key/value heads repeated to the query heads."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return q, k, v


def _blocks(q, k, v):
    """The full block before the queries' own keys (if any), then the causal square."""
    prefix = k.shape[2] - q.shape[2]
    if prefix > 0:
        yield k[:, :, :prefix], v[:, :, :prefix], False
    yield k[:, :, prefix:], v[:, :, prefix:], True


def _merge(out, lse, block_out, block_lse):
    """Softmax-weighted union of two attention results over disjoint keys."""
    block_out = block_out.to(torch.promote_types(block_out.dtype, torch.float32))
    if out is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(block_lse - merged).unsqueeze(-1)
    return out, merged


def _log_sum_exp(q, k, scale, mask):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    return scores.masked_fill(~mask, float("-inf")).logsumexp(dim=-1)


class FlashKernel:
    """flash-attn 2 (CUDA, fp16/bf16): bottom-right causal alignment is native."""

    name = "flash"

    def __init__(self):
        from flash_attn import flash_attn_func

        self._flash_attn_func = flash_attn_func

    def attend(self, q, k, v, scale, window=None, with_lse=False):
        window_size = (-1, -1) if window is None else (window - 1, 0)
        out, lse, _ = self._flash_attn_func(q, k, v, softmax_scale=scale, causal=True, window_size=window_size,
                                            return_attn_probs=True)
        return out, lse if with_lse else None


def flash_unavailable_reason(device, dtype):
    """Why flash-attn cannot serve this device and dtype, or None if it can."""
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (pip install ds_tsp[flash] on a CUDA machine)"
    if torch.device(device).type != "cuda":
        return f"flash-attn needs a CUDA device, the model is on {torch.device(device).type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs float16 or bfloat16, the model is {dtype}"
    return None


_announced = set()


def select_kernel(backend, device, dtype):
    """The kernel for ``tsp.attention_backend``; ``auto`` prefers flash and says
    once in the log when it falls back to SDPA. Cached: every layer asks on
    every forward."""
    return _select_kernel(backend, torch.device(device).type, dtype)


@functools.lru_cache(maxsize=None)
def _select_kernel(backend, device, dtype):
    if backend not in BACKENDS:
        raise ValueError(f"tsp.attention_backend = {backend!r}: choose one of {BACKENDS}")
    reason = flash_unavailable_reason(device, dtype) if backend in ("auto", "flash") else None
    if backend == "flash" and reason:
        raise RuntimeError(f"tsp.attention_backend = \"flash\" cannot be used: {reason}; "
                           "set tsp.attention_backend to \"auto\" or \"sdpa\"")
    if backend == "sdpa" or reason:
        if backend == "auto" and reason not in _announced:
            _announced.add(reason)
            logger.info("tsp.attention_backend auto: using torch SDPA because %s", reason)
        ops = _flash_ops(device, dtype)
        return SDPAKernel() if ops is None else BlockwiseFlashKernel(ops)
    return FlashKernel()
