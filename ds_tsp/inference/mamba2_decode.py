"""Generation through a hybrid's Mamba-2 mixers under TSP.

As for Gated DeltaNet (``linear_decode``), a Mamba-2 mixer's memory of the
prompt is a fixed-size state: rank ``j`` keeps, for every row, the
convolution's last ``kernel - 1`` inputs of its own channels (its heads' ``x``
and its ``1/D`` of the ``B`` and ``C`` rows, ``mamba2_shards``) and its heads'
SSM states ``(h/D, n, p)`` (``kv_cache.TSPStateLayer``).

Prefill runs the training schedule (``streamed``, ``mamba2_schedule``) on the left-aligned
prompt with each row's padding neither decaying nor writing the state, so the
state after the whole sequence, every head's on every rank, is each row's
after its last real token; rank ``j`` keeps its heads'. The convolution's
tails are gathered as Gated DeltaNet's (``linear_decode.PromptTails``).

A decode step, with the new token replicated on every rank: rank ``j``
projects it through its own input rows and convolves its own channels (Hugging
Face's ``causal_conv1d_update``); one small all-gather joins the ``B`` and
``C`` pieces (``2 n_groups n`` elements a row); rank ``j`` advances its heads'
states (Hugging Face's ``mamba2_selective_state_update``, in float32 or the
model's dtype where wider); the gated norm's sums of squares over its groups,
which may span ranks, are all-gathered and summed in rank order (``B n_groups``
elements a rank); its heads' normed outputs pass its ``out_proj`` columns and
the ``D`` partial outputs are all-gathered and summed in rank order. No weight
moves.
"""

import dataclasses

import torch
import torch.nn.functional as F

from ds_tsp.blocks.linear.mamba2_shards import CONV_PARTS, INPUT_PARTS
from ds_tsp.blocks.linear.streamed import streamed_forward
from ds_tsp.blocks.vocab import scaled
from ds_tsp.inference.linear_decode import PromptTails
from ds_tsp.parallel import comm


def state_shapes(mixer, dtype):
    """``(conv shape, recurrent shape, recurrent dtype)`` of a ``TSPMamba2``'s states, without the batch."""
    s = mixer.shapes
    channels = (s.d_inner + 2 * s.state_rows) // s.tsp_size
    return (channels, s.conv_kernel - 1), (s.heads, s.state_size, s.head_dim), torch.promote_types(dtype, torch.float32)


def own_channels(shapes, rank):
    """This rank's channels of the convolution (its heads' ``x``, its pieces of ``B`` and ``C``), as an index."""
    inner, rows = shapes.d_inner // shapes.tsp_size, shapes.state_rows // shapes.tsp_size
    return torch.cat([torch.arange(rank * inner, (rank + 1) * inner),
                      shapes.d_inner + torch.arange(rank * rows, (rank + 1) * rows),
                      shapes.d_inner + shapes.state_rows + torch.arange(rank * rows, (rank + 1) * rows)])


@torch.no_grad()
def prefill_mamba2(mixer, h, positions, lengths, group, store):
    """The mixer's output for the local tokens ``h`` ``(B, S/D, H)`` at global
    ``positions`` ``(S/D,)`` of rows ``lengths`` ``(B,)`` tokens long;
    ``store(conv, recurrent)`` receives this rank's states."""
    tails = PromptTails(positions, lengths, mixer.shapes.conv_kernel - 1)
    mine = own_channels(mixer.shapes, mixer.tsp_rank).to(h.device)
    heads = slice(mixer.tsp_rank * mixer.shapes.heads, (mixer.tsp_rank + 1) * mixer.shapes.heads)

    def sink(conv_inputs, final):
        store(tails.gather(conv_inputs, group)[..., mine].transpose(1, 2), final[:, heads])

    plan = dataclasses.replace(mixer.plan(h), valid=tails.valid, state_sink=sink)
    return streamed_forward(plan, scaled(h, mixer.input_multiplier), mixer.shard_weights().detach(),
                            mixer.out_bias, mixer.norm_weights())


