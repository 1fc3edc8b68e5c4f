"""The schedule of the recurrent mixers whose shard is three pieces
broadcast in turn (Mamba-2's, ``mamba2_schedule``; Mamba-1's, ``mamba1``;
LFM's gated short convolution, ``short_conv``), as plain forward and backward
functions and the autograd Function that runs them (DESIGN.md 6n).

Per layer, on every rank, with ``x`` its local tokens ``(B, S/D, H)``, each
rank's pieces broadcast in turn (the next one in flight under the current
one's compute):

1. the input pieces: each rank projects its own tokens through every rank's
   rows, so it holds its tokens' whole projections;
2. the per-channel pieces: the mixer's own ``plan.mix`` (its convolution's
   halos and recurrence gathered from the other ranks) turns the projections
   into the mixed output ``(B, S/D, mixed width)`` of its tokens;
3. the output pieces: each rank's ``out_proj`` columns, summed locally, so no
   all-reduce is needed.

Backward broadcasts the input pieces again (the projections are recomputed,
not saved), runs step 2 under autograd with the per-channel pieces and the
replicated tensors as leaves, broadcasts the output pieces for the mixed
output's gradient (written out), and the input pieces a third time for the
input's gradient: each piece's weight gradient goes to its owner, summed in
float32 or wider. Saved: the local input only.

A plan gives ``group``, ``specs`` (every rank's three PackSpecs), ``overlap``,
``fp32_accumulators``, ``grad_wire_dtype``, ``state_sink`` and ``shapes``
(``input_parts``, ``input_rows(name, j)``, ``output_width``), and
``mix(proj, pieces, replicated, sink)``.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_tsp.blocks.fused import FusedRows
from ds_tsp.blocks.latent.schedule import ShardGrads, piece_stream
from ds_tsp.blocks.packing import PackedShardMixin, PackSpec, module_reader
from ds_tsp.parallel import comm, precision
from ds_tsp.parallel.amp import autocast_backward, autocast_forward
from ds_tsp.parallel.eager import EagerFunction

INPUTS, CHANNELS, OUTPUTS = range(3)  # the pieces of a shard, in their order


def project(plan, x, packed):
    """The local tokens' projections ``{input part: (B, S/D, its full rows)}``, from every rank's input piece."""
    outputs = {name: [] for name in plan.shapes.input_parts}
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


def joined(pieces, dims=None):
    """Every rank's per-channel tensors, each concatenated over the ranks along its ``dims[name]`` (default 0)."""
    return {name: torch.cat([piece[name] for piece in pieces], dim=(dims or {}).get(name, 0)) for name in pieces[0]}


def accumulator_dtype(plan, dtype):
    return torch.promote_types(dtype, torch.float32) if plan.fp32_accumulators else dtype


def streamed_forward(plan, x, packed, out_bias, replicated=()):
    """Forward of one mixer on the local tokens ``x``: the output ``(B, S/D, H)``."""
    mixed = plan.mix(project(plan, x, packed), channel_pieces(plan, packed), replicated,
                     sink=plan.state_sink is not None)
    out = torch.empty((x.shape[0] * x.shape[1], x.shape[2]), dtype=accumulator_dtype(plan, x.dtype), device=x.device)
    columns = plan.shapes.output_width
    for j, w in piece_stream(plan, packed, OUTPUTS):
        part = mixed[..., j * columns:(j + 1) * columns].flatten(0, 1)
        precision.add_matmul(out, part, w["out_proj.weight"].to(x.dtype).t(), add=j > 0)
    out = out.view(x.shape).to(x.dtype)
    return out if out_bias is None else out + out_bias.to(x.dtype)


