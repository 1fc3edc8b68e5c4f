"""A Mamba-2 mixer's schedule under TSP (DESIGN.md 6n), as plain forward and
backward functions and the autograd Function that runs them.

Per layer, on every rank, with ``x`` its local tokens ``(B, S/D, H)``, and
each rank's three pieces broadcast in turn (``mamba2_shards``; the next one
in flight under the current one's compute):

1. the input pieces: each rank projects its own tokens through every rank's
   rows, so it holds its tokens' whole ``z``, ``x``, ``B``, ``C`` and ``dt``;
2. the per-channel pieces (convolution, ``dt_bias``, ``A_log``, ``D``): the
   short convolution takes the ``kernel - 1`` tokens before each of its chunks
   from their owners (``conv``: one small all-gather of chunk tails), then the
   SSD recurrence of every head runs each chunk from its exact initial state,
   composed from every chunk's state map (``recurrence``: one all-gather of
   the maps, one scalar and ``n x p`` a head and chunk, whatever the sequence
   length), plus the ``D`` skip term; the gated norm, over its groups of the
   whole inner width, is Hugging Face's module, run on the local tokens;
3. the output pieces: each group's ``out_proj`` columns, summed locally, so no
   all-reduce is needed.

Backward broadcasts the input pieces again (the projections are recomputed,
not saved), runs step 2 under autograd with the per-channel pieces as leaves,
broadcasts the output pieces for the normed output's gradient (written out),
and the input pieces a third time for the input's gradient: each piece's weight gradient
goes to its owner, summed in float32 or wider. Saved: the local input only.

Numerics are Hugging Face's torch path (``mamba2_chunk_scan``): ``dt`` in the
model's dtype, the scan in float32 (or the model's dtype where it is wider),
the norm in float32, its output cast back to the model's dtype for ``out_proj``.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds_tsp.blocks.latent.schedule import ShardGrads, piece_stream
from ds_tsp.blocks.linear.conv import causal_conv
from ds_tsp.blocks.linear.mamba2_shards import CONV_PARTS, INPUT_PARTS
from ds_tsp.blocks.linear.recurrence import chunk_recurrence, recurrence_forward
from ds_tsp.blocks.linear.ssd import SSD
from ds_tsp.parallel import precision
from ds_tsp.parallel.amp import autocast_backward, autocast_forward

INPUTS, CHANNELS, OUTPUTS = range(3)  # the pieces of a shard, as mamba2_shards.PIECES orders them


@dataclass(frozen=True)
class Mamba2Plan:
    """Everything the schedule needs besides tensors."""

    group: object
    shapes: object  # mamba2_shards.Mamba2Shapes
    specs: tuple  # every rank's (inputs, channels, outputs) PackSpecs
    layout: str
    norm: object  # the Hugging Face gated norm module, run with the given weight
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

    @property
    def tsp_size(self):
        return self.shapes.tsp_size


def _rows(shapes, name, j):
    """The slice of rank ``j``'s rows in the full ``name`` (an input part)."""
    full = {"in_proj_z": shapes.d_inner, "in_proj_x": shapes.d_inner, "in_proj_B": shapes.state_rows,
            "in_proj_C": shapes.state_rows, "in_proj_dt": shapes.num_heads}[name]
    per_rank = full // shapes.tsp_size
    return slice(j * per_rank, (j + 1) * per_rank)


def project(plan, x, packed):
    """The local tokens' projections ``{input part: (B, S/D, its full rows)}``, from every rank's input piece."""
    outputs = {name: [] for name in INPUT_PARTS}
    for _, w in piece_stream(plan, packed, INPUTS):
        for name, parts in outputs.items():
            bias = w.get(f"{name}.bias")
            parts.append(F.linear(x, w[f"{name}.weight"].to(x.dtype), None if bias is None else bias.to(x.dtype)))
    return {name: torch.cat(parts, dim=-1) for name, parts in outputs.items()}


def channel_pieces(plan, packed, leaves=False):
    """Every rank's per-channel piece, ``[{name: tensor}]`` by rank (views of each received buffer; leaves
    requiring gradients with ``leaves``)."""
    return [{name: t.detach().requires_grad_() if leaves else t for name, t in w.items()}
            for _, w in piece_stream(plan, packed, CHANNELS)]


