"""A Mamba-2 mixer's step 2 under TSP (DESIGN.md 6n), run by the streamed
schedule (``streamed``: each rank's input rows, per-channel tensors and output
columns broadcast in turn, the input saved alone).

On every rank, for its own tokens' whole projections: the short convolution
takes the ``kernel - 1`` tokens before each of its chunks from their owners
(``conv``: one small all-gather of chunk tails), then the SSD recurrence of
every head runs each chunk from its exact initial state, composed from every
chunk's state map (``recurrence``: one all-gather of the maps, one scalar and
``n x p`` a head and chunk, whatever the sequence length), plus the ``D`` skip
term; the gated norm, over its groups of the whole inner width, is Hugging
Face's module, run on the local tokens. Every head is each rank's for its
tokens, so the norm stays local whatever its groups span.

Numerics are Hugging Face's torch path (``mamba2_chunk_scan``): ``dt`` in the
model's dtype, the scan in float32 (or the model's dtype where it is wider),
the norm in float32, its output cast back to the model's dtype for ``out_proj``.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds_tsp.blocks.linear.conv import causal_conv
from ds_tsp.blocks.linear.mamba2_shards import CONV_PARTS
from ds_tsp.blocks.linear.recurrence import chunk_recurrence, recurrence_forward
from ds_tsp.blocks.linear.ssd import SSD
from ds_tsp.blocks.linear.streamed import joined


@dataclass(frozen=True)
class Mamba2Plan:
    """Everything the schedule needs besides tensors."""

    group: object
    shapes: object  # mamba2_shards.Mamba2Shapes
    specs: tuple  # every rank's (inputs, channels, outputs) PackSpecs
    layout: str
    norm: object  # the Hugging Face gated norm module, run with the given weight; None: gated by silu(z) alone
    activation: object  # the convolution's activation (the layer's own)
    time_step_limit: tuple  # dt's clamp, the layer's own
    overlap: bool
    documents: list | None  # the rows' packed document starts (ds_tsp.blocks.documents)
    starts: object  # (B, S/D) bool: the local tokens that start a document, or None
    chunk_size: int = 256
    fp32_accumulators: bool = True
    grad_wire_dtype: object = None
    # Generation's prefill: (B, S/D) bool, the real tokens (padding then neither decays nor writes the state), and
    # state_sink(conv inputs (B, S/D, conv channels), final state (B, h, n, p)), or None.
    valid: object = None
    state_sink: object = None
    # {input part: its multiplier} (Falcon-H1's mup_vector, cut by part), or None.
    part_multipliers: dict | None = None

    @property
    def tsp_size(self):
        return self.shapes.tsp_size

    def mix(self, proj, pieces, replicated, sink=False):
        """``mix`` with the norm's weight, the one replicated tensor (none without a norm)."""
        return mix(self, proj, pieces, *(replicated or (None,)), sink=sink)


def mix(plan, proj, pieces, norm_weight, sink=False):
    """The normed output ``(B, S/D, d_inner)`` in the tokens' dtype, from the projections ``proj`` and every
    rank's per-channel piece; with ``sink``, no autograd: ``plan.state_sink`` takes the conv inputs and the
    final state. Without a norm (``plan.norm`` None, Falcon-H1's ``mamba_rms_norm`` off) the output is gated
    by ``silu(z)`` alone."""
    shapes = plan.shapes
    out_dtype = proj["in_proj_x"].dtype
    if plan.part_multipliers is not None:  # Falcon-H1's mup_vector, a buffer in the weights' dtype
        proj = {name: t * plan.part_multipliers[name] for name, t in proj.items()}
    dtype = proj["in_proj_x"].dtype
    B, L = proj["in_proj_x"].shape[:2]
    channels = joined(pieces)
    weight = torch.cat([channels[f"{part}.weight"] for part in CONV_PARTS]).squeeze(1).to(dtype)  # (C, kernel)
    bias = torch.cat([channels[f"{part}.bias"] for part in CONV_PARTS]).to(dtype) if shapes.conv_bias else None
    conv_inputs = torch.cat([proj["in_proj_x"], proj["in_proj_B"], proj["in_proj_C"]], dim=-1)
    mixed = causal_conv(conv_inputs, weight, bias, plan.group, plan.layout, plan.activation, plan.documents)
    xs, Bs, Cs = mixed.split([shapes.d_inner, shapes.state_rows, shapes.state_rows], dim=-1)
    dt = F.softplus(proj["in_proj_dt"] + channels["dt_bias"].to(dtype))
    dt = torch.clamp(dt, min=plan.time_step_limit[0], max=plan.time_step_limit[1])
    wide = torch.promote_types(dtype, torch.float32)
    A = -torch.exp(channels["A_log"].to(torch.promote_types(channels["A_log"].dtype, torch.float32)))
    if plan.valid is not None:  # padding neither decays nor writes the state
        dt = dt * plan.valid[..., None]
    xs = xs.reshape(B, L, shapes.num_heads, shapes.head_dim).to(wide)

    def heads(t):  # (B, L, groups * n) -> (B, h, L, n), each group's rows repeated to its heads
        t = t.reshape(B, L, shapes.n_groups, shapes.state_size).to(wide)
        return t.repeat_interleave(shapes.num_heads // shapes.n_groups, dim=2).transpose(1, 2)

    inputs = (heads(Cs), heads(Bs), (xs * dt[..., None].to(wide)).transpose(1, 2),
              (A.to(wide) * dt.to(wide)).transpose(1, 2))
    if sink:
        y, _, final, _ = recurrence_forward(SSD, inputs, plan.starts, plan.group, plan.layout, plan.chunk_size)
        plan.state_sink(conv_inputs, final)
    else:
        y = chunk_recurrence(SSD, inputs, plan.group, plan.layout, plan.chunk_size, plan.starts)
    y = (y.transpose(1, 2) + channels["D"][:, None] * xs).reshape(B, L, shapes.d_inner)
    if plan.norm is None:
        return (y * F.silu(proj["in_proj_z"])).to(out_dtype)
    normed = torch.func.functional_call(plan.norm, {"weight": norm_weight}, (y, proj["in_proj_z"]))
    return normed.to(out_dtype)
