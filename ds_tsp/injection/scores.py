"""Per-token log-probabilities and entropies for preference and RL training
(DESIGN.md 6l): the TSP forward's ``return_token_logprobs`` / ``return_entropy``.

A folded LM head computes them on its loss ring from the same tiles
(``vocab.VocabParallelLMHead.token_scores``): ``logp = z_label - lse`` and
``H = lse - sum_v p_v z_v``, so no full-vocabulary logits exist. A replicated
head computes them from the local tokens' logits. Both are the LOCAL tokens'
``(B, S/D)``, in the layout's order (zigzag), float32 or wider, 0 where the
label is ``-100`` (or padding); ``sequence_sums`` adds them up per sequence
over the TSP group (differentiable), ``natural_order`` gathers them into the
whole sequence's order.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.utils import ModelOutput

from ds_tsp.blocks.vocab import IGNORE_INDEX, VocabParallelLMHead, map_logits
from ds_tsp.parallel.mappings import gather_sequence, gather_tokens, sum_over_group


# The per-token scores a TSP forward returns when asked (``return_token_logprobs``, ``return_entropy``).
SCORES = ("token_logprobs", "entropy")
# TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``): the per-token fields it can return, and the ring
# statistic each of those with no gradient comes from.
FUSED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_FUSED_STATISTICS = {"log_sum_sq_probs": "square_lse", "mean_logits": "logit_sum", "is_top1": "argmax"}


class ScoreRequest(NamedTuple):
    """What a TSP forward is asked to score: ``wanted`` of ``token_logprobs``,
    ``entropy`` (empty: the loss alone), the ring ``statistics``, the
    ``temperature``, and whether the answer is TRL's fused-head output."""

    wanted: tuple
    statistics: tuple
    temperature: float
    fused: bool


def scores_wanted(model, labels, tsp_predictions, temperature, return_token_logprobs, return_entropy,
                  fused_lm_head=False, shift_labels=None):
    """The forward's ``ScoreRequest``, after refusing what cannot be scored: no
    labels, evaluation's ``tsp_predictions``, a temperature that is not above 0,
    TRL's pre-shifted ``shift_labels``. With ``fused_lm_head`` (TRL's
    trainers) the fields and temperature ``add_fused_lm_head`` set."""
    fused = dict(getattr(model, "tsp_fused_head", None) or FUSED_DEFAULT) if fused_lm_head else None
    if fused is not None:
        temperature = fused["temperature"]
        return_token_logprobs, return_entropy = True, "entropy" in fused["outputs"]
    wanted = tuple(name for name, asked in (("token_logprobs", return_token_logprobs), ("entropy", return_entropy))
                   if asked)
    if wanted and (labels is None or tsp_predictions is not None):
        raise ValueError("return_token_logprobs / return_entropy / fused_lm_head score the labels' tokens: pass labels "
                         "(the input ids, -100 where no token is scored), and no tsp_predictions")
    if shift_labels is not None:
        raise ValueError("shift_labels (labels shifted for context parallelism): a TSP model shifts the labels itself "
                         "over the whole sequence: pass labels")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
        raise ValueError(f"temperature = {temperature!r}: the logits are divided by it, so it must be a number "
                         "above 0 (1.0: the model's own logits)")
    statistics = tuple(_FUSED_STATISTICS[name] for name in fused["outputs"] if name in _FUSED_STATISTICS) \
        if fused is not None else ()
    return ScoreRequest(wanted, statistics, float(temperature), fused is not None)


FUSED_DEFAULT = {"temperature": 1.0, "outputs": ("log_probs",)}


def add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",)):
    """TRL's ``add_fused_lm_head`` for a TSP model: ``model(..., labels=labels,
    fused_lm_head=True)`` then returns ``TSPFusedLMOutput``, TRL's fields of
    the whole sequence, from the folded head's ring (no full logits), instead
    of TRL's patch, which would run the backbone on the whole sequence.
    ``cast_lm_head_to_fp32`` true is refused: the ring's sums are float32
    already, its products run in the model's dtype."""
    unknown = [name for name in outputs if name not in FUSED_OUTPUTS]
    if unknown:
        raise ValueError(f"fused LM head outputs {unknown}: a TSP model computes {FUSED_OUTPUTS}")
    if cast_lm_head_to_fp32:
        raise ValueError("cast_lm_head_to_fp32 = True: the TSP head's ring sums in float32 and multiplies in the "
                         "model's dtype; leave it False")
    model.tsp_fused_head = {"temperature": temperature, "outputs": ("log_probs", *outputs)}


