"""How a Gated DeltaNet layer's heads split over a TSP group (DESIGN.md 6j).

Rank ``j`` owns key heads ``[j*nk/D, (j+1)*nk/D)``, the ``nv/nk`` value heads
each of them serves (consecutive in Hugging Face's order), and everything of
those heads: their rows of the input projections, their channels of the short
convolution, their ``A_log`` and ``dt_bias``, and their columns of
``out_proj``, packed in one flat buffer. The gated norm (one weight of a value
head's width) is kept whole on every rank.

Hugging Face lays the input projections out in two ways:

* ``in_proj_qkv`` (rows: every key head's queries, then its keys, then the
  values), ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (Qwen3.5, Qwen3.5-MoE
  and their kin): a rank's rows of ``in_proj_qkv`` are three pieces, read as
  the logical ``in_proj_q``, ``in_proj_k`` and ``in_proj_v`` (``ds_tsp.blocks.fused``);
* ``in_proj_qkvz`` and ``in_proj_ba`` (Qwen3-Next), which keep each key head's
  queries, keys, values and gates (``b``, ``a``) together: a rank's rows are one block;
* one Linear per projection (OLMo-Hybrid's ``q_proj``, ``k_proj``, ``v_proj``,
  ``g_proj``, ``b_proj``, ``a_proj`` and ``o_proj``, its gated norm ``o_norm``):
  the logical tensors under other names (``separate``).

The convolution's channels are queries', keys', values' in both: three pieces,
the logical ``conv1d_q``, ``conv1d_k`` and ``conv1d_v``.
"""

from dataclasses import dataclass

from ds_tsp.blocks.fused import FusedRows
from ds_tsp.blocks.packing import PackSpec

CONV_PARTS = ("conv1d_q", "conv1d_k", "conv1d_v")
QKV_PARTS = ("in_proj_q", "in_proj_k", "in_proj_v")
# Kimi Linear's KDA's tensors every rank keeps whole: its gates' low-rank down projections and its gated norm.
KDA_REPLICATED = ("forget_gate.f_a_proj.weight", "g_a_proj.weight", "o_norm.weight")
# OLMo-Hybrid's Linear for each logical tensor (``DeltaNetShapes.separate``).
SEPARATE_NAMES = {"q_proj": "in_proj_q", "k_proj": "in_proj_k", "v_proj": "in_proj_v", "g_proj": "in_proj_z",
                  "b_proj": "in_proj_b", "a_proj": "in_proj_a", "o_proj": "out_proj"}


@dataclass(frozen=True)
class DeltaNetShapes:
    """The sizes of one Gated DeltaNet layer over a TSP group of ``tsp_size``."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    tsp_size: int
    interleaved: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba, else in_proj_qkv / _z / _b / _a
    conv_bias: bool = False
    separate: bool = False  # OLMo-Hybrid's q_proj / k_proj / v_proj / g_proj / b_proj / a_proj / o_proj
    kda: bool = False  # Kimi Linear's KDA: a decay per key channel from a low-rank forget gate, a low-rank output gate

    def __post_init__(self):
        D, nk, nv = self.tsp_size, self.num_k_heads, self.num_v_heads
        if nk % D:
            raise ValueError(f"linear_num_key_heads = {nk} is not divisible by tsp.size = {D}: a TSP rank owns "
                             f"whole key heads of the Gated DeltaNet layers; choose tsp.size from the divisors of {nk}")
        if nv % nk:
            raise ValueError(f"linear_num_value_heads = {nv} is not a multiple of linear_num_key_heads = {nk}")

    @property
    def k_heads(self):
        """Key heads per rank."""
        return self.num_k_heads // self.tsp_size

    @property
    def v_heads(self):
        """Value heads per rank."""
        return self.num_v_heads // self.tsp_size

    @property
    def ratio(self):
        """Value heads per key head."""
        return self.num_v_heads // self.num_k_heads

    @property
    def out_proj(self):
        """The name of the output projection's columns in a shard (Hugging Face's ``o_proj`` under KDA's names)."""
        return "o_proj.weight" if self.kda else "out_proj.weight"

    @property
    def key_rows(self):
        return self.k_heads * self.head_k_dim

    @property
    def value_rows(self):
        return self.v_heads * self.head_v_dim

    def _per_rank(self):
        """``{name: (dim, rows per rank)}`` of every tensor a rank holds a piece of."""
        H, keys, values, heads = self.hidden_size, self.key_rows, self.value_rows, self.v_heads
        if self.kda:  # under Hugging Face's names; f_a_proj and g_a_proj, the gates' low-rank down, kept whole
            d = self.head_k_dim
            return {**{f"{name}.weight": (0, keys, H) for name in ("q_proj", "k_proj", "v_proj")},
                    **{f"{part}.weight": (0, keys, 1, self.conv_kernel) for part in CONV_PARTS},
                    "forget_gate.f_b_proj.weight": (0, keys, d), "forget_gate.dt_bias": (0, keys),
                    "forget_gate.A_log": (2, 1, 1, heads, 1), "b_proj.weight": (0, heads, H),
                    "g_b_proj.weight": (0, keys, d), "o_proj.weight": (1, H, values)}
        if self.interleaved:
            per_key_head = 2 * self.head_k_dim + 2 * self.ratio * self.head_v_dim
            inputs = {"in_proj_qkvz.weight": (0, self.k_heads * per_key_head, H),
                      "in_proj_ba.weight": (0, 2 * heads, H)}
        else:
            inputs = {"in_proj_q.weight": (0, keys, H), "in_proj_k.weight": (0, keys, H),
                      "in_proj_v.weight": (0, values, H), "in_proj_z.weight": (0, values, H),
                      "in_proj_b.weight": (0, heads, H), "in_proj_a.weight": (0, heads, H)}
        conv = {f"{part}.weight": (0, rows, 1, self.conv_kernel) for part, rows in zip(CONV_PARTS, (keys, keys, values))}
        if self.conv_bias:
            conv.update({f"{part}.bias": (0, rows) for part, rows in zip(CONV_PARTS, (keys, keys, values))})
        return {**inputs, **conv, "dt_bias": (0, heads), "A_log": (0, heads), "out_proj.weight": (1, H, values)}

    def spec(self, tsp_rank):
        """Rank ``tsp_rank``'s packed shard (every rank's has the same shapes)."""
        return PackSpec({name: shape for name, (_, *shape) in self._per_rank().items()})

    def piece(self, name, tsp_rank):
        """``(dim, start, length)`` of the full (logical) tensor ``name`` that
        ``tsp_rank`` holds, or None for a tensor every rank holds whole."""
        if name not in self._per_rank():
            return None
        dim, *shape = self._per_rank()[name]
        return dim, tsp_rank * shape[dim], shape[dim]

    def hf_rows(self):
        """Where the logical tensors lie in Hugging Face's fused ones."""
        keys, values = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        rows = dict(zip(QKV_PARTS + CONV_PARTS, (keys, keys, values) * 2))
        if self.kda:
            return FusedRows.of({"conv1d": CONV_PARTS}, rows)
        if self.separate:
            rows.update({"in_proj_z": values, "in_proj_b": self.num_v_heads, "in_proj_a": self.num_v_heads,
                         "out_proj": self.hidden_size})
            return FusedRows.of({**{hf: (logical,) for hf, logical in SEPARATE_NAMES.items()}, "conv1d": CONV_PARTS},
                                rows)
        table = {"conv1d": CONV_PARTS} if self.interleaved else {"in_proj_qkv": QKV_PARTS, "conv1d": CONV_PARTS}
        return FusedRows.of(table, rows)