def streamed_backward(plan, grad_out, x, packed, replicated=()):
    """Gradients of the local tokens ``x``, this rank's packed shard and the ``replicated`` tensors."""
    shapes = plan.shapes
    grads = ShardGrads(plan, packed)
    acc = accumulator_dtype(plan, x.dtype)
    with torch.no_grad():
        proj = project(plan, x, packed)
    proj = {name: t.requires_grad_() for name, t in proj.items()}
    pieces = channel_pieces(plan, packed, leaves=True)
    kept = [t.detach().requires_grad_() for t in replicated]
    with torch.enable_grad():
        mixed = plan.mix(proj, pieces, kept)
    grad_tokens = grad_out.flatten(0, 1)  # (N, H)
    grad_mixed = torch.empty(mixed.shape, dtype=mixed.dtype, device=x.device)
    columns = shapes.output_width
    for j, w in piece_stream(plan, packed, OUTPUTS):
        part = slice(j * columns, (j + 1) * columns)
        grad_mixed[..., part] = (grad_tokens @ w["out_proj.weight"].to(grad_tokens.dtype)).view(
            *mixed.shape[:2], columns)
        flat, into = grads.buffer(j, OUTPUTS)
        precision.partial_matmul(grad_tokens.t(), mixed.detach()[..., part].flatten(0, 1),
                                 out=into["out_proj.weight"], add=False)
        grads.send(j, flat)
    leaves = [*proj.values(), *(t for piece in pieces for t in piece.values()), *kept]
    found = torch.autograd.grad(mixed, leaves, grad_mixed, allow_unused=True)
    grad_proj, found = dict(zip(proj, found[:len(proj)])), found[len(proj):]
    for j, piece in enumerate(pieces):
        flat, into = grads.buffer(j, CHANNELS)
        for (name, leaf), grad in zip(piece.items(), found):
            into[name].copy_(torch.zeros_like(leaf) if grad is None else grad)
        found = found[len(piece):]
        grads.send(j, flat)
    grad_replicated = [g.to(t.dtype) for g, t in zip(found, replicated)]
    grad_x = torch.zeros(x.shape, dtype=acc, device=x.device)
    x_tokens = x.flatten(0, 1)
    for j, w in piece_stream(plan, packed, INPUTS):
        flat, into = grads.buffer(j, INPUTS)
        for name in shapes.input_parts:
            g = grad_proj[name][..., shapes.input_rows(name, j)].flatten(0, 1)  # (N, rows)
            precision.add_matmul(grad_x.view(-1, x.shape[-1]), g, w[f"{name}.weight"].to(g.dtype))
            precision.partial_matmul(g.t(), x_tokens, out=into[f"{name}.weight"], add=False)
            if f"{name}.bias" in into:  # summed over the local tokens in float32 or wider
                into[f"{name}.bias"].copy_(g.sum(0, dtype=acc))
        grads.send(j, flat)
    return grad_x.to(x.dtype), grads.own_shard().to(packed.dtype), grad_replicated


class StreamedMixerFunction(EagerFunction):
    """forward: ``streamed_forward``, saving its input; backward: ``streamed_backward``."""

    # Under autocast the input is cast to the autocast dtype; the shard keeps its dtype (each piece is cast once
    # received, where the mixer's own layer casts it), and so do out_proj's bias and the replicated tensors.
    @staticmethod
    @autocast_forward(cast_inputs=True, keep=(1, 3), keep_from=4)
    def forward(ctx, x, packed, plan, out_bias, *replicated):
        ctx.plan, ctx.has_bias = plan, out_bias is not None
        ctx.bias_dtype = None if out_bias is None else out_bias.dtype
        ctx.save_for_backward(x, packed, *replicated)
        return streamed_forward(plan, x, packed, out_bias, replicated)

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_out):
        x, packed, *replicated = ctx.saved_tensors
        grad_x, grad_packed, grad_replicated = streamed_backward(ctx.plan, grad_out.contiguous(), x, packed,
                                                                 replicated)
        grad_bias = None
        if ctx.has_bias:  # summed over the local tokens in float32 or wider
            grad_bias = grad_out.flatten(0, 1).sum(0, dtype=accumulator_dtype(ctx.plan, grad_out.dtype))
            grad_bias = grad_bias.to(ctx.bias_dtype)
        return grad_x, grad_packed, None, grad_bias, *grad_replicated


class StreamedShapes:
    """How a streamed mixer's shard splits, from its ``pieces()``: ``(inputs,
    channels, outputs)``, each ``{name: (split dim, shape per rank)}`` (every
    rank's alike); ``hf_rows()`` and ``replicated_names()`` are the mixer's own."""

    def specs(self, tsp_rank):
        """The ``(inputs, channels, outputs)`` PackSpecs of ``tsp_rank``'s shard."""
        return tuple(PackSpec({name: shape for name, (_, shape) in piece.items()}) for piece in self.pieces())

    def spec(self, tsp_rank):
        """The whole shard's PackSpec: its three pieces one after the other."""
        return PackSpec({name: shape for spec in self.specs(tsp_rank) for name, shape in spec.shapes.items()})

    def piece(self, name, tsp_rank):
        """``(dim, start, length)`` of the full (logical) tensor ``name`` that
        ``tsp_rank`` holds, or None for a tensor every rank holds whole."""
        for piece in self.pieces():
            if name in piece:
                dim, shape = piece[name]
                return dim, tsp_rank * shape[dim], shape[dim]
        return None


