"""TSP attention's schedule: the broadcast of head-group shards, as plain
forward and backward functions and the autograd Function that runs them.

Rank ``j`` of a TSP group owns query heads ``[j*nq/D, (j+1)*nq/D)``, their
key/value heads and the matching columns of ``o_proj``, packed in one flat
buffer. For every owner ``j`` in turn, each rank receives shard ``j``, projects
its LOCAL tokens, rotates them at their GLOBAL positions, all-gathers K/V along
the sequence and attends causally; the partial outputs of the head groups sum
locally through ``o_proj``, so no all-reduce is needed.

Backward re-broadcasts the shards and re-gathers K/V. Where the local tokens
fit one token tile the forward keeps their queries, keys and values (1/D of
the sequence's, as the MLP keeps its gate and up projections); beyond, backward
projects them again, and only the local input and, with the fused backward,
each head group's output and log-sum-exp are saved. dK/dV are
reduce-scattered back to the token owners in the model's dtype and added in
float32. Each shard's weight gradient is reduced to its owner: partial sums
in float32 or wider, sent in ``precision.gradient_wire_dtype`` and added in the
wider dtype on arrival.

With ``tsp.overlap`` every collective of a head group is in flight under
another group's compute: the broadcast of shard ``j+1`` and the K/V
all-gather of group ``j+1`` under group ``j``'s attention, and in backward
the dK/dV reduce-scatter of group ``j`` and its weight-gradient reduce under
group ``j+1``'s attention backward. A rank holds at most two other owners'
weight-gradient buffers in flight (``ReducesInFlight``) besides its own and
the one it computes.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds_tsp.blocks.attention.head_groups import HeadGroups
from ds_tsp.blocks.input_norm import TiledInputNorm
from ds_tsp.blocks.rotary import NO_ROTARY, ROTATE_HALF, group_norm, norm_rows, rotate, rotate_backward, scale_queries
from ds_tsp.parallel import comm, layout, precision
from ds_tsp.parallel.amp import autocast_backward, autocast_forward
from ds_tsp.parallel.eager import EagerFunction


@dataclass(frozen=True)
class AttentionPlan:
    """Everything the schedule needs besides tensors."""

    group: object
    heads: HeadGroups
    specs: tuple  # the PackSpec of every rank's shard
    layout: str
    kernel: object
    scale: float
    window: int | None
    overlap: bool
    explicit_backward: bool  # save each head group's output and lse; run the fused backward
    query_blocks: list  # documents.query_blocks: which keys each query tile attends to
    fp32_accumulators: bool = True  # sum head groups and input gradients in float32 (or wider)
    grad_wire_dtype: object = None  # weight-gradient reduces' wire dtype (precision.gradient_wire_dtype; None: float32)
    q_norm: object = None  # q/k norms applied before the rotary embedding, replicated: per head (Qwen3,
    k_norm: object = None  # Gemma-3) or over the whole projection (OLMo-2: see ProjectionNormPiece)
    v_norm: object = None  # a weightless per-head norm of the values (Gemma 4's), or None
    values_from_keys: bool = False  # the values are the keys before their norm and rotary (Gemma 4's k_eq_v)
    # Keys and values shared across layers (Gemma 4's): "store" also returns the local tokens' keys and values,
    # "reuse" attends to those of an earlier layer (no key/value projections); None: neither.
    kv_sharing: str | None = None
    input_norm: object = None  # the layer's norm before the attention, run inside it (ds_tsp.blocks.input_norm)
    token_tile: int = 0  # tsp.token_tile: the input norm's tiles in backward
    rope: object = ROTATE_HALF  # the rotary convention (rotary.ROTATE_HALF, or the model's own ModelRotary)
    query_scale: object = None  # (B, S/D) factors of the local queries after the rotary (Ministral 3's), or None
    casts_query_scale: bool = True  # cast the factors to the queries' dtype first (rotary.scale_queries)
    # Keep the local tokens' projections for backward instead of projecting them again there (their tokens fit
    # one token tile, as the MLP keeps its gate and up projections).
    keep_projections: bool = False

    @property
    def tsp_size(self):
        return self.heads.tsp_size


def broadcast_stream(group, buffer, overlap):
    """Yield ``(j, buffer(j))`` for every rank ``j`` of ``group`` once ``j`` has
    broadcast it (``buffer(j)``: ``j``'s data on ``j``, an empty buffer of its
    size elsewhere); with ``overlap`` the broadcast of ``j+1`` is in flight
    while ``j``'s computes."""
    D = comm.group_size(group)

    def start(j):
        buf = buffer(j)
        return buf, comm.broadcast(buf, src=j, group=group, async_op=True)

    pending = start(0)
    for j in range(D):
        buf, work = pending
        if work is not None:
            work.wait()
        if overlap and j + 1 < D:
            pending = start(j + 1)
        yield j, buf
        if not overlap and j + 1 < D:
            pending = start(j + 1)


