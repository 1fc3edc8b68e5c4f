"""Gated DeltaNet's chunk maps (ds_tsp.blocks.linear.delta_rule, composed by chunk_maps) against the token-by-token recurrence, float64."""

import functools

import pytest
import torch
import torch.nn.functional as F

from float32_control import float32_bound
from ds_tsp.blocks.linear.chunk_maps import initial_states, state_gradients
from ds_tsp.blocks.linear.delta_rule import GATED_DELTA, chunk_terms, run_chunks, span_map


def recurrence(q, k, v, g, beta, state):
    """Hugging Face's torch_recurrent_gated_delta_rule (or, with a decay per key channel ``g`` ``(B, h, L, dk)``,
    recurrent_kimi_delta_attention), in the inputs' dtype: one token at a time."""
    outputs = []
    for t in range(q.shape[2]):
        decay = g[:, :, t].exp()
        state = state * (decay[..., None] if g.dim() == 4 else decay[..., None, None])
        memory = (state * k[:, :, t].unsqueeze(-1)).sum(-2)
        delta = (v[:, :, t] - memory) * beta[:, :, t].unsqueeze(-1)
        state = state + k[:, :, t].unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append((state * q[:, :, t].unsqueeze(-1)).sum(-2))
    return torch.stack(outputs, dim=2), state


def inputs(B=2, h=3, L=150, dk=8, dv=6, seed=0, per_channel=False):
    """Random inputs of the rule; ``per_channel``: KDA's decay, one a key channel."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, h, L, dk, generator=gen, dtype=torch.float64), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(B, h, L, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, h, L, dv, generator=gen, dtype=torch.float64)
    g = -F.softplus(torch.randn(B, h, L, *((dk,) if per_channel else ()), generator=gen, dtype=torch.float64))
    beta = torch.sigmoid(torch.randn(B, h, L, generator=gen, dtype=torch.float64))
    return q, k, v, g, beta


class KDA:
    """Kimi Linear's KDA for ``test_linear_recurrence``: the same rule with a decay per key channel."""

    inputs = staticmethod(functools.partial(inputs, per_channel=True))
    recurrence = staticmethod(recurrence)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("cuts", [[150], [70, 80], [13, 40, 37, 60], [5, 5, 100, 40]])
