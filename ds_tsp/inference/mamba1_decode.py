"""Generation through Jamba's Mamba-1 mixers under TSP.

Rank ``j`` keeps, for every row, the convolution's last ``kernel - 1`` inputs
of its own channels and their SSM states ``(d/D, n)``
(``kv_cache.TSPStateLayer``). Prefill runs the training schedule
(``streamed``, ``mamba1``) on the left-aligned prompt with each row's padding
neither decaying nor writing the state; the convolution's tails are gathered
as Gated DeltaNet's (``linear_decode.PromptTails``).

A decode step, with the new token replicated on every rank: rank ``j``
projects it through its own rows and convolves its own channels (Hugging
Face's ``causal_conv1d_update``); ``x_proj`` sums over every channel, so its
``D`` partial products are all-gathered and summed in rank order
(``dt_rank + 2 n`` elements a row); the dt, B and C norms run whole on every
rank; rank ``j`` advances its channels' states (Hugging Face's
``mamba_selective_state_update``, in float32 or the model's dtype where wider)
and its ``out_proj`` columns' partial outputs are all-gathered and summed in
rank order. No weight moves.
"""

import dataclasses

import torch
import torch.nn.functional as F

from ds_tsp.blocks.linear.mamba1 import INPUT_PARTS
from ds_tsp.blocks.linear.streamed import streamed_forward
from ds_tsp.inference.linear_decode import PromptTails


def state_shapes(mixer, dtype):
    """``(conv shape, recurrent shape, recurrent dtype)`` of a ``TSPMamba1``'s states, without the batch."""
    s = mixer.shapes
    return (s.output_width, s.conv_kernel - 1), (s.output_width, s.state_size), torch.promote_types(dtype,
                                                                                                      torch.float32)


@torch.no_grad()
def prefill_mamba1(mixer, h, positions, lengths, group, store):
    """The mixer's output for the local tokens ``h`` ``(B, S/D, H)`` at global
    ``positions`` ``(S/D,)`` of rows ``lengths`` ``(B,)`` tokens long;
    ``store(conv, recurrent)`` receives this rank's states."""
    tails = PromptTails(positions, lengths, mixer.shapes.conv_kernel - 1)
    mine = mixer.shapes.input_rows("in_proj_x", mixer.tsp_rank)

    def sink(conv_inputs, final):
        store(tails.gather(conv_inputs, group)[..., mine].transpose(1, 2), final[:, mine])

    plan = dataclasses.replace(mixer.plan(h), valid=tails.valid, state_sink=sink)
    return streamed_forward(plan, h, mixer.shard_weights().detach(), mixer.out_bias,
                            tuple(norm.weight for norm in mixer.norms().values()))


@torch.no_grad()
def decode_mamba1(mixer, h, conv_state, recurrent_state, sum_over_group):
    """The mixer's output ``(B, 1, H)`` for the new token ``h`` ``(B, 1, H)``;
    ``conv_state`` ``(B, d/D, kernel - 1)`` and ``recurrent_state``
    ``(B, d/D, n)`` of this rank advance by the token in place."""
    s = mixer.shapes
    w = mixer.spec.unpack(mixer.shard_weights().detach())
    x, z = (F.linear(h[:, 0], w[f"{name}.weight"], w.get(f"{name}.bias")) for name in INPUT_PARTS)  # (B, d/D)
    window = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)  # (B, d/D, kernel)
    weight = w["conv1d.weight"]
    xs = mixer.activation(F.conv1d(window.to(weight.dtype), weight, w.get("conv1d.bias"), groups=weight.shape[0]))
    xs = xs.to(h.dtype)[..., -1]  # (B, d/D)
    conv_state.copy_(window[..., 1:])
    time_step, B, C = sum_over_group(F.linear(xs, w["x_proj.weight"])).split(
        [s.dt_rank, s.state_size, s.state_size], dim=-1)  # every channel's sum, in rank order
    time_step, B, C = (norm(t) for norm, t in zip(mixer.norms().values(), (time_step, B, C)))
    dt = F.softplus(F.linear(time_step.to(h.dtype), w["dt_proj.weight"]) + w["dt_proj.bias"])  # (B, d/D)
    wide = recurrent_state.dtype
    A = -torch.exp(w["A_log"].to(torch.promote_types(w["A_log"].dtype, torch.float32))).to(wide)  # (d/D, n)
    dt = dt.to(wide)
    state = recurrent_state * torch.exp(dt[..., None] * A) + (dt[..., None] * B.to(wide)[:, None]) * \
        xs.to(wide)[..., None]
    recurrent_state.copy_(state)
    y = (state * C.to(wide)[:, None]).sum(-1) + xs.to(wide) * w["D"].to(wide)
    y = (y * F.silu(z)).to(h.dtype)  # the gate in the model's dtype, as the training schedule and HF take it
    total = sum_over_group(F.linear(y, w["out_proj.weight"]))  # (B, H)
    return (total if mixer.out_bias is None else total + mixer.out_bias).unsqueeze(1)