def shard_stream(plan, packed):
    """Yield ``(j, shard j)`` for every owner ``j``, as ``broadcast_stream``."""
    tsp_rank = comm.group_rank(plan.group)
    return broadcast_stream(plan.group, lambda j: packed.detach() if j == tsp_rank else
                            packed.new_empty(plan.specs[j].numel), plan.overlap)


def project(x, weights, name, heads_per_rank, head_dim):
    """``x`` ``(B, L, H)`` through projection ``name`` of a shard -> ``(B, L, heads, d)``."""
    out = F.linear(x, weights[f"{name}.weight"], weights.get(f"{name}.bias"))
    return out.view(*x.shape[:2], heads_per_rank, head_dim)


def queries(plan, q, norm, cos, sin):
    """The raw queries ``q`` ``(B, L, h, d)`` as attention sees them: normed,
    rotated and scaled by position where the model does (``plan.query_scale``)."""
    rotated = rotate(q, norm, cos, sin, plan.rope)
    return rotated if plan.query_scale is None else scale_queries(rotated, plan.query_scale, plan.casts_query_scale)


def queries_backward(plan, q, grad, norm, cos, sin):
    """``rotate_backward`` of ``queries`` for the raw queries ``q`` and the gradient ``grad`` of what attention saw."""
    if plan.query_scale is not None:
        grad = scale_queries(grad, plan.query_scale, plan.casts_query_scale)
    return rotate_backward(q, grad, norm, cos, sin, plan.rope)


def raw_values(plan, x_project, k):
    """The values of a key/value holder before their norm: its keys ``k``
    before theirs where the layer takes keys as values, else ``v_proj`` of its
    tokens (``x_project(name)``). ``plan``: the ``AttentionPlan``, or the
    ``TSPAttention`` in decoding (both carry ``v_norm`` and ``values_from_keys``)."""
    return k if plan.values_from_keys else x_project("v_proj")


def attended_values(plan, v):
    """The raw values ``v`` ``(B, L, h, d)`` as attention sees them: normed where the layer norms them."""
    return v if plan.v_norm is None else rotate(v, plan.v_norm, None, None, NO_ROTARY)


def attended_values_backward(plan, v, grad):
    """The gradient of the raw values ``v`` from that of ``attended_values(plan, v)``."""
    return grad if plan.v_norm is None else rotate_backward(v, grad, plan.v_norm, None, None, NO_ROTARY)[0]


def shared_heads(plan, shared, j):
    """Key/value holder ``j``'s heads of the local tokens' shared keys and values ``shared``
    ``(2, B, S/D, nkv, d)``: ``(k, v)``, each ``(B, S/D, kv_heads, d)``."""
    piece = shared[:, :, :, plan.heads.kv_head_slice(j)]
    return piece[0], piece[1]


def split_gate(q, head_dim):
    """``(queries, output gate)`` of a q projection ``(B, L, h, width)``: with
    an output gate each head's ``2 * head_dim`` rows are its query then its
    gate (Qwen3-Next's, Qwen3.5's); without one, ``(q, None)``."""
    if q.shape[-1] == head_dim:
        return q, None
    return q[..., :head_dim], q[..., head_dim:]


def gather_kv(plan, k, v):
    """Start the all-gather of the local ``k, v`` ``(B, S/D, h, d)``; the
    returned pending op's ``wait()`` gives the full-sequence ``K, V``
    ``(B, S, h, d)`` in natural order (one copy out of the gather buffer; at
    D=1 ``k, v`` themselves)."""
    if plan.tsp_size == 1:
        return comm.Pending(None, lambda: (k, v))
    gathered, work = comm.all_gather(torch.stack([k, v]), plan.group, async_op=True)  # (D, 2, B, S/D, h, d)

    def natural():
        full = layout.unshard(gathered, plan.tsp_size, plan.layout, dim=2)
        return full[0], full[1]

    return comm.Pending(work, natural)


def scatter_kv_grads(plan, dKV, dtype):
    """Start the reduce-scatter of the full-sequence ``dKV`` ``(2, B, S, h, d)``
    (this rank's sums of dK and dV, float32 or wider): sent in ``dtype`` (one
    copy into the ranks' order), added in float32 or wider on arrival; the
    pending op's ``wait()`` gives the local tokens' ``(dk, dv)`` in ``dtype``."""
    if plan.tsp_size == 1:
        own = dKV.to(dtype)
        return comm.Pending(None, lambda: (own[0], own[1]))
    stacked = layout.stack_shards(dKV, plan.tsp_size, plan.layout, dim=2, dtype=dtype)
    pending = comm.reduce_scatter_fp32(stacked, plan.group, async_op=True)

    def local():
        summed = pending.wait().to(dtype)
        return summed[0], summed[1]

    return comm.Pending(None, local)


