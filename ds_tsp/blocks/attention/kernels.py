"""Local attention kernels behind one small interface.

``kernel.attend(q, k, v, scale, window, with_lse)`` takes queries ``(B, Lq, hq, d)`` that
are the LAST ``Lq`` positions of the keys ``(B, Lk, hkv, d)`` (bottom-right
causal alignment: query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``, and
``j > i + Lk - Lq - window`` with a sliding window) and returns the output
``(B, Lq, hq, d)`` and, when ``with_lse``, the log-sum-exp ``(B, hq, Lq)`` in
float32 (else None). The output is differentiable by autograd; the log-sum-exp
is for merging partial attention (decoding), not for training. ``hkv`` may
divide ``hq`` (grouped-query).

Every kernel also takes ``ahead`` (an int, ``documents.Block.ahead``): the
queries then sit ``ahead`` keys before the end of the keys and see every key
(a bidirectional block: Gemma 3's image tokens), within the window if any.

For training, a kernel may also offer ``explicit_backward(head_dim, window)`` and then
``forward(q, k, v, scale) -> (out, lse)`` and ``backward(grad_out, q, k, v,
out, lse, scale) -> (dq, dk, dv)``: the TSP backward then saves the output and
log-sum-exp of the local queries and runs the fused backward directly, instead
of recomputing the attention forward under autograd.

Backends (``tsp.attention_backend``), each with that explicit backward for full
causal attention:

* ``"sdpa"``: torch's fused flash ops (CPU: every float dtype; CUDA: fp16/bf16),
  else ``F.scaled_dot_product_attention``;
* ``"cudnn"``: torch's cuDNN attention ops (CUDA, fp16/bf16);
* ``"flash"``: flash-attn 2's own forward and backward with the log-sum-exp.

Which of them serves a layer, and ``"auto"``'s choice among them, is
``ds_tsp.blocks.attention.selection``.
"""

import functools
import inspect
import logging

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

logger = logging.getLogger("ds_tsp")


def bottom_right_causal_mask(q_len, k_len, window=None, device=None, ahead=None):
    """``(Lq, Lk)`` bool, True where a query may attend to a key; with
    ``ahead`` (a bidirectional block) every key within the window."""
    q_pos = torch.arange(q_len, device=device).unsqueeze(1) + (k_len - q_len - (ahead or 0))
    k_pos = torch.arange(k_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos if ahead is None else torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


class SDPAKernel:
    """torch's ``scaled_dot_product_attention``: runs on every device and dtype."""

    name = "sdpa"

    def attend(self, q, k, v, scale, window=None, with_lse=False, ahead=None):
        q_len, k_len = q.shape[1], k.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, L, d)
        mask, causal = None, ahead is None
        if window is not None or (causal and q_len != k_len):
            # No boolean mask where a causal flag serves, and whole heads where a mask or flag goes in: on CUDA
            # the memory-efficient kernel, which serves them beyond flash's reach (float32, windows), takes no
            # grouped heads, and SDPA would fall back to the math kernel (full score matrices) without a word.
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            mask = (causal_lower_right(q_len, k_len) if window is None
                    else bottom_right_causal_mask(q_len, k_len, window, q.device, ahead))
            causal = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        lse = None
        if with_lse:
            # SDPA does not return it; materialising the scores is fine for the
            # short query blocks of decoding, which is the only user.
            with torch.no_grad():
                lse = _log_sum_exp(q, k, scale, bottom_right_causal_mask(q_len, k_len, window, q.device, ahead))
        return out.transpose(1, 2), lse


