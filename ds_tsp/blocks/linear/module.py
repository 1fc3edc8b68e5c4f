"""The TSP Gated DeltaNet block (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid
and every Hugging Face class of their shape): this rank's head group of one linear
attention layer, built from a Hugging Face module or a checkpoint
(``from_hf``, ``load_shard``), run by ``ds_tsp.blocks.linear.schedule``.
"""

import copy

import torch
import torch.nn as nn
from transformers.activations import ACT2FN

from ds_tsp.blocks.documents import local_starts
from ds_tsp.blocks.linear.schedule import DeltaNetPlan, TSPDeltaNetFunction
from ds_tsp.blocks.linear.shards import KDA_REPLICATED, SEPARATE_NAMES, DeltaNetShapes
from ds_tsp.blocks.packing import PackedShardMixin, module_reader
from ds_tsp.parallel import comm


class TSPGatedDeltaNet(PackedShardMixin, nn.Module):
    """A Gated DeltaNet layer over a TSP group, sharded by head group.

    ``forward(x, position_embeddings, documents)`` takes the local tokens
    ``(B, S/D, H)`` (no rotary: the tables are ignored) and the rows' packed
    document starts, at which the state restarts. The constructor allocates
    the shard without initialising it: ``from_hf`` or ``load_shard`` fills it.
    """

    def __init__(self, shapes, tsp_group, norm, activation, *, layout_name="zigzag", overlap=True,
                 fp32_accumulators=True, dtype=None, device=None, norm_name="norm", beta_scale=1.0):
        super().__init__()
        self.tsp_group = tsp_group
        self.tsp_rank = comm.group_rank(tsp_group)
        self.shapes = shapes
        self.specs = tuple((shapes.spec(j),) for j in range(shapes.tsp_size))
        self.spec = shapes.spec(self.tsp_rank)
        self.packed = nn.Parameter(torch.empty(self.spec.numel, dtype=dtype, device=device))
        self.packed.tensor_model_parallel = True  # counted on every TSP rank in gradient norms
        self.lora = None
        self.hf_rows = shapes.hf_rows()
        self.norm = norm  # Hugging Face's gated norm module (one value head's width), kept whole
        self.norm_name = norm_name  # its Hugging Face name (OLMo-Hybrid's o_norm)
        # beta's range, 2 where the layer allows negative eigenvalues (OLMo-Hybrid's allow_neg_eigval), else 1
        self.beta_scale = beta_scale
        # KDA's gates' low-rank down projections (forget_gate.f_a_proj, g_a_proj: (d, H)), kept whole, or None.
        self.gate_downs = None
        if shapes.kda:
            self.gate_downs = nn.ParameterList(
                [nn.Parameter(torch.empty(shapes.head_k_dim, shapes.hidden_size, dtype=dtype, device=device))
                 for _ in KDA_REPLICATED[:2]])
        self.activation = activation
        self.layout_name, self.overlap, self.fp32_accumulators = layout_name, overlap, fp32_accumulators
        self.grad_wire_dtype = None  # set by ds_tsp.initialize from DeepSpeed's communication_data_type

    @classmethod
    def from_hf(cls, layer, config, tsp_group, layout_name="zigzag", overlap=True, fp32_accumulators=True,
                read=None, device=None, backend=None, token_tile=0):
        """Build from a Hugging Face Gated DeltaNet module, keeping this rank's
        shard; ``read(name, piece)`` as ``TSPAttention.from_hf``'s (Hugging
        Face's names). ``backend`` and ``token_tile`` are the attention's
        options, which a layer without attention does not read."""
        shapes = delta_net_shapes(layer, comm.group_size(tsp_group))
        weight = (layer.o_proj if shapes.kda else shapes.hf_rows().hf_module(layer, "out_proj")).weight
        device = device or weight.device
        name = norm_name(layer)
        module = cls(shapes, tsp_group, copy.deepcopy(layer.get_submodule(name)).to_empty(device=device),
                     ACT2FN[layer.activation], layout_name=layout_name, overlap=overlap,
                     fp32_accumulators=fp32_accumulators, dtype=weight.dtype, device=device, norm_name=name,
                     beta_scale=2.0 if getattr(layer, "allow_neg_eigval", False) else 1.0)
        read = module.hf_rows.reader(read or module_reader(layer))
        module.load_shard({name: read(name, module.shard_piece(name)) for name in module.shard_names()})
        return module

    def replicated_params(self):
        """The parameters every rank holds whole, under Hugging Face names."""
        downs = {} if self.gate_downs is None else dict(zip(KDA_REPLICATED, self.gate_downs))
        return {**downs, f"{self.norm_name}.weight": self.norm.weight}

    def shard_piece(self, name):
        return self.shapes.piece(name, self.tsp_rank)

    def takes_input_norm(self, norm):
        return False

    def plan(self, x, documents=None):
        starts = None if documents is None else local_starts(documents, self.tsp_rank, self.shapes.tsp_size,
                                                             self.layout_name, x.shape[1], x.device)
        return DeltaNetPlan(group=self.tsp_group, shapes=self.shapes, specs=self.specs, layout=self.layout_name,
                            norm=self.norm, norm_weight=f"{self.norm_name}.weight",
                            replicated_names=tuple(self.replicated_params()), activation=self.activation,
                            overlap=self.overlap, documents=documents,
                            starts=starts, fp32_accumulators=self.fp32_accumulators, beta_scale=self.beta_scale,
                            grad_wire_dtype=self.grad_wire_dtype)

    def forward(self, x, position_embeddings=None, documents=None, input_norm=None):
        if input_norm is not None:
            raise ValueError("the Gated DeltaNet block does not run its input norm inside (takes_input_norm)")
        return TSPDeltaNetFunction.apply(x, self.shard_weights(), self.plan(x, documents),
                                         *self.replicated_params().values())