def _cat(pieces, dim):
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _bidirectional(ahead):
    """A kernel's keyword for a bidirectional block (``documents.Block.ahead``);
    none for a causal one, so kernels that never meet one need not take it."""
    return {} if ahead is None else {"ahead": ahead}


def attend_local_chunks(plan, q, K, V, sinks=None):
    """Causal attention of this rank's queries over the full keys, block by
    block of ``plan.query_blocks``: each of this rank's two chunks (of ``2D``)
    attends to the key prefix that ends with itself, bottom-right aligned, so
    rows past it are never computed; with packed documents, each piece of a
    chunk attends from its document's start only.
    ``sinks``: the head group's sink logits ``(hq,)`` (``kernels.SinkKernel``), or None.
    Returns the output and, with ``plan.explicit_backward``, the log-sum-exp
    ``(B, hq, S/D)`` the fused backward needs (else None).
    """
    with_sinks = {} if sinks is None else {"sinks": sinks}
    outputs, lses = [], []
    for rows, blocks in plan.query_blocks:
        row_outputs, row_lses = [], []
        for q_lo, q_hi, k_lo, k_hi, ahead in blocks:
            q_block, K_block, V_block = q[rows, q_lo:q_hi], K[rows, k_lo:k_hi], V[rows, k_lo:k_hi]
            options = {**with_sinks, **_bidirectional(ahead)}
            if plan.explicit_backward:
                out, lse = plan.kernel.forward(q_block, K_block, V_block, plan.scale, **options)
                row_lses.append(lse)
            else:
                out, _ = plan.kernel.attend(q_block, K_block, V_block, plan.scale, plan.window, **options)
            row_outputs.append(out)
        outputs.append(_cat(row_outputs, 1))
        lses.append(_cat(row_lses, -1) if row_lses else None)
    return _cat(outputs, 0), _cat(lses, 0) if plan.explicit_backward else None


def attend_local_chunks_backward(plan, grad_o, q, K, V, o, lse, grad_K, grad_V, sinks=None):
    """``dq`` of ``attend_local_chunks`` from its saved output and lse, and the
    ``sinks``' gradient (None without them); the blocks' parts of ``dK, dV``
    are added to ``grad_K, grad_V`` (the head groups' full-sequence sums,
    float32 or wider), so no second full-sequence buffer exists."""
    grad_q, grad_sinks = [], None
    for rows, blocks in plan.query_blocks:
        row_grads = []
        for q_lo, q_hi, k_lo, k_hi, ahead in blocks:
            dq, dk, dv = plan.kernel.backward(grad_o[rows, q_lo:q_hi], q[rows, q_lo:q_hi], K[rows, k_lo:k_hi],
                                              V[rows, k_lo:k_hi], o[rows, q_lo:q_hi], lse[rows, :, q_lo:q_hi],
                                              plan.scale, **_bidirectional(ahead))
            row_grads.append(dq)
            if sinks is not None:
                part = plan.kernel.sink_gradient(grad_o[rows, q_lo:q_hi], o[rows, q_lo:q_hi], lse[rows, :, q_lo:q_hi],
                                                 sinks)
                grad_sinks = part if grad_sinks is None else grad_sinks + part
            grad_K[rows, k_lo:k_hi].add_(dk)
            grad_V[rows, k_lo:k_hi].add_(dv)
            del dk, dv  # a block's dK/dV (a full key prefix each) go before the next block's are made
        grad_q.append(_cat(row_grads, 1))
    return _cat(grad_q, 0), grad_sinks