def test_spans_run_from_composed_maps_equal_the_recurrence(cuts, per_channel):
    """The sequence cut into spans (lengths not multiples of the chunk): each span's map from a zero state,
    the composed prefixes as their initial states, each span run from its own: outputs and the final state
    equal the recurrence's over the whole sequence; with a decay per key channel too (KDA's)."""
    q, k, v, g, beta = inputs(per_channel=per_channel)
    start = torch.randn(2, 3, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected, final = recurrence(q, k, v, g, beta, start)
    bounds = torch.tensor([0] + cuts).cumsum(0).tolist()
    terms = [chunk_terms(*(t[:, :, a:b] for t in (q, k, v, g, beta)), chunk_size=16)
             for a, b in zip(bounds, bounds[1:])]
    states, last = initial_states([span_map(t) for t in terms], start)
    outputs = [run_chunks(t, s)[0] for t, s in zip(terms, states)]
    diff = (torch.cat(outputs, dim=2) - expected).abs().max().item()
    print(f"spans {cuts}: max|out diff| {diff:.2e}, final state {(last - final).abs().max().item():.2e}")
    assert diff < 1e-12 and (last - final).abs().max() < 1e-12


def test_a_wrong_map_is_caught():
    q, k, v, g, beta = inputs()
    expected, _ = recurrence(q, k, v, g, beta, torch.zeros(2, 3, 8, 6, dtype=torch.float64))
    terms = [chunk_terms(*(t[:, :, a:b] for t in (q, k, v, g, beta)), chunk_size=16) for a, b in ((0, 70), (70, 150))]
    maps = [span_map(t) for t in terms]
    maps[0] = (maps[0][0], maps[0][1] * 1.01)
    states, _ = initial_states(maps)
    out = torch.cat([run_chunks(t, s)[0] for t, s in zip(terms, states)], dim=2)
    assert (out - expected).abs().max() > 1e-4


def test_one_span_is_hugging_faces_chunked_rule():
    """Against transformers' own torch_chunk_gated_delta_rule (which computes in float32): float32 inputs,
    its q/k scaling left to it. Bound (tests/float32_control.py): both float32 runs against the float64
    token-by-token recurrence of the same (float32-rounded) inputs; HF's distance to it (relative to its
    largest value) is the control this machine's float32 rounding sets for this computation."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta = (t.float() for t in inputs())
    truth, truth_state = recurrence(*(t.double() for t in (q, k, v, g, beta)), torch.zeros(2, 3, 8, 6, dtype=torch.float64))
    q = q * q.shape[-1] ** 0.5  # HF scales the queries itself
    expected, final = torch_chunk_gated_delta_rule(*(t.transpose(1, 2) for t in (q, k, v)), g.transpose(1, 2),
                                                   beta.transpose(1, 2), output_final_state=True)
    out, state = run_chunks(chunk_terms(q * q.shape[-1] ** -0.5, k, v, g, beta), torch.zeros(2, 3, 8, 6))
    diff = (out.transpose(1, 2) - expected).abs().max().item()

    def relative(value, exact):
        return ((value.double() - exact).abs().max() / exact.abs().max()).item()

    ours, control = [relative(out, truth), relative(state, truth_state)], \
        [relative(expected.transpose(1, 2), truth), relative(final, truth_state)]
    bounds = [float32_bound([c]) for c in control]
    print(f"against HF's chunked rule (float32): max|out diff| {diff:.2e}; against the float64 recurrence, "
          f"relative: out {ours[0]:.2e} (bound {bounds[0]:.2e}, HF's {control[0]:.2e}), "
          f"state {ours[1]:.2e} (bound {bounds[1]:.2e}, HF's {control[1]:.2e})")
    assert ours[0] <= bounds[0] and ours[1] <= bounds[1]


def test_one_span_is_hugging_faces_kda():
    """Against transformers' chunk_kimi_delta_attention (Kimi Linear's KDA, its decay per key channel), run in
    float64 by patching its float32 casts away; its l2 norm and query scale left to it."""
    from unittest import mock

    from transformers.models.kimi_linear import modeling_kimi_linear

    q, k, v, g, beta = inputs(per_channel=True)
    start = torch.randn(2, 3, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    to = torch.Tensor.to
    with mock.patch.object(torch.Tensor, "to", lambda t, *a, **kw: t if a == (torch.float32,) else to(t, *a, **kw)), \
            mock.patch.object(torch.Tensor, "float", lambda t: t):
        expected, final = modeling_kimi_linear.chunk_kimi_delta_attention(
            *(t.transpose(1, 2) for t in (q * q.shape[-1] ** 0.5, k, v, g)), beta.transpose(1, 2), chunk_size=32,
            initial_state=start, output_final_state=True)
    out, state = run_chunks(chunk_terms(q, k, v, g, beta, chunk_size=16), start)
    diff, state_diff = (out.transpose(1, 2) - expected).abs().max().item(), (state - final).abs().max().item()
    print(f"against HF's chunk_kimi_delta_attention (chunks 32 against 16): max|out diff| {diff:.2e}, "
          f"state {state_diff:.2e}")
    assert diff < 1e-12 and state_diff < 1e-12


def spans_backward_diff(rule, leaves, recurrence, bounds=(0, 30, 47, 100)):
    """Backward as TSP would run it for ``rule`` (a ``ChunkRule``) over spans cut at ``bounds``: each span's
    initial-state gradient from its own outputs, the transposed composition for each span's final-state
    gradient, then each span's backward from its initial state with those two gradients. Returns the largest
    difference of every input's gradient (and the first state's) from autograd of the token ``recurrence``."""
    leaves = [t.requires_grad_() for t in leaves]
    start = torch.randn(2, 3, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    gen = torch.Generator().manual_seed(2)
    length = leaves[0].shape[2]
    grad_out, grad_final = torch.randn(2, 3, length, 6, generator=gen, dtype=torch.float64), torch.randn(
        2, 3, 8, 6, generator=gen, dtype=torch.float64)
    out, final = recurrence(*leaves, start)
    expected = torch.autograd.grad((out * grad_out).sum() + (final * grad_final).sum(), leaves + [start])

    pairs = list(zip(bounds, bounds[1:]))
    spans = [[t.detach()[:, :, a:b].requires_grad_() for t in leaves] for a, b in pairs]
    terms = [rule.terms(*span, chunk_size=16) for span in spans]
    with torch.no_grad():
        states, _ = initial_states([rule.span_map(t) for t in terms], start.detach(), rule.elementwise)
    maps = [tuple(m.detach() for m in rule.span_map(t)) for t in terms]
    grads_out = [grad_out[:, :, a:b] for a, b in pairs]
    local = []
    for t, s, g_out in zip(terms, states, grads_out):
        s = s.clone().requires_grad_()
        local.append(torch.autograd.grad((rule.run(t, s)[0] * g_out).sum(), s, retain_graph=True)[0])
    finals, grad_start = state_gradients(local, maps, grad_final, rule.elementwise)
    got = [torch.zeros_like(t) for t in leaves]
    for span, t, s, g_out, g_final, (a, b) in zip(spans, terms, states, grads_out, finals, pairs):
        o, f = rule.run(t, s)
        for total, part in zip(got, torch.autograd.grad((o * g_out).sum() + (f * g_final).sum(), span)):
            total[:, :, a:b] += part
    return max((a - b).abs().max().item() for a, b in zip(got + [grad_start], expected))


@pytest.mark.parametrize("per_channel", [False, True])
def test_spans_backward_from_transposed_maps_equals_autograd_of_the_recurrence(per_channel):
    """``spans_backward_diff`` of the gated delta rule (a decay per key channel too: KDA's)."""
    diff = spans_backward_diff(GATED_DELTA, inputs(L=100, per_channel=per_channel), recurrence)
    print(f"per channel {per_channel}: max|grad diff| {diff:.2e}")
    assert diff < 1e-11
