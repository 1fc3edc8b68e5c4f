"""Multi-head latent attention in generation (DESIGN.md 6i): the cache holds
each rank's tokens' latent and rotary key, ``kv_lora_rank + qk_rope_head_dim``
elements a token for all heads, as one key head (``TSPCache`` with no values:
a token's value is its latent).

Prefill runs the training schedule (``latent_attention_forward``) and caches
the local prompt tokens' latent. A decode step keeps the weights at rest and
attends in latent space (the absorbed form, the one the cost model picks for
one query token): every rank projects the new token through its down piece;
one all-gather hands every rank the whole down projection, so each normalises
and rotates the new latent and the rank ``TSPCache.place_next_token`` chose
caches it; rank ``j`` makes head group ``j``'s queries, absorbs the group's key
up-projection into them, and one all-gather hands every rank every head's
latent queries. Each rank attends all heads over its LOCAL cache; an
all-to-all sends head group ``j``'s partial ``(out, lse)`` to rank ``j``, which
merges them, applies the group's value up-projection and ``o_proj`` columns;
the ``D`` partial outputs are summed in rank order as the other layers' are.
Bytes received per rank, per decode step and layer, ``w = kv_lora_rank +
qk_rope_head_dim``, ``c = kv_lora_rank``::

    (D-1) * B * [ rows * e               # all-gather of the down pieces' rows (the widest piece's)
                + hq * w * e             # all-gather of the latent queries
                + hq * (c + 1) * a       # all-to-all of partial (out, lse)
                + H * e ]                # all-gather of the attention output parts

DeepSeek's sparse attention (``ds_tsp.blocks.latent.indexer``): a layer with a
lightning indexer of its own caches each token's index key after its latent;
a decode step gathers every rank's rows of the new token's ``wq_b`` and
``wk`` outputs, scores the new query against this rank's cached index keys,
and gathers every rank's best ``index_topk`` (score, position) pairs, from
which each rank keeps the cached keys that rank among the ``index_topk``
best (the earlier key first among equal scores) and attends to those only.
That adds ``(D-1) * B * [index_rows * e + 2 * index_topk * 8]`` bytes
(``index_rows``: the widest rank's rows of ``wq_b`` and ``wk``; the pairs in
float64). A layer reusing an earlier layer's choice (GLM-MoE-DSA's) moves nothing more.
"""

import torch
import torch.nn.functional as F

from ds_tsp.blocks.latent.indexer import index_inputs
from ds_tsp.blocks.latent.schedule import latent_attention_forward, local_latent
from ds_tsp.blocks.latent.shards import INDEXER_PROJECTIONS
from ds_tsp.parallel import comm


def latent_cache_shape(attn):
    """``(key heads, key width, value width)`` of a latent attention's cache: its latent and rotary key, and the
    index key after them where the layer has a lightning indexer of its own."""
    return 1, attn.shapes.latent_width + attn.shapes.index_head_dim, 0


def prefill_latent_attention(attn, h, tables, positions, write, chosen=None):
    """The training schedule's output for the local prompt tokens ``h`` at
    ``positions`` ``(B, S/D)``, and the keys each chose (``chosen``, an
    earlier layer's choice it reuses, or its own indexer's; None without);
    ``write(latent)`` caches their latent ``(B, S/D, 1, width)``."""
    packed = attn.shard_weights().detach()
    q_norm_weight = None if attn.q_a_layernorm is None else attn.q_a_layernorm.weight
    out, _, chosen = latent_attention_forward(attn.plan(h, positions=positions), h, packed, tables, q_norm_weight,
                                              attn.kv_a_layernorm.weight,
                                              latent_sink=lambda latent: write(latent.unsqueeze(2)), chosen=chosen)
    return out if attn.o_bias is None else out + attn.o_bias, chosen