def attention_forward(plan, x, packed, cos, sin, inv_rms=None, kv_sink=None, input_norm=None, shared=None):
    """Forward of one layer on the local tokens ``x`` ``(B, S/D, H)``;
    ``inv_rms``: with q/k norms over the whole projection, each local token's
    inverse RMS of q and of k (``{"q", "k"}``, ``projection_squares_forward``);
    ``input_norm``: a ``TiledInputNorm`` to apply to ``x`` first (``x`` is then
    the layer's input; its normed values are not kept).

    Key/value heads shared by a replica set of head groups (nkv < D) arrive
    with the set's first shard and are projected and gathered once for the set;
    ``kv_sink(k, v)``, if given, receives each set's rotated keys and values
    of the local tokens (a generation's prefill caches them).
    Returns the output ``(B, S/D, H)`` and what backward needs besides ``x``,
    of local tokens only, as lists (stacking would copy them): with
    ``plan.explicit_backward`` every head group's attention output
    ``(B, S/D, hq, d)`` and log-sum-exp ``(B, hq, S/D)``; with
    ``plan.keep_projections`` the local tokens' projections
    (``"projections"``: ``{(group, name): (B, S/D, heads, rows a head)}``).
    Without it queries, keys and values are not kept: backward projects them
    again from ``x`` with the shards it receives anyway.

    Keys and values shared across layers (``plan.kv_sharing``): a layer that
    reuses them takes each holder's from ``shared`` (the storing layer's local
    keys and values ``(2, B, S/D, nkv, d)``) instead of projecting and gathers
    them as its own; one that stores them returns them as a third value.
    """
    heads, d = plan.heads, plan.heads.head_dim
    if input_norm is not None:
        x = input_norm(x)
    # The head groups' outputs add up in float32 (or wider), cast once, unless
    # tsp.fp32_accumulators is off.
    out = torch.empty((x.shape[0] * x.shape[1], x.shape[2]), dtype=_accumulator_dtype(plan, x.dtype),
                      device=x.device)
    saved = {"o": [], "lse": [], "projections": {}}
    gathers = {}  # key/value holder -> its K/V all-gather in flight
    stored = []  # with plan.kv_sharing "store": every holder's local keys and values, in head order
    stream = shard_stream(plan, packed)

    def projected(j, w, name, num_heads, width=d):
        """Group ``j``'s projection ``name`` of the local tokens, kept for backward with ``plan.keep_projections``."""
        out = project(x, w, name, num_heads, width)
        if plan.keep_projections:
            saved["projections"][j, name] = out
        return out

    def receive():
        """The next shard's weights; a key/value holder's K/V gather starts at once."""
        j, shard = next(stream)
        w = plan.specs[j].unpack(shard)
        if heads.holds_kv(j):
            if plan.kv_sharing == "reuse":
                k_rotated, v = shared_heads(plan, shared, j)
            else:
                k = projected(j, w, "k_proj", heads.kv_heads)
                v = attended_values(plan, raw_values(plan, lambda name: projected(j, w, name, heads.kv_heads), k))
                k_rotated = rotate(k, group_norm(plan, "k", j, inv_rms), cos, sin, plan.rope)
            gathers[j] = gather_kv(plan, k_rotated, v)
            if kv_sink is not None:
                kv_sink(k_rotated, v)
            if plan.kv_sharing == "store":
                stored.append((k_rotated, v))
        return w

    upcoming = receive()
    for j in range(plan.tsp_size):
        w = upcoming
        if plan.overlap and j + 1 < plan.tsp_size:
            upcoming = receive()  # shard j+1 and its K/V gather travel under group j's attention
        if heads.holds_kv(j):
            K = V = None  # the previous set's K/V go before this one's are unpacked
            K, V = gathers.pop(j).wait()
        q, gate = split_gate(projected(j, w, "q_proj", heads.q_heads, heads.q_width), d)
        if "g_proj.weight" in w:  # one gate a head (LFM3's), from its own projection: (B, L, h, 1)
            gate = projected(j, w, "g_proj", heads.q_heads, 1)
        q_rotated = queries(plan, q, group_norm(plan, "q", j, inv_rms), cos, sin)
        o, lse = attend_local_chunks(plan, q_rotated, K, V, w.get("sinks"))
        gated = o if gate is None else o * torch.sigmoid(gate)
        precision.add_matmul(out, gated.flatten(2).flatten(0, 1), w["o_proj.weight"].t(), add=j > 0)
        if plan.explicit_backward:
            saved["o"].append(o), saved["lse"].append(lse)
        if not plan.overlap and j + 1 < plan.tsp_size:
            upcoming = receive()
    result = out.view(x.shape).to(x.dtype), {name: tensors for name, tensors in saved.items() if tensors}
    if plan.kv_sharing != "store":
        return result
    return (*result, torch.stack([torch.cat(parts, dim=2) for parts in zip(*stored)]))


def _accumulator_dtype(plan, dtype):
    return torch.promote_types(dtype, torch.float32) if plan.fp32_accumulators else dtype


class ReducesInFlight:
    """The weight-gradient reduces a rank starts to the shards' owners, each
    summed in float32 or wider and sent in the plan's gradient wire dtype.

    Another owner's buffer is this rank's only until its reduce is done: with
    ``plan.overlap`` at most ``limit`` of those are in flight, the oldest
    waited on when one more starts (it ran under the groups since), so a rank
    holds its own shard's gradient, ``limit`` sent ones and the one it
    computes, not one per head group. This rank's own sums are waited on in
    ``finish``. Without ``plan.overlap`` every reduce is finished at once."""

    def __init__(self, plan, limit=2):
        self.plan, self.limit, self.rank = plan, limit, comm.group_rank(plan.group)
        self.others, self.own = [], []  # pending reduces; this rank's: (part of its gradient, its reduce)

    def start(self, grad, owner):
        """Start the sum of ``grad`` at group rank ``owner``."""
        wire = precision.gradient_wire_dtype(self.plan.grad_wire_dtype, grad.dtype)
        pending = comm.reduce_fp32(grad, owner, self.plan.group, wire, async_op=True)
        if not self.plan.overlap:
            pending.wait()
        if owner == self.rank:
            self.own.append((grad, pending))
            return
        self.others.append(pending)
        while len(self.others) > self.limit:
            self.others.pop(0).wait()

    def finish(self):
        """Wait for every reduce; this rank's parts then hold their sums over the group."""
        while self.others:
            self.others.pop(0).wait()
        for piece, pending in self.own:
            summed = pending.wait()
            if summed is not piece:  # a reduce in place leaves the sum where it was
                piece.copy_(summed)


