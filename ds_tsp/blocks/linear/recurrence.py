"""A recurrent layer over a TSP group (DESIGN.md 6j, 6n): every rank runs its
own two sequence chunks from their exact initial states, computed from the
chunks' affine maps (``chunk_maps``) exchanged once, whatever the sequence
length. One schedule for every ``ChunkRule``: Gated DeltaNet's
(``delta_rule.GATED_DELTA``), Mamba-2's (``ssd.SSD``), Mamba-1's
(``selective_scan.SELECTIVE``).

Forward: each rank computes its two chunks' maps ``(T, U)`` from a zero state;
ONE all-gather of the ``2D`` maps (``2 B (|T| + |U|)`` elements a rank: a dense
``T`` is ``h dk dk``, an elementwise one as small as the rule's); each rank
composes the maps of the chunks before each of its own (natural order) and runs
its chunks from those states. Backward: each chunk's initial-state gradient from
its own outputs; ONE all-gather of them; each rank composes the transposed maps
of the chunks after each of its own for their final-state gradients, then runs
its chunks' backward with both gradients.
"""

import torch

from ds_tsp.blocks.linear.chunk_maps import initial_states, state_gradients
from ds_tsp.parallel import comm, layout
from ds_tsp.parallel.eager import EagerFunction


def _natural(gathered, tsp_size, layout_name):
    """``(D, 2, ...)`` per-rank pairs of chunk tensors -> the ``2D`` chunks' tensors in sequence order."""
    order = layout.rank_major_chunks(tsp_size, layout_name)
    by_chunk = [None] * len(order)
    for tensor, chunk in zip(gathered.flatten(0, 1).unbind(0), order):
        by_chunk[chunk] = tensor
    return by_chunk


def _own(by_chunk, tsp_rank, tsp_size, layout_name):
    return [by_chunk[c] for c in layout.chunk_ids(tsp_rank, tsp_size, layout_name)]


def _spans(tensors):
    """This rank's two chunks of each ``(B, h, S/D, ...)`` tensor."""
    return list(zip(*(t.chunk(2, dim=2) for t in tensors)))


def _starts(starts):
    """This rank's two chunks of the document starts ``(B, S/D)``, or Nones."""
    return (None, None) if starts is None else starts.chunk(2, dim=1)


def gather_maps(maps, group, layout_name):
    """Every chunk's ``(T, U)`` in sequence order, from this rank's two: one all-gather of both, flattened."""
    T, U = (torch.stack(parts) for parts in zip(*maps))  # (2, B, ...)
    sizes = [T[0, 0].numel(), U[0, 0].numel()]
    gathered, _ = comm.all_gather(torch.cat([T.flatten(2), U.flatten(2)], dim=-1), group)  # (D, 2, B, |T| + |U|)
    return [(t.view(T.shape[1:]), u.view(U.shape[1:]))
            for t, u in (m.split(sizes, dim=-1) for m in _natural(gathered, comm.group_size(group), layout_name))]


def recurrence_forward(rule, inputs, starts, group, layout_name, chunk_size, graph=False):
    """The local tokens' outputs ``(B, h, S/D, dv)``; for backward, every
    chunk's ``T`` (sequence order); the state after the whole sequence, the
    same on every rank; and, with ``graph`` (a recompute that backward follows
    at once), each chunk's inputs, made leaves, and its run from its initial
    state, made a leaf, with their autograd graph, so that backward need not
    run the chunks again (else None)."""
    D, r = comm.group_size(group), comm.group_rank(group)
    spans = [[t.detach().requires_grad_() for t in span] if graph else span for span in _spans(inputs)]
    with torch.set_grad_enabled(graph):
        terms = [rule.terms(*span, chunk_size=chunk_size, starts=s) for span, s in zip(spans, _starts(starts))]
    maps = [rule.span_map({name: t.detach() if torch.is_tensor(t) else t for name, t in chunk.items()})
            for chunk in terms]
    all_maps = gather_maps(maps, group, layout_name)
    states, final = initial_states(all_maps, elementwise=rule.elementwise)
    mine = _own(states, r, D, layout_name)
    runs = []
    with torch.set_grad_enabled(graph):
        for span, chunk, state in zip(spans, terms, mine):
            state = state.detach().requires_grad_() if graph else state
            runs.append((span, *rule.run(chunk, state), state))
    out = torch.cat([chunk_out for _, chunk_out, _, _ in runs], dim=2).detach()
    return out, [T for T, _ in all_maps], final, runs if graph else None


class ChunkRecurrence(EagerFunction):
    """forward: the local tokens' outputs ``(B, h, S/D, dv)`` from the exchanged maps, each chunk run under
    autograd when grad is on (``graph``; off, nothing will ask for a backward); backward: the transposed
    exchange and each chunk's own backward through that graph."""

    @staticmethod
    def forward(ctx, rule, starts, group, layout_name, chunk_size, graph, *inputs):
        out, all_T, _, runs = recurrence_forward(rule, inputs, starts, group, layout_name, chunk_size, graph)
        ctx.save_for_backward(*all_T)
        ctx.rule, ctx.group, ctx.layout_name, ctx.runs = rule, group, layout_name, runs
        return out

    @staticmethod
    def backward(ctx, grad_out):
        rule, group, layout_name, runs = ctx.rule, ctx.group, ctx.layout_name, ctx.runs
        ctx.runs = None
        D, r = comm.group_size(group), comm.group_rank(group)
        grads_out = grad_out.chunk(2, dim=2)
        with torch.enable_grad():
            local = [torch.autograd.grad((out * g_out).sum(), state, retain_graph=True)[0]
                     for (_, out, _, state), g_out in zip(runs, grads_out)]
        gathered, _ = comm.all_gather(torch.stack(local), group)  # (D, 2, B, ...state)
        finals, _ = state_gradients(_natural(gathered, D, layout_name), [(T, None) for T in ctx.saved_tensors],
                                    elementwise=rule.elementwise)
        grads = []
        with torch.enable_grad():
            for (span, out, final, _), g_out, g_final in zip(runs, grads_out, _own(finals, r, D, layout_name)):
                grads.append(torch.autograd.grad((out * g_out).sum() + (final * g_final).sum(), span))
        return (None,) * 6 + tuple(torch.cat(parts, dim=2) for parts in zip(*grads))


def chunk_recurrence(rule, inputs, group, layout_name="zigzag", chunk_size=64, starts=None):
    """The ``rule``'s outputs for this rank's tokens (``inputs``: its ``(B, h, S/D, ...)``
    tensors in the TSP layout), exact for the whole sequence; forward: an
    all-gather of the chunks' state maps, backward: one of their state gradients.
    ``starts`` ``(B, S/D)``: the local tokens that start a packed document
    (the state restarts there), or None. On one rank there is nothing to
    exchange: the rule runs over the whole sequence from a zero state, under autograd."""
    if comm.group_size(group) == 1:
        terms = rule.terms(*inputs, chunk_size=chunk_size, starts=starts)
        return rule.run(terms, rule.zero_state(terms))[0]
    return ChunkRecurrence.apply(rule, starts, group, layout_name, chunk_size, torch.is_grad_enabled(), *inputs)