def mix(plan, proj, pieces, norm_weight, sink=False):
    """The normed output ``(B, S/D, d_inner)`` in the tokens' dtype, from the projections ``proj`` and every
    rank's per-channel piece; with ``sink``, no autograd: ``plan.state_sink`` takes the conv inputs and the
    final state."""
    shapes = plan.shapes
    dtype = proj["in_proj_x"].dtype
    B, L = proj["in_proj_x"].shape[:2]
    joined = {name: torch.cat([piece[name] for piece in pieces]) for name in pieces[0]}
    weight = torch.cat([joined[f"{part}.weight"] for part in CONV_PARTS]).squeeze(1).to(dtype)  # (C, kernel)
    bias = torch.cat([joined[f"{part}.bias"] for part in CONV_PARTS]).to(dtype) if shapes.conv_bias else None
    conv_inputs = torch.cat([proj["in_proj_x"], proj["in_proj_B"], proj["in_proj_C"]], dim=-1)
    mixed = causal_conv(conv_inputs, weight, bias, plan.group, plan.layout, plan.activation, plan.documents)
    xs, Bs, Cs = mixed.split([shapes.d_inner, shapes.state_rows, shapes.state_rows], dim=-1)
    dt = F.softplus(proj["in_proj_dt"] + joined["dt_bias"].to(dtype))
    dt = torch.clamp(dt, min=plan.time_step_limit[0], max=plan.time_step_limit[1])
    wide = torch.promote_types(dtype, torch.float32)
    A = -torch.exp(joined["A_log"].to(torch.promote_types(joined["A_log"].dtype, torch.float32)))
    if plan.valid is not None:  # padding neither decays nor writes the state
        dt = dt * plan.valid[..., None]
    xs = xs.reshape(B, L, shapes.num_heads, shapes.head_dim).to(wide)

    def heads(t):  # (B, L, groups * n) -> (B, h, L, n), each group's rows repeated to its heads
        t = t.reshape(B, L, shapes.n_groups, shapes.state_size).to(wide)
        return t.repeat_interleave(shapes.num_heads // shapes.n_groups, dim=2).transpose(1, 2)

    inputs = (heads(Cs), heads(Bs), (xs * dt[..., None].to(wide)).transpose(1, 2),
              (A.to(wide) * dt.to(wide)).transpose(1, 2))
    if sink:
        y, _, _, final = recurrence_forward(SSD, inputs, plan.starts, plan.group, plan.layout, plan.chunk_size)
        plan.state_sink(conv_inputs, final)
    else:
        y = chunk_recurrence(SSD, inputs, plan.group, plan.layout, plan.chunk_size, plan.starts)
    y = y.transpose(1, 2) + joined["D"][:, None] * xs
    normed = torch.func.functional_call(plan.norm, {"weight": norm_weight},
                                        (y.reshape(B, L, shapes.d_inner), proj["in_proj_z"]))
    return normed.to(dtype)


def _accumulator_dtype(plan, dtype):
    return torch.promote_types(dtype, torch.float32) if plan.fp32_accumulators else dtype


def mamba2_forward(plan, x, packed, norm_weight, out_bias):
    """Forward of one mixer on the local tokens ``x``: the output ``(B, S/D, H)``."""
    normed = mix(plan, project(plan, x, packed), channel_pieces(plan, packed), norm_weight,
                 sink=plan.state_sink is not None)
    out = torch.empty((x.shape[0] * x.shape[1], x.shape[2]), dtype=_accumulator_dtype(plan, x.dtype), device=x.device)
    columns = plan.shapes.heads * plan.shapes.head_dim
    for j, w in piece_stream(plan, packed, OUTPUTS):
        part = normed[..., j * columns:(j + 1) * columns].flatten(0, 1)
        precision.add_matmul(out, part, w["out_proj.weight"].to(x.dtype).t(), add=j > 0)
    out = out.view(x.shape).to(x.dtype)
    return out if out_bias is None else out + out_bias.to(x.dtype)


def mamba2_backward(plan, grad_out, x, packed, norm_weight):
    """Gradients of the local tokens ``x``, this rank's packed shard and the norm's weight."""
    shapes = plan.shapes
    grads = ShardGrads(plan, packed)
    acc = _accumulator_dtype(plan, x.dtype)
    with torch.no_grad():
        proj = project(plan, x, packed)
    proj = {name: t.requires_grad_() for name, t in proj.items()}
    pieces = channel_pieces(plan, packed, leaves=True)
    norm_leaf = norm_weight.detach().requires_grad_()
    with torch.enable_grad():
        normed = mix(plan, proj, pieces, norm_leaf)
    grad_tokens = grad_out.flatten(0, 1)  # (N, H)
    grad_normed = torch.empty(normed.shape, dtype=normed.dtype, device=x.device)
    columns = shapes.heads * shapes.head_dim
    for j, w in piece_stream(plan, packed, OUTPUTS):
        part = slice(j * columns, (j + 1) * columns)
        grad_normed[..., part] = (grad_tokens @ w["out_proj.weight"].to(grad_tokens.dtype)).view(
            *normed.shape[:2], columns)
        flat, into = grads.buffer(j, OUTPUTS)
        precision.partial_matmul(grad_tokens.t(), normed.detach()[..., part].flatten(0, 1),
                                 out=into["out_proj.weight"], add=False)
        grads.send(j, flat)
    leaves = [*proj.values(), *(t for piece in pieces for t in piece.values()), norm_leaf]
    found = torch.autograd.grad(normed, leaves, grad_normed)
    grad_proj, found = dict(zip(proj, found[:len(proj)])), found[len(proj):]
    for j, piece in enumerate(pieces):
        flat, into = grads.buffer(j, CHANNELS)
        for name, grad in zip(piece, found):
            into[name].copy_(grad)
        found = found[len(piece):]
        grads.send(j, flat)
    grad_norm = found[0]
    grad_x = torch.zeros(x.shape, dtype=acc, device=x.device)
    x_tokens = x.flatten(0, 1)
    for j, w in piece_stream(plan, packed, INPUTS):
        flat, into = grads.buffer(j, INPUTS)
        for name in INPUT_PARTS:
            g = grad_proj[name][..., _rows(shapes, name, j)].flatten(0, 1)  # (N, rows)
            precision.add_matmul(grad_x.view(-1, x.shape[-1]), g, w[f"{name}.weight"].to(g.dtype))
            precision.partial_matmul(g.t(), x_tokens, out=into[f"{name}.weight"], add=False)
            if f"{name}.bias" in into:
                into[f"{name}.bias"].copy_(g.sum(0))
        grads.send(j, flat)
    return grad_x.to(x.dtype), grads.own_shard().to(packed.dtype), grad_norm.to(norm_weight.dtype)


class TSPMamba2Function(torch.autograd.Function):
    """forward: ``mamba2_forward``, saving its input; backward: ``mamba2_backward``."""

    # Under autocast the input is cast to the autocast dtype; the shard keeps its dtype (each piece is cast once
    # received, A_log and D never, dt_bias to the tokens' dtype where dt takes it, as Hugging Face's layer does),
    # and so do the norm's weight and out_proj's bias.
    @staticmethod
    @autocast_forward(cast_inputs=True, keep=(1, 3, 4))
    def forward(ctx, x, packed, plan, norm_weight, out_bias):
        ctx.plan, ctx.has_bias = plan, out_bias is not None
        ctx.bias_dtype = None if out_bias is None else out_bias.dtype
        ctx.save_for_backward(x, packed, norm_weight)
        return mamba2_forward(plan, x, packed, norm_weight, out_bias)

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_out):
        x, packed, norm_weight = ctx.saved_tensors
        grad_x, grad_packed, grad_norm = mamba2_backward(ctx.plan, grad_out.contiguous(), x, packed, norm_weight)
        grad_bias = None
        if ctx.has_bias:  # summed over the local tokens in float32 or wider
            grad_bias = grad_out.flatten(0, 1).sum(0, dtype=_accumulator_dtype(ctx.plan, grad_out.dtype))
            grad_bias = grad_bias.to(ctx.bias_dtype)
        return grad_x, grad_packed, None, grad_norm, grad_bias