class Recomputation:
    """What backward projects again from the local tokens as the shards arrive
    a second time: each group's queries and, per key/value holder, its keys
    (kept for their gradient) and its K/V all-gather."""

    def __init__(self, plan, x, packed, cos, sin, inv_rms, input_norm, shared=None, kept=None):
        self.plan, self.x, self.cos, self.sin, self.inv_rms, self.input_norm = plan, x, cos, sin, inv_rms, input_norm
        self.shared = shared  # the keys and values a layer that reuses them attends to (attention_forward)
        self.kept = dict(kept or {})  # the forward's projections, {(group, name): tensor}: taken, not recomputed
        self.tokens = x.flatten(0, 1)  # (N, H)
        self.stream = shard_stream(plan, packed)
        self.gathers = {}  # key/value holder -> its K/V all-gather in flight
        self.keys = {}  # key/value holder -> its keys before the norm and rotary embedding
        self.values = {}  # key/value holder -> its values before their norm, where the layer norms them

    def project(self, j, w, name, num_heads, head_dim=None):
        """Group ``j``'s projection ``name`` of the local tokens, as the forward
        computed it (``head_dim``: rows a head, the heads' size by default): the
        forward's own where it kept it (dropped here), else projected again."""
        if (j, name) in self.kept:
            return self.kept.pop((j, name))
        head_dim = head_dim or self.plan.heads.head_dim
        if self.input_norm is None:
            return project(self.x, w, name, num_heads, head_dim)
        out = self.input_norm.project(self.tokens, w[f"{name}.weight"], w.get(f"{name}.bias"))
        return out.view(*self.x.shape[:2], num_heads, head_dim)

    def receive(self):
        """The next shard's weights; a key/value holder's keys and values are
        projected again and their gather starts at once."""
        plan, heads = self.plan, self.plan.heads
        j, shard = next(self.stream)
        w = plan.specs[j].unpack(shard)
        if heads.holds_kv(j) and plan.kv_sharing == "reuse":
            self.gathers[j] = gather_kv(plan, *shared_heads(plan, self.shared, j))
        elif heads.holds_kv(j):
            self.keys[j] = self.project(j, w, "k_proj", heads.kv_heads)
            v = raw_values(plan, lambda name: self.project(j, w, name, heads.kv_heads), self.keys[j])
            if plan.v_norm is not None:
                self.values[j] = v
            self.gathers[j] = gather_kv(plan, rotate(self.keys[j], group_norm(plan, "k", j, self.inv_rms), self.cos,
                                                     self.sin, plan.rope), attended_values(plan, v))
        return w

    def keys_backward(self, holder, dk):
        """``rotate_backward`` of the holder's keys, which are then dropped."""
        norm = group_norm(self.plan, "k", holder, self.inv_rms)
        return rotate_backward(self.keys.pop(holder), dk, norm, self.cos, self.sin, self.plan.rope)

    def values_backward(self, holder, dv):
        """The gradient of the holder's raw values (``attended_values_backward``), which are then dropped."""
        return attended_values_backward(self.plan, self.values.pop(holder, None), dv)