class SoftCappedKernel:
    """Attention whose scores are soft-capped, ``cap * tanh(scores / cap)``,
    before the mask (Gemma-2's ``attn_logit_softcapping``). torch's fused
    kernels take no cap, so a block's scores are materialised (a query tile by
    the keys it sees: ``tsp.token_tile`` bounds them) and autograd runs the
    backward; the softmax runs in float32 or wider."""

    name = "softcap"

    def __init__(self, cap):
        self.cap = cap

    def attend(self, q, k, v, scale, window=None, with_lse=False, ahead=None):
        acc = torch.promote_types(q.dtype, torch.float32)
        q_len, k_len = q.shape[1], k.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, L, d)
        repeats = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale / self.cap) * self.cap
        scores = scores.masked_fill(~bottom_right_causal_mask(q_len, k_len, window, q.device, ahead), float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
        lse = scores.detach().logsumexp(dim=-1) if with_lse else None
        return out.transpose(1, 2), lse


class SinkKernel:
    """Attention with a learned sink logit per query head (GPT-OSS's
    ``sinks``): one more softmax column with no value, so each query row's
    weights sum to ``Z / (Z + exp(s_h))`` (DESIGN.md 6h).

    Over a ``base`` kernel with an explicit backward (full causal layers), the
    sink is applied after it: ``o = o' sigmoid(lse' - s)`` and the row's
    log-sum-exp becomes ``logaddexp(lse', s)``; the base's backward given that
    output and log-sum-exp is the exact backward of the sink attention (the
    sink column has no value, so it only enters through the row's
    normaliser), and the sinks' gradient is ``sink_gradient``. Elsewhere
    (sliding windows, or a base without that backward) ``attend`` materialises
    a block's scores (a query tile by the keys it sees: ``tsp.token_tile``
    bounds them) with the sink column, softmaxes in float32 or wider, and
    autograd runs the backward, the sinks' included."""

    name = "sinks"

    def __init__(self, base=None):
        self.base = base

    def explicit_backward(self, head_dim, window):
        return hasattr(self.base, "explicit_backward") and self.base.explicit_backward(head_dim, window)

    def forward(self, q, k, v, scale, sinks=None, **ahead):
        out, lse = self.base.forward(q, k, v, scale, **ahead)  # (B, L, h, d), (B, h, L)
        s = sinks.to(lse.dtype).view(1, -1, 1)
        kept = torch.sigmoid(lse - s).transpose(1, 2).unsqueeze(-1)  # (B, L, h, 1)
        return (out * kept.to(out.dtype)).to(out.dtype), torch.logaddexp(lse, s.expand_as(lse))

    def backward(self, grad_out, q, k, v, out, lse, scale, **ahead):
        return self.base.backward(grad_out, q, k, v, out, lse, scale, **ahead)

    @staticmethod
    def sink_gradient(grad_out, out, lse, sinks):
        """``(h,)``: the sinks' gradient from a block's output gradient and the
        output and log-sum-exp ``forward`` returned: ``-sum over rows of
        exp(s - lse) (dO . o)``, in float32 or wider."""
        acc = torch.promote_types(lse.dtype, torch.float32)
        row = (grad_out.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # (B, h, L)
        weight = torch.exp(sinks.to(acc).view(1, -1, 1) - lse.to(acc))
        return -(weight * row).sum(dim=(0, 2))

    def attend(self, q, k, v, scale, window=None, with_lse=False, sinks=None, ahead=None):
        acc = torch.promote_types(q.dtype, torch.float32)
        q_len, k_len = q.shape[1], k.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, L, d)
        repeats = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale
        scores = scores.masked_fill(~bottom_right_causal_mask(q_len, k_len, window, q.device, ahead), float("-inf"))
        sink_column = sinks.to(acc).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        combined = torch.cat([scores, sink_column], dim=-1)
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        out = torch.matmul(probs.to(v.dtype), v)
        lse = combined.detach().logsumexp(dim=-1) if with_lse else None
        return out.transpose(1, 2), lse


# ---- torch's fused ops, as (B, h, L, d) blocks with top-left causal masks ----

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


@functools.lru_cache(maxsize=None)
def _unused_rng_state(device, dtype, shape):
    """Dropout seed/offset for backward ops that take one: without dropout it is
    never read, so one tensor per device serves every call (no fill per call)."""
    return torch.zeros(shape, dtype=dtype, device=device)


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
        seed, offset = _unused_rng_state(q.device, torch.uint64, (2,)), _unused_rng_state(q.device, torch.uint64, ())
        # Strided slices of longer tensors are fine (the kernel needs a unit
        # last stride and makes grad_out and out dense itself), but it reads
        # the log-sum-exp as a dense (B, h, Lq) array.
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
            scale=scale)


