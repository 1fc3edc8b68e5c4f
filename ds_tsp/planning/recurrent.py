"""The recurrent token mixers the planner models (DESIGN.md 6j, 6n), a class
a kind, each holding its sizes and what it costs: the weights TSP (and TP)
split by head and those every rank keeps whole, the forward FLOPs a token,
what a Hugging Face layer saves a token, what a TSP rank's backward holds,
and what Megatron-style context parallelism moves by head all-to-all. Their
TSP bytes by op are ``communication.recurrent_bytes_by_op``'s.

* ``GatedDeltaNet`` (Qwen3-Next, Qwen3.5) and ``KimiDeltaAttention`` (Kimi
  Linear's KDA, a decay per key channel): TSP broadcasts one head group's
  weights at a time, as attention does, and every rank runs that group over
  its own tokens, exchanging the chunks' state maps
  (``ds_tsp.blocks.linear.schedule``).
* ``Mamba2`` (Nemotron-H, Granite-4.0-H, Bamba), ``Mamba1`` (Jamba) and
  ``ShortConvolution`` (LFM2): TSP broadcasts a rank's pieces (input rows,
  per-channel tensors, output columns) and every rank runs every head (or
  channel) over its own tokens at once, Mamba-2's gated norm over
  ``d_inner / n_groups`` staying local (``ds_tsp.blocks.linear.streamed``).

A Hugging Face layer's saved tensors are estimates from the kernels a
training run takes (flash-linear-attention's, ``mamba_ssm``'s fused
``mamba_split_conv1d_scan_combined``), not measured here: the CPU runs their
torch fallbacks. A TSP rank's backward buffers are counted from ds_tsp's own
torch code. Imports no torch."""

from dataclasses import dataclass

FLOAT32 = 4


