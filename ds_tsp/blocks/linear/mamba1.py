"""Mamba-1 mixers under TSP (Jamba's; DESIGN.md 6n): ``in_proj`` packs the
SSM input ``x`` and the gate ``z`` (``d_inner`` rows each), a depthwise causal
convolution runs over ``x`` and its activation, ``x_proj`` maps every channel
to the time-step rank and the state's ``B`` and ``C``, normed (Jamba's
``dt_layernorm``, ``b_layernorm``, ``c_layernorm``), ``dt_proj`` widens the
time step back to the channels, the selective scan (``selective_scan``) runs
with a decay per channel and state entry (``A_log`` ``(d_inner, n)``), then the
``D`` skip term, the gate's silu and ``out_proj``.

Rank ``j`` owns channels ``[j d/D, (j+1) d/D)``: their rows of ``x`` and ``z``,
their convolution taps, their columns of ``x_proj``, rows of ``dt_proj``, rows
of ``A_log`` and ``D``, and columns of ``out_proj``; the three norms' weights
and ``out_proj``'s bias are kept whole on every rank. The pieces are
broadcast in turn like a Mamba-2 mixer's (``streamed``): every rank mixes
every channel for its own tokens (``x_proj`` sums over all of them), the
convolution's halos are all-gathered, and the scan's span maps (``2 d n``
elements a row and chunk) are all-gathered once (``recurrence``).

Numerics are Hugging Face's torch path (``mamba_selective_scan``): the time
step in the model's dtype, the scan in float32 (or the model's dtype where
wider), the output cast back to the model's dtype for ``out_proj``.
"""

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ds_tsp.blocks.documents import local_starts
from ds_tsp.blocks.linear.conv import causal_conv
from ds_tsp.blocks.linear.recurrence import chunk_recurrence, recurrence_forward
from ds_tsp.blocks.linear.selective_scan import SELECTIVE
from ds_tsp.blocks.linear.streamed import ChannelShapes, StreamedMixer, StreamedMixerFunction, joined
from ds_tsp.parallel import comm

INPUT_PARTS = ("in_proj_x", "in_proj_z")  # in_proj's rows, in Hugging Face's order
MAMBA1_MODULES = ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj")
MAMBA1_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")  # Jamba's, before dt_proj and on B and C
MAMBA1_TENSORS = ("A_log", "D")


@dataclass(frozen=True)
class Mamba1Shapes(ChannelShapes):
    """The sizes of one Mamba-1 mixer over a TSP group of ``tsp_size``."""

    hidden_size: int
    d_inner: int
    state_size: int
    dt_rank: int
    conv_kernel: int
    tsp_size: int
    proj_bias: bool = False  # in_proj's bias, split with its rows
    conv_bias: bool = True
    out_bias: bool = False  # out_proj's bias, kept whole

    input_parts = INPUT_PARTS
    channels_name = "the Mamba layers' intermediate size (mamba_expand x hidden_size)"

    @property
    def channels(self):
        return self.d_inner

    def channel_tensors(self):
        """This rank's channels' convolution taps (and bias), ``x_proj`` columns, ``dt_proj`` rows and bias,
        ``A_log`` rows and ``D``."""
        C, n = self.output_width, self.state_size
        channels = {"conv1d.weight": (0, (C, 1, self.conv_kernel))}
        if self.conv_bias:
            channels["conv1d.bias"] = (0, (C,))
        channels.update({"x_proj.weight": (1, (self.dt_rank + 2 * n, C)), "dt_proj.weight": (0, (C, self.dt_rank)),
                         "dt_proj.bias": (0, (C,)), "A_log": (0, (C, n)), "D": (0, (C,))})
        return channels

    def replicated_names(self):
        """Hugging Face names of the tensors every rank holds whole."""
        return [f"{norm}.weight" for norm in MAMBA1_NORMS] + (["out_proj.bias"] if self.out_bias else [])


