"""Activation checkpoints in host memory: each TSP layer's input waits for backward on the host.

With activation checkpointing a layer keeps only its input ``(B, S/D, H)``
for backward and recomputes the rest there. ``host_checkpoint`` keeps that
input in host memory instead of on the device: on CUDA it is copied to a
pinned buffer on a side stream while the next layers compute, and copied back
when the layer's backward starts. The recompute then runs exactly as with
on-device checkpoints, so offloading changes no number.

DeepSpeed's own ``activation_checkpointing.cpu_checkpointing`` does this only
together with ``partition_activations``, which splits checkpoints over the
model-parallel group; TSP ranks already hold different tokens, so ds_tsp
refuses that and serves ``cpu_checkpointing`` with this function instead.
"""

import torch

_streams = {}


def _side_stream(device):
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


class HostCopy:
    """A device tensor's copy in host memory; ``to_device`` brings it back.
    On CUDA the copy runs on a side stream into pinned memory, ordered after
    the work that produced the tensor; ``to_device`` waits for it."""

    def __init__(self, tensor):
        self.device = tensor.device
        if tensor.device.type != "cuda":
            self.host, self.copied = tensor.detach().to("cpu", copy=True), None
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        stream = _side_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            self.host.copy_(tensor.detach(), non_blocking=True)
        tensor.record_stream(stream)  # its memory is not reused before the copy ends
        self.copied = stream.record_event()

    def to_device(self):
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.to(self.device, non_blocking=True)


class _HostCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, hidden, *args):
        ctx.run, ctx.args = run, args
        ctx.needs_grad = hidden.requires_grad
        ctx.saved_hidden = HostCopy(hidden)
        with torch.no_grad():
            return run(hidden, *args)

    @staticmethod
    def backward(ctx, grad):
        hidden = ctx.saved_hidden.to_device().requires_grad_(ctx.needs_grad)
        ctx.saved_hidden = None
        with torch.enable_grad():
            out = ctx.run(hidden, *ctx.args)
        torch.autograd.backward(out, grad)
        return None, hidden.grad, *(None for _ in ctx.args)


def host_checkpoint(run, hidden, *args):
    """``run(hidden, *args)`` as an activation checkpoint whose saved input is
    ``hidden`` in host memory (the ``gradient_checkpointing_func`` of a TSP
    layer). ``args`` (the rotary tables, the documents) are not
    differentiated and stay where they are: every layer shares them."""
    return _HostCheckpoint.apply(run, hidden, *args)
