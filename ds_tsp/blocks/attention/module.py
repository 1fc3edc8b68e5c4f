"""TSP attention: the broadcast schedule over head-group shards (DESIGN.md section 4).

Rank ``j`` of a TSP group owns query heads ``[j*nq/D, (j+1)*nq/D)``, their
key/value heads and the matching columns of ``o_proj``, packed in one flat
buffer. For every owner ``j`` in turn, each rank receives shard ``j``, projects
its LOCAL tokens, rotates them at their GLOBAL positions, all-gathers K/V along
the sequence and attends causally; the partial outputs of the head groups sum
locally through ``o_proj``, so no all-reduce is needed.

Backward re-broadcasts the shards, projects the local tokens' queries, keys
and values again and re-gathers K/V (only the local input and, with the fused
backward, each head group's output and log-sum-exp are saved),
reduce-scatters dK/dV back to the token owners (in the model's dtype,
added in float32) and reduces each shard's weight gradient to its owner
(partial sums in float32 or wider, sent in the gradient wire dtype of
``comm.gradient_wire_dtype`` and added in the wider dtype on arrival).

With ``tsp.overlap`` every collective of a head group is in flight under
another group's compute: the broadcast of shard ``j+1`` and the K/V
all-gather of group ``j+1`` under group ``j``'s attention, and in backward
the dK/dV reduce-scatter of group ``j`` and its weight-gradient reduce under
group ``j+1``'s attention backward.
"""

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_tsp.parallel import comm, layout
from ds_tsp.parallel.amp import autocast_backward, autocast_forward
from ds_tsp.blocks.attention.kernels import SoftCappedKernel
from ds_tsp.blocks.attention.selection import select_kernel
from ds_tsp.blocks.documents import query_blocks
from ds_tsp.blocks.fused import FusedRows
from ds_tsp.blocks.attention.head_groups import HeadGroups, shard_piece, shard_spec
from ds_tsp.blocks.input_norm import TiledInputNorm, recomputable
from ds_tsp.blocks.packing import PackedShardMixin, module_reader
from ds_tsp.blocks.rotary import group_norm, norm_rows, rotate, rotate_backward


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
    grad_wire_dtype: object = None  # weight-gradient reduces' wire dtype (comm.gradient_wire_dtype; None: float32)
    q_norm: object = None  # q/k norms applied before the rotary embedding, replicated: per head (Qwen3,
    k_norm: object = None  # Gemma-3) or over the whole projection (OLMo-2: see ProjectionNormPiece)
    input_norm: object = None  # the layer's norm before the attention, run inside it (ds_tsp.blocks.input_norm)
    token_tile: int = 0  # tsp.token_tile: the input norm's tiles in backward

    @property
    def tsp_size(self):
        return self.heads.tsp_size


def shard_stream(plan, packed):
    """Yield ``(j, shard j)`` for every owner ``j``; with ``plan.overlap`` the
    broadcast of shard ``j+1`` is in flight while shard ``j`` computes."""
    tsp_rank, D = comm.group_rank(plan.group), plan.tsp_size

    def start(j):
        buf = packed.detach() if j == tsp_rank else packed.new_empty(plan.specs[j].numel)
        return buf, comm.broadcast(buf, src=j, group=plan.group, async_op=True)

    pending = start(0)
    for j in range(D):
        buf, work = pending
        if work is not None:
            work.wait()
        if plan.overlap and j + 1 < D:
            pending = start(j + 1)
        yield j, buf
        if not plan.overlap and j + 1 < D:
            pending = start(j + 1)


def project(x, weights, name, heads_per_rank, head_dim):
    """``x`` ``(B, L, H)`` through projection ``name`` of a shard -> ``(B, L, heads, d)``."""
    out = F.linear(x, weights[f"{name}.weight"], weights.get(f"{name}.bias"))
    return out.view(*x.shape[:2], heads_per_rank, head_dim)


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


