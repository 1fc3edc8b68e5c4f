"""How multi-head latent attention's weights split over a TSP group (DESIGN.md 6i).

Rank ``j`` holds two pieces, packed in one flat buffer, down piece first:

* the down projections' output rows ``[j*n/D, (j+1)*n/D)`` of ``q_a_proj``
  (``n = q_lora_rank``) and of ``kv_a_proj_with_mqa`` (``n = kv_lora_rank +
  qk_rope_head_dim``), with their biases: every rank needs every row for its
  own tokens, so these go to all ranks once per pass;
* head group ``j``: query heads ``[j*nq/D, (j+1)*nq/D)``, their rows of
  ``q_b_proj`` (or of ``q_proj`` when ``q_lora_rank`` is None) and of
  ``kv_b_proj``, and their columns of ``o_proj``.

A layer with a lightning indexer (DeepSeek-V3.2's sparse attention, DESIGN.md
6o) adds a third piece, its query and key projections' output rows
``[j*n/D, (j+1)*n/D)`` of ``indexer.wq_b`` (``n = index_n_heads *
index_head_dim``) and ``indexer.wk`` (``n = index_head_dim``): like the down
pieces every rank needs every row for its own tokens, but only in forward
(the indexer takes no gradient).

A head group also holds its heads' rows of an output gate (HY-V4's
``gate_proj``: one sigmoid a value channel) and their sink logits (``sinks``)
where the layer has them.

The latent norms, ``o_proj``'s bias, the indexer's key norm and its head
weights (``weights_proj``, float32 in Hugging Face's checkpoints) are small and
kept whole on every rank.
"""

from dataclasses import dataclass

from ds_tsp.blocks.packing import PackSpec

DOWN_PROJECTIONS = ("q_a_proj", "kv_a_proj_with_mqa")
INDEXER_PROJECTIONS = ("indexer.wq_b", "indexer.wk")
# Which dim of each full Hugging Face tensor is split.
SHARD_DIMS = {"q_a_proj.weight": 0, "q_a_proj.bias": 0, "kv_a_proj_with_mqa.weight": 0,
              "kv_a_proj_with_mqa.bias": 0, "q_proj.weight": 0, "q_b_proj.weight": 0, "kv_b_proj.weight": 0,
              "o_proj.weight": 1, "indexer.wq_b.weight": 0, "indexer.wk.weight": 0, "gate_proj.weight": 0, "sinks": 0}
REPLICATED = ("q_a_layernorm.weight", "kv_a_layernorm.weight", "o_proj.bias", "indexer.k_norm.weight",
              "indexer.k_norm.bias", "indexer.weights_proj.weight")


@dataclass(frozen=True)
class LatentShapes:
    """The sizes of one MLA layer, split over a TSP group of ``tsp_size``."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: queries straight from the hidden states (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    tsp_size: int
    down_bias: bool = False  # q_a_proj's and kv_a_proj_with_mqa's biases (attention_bias)
    index_heads: int = 0  # the lightning indexer's heads (index_n_heads); 0: the layer has no indexer of its own
    index_head_dim: int = 0
    head_gate: bool = False  # an output gate, v_head_dim sigmoids a head from the hidden states (HY-V4's gate_proj)
    sinks: bool = False  # a sink logit a head (HY-V4's)

    def __post_init__(self):
        D = self.tsp_size
        if self.num_heads % D:
            raise ValueError(f"num_attention_heads = {self.num_heads} is not divisible by tsp.size = {D}: "
                             f"choose tsp.size from the divisors of {self.num_heads}")
        if self.index_heads and self.q_lora_rank is None:
            raise ValueError("a lightning indexer reads the query latent (q_lora_rank), which this layer lacks")
        narrowest = min(n for n in (self.q_lora_rank, self.latent_width, self.index_head_dim or None)
                        if n is not None)
        if narrowest < D:
            raise ValueError(f"a down projection of {narrowest} rows cannot give each of tsp.size = {D} ranks "
                             "a row: choose a smaller tsp.size")

    @property
    def q_heads(self):
        """Query heads per rank."""
        return self.num_heads // self.tsp_size

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self):
        """What one token's keys and values are made from: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def query_projection(self):
        """The per-head query projection's Hugging Face name."""
        return "q_proj" if self.q_lora_rank is None else "q_b_proj"

    @property
    def indexed(self):
        """Whether the layer has a lightning indexer of its own."""
        return self.index_heads > 0

    def down_projections(self):
        return DOWN_PROJECTIONS if self.q_lora_rank is not None else DOWN_PROJECTIONS[1:]

    def rows(self, name, tsp_rank):
        """Rows (columns for ``o_proj``) of the full tensor ``name`` that ``tsp_rank`` holds."""
        projection = name.rpartition(".")[0] if name.startswith("indexer.") else name.split(".")[0]
        totals = {"q_a_proj": self.q_lora_rank, "kv_a_proj_with_mqa": self.latent_width,
                  "indexer.wq_b": self.index_heads * self.index_head_dim, "indexer.wk": self.index_head_dim}
        if projection in totals:
            total = totals[projection]
            return slice(tsp_rank * total // self.tsp_size, (tsp_rank + 1) * total // self.tsp_size)
        per_head = {"q_proj": self.qk_head_dim, "q_b_proj": self.qk_head_dim,
                    "kv_b_proj": self.qk_nope_head_dim + self.v_head_dim, "o_proj": self.v_head_dim,
                    "gate_proj": self.v_head_dim, "sinks": 1}[projection]
        size = self.q_heads * per_head
        return slice(tsp_rank * size, (tsp_rank + 1) * size)

    def specs(self, tsp_rank):
        """``(down piece, head group)`` PackSpecs of ``tsp_rank``'s shard, and its indexer piece where the layer
        has an indexer."""
        down = {}
        for projection in self.down_projections():
            rows = self.rows(projection, tsp_rank)
            down[f"{projection}.weight"] = (rows.stop - rows.start, self.hidden_size)
            if self.down_bias:
                down[f"{projection}.bias"] = (rows.stop - rows.start,)
        q_input = self.hidden_size if self.q_lora_rank is None else self.q_lora_rank
        heads = {f"{self.query_projection}.weight": (self.q_heads * self.qk_head_dim, q_input),
                 "kv_b_proj.weight": (self.q_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
                 "o_proj.weight": (self.hidden_size, self.q_heads * self.v_head_dim)}
        if self.head_gate:
            heads["gate_proj.weight"] = (self.q_heads * self.v_head_dim, self.hidden_size)
        if self.sinks:
            heads["sinks"] = (self.q_heads,)
        if not self.indexed:
            return PackSpec(down), PackSpec(heads)
        indexer = {}
        for projection, width in zip(INDEXER_PROJECTIONS, (self.q_lora_rank, self.hidden_size)):
            rows = self.rows(f"{projection}.weight", tsp_rank)
            indexer[f"{projection}.weight"] = (rows.stop - rows.start, width)
        return PackSpec(down), PackSpec(heads), PackSpec(indexer)


def shard_spec(shapes, tsp_rank):
    """The whole packed shard of ``tsp_rank``: its down piece, its head group, then its indexer piece if any."""
    return PackSpec({name: shape for spec in shapes.specs(tsp_rank) for name, shape in spec.shapes.items()})


def shard_piece(shapes, name, tsp_rank):
    """``(dim, start, length)`` of the full tensor ``name`` that ``tsp_rank`` holds, or None if whole."""
    if name not in SHARD_DIMS:
        return None
    rows = shapes.rows(name, tsp_rank)
    return SHARD_DIMS[name], rows.start, rows.stop - rows.start