@dataclass(frozen=True)
class Mamba1Plan:
    """Everything the streamed schedule needs besides tensors."""

    group: object
    shapes: Mamba1Shapes
    specs: tuple  # every rank's (inputs, channels, outputs) PackSpecs
    layout: str
    norms: tuple  # the Hugging Face norm modules of dt, B and C, run with the given weights
    activation: object  # the convolution's activation (the layer's own)
    overlap: bool
    documents: list | None  # the rows' packed document starts (ds_tsp.blocks.documents)
    starts: object  # (B, S/D) bool: the local tokens that start a document, or None
    fp32_accumulators: bool = True
    grad_wire_dtype: object = None
    # Generation's prefill: (B, S/D) bool, the real tokens (padding then neither decays nor writes the state), and
    # state_sink(conv inputs (B, S/D, d_inner), final state (B, d_inner, n)), or None.
    valid: object = None
    state_sink: object = None

    def mix(self, proj, pieces, replicated, sink=False):
        """The gated scan output ``(B, S/D, d_inner)`` of the local tokens, in their dtype; with ``sink``, no
        autograd: ``state_sink`` takes the convolution's inputs and the final state."""
        s = self.shapes
        channels = joined(pieces, {"x_proj.weight": 1})
        x, z = proj["in_proj_x"], proj["in_proj_z"]
        dtype = x.dtype
        bias = channels["conv1d.bias"].to(dtype) if s.conv_bias else None
        xs = causal_conv(x, channels["conv1d.weight"].squeeze(1).to(dtype), bias, self.group, self.layout,
                         self.activation, self.documents)  # (B, L, d)
        time_step, B, C = F.linear(xs, channels["x_proj.weight"].to(dtype)).split(
            [s.dt_rank, s.state_size, s.state_size], dim=-1)
        time_step, B, C = (torch.func.functional_call(norm, {"weight": weight}, (t,))
                           for norm, weight, t in zip(self.norms, replicated, (time_step, B, C)))
        # (B, L, d): dt_proj without its bias, in the tokens' dtype (a float32 norm weight under autocast widens it)
        dt = F.linear(time_step.to(dtype), channels["dt_proj.weight"].to(dtype))
        dt = F.softplus(dt + channels["dt_proj.bias"].to(dtype))
        if self.valid is not None:  # padding neither decays nor writes the state
            dt = dt * self.valid[..., None]
        wide = torch.promote_types(dtype, torch.float32)
        A = -torch.exp(channels["A_log"].to(torch.promote_types(channels["A_log"].dtype, torch.float32)))  # (d, n)
        dt_w = dt.to(wide).transpose(1, 2).unsqueeze(-1)  # (B, d, L, 1)
        inputs = (torch.exp(A.to(wide)[None, :, None, :] * dt_w),
                  dt_w * B.to(wide)[:, None] * xs.to(wide).transpose(1, 2).unsqueeze(-1),
                  C.to(wide)[:, None])
        if sink:
            y, _, final, _ = recurrence_forward(SELECTIVE, inputs, self.starts, self.group, self.layout, None)
            self.state_sink(x, final)
        else:
            y = chunk_recurrence(SELECTIVE, inputs, self.group, self.layout, None, self.starts)
        y = y.to(dtype).transpose(1, 2) + xs * channels["D"].to(wide)
        return (y * F.silu(z)).to(dtype)