def attend_local_chunks(plan, q, K, V):
    """Causal attention of this rank's queries over the full keys, block by
    block of ``plan.query_blocks``: each of this rank's two chunks (of ``2D``)
    attends to the key prefix that ends with itself, bottom-right aligned, so
    rows past it are never computed; with packed documents, each piece of a
    chunk attends from its document's start only.
    Returns the output and, with ``plan.explicit_backward``, the log-sum-exp
    ``(B, hq, S/D)`` the fused backward needs (else None).
    """
    outputs, lses = [], []
    for rows, blocks in plan.query_blocks:
        row_outputs, row_lses = [], []
        for q_lo, q_hi, k_lo, k_hi in blocks:
            q_block, K_block, V_block = q[rows, q_lo:q_hi], K[rows, k_lo:k_hi], V[rows, k_lo:k_hi]
            if plan.explicit_backward:
                out, lse = plan.kernel.forward(q_block, K_block, V_block, plan.scale)
                row_lses.append(lse)
            else:
                out, _ = plan.kernel.attend(q_block, K_block, V_block, plan.scale, plan.window)
            row_outputs.append(out)
        outputs.append(_cat(row_outputs, 1))
        lses.append(_cat(row_lses, -1) if row_lses else None)
    return _cat(outputs, 0), _cat(lses, 0) if plan.explicit_backward else None


def attend_local_chunks_backward(plan, grad_o, q, K, V, o, lse, grad_K, grad_V):
    """``dq`` of ``attend_local_chunks`` from its saved output and lse; the
    blocks' parts of ``dK, dV`` are added to ``grad_K, grad_V`` (the head
    groups' full-sequence sums, float32 or wider), so no second full-sequence
    buffer exists."""
    grad_q = []
    for rows, blocks in plan.query_blocks:
        row_grads = []
        for q_lo, q_hi, k_lo, k_hi in blocks:
            dq, dk, dv = plan.kernel.backward(grad_o[rows, q_lo:q_hi], q[rows, q_lo:q_hi], K[rows, k_lo:k_hi],
                                              V[rows, k_lo:k_hi], o[rows, q_lo:q_hi], lse[rows, :, q_lo:q_hi],
                                              plan.scale)
            row_grads.append(dq)
            grad_K[rows, k_lo:k_hi].add_(dk)
            grad_V[rows, k_lo:k_hi].add_(dv)
            del dk, dv  # a block's dK/dV (a full key prefix each) go before the next block's are made
        grad_q.append(_cat(row_grads, 1))
    return _cat(grad_q, 0)


