"""LFM's gated short convolution under TSP (LFM2's, LFM2-MoE's, LFM3's ``conv``
layers; DESIGN.md 6n): ``in_proj`` packs ``B``, ``C`` and ``x`` (``H`` rows
each), a depthwise causal convolution runs over ``B * x``, and ``out_proj``
takes ``C`` times its output. No state outlives the convolution's window, so
the only tokens a rank needs from others are each chunk's ``kernel - 1``
halo (``conv``).

Rank ``j`` owns channels ``[jH/D, (j+1)H/D)``: their rows of ``B``, ``C`` and
``x`` (and of ``in_proj``'s bias), their convolution taps and bias, and their
columns of ``out_proj``; ``out_proj``'s bias is kept whole on every rank. The
three pieces are broadcast in turn like a Mamba-2 mixer's (``streamed``:
every rank mixes every channel for its own tokens; the weights cost what the
attention's broadcast costs, ``4 H^2`` a layer, and the halo ``2 (kernel - 1)
H`` elements a rank).
"""

from dataclasses import dataclass

import torch.nn as nn

from ds_tsp.blocks.linear.conv import causal_conv
from ds_tsp.blocks.linear.streamed import ChannelShapes, StreamedMixer, StreamedMixerFunction, joined
from ds_tsp.parallel import comm

INPUT_PARTS = ("in_proj_B", "in_proj_C", "in_proj_x")  # in_proj's rows, in Hugging Face's order
SHORT_CONV_MODULES = ("in_proj", "conv", "out_proj")


@dataclass(frozen=True)
class ShortConvShapes(ChannelShapes):
    """The sizes of one gated short convolution over a TSP group of ``tsp_size``."""

    hidden_size: int
    conv_kernel: int
    tsp_size: int
    proj_bias: bool = False  # in_proj's bias, split with its rows
    conv_bias: bool = False
    out_bias: bool = False  # out_proj's bias, kept whole

    input_parts = INPUT_PARTS
    channels_name = "hidden_size"

    @property
    def channels(self):
        return self.hidden_size

    def channel_tensors(self):
        """This rank's channels' convolution taps (and bias)."""
        C = self.output_width
        return {"conv.weight": (0, (C, 1, self.conv_kernel)), **({"conv.bias": (0, (C,))} if self.conv_bias else {})}

    def replicated_names(self):
        """Hugging Face names of the tensors every rank holds whole."""
        return ["out_proj.bias"] if self.out_bias else []


@dataclass(frozen=True)
class ShortConvPlan:
    """Everything the streamed schedule needs besides tensors."""

    group: object
    shapes: ShortConvShapes
    specs: tuple  # every rank's (inputs, channels, outputs) PackSpecs
    layout: str
    overlap: bool
    documents: list | None  # the rows' packed document starts (ds_tsp.blocks.documents)
    fp32_accumulators: bool = True
    grad_wire_dtype: object = None
    state_sink: object = None  # generation's prefill: state_sink(conv inputs (B, S/D, H)), or None

    def mix(self, proj, pieces, replicated, sink=False):
        """``C * conv(B * x)`` ``(B, S/D, H)`` of the local tokens, in their dtype, Hugging Face's
        order of operations; with ``sink``, ``state_sink`` takes the convolution's inputs."""
        channels = joined(pieces)
        dtype = proj["in_proj_x"].dtype
        gated = proj["in_proj_B"] * proj["in_proj_x"]
        if sink:
            self.state_sink(gated)
        bias = channels["conv.bias"].to(dtype) if self.shapes.conv_bias else None
        mixed = causal_conv(gated, channels["conv.weight"].squeeze(1).to(dtype), bias, self.group, self.layout,
                            documents=self.documents)
        return proj["in_proj_C"] * mixed


class TSPShortConv(StreamedMixer):
    """A gated short convolution over a TSP group, sharded by channel.

    ``forward(x, position_embeddings, documents)`` takes the local tokens
    ``(B, S/D, H)`` (no rotary: the tables are ignored) and the rows' packed
    document starts, at which the convolution's window stops. The constructor
    allocates the shard without initialising it: ``from_hf`` or ``load_shard``
    fills it.
    """

    @classmethod
    def from_hf(cls, layer, config, tsp_group, layout_name="zigzag", overlap=True, fp32_accumulators=True,
                read=None, device=None, backend=None, token_tile=0):
        """Build from a Hugging Face short convolution, keeping this rank's shard;
        ``read(name, piece)`` as ``TSPAttention.from_hf``'s (Hugging Face's
        names). ``backend`` and ``token_tile`` are the attention's options,
        which a layer without attention does not read."""
        weight = layer.out_proj.weight
        return cls(short_conv_shapes(layer, comm.group_size(tsp_group)), tsp_group, layout_name=layout_name,
                   overlap=overlap, fp32_accumulators=fp32_accumulators, dtype=weight.dtype,
                   device=device or weight.device).load_hf(layer, read)

    def replicated_params(self):
        """The parameters every rank holds whole, under Hugging Face names."""
        return {} if self.out_bias is None else {"out_proj.bias": self.out_bias}

    def plan(self, x, documents=None, state_sink=None):
        return ShortConvPlan(group=self.tsp_group, shapes=self.shapes, specs=self.specs, layout=self.layout_name,
                             overlap=self.overlap, documents=documents, fp32_accumulators=self.fp32_accumulators,
                             grad_wire_dtype=self.grad_wire_dtype, state_sink=state_sink)

    def forward(self, x, position_embeddings=None, documents=None, input_norm=None):
        if input_norm is not None:
            raise ValueError("the short convolution does not run its input norm inside (takes_input_norm)")
        return StreamedMixerFunction.apply(x, self.shard_weights(), self.plan(x, documents), self.out_bias)


def short_conv_shapes(layer, tsp_size):
    """The ``ShortConvShapes`` of a Hugging Face gated short convolution."""
    return ShortConvShapes(hidden_size=layer.out_proj.out_features, conv_kernel=layer.conv.kernel_size[0],
                           tsp_size=tsp_size, proj_bias=layer.in_proj.bias is not None,
                           conv_bias=layer.conv.bias is not None, out_bias=layer.out_proj.bias is not None)


def is_short_conv(module):
    """Whether ``module`` is a gated short convolution of LFM's shape: ``in_proj`` packing ``B``, ``C`` and
    ``x``, a depthwise ``conv`` over the channels, ``out_proj``."""
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in SHORT_CONV_MODULES):
        return False
    conv, hidden = module.conv, module.out_proj.out_features
    return (isinstance(conv, nn.Conv1d) and conv.groups == conv.in_channels == conv.out_channels == hidden
            and module.in_proj.out_features == 3 * hidden and module.out_proj.in_features == hidden)

