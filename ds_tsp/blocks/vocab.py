"""The vocabulary folded over the TSP group (DESIGN.md 6): the embedding and the
LM head sharded by vocabulary rows, the loss fused with the head on a ring, and
no ``(tokens, V)`` logits tensor when there are labels.

Rank ``j`` owns rows ``[j Vs, (j+1) Vs)`` of the embedding and of the LM head,
``Vs = ceil(V / D)``. ``V`` is padded up to ``D * Vs`` with zero rows that are
never looked up (ids must lie in ``[0, V)``) and never a target (they are left
out of every log-sum-exp). A tied model's one shard serves both uses and its
gradient is the sum of both.

Embedding, on rank ``r`` with local tokens ``x_r`` (``N = B*S/D`` ids). Every
rank holds the full micro-batch, so it knows every rank's local ids and which
of them fall in its own rows. One all-to-all with sizes known on both sides
(no request round) moves exactly those rows; backward sends the row
gradients the other way and the owner adds them into its shard. With
``c[k][j]`` the number of rank ``k``'s local tokens whose id rank ``j`` owns,
bytes received by rank ``r``::

    forward   sum_{j != r} c[r][j] * H * e      # ~ (D-1)/D * N * H * e for spread ids
    backward  sum_{k != r} c[k][r] * H * e

(the counts come from the host copy of the batch the model reads once per
micro-batch, which also checks the ids). The alternative, a masked lookup of all ``B*S`` tokens on
every rank and a reduce-scatter of the ``(B, S, H)`` partial sums, receives
``(D-1)/D * B*S * H * e``: ``D`` times more, so it is not offered.

LM head and cross-entropy, with labels, on the ring of ``ds_tsp.parallel.ring``::

    lse = -inf; z_target = 0                # per local token, fp32
    for t in 0..D-1:                        # buf holds head shard s = (r - t) mod D
        for each tile T of the local tokens:
            z = h[T] @ W_buf^T              # (|T|, Vs), never more than a tile
            lse[T] = logaddexp(lse[T], logsumexp(z))
            z_target[T] += z[label in rows of s]
    loss_r = sum over real targets of (lse - z_target)

Backward runs the ring again, recomputing each tile's ``z`` and
``dz = (softmax(z) - onehot) * dloss`` from the saved ``lse``:
``dh[T] += dz @ W_buf`` and ``dW_buf += dz^T @ h[T]`` in an accumulator that
travels with the shard and ends on its owner. Bytes received per rank: forward
``(D-1) * Vs*H * e``, backward ``(D-1) * Vs*H * (e + a)`` (``a``: the
accumulator's element on the wire, ``precision.gradient_wire_dtype``: fp32 (float64
for float64 models) unless DeepSpeed's ``communication_data_type`` names a
narrower one). Products run in the model dtype, sums in fp32 or wider.
A tile is at most ``tsp.logits_tile_mib`` MiB of fp32 logits.

Without labels the local tokens' full-vocabulary logits are returned, with the
head's rows all-gathered (backward: reduce-scatter). Generation needs the full
logits of one replicated position only, so each rank computes its ``(B, Vs)``
slice and the slices are all-gathered.
"""

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ds_tsp.parallel import comm, precision
from ds_tsp.parallel.amp import autocast_backward, autocast_forward
from ds_tsp.parallel.eager import EagerFunction, untraced
from ds_tsp.parallel.host_reads import host_read
from ds_tsp.parallel.mappings import gather_rows
from ds_tsp.parallel.precision import accumulation_dtype
from ds_tsp.parallel.ring import ring_gradients, ring_steps

IGNORE_INDEX = -100


class VocabError(ValueError):
    """A model whose embedding or LM head cannot be folded; the message names the fix."""


