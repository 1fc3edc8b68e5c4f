"""Mamba-2's chunk maps (ds_tsp.blocks.linear.ssd, composed by chunk_maps) against the token-by-token
recurrence and Hugging Face's chunked scan, float64."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from ds_tsp.blocks.linear.chunk_maps import initial_states
from ds_tsp.blocks.linear.ssd import SSD, chunk_terms, run_chunks, span_map


def recurrence(q, k, v, a, state):
    """``S_t = exp(a_t) S_{t-1} + k_t^T v_t``, ``y_t = q_t S_t``: one token at a time (HF's selective state update)."""
    outputs = []
    for t in range(q.shape[2]):
        state = state * a[:, :, t].exp()[..., None, None] + k[:, :, t].unsqueeze(-1) * v[:, :, t].unsqueeze(-2)
        outputs.append((q[:, :, t].unsqueeze(-1) * state).sum(-2))
    return torch.stack(outputs, dim=2), state


def inputs(B=2, h=3, L=150, n=8, p=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, h, L, n, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, h, L, p, generator=gen, dtype=torch.float64)
    a = -F.softplus(torch.randn(B, h, L, generator=gen, dtype=torch.float64)) * 0.3
    return q, k, v, a


def _spans(tensors, bounds):
    return [[t[:, :, a:b] for t in tensors] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("cuts", [[150], [70, 80], [13, 40, 37, 60], [5, 5, 100, 40]])
def test_spans_run_from_composed_maps_equal_the_recurrence(cuts):
    """Spans (lengths not multiples of the chunk), each span's map from zero, composed prefixes as initial
    states: outputs and final state equal the recurrence's; ``T`` is one scalar a head."""
    tensors = inputs()
    start = torch.randn(2, 3, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected, final = recurrence(*tensors, start)
    bounds = torch.tensor([0] + cuts).cumsum(0).tolist()
    terms = [chunk_terms(*span, chunk_size=16) for span in _spans(tensors, bounds)]
    maps = [span_map(t) for t in terms]
    assert all(T.shape == (2, 3, 1, 1) for T, _ in maps)
    states, last = initial_states(maps, start, elementwise=True)
    out = torch.cat([run_chunks(t, s)[0] for t, s in zip(terms, states)], dim=2)
    diff, state_diff = (out - expected).abs().max().item(), (last - final).abs().max().item()
    print(f"spans {cuts}: max|out diff| {diff:.2e}, final state {state_diff:.2e}")
    assert diff < 1e-12 and state_diff < 1e-12


def test_documents_restart_the_state():
    """Packed documents (starts inside chunks and spans): each document's outputs equal its own recurrence
    from zero, and a span holding a start passes nothing of its incoming state on (``T`` = 0)."""
    tensors = inputs(L=100)
    starts = torch.zeros(2, 100, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, [9, 40, 41]] = True
    starts[1, [63]] = True
    bounds = [0, 30, 47, 100]
    terms = [chunk_terms(*span, chunk_size=16, starts=starts[:, a:b])
             for span, (a, b) in zip(_spans(tensors, bounds), zip(bounds, bounds[1:]))]
    maps = [span_map(t) for t in terms]
    states, _ = initial_states(maps, elementwise=True)
    out = torch.cat([run_chunks(t, s)[0] for t, s in zip(terms, states)], dim=2)
    worst = 0.0
    for row in range(2):
        edges = starts[row].nonzero().flatten().tolist() + [100]
        for a, b in zip(edges, edges[1:]):
            alone, _ = recurrence(*(t[row:row + 1, :, a:b] for t in tensors), torch.zeros(1, 3, 8, 6, dtype=torch.float64))
            worst = max(worst, (out[row:row + 1, :, a:b] - alone).abs().max().item())
    print(f"packed: max|diff| against each document alone {worst:.2e}")
    assert worst < 1e-12
    assert maps[0][0][0].abs().max() == 0 and maps[0][0][1].abs().max() == 0  # row 0 and 1 start in span 0


def test_a_wrong_map_is_caught():
    tensors = inputs()
    expected, _ = recurrence(*tensors, torch.zeros(2, 3, 8, 6, dtype=torch.float64))
    terms = [chunk_terms(*span, chunk_size=16) for span in _spans(tensors, [0, 70, 150])]
    maps = [span_map(t) for t in terms]
    maps[0] = (maps[0][0], maps[0][1] * 1.01)
    states, _ = initial_states(maps, elementwise=True)
    out = torch.cat([run_chunks(t, s)[0] for t, s in zip(terms, states)], dim=2)
    assert (out - expected).abs().max() > 1e-4


def test_one_span_is_hugging_faces_chunked_scan():
    """Against transformers' mamba2_chunk_scan (its torch path, which computes in float32 and takes
    ``x``, ``dt``, ``A``, ``B``, ``C`` by groups), run here in float64 by patching its float32 casts away:
    our terms of ``q = C``, ``k = B``, ``v = dt x``, ``a = dt A`` and its skip term equal it."""
    from transformers.models.mamba2 import modeling_mamba2

    gen = torch.Generator().manual_seed(3)
    B, L, h, p, groups, n = 2, 150, 4, 6, 2, 8
    x = torch.randn(B, L, h, p, generator=gen, dtype=torch.float64)
    dt = F.softplus(torch.randn(B, L, h, generator=gen, dtype=torch.float64))
    A = -torch.rand(h, generator=gen, dtype=torch.float64) - 0.2
    Bm, Cm = (torch.randn(B, L, groups, n, generator=gen, dtype=torch.float64) for _ in range(2))
    D = torch.randn(h, generator=gen, dtype=torch.float64)
    start = torch.randn(B, h, p, n, generator=gen, dtype=torch.float64)
    with mock.patch.object(torch.Tensor, "float", lambda t: t):  # HF's scan computes in float32; float64 here
        expected, final = modeling_mamba2.mamba2_chunk_scan(x, dt, A, Bm, Cm, chunk_size=32, D=D,
                                                            initial_states=start, return_final_states=True)

    def heads(t):  # (B, L, groups, n) -> (B, h, L, n)
        return t.repeat_interleave(h // groups, dim=2).transpose(1, 2)

    terms = chunk_terms(heads(Cm), heads(Bm), (x * dt[..., None]).transpose(1, 2), (dt * A).transpose(1, 2),
                        chunk_size=16)
    out, state = run_chunks(terms, start.transpose(-1, -2))
    out = out.transpose(1, 2) + x * D[:, None]
    diff, state_diff = (out - expected).abs().max().item(), (state.transpose(-1, -2) - final).abs().max().item()
    print(f"against HF's mamba2_chunk_scan (chunks 32 against 16): max|out diff| {diff:.2e}, state {state_diff:.2e}")
    assert diff < 1e-12 and state_diff < 1e-12


def test_spans_backward_from_transposed_maps_equals_autograd_of_the_recurrence():
    """``test_chunk_maps.spans_backward_diff`` of the SSD (its ``T`` elementwise)."""
    from test_chunk_maps import spans_backward_diff

    diff = spans_backward_diff(SSD, inputs(L=100), recurrence)
    print(f"max|grad diff| {diff:.2e}")
    assert diff < 1e-11