class CUDNNOps:
    """torch's cuDNN attention ops (CUDA, float16/bfloat16, head size <= 128)."""

    def __init__(self):
        # torch versions return the log-sum-exp as (B, h, Lq) or (B, h, Lq, 1);
        # the backward gets it back in the shape the forward gave.
        self._lse_has_unit_dim = False

    def supports(self, head_dim):
        return head_dim <= 128 and head_dim % 8 == 0

    def forward(self, q, k, v, causal, scale):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                          scale=scale)
        self._lse_has_unit_dim = lse.dim() == 4
        return out, lse.squeeze(-1) if self._lse_has_unit_dim else lse

    def backward(self, grad_out, q, k, v, out, lse, causal, scale):
        seed = offset = _unused_rng_state(q.device, torch.int64, ())
        lse = lse.contiguous()  # read as a dense array, like the flash kernels
        if self._lse_has_unit_dim:
            lse = lse.unsqueeze(-1)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse, seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, causal,
            scale=scale)


def flash_ops(device, dtype):
    device = torch.device(device).type
    if device == "cpu":
        return _CPUFlashOps()
    if device == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return _CUDAFlashOps()
    return None


class BlockwiseFlashKernel(SDPAKernel):
    """SDPA plus an explicit backward for full causal attention (no window),
    over torch's fused ops (``ops``), whose causal mask is top-left aligned.

    A bottom-right causal block is a full block (the keys before the queries'
    own chunk) plus a square causal block (their own chunk): one fused call
    each, merged by log-sum-exp; a bidirectional block is one full call. Backward runs each block's fused backward
    against the MERGED output and log-sum-exp, which gives the exact gradient
    of the merged attention (ring-flash-attention's pattern).
    """

    def __init__(self, ops, name="sdpa"):
        self.ops, self.name = ops, name

    def explicit_backward(self, head_dim, window):
        """Whether ``forward``/``backward`` serve this layer: full causal
        attention (no window) at a head size the fused kernels take."""
        return window is None and self.ops.supports(head_dim)

    def forward(self, q, k, v, scale, ahead=None):
        q, k, v = _heads_first(q, k, v, takes_grouped_query(self.ops, q.device, q.dtype))
        out = lse = None
        for k_block, v_block, causal in _blocks(q, k, v, ahead):
            block_out, block_lse = self.ops.forward(q, k_block, v_block, causal, scale)
            out, lse = _merge(out, lse, block_out, block_lse)
        return out.to(q.dtype).transpose(1, 2), lse

    def backward(self, grad_out, q, k, v, out, lse, scale, ahead=None):
        grouped_query = takes_grouped_query(self.ops, q.device, q.dtype)
        rep = 1 if grouped_query else q.shape[2] // k.shape[2]
        q, k, v = _heads_first(q, k, v, grouped_query)
        grad_out, out = grad_out.transpose(1, 2), out.transpose(1, 2)
        lse = lse.to(self._lse_dtype(q))
        grads = [self.ops.backward(grad_out, q, k_block, v_block, out, lse, causal, scale)
                 for k_block, v_block, causal in _blocks(q, k, v, ahead)]
        grad_q = grads[0][0]
        if len(grads) == 2:  # the blocks' query gradients add up in float32 (or wider), cast once
            grad_q = (grad_q.to(torch.promote_types(q.dtype, torch.float32)) + grads[1][0]).to(q.dtype)
        grad_k = _cat([_fold_heads(dk, rep) for _, dk, _ in grads], dim=2)
        grad_v = _cat([_fold_heads(dv, rep) for _, _, dv in grads], dim=2)
        return grad_q.transpose(1, 2), grad_k.transpose(1, 2), grad_v.transpose(1, 2)

    @staticmethod
    def _lse_dtype(q):
        return torch.promote_types(q.dtype, torch.float32) if q.device.type == "cpu" else torch.float32


_GROUPED_QUERY = {}  # (ops type, device, dtype) -> takes_grouped_query's answer


def takes_grouped_query(ops, device, dtype):
    """Whether ``ops`` (torch's fused flash or cuDNN ops) take fewer key/value
    heads than query heads, forward and backward (dK/dV per key/value head),
    and give the numbers that repeating the key/value heads gives; if not, the
    kernel repeats them (one copy of K and V per call). Probed once per ops
    type, device and dtype on a small causal problem (one host read, at first
    use), so a kernel that refuses, or pairs query heads with the wrong
    key/value heads, is never used that way."""
    key = (type(ops), torch.device(device), dtype)
    if key not in _GROUPED_QUERY:
        _GROUPED_QUERY[key] = _grouped_query_matches_repeated(ops, torch.device(device), dtype)
    return _GROUPED_QUERY[key]