def shard_rows(vocab_size, tsp_size):
    """Rows ``Vs`` of every rank's shard: ``ceil(V / D)``."""
    return -(-vocab_size // tsp_size)


def shard_piece(vocab_size, tsp_size, tsp_rank):
    """``(dim, start, length)`` of the full ``(V, H)`` tensor that ``tsp_rank``
    holds; the last ranks' pieces are shorter (or empty) where ``V`` is padded."""
    rows = shard_rows(vocab_size, tsp_size)
    start = min(tsp_rank * rows, vocab_size)
    return 0, start, min(start + rows, vocab_size) - start


def embedding_scale(embed):
    """The constant a scaled word embedding multiplies its lookup by (a 0-d
    tensor: Gemma's ``embed_scale``), or None for a plain ``nn.Embedding``.

    Transformers' ``*ScaledWordEmbedding`` classes return ``lookup *
    embed_scale.to(weight.dtype)``; where the module holds real tensors, a
    probe checks that its forward is exactly that. Anything else is refused."""
    if type(embed) is nn.Embedding:
        return None
    scale = getattr(embed, "embed_scale", None)
    scaled_class = (isinstance(embed, nn.Embedding) and type(embed).__name__.endswith("ScaledWordEmbedding")
                    and type(embed).__module__.startswith("transformers."))
    if not scaled_class or not torch.is_tensor(scale) or scale.dim() != 0:
        raise VocabError("nor a transformers *ScaledWordEmbedding with a constant embed_scale: it may transform "
                         "its output")
    if not embed.weight.is_meta and not scale.is_meta:
        ids = torch.arange(min(embed.num_embeddings, 8), device=embed.weight.device)
        with torch.no_grad():
            if not torch.equal(embed(ids), F.embedding(ids, embed.weight) * scale.to(embed.weight.dtype)):
                raise VocabError("its forward is not its lookup times embed_scale")
    return scale


FOLD_FIX = "set tsp.vocab_parallel to false to keep them replicated"


def check_foldable_table(embed, where="model", kind="input embedding"):
    """Refuse, before any weight moves, an embedding the folded vocabulary would not reproduce exactly."""
    try:
        embedding_scale(embed)
    except VocabError as refusal:
        raise VocabError(f"{where}'s {kind} is a {type(embed).__name__}, not a plain nn.Embedding "
                         f"({refusal}): ds_tsp cannot fold it; {FOLD_FIX}") from None
    if embed.max_norm is not None or embed.scale_grad_by_freq or embed.sparse:
        raise VocabError(f"{where}'s {kind} uses max_norm, scale_grad_by_freq or sparse gradients, "
                         f"which the vocabulary-parallel embedding does not reproduce; {FOLD_FIX}")


def check_foldable(embed, lm_head, where="model"):
    """Refuse, before any weight moves, an embedding or head that the folded
    vocabulary would not reproduce exactly."""
    check_foldable_table(embed, where)
    if type(lm_head) is not nn.Linear or lm_head.bias is not None:
        raise VocabError(f"{where}'s LM head is a {type(lm_head).__name__}"
                         f"{' with a bias' if getattr(lm_head, 'bias', None) is not None else ''}: ds_tsp folds a "
                         f"bias-free nn.Linear only; {FOLD_FIX}")
    if lm_head.out_features != embed.num_embeddings or lm_head.in_features != embed.embedding_dim:
        raise VocabError(f"{where}'s LM head maps {lm_head.in_features} -> {lm_head.out_features} but the embedding "
                         f"is {embed.num_embeddings} x {embed.embedding_dim}: ds_tsp folds them only when both "
                         f"span the same vocabulary; {FOLD_FIX}")


# ----------------------------------------------------------------- embedding

class EmbeddingRoute:
    """Which embedding rows move where for one micro-batch.

    ``rank_ids``: every rank's local ids (D tensors of one shape), the same
    list on every rank. ``send_counts[k]`` rows of this rank's shard go to rank
    ``k``, taken at ``shard_rows`` (local row indices, grouped by destination);
    ``recv_counts[j]`` rows come from rank ``j`` and land, in order, on the
    local tokens ``order[...]`` whose ids rank ``j`` owns.

    The route is worked out on the host from a host copy of the ids (the
    model's ``TSPBatch`` hands one over, so the training forward reads nothing
    back from the device here) and its two index tensors go to ``device``.
    """

    @untraced
    def __init__(self, rank_ids, vocab_size, rows, tsp_rank, device):
        ids = host_read(torch.stack([t.reshape(-1) for t in rank_ids]), "embedding route")  # (D, N); host ids: as is
        tsp_size = ids.shape[0]
        bad = int(((ids < 0) | (ids >= vocab_size)).sum())
        if bad:
            raise ValueError(f"input_ids hold {bad} id(s) outside [0, vocab_size = {vocab_size}): check the "
                             "tokenizer and the model's vocabulary (resize_token_embeddings before ds_tsp.inject)")
        owners = ids.div(rows, rounding_mode="floor")
        pairs = (torch.arange(tsp_size).unsqueeze(1) * tsp_size + owners).reshape(-1)
        counts = torch.bincount(pairs, minlength=tsp_size * tsp_size).view(tsp_size, tsp_size).tolist()
        self.send_counts = [counts[k][tsp_rank] for k in range(tsp_size)]  # counts[k][j]
        self.recv_counts = counts[tsp_rank]
        # Row-major: grouped by destination.
        self.shard_rows = (ids[owners == tsp_rank] - tsp_rank * rows).to(device, non_blocking=True)
        self.order = torch.argsort(owners[tsp_rank], stable=True).to(device, non_blocking=True)
        self.num_tokens = ids.shape[1]


def embedding_forward(weight, route, tsp_group):
    """``(N, H)`` embeddings of this rank's local tokens."""
    received = comm.all_to_all_rows(weight[route.shard_rows], route.send_counts, route.recv_counts, tsp_group)
    out = weight.new_empty(route.num_tokens, weight.shape[1])
    out[route.order] = received
    return out


def embedding_backward(grad_out, weight, route, tsp_group, padding_idx=None):
    """Gradient of this rank's shard: every rank's row gradients, sent back to
    their owner and added there (in fp32 or wider)."""
    returned = comm.all_to_all_rows(grad_out[route.order], route.recv_counts, route.send_counts, tsp_group)
    rows = route.shard_rows
    grad = torch.zeros(weight.shape, dtype=accumulation_dtype(weight.dtype), device=weight.device)
    if padding_idx is not None:  # as nn.Embedding: the padding row gets no gradient
        returned = returned.masked_fill((rows == padding_idx).unsqueeze(1), 0)
    grad.index_add_(0, rows, returned.to(grad.dtype))
    return grad.to(weight.dtype)


class _EmbeddingExchange(EagerFunction):
    # A lookup: autocast leaves nn.Embedding in the weight's dtype, and so does this.
    @staticmethod
    @autocast_forward(cast_inputs=False)
    def forward(ctx, weight, route, tsp_group, local_padding_idx):
        ctx.route, ctx.tsp_group, ctx.padding_idx = route, tsp_group, local_padding_idx
        ctx.save_for_backward(weight)
        return embedding_forward(weight, route, tsp_group)

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_out):
        (weight,) = ctx.saved_tensors
        return embedding_backward(grad_out, weight, ctx.route, ctx.tsp_group, ctx.padding_idx), None, None, None


