"""How attention's heads split over a TSP group (DESIGN.md section 4).

Rank ``j`` owns query heads ``[j*nq/D, (j+1)*nq/D)``, the key/value heads
they use (stored once, on the first rank of the heads that share them, when
``nkv < D``) and the matching columns of ``o_proj``, packed in one flat
buffer: which rows of which Hugging Face tensor that is, for the TSP
attention, its checkpoints and the planner.
"""

from dataclasses import dataclass

from ds_tsp.blocks.packing import PackSpec


@dataclass(frozen=True)
class HeadGroups:
    """How query and key/value heads split over a TSP group of ``tsp_size``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    tsp_size: int
    # Qwen3-Next's and Qwen3.5's output gate: q_proj yields each head's query and gate, 2 * head_dim rows a head.
    output_gate: bool = False

    def __post_init__(self):
        D, nq, nkv = self.tsp_size, self.num_heads, self.num_kv_heads
        if nq % D:
            raise ValueError(f"num_attention_heads = {nq} is not divisible by tsp.size = {D}: "
                             f"choose tsp.size from the divisors of {nq}")
        if nq % nkv:
            raise ValueError(f"num_attention_heads = {nq} is not a multiple of num_key_value_heads = {nkv}")
        if nkv >= D and nkv % D:
            raise ValueError(f"num_key_value_heads = {nkv} is not divisible by tsp.size = {D}: "
                             f"choose tsp.size dividing {nkv}")
        if nkv < D and D % nkv:
            raise ValueError(f"num_key_value_heads = {nkv} < tsp.size = {D} needs tsp.size to be a multiple of "
                             f"{nkv} so each key/value head can be replicated to whole head groups")

    @property
    def q_heads(self):
        """Query heads per rank."""
        return self.num_heads // self.tsp_size

    @property
    def kv_heads(self):
        """Key/value heads per rank (1 when they are replicated)."""
        return max(self.num_kv_heads // self.tsp_size, 1)

    @property
    def kv_replicas(self):
        """How many consecutive head groups share the same key/value heads."""
        return max(self.tsp_size // self.num_kv_heads, 1)

    def kv_holder(self, tsp_rank):
        """The rank that stores the key/value heads ``tsp_rank``'s queries use:
        the first of its replica set, so each head is stored (and counted in
        gradient norms) exactly once."""
        return tsp_rank - tsp_rank % self.kv_replicas

    def holds_kv(self, tsp_rank):
        return self.kv_holder(tsp_rank) == tsp_rank

    @property
    def q_width(self):
        """Rows of q_proj a head holds: its query, and its gate where there is an output gate."""
        return 2 * self.head_dim if self.output_gate else self.head_dim

    def q_rows(self, tsp_rank):
        """Columns of o_proj owned by ``tsp_rank`` (and rows of q_proj without an output gate)."""
        size = self.q_heads * self.head_dim
        return slice(tsp_rank * size, (tsp_rank + 1) * size)

    def q_proj_rows(self, tsp_rank):
        """Rows of q_proj owned by ``tsp_rank``."""
        size = self.q_heads * self.q_width
        return slice(tsp_rank * size, (tsp_rank + 1) * size)

    def kv_rows(self, tsp_rank):
        """Rows of k_proj/v_proj held by ``tsp_rank``."""
        first = tsp_rank * self.num_kv_heads // self.tsp_size
        return slice(first * self.head_dim, (first + self.kv_heads) * self.head_dim)

    def kv_head_slice(self, tsp_rank):
        """The key/value heads (among all ``num_kv_heads``) held by ``tsp_rank``."""
        first = self.kv_rows(tsp_rank).start // self.head_dim
        return slice(first, first + self.kv_heads)

    def rows(self, name, tsp_rank):
        if name == "sinks" or name.startswith("g_proj"):  # one per query head
            return slice(tsp_rank * self.q_heads, (tsp_rank + 1) * self.q_heads)
        if name.startswith("q_proj"):
            return self.q_proj_rows(tsp_rank)
        return self.q_rows(tsp_rank) if name.startswith("o_proj") else self.kv_rows(tsp_rank)

    def holds(self, name, tsp_rank):
        return name.startswith(("q_proj", "o_proj", "sinks", "g_proj")) or self.holds_kv(tsp_rank)


# Which dim of each full Hugging Face tensor is split (o_proj.bias is replicated); GPT-OSS's
# attention sinks, one logit per query head, and LFM3's head gate, one row per query head, go with their heads.
SHARD_DIMS = {"q_proj.weight": 0, "q_proj.bias": 0, "o_proj.weight": 1, "sinks": 0, "g_proj.weight": 0,
              "k_proj.weight": 0, "k_proj.bias": 0, "v_proj.weight": 0, "v_proj.bias": 0}


def shard_spec(heads, hidden_size, qkv_bias, tsp_rank, sinks=False, values=True, keys=True, head_gate=False):
    """Rank ``tsp_rank``'s packed shard: its query heads, ``o_proj`` columns,
    (``sinks``) its heads' sink logits and (``head_gate``) their rows of the
    gate projection ``g_proj`` (LFM3's: one sigmoid gate a head), then, on the rank that holds them, its
    key/value heads (a contiguous tail, so the key/value gradient can be
    reduced on its own); without ``values`` (keys used as values, Gemma 4's
    full layers) no ``v_proj``, without ``keys`` (a layer attending to an
    earlier layer's keys and values, Gemma 4's shared ones) neither."""
    q, kv = heads.q_heads * heads.head_dim, heads.kv_heads * heads.head_dim
    q_proj = heads.q_heads * heads.q_width
    shapes = {"q_proj.weight": (q_proj, hidden_size), "q_proj.bias": (q_proj,), "o_proj.weight": (hidden_size, q),
              "sinks": (heads.q_heads,), "g_proj.weight": (heads.q_heads, hidden_size),
              "k_proj.weight": (kv, hidden_size), "k_proj.bias": (kv,),
              "v_proj.weight": (kv, hidden_size), "v_proj.bias": (kv,)}
    return PackSpec({name: shape for name, shape in shapes.items()
                     if (qkv_bias or not name.endswith("bias")) and (sinks or name != "sinks")
                     and (head_gate or name != "g_proj.weight")
                     and (values or not name.startswith("v_proj"))
                     and (keys or not name.startswith(("k_proj", "v_proj")))
                     and heads.holds(name, tsp_rank)})


def shard_piece(heads, name, tsp_rank):
    """``(dim, start, length)`` of the full tensor ``name`` (e.g. ``k_proj.weight``)
    that ``tsp_rank``'s rows are, or None if it is not split."""
    if name not in SHARD_DIMS:
        return None
    rows = heads.rows(name, tsp_rank)
    return SHARD_DIMS[name], rows.start, rows.stop - rows.start


def slice_full_tensor(name, full, heads, tsp_rank):
    """This rank's part of a full Hugging Face tensor ``name`` (e.g. ``k_proj.weight``)."""
    rows = heads.rows(name, tsp_rank)
    return full.narrow(SHARD_DIMS[name], rows.start, rows.stop - rows.start)