@torch.no_grad()
def _grouped_query_matches_repeated(ops, device, dtype):
    # Two query heads per key/value head and two key/value heads (so repeating and tiling differ), in a few
    # KiB: a first training step's peak does not notice.
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, heads, 8, 64, generator=generator).to(device, dtype) for heads in (4, 2, 2, 4))
    scale = 64 ** -0.5
    try:
        out, lse = ops.forward(q, k, v, True, scale)
        grads = ops.backward(grad, q, k, v, out, lse, True, scale)
    except (RuntimeError, ValueError, TypeError, NotImplementedError, IndexError):
        return False
    k_all, v_all = (t.repeat_interleave(2, dim=1) for t in (k, v))
    ref_out, ref_lse = ops.forward(q, k_all, v_all, True, scale)
    ref_dq, ref_dk, ref_dv = ops.backward(grad, q, k_all, v_all, ref_out, ref_lse, True, scale)
    expected = (ref_out, ref_dq, _fold_heads(ref_dk, 2), _fold_heads(ref_dv, 2))
    # The same kernel either way: only the order of the key/value heads' gradient sums differs.
    tolerance = 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2
    return all(a.shape == b.shape and (a.float() - b.float()).abs().max() <= tolerance * b.float().abs().max()
               for a, b in zip((out, *grads), expected))


def _heads_first(q, k, v, grouped_query):
    """``(B, L, h, d)`` -> ``(B, h, L, d)``; key/value heads repeated to the
    query heads unless the kernel takes them ``grouped_query``."""
    rep = 1 if grouped_query else q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return q, k, v


def _fold_heads(grad, rep):
    """Gradient of repeated key/value heads ``(B, hq, L, d)`` summed back onto their group."""
    return grad if rep == 1 else grad.unflatten(1, (-1, rep)).sum(2)


def _cat(pieces, dim):
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _blocks(q, k, v, ahead=None):
    """The full block before the queries' own keys (if any), then the causal
    square; a bidirectional block (``ahead`` given) whole, as one full block."""
    if ahead is not None:
        yield k, v, False
        return
    prefix = k.shape[2] - q.shape[2]
    if prefix > 0:
        yield k[:, :, :prefix], v[:, :, :prefix], False
    yield k[:, :, prefix:], v[:, :, prefix:], True


def _merge(out, lse, block_out, block_lse):
    """Softmax-weighted union of two attention results over disjoint keys; a
    single block passes through in its own dtype, a merge is float32 or wider."""
    if out is None:
        return block_out, block_lse
    acc = torch.promote_types(out.dtype, torch.float32)
    merged = torch.logaddexp(lse, block_lse)
    share = torch.exp(block_lse - merged).unsqueeze(-1).to(acc)  # the new block's softmax mass
    return torch.lerp(out.to(acc), block_out.to(acc), share), merged


def _log_sum_exp(q, k, scale, mask):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    return scores.masked_fill(~mask, float("-inf")).logsumexp(dim=-1)


# ---- flash-attn ----

