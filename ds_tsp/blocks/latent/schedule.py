"""Multi-head latent attention's schedule under TSP (DESIGN.md 6i), as plain
forward and backward functions and the autograd Function that runs them.

Per layer, on every rank, with ``x`` its local tokens ``(B, S/D, H)``:

1. the down pieces are broadcast in turn (the next one in flight under the
   current one's product): each rank projects its own tokens through every
   piece, so it holds its tokens' whole query latent, key/value latent and
   rotary key, and norms them whole;
2. ONE all-gather along the sequence of the latent and the rotated key:
   ``kv_lora_rank + qk_rope_head_dim`` elements per token, for all heads;
3. the head groups are broadcast in turn; each rank runs its queries of the
   group against the gathered latent, expanded into the group's keys and
   values (``"expanded"``) or attended in latent space, the group's key
   up-projection absorbed into its queries and its value up-projection
   applied to the output (``"absorbed"``), and sums the groups' outputs
   through their ``o_proj`` columns locally.

Backward broadcasts the head groups and the down pieces again, re-gathers the
latent and runs each group's local backward: its queries, keys and values are
made again under autograd and, where the fused kernels serve the layer (dense
attention, the values padded to the queries' head size), their backward runs
against the group's saved attention output and log-sum-exp, as the attention's
does; else the group's attention runs again under autograd. The latent's
gradient, summed over the groups in float32 or wider, is reduce-scattered to
its tokens' owners once per layer; each piece's weight gradient is reduced to
its owner. Saved: the local input, its down projections' outputs and, with the
fused kernels, each head group's attention output and log-sum-exp.

A layer of DeepSeek's sparse attention adds its lightning indexer
(``indexer.py``): the index keys ride in step 2's gather, and each query
attends to the keys the indexer chose for it (saved for backward).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds_tsp.blocks.attention.schedule import (ReducesInFlight, attend_local_chunks, attend_local_chunks_backward,
                                              broadcast_stream)
from ds_tsp.blocks.latent.indexer import attend_selected, choose_keys, index_inputs, index_projections
from ds_tsp.parallel import comm, layout, precision
from ds_tsp.parallel.amp import autocast_backward, autocast_forward
from ds_tsp.parallel.eager import EagerFunction

FORMS = ("expanded", "absorbed")


@dataclass(frozen=True)
class LatentPlan:
    """Everything the schedule needs besides tensors."""

    group: object
    shapes: object  # shards.LatentShapes
    specs: tuple  # every rank's (down piece, head group) PackSpecs
    layout: str
    kernel: object
    scale: float
    form: str  # "expanded" or "absorbed"
    rope: object  # rope(t (B, L, h, d_rope), tables) -> t rotated, the model's own rotary function
    q_norm: object  # the Hugging Face norm modules of the latents (q_a_layernorm None without a query latent)
    kv_norm: object
    overlap: bool
    query_blocks: list  # documents.query_blocks
    fp32_accumulators: bool = True
    grad_wire_dtype: object = None
    query_scale: object = None  # (B, S/D) factors of the local queries (Mistral 4's, by position), or None
    indexer: object = None  # indexer.IndexerPlan of a layer with a lightning indexer of its own, or None
    window: None = None  # read by attend_local_chunks: MLA layers attend causally over the whole sequence
    # The fused kernels attend (values padded to the queries' head size) and backward runs theirs against each head
    # group's saved output and log-sum-exp; else the groups' attention runs again under autograd in backward.
    explicit_backward: bool = False

    @property
    def tsp_size(self):
        return self.shapes.tsp_size


def piece_stream(plan, packed, part):
    """Yield ``(j, weights of piece j)`` for every owner ``j``, ``part`` the
    index of the piece in each shard (here 0 for the down pieces, 1 for the
    head groups, 2 for the indexer pieces); with ``plan.overlap`` the broadcast of piece ``j+1`` is in
    flight while piece ``j`` computes."""
    tsp_rank = comm.group_rank(plan.group)

    def buffer(j):
        specs = plan.specs[j]
        if j == tsp_rank:
            return packed.detach().narrow(0, part_offset(specs, part), specs[part].numel)
        return packed.new_empty(specs[part].numel)

    for j, buf in broadcast_stream(plan.group, buffer, plan.overlap):
        yield j, plan.specs[j][part].unpack(buf)


def part_offset(specs, part):
    """Where piece ``part`` starts in a packed shard laid out as ``specs``, its pieces one after the other."""
    return sum(spec.numel for spec in specs[:part])


def down_project(plan, x, packed):
    """The local tokens' down projections, before their norms: ``{name: (B, S/D, rows)}``
    for ``q_a_proj`` (with a query latent) and ``kv_a_proj_with_mqa``, from every rank's piece."""
    parts = {name: [] for name in plan.shapes.down_projections()}
    for _, w in piece_stream(plan, packed, 0):
        for name, outputs in parts.items():
            outputs.append(F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias")))
    return {name: torch.cat(outputs, dim=-1) for name, outputs in parts.items()}


def local_latent(plan, raw, tables, q_norm_weight, kv_norm_weight):
    """From the down projections ``raw``: the query latent ``c_q`` (None
    without one) and ``(B, S/D, kv_lora_rank + qk_rope_head_dim)``: the normed
    key/value latent and the rotary key at the tokens' global positions.
    The norms run as the model's modules with the given weights (stand-ins in
    backward, so the parameters' own gradient hooks do not run here)."""
    shapes = plan.shapes
    c_q = None
    if "q_a_proj" in raw:
        c_q = torch.func.functional_call(plan.q_norm, {"weight": q_norm_weight}, (raw["q_a_proj"],))
        c_q = c_q.to(raw["q_a_proj"].dtype)  # as the next projection's autocast casts it
    kv_nope, k_rot = raw["kv_a_proj_with_mqa"].split([shapes.kv_lora_rank, shapes.qk_rope_head_dim], dim=-1)
    c_kv = torch.func.functional_call(plan.kv_norm, {"weight": kv_norm_weight}, (kv_nope,))
    # Rotated by float32 tables, cast back as the attention's autocast casts them.
    k_rot = plan.rope(k_rot.unsqueeze(2), tables).squeeze(2).to(kv_nope.dtype)
    return c_q, torch.cat([c_kv.to(k_rot.dtype), k_rot], dim=-1)


def gather_latent(plan, latent):
    """Start the all-gather of the full sequence's latent: the returned
    pending op's ``wait()`` gives it ``(B, S, width)`` in natural order, from
    every rank's ``(B, S/D, width)``."""
    if plan.tsp_size == 1:
        return comm.Pending(None, lambda: latent)
    gathered, work = comm.all_gather(latent, plan.group, async_op=True)
    return comm.Pending(work, lambda: layout.unshard(gathered, plan.tsp_size, plan.layout, dim=1))


def scatter_latent_grad(plan, grad, dtype):
    """The local tokens' part of the full sequence's latent gradient ``grad``
    (float32 or wider), summed over ranks: sent in ``dtype``, added in float32 or wider."""
    if plan.tsp_size == 1:
        return grad
    stacked = layout.stack_shards(grad, plan.tsp_size, plan.layout, dim=1, dtype=dtype)
    return comm.reduce_scatter_fp32(stacked, plan.group)


def head_group_queries(plan, q_input, w, tables):
    """Head group ``w``'s queries of the local tokens (``q_input``: the query
    latent, or the hidden states without one): ``(q_nope, q_rot)``, rotated
    and scaled."""
    shapes = plan.shapes
    B, L = q_input.shape[:2]
    q = F.linear(q_input, w[f"{shapes.query_projection}.weight"]).view(B, L, shapes.q_heads, shapes.qk_head_dim)
    q_nope, q_rot = q.split([shapes.qk_nope_head_dim, shapes.qk_rope_head_dim], dim=-1)
    q_rot = plan.rope(q_rot, tables).to(q.dtype)
    if plan.query_scale is not None:
        factor = plan.query_scale[:, :, None, None].to(q.dtype)  # as Hugging Face casts it
        q_nope, q_rot = q_nope * factor, q_rot * factor
    return q_nope, q_rot


def up_projection(plan, w):
    """Head group ``w``'s ``kv_b_proj`` by head: ``(hq, qk_nope_head_dim + v_head_dim, kv_lora_rank)``, each
    head's key rows then its value rows."""
    shapes = plan.shapes
    return w["kv_b_proj.weight"].view(shapes.q_heads, shapes.qk_nope_head_dim + shapes.v_head_dim,
                                      shapes.kv_lora_rank)


def head_group_attention(plan, q_input, latent, w, tables, queries=None):
    """Head group ``w``'s attention inputs ``(q, K, V)``: its queries of the
    local tokens (``queries``, or ``head_group_queries`` of ``q_input``) and
    the whole sequence's ``latent`` as keys and values, in latent space with
    the key up-projection absorbed into the queries (one key head shared by
    every query head), or expanded into the group's keys and values."""
    shapes = plan.shapes
    hq, nope, rope_dim, v_dim = shapes.q_heads, shapes.qk_nope_head_dim, shapes.qk_rope_head_dim, shapes.v_head_dim
    q_nope, q_rot = queries or head_group_queries(plan, q_input, w, tables)
    c_kv, k_rot = latent.split([shapes.kv_lora_rank, rope_dim], dim=-1)
    if plan.form == "absorbed":
        q_latent = torch.einsum("blhn,hnc->blhc", q_nope, up_projection(plan, w)[:, :nope])
        return torch.cat([q_latent, q_rot], dim=-1), latent.unsqueeze(2), c_kv.unsqueeze(2)
    B, S = latent.shape[:2]
    k_nope, v = F.linear(c_kv, w["kv_b_proj.weight"]).view(B, S, hq, nope + v_dim).split([nope, v_dim], dim=-1)
    keys = torch.cat([k_nope, k_rot.unsqueeze(2).expand(-1, -1, hq, -1)], dim=-1)
    return torch.cat([q_nope, q_rot], dim=-1), keys, v


def head_group_output(plan, o, w, x):
    """Head group ``w``'s output ``(B, S/D, hq * v_head_dim)`` from its
    attention's ``o``: the value up-projection applied where it attended in
    latent space, and gated by the sigmoid of ``x``'s ``gate_proj`` rows where
    it has them, as Hugging Face's."""
    if plan.form == "absorbed":
        o = torch.einsum("blhc,hvc->blhv", o, up_projection(plan, w)[:, plan.shapes.qk_nope_head_dim:])
    if "gate_proj.weight" in w:
        o = o * torch.sigmoid(F.linear(x, w["gate_proj.weight"]).view(o.shape))
    return o.flatten(2)


def head_group(plan, q_input, latent, w, tables, queries=None, chosen=None, x=None, saved=None):
    """Head group ``w``'s attention output ``(B, S/D, hq * v_head_dim)``: its
    queries of the local tokens (``queries``, or ``head_group_queries`` of
    ``q_input``) against the whole sequence's ``latent``, or only its rows
    each query's ``chosen`` names (``(B, S/D, k)``, the lightning indexer's);
    with the group's sink logits (``w["sinks"]``) in each softmax, and its
    output gated by the sigmoid of ``x``'s ``gate_proj`` rows where it has them.
    With ``plan.explicit_backward`` the fused kernels attend, and the
    attention's output and log-sum-exp are appended to ``saved``
    (``{"o": [], "lse": []}``), if given, for ``fused_head_group_backward``."""
    q, K, V = head_group_attention(plan, q_input, latent, w, tables, queries)
    if plan.explicit_backward:
        o, lse = attend_padded(plan, q, K, V)
        if saved is not None:
            saved["o"].append(o), saved["lse"].append(lse)
    else:
        o = _attend(plan, q, K, V, chosen, w.get("sinks"))
    return head_group_output(plan, o, w, x)


def padded_values(V, width):
    """``V`` ``(..., d_v)`` with zero columns up to ``width``: the fused
    kernels take one head size for queries, keys and values; the padding's
    outputs are zero and the log-sum-exp is unchanged."""
    return F.pad(V, (0, width - V.shape[-1]))


def attend_padded(plan, q, K, V):
    """``attend_local_chunks`` by the fused kernels for values narrower than the
    queries and keys: their output ``(B, S/D, h, d_v)`` and log-sum-exp."""
    o, lse = attend_local_chunks(plan, q, K, padded_values(V, q.shape[-1]))
    return o[..., :V.shape[-1]].contiguous(), lse


def _sum_grads(a, b):
    return a if b is None else b if a is None else a + b


def fused_head_group_backward(plan, leaves, w, tables, o_attn, lse, grad_tokens):
    """A head group's backward against its attention's saved output ``o_attn``
    and log-sum-exp (``head_group`` with ``plan.explicit_backward``): its
    queries, keys and values are made again under autograd from ``leaves``
    (``q``, ``latent``, the group's weights in ``w``, ``x`` for a gate), its
    attention is not: the fused kernels' own backward gives their gradients.
    ``grad_tokens``: the layer's output gradient ``(N, H)``. Returns the
    gradients of ``leaves``, in their order, and the group's output."""
    with torch.enable_grad():
        q, K, V = head_group_attention(plan, leaves["q"], leaves["latent"], w, tables)
        o_leaf = o_attn.detach().requires_grad_()
        o = head_group_output(plan, o_leaf, w, leaves.get("x"))
    grad_o = (grad_tokens @ w["o_proj.weight"]).view_as(o)
    grad_o_attn, *after = torch.autograd.grad(o, [o_leaf, *leaves.values()], grad_o, allow_unused=True)
    width, acc = q.shape[-1], _accumulator_dtype(plan, K.dtype)
    grad_K = torch.zeros(K.shape, dtype=acc, device=K.device)
    grad_V = torch.zeros((*V.shape[:-1], width), dtype=acc, device=V.device)
    dq, _ = attend_local_chunks_backward(plan, padded_values(grad_o_attn, width), q.detach(), K.detach(),
                                         padded_values(V.detach(), width), padded_values(o_attn, width), lse, grad_K,
                                         grad_V)
    before = torch.autograd.grad([q, K, V], list(leaves.values()),
                                 [dq.to(q.dtype), grad_K.to(K.dtype), grad_V[..., :V.shape[-1]].to(V.dtype)],
                                 allow_unused=True)
    return [_sum_grads(a, b) for a, b in zip(after, before)], o.detach()


def _attend(plan, q, K, V, chosen, sinks=None):
    if chosen is None:
        return attend_local_chunks(plan, q, K, V)[0]
    return attend_selected(q, K, V, chosen, plan.scale, sinks)


def _accumulator_dtype(plan, dtype):
    return torch.promote_types(dtype, torch.float32) if plan.fp32_accumulators else dtype


def latent_attention_forward(plan, x, packed, tables, q_norm_weight, kv_norm_weight, latent_sink=None, chosen=None,
                             saved=None):
    """Forward of one layer on the local tokens ``x``; returns the output
    ``(B, S/D, H)``, the down projections' outputs, which backward keeps, and
    the keys each query attended to (``chosen``, or its own indexer's choice;
    None without an indexer). ``saved``: ``{"o": [], "lse": []}`` each head
    group's attention output and log-sum-exp are appended to, for backward,
    with ``plan.explicit_backward``. ``latent_sink(latent)``, if given, receives the
    local tokens' latent and rotated key ``(B, S/D, width)``, and their index
    keys after them where the layer has an indexer (a generation's prefill
    caches them)."""
    raw = down_project(plan, x, packed)
    c_q, latent = local_latent(plan, raw, tables, q_norm_weight, kv_norm_weight)
    index = None
    if plan.indexer is not None:
        with torch.no_grad():
            index = index_inputs(plan.indexer, x, *index_projections(x, c_q, piece_stream(plan, packed, 2)), tables)
        latent = torch.cat([latent, index[2]], dim=-1)  # the index keys ride in the latent's gather
    if latent_sink is not None:
        latent_sink(latent)
    gathering, latent = gather_latent(plan, latent), None
    q_input = x if c_q is None else c_q
    out = torch.empty((x.shape[0] * x.shape[1], x.shape[2]), dtype=_accumulator_dtype(plan, x.dtype),
                      device=x.device)
    for j, w in piece_stream(plan, packed, 1):
        queries = head_group_queries(plan, q_input, w, tables)
        if latent is None:  # the gather ran under the first head group's queries
            latent = gathering.wait()
            if index is not None:
                latent, keys = latent.split([plan.shapes.latent_width, plan.shapes.index_head_dim], dim=-1)
                chosen = choose_keys(plan.indexer, index[0], index[1], keys)
                index = keys = None
        o = head_group(plan, q_input, latent, w, tables, queries, chosen, x, saved)
        precision.add_matmul(out, o.flatten(0, 1), w["o_proj.weight"].t(), add=j > 0)
    return out.view(x.shape).to(x.dtype), raw, chosen


class ShardGrads:
    """The weight gradients of every rank's pieces this rank computes, each
    reduced to its owner as soon as it is whole; this rank's own sums are
    collected into one buffer laid out like its packed shard."""

    def __init__(self, plan, packed):
        self.plan, self.tsp_rank = plan, comm.group_rank(plan.group)
        self.acc_dtype = torch.promote_types(packed.dtype, torch.float32)
        self.own = torch.empty(packed.numel(), dtype=self.acc_dtype, device=packed.device)
        self.reduces = ReducesInFlight(plan)

    def buffer(self, j, part):
        """A flat float32-or-wider gradient buffer of piece ``part`` of rank ``j``, and its views by name."""
        specs = self.plan.specs[j]
        if j == self.tsp_rank:
            flat = self.own.narrow(0, part_offset(specs, part), specs[part].numel)
        else:
            flat = torch.empty(specs[part].numel, dtype=self.acc_dtype, device=self.own.device)
        return flat, specs[part].unpack(flat)

    def send(self, j, flat):
        self.reduces.start(flat, j)

    def own_shard(self):
        self.reduces.finish()
        return self.own


def _leaf(t):
    return None if t is None else t.detach().requires_grad_()


def head_groups_backward(plan, grad_out, packed, q_input, latent, tables, grads, chosen=None, x=None, saved=None):
    """Every head group's backward: the gradients of ``q_input``, of the
    whole sequence's ``latent`` and of the output gate's input ``x`` (None
    without a gate), float32 or wider, each group's weight gradient sent to its
    owner; ``chosen``: each query's keys (``head_group``); ``saved``: each
    group's attention output and log-sum-exp with ``plan.explicit_backward``
    (``fused_head_group_backward``), else the groups run again under autograd."""
    shapes = plan.shapes
    acc = _accumulator_dtype(plan, latent.dtype)
    grad_q_input = torch.zeros(q_input.shape, dtype=acc, device=q_input.device)
    grad_latent = torch.zeros(latent.shape, dtype=acc, device=latent.device)
    grad_x = torch.zeros(x.shape, dtype=acc, device=x.device) if shapes.head_gate else None
    grad_tokens = grad_out.flatten(0, 1)  # (N, H)
    names = (f"{shapes.query_projection}.weight", "kv_b_proj.weight",
             *(["gate_proj.weight"] if shapes.head_gate else []), *(["sinks"] if shapes.sinks else []))
    for j, w in piece_stream(plan, packed, 1):
        leaves = {"q": _leaf(q_input), "latent": _leaf(latent), **{name: _leaf(w[name]) for name in names},
                  **({"x": _leaf(x)} if shapes.head_gate else {})}
        group_weights = {**w, **{name: leaves[name] for name in names}}
        if plan.explicit_backward:
            (d_q, d_latent, *d_weights), o = fused_head_group_backward(plan, leaves, group_weights, tables,
                                                                       saved["o"][j], saved["lse"][j], grad_tokens)
        else:
            with torch.enable_grad():
                o = head_group(plan, leaves["q"], leaves["latent"], group_weights, tables, chosen=chosen,
                               x=leaves.get("x"))
                grad_o = (grad_tokens @ w["o_proj.weight"]).view_as(o)
                d_q, d_latent, *d_weights = torch.autograd.grad(o, list(leaves.values()), grad_o)
        if shapes.head_gate:
            grad_x += d_weights.pop()
        grad_q_input += d_q
        grad_latent += d_latent
        flat, into = grads.buffer(j, 1)
        for name, grad in zip(names, d_weights):
            into[name].copy_(grad)
        precision.partial_matmul(grad_tokens.t(), o.detach().flatten(0, 1), out=into["o_proj.weight"], add=False)
        grads.send(j, flat)
    return grad_q_input, grad_latent, grad_x


def down_backward(plan, x, packed, grad_raw, grads, grad_x):
    """The down projections' backward: each piece's rows of ``grad_raw`` into
    ``grad_x`` (float32 or wider) and, against the local tokens, into the
    piece's weight gradient, which goes to its owner."""
    tokens = x.flatten(0, 1)
    for j, w in piece_stream(plan, packed, 0):
        flat, into = grads.buffer(j, 0)
        for name, grad in grad_raw.items():
            rows = plan.shapes.rows(name, j)
            part = grad[..., rows].flatten(0, 1)  # (N, rows of piece j)
            precision.add_matmul(grad_x, part, w[f"{name}.weight"])
            precision.partial_matmul(part.t(), tokens, out=into[f"{name}.weight"], add=False)
            if f"{name}.bias" in into:
                torch.sum(part, 0, dtype=into[f"{name}.bias"].dtype, out=into[f"{name}.bias"])
        grads.send(j, flat)


def latent_attention_backward(plan, grad_out, x, packed, tables, raw, q_norm_weight, kv_norm_weight, chosen=None,
                              saved=None):
    """Gradients of the local tokens ``x``, this rank's packed shard and the two latent norms' weights;
    ``chosen``: the keys each query attended to in forward; ``saved``: what the forward's head groups kept
    (``head_groups_backward``). The indexer's piece takes none (zeros)."""
    grads = ShardGrads(plan, packed)
    if plan.indexer is not None:
        grads.buffer(grads.tsp_rank, 2)[0].zero_()
    leaves = {"raw": {name: _leaf(t) for name, t in raw.items()}, "q_norm": _leaf(q_norm_weight),
              "kv_norm": _leaf(kv_norm_weight)}
    with torch.enable_grad():
        c_q, local = local_latent(plan, leaves["raw"], tables, leaves["q_norm"], leaves["kv_norm"])
    q_input = x if c_q is None else c_q.detach()
    latent = gather_latent(plan, local.detach()).wait()
    grad_q_input, grad_latent, grad_gate_input = head_groups_backward(plan, grad_out, packed, q_input, latent, tables,
                                                                      grads, chosen, x, saved)
    latent = None
    grad_local = scatter_latent_grad(plan, grad_latent, x.dtype)
    outputs, grad_outputs = [local], [grad_local.to(local.dtype)]
    if c_q is not None:
        outputs.append(c_q), grad_outputs.append(grad_q_input.to(c_q.dtype))
    inputs = [*leaves["raw"].values(), *(leaves[name] for name in ("q_norm", "kv_norm") if leaves[name] is not None)]
    with torch.enable_grad():
        found = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
    grad_raw = dict(zip(leaves["raw"], found))
    grad_norms = dict(zip([name for name in ("q_norm", "kv_norm") if leaves[name] is not None],
                          found[len(grad_raw):]))
    # Without a query latent the queries come from x itself.
    grad_x = (grad_q_input if c_q is None else grad_q_input.new_zeros(x.shape)).flatten(0, 1)
    if grad_gate_input is not None:  # the output gate's, from the layer's input
        grad_x += grad_gate_input.flatten(0, 1)
    down_backward(plan, x, packed, grad_raw, grads, grad_x)
    own = grads.own_shard()
    return (grad_x.view(x.shape).to(x.dtype), own.to(packed.dtype), grad_norms.get("q_norm"),
            grad_norms.get("kv_norm"))


class TSPLatentAttentionFunction(EagerFunction):
    """forward: ``latent_attention_forward``, saving its input, down projections
    and the keys each query attended to; backward: ``latent_attention_backward``.
    Returns the output and those keys (None without an indexer), which are
    given back as ``chosen`` to a layer that shares its indexer's choice."""

    # Under autocast the input and the shard are cast to the autocast dtype and the layer runs as a model of that
    # dtype would; the latents' norm weights keep theirs, as Hugging Face's norms do.
    @staticmethod
    @autocast_forward(cast_inputs=True, keep=(4, 5))
    def forward(ctx, x, packed, plan, tables, q_norm_weight, kv_norm_weight, chosen=None):
        # The norm weights are inputs only so that autograd routes their gradients.
        saved = {"o": [], "lse": []}
        out, raw, chosen = latent_attention_forward(plan, x, packed, tables, q_norm_weight, kv_norm_weight,
                                                    chosen=chosen, saved=saved)
        ctx.plan, ctx.tables, ctx.raw_names, ctx.groups = plan, tables, tuple(raw), len(saved["o"])
        ctx.save_for_backward(x, packed, q_norm_weight, kv_norm_weight, chosen, *raw.values(), *saved["o"],
                              *saved["lse"])
        if chosen is not None:
            ctx.mark_non_differentiable(chosen)
        return out, chosen

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_out, grad_chosen=None):
        x, packed, q_norm_weight, kv_norm_weight, chosen, *rest = ctx.saved_tensors
        raw, rest = rest[:len(ctx.raw_names)], rest[len(ctx.raw_names):]
        saved = {"o": rest[:ctx.groups], "lse": rest[ctx.groups:]}
        grads = latent_attention_backward(ctx.plan, grad_out.contiguous(), x, packed, ctx.tables,
                                          dict(zip(ctx.raw_names, raw)), q_norm_weight, kv_norm_weight, chosen, saved)
        grad_x, grad_packed, grad_q_norm, grad_kv_norm = grads
        return grad_x, grad_packed, None, None, grad_q_norm, grad_kv_norm, None