def attention_forward(plan, x, packed, cos, sin, inv_rms=None, kv_sink=None, input_norm=None):
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
    ``(B, S/D, hq, d)`` and log-sum-exp ``(B, hq, S/D)``; nothing without.
    Queries, keys and values are not kept: backward projects them again from
    ``x`` with the shards it receives anyway.
    """
    heads, d = plan.heads, plan.heads.head_dim
    if input_norm is not None:
        x = input_norm(x)
    # The head groups' outputs add up in float32 (or wider), cast once, unless
    # tsp.fp32_accumulators is off.
    out = torch.empty((x.shape[0] * x.shape[1], x.shape[2]), dtype=_accumulator_dtype(plan, x.dtype),
                      device=x.device)
    saved = {"o": [], "lse": []}
    gathers = {}  # key/value holder -> its K/V all-gather in flight
    stream = shard_stream(plan, packed)

    def receive():
        """The next shard's weights; a key/value holder's K/V gather starts at once."""
        j, shard = next(stream)
        w = plan.specs[j].unpack(shard)
        if heads.holds_kv(j):
            k = project(x, w, "k_proj", heads.kv_heads, d)
            v = project(x, w, "v_proj", heads.kv_heads, d)
            k_rotated = rotate(k, group_norm(plan, "k", j, inv_rms), cos, sin)
            gathers[j] = gather_kv(plan, k_rotated, v)
            if kv_sink is not None:
                kv_sink(k_rotated, v)
        return w

    upcoming = receive()
    for j in range(plan.tsp_size):
        w = upcoming
        if plan.overlap and j + 1 < plan.tsp_size:
            upcoming = receive()  # shard j+1 and its K/V gather travel under group j's attention
        if heads.holds_kv(j):
            K = V = None  # the previous set's K/V go before this one's are unpacked
            K, V = gathers.pop(j).wait()
        q = project(x, w, "q_proj", heads.q_heads, d)
        q_rotated = rotate(q, group_norm(plan, "q", j, inv_rms), cos, sin)
        o, lse = attend_local_chunks(plan, q_rotated, K, V)
        comm.add_matmul(out, o.flatten(2).flatten(0, 1), w["o_proj.weight"].t(), add=j > 0)
        if plan.explicit_backward:
            saved["o"].append(o), saved["lse"].append(lse)
        if not plan.overlap and j + 1 < plan.tsp_size:
            upcoming = receive()
    return out.view(x.shape).to(x.dtype), {name: tensors for name, tensors in saved.items() if tensors}


def _accumulator_dtype(plan, dtype):
    return torch.promote_types(dtype, torch.float32) if plan.fp32_accumulators else dtype


def _reduce_to(plan, grad, owner, works):
    """Start the sum of ``grad`` (float32 or wider) at ``owner``, sent in the
    plan's gradient wire dtype and added in ``grad``'s; returns the pending op,
    also put in ``works`` (without ``plan.overlap`` it is finished already)."""
    wire = comm.gradient_wire_dtype(plan.grad_wire_dtype, grad.dtype)
    pending = comm.reduce_fp32(grad, owner, plan.group, wire, async_op=True)
    if not plan.overlap:
        pending.wait()
    works.append(pending)
    return pending


def attention_backward(plan, grad_out, x, packed, saved, cos, sin, inv_rms=None, input_norm=None):
    """Gradients of the local tokens ``x``, of this rank's packed shard, of
    the q/k norms' weights (None without them; local tokens' part), for
    norms over the projection of the tokens' inverse RMS of q and k
    (``inv_rms``) and, with an ``input_norm`` (``attention_forward``), of its
    weight (else None; the local tokens' part): the normed values are
    computed again a tile at a time wherever they are needed.

    Per head group ``j``: re-broadcast its shard, project its queries (and,
    once per key/value replica set, its keys and values) from ``x`` again and
    re-gather its K/V, attention backward, and reduce the query/output
    weight gradient to owner ``j``. dK/dV are summed over the replica set,
    reduce-scattered back to the token owners, and the key/value weight
    gradient is reduced to the holder, in the same message as the holder's
    query/output gradient. With ``plan.overlap`` the next group's shard and
    K/V are on their way, and a completed set's reduce-scatter (with the
    reduces that wait for it) runs under the next group's compute.
    """
    heads = plan.heads
    tsp_rank = comm.group_rank(plan.group)
    # Products run in the model's dtype (tensor cores for bf16); their sums over
    # head groups and ranks accumulate in at least float32, cast once at the end.
    # The compute dtype is the shard's: ``x`` is the layer's input, in its own
    # dtype, when the input norm runs inside (float32 under autocast).
    dtype = packed.dtype
    acc_dtype = torch.promote_types(dtype, torch.float32)
    tokens, grad_tokens = x.flatten(0, 1), grad_out.flatten(0, 1)  # (N, H)
    grad_x = torch.zeros(tokens.shape, dtype=_accumulator_dtype(plan, dtype), device=x.device)
    works, own_parts = [], []  # the reduces in flight; this rank's: (part of its shard's gradient, its reduce)
    grad_shards = {}  # group j -> this rank's partial gradient of shard j, flat and laid out like it
    norm_grads, rms_grads = {"q": None, "k": None}, {"q": None, "k": None}
    gathers = {}  # key/value holder -> its K/V all-gather in flight
    keys = {}  # key/value holder -> its keys before the norm and rotary embedding, for their backward
    stream = shard_stream(plan, packed)

    def projected(w, name, num_heads):
        """Projection ``name`` of the local tokens, as the forward computed it."""
        if input_norm is None:
            return project(x, w, name, num_heads, heads.head_dim)
        out = input_norm.project(tokens, w[f"{name}.weight"], w.get(f"{name}.bias"))
        return out.view(*x.shape[:2], num_heads, heads.head_dim)

    def receive():
        """The next shard's weights; a key/value holder's keys and values are
        projected again and their gather starts at once."""
        j, shard = next(stream)
        w = plan.specs[j].unpack(shard)
        if heads.holds_kv(j):
            keys[j] = projected(w, "k_proj", heads.kv_heads)
            gathers[j] = gather_kv(plan, rotate(keys[j], group_norm(plan, "k", j, inv_rms), cos, sin),
                                   projected(w, "v_proj", heads.kv_heads))
        return w

    def shard_grads(j):
        """Views, by name, of shard ``j``'s gradient buffer, which the weight
        gradients are written into (float32 or wider), so the messages need no packing."""
        if j not in grad_shards:
            grad_shards[j] = torch.empty(plan.specs[j].numel, dtype=acc_dtype, device=x.device)
        return plan.specs[j].unpack(grad_shards[j])

    def write_projection_grads(into, name, grad):
        """Projection ``name``'s weight (and bias) gradient from its output's ``grad``."""
        # Weight-gradient partials stay float32 until their sum over ranks is rounded.
        if input_norm is None:
            comm.partial_matmul(grad.t(), tokens, out=into[f"{name}.weight"], add=False)
        else:
            input_norm.weight_gradient(grad, tokens, into[f"{name}.weight"])
        if f"{name}.bias" in into:
            torch.sum(grad, 0, dtype=acc_dtype, out=into[f"{name}.bias"])

    def add_norm_grads(name, j, grad_weight, grad_inv_rms):
        """Head group ``j``'s part of the ``name`` norm's weight and inverse-RMS gradients."""
        if grad_weight is None:
            return
        if norm_grads[name] is None:
            norm = plan.q_norm if name == "q" else plan.k_norm
            norm_grads[name] = torch.zeros(norm.weight.shape, dtype=grad_weight.dtype, device=grad_weight.device)
        norm_grads[name][norm_rows(plan, name, j, inv_rms is not None)] += grad_weight
        if grad_inv_rms is not None:
            rms_grads[name] = grad_inv_rms if rms_grads[name] is None else rms_grads[name] + grad_inv_rms

    def reduce_part(j, part):
        """Send ``part`` (``"query/output"``, ``"key/value"`` or ``"all"``) of
        shard ``j``'s gradient buffer to its owner ``j``."""
        spec, flat = plan.specs[j], grad_shards[j]
        kv_start = spec.offsets.get("k_proj.weight", spec.numel)  # the key/value heads are the tail
        piece = {"query/output": flat[:kv_start], "key/value": flat[kv_start:], "all": flat}[part]
        reduced = _reduce_to(plan, piece, j, works)
        if j == tsp_rank:
            own_parts.append((piece, reduced))

    def finish_kv_set(j, holder, kv_weights, scatter):
        """The replica set ending at group ``j``: its reduce-scattered dK/dV into
        the input gradient and the key/value weight gradients, which go to the
        holder (with ``j``'s own query/output part when ``j`` is the holder)."""
        dk, dv = scatter.wait()
        dk, *grad_k_norm = rotate_backward(keys.pop(holder), dk, group_norm(plan, "k", holder, inv_rms), cos, sin)
        add_norm_grads("k", holder, *grad_k_norm)
        dk = dk.flatten(0, 1).flatten(1)
        dv = dv.flatten(0, 1).flatten(1)
        grad_x.add_((dk @ kv_weights["k_proj.weight"] + dv @ kv_weights["v_proj.weight"]).to(grad_x.dtype))
        into = shard_grads(holder)
        write_projection_grads(into, "k_proj", dk)
        write_projection_grads(into, "v_proj", dv)
        reduce_part(holder, "all" if holder == j else "key/value")

    upcoming, unfinished = receive(), None
    for j in range(plan.tsp_size):
        w = upcoming
        if plan.overlap and j + 1 < plan.tsp_size:
            upcoming = receive()  # shard j+1 and its K/V gather travel under group j's backward
        holder = heads.kv_holder(j)
        if holder == j:
            kv_weights = w
            K = V = None  # the previous set's K/V go before this one's are unpacked
            K, V = gathers.pop(j).wait()
            # The set's dK, dV sums over its head groups and query blocks (tsp.fp32_accumulators).
            dKV = torch.zeros((2, *K.shape), dtype=_accumulator_dtype(plan, K.dtype), device=K.device)
        q_norm = group_norm(plan, "q", j, inv_rms)
        raw_q = projected(w, "q_proj", heads.q_heads)
        q = rotate(raw_q, q_norm, cos, sin)
        grad_o = (grad_out @ w["o_proj.weight"]).view_as(q)
        if plan.explicit_backward:
            o = saved["o"][j]
            dq = attend_local_chunks_backward(plan, grad_o, q, K, V, o, saved["lse"][j], dKV[0], dKV[1])
        else:  # the kernel has no fused backward: autograd through a recomputed forward
            with torch.enable_grad():
                q, K_leaf, V_leaf = (t.detach().requires_grad_() for t in (q, K, V))
                o, _ = attend_local_chunks(plan, q, K_leaf, V_leaf)
                dq, dK, dV = torch.autograd.grad(o, (q, K_leaf, V_leaf), grad_o)
            dKV[0].add_(dK)
            dKV[1].add_(dV)
        if unfinished is not None:  # the previous set's reduce-scatter ran under this group's compute
            finish_kv_set(*unfinished)
            unfinished = None
        dq, *grad_q_norm = rotate_backward(raw_q, dq, q_norm, cos, sin)
        raw_q = None
        add_norm_grads("q", j, *grad_q_norm)
        dq = dq.flatten(0, 1).flatten(1)  # (N, hq*d)
        grad_x.add_((dq @ w["q_proj.weight"]).to(grad_x.dtype))
        into = shard_grads(j)
        write_projection_grads(into, "q_proj", dq)
        comm.partial_matmul(grad_tokens.t(), o.detach().flatten(0, 1).flatten(1), out=into["o_proj.weight"],
                            add=False)
        if j == holder + heads.kv_replicas - 1:  # the replica set is complete
            # Sent in the model dtype, as the forward gathered K/V (the cost
            # model's 2*B*S*nkv*d elements of the model's size), summed in fp32.
            scatter = scatter_kv_grads(plan, dKV, dtype)
            K = V = dKV = None
            if holder != j:  # only the holder's message waits for the key/value part
                reduce_part(j, "all")
            unfinished = (j, holder, kv_weights, scatter)
            if not plan.overlap:
                finish_kv_set(*unfinished)
                unfinished = None
        else:
            reduce_part(j, "query/output")
        if not plan.overlap and j + 1 < plan.tsp_size:
            upcoming = receive()
    if unfinished is not None:
        finish_kv_set(*unfinished)
    for pending in works:
        pending.wait()
    for piece, pending in own_parts:
        summed = pending.wait()
        if summed is not piece:  # a reduce in place leaves the sum where it was
            piece.copy_(summed)
    own = grad_shards[tsp_rank]
    grad_input_norm = None
    if input_norm is None:
        grad_x = grad_x.view(x.shape).to(x.dtype)
    else:
        grad_x, grad_input_norm = input_norm.backward(tokens, grad_x)
        grad_x = grad_x.view(x.shape)
    return (grad_x, own.to(packed.dtype), norm_grads["q"], norm_grads["k"], rms_grads["q"], rms_grads["k"],
            grad_input_norm)