class _FlashAttnLSE:
    """flash-attn's ``_flash_attn_forward`` / ``_flash_attn_backward`` (what its
    own autograd Function calls), by keyword: 2.5 takes ``window_size``, 2.6
    adds ``softcap``, 2.6.3+ splits the window into ``window_size_left/right``
    and returns 4 values instead of 8. Bottom-right causal alignment and
    grouped-query heads are native, so one call serves a whole block."""

    # Everything these functions took in 2.5-2.8, with the values for dense,
    # full causal attention without dropout; the per-call tensors are added.
    FIXED = {"dropout_p": 0.0, "causal": True, "window_size": (-1, -1), "window_size_left": -1,
             "window_size_right": -1, "softcap": 0.0, "alibi_slopes": None, "return_softmax": False,
             "deterministic": False, "rng_state": None}
    # What must be there for the call to mean what ds_tsp asks.
    FORWARD = ("q", "k", "v", "softmax_scale", "causal")
    BACKWARD = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "softmax_scale", "causal")

    def __init__(self, forward, backward, parameters):
        self._forward, self._backward = forward, backward
        self._parameters = parameters  # {"_flash_attn_forward": names, "_flash_attn_backward": names}

    @classmethod
    def load(cls, module):
        """The API of flash-attn's ``flash_attn_interface`` ``module``, or None
        and why ds_tsp cannot call it."""
        functions, parameters = {}, {}
        for name, own in (("_flash_attn_forward", cls.FORWARD), ("_flash_attn_backward", cls.BACKWARD)):
            functions[name] = getattr(module, name, None)
            if functions[name] is None:
                return None, f"flash-attn has no {name}"
            names = parameters[name] = _parameter_names(functions[name])
            if names is None:
                return None, f"the parameters of flash-attn's {name} cannot be read"
            unknown = [n for n, required in names.items() if required and n not in own + tuple(cls.FIXED)]
            missing = [n for n in own if n not in names]
            if unknown or missing:
                return None, (f"flash-attn's {name} takes {list(names)}, not the 2.5-2.8 parameters ds_tsp knows "
                              f"(unknown {unknown}, missing {missing})")
        return cls(*functions.values(), parameters), None

    def forward(self, q, k, v, scale, causal=True):
        outputs = self._forward(**self._arguments("_flash_attn_forward", q=q, k=k, v=v, softmax_scale=scale,
                                                  causal=causal))
        if len(outputs) == 8:  # out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state
            return outputs[0], outputs[5]
        if len(outputs) == 4:  # out_padded, softmax_lse, S_dmask, rng_state
            return outputs[0], outputs[1]
        raise RuntimeError(f"flash-attn's _flash_attn_forward returned {len(outputs)} values; ds_tsp knows 8 "
                           "(flash-attn < 2.6.3) and 4")

    def backward(self, grad_out, q, k, v, out, lse, scale, causal=True):
        # Filled in place; the kernel reads the log-sum-exp as a dense array.
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._backward(**self._arguments("_flash_attn_backward", dout=grad_out, q=q, k=k, v=v, out=out,
                                         softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv, softmax_scale=scale,
                                         causal=causal))
        return dq, dk, dv

    def _arguments(self, function, **tensors):
        """The keyword arguments ``function`` takes, of the fixed ones and ``tensors``."""
        return {name: value for name, value in {**self.FIXED, **tensors}.items() if name in self._parameters[function]}


def _parameter_names(fn):
    """``{name: required}`` of ``fn``'s parameters, or None if they cannot be
    read. ``torch.library.custom_op`` (flash-attn 2.6.3+ on torch >= 2.4) wraps
    the Python function as ``_init_fn``, behind a ``(*args, **kwargs)`` call."""
    try:
        parameters = inspect.signature(getattr(fn, "_init_fn", fn)).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return None
    return {p.name: p.default is p.empty for p in parameters}


class FlashKernel:
    """flash-attn 2 (CUDA, fp16/bf16): bottom-right causal alignment, grouped-query
    heads and sliding windows are native."""

    name = "flash"

    def __init__(self, interface=None):
        """``interface``: flash-attn's ``flash_attn_interface`` module (imported if None)."""
        if interface is None:
            from flash_attn import flash_attn_interface as interface
        self._flash_attn_func = interface.flash_attn_func
        self._lse_api, reason = _FlashAttnLSE.load(interface)
        if reason:
            logger.warning("tsp.attention_backend flash: %s; attention backward recomputes the forward", reason)

    def explicit_backward(self, head_dim, window):
        """Full causal attention at a head size flash-attn takes unpadded."""
        return self._lse_api is not None and window is None and head_dim % 8 == 0 and head_dim <= 256

    def attend(self, q, k, v, scale, window=None, with_lse=False, ahead=None):
        # flash-attn's window counts from the bottom-right diagonal: a bidirectional block's queries sit `ahead`
        # keys before it and see every key after them.
        window_size = (-1, -1) if window is None else (window - 1 + (ahead or 0), 0 if ahead is None else -1)
        out, lse, _ = self._flash_attn_func(q, k, v, softmax_scale=scale, causal=ahead is None,
                                            window_size=window_size, return_attn_probs=True)
        return out, lse if with_lse else None

    def forward(self, q, k, v, scale, ahead=None):
        return self._lse_api.forward(q, k, v, scale, causal=ahead is None)

    def backward(self, grad_out, q, k, v, out, lse, scale, ahead=None):
        return self._lse_api.backward(grad_out, q, k, v, out, lse, scale, causal=ahead is None)