class _VocabShard(nn.Module):
    """A ``(Vs, H)`` shard of a ``(V, H)`` vocabulary matrix, under the Hugging
    Face name ``weight`` (see ``shard_piece``)."""

    def __init__(self, vocab_size, hidden_size, tsp_group, dtype=None, device=None, weight=None):
        super().__init__()
        self.vocab_size, self.hidden_size, self.tsp_group = vocab_size, hidden_size, tsp_group
        self.tsp_size, self.tsp_rank = comm.group_size(tsp_group), comm.group_rank(tsp_group)
        self.rows = shard_rows(vocab_size, self.tsp_size)
        if weight is None:
            weight = nn.Parameter(torch.zeros(self.rows, hidden_size, dtype=dtype, device=device))
            # DeepSpeed counts a parameter on every model-parallel rank in grad norms only with this tag.
            weight.tensor_model_parallel = True
        self.weight = weight

    def shard_names(self):
        return ["weight"]

    def shard_piece(self, name):
        """``(dim, start, length)`` of the full tensor ``name`` this rank holds."""
        return shard_piece(self.vocab_size, self.tsp_size, self.tsp_rank)

    def load_shard(self, tensors):
        """Copy this rank's rows in; the padding rows stay zero."""
        _, _, length = self.shard_piece("weight")
        with torch.no_grad():
            self.weight[:length].copy_(tensors["weight"])
            self.weight[length:].zero_()

    def shard_tensors(self):
        """This rank's rows under the HF name (padding rows left out)."""
        _, _, length = self.shard_piece("weight")
        return {"weight": self.weight.detach()[:length]}

    def extra_repr(self):
        return f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, rows={self.rows}, " \
               f"tsp_size={self.tsp_size}"