class TSPMamba1(StreamedMixer):
    """A Mamba-1 mixer over a TSP group, sharded by channel.

    ``forward(x, position_embeddings, documents)`` takes the local tokens
    ``(B, S/D, H)`` (no rotary: the tables are ignored) and the rows' packed
    document starts, at which the state restarts and the convolution's window
    stops. The constructor allocates the shard without initialising it:
    ``from_hf`` or ``load_shard`` fills it.
    """

    def __init__(self, shapes, tsp_group, norms, activation, *, layout_name="zigzag", overlap=True,
                 fp32_accumulators=True, dtype=None, device=None):
        super().__init__(shapes, tsp_group, layout_name=layout_name, overlap=overlap,
                         fp32_accumulators=fp32_accumulators, dtype=dtype, device=device)
        for name, norm in norms.items():  # Hugging Face's dt, B and C norms, kept whole under their names
            self.add_module(name, norm)
        self.activation = activation

    @classmethod
    def from_hf(cls, layer, config, tsp_group, layout_name="zigzag", overlap=True, fp32_accumulators=True,
                read=None, device=None, backend=None, token_tile=0):
        """Build from a Hugging Face Mamba-1 mixer, keeping this rank's shard;
        ``read(name, piece)`` as ``TSPAttention.from_hf``'s (Hugging Face's
        names). ``backend`` and ``token_tile`` are the attention's options,
        which a layer without attention does not read."""
        weight = layer.out_proj.weight
        device = device or weight.device
        norms = {name: copy.deepcopy(layer.get_submodule(name)).to_empty(device=device) for name in MAMBA1_NORMS}
        return cls(mamba1_shapes(layer, comm.group_size(tsp_group)), tsp_group, norms, ACT2FN[layer.activation],
                   layout_name=layout_name, overlap=overlap, fp32_accumulators=fp32_accumulators, dtype=weight.dtype,
                   device=device).load_hf(layer, read)

    def norms(self):
        """The dt, B and C norms by Hugging Face name."""
        return {name: getattr(self, name) for name in MAMBA1_NORMS}

    def replicated_params(self):
        """The parameters every rank holds whole, under Hugging Face names."""
        params = {f"{name}.weight": norm.weight for name, norm in self.norms().items()}
        return params if self.out_bias is None else {**params, "out_proj.bias": self.out_bias}

    def plan(self, x, documents=None, valid=None, state_sink=None):
        starts = None if documents is None else local_starts(documents, self.tsp_rank, self.shapes.tsp_size,
                                                             self.layout_name, x.shape[1], x.device)
        return Mamba1Plan(group=self.tsp_group, shapes=self.shapes, specs=self.specs, layout=self.layout_name,
                          norms=tuple(self.norms().values()), activation=self.activation, overlap=self.overlap,
                          documents=documents, starts=starts, fp32_accumulators=self.fp32_accumulators,
                          grad_wire_dtype=self.grad_wire_dtype, valid=valid, state_sink=state_sink)

    def forward(self, x, position_embeddings=None, documents=None, input_norm=None):
        if input_norm is not None:
            raise ValueError("the Mamba-1 mixer does not run its input norm inside (takes_input_norm)")
        return StreamedMixerFunction.apply(x, self.shard_weights(), self.plan(x, documents), self.out_bias,
                                           *(norm.weight for norm in self.norms().values()))


def mamba1_shapes(layer, tsp_size):
    """The ``Mamba1Shapes`` of a Hugging Face Mamba-1 mixer."""
    return Mamba1Shapes(hidden_size=layer.out_proj.out_features, d_inner=layer.out_proj.in_features,
                        state_size=layer.A_log.shape[1], dt_rank=layer.dt_proj.in_features,
                        conv_kernel=layer.conv1d.kernel_size[0], tsp_size=tsp_size,
                        proj_bias=layer.in_proj.bias is not None, conv_bias=layer.conv1d.bias is not None,
                        out_bias=layer.out_proj.bias is not None)


def is_mamba1(module):
    """Whether ``module`` is a Mamba-1 mixer of Jamba's shape: ``in_proj`` packing ``x`` and ``z``, a
    convolution, ``x_proj``, ``dt_proj``, per channel and state entry ``A_log``, ``D``, and the three norms."""
    return (all(isinstance(getattr(module, name, None), nn.Module) for name in (*MAMBA1_MODULES, *MAMBA1_NORMS))
            and all(isinstance(getattr(module, name, None), nn.Parameter) for name in MAMBA1_TENSORS)
            and module.A_log.dim() == 2)