@dataclass(frozen=True)
class GatedDeltaNet:
    """A Gated DeltaNet layer: ``num_key_heads`` query and key heads of ``key_head_dim``, ``num_value_heads``
    value heads of ``value_head_dim``, a causal convolution of ``conv_kernel`` taps over q, k and v, the
    delta rule by chunks of ``chunk_size`` tokens."""

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    chunk_size: int = 64

    kind = "Gated DeltaNet"
    head_all_to_all = True  # Megatron-style context parallelism can move its heads

    @property
    def keys(self):
        return self.num_key_heads * self.key_head_dim

    @property
    def values(self):
        return self.num_value_heads * self.value_head_dim

    @property
    def params(self):
        """The weights TSP (and TP) split by head: the input projections (queries, keys, values, the output gate
        ``z`` and ``b``, ``a``), the convolution's channels, ``A_log``, ``dt_bias`` and ``out_proj``."""
        H, nv, keys, values = self.hidden_size, self.num_value_heads, self.keys, self.values
        return H * (2 * keys + 2 * values + 2 * nv) + (2 * keys + values) * self.conv_kernel + 2 * nv + values * H

    @property
    def replicated_tensors(self):
        """The whole tensors: the gated norm, one value head's width."""
        return [self.value_head_dim]

    @property
    def matmul_params(self):
        """The weights a token multiplies by (FLOPs ``2 x`` a token, forward)."""
        return self.params

    def describe(self):
        return (f"{self.kind} (linear attention: {self.num_key_heads} key heads of {self.key_head_dim}, "
                f"{self.num_value_heads} value heads of {self.value_head_dim}, a {self.conv_kernel}-tap convolution)")

    def shape_problem(self, ranks, tsp=True):
        """Why ``ranks`` (TSP's, else TP's or a head all-to-all's) cannot split the layer by head, or None."""
        if self.num_key_heads % ranks:
            return (f"linear_num_key_heads {self.num_key_heads} is not divisible by {ranks}: a rank owns whole "
                    f"key heads of the {self.kind} layers")
        if self.num_value_heads % self.num_key_heads:
            return (f"linear_num_value_heads {self.num_value_heads} is not a multiple of linear_num_key_heads "
                    f"{self.num_key_heads}")
        return None

    def rule_flops_per_token(self, maps=False):
        """Forward FLOPs a token costs the delta rule, per value head as Hugging Face's
        ``torch_chunk_gated_delta_rule`` chunks it (``C`` tokens): the UT system and the intra-chunk scores
        (``2 C dk`` each), the two triangular solves (``C (dk + dv)``), the intra-chunk attention (``2 C dv``),
        the state read twice and written (``6 dk dv``). ``maps``: also each chunk's state map ``(T, U)`` and its
        composition into its span's (``ds_tsp.blocks.linear.delta_rule.span_map``),
        ``2 dk (dk + dv) (1 + dk/C)``."""
        C, dk, dv = self.chunk_size, self.key_head_dim, self.value_head_dim
        rule = C * (5 * dk + 3 * dv) + 6 * dk * dv
        span = 2 * dk * (dk + dv) * (1 + dk / C) if maps else 0
        return self.num_value_heads * (rule + span)

    def hf_saved_per_token(self, e):
        """Bytes a Hugging Face layer saves per token, before its norm, with flash-linear-attention's kernels:
        the convolution's input and output (queries, keys, values), the rule's l2-normed queries and keys
        repeated to the value heads and their float32 1/norm, ``z``, ``beta``, the decay ``g`` and the softplus's
        input and output in float32, the UT transform's ``C`` values a token and value head (``A``), the rule's
        output, the gated norm's float32 1/rms and ``out_proj``'s input."""
        nv, dk, keys, values = self.num_value_heads, self.key_head_dim, self.keys, self.values
        return e * (4 * keys + 5 * values + 2 * nv * dk + (self.chunk_size + 1) * nv) + 6 * FLOAT32 * nv

    def tsp_backward_buffers(self, e, D, B, tokens, shard):
        """A TSP rank's backward buffers for one layer (``ds_tsp.blocks.linear.schedule``), by name: one head
        group's forward recomputed under autograd with its gradients, the group's gathered state maps and
        their initial-state gradients, the weight shards in flight."""
        k_heads, v_heads = self.num_key_heads // D, self.num_value_heads // D
        dk, dv = self.key_head_dim, self.value_head_dim
        keys, values = k_heads * dk, v_heads * dv
        state = max(e, FLOAT32)  # the rule runs in float32, or the model's dtype where wider
        # Per local token, each with its gradient: the group's projections (q, k, v, z, b, a) and the
        # convolution's inputs; the rule's chunk terms per value head: w, u, the decayed q and k, k and v times
        # beta, the chunk-wide UT system, decays and intra-chunk scores, and the state a chunk starts from.
        projections = e * (2 * keys + 2 * values + 2 * v_heads + 2 * keys + values)
        C = self.chunk_size
        chunk_terms = state * v_heads * (4 * dk + 2 * dv + 3 * C + dk * dv / C)
        return {"state_maps": state * 2 * D * B * v_heads * dk * (dk + 2 * dv),
                "head_group_local": 2 * tokens * (projections + chunk_terms),
                "linear_shards_in_flight": 2 * shard * e}

    def state_bytes(self, e):
        """What a sequence keeps between decode steps (``ds_tsp.inference``'s recurrent cache layers): the
        state, float32, and the convolution's last ``kernel - 1`` inputs, in the model's dtype."""
        return FLOAT32 * self.num_value_heads * self.key_head_dim * self.value_head_dim + \
            e * (2 * self.keys + self.values) * (self.conv_kernel - 1)

    def head_all_to_all_elements(self, c):
        """Elements a token sends and receives in a head all-to-all over ``c`` ranks (Megatron-style context
        parallelism): the projections in (q, k, v, z, b, a), the gated output back."""
        return 2 * self.keys + 2 * self.values + 2 * self.num_value_heads + self.values


@dataclass(frozen=True)
class KimiDeltaAttention(GatedDeltaNet):
    """Kimi Linear's KDA: ``num_heads`` heads of ``head_dim`` (as query, key and value heads), the delta rule
    decaying per key channel, its forget and output gates low-rank (``f_a_proj``/``g_a_proj`` down to
    ``head_dim``, kept whole on every rank; ``f_b_proj``/``g_b_proj`` up, split by head)."""

    kind = "KDA"

    @classmethod
    def of(cls, hidden_size, num_heads, head_dim, conv_kernel):
        return cls(hidden_size, num_heads, num_heads, head_dim, head_dim, conv_kernel)

    @property
    def params(self):
        """The weights split by head: q, k, v (and their convolutions), ``f_b_proj``, ``g_b_proj``, ``dt_bias``
        a channel, ``A_log`` and ``b_proj`` a head, ``o_proj``."""
        H, heads, rows, d = self.hidden_size, self.num_value_heads, self.values, self.value_head_dim
        return 3 * H * rows + 3 * rows * self.conv_kernel + 2 * rows * d + rows + heads + heads * H + H * rows

    @property
    def replicated_tensors(self):
        """The whole tensors: the gates' down projections and the gated norm (one head's width)."""
        return [self.hidden_size * self.value_head_dim] * 2 + [self.value_head_dim]

    @property
    def matmul_params(self):
        return self.params + 2 * self.hidden_size * self.value_head_dim

    def describe(self):
        return (f"{self.kind} ({self.num_value_heads} heads of {self.value_head_dim}, a decay per key channel, "
                f"a {self.conv_kernel}-tap convolution)")

    def shape_problem(self, ranks, tsp=True):
        if self.num_value_heads % ranks:
            return (f"linear_attn_config num_heads {self.num_value_heads} is not divisible by {ranks}: a rank "
                    f"owns whole heads of the {self.kind} layers")
        return None

    def hf_saved_per_token(self, e):
        """Gated DeltaNet's, with the decay a float32 per key channel and the gates' low-rank activations."""
        return super().hf_saved_per_token(e) + FLOAT32 * (self.keys - self.num_value_heads) \
            + 2 * e * self.value_head_dim

    def tsp_backward_buffers(self, e, D, B, tokens, shard):
        """Gated DeltaNet's, with the decay per key channel (float32, with its gradient) and the gates'
        low-rank activations."""
        buffers = super().tsp_backward_buffers(e, D, B, tokens, shard)
        per_channel = max(e, FLOAT32) * self.keys // D + 2 * e * self.value_head_dim
        buffers["head_group_local"] += 2 * tokens * per_channel
        return buffers

    def head_all_to_all_elements(self, c):
        """q, k, v, the per-channel decay, the output gate and ``beta`` in; the gated output back."""
        return 5 * self.keys + self.num_value_heads + self.values