class _TSPAttentionFunction(torch.autograd.Function):
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
                input_norm_weight):
        # The norm weights are inputs only so that autograd routes their gradients.
        inv_rms = None if q_inv_rms is None else {"q": q_inv_rms, "k": k_inv_rms}
        input_norm = None
        if plan.input_norm is None:
            x = x.to(packed.dtype)  # as autocast casts a projection's input
        else:
            input_norm = TiledInputNorm(plan.input_norm, input_norm_weight, packed.dtype, plan.token_tile)
        out, saved = attention_forward(plan, x, packed, cos, sin, inv_rms, input_norm=input_norm)
        ctx.plan, ctx.input_norm = plan, input_norm
        ctx.saved_counts = {name: len(tensors) for name, tensors in saved.items()}
        ctx.save_for_backward(x, packed, cos, sin, q_inv_rms, k_inv_rms,
                              *(t for tensors in saved.values() for t in tensors))
        return out

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_out):
        x, packed, cos, sin, q_inv_rms, k_inv_rms, *flat = ctx.saved_tensors
        saved, start = {}, 0
        for name, count in ctx.saved_counts.items():
            saved[name], start = flat[start:start + count], start + count
        inv_rms = None if q_inv_rms is None else {"q": q_inv_rms, "k": k_inv_rms}
        grads = attention_backward(ctx.plan, grad_out.contiguous(), x, packed, saved, cos, sin, inv_rms,
                                   ctx.input_norm)
        grad_x, grad_packed, grad_q_norm, grad_k_norm, grad_q_inv_rms, grad_k_inv_rms, grad_input_norm = grads
        return (grad_x, grad_packed, None, None, None, grad_q_norm, grad_k_norm, grad_q_inv_rms, grad_k_inv_rms,
                grad_input_norm)


