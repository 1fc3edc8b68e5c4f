"""How a Mamba-2 mixer's weights split over a TSP group (DESIGN.md 6n).

Hugging Face's Mamba-2 mixers (Mamba-2's, Bamba's, Granite-4.0-H's,
Nemotron-H's, Falcon-H1's) hold one ``in_proj`` whose rows are, in order, the
gate ``z`` (``d_inner``), the SSM input ``x`` (``d_inner``), the groups' ``B``
and ``C`` (``n_groups * state`` each) and the time steps ``dt`` (one a head);
one depthwise ``conv1d`` over the channels of ``x``, ``B`` and ``C``; per head
``dt_bias``, ``A_log`` and ``D``; the gated norm's weight (``d_inner``) and
``out_proj``.

Rank ``j`` owns heads ``[j*h/D, (j+1)*h/D)``: their rows of ``z``, ``x`` and
``dt``, their channels of the convolution, their ``dt_bias``, ``A_log``,
``D`` and columns of ``out_proj``; and the ``j``-th ``1/D`` of the rows of
``B`` and of ``C`` (and of their channels), whichever heads read them: every
rank projects all of them for its own tokens, as it does every head (the
norm spans the groups' heads, so the whole inner width is each rank's, for its
tokens). A rank's shard is three pieces, broadcast in turn: the input rows
(``in_proj``), the per-channel tensors (convolution, ``dt_bias``, ``A_log``,
``D``) and the output columns (``out_proj``). The norm's weight and
``out_proj``'s bias are kept whole on every rank. The logical tensors
``in_proj_z`` ... and ``conv1d_x`` ... are rows of Hugging Face's fused ones
(``ds_tsp.blocks.fused``).
"""

from dataclasses import dataclass

from ds_tsp.blocks.fused import FusedRows
from ds_tsp.blocks.linear.streamed import StreamedShapes

INPUT_PARTS = ("in_proj_z", "in_proj_x", "in_proj_B", "in_proj_C", "in_proj_dt")
CONV_PARTS = ("conv1d_x", "conv1d_B", "conv1d_C")
HEAD_TENSORS = ("dt_bias", "A_log", "D")


@dataclass(frozen=True)
class Mamba2Shapes(StreamedShapes):
    """The sizes of one Mamba-2 mixer over a TSP group of ``tsp_size``."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    tsp_size: int
    proj_bias: bool = False  # in_proj's bias, split with its rows
    conv_bias: bool = True
    out_bias: bool = False  # out_proj's bias, kept whole
    norm: bool = True  # a gated norm (Falcon-H1's may have none: mamba_rms_norm off), its weight kept whole

    def __post_init__(self):
        D = self.tsp_size
        if self.num_heads % D:
            raise ValueError(f"mamba_n_heads = {self.num_heads} is not divisible by tsp.size = {D}: a TSP rank "
                             f"owns whole heads of the Mamba-2 layers; choose tsp.size from the divisors of "
                             f"{self.num_heads}")
        if self.state_rows % D:
            raise ValueError(f"n_groups x ssm_state_size = {self.state_rows} is not divisible by tsp.size = {D}: "
                             "a TSP rank holds 1/D of the B and C rows of the Mamba-2 layers; choose tsp.size "
                             f"from the divisors of {self.state_rows}")

    @property
    def d_inner(self):
        return self.num_heads * self.head_dim

    @property
    def state_rows(self):
        """Rows of ``B`` (and of ``C``): every group's state."""
        return self.n_groups * self.state_size

    @property
    def heads(self):
        """Heads per rank."""
        return self.num_heads // self.tsp_size

    input_parts = INPUT_PARTS

    @property
    def output_width(self):
        """Columns of ``out_proj`` a rank holds: its heads'."""
        return self.heads * self.head_dim

    def in_proj_rows(self):
        """``{input part: its rows in Hugging Face's whole in_proj}``."""
        rows, first = {}, 0
        for name in INPUT_PARTS:
            rows[name] = slice(first, first + self._full_rows()[name])
            first = rows[name].stop
        return rows

    def input_rows(self, name, j):
        """The slice of rank ``j``'s rows in the full ``name`` (an input part)."""
        per_rank = self._full_rows()[name] // self.tsp_size
        return slice(j * per_rank, (j + 1) * per_rank)

    def _full_rows(self):
        return dict(zip(INPUT_PARTS + CONV_PARTS,
                        (self.d_inner, self.d_inner, self.state_rows, self.state_rows, self.num_heads,
                         self.d_inner, self.state_rows, self.state_rows)))

    def pieces(self):
        """``(inputs, channels, outputs)``, each ``{name: (dim, shape per rank)}``."""
        D, H = self.tsp_size, self.hidden_size
        rows = {name: full // D for name, full in self._full_rows().items()}
        inputs = {f"{name}.weight": (0, (rows[name], H)) for name in INPUT_PARTS}
        if self.proj_bias:
            inputs.update({f"{name}.bias": (0, (rows[name],)) for name in INPUT_PARTS})
        channels = {f"{name}.weight": (0, (rows[name], 1, self.conv_kernel)) for name in CONV_PARTS}
        if self.conv_bias:
            channels.update({f"{name}.bias": (0, (rows[name],)) for name in CONV_PARTS})
        channels.update({name: (0, (self.heads,)) for name in HEAD_TENSORS})
        return inputs, channels, {"out_proj.weight": (1, (H, self.heads * self.head_dim))}

    def hf_rows(self):
        """Where the logical tensors lie in Hugging Face's fused ``in_proj`` and ``conv1d``."""
        return FusedRows.of({"in_proj": INPUT_PARTS, "conv1d": CONV_PARTS}, self._full_rows())

    def replicated_names(self):
        """Hugging Face names of the tensors every rank holds whole."""
        return (["norm.weight"] if self.norm else []) + (["out_proj.bias"] if self.out_bias else [])