@dataclass(frozen=True)
class Mamba2:
    """A Mamba-2 mixer: ``num_heads`` heads of ``head_dim`` (``d_inner``), ``n_groups`` groups of B and C rows of
    ``state_size``, a depthwise convolution of ``conv_kernel`` taps over x, B and C, SSD by chunks of
    ``chunk_size``; ``conv_bias``, ``proj_bias`` (``in_proj``'s, and ``out_proj``'s kept whole) and the gated
    RMSNorm over ``d_inner / n_groups`` (``norm``, its weight kept whole)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int = 256
    conv_bias: bool = True
    proj_bias: bool = False
    norm: bool = True

    kind = "Mamba-2"
    head_all_to_all = True

    @property
    def d_inner(self):
        return self.num_heads * self.head_dim

    @property
    def state_rows(self):
        """B's (and C's) rows: ``n_groups x state_size``."""
        return self.n_groups * self.state_size

    @property
    def params(self):
        """The weights split over TSP's pieces: ``in_proj`` (z, x, B, C, dt), the convolution, ``dt_bias``,
        ``A_log`` and ``D``, ``out_proj``."""
        H, di, bc, nh = self.hidden_size, self.d_inner, self.state_rows, self.num_heads
        return (H + self.proj_bias) * (2 * di + 2 * bc + nh) + (self.conv_kernel + self.conv_bias) * (di + 2 * bc) \
            + 3 * nh + di * H

    @property
    def replicated_tensors(self):
        return ([self.d_inner] if self.norm else []) + ([self.hidden_size] if self.proj_bias else [])

    @property
    def matmul_params(self):
        return self.params

    def describe(self):
        groups = f"{self.n_groups} groups" if self.n_groups > 1 else "one group"
        return (f"{self.kind} ({self.num_heads} heads of {self.head_dim}, {groups} of state {self.state_size}, "
                f"a {self.conv_kernel}-tap convolution, chunks of {self.chunk_size})")

    def shape_problem(self, ranks, tsp=True):
        """Why ``ranks`` cannot split the mixer (``mamba2_shards.Mamba2Shapes``'s rules; for TP and a head
        all-to-all, ``tsp`` false, whole heads a rank), or None."""
        if self.num_heads % ranks:
            return f"mamba_n_heads {self.num_heads} is not divisible by {ranks}: a rank owns whole heads"
        if tsp and self.state_rows % ranks:
            return (f"n_groups x ssm_state_size = {self.state_rows} is not divisible by {ranks}: a rank owns 1/D "
                    "of the B and C rows")
        return None

    def rule_flops_per_token(self, maps=False):
        """Forward FLOPs a token costs SSD as Hugging Face's torch path and ds_tsp chunk it (B and C repeated to
        the heads), per head: the intra-chunk scores and outputs (``2 C (n + p)``), the chunk state written and
        read (``4 n p``); and the depthwise convolution (``2 k`` a channel). ``maps``: also the span's map,
        each chunk's state composed once more (``2 n p / C``)."""
        C, n, p = self.chunk_size, self.state_size, self.head_dim
        per_head = 2 * C * (n + p) + 4 * n * p + (2 * n * p / C if maps else 0)
        return self.num_heads * per_head + 2 * self.conv_kernel * (self.d_inner + 2 * self.state_rows)

    def hf_saved_per_token(self, e):
        """Bytes a Hugging Face mixer saves per token with ``mamba_ssm``'s fused
        ``mamba_split_conv1d_scan_combined`` (convolution, scan, gated norm and ``out_proj`` recomputed in
        backward): ``in_proj``'s output (z, x, B, C, dt), the scan's output and the norm's float32 1/rms a
        group."""
        return e * (3 * self.d_inner + 2 * self.state_rows + self.num_heads) + FLOAT32 * self.n_groups

    def tsp_backward_buffers(self, e, D, B, tokens, shard):
        """A TSP rank's backward buffers for one mixer (``ds_tsp.blocks.linear.streamed``): its forward over
        every head of the local tokens recomputed under autograd, each tensor with its gradient; every rank's
        chunks' state maps and their gradients; the pieces in flight."""
        di, bc, nh, n = self.d_inner, self.state_rows, self.num_heads, self.state_size
        wide = max(e, FLOAT32)  # SSD runs in float32, or the model's dtype where wider
        # In the model's dtype: in_proj's output, the convolution's output and its activation. In float32: B
        # and C repeated to the heads, x, dt x, the decays; the chunk terms (decayed C and B, the intra-chunk
        # weights and decays, C values a head and token each), the output and the gated norm's input and output.
        projections = e * (2 * di + 2 * bc + nh + 2 * (di + 2 * bc))
        ssd = wide * (4 * nh * n + 2 * nh * self.chunk_size + 5 * di + nh)
        maps = 2 * D * B * nh * (1 + n * self.head_dim) + 2 * D * B * nh * n * self.head_dim
        inputs = (self.hidden_size + self.proj_bias) * (2 * di + 2 * bc + nh) // D  # the largest piece
        return {"state_maps": wide * maps,
                "head_group_local": 2 * tokens * (projections + ssd),  # the group: every head
                "linear_shards_in_flight": 2 * inputs * e}

    def state_bytes(self, e):
        """The SSM state (``n x p`` a head, float32) and the convolution's last ``kernel - 1`` inputs."""
        return FLOAT32 * self.num_heads * self.state_size * self.head_dim + \
            e * (self.d_inner + 2 * self.state_rows) * (self.conv_kernel - 1)

    def head_all_to_all_elements(self, c):
        """Megatron's Mamba context parallelism (``MambaContextParallel``): z, x, B and C (each group repeated
        to ``c`` where there are fewer) and dt to the head split, the scan's output back."""
        return 2 * self.d_inner + 2 * max(self.n_groups, c) * self.state_size + self.num_heads + self.d_inner