class VocabParallelEmbedding(_VocabShard):
    """``nn.Embedding`` with its rows sharded over ``tsp_group`` (see the module docstring)."""

    def __init__(self, vocab_size, hidden_size, tsp_group, padding_idx=None, embed_scale=None, dtype=None,
                 device=None):
        super().__init__(vocab_size, hidden_size, tsp_group, dtype=dtype, device=device)
        self.padding_idx = padding_idx
        # A scaled word embedding's constant (Gemma's), applied in the weight's dtype as Hugging Face applies it;
        # not persistent, as Hugging Face's is not.
        self.register_buffer("embed_scale", None if embed_scale is None else embed_scale.detach().clone(),
                             persistent=False)

    @classmethod
    def from_hf(cls, embed, tsp_group, read=None, device=None):
        """Build from an ``nn.Embedding`` or a scaled word embedding (the weight
        maybe on the meta device when ``read`` supplies this rank's rows from a
        checkpoint)."""
        scale = embedding_scale(embed)
        module = cls(embed.num_embeddings, embed.embedding_dim, tsp_group, padding_idx=embed.padding_idx,
                     embed_scale=None if scale is None else scale.to(device or embed.weight.device),
                     dtype=embed.weight.dtype, device=device or embed.weight.device)
        piece = module.shard_piece("weight")
        module.load_shard({"weight": read("weight", piece) if read else embed.weight.detach().narrow(*piece)})
        return module

    def forward(self, rank_ids):
        """``rank_ids``: every rank's local ids (D tensors of one shape ``(B, n)``,
        the same list on every rank; host tensors spare a device read). Returns
        this rank's embeddings ``(B, n, H)``."""
        route = EmbeddingRoute(rank_ids, self.vocab_size, self.rows, self.tsp_rank, self.weight.device)
        padding = None
        if self.padding_idx is not None and self.padding_idx // self.rows == self.tsp_rank:
            padding = self.padding_idx - self.tsp_rank * self.rows
        out = _EmbeddingExchange.apply(self.weight, route, self.tsp_group, padding)
        return self._scaled(out.view(*rank_ids[self.tsp_rank].shape, self.hidden_size))

    def _scaled(self, looked_up):
        return looked_up if self.embed_scale is None else looked_up * self.embed_scale.to(self.weight.dtype)

    def replicated_lookup(self, ids):
        """Embeddings ``(..., H)`` of ``ids`` that are the same on every rank
        (generation): each rank looks up the ids it owns, zeros for the others,
        and the parts are all-gathered and added. One part per id is not zero,
        so the sum is exact, the same on every rank."""
        bad = int(host_read(((ids < 0) | (ids >= self.vocab_size)).sum(), "token ids"))
        if bad:
            raise ValueError(f"input_ids hold {bad} id(s) outside [0, vocab_size = {self.vocab_size})")
        local = ids - self.tsp_rank * self.rows
        owned = (local >= 0) & (local < self.rows)
        part = torch.where(owned.unsqueeze(-1), self.weight[local.clamp(0, self.rows - 1)], 0)
        return self._scaled(comm.all_gather_small(part, self.tsp_group).sum(dim=0))


# ---------------------------------------------------------- LM head and loss

