"""Generation through a hybrid's Gated DeltaNet layers under TSP.

A Gated DeltaNet layer's memory of the prompt is a fixed-size state, not a
cache that grows by token: so no sequence sharding, and nothing moves at rest.
Rank ``j`` keeps, for its own head group ``j`` and every row, the
convolution's last ``kernel - 1`` inputs and the recurrent state
``(hv, dk, dv)`` (``kv_cache.TSPStateLayer``).

Prefill runs the training schedule (``ds_tsp.blocks.linear.schedule``) on the
left-aligned prompt with each row's padding neither decaying nor writing the
state, so the state after the whole sequence, which every rank composes from
the exchanged maps, is each row's after its last real token; rank ``j`` keeps
group ``j``'s. The convolution's tails lie on whichever ranks own each row's
last tokens: for every group, each rank places its tokens' inputs in a
``(B, kernel - 1, C)`` buffer, zeros elsewhere, and one small all-gather
hands them to all (``(D-1) B (kernel-1) C`` elements a group); their sum is
exact, one contributor a slot.

A decode step, with the new token replicated on every rank: rank ``j``
projects it through its own shard, runs its convolution step and recurrent
step (Hugging Face's ``causal_conv1d_update`` and
``torch_recurrent_gated_delta_rule``, in float32 or the model's dtype where
wider) and its ``out_proj`` columns; the ``D`` partial outputs are
all-gathered and summed in rank order, as the MLP's: ``(D-1) B H`` elements a
step and layer, and no weight moves.
"""

import dataclasses

import torch
import torch.nn.functional as F

from ds_tsp.blocks.linear.schedule import (compute_weights, delta_net_forward, kda_inputs, kda_l2norm, l2norm,
                                          project)
from ds_tsp.blocks.linear.shards import CONV_PARTS
from ds_tsp.parallel import comm


def state_shapes(net, dtype):
    """``(conv shape, recurrent shape, recurrent dtype)`` of a ``TSPGatedDeltaNet``'s states, without the batch."""
    s = net.shapes
    return ((2 * s.key_rows + s.value_rows, s.conv_kernel - 1), (s.v_heads, s.head_k_dim, s.head_v_dim),
            torch.promote_types(dtype, torch.float32))


class PromptTails:
    """Where each row's last ``width`` real prompt tokens lie among the local
    ones at global ``positions`` ``(S/D,)`` of rows ``lengths`` ``(B,)`` tokens
    long (``valid`` ``(B, S/D)``: the real ones), and the convolution inputs of
    those tokens gathered from whichever ranks hold them (``gather``)."""

    def __init__(self, positions, lengths, width):
        self.width = width
        self.valid = positions.unsqueeze(0) < lengths.unsqueeze(1)  # (B, S/D)
        slot = positions.unsqueeze(0) - (lengths.unsqueeze(1) - width)  # a token's place among its row's last ones
        # Tokens outside the tail go to a spare slot past it, dropped: a scatter, with no host read of which are in.
        self.target = torch.where((slot >= 0) & self.valid, slot, width).unsqueeze(-1)  # (B, S/D, 1)

    def gather(self, conv_inputs, group):
        """``(B, width, C)``: each row's last inputs ``conv_inputs`` ``(B, S/D, C)``, from every rank: each
        places its tokens' in their slots, zeros elsewhere, and one small all-gather sums them (one
        contributor a slot, so exactly)."""
        tail = conv_inputs.new_zeros(conv_inputs.shape[0], self.width + 1, conv_inputs.shape[-1])
        tail.scatter_(1, self.target.expand(-1, -1, conv_inputs.shape[-1]), conv_inputs)
        return comm.all_gather_small(tail[:, :self.width].contiguous(), group).sum(dim=0)


