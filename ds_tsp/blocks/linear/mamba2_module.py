"""The TSP Mamba-2 mixer (Bamba's, Granite-4.0-H's, Nemotron-H's, Falcon-H1's,
Mamba-2's and every Hugging Face mixer of their shape): this rank's heads of
one Mamba-2 layer, built from a Hugging Face module or a checkpoint
(``from_hf``, ``load_shard``), run by ``ds_tsp.blocks.linear.streamed`` with
``mamba2_schedule``'s step 2.
"""

import copy
import sys

import torch
import torch.nn as nn
from transformers.activations import ACT2FN

from ds_tsp.blocks.documents import local_starts
from ds_tsp.blocks.linear.mamba2_schedule import Mamba2Plan
from ds_tsp.blocks.linear.mamba2_shards import Mamba2Shapes
from ds_tsp.blocks.linear.streamed import StreamedMixer, StreamedMixerFunction
from ds_tsp.blocks.vocab import scaled
from ds_tsp.parallel import comm

# What a Hugging Face Mamba-2 mixer holds, by attribute: its modules and tensors, and its sizes.
MAMBA2_MODULES = ("in_proj", "conv1d", "norm", "out_proj")
MAMBA2_TENSORS = ("dt_bias", "A_log", "D")
MAMBA2_SIZES = ("hidden_size", "num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size",
                "chunk_size")


class TSPMamba2(StreamedMixer):
    """A Mamba-2 mixer over a TSP group, sharded by head (``mamba2_shards``).

    ``forward(x, position_embeddings, documents)`` takes the local tokens
    ``(B, S/D, H)`` (no rotary: the tables are ignored) and the rows' packed
    document starts, at which the state restarts and the convolution's window
    stops. The constructor allocates the shard without initialising it:
    ``from_hf`` or ``load_shard`` fills it.
    """

    def __init__(self, shapes, tsp_group, norm, activation, time_step_limit, chunk_size, *, layout_name="zigzag",
                 overlap=True, fp32_accumulators=True, dtype=None, device=None, input_multiplier=1.0,
                 mup_vector=None):
        super().__init__(shapes, tsp_group, layout_name=layout_name, overlap=overlap,
                         fp32_accumulators=fp32_accumulators, dtype=dtype, device=device)
        # Hugging Face's gated norm module (the whole inner width), kept whole; None where the layer has none
        # (Falcon-H1's mamba_rms_norm off: the output gated by silu(z) alone).
        self.norm = norm
        self.activation = activation
        self.time_step_limit, self.chunk_size = tuple(time_step_limit), chunk_size
        # Falcon-H1's multipliers: of the input (ssm_in_multiplier) and of in_proj's output rows (its mup_vector,
        # a buffer Hugging Face computes from the config and does not save: kept whole, not saved either).
        self.input_multiplier = input_multiplier
        self.register_buffer("mup_vector", mup_vector, persistent=False)

    @classmethod
    def from_hf(cls, layer, config, tsp_group, layout_name="zigzag", overlap=True, fp32_accumulators=True,
                read=None, device=None, backend=None, token_tile=0):
        """Build from a Hugging Face Mamba-2 mixer, keeping this rank's shard;
        ``read(name, piece)`` as ``TSPAttention.from_hf``'s (Hugging Face's
        names). ``backend`` and ``token_tile`` are the attention's options,
        which a layer without attention does not read."""
        weight = layer.out_proj.weight
        device = device or weight.device
        shapes = mamba2_shapes(layer, comm.group_size(tsp_group))
        norm = copy.deepcopy(layer.norm).to_empty(device=device) if shapes.norm else None
        mup = mup_vector_of(layer, config, weight.dtype)
        module = cls(shapes, tsp_group, norm, ACT2FN[layer.activation], layer.time_step_limit, layer.chunk_size,
                     layout_name=layout_name, overlap=overlap, fp32_accumulators=fp32_accumulators,
                     dtype=weight.dtype, device=device, input_multiplier=getattr(layer, "ssm_in_multiplier", 1.0),
                     mup_vector=None if mup is None else mup.to(device))
        return module.load_hf(layer, read)

    def replicated_params(self):
        """The parameters every rank holds whole, under Hugging Face names."""
        params = {} if self.norm is None else {"norm.weight": self.norm.weight}
        return params if self.out_bias is None else {**params, "out_proj.bias": self.out_bias}

    def part_multipliers(self):
        """``{input part: its rows of the mup_vector}``, or None without one."""
        if self.mup_vector is None:
            return None
        return {name: self.mup_vector[..., rows] for name, rows in self.shapes.in_proj_rows().items()}

    def norm_weights(self):
        """The replicated tensors the schedule takes: the norm's weight, or none."""
        return () if self.norm is None else (self.norm.weight,)

    def plan(self, x, documents=None, valid=None, state_sink=None):
        starts = None if documents is None else local_starts(documents, self.tsp_rank, self.shapes.tsp_size,
                                                             self.layout_name, x.shape[1], x.device)
        return Mamba2Plan(group=self.tsp_group, shapes=self.shapes, specs=self.specs, layout=self.layout_name,
                          norm=self.norm, activation=self.activation, time_step_limit=self.time_step_limit,
                          overlap=self.overlap, documents=documents, starts=starts, chunk_size=self.chunk_size,
                          fp32_accumulators=self.fp32_accumulators, grad_wire_dtype=self.grad_wire_dtype,
                          valid=valid, state_sink=state_sink, part_multipliers=self.part_multipliers())

    def forward(self, x, position_embeddings=None, documents=None, input_norm=None):
        if input_norm is not None:
            raise ValueError("the Mamba-2 mixer does not run its input norm inside (takes_input_norm)")
        return StreamedMixerFunction.apply(scaled(x, self.input_multiplier), self.shard_weights(),
                                           self.plan(x, documents), self.out_bias, *self.norm_weights())


