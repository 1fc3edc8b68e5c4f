"""What ds_tsp's autograd Functions do under ``torch.autocast``.

Every Function declares it with ``autocast_forward`` / ``autocast_backward``:
the matmul-heavy ones (attention, the MLP ring, the fused LM head and loss)
cast their inputs to the autocast dtype and run as a model of that dtype
would, with their float32 sums kept; lookups and collectives run in their
inputs' dtypes, as the ops they stand for do under autocast.
"""

import functools

import torch


def _autocast_on(device_type):
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def compute_dtype(tensor):
    """The dtype a matmul of ``tensor`` runs in: the autocast dtype where
    autocast is on for its device and would cast it (floating, not float64),
    else its own."""
    if tensor.is_floating_point() and tensor.dtype != torch.float64 and _autocast_on(tensor.device.type):
        return torch.get_autocast_dtype(tensor.device.type)
    return tensor.dtype


def autocast_forward(cast_inputs, keep=(), keep_from=None):
    """``torch.amp.custom_fwd`` for Functions that run on any device and under
    any autocast dtype (``custom_fwd`` fixes both when it decorates).

    Under autocast on the device of the first tensor argument, ``forward``
    runs with autocast off; with ``cast_inputs`` its floating tensor arguments
    are first cast to the autocast dtype, as autocast casts a linear layer's
    (float64 left alone, as autocast does), so the matmuls inside run in that
    dtype with the sums in float32 that the code keeps. Autograd hands each
    gradient back in its input's dtype, so float32 parameters get float32
    gradients. Without ``cast_inputs`` the Function runs in its inputs'
    dtypes, as the ops it stands for (lookups, collectives) do under
    autocast. ``keep``: the positions (after ``ctx``) of arguments that stay
    in their dtype even with ``cast_inputs`` (float32 statistics a norm
    applies, as Hugging Face's norms compute in float32 under autocast);
    ``keep_from``: the position from which every argument stays (a Function's
    trailing ``*tensors``). Pair with ``autocast_backward``."""

    def decorate(forward):
        @functools.wraps(forward)
        def wrapped(ctx, *args):
            device_type = next(arg for arg in args if isinstance(arg, torch.Tensor)).device.type
            ctx.autocast_device_type = device_type
            if not _autocast_on(device_type):
                return forward(ctx, *args)
            if cast_inputs:
                kept = set(keep) | set(range(len(args) if keep_from is None else keep_from, len(args)))
                args = [arg.to(compute_dtype(arg)) if isinstance(arg, torch.Tensor) and index not in kept else arg
                        for index, arg in enumerate(args)]
            with torch.autocast(device_type, enabled=False):
                return forward(ctx, *args)

        return wrapped

    return decorate


def autocast_backward(backward):
    """``torch.amp.custom_bwd`` to ``autocast_forward``: backward runs with
    autocast off, on the dtypes forward saved, even when called inside an
    autocast region."""

    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        if not _autocast_on(ctx.autocast_device_type):
            return backward(ctx, *grads)
        with torch.autocast(ctx.autocast_device_type, enabled=False):
            return backward(ctx, *grads)

    return wrapped