@torch.no_grad()
def prefill_delta_net(net, h, positions, lengths, group, store):
    """The layer's output for the local tokens ``h`` ``(B, S/D, H)`` at global
    ``positions`` ``(S/D,)`` of rows ``lengths`` ``(B,)`` tokens long;
    ``store(conv, recurrent)`` receives this rank's head group's states."""
    tails = PromptTails(positions, lengths, net.shapes.conv_kernel - 1)

    def sink(j, conv_inputs, final):
        gathered = tails.gather(conv_inputs, group)
        if j == net.tsp_rank:
            store(gathered.transpose(1, 2), final)

    plan = dataclasses.replace(net.plan(h), valid=tails.valid, state_sink=sink)
    return delta_net_forward(plan, h, net.shard_weights().detach(), net.replicated_params())


@torch.no_grad()
def decode_delta_net(net, h, conv_state, recurrent_state, sum_over_group):
    """The layer's output ``(B, 1, H)`` for the new token ``h`` ``(B, 1, H)``;
    ``conv_state`` ``(B, C, kernel - 1)`` and ``recurrent_state``
    ``(B, hv, dk, dv)`` of this rank's head group advance by the token in place.
    KDA's decay is one a key channel (``recurrent_kimi_delta_attention``)."""
    s = net.shapes
    w = compute_weights(net.spec.unpack(net.shard_weights().detach()), h.dtype)
    wide = recurrent_state.dtype
    if s.kda:
        replicated = {name: t.detach() for name, t in net.replicated_params().items()}
        q, k, v, z, beta, g = kda_inputs(s, h, w, replicated, wide)
        beta, g, normalize = beta[:, 0].to(wide), g[:, 0], kda_l2norm  # (B, h), (B, h, dk)
    else:
        q, k, v, z, b, a = project(s, h, w)
        beta = (b[:, 0].sigmoid() if net.beta_scale == 1 else b[:, 0].sigmoid() * net.beta_scale).to(wide)
        g = -w["A_log"].to(wide).exp() * F.softplus(a[:, 0].to(wide) + w["dt_bias"])  # (B, hv)
        normalize = l2norm
    window = torch.cat([conv_state, torch.cat([q, k, v], dim=-1).transpose(1, 2)], dim=-1)  # (B, C, kernel)
    conv_weight = torch.cat([w[f"{part}.weight"] for part in CONV_PARTS])  # (C, 1, kernel)
    conv_bias = torch.cat([w[f"{part}.bias"] for part in CONV_PARTS]) if s.conv_bias else None
    mixed = F.conv1d(window.to(conv_weight.dtype), conv_weight, conv_bias, groups=conv_weight.shape[0])
    mixed = net.activation(mixed).to(h.dtype)[..., -1]  # (B, C)
    conv_state.copy_(window[..., 1:])
    q, k, v = mixed.split([s.key_rows, s.key_rows, s.value_rows], dim=-1)

    def heads(t, dim):  # (B, h*dim) -> (B, hv, dim), keys and queries repeated to the value heads
        t = t.reshape(t.shape[0], -1, dim)
        return (t if t.shape[1] == s.v_heads else t.repeat_interleave(s.ratio, dim=1)).to(wide)

    q, k = (normalize(heads(t, s.head_k_dim)) for t in (q, k))
    q = q / s.head_k_dim ** 0.5
    state = recurrent_state * (g.exp()[..., None] if s.kda else g.exp()[..., None, None])
    delta = (heads(v, s.head_v_dim) - (state * k.unsqueeze(-1)).sum(dim=-2)) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    recurrent_state.copy_(state)
    out = (state * q.unsqueeze(-1)).sum(dim=-2).to(h.dtype)  # (B, hv, dv)
    normed = torch.func.functional_call(net.norm, {"weight": net.norm.weight},
                                        (out.reshape(-1, s.head_v_dim), z.reshape(-1, s.head_v_dim)))
    part = F.linear(normed.reshape(h.shape[0], -1), w[s.out_proj])  # (B, H)
    return sum_over_group(part).unsqueeze(1)