@dataclass
class TSPFusedLMOutput(ModelOutput):
    """TRL's ``FusedCausalLMOutput``: per-token fields ``(B, S-1)`` of the whole
    sequence in its order on every rank (``log_probs``, ``entropy``
    differentiable: backward hands each rank its own tokens' gradient), zero
    where the label is -100; the others None unless asked for."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def fused_head_output(model, batch, loss, scores, seq_len, vocab_size, aux_loss=None):
    """``TSPFusedLMOutput`` from the local tokens' ``scores`` (``head_token_scores``)."""
    group, layout_name, padding = model.tsp_topology.tsp_group, model.tsp_config.layout, batch.num_padding

    def natural(values, differentiable=False):  # (B, S-1): the positions that predict a next token
        if values is None:
            return None
        gather = gather_tokens if differentiable else gather_sequence
        values = gather(values, padding, group, layout_name)
        if batch.left_padding is not None:  # the rows ran moved left by their padding: back to their own order
            columns = torch.arange(seq_len, device=values.device).unsqueeze(0)
            values = values.gather(1, (columns - batch.left_padding.to(values.device).unsqueeze(1)) % seq_len)
        return values[:, :seq_len - 1]

    targets = natural(batch.labels)
    mask = targets != IGNORE_INDEX
    found = {name: natural(scores.get(statistic)) for name, statistic in _FUSED_STATISTICS.items()}
    return TSPFusedLMOutput(
        loss=loss, log_probs=natural(scores["token_logprobs"], True), entropy=natural(scores["entropy"], True),
        log_sum_sq_probs=None if found["log_sum_sq_probs"] is None else found["log_sum_sq_probs"].masked_fill(~mask, 0),
        mean_logits=None if found["mean_logits"] is None else (found["mean_logits"] / vocab_size).masked_fill(~mask, 0),
        is_top1=None if found["is_top1"] is None else (found["is_top1"] == targets) & mask,
        label_mask=mask, aux_loss=aux_loss)


def head_token_scores(lm_head, hidden, batch, tsp_group, num_items_in_batch=None, logit_map=None,
                      temperature=1.0, wanted=("token_logprobs", "entropy"), statistics=()):
    """``(loss, {name: values})``: the ``wanted`` log-probabilities
    (``token_logprobs``) and entropies of the normed local hidden states
    ``(B, S/D, H)`` against the batch's labels, the logits mapped by
    ``logit_map`` (``LogitMap``) and divided by ``temperature``, None where not wanted,
    and the ``statistics`` of ``vocab.RING_STATISTICS`` (no gradient). The
    loss is the mean of ``-logp`` over the real targets of the whole sequence
    (Hugging Face's cross-entropy at temperature 1)."""
    labels = batch.labels
    if isinstance(lm_head, VocabParallelLMHead):
        logprobs, entropy, found = lm_head.token_scores(hidden, labels, logit_map, temperature, statistics)
    else:
        logprobs, entropy, found = _replicated_head_scores(lm_head, hidden, labels, logit_map, temperature,
                                                           statistics)
    count = batch.num_real_labels if num_items_in_batch is None else num_items_in_batch
    divisor = count.clamp(min=1) if torch.is_tensor(count) else max(count, 1)
    scores = {"token_logprobs": logprobs if "token_logprobs" in wanted else None,
              "entropy": entropy if "entropy" in wanted else None, **found}
    return sum_over_group(-logprobs.sum(), tsp_group) / divisor, scores


def _replicated_head_scores(lm_head, hidden, labels, logit_map, temperature, statistics):
    """``head_token_scores``' values from a replicated head's local logits."""
    logits = map_logits(lm_head(hidden), logit_map)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_softmax = F.log_softmax(logits, -1)
    real = labels != IGNORE_INDEX
    picked = log_softmax.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    with torch.no_grad():
        found = {"argmax": lambda: logits.argmax(-1), "logit_sum": lambda: logits.sum(-1),
                 "square_lse": lambda: (2 * log_softmax).logsumexp(-1),
                 "expected_logit": lambda: (log_softmax.exp() * logits).sum(-1)}
        found = {name: found[name]() for name in statistics}
    return torch.where(real, picked, 0), torch.where(real, entropy, 0), found


def sequence_sums(token_values, model):
    """``(B,)``: each sequence's sum of a TSP model's per-token values
    ``(B, S/D)`` (``token_logprobs``, ``entropy`` or any product of them)
    over the whole sequence: the local sums all-reduced over the TSP group;
    backward hands every rank its own tokens' gradient."""
    return sum_over_group(token_values.sum(dim=-1), model.tsp_topology.tsp_group)


def natural_order(token_values, model, seq_len):
    """``(B, seq_len, ...)``: a TSP model's per-token values of the local
    tokens ``(B, S/D, ...)`` gathered from every rank into the sequence's own
    order, the padding TSP appended dropped (no gradient: for logging and
    evaluation; ``sequence_sums`` is the differentiable reduction)."""
    padded = token_values.shape[1] * model.tsp_topology.tsp_size
    return gather_sequence(token_values, padded - seq_len, model.tsp_topology.tsp_group, model.tsp_config.layout)
