"""Activation checkpoints in host memory: each TSP layer's input waits for backward on the host.

With activation checkpointing a layer keeps only its input ``(B, S/D, H)``
for backward and recomputes the rest there. ``host_checkpoint`` keeps that
input in host memory instead of on the device: on CUDA it is copied to a
pinned buffer on a side stream while the next layers compute, and copied back
when the layer's backward starts, ordered after the first copy on the device
(the host never waits). With ``prefetch`` (``tsp.prefetch_checkpoints``; "auto": ``ds_tsp.runtime.prefetch``) the
layer before's input starts back on the side stream as soon as this layer's
backward starts, so that copy runs under this layer's recompute and backward,
for one more layer input on the device while it does. The recompute then runs
exactly as with on-device checkpoints, so offloading changes no number.

DeepSpeed's own ``activation_checkpointing.cpu_checkpointing`` does this only
together with ``partition_activations``, which splits checkpoints over the
model-parallel group; TSP ranks already hold different tokens, so ds_tsp
refuses that and serves ``cpu_checkpointing`` with this function instead.
"""

import functools
import weakref

import torch

from ds_tsp.parallel.eager import EagerFunction

_streams = {}
# Per device, the copy the last checkpointed forward made: the next one's ``previous``.
_last_copies = {}


def _side_stream(device):
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


class HostCopy:
    """A device tensor's copy in host memory; ``to_device`` brings it back.
    On CUDA the copy runs on a side stream into pinned memory, ordered after
    the work that produced the tensor; ``prefetch`` starts the copy back on the
    side stream, and ``to_device`` orders the current stream after whichever
    copy it needs. ``previous`` is a weak reference to the copy made just
    before this one (the layer below's), or None."""

    def __init__(self, tensor, previous=None):
        self.device, self.previous, self.back = tensor.device, previous, None
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

    def prefetch(self):
        """Start the copy back to the device on the side stream (CUDA only; once)."""
        if self.copied is None or self.back is not None:
            return
        stream = _side_stream(self.device)
        stream.wait_event(self.copied)
        with torch.cuda.stream(stream):
            tensor = self.host.to(self.device, non_blocking=True)
        self.back = tensor, stream.record_event()

    def to_device(self):
        if self.copied is None:
            return self.host.to(self.device, non_blocking=True)
        current = torch.cuda.current_stream(self.device)
        if self.back is None:
            current.wait_event(self.copied)
            return self.host.to(self.device, non_blocking=True)
        tensor, ready = self.back
        current.wait_event(ready)
        tensor.record_stream(current)  # made on the side stream, used on this one
        return tensor


# A layer that hands its keys and values to later layers (or takes an earlier one's), or takes a per-layer input,
# has a second output or input to differentiate, which a host checkpoint of one input and output would cut off.
HOST_CHECKPOINT_REFUSAL = ("activation_checkpointing.cpu_checkpointing keeps one input of a layer in host memory "
                           "and differentiates one output, but this model's layers take or give more (Gemma 4's keys "
                           "and values shared across layers, config.num_kv_shared_layers, or its per-layer inputs, "
                           "config.hidden_size_per_layer_input; a sparse attention's choice of keys shared across "
                           "layers, config.indexer_types \"shared\"): set cpu_checkpointing to false, with which "
                           "DeepSpeed's activation checkpointing recomputes its layers")


class _HostCheckpoint(EagerFunction):
    @staticmethod
    def forward(ctx, run, prefetch, hidden, *args):
        ctx.run, ctx.args = run, args
        ctx.needs_grad = hidden.requires_grad
        if callable(prefetch):  # tsp.prefetch_checkpoints "auto" (ds_tsp.runtime.prefetch)
            prefetch = prefetch(hidden)
        previous = _last_copies.get(hidden.device) if prefetch else None
        ctx.saved_hidden = HostCopy(hidden, previous)
        if prefetch:
            _last_copies[hidden.device] = weakref.ref(ctx.saved_hidden)
        with torch.no_grad():
            out = run(hidden, *args)
        if not torch.is_tensor(out):
            raise ValueError(HOST_CHECKPOINT_REFUSAL)
        return out

    @staticmethod
    def backward(ctx, grad):
        copy, ctx.saved_hidden = ctx.saved_hidden, None
        hidden = copy.to_device().requires_grad_(ctx.needs_grad)
        below = copy.previous() if copy.previous is not None else None
        if below is not None:  # the layer whose backward runs next
            below.prefetch()
        with torch.enable_grad():
            out = ctx.run(hidden, *ctx.args)
        # Backward starts from the output's place in the graph: the recomputed
        # output itself is not needed and is freed before the layer's backward runs.
        edge = torch.autograd.graph.get_gradient_edge(out)
        del out
        torch.autograd.backward(edge, grad)
        return None, None, hidden.grad, *(None for _ in ctx.args)


def host_checkpoint(run, hidden, *args, prefetch=False):
    """``run(hidden, *args)`` as an activation checkpoint whose saved input is
    ``hidden`` in host memory (the ``gradient_checkpointing_func`` of a TSP
    layer). ``args`` (the rotary tables, the documents) are not
    differentiated and stay where they are: every layer shares them; one
    that needs a gradient is refused (``HOST_CHECKPOINT_REFUSAL``).
    ``prefetch``: bring the layer below's input back under this layer's
    backward; a callable decides it from ``hidden`` (``ds_tsp.runtime.prefetch``)."""
    if any(torch.is_tensor(arg) and arg.requires_grad for arg in args):
        raise ValueError(HOST_CHECKPOINT_REFUSAL)
    return _HostCheckpoint.apply(run, prefetch, hidden, *args)


def host_checkpoint_function(prefetch):
    """The ``gradient_checkpointing_func`` for ``cpu_checkpointing`` (``tsp.prefetch_checkpoints``)."""
    return functools.partial(host_checkpoint, prefetch=prefetch) if prefetch else host_checkpoint
