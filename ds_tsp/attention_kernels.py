"""Local attention kernels behind one small interface.

``kernel.attend(q, k, v, scale, window, with_lse)`` takes queries ``(B, Lq, hq, d)`` that
are the LAST ``Lq`` positions of the keys ``(B, Lk, hkv, d)`` (bottom-right
causal alignment: query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``, and
``j > i + Lk - Lq - window`` with a sliding window) and returns the output
``(B, Lq, hq, d)`` and, when ``with_lse``, the log-sum-exp ``(B, hq, Lq)`` in
float32 (else None). The output is differentiable by autograd; the log-sum-exp
is for merging partial attention (decoding), not for training. ``hkv`` may divide ``hq`` (grouped-query).
"""

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
    once in the log when it falls back to SDPA."""
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
        return SDPAKernel()
    return FlashKernel()