def delta_net_shapes(layer, tsp_size):
    """The ``DeltaNetShapes`` of a Hugging Face Gated DeltaNet module (or Kimi Linear's KDA)."""
    if is_kda(layer):
        return DeltaNetShapes(hidden_size=layer.hidden_size, num_k_heads=layer.num_heads, num_v_heads=layer.num_heads,
                              head_k_dim=layer.head_dim, head_v_dim=layer.head_dim,
                              conv_kernel=layer.conv1d.kernel_size[0], tsp_size=tsp_size, interleaved=False,
                              conv_bias=layer.conv1d.bias is not None, kda=True)
    return DeltaNetShapes(hidden_size=layer.hidden_size, num_k_heads=layer.num_k_heads, num_v_heads=layer.num_v_heads,
                          head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim,
                          conv_kernel=layer.conv1d.kernel_size[0], tsp_size=tsp_size,
                          interleaved=hasattr(layer, "in_proj_qkvz"), conv_bias=layer.conv1d.bias is not None,
                          separate=hasattr(layer, "q_proj"))


def is_gated_delta_net(module):
    """Whether ``module`` is a Gated DeltaNet layer of a shape ds_tsp takes: a
    short convolution and the gated delta rule's ``A_log`` / ``dt_bias``, fed
    by ``in_proj_qkvz`` + ``in_proj_ba``, ``in_proj_qkv`` + ``in_proj_z`` /
    ``_b`` / ``_a``, or one Linear each (OLMo-Hybrid's ``q_proj`` ... ``g_proj``)."""
    return is_kda(module) or (isinstance(getattr(module, "conv1d", None), nn.Conv1d) and hasattr(module, "A_log")
                              and (hasattr(module, "in_proj_qkvz") or hasattr(module, "in_proj_qkv")
                                   or all(hasattr(module, name) for name in SEPARATE_NAMES)))


def is_kda(module):
    """Whether ``module`` is Kimi Linear's KDA: the delta rule with a decay per key channel from a low-rank
    forget gate (``forget_gate``: ``f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log``), ``b_proj`` and a low-rank
    output gate (``g_a_proj``, ``g_b_proj``) before its gated norm ``o_norm``."""
    gate = getattr(module, "forget_gate", None)
    return (isinstance(getattr(module, "conv1d", None), nn.Conv1d) and isinstance(gate, nn.Module)
            and all(hasattr(gate, name) for name in ("f_a_proj", "f_b_proj", "dt_bias", "A_log"))
            and all(hasattr(module, name) for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj")))


def norm_name(layer):
    """The Hugging Face name of a Gated DeltaNet's gated norm: ``norm``, or OLMo-Hybrid's ``o_norm``."""
    return "o_norm" if hasattr(layer, "o_norm") else "norm"


def replicated_names(layer):
    """Hugging Face names of the Gated DeltaNet tensors TSP keeps whole on every rank."""
    return [*(KDA_REPLICATED[:2] if is_kda(layer) else ()), f"{norm_name(layer)}.weight"]