class ChannelShapes(StreamedShapes):
    """A streamed mixer split by channel (Mamba-1's, the short convolution's): rank ``j`` owns channels
    ``[j C, (j+1) C)``, ``C = output_width``, of every input part (rows of Hugging Face's fused ``in_proj``, in
    ``input_parts`` order, with ``proj_bias`` their bias) and of ``out_proj``'s columns; the subclass gives
    ``channels`` (the count), ``channels_name`` (the config's, for a refusal) and ``channel_tensors()`` (its
    per-channel piece)."""

    def __post_init__(self):
        if self.channels % self.tsp_size:
            raise ValueError(f"{self.channels_name} = {self.channels} is not divisible by tsp.size = "
                             f"{self.tsp_size}: a TSP rank owns 1/D of the channels of these layers; choose "
                             f"tsp.size from the divisors of {self.channels}")

    def pieces(self):
        """``(inputs, channels, outputs)``, each ``{name: (dim, shape per rank)}``."""
        H, C = self.hidden_size, self.output_width
        inputs = {f"{name}.weight": (0, (C, H)) for name in self.input_parts}
        if self.proj_bias:
            inputs.update({f"{name}.bias": (0, (C,)) for name in self.input_parts})
        return inputs, self.channel_tensors(), {"out_proj.weight": (1, (H, C))}

    def hf_rows(self):
        """Where the input parts lie in Hugging Face's fused ``in_proj``."""
        return FusedRows.of({"in_proj": self.input_parts}, dict.fromkeys(self.input_parts, self.channels))

    @property
    def output_width(self):
        """Channels (columns of ``out_proj``) a rank holds."""
        return self.channels // self.tsp_size

    def input_rows(self, name, j):
        """The slice of rank ``j``'s rows in the full ``name`` (an input part)."""
        return slice(j * self.output_width, (j + 1) * self.output_width)


class StreamedMixer(PackedShardMixin, nn.Module):
    """What the mixers run by this schedule hold: this rank's packed shard of
    ``shapes`` (its three pieces), ``out_proj``'s bias whole where there is
    one, and the options the plan reads. The constructor allocates without
    initialising: ``from_hf`` or ``load_shard`` fills them."""

    def __init__(self, shapes, tsp_group, *, layout_name="zigzag", overlap=True, fp32_accumulators=True, dtype=None,
                 device=None):
        super().__init__()
        self.tsp_group = tsp_group
        self.tsp_rank = comm.group_rank(tsp_group)
        self.shapes = shapes
        self.specs = tuple(shapes.specs(j) for j in range(shapes.tsp_size))
        self.spec = shapes.spec(self.tsp_rank)
        self.packed = nn.Parameter(torch.empty(self.spec.numel, dtype=dtype, device=device))
        self.packed.tensor_model_parallel = True  # counted on every TSP rank in gradient norms
        self.lora = None
        self.hf_rows = shapes.hf_rows()
        self.out_bias = (nn.Parameter(torch.empty(shapes.hidden_size, dtype=dtype, device=device))
                         if shapes.out_bias else None)
        self.layout_name, self.overlap, self.fp32_accumulators = layout_name, overlap, fp32_accumulators
        self.grad_wire_dtype = None  # set by ds_tsp.initialize from DeepSpeed's communication_data_type

    def shard_piece(self, name):
        return self.shapes.piece(name, self.tsp_rank)

    def takes_input_norm(self, norm):
        return False

    def load_hf(self, layer, read=None):
        """This rank's shard from the Hugging Face mixer ``layer``, or from ``read(name, piece)`` under its names
        (``TSPAttention.from_hf``'s); returns the module."""
        read = self.hf_rows.reader(read or module_reader(layer))
        self.load_shard({name: read(name, self.shard_piece(name)) for name in self.shard_names()})
        return self


def left_padding_refusal(model):
    """Why ``model``'s left-padded rows cannot run, or None: a streamed mixer
    (Mamba-2's, Mamba-1's, a short convolution) whose ``in_proj`` has a bias. Hugging Face
    zeroes the padding's hidden states, so its projections are that bias and
    its convolution carries them into the first real tokens; the TSP model runs
    a row moved left, its window starting at the first real token."""
    biased = [name for name, module in model.named_modules()
              if isinstance(module, StreamedMixer) and module.shapes.proj_bias]
    if not biased:
        return None
    return (f"left-padded rows with Mamba or short-convolution mixers whose in_proj has a bias ({biased[0]}: "
            "mamba_proj_bias, conv_bias): Hugging Face's convolution reads the padding's projected bias into the "
            "first real tokens, which the TSP model does not reproduce: pad on the right "
            "(tokenizer.padding_side = 'right'), pack the rows, or leave tsp.enabled false")
