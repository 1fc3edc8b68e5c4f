"""Gated DeltaNet's recurrence over a TSP group (DESIGN.md 6j): every rank runs
its own two sequence chunks from their exact initial states, computed from the
chunks' affine maps (``chunk_maps``) exchanged once, whatever the sequence length.

Forward: each rank computes its two chunks' maps ``(T, U)`` from a zero state;
ONE all-gather of the ``2D`` maps (``2 B h dk (dk + dv)`` elements a rank);
each rank composes the maps of the chunks before each of its own (natural
order) and runs its chunks from those states. Backward: each chunk's
initial-state gradient from its own outputs; ONE all-gather of them; each rank
composes the transposed maps of the chunks after each of its own for their
final-state gradients, then runs its chunks' backward with both gradients.
"""

import torch

from ds_tsp.blocks.linear.chunk_maps import chunk_terms, initial_states, run_chunks, span_map, state_gradients
from ds_tsp.parallel import comm, layout


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


def recurrence_forward(q, k, v, g, beta, starts, group, layout_name, chunk_size):
    """The local tokens' outputs ``(B, h, S/D, dv)``; and, for backward, this
    rank's two chunks' initial states and every chunk's ``T`` (sequence order);
    and the state after the whole sequence, the same on every rank."""
    D, r = comm.group_size(group), comm.group_rank(group)
    terms = [chunk_terms(*span, chunk_size=chunk_size, starts=s)
             for span, s in zip(_spans((q, k, v, g, beta)), _starts(starts))]
    maps = [span_map(t) for t in terms]
    T = torch.stack([m[0] for m in maps])  # (2, B, h, dk, dk)
    U = torch.stack([m[1] for m in maps])  # (2, B, h, dk, dv)
    gathered, _ = comm.all_gather(torch.cat([T, U], dim=-1), group)  # (D, 2, B, h, dk, dk + dv)
    dk = T.shape[-1]
    all_maps = [(m[..., :dk], m[..., dk:]) for m in _natural(gathered, D, layout_name)]
    states, final = initial_states(all_maps)
    mine = _own(states, r, D, layout_name)
    out = torch.cat([run_chunks(t, s)[0] for t, s in zip(terms, mine)], dim=2)
    return out, mine, [T for T, _ in all_maps], final


class GatedDeltaRecurrence(torch.autograd.Function):
    """forward: the local tokens' outputs ``(B, h, S/D, dv)`` from the exchanged maps;
    backward: the transposed exchange and each chunk's own backward."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, starts, group, layout_name, chunk_size):
        out, mine, all_T, _ = recurrence_forward(q, k, v, g, beta, starts, group, layout_name, chunk_size)
        ctx.save_for_backward(q, k, v, g, beta, *mine, *all_T)
        ctx.group, ctx.layout_name, ctx.chunk_size, ctx.starts = group, layout_name, chunk_size, starts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, g, beta, s0, s1, *all_T = ctx.saved_tensors
        group, layout_name = ctx.group, ctx.layout_name
        D, r = comm.group_size(group), comm.group_rank(group)
        spans = [[t.detach().requires_grad_() for t in span] for span in _spans((q, k, v, g, beta))]
        grads_out = grad_out.chunk(2, dim=2)
        local, runs = [], []
        with torch.enable_grad():
            for span, starts, state, g_out in zip(spans, _starts(ctx.starts), (s0, s1), grads_out):
                state = state.detach().requires_grad_()
                out, final = run_chunks(chunk_terms(*span, chunk_size=ctx.chunk_size, starts=starts), state)
                local.append(torch.autograd.grad((out * g_out).sum(), state, retain_graph=True)[0])
                runs.append((span, out, final, g_out))
        gathered, _ = comm.all_gather(torch.stack(local), group)  # (D, 2, B, h, dk, dv)
        finals, _ = state_gradients(_natural(gathered, D, layout_name), [(T, None) for T in all_T])
        grads = []
        with torch.enable_grad():
            for (span, out, final, g_out), g_final in zip(runs, _own(finals, r, D, layout_name)):
                grads.append(torch.autograd.grad((out * g_out).sum() + (final * g_final).sum(), span))
        return (*(torch.cat(parts, dim=2) for parts in zip(*grads)), None, None, None, None)


def _starts(starts):
    """This rank's two chunks of the document starts ``(B, S/D)``, or Nones."""
    return (None, None) if starts is None else starts.chunk(2, dim=1)


def gated_delta_recurrence(q, k, v, g, beta, group, layout_name="zigzag", chunk_size=64, starts=None):
    """The gated delta rule's outputs for this rank's tokens (``(B, h, S/D, ...)``
    inputs in the TSP layout), exact for the whole sequence; forward: an
    all-gather of the chunks' state maps, backward: one of their state gradients.
    ``starts`` ``(B, S/D)``: the local tokens that start a packed document
    (the state restarts there, ``chunk_maps.chunk_terms``), or None."""
    return GatedDeltaRecurrence.apply(q, k, v, g, beta, starts, group, layout_name, chunk_size)