def tile_tokens(logits_tile_mib, rows):
    """Tokens per tile so that a tile's fp32 logits ``(tokens, Vs)`` fit in ``logits_tile_mib`` MiB."""
    return max(1, int(logits_tile_mib * 2**20) // (4 * rows))


def _shard_columns(tsp_rank, t, tsp_size, rows, vocab_size):
    """``(first vocabulary id, real rows)`` of the shard held at ring step ``t``."""
    first = ((tsp_rank - t) % tsp_size) * rows
    return first, max(0, min(rows, vocab_size - first))


def _targets_in(labels, first, count):
    """``(column of each label in the shard, whether it is in the shard)``."""
    column = labels - first
    hit = (column >= 0) & (column < count)
    return column.clamp(0, max(count - 1, 0)), hit


def soft_cap(logits, cap):
    """``cap * tanh(logits / cap)``, Gemma-2/3's soft-capping of attention scores
    and of the final logits, in Hugging Face's order of operations; None: ``logits``."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


@functools.lru_cache(maxsize=None)
def multiplies_logits_scaling(config_class):
    """Whether the causal LM of ``config_class`` multiplies its logits by
    ``config.logits_scaling`` (HyperCLOVA X's forward) rather than dividing
    (Granite's), read off that forward."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        source = inspect.getsource(MODEL_FOR_CAUSAL_LM_MAPPING[config_class].forward)
    except (KeyError, OSError, TypeError):
        return False
    return "* self.config.logits_scaling" in source


@dataclass(frozen=True)
class LogitMap:
    """The final logits as the model's forward makes them from the LM head's
    output ``z``: ``z * multiplier / divisor`` (Cohere's ``logit_scale`` and
    Falcon-H1's ``lm_head_multiplier``, multipliers; Granite's
    ``logits_scaling``, a divisor), then soft-capped at
    ``cap`` (Gemma-2's ``final_logit_softcapping``), in Hugging Face's order of
    operations. The fused head + loss ring applies it to each tile of logits
    and its slope in backward, so no full-vocabulary tensor is made for it."""

    multiplier: float = 1.0
    divisor: float = 1.0
    cap: float | None = None

    @classmethod
    def of(cls, config):
        """The map of ``config``'s causal LM, or None where its logits are the head's output.
        ``logits_scaling`` divides (Granite's) unless the causal LM's forward
        multiplies by it (HyperCLOVA X's)."""
        scaling = getattr(config, "logits_scaling", None) or 1.0
        multiplies = scaling != 1.0 and multiplies_logits_scaling(type(config))
        multiplier = ((getattr(config, "logit_scale", None) or 1.0)
                      * (getattr(config, "lm_head_multiplier", None) or 1.0))
        logit_map = cls(multiplier * (scaling if multiplies else 1.0),
                        1.0 if multiplies else scaling, getattr(config, "final_logit_softcapping", None))
        return None if logit_map == cls() else logit_map

    def __call__(self, z):
        if self.multiplier != 1.0:
            z = z * self.multiplier
        if self.divisor != 1.0:
            z = z / self.divisor
        return soft_cap(z, self.cap)

    def __str__(self):
        steps = ([f"times {self.multiplier} (config.logit_scale, lm_head_multiplier or logits_scaling)"]
                 if self.multiplier != 1.0 else []) + \
            ([f"divided by {self.divisor} (config.logits_scaling)"] if self.divisor != 1.0 else []) + \
            ([f"soft-cap at {self.cap} (config.final_logit_softcapping)"] if self.cap is not None else [])
        return " -> ".join(steps)

    def slope(self, mapped):
        """The derivative of the map at each of its outputs ``mapped``: a tensor under a cap, else a number."""
        linear = self.multiplier / self.divisor
        return linear if self.cap is None else (1 - (mapped / self.cap) ** 2) * linear


def map_logits(logits, logit_map):
    """``logit_map(logits)``, or ``logits`` without a map (None)."""
    return logits if logit_map is None else logit_map(logits)


def _mapped_logits(hidden, w, acc, logit_map):
    """A tile's logits against shard rows ``w``, mapped (``LogitMap``), in
    ``acc``, and the map's derivative (None without one) for the backward."""
    z = F.linear(hidden, w).to(acc)
    if logit_map is None:
        return z, None
    mapped = logit_map(z)
    return mapped, logit_map.slope(mapped)


# What the forward ring can also find per token, over the same tiles (``cross_entropy_ring_forward``).
RING_STATISTICS = ("argmax", "expected_logit", "logit_sum", "square_lse")


def cross_entropy_ring_forward(hidden, weight, labels, vocab_size, tile, tsp_group, overlap=True, logit_map=None,
                               temperature=1.0, statistics=()):
    """``(losses, lse, {statistic: (N,)})``: the per-token cross-entropy
    ``(N,)`` (0 where the label is ignored) and the log-sum-exp ``(N,)`` of
    every token's full-vocabulary logits, both in fp32 or wider, and the
    ``statistics`` asked for. ``hidden`` ``(N, H)``, ``weight`` this rank's
    ``(Vs, H)`` head rows; ``logit_map``: the final logits' ``LogitMap``
    (scale and soft-cap) or None; ``temperature``: the logits divided
    by it after the map (RL trainers'). The statistics, found shard by shard
    on the same ring (``RING_STATISTICS``): ``argmax``, each token's predicted
    id, the first of the largest logits as ``logits.argmax(-1)`` picks;
    ``expected_logit``, ``sum_v p_v z_v`` (the entropy is ``lse`` less it), a
    running sum rescaled as the log-sum-exp grows; ``logit_sum``, ``sum_v
    z_v``; ``square_lse``, the log-sum-exp of ``2 z`` (``log sum_v p_v^2`` is
    it less ``2 lse``)."""
    unknown = set(statistics) - set(RING_STATISTICS)
    if unknown:
        raise ValueError(f"ring statistics {sorted(unknown)}: known are {RING_STATISTICS}")
    acc = accumulation_dtype(weight.dtype)
    tsp_size, tsp_rank = comm.group_size(tsp_group), comm.group_rank(tsp_group)
    num_tokens, rows = hidden.shape[0], weight.shape[0]

    def filled(value, dtype=acc):
        return torch.full((num_tokens,), value, dtype=dtype, device=hidden.device)

    lse, target_logit = filled(float("-inf")), filled(0.0)
    found = {"argmax": filled(0, torch.long), "best": filled(float("-inf")), "expected_logit": filled(0.0),
             "logit_sum": filled(0.0), "square_lse": filled(float("-inf"))}

    def step(t, buf):
        first, count = _shard_columns(tsp_rank, t, tsp_size, rows, vocab_size)
        if count == 0:
            return
        w = buf[:count]
        for start in range(0, num_tokens, tile):
            span = slice(start, start + tile)
            z, _ = _mapped_logits(hidden[span], w, acc, logit_map)  # (tile, count)
            if temperature != 1.0:
                z = z / temperature
            grown = torch.logaddexp(lse[span], z.logsumexp(dim=-1))
            if "expected_logit" in statistics:  # sum_v exp(z_v - lse) z_v, earlier shards rescaled to the grown lse
                found["expected_logit"][span] = found["expected_logit"][span] * torch.exp(lse[span] - grown) + \
                    (torch.exp(z - grown.unsqueeze(1)) * z).sum(dim=-1)
            lse[span] = grown
            column, hit = _targets_in(labels[span], first, count)
            target_logit[span] += torch.where(hit, z.gather(1, column.unsqueeze(1)).squeeze(1), 0)
            if "argmax" in statistics:  # shards arrive out of vocabulary order: a tie goes to the lower id
                value, index = z.max(dim=-1)
                index = index + first
                best, best_id = found["best"][span], found["argmax"][span]
                better = (value > best) | ((value == best) & (index < best_id))
                found["best"][span] = torch.where(better, value, best)
                found["argmax"][span] = torch.where(better, index, best_id)
            if "logit_sum" in statistics:
                found["logit_sum"][span] += z.sum(dim=-1)
            if "square_lse" in statistics:
                found["square_lse"][span] = torch.logaddexp(found["square_lse"][span], (2 * z).logsumexp(dim=-1))

    ring_steps(weight, tsp_group, step, overlap)
    losses = torch.where(labels != IGNORE_INDEX, lse - target_logit, 0)
    return losses, lse, {name: found[name] for name in statistics}


def cross_entropy_ring_backward(grad_losses, hidden, weight, labels, lse, vocab_size, tile, tsp_group, overlap=True,
                                grad_wire_dtype=None, weight_grad=True, logit_map=None, temperature=1.0,
                                grad_entropy=None, expected=None):
    """``(grad_hidden (N, H), grad_weight (Vs, H))``, the latter summed over every
    rank's tokens, from the saved log-sum-exp (logits recomputed per tile); its
    accumulators travel in ``precision.gradient_wire_dtype(grad_wire_dtype, ...)``.
    Without ``weight_grad`` (a frozen head: LoRA) the shards go round the ring
    once more for ``grad_hidden`` alone, with no accumulators, and ``grad_weight``
    is None. ``grad_entropy`` (with the forward's ``expected`` logits): the
    entropies' gradient too, ``dH/dz_v = -p_v (z_v - sum_u p_u z_u)``."""
    acc = accumulation_dtype(weight.dtype)
    tsp_size, tsp_rank = comm.group_size(tsp_group), comm.group_rank(tsp_group)
    num_tokens, rows = hidden.shape[0], weight.shape[0]
    real = labels != IGNORE_INDEX
    scale = torch.where(real, grad_losses.to(acc), 0)
    entropy_scale = None if grad_entropy is None else torch.where(real, grad_entropy.to(acc), 0)
    grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)

    def step(t, buf):
        grad_w = torch.zeros(buf.shape, dtype=acc, device=buf.device) if weight_grad else None
        first, count = _shard_columns(tsp_rank, t, tsp_size, rows, vocab_size)
        if count == 0:
            return grad_w
        w = buf[:count]
        for start in range(0, num_tokens, tile):
            span = slice(start, start + tile)
            # In place on the tile's logits, which nothing else reads: one (tile, count) buffer in fp32.
            dz, slope = _mapped_logits(hidden[span], w, acc, logit_map)  # (tile, count)
            if temperature != 1.0:
                dz.div_(temperature)
            column, hit = _targets_in(labels[span], first, count)
            if entropy_scale is None:
                dz.sub_(lse[span].unsqueeze(1)).exp_()  # softmax over the full vocabulary
                dz.scatter_add_(1, column.unsqueeze(1), -hit.to(acc).unsqueeze(1))
                dz.mul_(scale[span].unsqueeze(1))
            else:  # p (dloss - dH (z - sum p z)) - onehot dloss: a second (tile, count) buffer for p
                p = (dz - lse[span].unsqueeze(1)).exp_()
                dz.sub_(expected[span].unsqueeze(1)).mul_(-entropy_scale[span].unsqueeze(1))
                dz.add_(scale[span].unsqueeze(1)).mul_(p)
                del p
                dz.scatter_add_(1, column.unsqueeze(1), -(hit.to(acc) * scale[span]).unsqueeze(1))
            if temperature != 1.0:
                dz.div_(temperature)
            if slope is not None:
                dz.mul_(slope)
                del slope
            dz = dz.to(w.dtype)
            grad_hidden[span] += dz @ w
            if weight_grad:
                precision.partial_matmul(dz.t(), hidden[span], out=grad_w[:count])
            del dz  # the next tile's logits are made after this one's are gone
        return grad_w

    if not weight_grad:
        ring_steps(weight, tsp_group, step, overlap)
        return grad_hidden.to(hidden.dtype), None
    wire = precision.gradient_wire_dtype(grad_wire_dtype, weight.dtype)
    grad_weight = ring_gradients(weight, tsp_group, step, overlap, wire)
    return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype)


class _CrossEntropyRing(EagerFunction):
    # Under autocast the head's matmuls run in the autocast dtype, as HF's
    # lm_head does; the logits are upcast per tile, so the softmax and the
    # losses stay in float32 as in HF's loss.
    @staticmethod
    @autocast_forward(cast_inputs=True)
    def forward(ctx, hidden, weight, labels, vocab_size, tile, tsp_group, overlap, grad_wire_dtype, logit_map):
        losses, lse, _ = cross_entropy_ring_forward(hidden, weight, labels, vocab_size, tile, tsp_group, overlap,
                                                    logit_map)
        # Local tokens only (hidden, labels, lse) plus this rank's own shard.
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.vocab_size, ctx.tile, ctx.tsp_group, ctx.overlap = vocab_size, tile, tsp_group, overlap
        ctx.grad_wire_dtype, ctx.logit_map = grad_wire_dtype, logit_map
        return losses

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_losses):
        hidden, weight, labels, lse = ctx.saved_tensors
        grad_hidden, grad_weight = cross_entropy_ring_backward(grad_losses, hidden, weight, labels, lse,
                                                               ctx.vocab_size, ctx.tile, ctx.tsp_group, ctx.overlap,
                                                               ctx.grad_wire_dtype, ctx.needs_input_grad[1],
                                                               ctx.logit_map)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


