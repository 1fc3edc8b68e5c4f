"""The dtype policy of TSP's sums: partial products and sums over ranks, ring
steps and tiles run in float32 or wider and are rounded once, as the
unsharded model's single matmul is; parameter-gradient partials travel in the
wire dtype DeepSpeed's ``communication_data_type`` names."""

import functools

import torch


def accumulation_dtype(dtype):
    """float32, or ``dtype`` where that is wider (float64 stays float64): what
    sums over ranks, ring steps and head groups run in."""
    return torch.promote_types(dtype, torch.float32)


def gradient_wire_dtype(wire_dtype, dtype):
    """The dtype in which TSP's parameter-gradient partial sums of a ``dtype``
    model travel between ranks (the attention's weight-gradient reduces, the
    rings' gradient accumulators): ``wire_dtype`` where one is set (DeepSpeed's
    ``communication_data_type``, when the config names it), else the
    accumulation dtype. A float64 model keeps float64 whatever ``wire_dtype``
    says: it is run for its precision (the parity tests)."""
    acc = accumulation_dtype(dtype)
    return acc if wire_dtype is None or acc == torch.float64 else wire_dtype


def partial_matmul(a, b, out=None, add=True):
    """``a @ b`` with its sum over the inner dimension returned in float32 (or
    wider) and not rounded to ``a``'s dtype: a partial gradient that is summed
    over ranks, ring steps or tiles afterwards, so that the whole sum is rounded
    once, as the unsharded model's single matmul is. On CUDA the product still
    runs on bf16/fp16 tensor cores (``out_dtype``); elsewhere the inputs are
    widened first. With ``out`` (that wider dtype) the product is added into it
    in place, or written to it when not ``add`` (in the matmul itself where the
    dtypes allow), and ``out`` returned."""
    acc = accumulation_dtype(a.dtype)
    if acc == a.dtype:
        if out is None:
            return a @ b
        return out.addmm_(a, b) if add else torch.mm(a, b, out=out)
    if _mm_out_dtype_works(a.device, a.dtype, acc):
        product = torch.mm(a, b, out_dtype=acc)
    else:
        product = a.to(acc) @ b.to(acc)
    if out is None:
        return product
    return out.add_(product) if add else out.copy_(product)


def add_matmul(total, a, b, add=True):
    """``total += a @ b`` in place (``total = a @ b`` when not ``add``), the sum
    fused into the matmul where the dtypes agree; otherwise the product, in
    ``a``'s dtype, is widened on the add. Returns ``total``."""
    if total.dtype == a.dtype:
        return total.addmm_(a, b) if add else torch.mm(a, b, out=total)
    product = a @ b
    return total.add_(product) if add else total.copy_(product)


@functools.lru_cache(maxsize=None)
def _mm_out_dtype_works(device, dtype, out_dtype):
    """Whether ``torch.mm(..., out_dtype=)`` runs here (CUDA builds of torch >= 2.8)."""
    if device.type != "cuda":
        return False
    try:
        torch.mm(torch.ones(1, 1, dtype=dtype, device=device), torch.ones(1, 1, dtype=dtype, device=device),
                 out_dtype=out_dtype)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True