class HeadGroupGrads:
    """This rank's gradients in backward, summed over the head groups: of the
    local tokens, of every group's shard (a flat buffer laid out like the
    shard, so its reduce to the owner needs no packing), and of the q/k norms'
    weights and inverse RMS."""

    def __init__(self, plan, inputs, dtype):
        self.plan, self.inputs, self.tsp_rank = plan, inputs, comm.group_rank(plan.group)
        self.acc_dtype = torch.promote_types(dtype, torch.float32)
        self.x = torch.zeros(inputs.tokens.shape, dtype=_accumulator_dtype(plan, dtype), device=inputs.x.device)
        self.shards = {}  # group j -> this rank's partial gradient of shard j
        self.norm_weights, self.norm_inv_rms = {"q": None, "k": None}, {"q": None, "k": None}
        self.reduces = ReducesInFlight(plan)
        # Shared keys and values: a reusing layer's gradient of those it attended to; a storing layer's of those
        # it handed on (from the later layers), added to its own keys' and values'.
        self.shared = None

    def shard(self, j):
        """Views, by name, of shard ``j``'s gradient buffer (float32 or wider)."""
        if j not in self.shards:
            self.shards[j] = torch.empty(self.plan.specs[j].numel, dtype=self.acc_dtype, device=self.x.device)
        return self.plan.specs[j].unpack(self.shards[j])

    def add_input(self, grad):
        self.x.add_(grad.to(self.x.dtype))

    def add_projection(self, j, w, name, grad):
        """Group ``j``'s projection ``name`` of the local tokens, from its output's ``grad`` ``(N, rows)``:
        the input's gradient through it, and its weight's."""
        self.add_input(grad @ w[f"{name}.weight"])
        self.write_projection(j, name, grad)

    def write_projection(self, j, name, grad):
        """Projection ``name``'s weight (and bias) gradient from its output's ``grad``."""
        into, tokens, input_norm = self.shard(j), self.inputs.tokens, self.inputs.input_norm
        # Weight-gradient partials stay float32 until their sum over ranks is rounded.
        if input_norm is None:
            precision.partial_matmul(grad.t(), tokens, out=into[f"{name}.weight"], add=False)
        else:
            input_norm.weight_gradient(grad, tokens, into[f"{name}.weight"])
        if f"{name}.bias" in into:
            torch.sum(grad, 0, dtype=self.acc_dtype, out=into[f"{name}.bias"])

    def add_query_output(self, j, w, dq, o, grad_tokens):
        """Group ``j``'s query and output projections, from ``dq`` ``(N, hq*d)``,
        the attention output ``o`` and the layer's output gradient ``(N, H)``."""
        self.add_projection(j, w, "q_proj", dq)
        precision.partial_matmul(grad_tokens.t(), o.detach().flatten(0, 1).flatten(1), out=self.shard(j)["o_proj.weight"],
                            add=False)

    def add_norm(self, name, j, grad_weight, grad_inv_rms):
        """Head group ``j``'s part of the ``name`` norm's weight and inverse-RMS gradients."""
        if grad_weight is None:
            return
        if self.norm_weights[name] is None:
            norm = self.plan.q_norm if name == "q" else self.plan.k_norm
            self.norm_weights[name] = torch.zeros(norm.weight.shape, dtype=grad_weight.dtype,
                                                  device=grad_weight.device)
        self.norm_weights[name][norm_rows(self.plan, name, j, self.inputs.inv_rms is not None)] += grad_weight
        if grad_inv_rms is not None:
            summed = self.norm_inv_rms[name]
            self.norm_inv_rms[name] = grad_inv_rms if summed is None else summed + grad_inv_rms

    def reduce_part(self, j, part):
        """Send ``part`` (``"query/output"``, ``"key/value"`` or ``"all"``) of
        shard ``j``'s gradient buffer to its owner ``j``."""
        spec, flat = self.plan.specs[j], self.shards[j]
        kv_start = spec.offsets.get("k_proj.weight", spec.numel)  # the key/value heads are the tail
        piece = {"query/output": flat[:kv_start], "key/value": flat[kv_start:], "all": flat}[part]
        self.reduces.start(piece, j)
        if j != self.tsp_rank:  # its reduce holds it until done; a later key/value part gets a buffer of its own
            del self.shards[j]

    def add_kv_set(self, j, holder, kv_weights, scatter):
        """The replica set ending at group ``j``: its reduce-scattered dK/dV into
        the input gradient and the key/value weight gradients, which go to the
        holder (with ``j``'s own query/output part when ``j`` is the holder)."""
        dk, dv = scatter.wait()
        if self.plan.kv_sharing is not None:
            heads = self.plan.heads.kv_head_slice(holder)
            if self.plan.kv_sharing == "reuse":  # the keys and values are an earlier layer's: their gradient goes back
                self.shared[0][:, :, heads], self.shared[1][:, :, heads] = dk, dv
                if holder == j:
                    self.reduce_part(holder, "all")
                return
            dk, dv = dk + self.shared[0][:, :, heads], dv + self.shared[1][:, :, heads]
        dv = self.inputs.values_backward(holder, dv)
        dk, *grad_k_norm = self.inputs.keys_backward(holder, dk)
        self.add_norm("k", holder, *grad_k_norm)
        dk = dk.flatten(0, 1).flatten(1)
        dv = dv.flatten(0, 1).flatten(1)
        if self.plan.values_from_keys:  # one projection fed both
            dk = dk + dv
            self.add_input(dk @ kv_weights["k_proj.weight"])
        else:
            self.add_input(dk @ kv_weights["k_proj.weight"] + dv @ kv_weights["v_proj.weight"])
            self.write_projection(holder, "v_proj", dv)
        self.write_projection(holder, "k_proj", dk)
        self.reduce_part(holder, "all" if holder == j else "key/value")

    def own_shard(self):
        """This rank's shard gradient summed over ranks, once every reduce is done."""
        self.reduces.finish()
        return self.shards[self.tsp_rank]

    def input_grads(self):
        """The gradients of the local tokens (in their dtype) and of the input
        norm's weight (None without one); the accumulator is dropped."""
        grad, self.x = self.x, None
        x, input_norm = self.inputs.x, self.inputs.input_norm
        if input_norm is None:
            return grad.view(x.shape).to(x.dtype), None
        grad_x, grad_input_norm = input_norm.backward(self.inputs.tokens, grad)
        return grad_x.view(x.shape), grad_input_norm