class _TokenScoresRing(EagerFunction):
    """Per-token log-probabilities of the labels and entropies (DESIGN.md 6l)
    from the same ring and tiles as the loss: ``logp = z_label - lse`` and
    ``H = lse - sum_v p_v z_v`` of the logits divided by ``temperature``, in
    float32 or wider, 0 where the label is ignored. Backward as the loss's,
    with the entropy's term where it has a gradient."""

    @staticmethod
    @autocast_forward(cast_inputs=True)
    def forward(ctx, hidden, weight, labels, vocab_size, tile, tsp_group, overlap, grad_wire_dtype, logit_map,
                temperature, statistics):
        losses, lse, found = cross_entropy_ring_forward(hidden, weight, labels, vocab_size, tile, tsp_group,
                                                        overlap, logit_map, temperature,
                                                        ("expected_logit", *statistics))
        expected = found["expected_logit"]
        real = labels != IGNORE_INDEX
        ctx.save_for_backward(hidden, weight, labels, lse, expected)
        ctx.vocab_size, ctx.tile, ctx.tsp_group, ctx.overlap = vocab_size, tile, tsp_group, overlap
        ctx.grad_wire_dtype, ctx.logit_map, ctx.temperature = grad_wire_dtype, logit_map, temperature
        extras = [found[name] if name != "square_lse" else found[name] - 2 * lse for name in statistics]
        ctx.mark_non_differentiable(*extras)
        return (-losses, torch.where(real, lse - expected, 0), *extras)

    @staticmethod
    @autocast_backward
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        hidden, weight, labels, lse, expected = ctx.saved_tensors
        grad_losses = torch.zeros_like(lse) if grad_logprobs is None else -grad_logprobs
        grad_hidden, grad_weight = cross_entropy_ring_backward(
            grad_losses, hidden, weight, labels, lse, ctx.vocab_size, ctx.tile, ctx.tsp_group, ctx.overlap,
            ctx.grad_wire_dtype, ctx.needs_input_grad[1], ctx.logit_map, ctx.temperature, grad_entropy, expected)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None