@torch.no_grad()
def decode_mamba2(mixer, h, conv_state, recurrent_state, sum_over_group):
    """The mixer's output ``(B, 1, H)`` for the new token ``h`` ``(B, 1, H)``;
    ``conv_state`` ``(B, C/D, kernel - 1)`` and ``recurrent_state``
    ``(B, h/D, n, p)`` of this rank advance by the token in place."""
    s, group = mixer.shapes, mixer.tsp_group
    w = mixer.spec.unpack(mixer.shard_weights().detach())
    h = scaled(h, mixer.input_multiplier)
    proj = {name: F.linear(h[:, 0], w[f"{name}.weight"], w.get(f"{name}.bias")) for name in INPUT_PARTS}  # (B, .)
    multipliers = mixer.part_multipliers()
    if multipliers is not None:  # this rank's rows of each part's
        proj = {name: t * multipliers[name][0, 0, s.input_rows(name, mixer.tsp_rank)] for name, t in proj.items()}
    window = torch.cat([conv_state, torch.cat([proj["in_proj_x"], proj["in_proj_B"], proj["in_proj_C"]],
                                              dim=-1).unsqueeze(-1)], dim=-1)  # (B, C/D, kernel)
    weight = torch.cat([w[f"{part}.weight"] for part in CONV_PARTS])  # (C/D, 1, kernel)
    bias = torch.cat([w[f"{part}.bias"] for part in CONV_PARTS]) if s.conv_bias else None
    mixed = F.conv1d(window.to(weight.dtype), weight, bias, groups=weight.shape[0])
    mixed = mixer.activation(mixed).to(h.dtype)[..., -1]  # (B, C/D)
    conv_state.copy_(window[..., 1:])
    inner, rows = s.d_inner // s.tsp_size, s.state_rows // s.tsp_size
    x, pieces = mixed.split([inner, 2 * rows], dim=-1)
    gathered = comm.all_gather_small(pieces.contiguous(), group)  # (D, B, 2 rows): every rank's B and C pieces
    Bs, Cs = (gathered[..., part * rows:(part + 1) * rows].permute(1, 0, 2).flatten(1) for part in (0, 1))

    wide = recurrent_state.dtype
    batch = h.shape[0]
    first = mixer.tsp_rank * s.heads  # this rank's first head, and its groups' B and C
    groups = (first + torch.arange(s.heads, device=h.device)) // (s.num_heads // s.n_groups)

    def heads(t):  # (B, n_groups * n) -> (B, h/D, n): each head's group's rows
        return t.view(batch, s.n_groups, s.state_size)[:, groups].to(wide)

    dt = F.softplus(proj["in_proj_dt"] + w["dt_bias"].to(h.dtype))
    dt = torch.clamp(dt, min=mixer.time_step_limit[0], max=mixer.time_step_limit[1]).to(wide)  # (B, h/D)
    A = -torch.exp(w["A_log"].to(torch.promote_types(w["A_log"].dtype, torch.float32)))
    x = x.view(batch, s.heads, s.head_dim)
    state = recurrent_state * torch.exp(dt * A.to(wide))[..., None, None] + \
        heads(Bs).unsqueeze(-1) * (dt[..., None] * x.to(wide)).unsqueeze(-2)
    recurrent_state.copy_(state)
    y = (heads(Cs).unsqueeze(-1) * state).sum(dim=-2) + x * w["D"][:, None]  # (B, h/D, p)
    y = y.to(h.dtype).reshape(batch, inner)  # Hugging Face's step returns the model's dtype
    z = proj["in_proj_z"]
    out = y * F.silu(z) if mixer.norm is None else gated_norm_piece(mixer, y, z, group)
    part = F.linear(out.to(h.dtype), w["out_proj.weight"])  # (B, H)
    total = sum_over_group(part)
    return (total if mixer.out_bias is None else total + mixer.out_bias).unsqueeze(1)


def gated_norm_piece(mixer, y, z, group):
    """Hugging Face's gated norm (``RMSNormGated``: ``y * silu(z)`` normed over
    groups of ``d_inner / n_groups`` features, in float32 or wider; Falcon-H1's
    ``norm_before_gate``: ``y`` normed, then times ``silu(z)``) of this rank's
    features ``y``, ``z`` ``(B, d_inner/D)``: a norm group's sum of squares
    summed over the ranks holding it (one all-gather of ``(B, n_groups)`` a
    rank, summed in rank order)."""
    s, norm = mixer.shapes, mixer.norm
    size = s.d_inner // s.n_groups
    wide = torch.promote_types(y.dtype, torch.float32)
    before = getattr(norm, "norm_before_gate", False)
    gated = y.to(wide) if before else y.to(wide) * F.silu(z.to(wide))
    start = mixer.tsp_rank * (s.d_inner // s.tsp_size)
    group_of = (start + torch.arange(gated.shape[-1], device=y.device)) // size  # each feature's norm group
    sums = gated.new_zeros(gated.shape[0], s.n_groups).index_add_(1, group_of, gated * gated)
    gathered = comm.all_gather_small(sums, group)
    sums = gathered[0]
    for other in gathered[1:]:  # in rank order: the same bits on every rank
        sums = sums + other
    normed = gated * torch.rsqrt(sums / size + norm.variance_epsilon)[:, group_of]
    weight = norm.weight[start:start + gated.shape[-1]]
    if hasattr(norm, "norm_before_gate"):  # Falcon-H1's: the weight, then the gate where it comes after, then cast
        normed = weight * normed
        return (normed * F.silu(z.to(wide)) if before else normed).to(y.dtype)
    return weight * normed.to(y.dtype)