@dataclass(frozen=True)
class Mamba1:
    """Jamba's Mamba-1 mixer: ``d_inner`` channels, each with ``state_size`` decays, a depthwise convolution of
    ``conv_kernel`` taps, ``x_proj`` down to ``dt_rank + 2 state_size`` (its dt, B and C, normed by whole
    RMSNorms where ``inner_norms``), ``dt_proj`` back up; ``conv_bias``, ``proj_bias`` (``in_proj``'s, and
    ``out_proj``'s kept whole). TSP splits the channels (``ds_tsp.blocks.linear.mamba1``)."""

    hidden_size: int
    d_inner: int
    state_size: int
    dt_rank: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    inner_norms: bool = True

    kind = "Mamba-1"
    head_all_to_all = False  # x_proj mixes every channel: no head (channel) split without a reduction

    @property
    def params(self):
        """The weights split by channel: ``in_proj``'s x and z rows, the convolution, ``x_proj``'s columns,
        ``dt_proj`` (and its bias), ``A_log``, ``D``, ``out_proj``'s columns."""
        H, di, n, r = self.hidden_size, self.d_inner, self.state_size, self.dt_rank
        return (H + self.proj_bias) * 2 * di + (self.conv_kernel + self.conv_bias) * di + di * (r + 2 * n) \
            + (r + 1) * di + di * n + di + di * H

    @property
    def replicated_tensors(self):
        return ([self.dt_rank, self.state_size, self.state_size] if self.inner_norms else []) + \
            ([self.hidden_size] if self.proj_bias else [])

    @property
    def matmul_params(self):
        return self.params

    def describe(self):
        return (f"{self.kind} ({self.d_inner} channels of state {self.state_size}, dt rank {self.dt_rank}, a "
                f"{self.conv_kernel}-tap convolution)")

    def shape_problem(self, ranks, tsp=True):
        if self.d_inner % ranks:
            return (f"mamba_expand x hidden_size = {self.d_inner} is not divisible by {ranks}: a rank owns 1/D of "
                    f"the {self.kind} channels")
        return None

    def rule_flops_per_token(self, maps=False):
        """The selective scan a channel: the decay and input terms, the state's update and its read-out
        (``6 n``), and the depthwise convolution (``2 k``)."""
        return self.d_inner * (6 * self.state_size + 2 * self.conv_kernel)

    def hf_saved_per_token(self, e):
        """Bytes a Hugging Face mixer saves per token with ``mamba_ssm``'s kernels (an estimate from their
        code): ``in_proj``'s x and z, the convolution's output, ``x_proj``'s output and the normed dt, B, C
        (float32 1/rms each), dt, the scan's output and ``out_proj``'s input."""
        di, n, r = self.d_inner, self.state_size, self.dt_rank
        return e * (6 * di + 2 * (r + 2 * n)) + FLOAT32 * 3

    def state_bytes(self, e):
        """The state (``n`` a channel, float32) and the convolution's last ``kernel - 1`` inputs."""
        return FLOAT32 * self.d_inner * self.state_size + e * self.d_inner * (self.conv_kernel - 1)

    def tsp_backward_buffers(self, e, D, B, tokens, shard):
        """A TSP rank's backward buffers for one mixer (``ds_tsp.blocks.linear.mamba1``): its forward over every
        channel of the local tokens recomputed under autograd with its gradients, Hugging Face's scan keeping
        the discretised decay, input and state a channel and state entry per token (float32); every rank's
        chunks' maps (an elementwise T and a U of ``d_inner x n``) and their gradients; the pieces in
        flight."""
        di, n, r = self.d_inner, self.state_size, self.dt_rank
        wide = max(e, FLOAT32)
        projections = e * (2 * di + 2 * di + (r + 2 * n) + di)
        scan = wide * (3 * di * n + 4 * di)
        inputs = (self.hidden_size + self.proj_bias) * 2 * di // D
        return {"state_maps": wide * D * 2 * B * 3 * di * n,
                "head_group_local": 2 * tokens * (projections + scan),  # the group: every channel
                "linear_shards_in_flight": 2 * inputs * e}