class VocabParallelLMHead(_VocabShard):
    """A bias-free LM head with its rows sharded over ``tsp_group``; ``tied_to``
    a ``VocabParallelEmbedding`` shares that module's shard (tied embeddings)."""

    def __init__(self, vocab_size, hidden_size, tsp_group, logits_tile_mib=32.0, overlap=True, dtype=None,
                 device=None, tied_to=None):
        super().__init__(vocab_size, hidden_size, tsp_group, dtype=dtype, device=device,
                         weight=None if tied_to is None else tied_to.weight)
        self.tied = tied_to is not None
        self.tile = tile_tokens(logits_tile_mib, self.rows)
        self.overlap = overlap
        # The ring's gradient accumulators' wire dtype; None: float32 (or wider). ds_tsp.initialize
        # sets DeepSpeed's communication_data_type here when the config names it.
        self.grad_wire_dtype = None

    @classmethod
    def from_hf(cls, lm_head, tsp_group, logits_tile_mib=32.0, overlap=True, tied_to=None, read=None, device=None):
        module = cls(lm_head.out_features, lm_head.in_features, tsp_group, logits_tile_mib, overlap,
                     dtype=lm_head.weight.dtype, device=device or lm_head.weight.device, tied_to=tied_to)
        if not module.tied:
            piece = module.shard_piece("weight")
            module.load_shard({"weight": read("weight", piece) if read else lm_head.weight.detach().narrow(*piece)})
        return module

    def forward(self, hidden):
        """Full-vocabulary logits ``(..., V)`` of this rank's tokens (the head's
        rows all-gathered; backward reduce-scatters their gradient)."""
        weight = gather_rows(self.weight, self.tsp_group)[:self.vocab_size]
        return F.linear(hidden, weight)

    def loss_sum(self, hidden, labels, logit_map=None):
        """Sum over this rank's tokens of the cross-entropy against ``labels``
        (``IGNORE_INDEX`` skipped) of the logits mapped by ``logit_map`` (``LogitMap``: scaled, soft-capped),
        fused with the head; no full logits."""
        losses = _CrossEntropyRing.apply(hidden.reshape(-1, hidden.shape[-1]), self.weight, labels.reshape(-1),
                                         self.vocab_size, self.tile, self.tsp_group, self.overlap,
                                         self.grad_wire_dtype, logit_map)
        return losses.sum()

    def token_scores(self, hidden, labels, logit_map=None, temperature=1.0, statistics=()):
        """``(log-probabilities of the labels, entropies, {statistic: values})``,
        each ``labels``' shape, float32 or wider, of this rank's tokens' logits
        mapped by ``logit_map`` (``LogitMap``: scaled, soft-capped) and divided by ``temperature``; 0 where the
        label is ``IGNORE_INDEX``. ``statistics`` (no gradient): of
        ``RING_STATISTICS``, ``square_lse`` given as ``log sum_v p_v^2``. Fused
        with the head on its ring: no full logits."""
        logprobs, entropy, *extras = _TokenScoresRing.apply(
            hidden.reshape(-1, hidden.shape[-1]), self.weight, labels.reshape(-1), self.vocab_size, self.tile,
            self.tsp_group, self.overlap, self.grad_wire_dtype, logit_map, float(temperature), tuple(statistics))
        return (logprobs.view(labels.shape), entropy.view(labels.shape),
                {name: value.view(labels.shape) for name, value in zip(statistics, extras)})

    @torch.no_grad()
    def loss_sum_and_argmax(self, hidden, labels, logit_map=None):
        """Evaluation: ``loss_sum`` (no gradient) and the predicted ids ``(...)``
        of this rank's tokens, the argmax of their full-vocabulary logits found
        on the same ring, without them. ``labels`` None: no loss (None)."""
        flat_labels = (torch.full(hidden.shape[:-1], IGNORE_INDEX, device=hidden.device) if labels is None
                       else labels).reshape(-1)
        losses, _, found = cross_entropy_ring_forward(hidden.reshape(-1, hidden.shape[-1]), self.weight,
                                                      flat_labels, self.vocab_size, self.tile, self.tsp_group,
                                                      self.overlap, logit_map, statistics=("argmax",))
        predicted = found["argmax"]
        return (None if labels is None else losses.sum()), predicted.view(hidden.shape[:-1])

    @torch.no_grad()
    def replicated_logits(self, hidden):
        """Full-vocabulary logits ``(..., V)`` of a ``hidden`` that is the same on
        every rank (generation): each rank's ``(..., Vs)`` slice, all-gathered."""
        part = F.linear(hidden, self.weight)
        gathered = comm.all_gather_small(part, self.tsp_group)  # (D, ..., Vs)
        return torch.cat(gathered.unbind(0), dim=-1)[..., :self.vocab_size]


