"""Generation through LFM's gated short convolutions under TSP.

A short convolution remembers nothing but its window: rank ``j`` keeps, for
every row, the last ``kernel - 1`` convolution inputs (``B * x``) of its own
channels (``short_conv``; ``kv_cache.TSPStateLayer``, with an empty recurrent
state).

Prefill runs the training schedule (``streamed``) on the left-aligned prompt;
the convolution's tails are gathered as Gated DeltaNet's
(``linear_decode.PromptTails``). A decode step, with the new token replicated
on every rank: rank ``j`` projects it through its own rows, convolves its own
channels (Hugging Face's ``causal_conv1d_update``) and passes them through its
``out_proj`` columns; the ``D`` partial outputs are all-gathered and summed in
rank order. No weight moves.
"""

import dataclasses

import torch
import torch.nn.functional as F

from ds_tsp.blocks.linear.short_conv import INPUT_PARTS
from ds_tsp.blocks.linear.streamed import streamed_forward
from ds_tsp.inference.linear_decode import PromptTails


def state_shapes(mixer, dtype):
    """``(conv shape, recurrent shape, recurrent dtype)`` of a ``TSPShortConv``'s states, without the batch:
    its channels' window, and no recurrent state."""
    s = mixer.shapes
    return (s.output_width, s.conv_kernel - 1), (0,), dtype


@torch.no_grad()
def prefill_short_conv(mixer, h, positions, lengths, group, store):
    """The mixer's output for the local tokens ``h`` ``(B, S/D, H)`` at global
    ``positions`` ``(S/D,)`` of rows ``lengths`` ``(B,)`` tokens long;
    ``store(conv, recurrent)`` receives this rank's states."""
    tails = PromptTails(positions, lengths, mixer.shapes.conv_kernel - 1)
    mine = mixer.shapes.input_rows("in_proj_x", mixer.tsp_rank)

    def sink(conv_inputs):
        store(tails.gather(conv_inputs, group)[..., mine].transpose(1, 2), conv_inputs.new_empty(h.shape[0], 0))

    plan = dataclasses.replace(mixer.plan(h), state_sink=sink)
    return streamed_forward(plan, h, mixer.shard_weights().detach(), mixer.out_bias)


@torch.no_grad()
def decode_short_conv(mixer, h, conv_state, recurrent_state, sum_over_group):
    """The mixer's output ``(B, 1, H)`` for the new token ``h`` ``(B, 1, H)``;
    ``conv_state`` ``(B, H/D, kernel - 1)`` of this rank advances by the token
    in place (``recurrent_state`` is empty)."""
    w = mixer.spec.unpack(mixer.shard_weights().detach())
    B, C, x = (F.linear(h[:, 0], w[f"{name}.weight"], w.get(f"{name}.bias")) for name in INPUT_PARTS)  # (B, H/D)
    window = torch.cat([conv_state, (B * x).unsqueeze(-1)], dim=-1)  # (B, H/D, kernel)
    weight = w["conv.weight"]  # (H/D, 1, kernel)
    mixed = F.conv1d(window.to(weight.dtype), weight, w.get("conv.bias"), groups=weight.shape[0]).to(h.dtype)
    conv_state.copy_(window[..., 1:])
    total = sum_over_group(F.linear(C * mixed[..., -1], w["out_proj.weight"]))  # (B, H)
    return (total if mixer.out_bias is None else total + mixer.out_bias).unsqueeze(1)