@dataclass(frozen=True)
class ShortConvolution:
    """LFM's gated short convolution: ``C * conv(B * x)`` over the ``hidden_size`` channels, ``in_proj`` making
    B, C and x, a depthwise convolution of ``conv_kernel`` taps, ``out_proj``; ``bias`` on all three
    (``out_proj``'s kept whole). TSP splits the channels (``ds_tsp.blocks.linear.short_conv``)."""

    hidden_size: int
    conv_kernel: int
    bias: bool = False

    kind = "short convolution"
    head_all_to_all = True

    @property
    def params(self):
        H, b = self.hidden_size, self.bias
        return (H + b) * 3 * H + (self.conv_kernel + b) * H + H * H

    @property
    def replicated_tensors(self):
        return [self.hidden_size] if self.bias else []

    @property
    def matmul_params(self):
        return self.params

    def describe(self):
        return f"gated short convolution ({self.hidden_size} channels, {self.conv_kernel} taps)"

    def shape_problem(self, ranks, tsp=True):
        if self.hidden_size % ranks:
            return (f"hidden_size {self.hidden_size} is not divisible by {ranks}: a rank owns 1/D of the "
                    f"{self.kind}'s channels")
        return None

    def rule_flops_per_token(self, maps=False):
        """The convolution (``2 k`` a channel) and the two gates."""
        return self.hidden_size * (2 * self.conv_kernel + 2)

    def hf_saved_per_token(self, e):
        """``in_proj``'s B, C and x, ``B x``, the convolution's output and ``out_proj``'s input."""
        return 6 * e * self.hidden_size

    def tsp_backward_buffers(self, e, D, B, tokens, shard):
        """Every channel of the local tokens recomputed under autograd with its gradients, the gathered halos
        (no state maps), the pieces in flight."""
        H = self.hidden_size
        return {"state_maps": e * 2 * D * B * (self.conv_kernel - 1) * H,  # the halos: a convolution's only state
                "head_group_local": 2 * tokens * 6 * e * H,
                "linear_shards_in_flight": 2 * (H + self.bias) * 3 * H // D * e}

    def state_bytes(self, e):
        """The convolution's window: ``kernel`` inputs a channel (Hugging Face's ``conv_L_cache``)."""
        return e * self.hidden_size * self.conv_kernel

    def head_all_to_all_elements(self, c):
        """B, C and x to the channel split, the gated output back."""
        return 4 * self.hidden_size