def mup_vector_of(layer, config, dtype):
    """A copy of the mixer's ``mup_vector`` (Falcon-H1's multipliers of in_proj's rows, a buffer no checkpoint
    holds), or None; on the meta device, computed from the config by the layer's own modeling module
    (``compute_mup_vector``, as Hugging Face's weight initialisation does), in the weights' ``dtype``."""
    mup = getattr(layer, "mup_vector", None)
    if mup is None or not mup.is_meta:
        return None if mup is None else mup.detach().clone()
    compute = getattr(sys.modules[type(layer).__module__], "compute_mup_vector", None)
    if compute is None:
        raise ValueError(f"{type(layer).__name__} holds a mup_vector its module has no compute_mup_vector for: "
                         "ds_tsp cannot tell its values from the config; leave tsp.enabled false")
    return compute(config).to(dtype)


def has_gated_norm(layer):
    """Whether the Mamba-2 mixer ``layer`` norms its output (a module with a weight), rather than gating it by
    ``silu(z)`` alone (Falcon-H1's ``nn.Identity``, ``mamba_rms_norm`` off)."""
    return isinstance(getattr(layer.norm, "weight", None), torch.Tensor)


def mamba2_shapes(layer, tsp_size):
    """The ``Mamba2Shapes`` of a Hugging Face Mamba-2 mixer."""
    return Mamba2Shapes(hidden_size=layer.hidden_size, num_heads=layer.num_heads, head_dim=layer.head_dim,
                        n_groups=layer.n_groups, state_size=layer.ssm_state_size,
                        conv_kernel=layer.conv1d.kernel_size[0], tsp_size=tsp_size,
                        proj_bias=layer.in_proj.bias is not None, conv_bias=layer.conv1d.bias is not None,
                        out_bias=layer.out_proj.bias is not None, norm=has_gated_norm(layer))


def is_mamba2(module):
    """Whether ``module`` is a Mamba-2 mixer of the shape Hugging Face's share: ``in_proj`` packing
    ``z, x, B, C, dt``, a short convolution, per-head ``dt_bias`` / ``A_log`` / ``D``, a gated norm."""
    return (all(isinstance(getattr(module, name, None), nn.Module) for name in MAMBA2_MODULES)
            and all(isinstance(getattr(module, name, None), nn.Parameter) for name in MAMBA2_TENSORS)
            and hasattr(module, "n_groups") and hasattr(module, "time_step_limit"))
