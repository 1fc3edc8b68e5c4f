"""A recurrent layer's state moved by spans of tokens, as affine maps (DESIGN.md
6j, 6n): the exact pieces a TSP rank needs to run its own tokens from the true
initial state without waiting for the ranks before it.

Within a span the state ``S`` moves as ``S_out = T S_in + U`` and the span's
outputs are affine in ``S_in`` too. Each rank computes its spans' ``(T, U)``
from a zero state, the maps are exchanged, and each rank composes the maps of
the spans before its own to get their initial states, then runs its spans from
them. Only ``T``'s shape depends on the layer (a ``ChunkRule``): a dense matrix
acting on the state's rows (Gated DeltaNet's ``dk x dk``, ``delta_rule``), or
``elementwise``, a tensor broadcast against the state (Mamba-2's one scalar per
head, ``ssd``; Mamba-1's one decay a channel and state entry,
``selective_scan``). A composition keeps the shape, so the bytes of an elementwise
``T`` carry no ``dk x dk`` term.
"""

from typing import Callable, NamedTuple

import torch


class ChunkRule(NamedTuple):
    """One kind of recurrence, restated by spans: ``terms(*inputs, chunk_size=, starts=)``
    a span's chunk terms from its ``(B, h, L, ...)`` inputs (``starts`` ``(B, L)``:
    the tokens that start a packed document, where the state restarts, or None);
    ``run(terms, state)`` its outputs ``(B, h, L, dv)`` and final state from the
    initial ``state``; ``span_map(terms)`` its ``(T, U)``; ``elementwise``: how
    ``T`` acts on the state (``act``); ``zero_state(terms)`` the state before a
    sequence."""

    terms: Callable
    run: Callable
    span_map: Callable
    elementwise: bool
    zero_state: Callable


def act(T, state, elementwise):
    """``T S``: ``T`` broadcast against the state, or a matrix on its rows."""
    return T * state if elementwise else T @ state


def transposed(T, elementwise):
    """``T^T`` (an elementwise ``T`` is its own)."""
    return T if elementwise else T.transpose(-1, -2)


def compose(first, then, elementwise):
    """The map of ``first`` followed by ``then``: ``(T2 T1, T2 U1 + U2)``."""
    (T1, U1), (T2, U2) = first, then
    return act(T2, T1, elementwise), act(T2, U1, elementwise) + U2


def initial_states(maps, state=None, elementwise=False):
    """Every span's initial state, from the maps of the spans in sequence order
    and the first span's ``state`` (zero by default): the prefix compositions;
    and the state after the last span."""
    current = torch.zeros_like(maps[0][1]) if state is None else state
    states = []
    for T, U in maps:
        states.append(current)
        current = act(T, current, elementwise) + U
    return states, current


def state_gradients(local, maps, final=None, elementwise=False):
    """The gradient of every span's final state, the transpose of ``initial_states``:
    ``local[j]`` is what span ``j``'s own outputs give its initial state's
    gradient (``(d out_j / d S_j)^T grad out_j``), ``maps`` the spans' ``(T, U)``
    and ``final`` the last state's gradient (zero by default). The gradient of
    span ``j``'s initial state is ``local[j] + T_j^T G_j``, where ``G_j`` is that
    of its final state, the next span's initial one."""
    current = torch.zeros_like(local[-1]) if final is None else final
    finals = [None] * len(maps)
    for j in reversed(range(len(maps))):
        finals[j] = current
        current = local[j] + act(transposed(maps[j][0], elementwise), current, elementwise)
    return finals, current
