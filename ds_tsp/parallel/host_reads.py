"""Host reads: the one place ds_tsp waits for the accelerator to learn a tensor's values.

Reading a device tensor on the host (``.cpu()``, ``.item()``, ``.tolist()``,
``int(t)``) waits for every kernel queued before it. What the host must know
(a micro-batch's padding, documents and token routes, a mixture-of-experts
layer's split sizes, a check's verdict) is read through ``host_copy`` alone:
one device-to-host transfer for all the tensors it is given, counted in
``reads`` under the reason it names, so that a run can say how many reads a
step makes and why, and the NCCL-rules dry run (``tests/test_nccl_rules.py``)
can bound them. Tensors already on the host are returned as they are,
neither moved nor counted.
"""

from collections import Counter

import torch

# Device-to-host transfers by reason since the last ``reads.clear()``, as ``comm.counter`` counts bytes.
reads = Counter()


def host_copy(*tensors, reason):
    """Host copies of ``tensors`` (None stays None): those on an accelerator in
    one transfer, counted once under ``reason``; host tensors as they are."""
    on_device = [t for t in tensors if t is not None and t.device.type != "cpu"]
    if not on_device:
        return tensors
    reads[reason] += 1
    copies = iter(_transfer(on_device, reason))
    return tuple(t if t is None or t.device.type == "cpu" else next(copies) for t in tensors)


def host_read(tensor, reason):
    """The host copy of one ``tensor`` (``host_copy`` of it alone)."""
    return host_copy(tensor, reason=reason)[0]


def _transfer(tensors, reason):
    """CPU copies of device ``tensors`` in one copy: flattened into one buffer
    of their common dtype (int64 for integers and bools, float64 where any is
    floating) and split again on the host. ``reason`` is unused here; the
    NCCL-rules dry run, whose meta tensors hold no values, stands in for this
    function and answers by it."""
    dtypes = {t.dtype for t in tensors}
    wide = dtypes.pop() if len(dtypes) == 1 else (
        torch.float64 if any(t.is_floating_point() for t in tensors) else torch.int64)
    flat = torch.cat([t.reshape(-1).to(wide) for t in tensors]).cpu()
    return [piece.view(t.shape).to(t.dtype) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
