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

import torch
import torch.nn.functional as F

from ds_tsp.blocks.vocab import IGNORE_INDEX, VocabParallelLMHead, soft_cap
from ds_tsp.parallel.mappings import gather_sequence, sum_over_group


def scores_wanted(labels, tsp_predictions, temperature, return_token_logprobs, return_entropy):
    """The forward's outputs asked for (``("token_logprobs", "entropy")`` or
    fewer, empty for none), after refusing what cannot be scored: no labels,
    evaluation's ``tsp_predictions``, a temperature that is not above 0."""
    wanted = tuple(name for name, asked in (("token_logprobs", return_token_logprobs), ("entropy", return_entropy))
                   if asked)
    if wanted and (labels is None or tsp_predictions is not None):
        raise ValueError("return_token_logprobs / return_entropy score the labels' tokens: pass labels (the input "
                         "ids, -100 where no token is scored), and no tsp_predictions")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
        raise ValueError(f"temperature = {temperature!r}: the logits are divided by it, so it must be a number "
                         "above 0 (1.0: the model's own logits)")
    return wanted


def head_token_scores(lm_head, hidden, batch, tsp_group, num_items_in_batch=None, logit_softcap=None,
                      temperature=1.0, wanted=("token_logprobs", "entropy")):
    """``(loss, {name: values})``: the ``wanted`` log-probabilities
    (``token_logprobs``) and entropies of the normed local hidden states
    ``(B, S/D, H)`` against the batch's labels, the logits soft-capped by
    ``logit_softcap`` and divided by ``temperature``, None where not wanted.
    The loss is the mean of ``-logp`` over the real targets of the whole
    sequence (Hugging Face's cross-entropy at temperature 1)."""
    labels = batch.labels
    if isinstance(lm_head, VocabParallelLMHead):
        logprobs, entropy = lm_head.token_scores(hidden, labels, logit_softcap, temperature)
    else:
        logits = soft_cap(lm_head(hidden), logit_softcap)
        log_softmax = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
        real = labels != IGNORE_INDEX
        picked = log_softmax.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        logprobs = torch.where(real, picked, 0)
        entropy = torch.where(real, -(log_softmax.exp() * log_softmax).sum(-1), 0)
    count = batch.num_real_labels if num_items_in_batch is None else num_items_in_batch
    divisor = count.clamp(min=1) if torch.is_tensor(count) else max(count, 1)
    scores = {"token_logprobs": logprobs, "entropy": entropy}
    return sum_over_group(-logprobs.sum(), tsp_group) / divisor, {name: scores[name] if name in wanted else None
                                                                  for name in scores}


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