def projection_squares_forward(plan, x, packed):
    """Each local token's sum of squares over the whole q and over the whole k
    projection (every head group's; ``(B, S/D)`` each, float32 or wider), which
    norms over a projection's width need before any head group is normed
    (``ProjectionNormPiece``): the shards go round once more, ahead of the
    attention's own round."""
    acc = torch.promote_types(x.dtype, torch.float32)
    sums = {name: torch.zeros(x.shape[:2], dtype=acc, device=x.device) for name in ("q", "k")}
    for j, shard in shard_stream(plan, packed):
        w = plan.specs[j].unpack(shard)
        for name in ("q", "k") if plan.heads.holds_kv(j) else ("q",):
            projected = F.linear(x, w[f"{name}_proj.weight"], w.get(f"{name}_proj.bias"))
            sums[name] += projected.to(acc).pow(2).sum(dim=-1)  # as HF's norm: squares of the float32 (or wider) values
    return sums["q"], sums["k"]


def projection_squares_backward(plan, grad_sums, x, packed):
    """Gradients of ``projection_squares_forward`` for ``x`` and this rank's
    shard, from those of the sums (``{"q", "k"}``, ``(B, S/D)``): each group's
    projections recomputed, their weight gradients reduced to the owner."""
    acc = torch.promote_types(x.dtype, torch.float32)
    tokens = x.flatten(0, 1)  # (N, H)
    grad_x = torch.zeros(tokens.shape, dtype=acc, device=x.device)
    tsp_rank, works, own = comm.group_rank(plan.group), [], []
    for j, shard in shard_stream(plan, packed):
        spec = plan.specs[j]
        w, grad_shard = spec.unpack(shard), torch.zeros(spec.numel, dtype=acc, device=x.device)
        if j == tsp_rank:
            own_grad = grad_shard
        into = spec.unpack(grad_shard)
        for name in ("q", "k") if plan.heads.holds_kv(j) else ("q",):
            weight, bias = f"{name}_proj.weight", f"{name}_proj.bias"
            projected = F.linear(tokens, w[weight], w.get(bias)).to(acc)
            grad = (2 * grad_sums[name].reshape(-1, 1).to(acc) * projected).to(x.dtype)  # (N, rows)
            grad_x += (grad @ w[weight]).to(acc)
            comm.partial_matmul(grad.t(), tokens, out=into[weight], add=False)
            if bias in into:
                torch.sum(grad, 0, dtype=acc, out=into[bias])
            # Only the projection's own rows travel: the rest of the shard gets no gradient here.
            start = spec.offsets[weight]
            stop = start + into[weight].numel() + (into[bias].numel() if bias in into else 0)
            piece = grad_shard[start:stop]
            reduced = _reduce_to(plan, piece, j, works)
            if j == tsp_rank:
                own.append((piece, reduced))
    for pending in works:
        pending.wait()
    for piece, pending in own:
        summed = pending.wait()
        if summed is not piece:
            piece.copy_(summed)
    return grad_x.view(x.shape).to(x.dtype), own_grad