def attend_backward(plan, grad_o, q, K, V, dKV, saved, j, sinks=None):
    """Group ``j``'s ``dq``, attention output and sinks' gradient (None
    without ``sinks``); its ``dK, dV`` are added to the replica set's sums ``dKV``."""
    if plan.explicit_backward:
        o = saved["o"][j]
        dq, grad_sinks = attend_local_chunks_backward(plan, grad_o, q, K, V, o, saved["lse"][j], dKV[0], dKV[1], sinks)
        return dq, o, grad_sinks
    # The kernel has no fused backward: autograd through a recomputed forward.
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, K, V) + (() if sinks is None else (sinks,))]
        o, _ = attend_local_chunks(plan, *leaves[:3], None if sinks is None else leaves[3])
        dq, dK, dV, *d_sinks = torch.autograd.grad(o, leaves, grad_o)
    dKV[0].add_(dK)
    dKV[1].add_(dV)
    return dq, o, d_sinks[0] if d_sinks else None


def attention_backward(plan, grad_out, x, packed, saved, cos, sin, inv_rms=None, input_norm=None, shared=None,
                       grad_shared=None):
    """Gradients of the local tokens ``x``, this rank's packed shard, the q/k
    norms' weights and inverse RMS, the ``input_norm``'s weight and the shared
    keys and values (None where absent). Per head group: re-broadcast its shard, project again, attend
    backward; a replica set's dK/dV sums are reduce-scattered once the set is
    complete and, with ``plan.overlap``, finished under the next group's compute.
    ``shared``: the keys and values a reusing layer attended to; ``grad_shared``:
    the gradient of those a storing layer returned."""
    heads = plan.heads
    # Products run in the shard's dtype (tensor cores for bf16; ``x`` keeps its
    # own when the input norm runs inside); sums over head groups and ranks
    # accumulate in at least float32, cast once at the end.
    dtype = packed.dtype
    inputs = Recomputation(plan, x, packed, cos, sin, inv_rms, input_norm, shared, saved.get("projections"))
    grads = HeadGroupGrads(plan, inputs, dtype)
    grads.shared = torch.empty_like(shared) if plan.kv_sharing == "reuse" else grad_shared
    grad_tokens = grad_out.flatten(0, 1)  # (N, H)
    upcoming, unfinished = inputs.receive(), None
    for j in range(plan.tsp_size):
        w = upcoming
        if plan.overlap and j + 1 < plan.tsp_size:
            upcoming = inputs.receive()  # shard j+1 and its K/V gather travel under group j's backward
        holder = heads.kv_holder(j)
        if holder == j:
            kv_weights = w
            K = V = None  # the previous set's K/V go before this one's are unpacked
            K, V = inputs.gathers.pop(j).wait()
            # The set's dK, dV sums over its head groups and query blocks (tsp.fp32_accumulators).
            dKV = torch.zeros((2, *K.shape), dtype=_accumulator_dtype(plan, K.dtype), device=K.device)
        q_norm = group_norm(plan, "q", j, inv_rms)
        raw_q, gate = split_gate(inputs.project(j, w, "q_proj", heads.q_heads, heads.q_width), heads.head_dim)
        head_gate = "g_proj.weight" in w
        if head_gate:
            gate = inputs.project(j, w, "g_proj", heads.q_heads, 1)
        q = queries(plan, raw_q, q_norm, cos, sin)
        grad_o = (grad_out @ w["o_proj.weight"]).view_as(q)
        if gate is not None:
            grad_gated, sigmoid = grad_o, torch.sigmoid(gate)
            grad_o = grad_gated * sigmoid
        dq, o, grad_sinks = attend_backward(plan, grad_o, q, K, V, dKV, saved, j, w.get("sinks"))
        if gate is not None:
            grad_gate = grad_gated * o * sigmoid * (1 - sigmoid)
            if head_gate:  # summed over the head's features: (B, L, h, 1)
                grad_gate = grad_gate.sum(-1, keepdim=True)
            o = o * sigmoid
        if grad_sinks is not None:
            grads.shard(j)["sinks"].copy_(grad_sinks)
        if unfinished is not None:  # the previous set's reduce-scatter ran under this group's compute
            grads.add_kv_set(*unfinished)
            unfinished = None
        dq, *grad_q_norm = queries_backward(plan, raw_q, dq, q_norm, cos, sin)
        raw_q = None
        if gate is not None and not head_gate:
            dq = torch.cat([dq, grad_gate.to(dq.dtype)], dim=-1)  # each head's query rows, then its gate's
        grads.add_norm("q", j, *grad_q_norm)
        grads.add_query_output(j, w, dq.flatten(0, 1).flatten(1), o, grad_tokens)
        if head_gate:
            grads.add_projection(j, w, "g_proj", grad_gate.flatten(0, 1).flatten(1).to(dq.dtype))
        if j == holder + heads.kv_replicas - 1:  # the replica set is complete
            # Sent in the model dtype, as the forward gathered K/V (the cost
            # model's 2*B*S*nkv*d elements of the model's size), summed in fp32.
            scatter = scatter_kv_grads(plan, dKV, dtype)
            K = V = dKV = None
            if holder != j:  # only the holder's message waits for the key/value part
                grads.reduce_part(j, "all")
            unfinished = (j, holder, kv_weights, scatter)
            if not plan.overlap:
                grads.add_kv_set(*unfinished)
                unfinished = None
        else:
            grads.reduce_part(j, "query/output")
        if not plan.overlap and j + 1 < plan.tsp_size:
            upcoming = inputs.receive()
    if unfinished is not None:
        grads.add_kv_set(*unfinished)
    own = grads.own_shard()
    grad_x, grad_input_norm = grads.input_grads()
    return (grad_x, own.to(packed.dtype), grads.norm_weights["q"], grads.norm_weights["k"], grads.norm_inv_rms["q"],
            grads.norm_inv_rms["k"], grad_input_norm, grads.shared if plan.kv_sharing == "reuse" else None)


