"""Gated DeltaNet's schedule under TSP (DESIGN.md 6j), as plain forward and
backward functions and the autograd Function that runs them.

Per layer, on every rank, with ``x`` its local tokens ``(B, S/D, H)``, for
every owner ``j`` in turn (the next head group's broadcast in flight under
this one's compute):

1. head group ``j``'s shard is broadcast; each rank projects its own tokens;
2. the short convolution takes the ``kernel - 1`` tokens before each of its
   chunks from their owners (``conv``: one small all-gather of chunk tails);
3. the recurrence runs each chunk from its exact initial state, composed from
   every chunk's state map (``recurrence``: one all-gather of the maps, bytes
   independent of the sequence length);
4. the gated norm and the group's ``out_proj`` columns: the groups' outputs
   sum locally, so no all-reduce is needed.

Backward broadcasts the groups again and runs each group's local backward
under autograd (its convolution and recurrence Functions do their transposed
exchanges); each group's weight gradient goes to its owner, summed in
float32 or wider. Saved: the local input only.

Numerics are Hugging Face's (``torch_chunk_gated_delta_rule``): the decay
``g`` and the rule in float32, or in the model's dtype where it is wider;
the output back in the model's dtype before the gated norm.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds_tsp.blocks.latent.schedule import ShardGrads, piece_stream
from ds_tsp.blocks.linear.conv import causal_conv
from ds_tsp.blocks.linear.delta_rule import GATED_DELTA
from ds_tsp.blocks.linear.recurrence import chunk_recurrence, recurrence_forward
from ds_tsp.blocks.linear.shards import CONV_PARTS
from ds_tsp.parallel import precision
from ds_tsp.parallel.amp import autocast_backward, autocast_forward
from ds_tsp.parallel.eager import EagerFunction


@dataclass(frozen=True)
class DeltaNetPlan:
    """Everything the schedule needs besides tensors."""

    group: object
    shapes: object  # shards.DeltaNetShapes
    specs: tuple  # every rank's (shard,) PackSpec, as ShardGrads reads them
    layout: str
    norm: object  # the Hugging Face gated norm module, run with the given weight
    norm_weight: str  # its weight's Hugging Face name, among the replicated tensors
    replicated_names: tuple  # the Hugging Face names of the tensors every rank holds whole, as the Function takes them
    activation: object  # the convolution's activation (the layer's own)
    overlap: bool
    documents: list | None  # the rows' packed document starts (ds_tsp.blocks.documents)
    starts: object  # (B, S/D) bool: the local tokens that start a document, or None
    chunk_size: int = 64
    # Generation's prefill: (B, S/D) bool, the real tokens (padding then neither decays nor writes the state, so
    # the final state is each row's after its last real token), and state_sink(j, conv inputs (B, S/D, C), final
    # state (B, hv, dk, dv)), called for every head group j.
    valid: object = None
    state_sink: object = None
    fp32_accumulators: bool = True
    grad_wire_dtype: object = None
    beta_scale: float = 1.0  # 2 where the layer allows negative eigenvalues (OLMo-Hybrid's allow_neg_eigval)

    @property
    def tsp_size(self):
        return self.shapes.tsp_size


def project(shapes, x, w):
    """The local tokens' ``q, k`` ``(B, L, hk*dk)``, ``v, z`` ``(B, L, hv*dv)``
    and ``b, a`` ``(B, L, hv)`` of one head group, from its weights ``w``."""
    B, L = x.shape[:2]
    if shapes.interleaved:  # Hugging Face's fix_query_key_value_ordering, on the group's key heads
        dk, r_dv, r = shapes.head_k_dim, shapes.ratio * shapes.head_v_dim, shapes.ratio
        qkvz = F.linear(x, w["in_proj_qkvz.weight"]).view(B, L, shapes.k_heads, 2 * dk + 2 * r_dv)
        q, k, v, z = qkvz.split([dk, dk, r_dv, r_dv], dim=-1)
        b, a = F.linear(x, w["in_proj_ba.weight"]).view(B, L, shapes.k_heads, 2 * r).split([r, r], dim=-1)
        return (*(t.reshape(B, L, -1) for t in (q, k, v, z, b, a)),)
    return tuple(F.linear(x, w[f"in_proj_{name}.weight"]) for name in "qkvzba")


def head_group(plan, x, w, replicated, sink=None):
    """Head group ``w``'s output before ``out_proj``, ``(B, L, hv*dv)``, of the
    local tokens ``x``; ``replicated``: the tensors every rank holds whole, by
    Hugging Face name (the gated norm's weight; KDA's gates' down projections);
    ``sink(conv inputs, final state)``: see ``DeltaNetPlan.state_sink``
    (forward only: no autograd)."""
    shapes = plan.shapes
    B, L = x.shape[:2]
    w = compute_weights(w, x.dtype)
    wide = torch.promote_types(x.dtype, torch.float32)
    if shapes.kda:
        q, k, v, z, beta, g = kda_inputs(shapes, x, w, replicated, wide)
        normalize = kda_l2norm
    else:
        q, k, v, z, b, a = project(shapes, x, w)
        beta = b.sigmoid() if plan.beta_scale == 1 else b.sigmoid() * plan.beta_scale
        g = -w["A_log"].to(wide).exp() * F.softplus(a.to(wide) + w["dt_bias"])
        normalize = l2norm
    conv_weight = torch.cat([w[f"{part}.weight"] for part in CONV_PARTS]).squeeze(1)  # (C, kernel)
    conv_bias = torch.cat([w[f"{part}.bias"] for part in CONV_PARTS]) if shapes.conv_bias else None
    conv_inputs = torch.cat([q, k, v], dim=-1)
    mixed = causal_conv(conv_inputs, conv_weight, conv_bias, plan.group, plan.layout, plan.activation,
                        plan.documents)
    q, k, v = mixed.split([shapes.key_rows, shapes.key_rows, shapes.value_rows], dim=-1)
    if plan.valid is not None:
        valid = plan.valid.view(*plan.valid.shape, *[1] * (g.dim() - 2))
        beta, g = beta * plan.valid[..., None], g * valid

    def heads(t, dim):  # (B, L, h*dim) -> (B, hv, L, dim) in the rule's dtype, keys/queries repeated
        t = t.reshape(B, L, -1, dim)
        if t.shape[2] != shapes.v_heads:
            t = t.repeat_interleave(shapes.ratio, dim=2)
        return t.transpose(1, 2).to(wide)

    q, k = (normalize(heads(t, shapes.head_k_dim)) for t in (q, k))
    q = q * shapes.head_k_dim ** -0.5
    v, g, beta = heads(v, shapes.head_v_dim), g.transpose(1, 2), beta.transpose(1, 2).to(wide)
    if sink is None:
        out = chunk_recurrence(GATED_DELTA, (q, k, v, g, beta), plan.group, plan.layout, plan.chunk_size, plan.starts)
    else:
        out, _, final, _ = recurrence_forward(GATED_DELTA, (q, k, v, g, beta), plan.starts, plan.group,
                                              plan.layout, plan.chunk_size)
        sink(conv_inputs, final)
    out = out.transpose(1, 2).to(x.dtype)  # (B, L, hv, dv)
    normed = torch.func.functional_call(plan.norm, {"weight": replicated[plan.norm_weight]},
                                        (out.reshape(-1, shapes.head_v_dim), z.reshape(-1, shapes.head_v_dim)))
    return normed.reshape(B, L, -1)


def kda_inputs(shapes, x, w, replicated, wide):
    """Kimi Linear's KDA inputs of one head group (``KimiLinearDeltaAttention``):
    ``q, k, v`` ``(B, L, h*d)``, its output gate ``(B, L, h*d)`` (``g_b_proj``
    of the whole ``g_a_proj``), ``beta`` ``(B, L, h)`` and the log decay per
    key channel ``(B, L, h, d)``: ``-exp(A_log)`` times its forget gate's
    softplus (``KimiLinearForgetGate``: ``f_b_proj`` of the whole ``f_a_proj``
    plus ``dt_bias``, in float32 or wider), as Hugging Face computes them."""
    B, L = x.shape[:2]
    q, k, v = (F.linear(x, w[f"{name}_proj.weight"]) for name in "qkv")
    gate = F.linear(F.linear(x, replicated["g_a_proj.weight"].to(x.dtype)), w["g_b_proj.weight"])
    forget = F.linear(F.linear(x, replicated["forget_gate.f_a_proj.weight"].to(x.dtype)),
                      w["forget_gate.f_b_proj.weight"])
    g = (forget.to(wide) + w["forget_gate.dt_bias"].to(wide)).view(B, L, shapes.v_heads, shapes.head_k_dim)
    softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))  # Hugging Face's, bounded
    g = -torch.exp(w["forget_gate.A_log"].to(wide)).view(1, 1, shapes.v_heads, 1) * softplus
    beta = torch.sigmoid(F.linear(x, w["b_proj.weight"]))
    return q, k, v, gate, beta, g


def compute_weights(w, dtype):
    """A head group's weights as its products take them: in the tokens' dtype
    (an autocast dtype, where the shard stayed float32), but ``A_log`` and
    ``dt_bias``, which the decay takes in their own dtype and widens to
    float32, as Hugging Face's layer does."""
    return {name: t if name.endswith(("A_log", "dt_bias")) else t.to(dtype) for name, t in w.items()}


def l2norm(t, eps=1e-6):
    """Hugging Face's (and flash-linear-attention's) ``l2norm``."""
    return t * torch.rsqrt((t * t).sum(dim=-1, keepdim=True) + eps)


def kda_l2norm(t, eps=1e-6):
    """Kimi Linear's ``l2norm``: a division by the root, as its Triton kernels compute it."""
    return t / torch.sqrt((t * t).sum(dim=-1, keepdim=True) + eps)


def _accumulator_dtype(plan, dtype):
    return torch.promote_types(dtype, torch.float32) if plan.fp32_accumulators else dtype


def delta_net_forward(plan, x, packed, replicated):
    """Forward of one layer on the local tokens ``x``: the output ``(B, S/D, H)``;
    ``replicated``: the tensors every rank holds whole, by Hugging Face name."""
    out = torch.empty((x.shape[0] * x.shape[1], x.shape[2]), dtype=_accumulator_dtype(plan, x.dtype),
                      device=x.device)
    out_proj = plan.shapes.out_proj
    for j, w in piece_stream(plan, packed, 0):
        sink = None if plan.state_sink is None else functools.partial(plan.state_sink, j)
        o = head_group(plan, x, w, replicated, sink)
        precision.add_matmul(out, o.flatten(0, 1), w[out_proj].to(x.dtype).t(), add=j > 0)
    return out.view(x.shape).to(x.dtype)


def delta_net_backward(plan, grad_out, x, packed, replicated):
    """Gradients of the local tokens ``x``, this rank's packed shard and the
    ``replicated`` tensors (``{Hugging Face name: tensor}``), in their order."""
    grads = ShardGrads(plan, packed)
    acc = _accumulator_dtype(plan, x.dtype)
    grad_x = torch.zeros(x.shape, dtype=acc, device=x.device)
    grad_replicated = [torch.zeros(t.shape, dtype=acc, device=x.device) for t in replicated.values()]
    grad_tokens = grad_out.flatten(0, 1)  # (N, H)
    out_proj = plan.shapes.out_proj
    for j, w in piece_stream(plan, packed, 0):
        names = [name for name in w if name != out_proj]
        whole = [t.detach().requires_grad_() for t in replicated.values()]
        leaves = [x.detach().requires_grad_(), *whole, *(w[name].detach().requires_grad_() for name in names)]
        with torch.enable_grad():
            o = head_group(plan, leaves[0], dict(zip(names, leaves[1 + len(whole):])), dict(zip(replicated, whole)))
            grad_o = (grad_tokens @ w[out_proj].to(grad_tokens.dtype)).view_as(o)
            found = torch.autograd.grad(o, leaves, grad_o)
        grad_x += found[0]
        for total, grad in zip(grad_replicated, found[1:1 + len(whole)]):
            total += grad
        flat, into = grads.buffer(j, 0)
        for name, grad in zip(names, found[1 + len(whole):]):
            into[name].copy_(grad)
        precision.partial_matmul(grad_tokens.t(), o.detach().flatten(0, 1), out=into[out_proj], add=False)
        grads.send(j, flat)
    own = grads.own_shard()
    grad_replicated = [grad.to(t.dtype) for grad, t in zip(grad_replicated, replicated.values())]
    return grad_x.to(x.dtype), own.to(packed.dtype), grad_replicated


class TSPDeltaNetFunction(EagerFunction):
    """forward: ``delta_net_forward``, saving its input; backward: ``delta_net_backward``."""

    # Under autocast the input is cast to the autocast dtype and the layer runs as a model of that dtype would; the
    # shard keeps its dtype (each group's matrices are cast once received, A_log and dt_bias never, as Hugging
    # Face's layer widens them to float32: rounded to bf16 they would move every decay), and so do the replicated
    # tensors (the gated norm's weight, as Hugging Face's norm does; KDA's gates' down projections, cast where
    # used). The shards then travel in their own dtype.
    @staticmethod
    @autocast_forward(cast_inputs=True, keep=(1, 3, 4, 5))
    def forward(ctx, x, packed, plan, *replicated):
        ctx.plan = plan
        ctx.save_for_backward(x, packed, *replicated)
        return delta_net_forward(plan, x, packed, dict(zip(plan.replicated_names, replicated)))

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_out):
        x, packed, *replicated = ctx.saved_tensors
        grad_x, grad_packed, grad_replicated = delta_net_backward(
            ctx.plan, grad_out.contiguous(), x, packed, dict(zip(ctx.plan.replicated_names, replicated)))
        return grad_x, grad_packed, None, *grad_replicated
