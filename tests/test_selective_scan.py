"""Mamba-1's selective scan by spans (ds_tsp.blocks.linear.selective_scan) against the token recurrence, float64:
spans run from composed maps, document restarts and a wrong map."""

import pytest
import torch

from ds_tsp.blocks.linear.chunk_maps import initial_states
from ds_tsp.blocks.linear.selective_scan import SELECTIVE


def recurrence(decay, writes, C, state):
    """``S_t = decay_t * S_{t-1} + writes_t``, ``y_t = sum_s C_t[s] S_t[:, s]``: Hugging Face's loop."""
    outputs = []
    for t in range(decay.shape[2]):
        state = decay[:, :, t] * state + writes[:, :, t]
        outputs.append((state * C[:, :, t]).sum(-1))
    return torch.stack(outputs, dim=2), state


def inputs(B=2, d=3, L=150, n=8, seed=0):
    """Decays in (0.7, 1) for every channel and state entry, writes and read-outs (one a token, shared by the
    channels)."""
    gen = torch.Generator().manual_seed(seed)
    decay = 0.7 + 0.3 * torch.rand(B, d, L, n, generator=gen, dtype=torch.float64)
    writes = torch.randn(B, d, L, n, generator=gen, dtype=torch.float64)
    C = torch.randn(B, 1, L, n, generator=gen, dtype=torch.float64)
    return decay, writes, C


def zero_state(B=2, d=3, n=8):
    return torch.zeros(B, d, n, dtype=torch.float64)


def _spans(tensors, bounds):
    return [[t[:, :, a:b] for t in tensors] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("cuts", [[150], [70, 80], [13, 40, 37, 60]])
def test_spans_run_from_composed_maps_equal_the_recurrence(cuts):
    """Each span's map from zero, composed prefixes as initial states, each span run from its own: the whole
    sequence's outputs and final state."""
    full = inputs()
    expected, final = recurrence(*full, zero_state())
    bounds = [0, *torch.tensor(cuts).cumsum(0).tolist()]
    terms = [SELECTIVE.terms(*span) for span in _spans(full, bounds)]
    states, last = initial_states([SELECTIVE.span_map(t) for t in terms], elementwise=True)
    got = torch.cat([SELECTIVE.run(t, s)[0] for t, s in zip(terms, states)], dim=2)
    diff = max((got - expected).abs().max().item(), (last - final).abs().max().item())
    print(f"cuts {cuts}: max|diff| {diff:.2e}")
    assert diff < 1e-12


def test_a_document_start_forgets_the_state():
    """A token that starts a packed document takes no state from before it: the run of a row with a start at
    token 60 equals the two documents run alone."""
    decay, writes, C = inputs()
    starts = torch.zeros(2, 150, dtype=torch.bool)
    starts[:, 60] = True
    got, _ = SELECTIVE.run(SELECTIVE.terms(decay, writes, C, starts=starts), zero_state())
    first, _ = recurrence(decay[:, :, :60], writes[:, :, :60], C[:, :, :60], zero_state())
    second, _ = recurrence(decay[:, :, 60:], writes[:, :, 60:], C[:, :, 60:], zero_state())
    diff = (got - torch.cat([first, second], dim=2)).abs().max().item()
    print(f"document restart: max|diff| {diff:.2e}")
    assert diff < 1e-12


def test_a_wrong_map_is_caught():
    full = inputs()
    expected, _ = recurrence(*full, zero_state())
    terms = [SELECTIVE.terms(*span) for span in _spans(full, [0, 70, 150])]
    (T0, U0), later = SELECTIVE.span_map(terms[0]), SELECTIVE.span_map(terms[1])
    states, _ = initial_states([(T0, U0 * 1.01), later], elementwise=True)
    got = torch.cat([SELECTIVE.run(t, s)[0] for t, s in zip(terms, states)], dim=2)
    moved = (got - expected).abs().max().item()
    print(f"a map 1% off moves the outputs by {moved:.2e}")
    assert moved > 1e-4