class TSPAttentionFunction(EagerFunction):
    """forward: ``attention_forward``, saving its input; backward: ``attention_backward``."""

    # Under autocast every floating input (x, the shard, the rotary tables)
    # is cast to the autocast dtype and the layer runs as a model of that
    # dtype would: projections, rotary and attention in it, the head groups'
    # outputs summed in float32, the output in the autocast dtype as HF's
    # o_proj returns it. The inverse RMS of q and k (norms over the projection)
    # stay float32, as Hugging Face's norms compute; so do the layer's input and
    # its norm's weight where the input norm runs inside (plan.input_norm): the
    # normed values are cast, as the unfused norm's output is by the projections.
    @staticmethod
    @autocast_forward(cast_inputs=True, keep=(0, 7, 8, 9))
    def forward(ctx, x, packed, cos, sin, plan, q_norm_weight, k_norm_weight, q_inv_rms, k_inv_rms,
                input_norm_weight, shared=None):
        # The norm weights are inputs only so that autograd routes their gradients. ``shared``: the keys and
        # values a layer reusing them attends to; a layer storing them returns its own as a second output.
        inv_rms = None if q_inv_rms is None else {"q": q_inv_rms, "k": k_inv_rms}
        input_norm = None
        if plan.input_norm is None:
            x = x.to(packed.dtype)  # as autocast casts a projection's input
        else:
            input_norm = TiledInputNorm(plan.input_norm, input_norm_weight, packed.dtype, plan.token_tile)
        out, saved, *stored = attention_forward(plan, x, packed, cos, sin, inv_rms, input_norm=input_norm,
                                                shared=shared)
        ctx.plan, ctx.input_norm = plan, input_norm
        projections = saved.pop("projections", {})
        ctx.projection_keys = tuple(projections)
        saved["projections"] = list(projections.values())
        ctx.saved_counts = {name: len(tensors) for name, tensors in saved.items()}
        ctx.save_for_backward(x, packed, cos, sin, q_inv_rms, k_inv_rms, shared,
                              *(t for tensors in saved.values() for t in tensors))
        return (out, *stored) if stored else out

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_out, grad_stored=None):
        x, packed, cos, sin, q_inv_rms, k_inv_rms, shared, *flat = ctx.saved_tensors
        saved, start = {}, 0
        for name, count in ctx.saved_counts.items():
            saved[name], start = flat[start:start + count], start + count
        saved["projections"] = dict(zip(ctx.projection_keys, saved["projections"]))
        inv_rms = None if q_inv_rms is None else {"q": q_inv_rms, "k": k_inv_rms}
        grads = attention_backward(ctx.plan, grad_out.contiguous(), x, packed, saved, cos, sin, inv_rms,
                                   ctx.input_norm, shared, grad_stored)
        (grad_x, grad_packed, grad_q_norm, grad_k_norm, grad_q_inv_rms, grad_k_inv_rms, grad_input_norm,
         grad_shared) = grads
        return (grad_x, grad_packed, None, None, None, grad_q_norm, grad_k_norm, grad_q_inv_rms, grad_k_inv_rms,
                grad_input_norm, grad_shared)