def decode_latent_attention(attn, h, tables, positions, group, write, attend, sum_over_group, choose=None,
                            chosen=None):
    """Attention of the new token ``h`` ``(B, 1, H)`` at ``positions`` ``(B, 1)``, see the module docstring,
    and the cached keys it attended to (None: all). ``write(latent)`` caches the new latent ``(B, 1, 1,
    width)`` where this rank is the one chosen; ``attend(q, chosen)`` attends every head's latent queries ``(B,
    nq, width)`` over every rank's cache (``chosen`` of it, ``(B, T)`` bool, or all) and returns this rank's
    head group's merged output ``(B, hq, kv_lora_rank)`` and log-sum-exp ``(B, hq)`` (a head's sink logit joins
    its softmax through it); ``sum_over_group(part)`` sums every rank's part in rank order. An output gate (HY-V4's
    ``gate_proj``) gates each head's output from the new token. DeepSeek's sparse attention: a layer with an
    indexer of its own caches the new token's index key after its latent and ``choose(q, weights)`` (its index
    query ``(B, Hi, Di)`` and head weights ``(B, Hi)``) gives the cached keys it chooses; a layer reusing an
    earlier layer's choice is given it as ``chosen``."""
    shapes = attn.shapes
    plan = attn.plan(h, positions=positions, form="absorbed", decode=True)  # what this step runs, not a choice
    down, heads, *indexer = (spec.unpack(piece) for spec, piece in zip(attn.specs[attn.tsp_rank], _pieces(attn)))
    raw = _whole_down_projections(attn, h, down, group)
    q_norm_weight = None if attn.q_a_layernorm is None else attn.q_a_layernorm.weight
    c_q, latent = local_latent(plan, raw, tables, q_norm_weight, attn.kv_a_layernorm.weight)  # (B, 1, width)
    if plan.indexer is not None:
        q_index, weights, k_index = index_inputs(plan.indexer, h, *_whole_index_projections(attn, h, c_q,
                                                                                             indexer[0], group),
                                                 tables)
        write(torch.cat([latent, k_index], dim=-1).unsqueeze(2))
        chosen = choose(q_index[:, 0], weights[:, 0])
    else:
        write(latent.unsqueeze(2))
    hq, nope, c = shapes.q_heads, shapes.qk_nope_head_dim, shapes.kv_lora_rank
    q = F.linear(h if c_q is None else c_q, heads[f"{shapes.query_projection}.weight"])
    q_nope, q_rot = q.view(h.shape[0], 1, hq, shapes.qk_head_dim).split([nope, shapes.qk_rope_head_dim], dim=-1)
    q_rot = plan.rope(q_rot, tables).to(q.dtype)
    if plan.query_scale is not None:
        factor = plan.query_scale[:, :, None, None].to(q.dtype)  # as Hugging Face casts it
        q_nope, q_rot = q_nope * factor, q_rot * factor
    up = heads["kv_b_proj.weight"].view(hq, nope + shapes.v_head_dim, c)
    q_latent = torch.cat([torch.einsum("blhn,hnc->blhc", q_nope, up[:, :nope]), q_rot], dim=-1)
    q_all = comm.all_gather_small(q_latent[:, 0], group).transpose(0, 1).flatten(1, 2)  # (B, nq, width)
    o_latent, lse = attend(q_all, chosen)
    if "sinks" in heads:  # each head's sink joins its softmax once, over every rank's cache (DESIGN.md 6h)
        o_latent = o_latent * torch.sigmoid(lse - heads["sinks"].to(lse.dtype)).unsqueeze(-1).to(o_latent.dtype)
    o = torch.einsum("bhc,hvc->bhv", o_latent.to(h.dtype), up[:, nope:])
    if "gate_proj.weight" in heads:  # this rank's heads' output gates (HY-V4's)
        o = o * torch.sigmoid(F.linear(h[:, 0], heads["gate_proj.weight"]).view(o.shape))
    y = sum_over_group(F.linear(o.flatten(1), heads["o_proj.weight"]))
    return (y if attn.o_bias is None else y + attn.o_bias).unsqueeze(1), chosen


def _pieces(attn):
    """This rank's packed shard as flat views of its pieces: down piece, head group (and indexer piece)."""
    packed = attn.shard_weights().detach()
    return packed.split([spec.numel for spec in attn.specs[attn.tsp_rank]])


def _whole_down_projections(attn, h, down, group):
    """Every rank's rows of the down projections of the new token, joined:
    ``{name: (B, 1, rows)}`` as ``schedule.down_project`` gives them."""
    names = attn.shapes.down_projections()
    mine = [F.linear(h[:, 0], down[f"{name}.weight"], down.get(f"{name}.bias")) for name in names]
    return _joined_rows(attn, names, mine, group)


def _whole_index_projections(attn, h, c_q, piece, group):
    """Every rank's rows of the indexer's ``wq_b`` and ``wk`` outputs for the new token, joined: ``(B, 1,
    Hi * Di)`` and ``(B, 1, Di)`` as ``indexer.index_projections`` gives them."""
    mine = [F.linear(c_q[:, 0], piece["indexer.wq_b.weight"]), F.linear(h[:, 0], piece["indexer.wk.weight"])]
    joined = _joined_rows(attn, [f"{name}.weight" for name in INDEXER_PROJECTIONS], mine, group)
    return tuple(joined.values())


def _joined_rows(attn, names, mine, group):
    """``{name: (B, 1, rows)}``: every rank's rows of the projections ``names`` (their outputs on this rank,
    ``mine``, ``(B, rows of this rank)`` each), gathered in one message padded to the widest rank's and joined
    in rank order."""
    shapes, D = attn.shapes, attn.shapes.tsp_size
    rows = [[shapes.rows(name, j) for name in names] for j in range(D)]
    widest = max(sum(r.stop - r.start for r in ranks) for ranks in rows)
    mine = torch.cat(mine, dim=-1)
    gathered = comm.all_gather_small(F.pad(mine, (0, widest - mine.shape[-1])), group)  # (D, B, widest)
    parts = {name: [] for name in names}
    for j in range(D):
        start = 0
        for name, r in zip(names, rows[j]):
            parts[name].append(gathered[j, :, start:start + r.stop - r.start])
            start += r.stop - r.start
    return {name: torch.cat(pieces, dim=-1).unsqueeze(1) for name, pieces in parts.items()}