def embed_local_tokens(embed, rank_ids, tsp_rank, local_ids=None, multiplier=1.0):
    """This rank's embeddings from every rank's local ids: the vocabulary-parallel
    embedding needs them all, a replicated one its own only (``local_ids``, on
    the embedding's device, when ``rank_ids`` are host copies); times the
    model's ``embedding_multiplier`` (``multiplier``)."""
    if isinstance(embed, VocabParallelEmbedding):
        return scaled(embed(rank_ids), multiplier)
    return scaled(embed(rank_ids[tsp_rank] if local_ids is None else local_ids), multiplier)


def replicated_embedding(embed, ids, multiplier=1.0):
    """Embeddings of ``ids`` that are the same on every rank (generation), times ``multiplier``."""
    if isinstance(embed, VocabParallelEmbedding):
        return scaled(embed.replicated_lookup(ids), multiplier)
    return scaled(embed(ids), multiplier)


def embedding_multiplier(config):
    """The factor the model's forward multiplies the looked-up embeddings by
    (Granite's ``config.embedding_multiplier``), 1.0 where it has none."""
    return getattr(config, "embedding_multiplier", None) or 1.0


def scaled(hidden, multiplier):
    """``hidden * multiplier`` as Hugging Face's forward writes it, or ``hidden`` for 1."""
    return hidden if multiplier == 1.0 else hidden * multiplier


def full_vocab_logits(lm_head, hidden, logit_map=None):
    """Logits ``(..., V)`` of a ``hidden`` replicated over the TSP group, mapped by ``logit_map`` (``LogitMap``: scaled, soft-capped)."""
    if isinstance(lm_head, VocabParallelLMHead):
        return map_logits(lm_head.replicated_logits(hidden), logit_map)
    return map_logits(lm_head(hidden), logit_map)
