"""Mamba-1's selective scan as affine maps of its state (DESIGN.md 6n).

Per channel ``c`` the state is a vector over the ``n`` state entries, moved
token by token as ``S_t[c, s] = exp(dt_t[c] A[c, s]) S_{t-1}[c, s] +
dt_t[c] B_t[s] x_t[c]`` and read as ``y_t[c] = sum_s C_t[s] S_t[c, s]``: the
decay is one number a channel and state entry, so a span's map ``T`` is the
product of its tokens' decays, elementwise (``d x n`` a row, no ``n x n``
term), and ``U`` the state it writes from zero. The run from zero is Hugging
Face's ``mamba_selective_scan`` torch loop, token by token, once a span; a
span's run from its exact initial state adds that state decayed to each token
and read out. In the inputs' dtype (float32 or wider); the ``D`` skip term and
the gate are the caller's.

Shapes: ``decay`` (``exp(dt A)``) and ``writes`` (``dt B x``) ``(B, d, L, n)``,
``C`` ``(B, 1, L, n)``; states ``(B, d, n)``; outputs ``(B, d, L)``.
"""

import torch

from ds_tsp.blocks.linear.chunk_maps import ChunkRule


def scan_terms(decay, writes, C, chunk_size=None, starts=None):
    """A span's terms: its run from a zero state (Hugging Face's token loop:
    the outputs ``y0`` and the final state ``U``) and the running product of
    its decays, a document's first token forgetting the state it receives
    (``starts`` ``(B, L)`` bool, or None); ``C`` its read-outs. ``chunk_size``
    is the chunked rules'; the scan runs token by token."""
    if starts is not None:
        decay = decay * (~starts)[:, None, :, None].to(decay.dtype)
    state, outputs = torch.zeros_like(writes[:, :, 0]), []
    for t in range(decay.shape[2]):
        state = decay[:, :, t] * state + writes[:, :, t]
        outputs.append((state * C[:, :, t]).sum(-1))
    return {"decayed": decay.cumprod(dim=2), "C": C, "y0": torch.stack(outputs, dim=2), "U": state}


def run_scan(terms, state):
    """The span's outputs ``(B, d, L)`` and final state from the initial ``state`` ``(B, d, n)``: the run from
    zero plus the initial state decayed to each token and read out."""
    y = terms["y0"] + (terms["C"] * terms["decayed"] * state[:, :, None]).sum(-1)
    return y, terms["decayed"][:, :, -1] * state + terms["U"]


def span_map(terms):
    """``(T, U)`` of the span, each ``(B, d, n)``: the product of its decays and the state it writes from zero."""
    return terms["decayed"][:, :, -1], terms["U"]


def zero_state(terms):
    """The ``(B, d, n)`` state before a sequence."""
    return torch.zeros_like(terms["U"])


SELECTIVE = ChunkRule(scan_terms, run_scan, span_map, elementwise=True, zero_state=zero_state)