class _ProjectionSquares(torch.autograd.Function):
    @staticmethod
    @autocast_forward(cast_inputs=True)
    def forward(ctx, x, packed, plan):
        ctx.plan = plan
        ctx.save_for_backward(x, packed)
        return projection_squares_forward(plan, x, packed)

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_q, grad_k):
        x, packed = ctx.saved_tensors
        grads = {"q": grad_q, "k": grad_k}
        grads = {name: torch.zeros(x.shape[:2], device=x.device) if g is None else g for name, g in grads.items()}
        grad_x, grad_packed = projection_squares_backward(ctx.plan, grads, x, packed)
        return grad_x, grad_packed.to(packed.dtype), None


class TSPAttention(PackedShardMixin, nn.Module):
    """Self-attention of one decoder layer, sharded by head group over a TSP group.

    ``forward(x, position_embeddings)`` takes the local tokens ``(B, S/D, H)``
    and the rotary ``(cos, sin)`` of their GLOBAL positions, each ``(B, S/D, d)``
    as the model's Hugging Face rotary embedding computes them. The constructor
    allocates the shard without initialising it: ``from_hf`` or ``load_shard``
    fills it (TSP converts trained models; it does not initialise new ones).
    """

    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, tsp_group, *, qkv_bias=False,
                 o_bias=False, scale=None, sliding_window=None, layout_name="zigzag", backend="auto",
                 overlap=True, token_tile=0, fp32_accumulators=True, dtype=None, device=None, q_norm=None,
                 k_norm=None, softcap=None):
        super().__init__()
        self.tsp_group = tsp_group
        self.tsp_rank = comm.group_rank(tsp_group)
        self.heads = HeadGroups(num_heads, num_kv_heads, head_dim, comm.group_size(tsp_group))
        self.specs = tuple(shard_spec(self.heads, hidden_size, qkv_bias, j) for j in range(self.heads.tsp_size))
        self.spec = self.specs[self.tsp_rank]
        self.packed = nn.Parameter(torch.empty(self.spec.numel, dtype=dtype, device=device))
        # DeepSpeed counts parameters tagged model-parallel on every TSP rank in
        # gradient norms (each rank holds a different shard).
        self.packed.tensor_model_parallel = True
        self.lora = None  # LoRA adapters of this rank's shard (ds_tsp.injection.lora)
        self.o_bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)) if o_bias else None
        # Norms of queries and keys, small, kept whole on every rank: per head (Qwen3, Gemma-3) or over
        # the whole projection (OLMo-2), whose RMS spans every rank's head groups (projection_squares_forward).
        self.q_norm, self.k_norm = q_norm, k_norm
        self.norms_span_projection = q_norm is not None and q_norm.weight.numel() != head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        # Gemma-2's attention-logit soft-cap: a kernel of ds_tsp's own (SoftCappedKernel) serves it.
        if softcap is not None and backend not in ("auto", "sdpa"):
            raise ValueError(f"tsp.attention_backend = {backend!r} cannot soft-cap attention scores "
                             f"(attn_logit_softcapping = {softcap}): set tsp.attention_backend to \"auto\" or "
                             "\"sdpa\", with which ds_tsp's capped attention serves these layers")
        self.softcap = softcap
        self.layout_name, self.backend, self.overlap = layout_name, backend, overlap
        self.token_tile, self.fp32_accumulators = token_tile, fp32_accumulators
        # The weight-gradient reduces' wire dtype; None: float32 (or wider). ds_tsp.initialize
        # sets DeepSpeed's communication_data_type here when the config names it.
        self.grad_wire_dtype = None

    @classmethod
    def from_hf(cls, attn, config, tsp_group, layout_name="zigzag", backend="auto", overlap=True, token_tile=0,
                fp32_accumulators=True, read=None, device=None, fused=None):
        """Build from a Hugging Face attention module, keeping this rank's shard.

        ``read(name, piece)`` returns the tensor ``name`` (e.g. ``q_proj.weight``)
        cut to ``piece`` (see ``shard_piece``); by default it slices ``attn``'s own
        parameters, and a checkpoint reader can pass its own (``attn`` may then
        be on the meta device: only its shapes are used). ``fused``: the
        policy's fused projections of this module (``DecoderPolicy.fused``,
        Phi-3's ``qkv_proj``), whose rows ``read`` is then asked for under
        Hugging Face's names (``ds_tsp.blocks.fused``).
        """
        rows = hf_rows(attn, config, fused)
        q_proj = rows.hf_module(attn, "q_proj")
        weight = q_proj.weight
        device = device or weight.device
        norms = {}
        for name in ("q_norm", "k_norm"):
            norm = getattr(attn, name, None)
            if norm is not None:
                # A copy, so the HF module's parameters are never shared; its
                # weight is loaded from ``read`` below.
                norm = copy.deepcopy(norm).to_empty(device=device)
            norms[name] = norm
        module = cls(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, attn.head_dim,
                     tsp_group, qkv_bias=q_proj.bias is not None, o_bias=attn.o_proj.bias is not None,
                     scale=attn.scaling, sliding_window=sliding_window_of(attn, config), layout_name=layout_name,
                     backend=backend, overlap=overlap, token_tile=token_tile, fp32_accumulators=fp32_accumulators,
                     dtype=weight.dtype, device=device, softcap=getattr(attn, "attn_logit_softcapping", None),
                     **norms)
        module.hf_rows = rows
        read = rows.reader(read or module_reader(attn))
        module.load_shard({name: read(name, module.shard_piece(name)) for name in module.shard_names()})
        return module

    def replicated_params(self):
        """The parameters every rank holds whole, under Hugging Face names."""
        params = {"o_proj.bias": self.o_bias}
        params.update({f"{name}.weight": getattr(self, name).weight
                       for name in ("q_norm", "k_norm") if getattr(self, name) is not None})
        return {name: param for name, param in params.items() if param is not None}

    def shard_piece(self, name):
        """``(dim, start, length)`` of the full tensor ``name`` this rank holds, or None if whole."""
        return shard_piece(self.heads, name, self.tsp_rank)

    def plan(self, x, documents=None, input_norm=None):
        """How to run this layer on the local tokens ``x``; ``documents``: the
        rows' document starts (``ds_tsp.blocks.documents``), None for one per row;
        ``input_norm``: the layer's norm to run inside (``forward``)."""
        kernel = (SoftCappedKernel(self.softcap) if self.softcap is not None
                  else select_kernel(self.backend, x.device, x.dtype))
        explicit = hasattr(kernel, "explicit_backward") and kernel.explicit_backward(self.heads.head_dim,
                                                                                     self.sliding_window)
        return AttentionPlan(group=self.tsp_group, heads=self.heads, specs=self.specs, layout=self.layout_name,
                             kernel=kernel, scale=self.scale, window=self.sliding_window, overlap=self.overlap,
                             explicit_backward=explicit, q_norm=self.q_norm, k_norm=self.k_norm,
                             query_blocks=query_blocks(documents, x.shape[1], self.tsp_rank, self.heads.tsp_size,
                                                       self.layout_name, x.shape[0], self.token_tile,
                                                       self.sliding_window),
                             fp32_accumulators=self.fp32_accumulators, grad_wire_dtype=self.grad_wire_dtype,
                             input_norm=input_norm, token_tile=self.token_tile)

    def projection_inv_rms(self, x, packed, plan):
        """With q/k norms over the whole projection, each local token's inverse
        RMS of q and of k (``{"q", "k"}``, ``(B, S/D)``) as Hugging Face's
        RMSNorm computes it (float32 or wider); None with per-head norms or none."""
        if not self.norms_span_projection:
            return None
        sums = _ProjectionSquares.apply(x, packed, plan)
        return {name: torch.rsqrt(total / norm.weight.numel() + norm.variance_epsilon)
                for name, total, norm in zip(("q", "k"), sums, (self.q_norm, self.k_norm))}

    def takes_input_norm(self, norm):
        """Whether ``forward`` can run ``norm`` inside (``ds_tsp.blocks.input_norm``):
        a recomputable norm, and q/k norms that do not span the projection
        (whose sums of squares need the normed input first)."""
        return recomputable(norm) and not self.norms_span_projection

    def forward(self, x, position_embeddings, documents=None, input_norm=None):
        """``input_norm``: the layer's norm before the attention (``takes_input_norm``),
        applied to ``x`` here and recomputed tile by tile in backward; ``x`` is
        then the layer's input."""
        cos, sin = position_embeddings
        plan, packed = self.plan(x, documents, input_norm), self.shard_weights()
        norm_weights = [None if norm is None else norm.weight for norm in (self.q_norm, self.k_norm)]
        inv_rms = self.projection_inv_rms(x, packed, plan) or {"q": None, "k": None}
        out = _TSPAttentionFunction.apply(x, packed, cos, sin, plan, *norm_weights, inv_rms["q"], inv_rms["k"],
                                          None if input_norm is None else input_norm.weight)
        return out if self.o_bias is None else out + self.o_bias


def hf_rows(attn, config, fused=None):
    """Where q/k/v lie in the Hugging Face module ``attn`` under the policy's
    ``fused`` table for it (``ds_tsp.blocks.fused``: q rows, then k, then v)."""
    head_dim = attn.head_dim
    kv_rows = config.num_key_value_heads * head_dim
    rows = FusedRows.of(fused or {}, {"q_proj": config.num_attention_heads * head_dim, "k_proj": kv_rows,
                                      "v_proj": kv_rows})
    rows.check_rows(attn, type(attn).__name__)
    return rows


def replicated_names(attn):
    """Hugging Face names of the tensors of an attention module that TSP keeps
    whole on every rank: the output bias and per-head q/k norms, where present."""
    names = ["o_proj.bias"] if attn.o_proj.bias is not None else []
    return names + [f"{name}.weight" for name in ("q_norm", "k_norm") if getattr(attn, name, None) is not None]


def sliding_window_of(attn, config):
    """The layer's sliding window: Qwen2-style modules carry it per layer,
    Mistral-style configs set it for every layer; None means full causal, and
    so does 0 (Qwen2-MoE's config says "no window" so; no mask applies it)."""
    return getattr(attn, "sliding_window", getattr(config, "sliding_window", None)) or None
