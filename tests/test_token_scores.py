"""Per-token log-probabilities and entropies from the TSP forward
(``return_token_logprobs``, ``return_entropy``; DESIGN.md 6l) against the
unsharded Hugging Face model's logits, float64.

Every case scores 2 rows of 13 tokens (the second right-padded by 3, a few
labels -100) of a vocabulary of 61, which no D > 1 divides, with the logits
divided by a temperature of 0.7, at D = 1, 2, 4 with the folded and the
replicated vocabulary, and Gemma-2's soft-capped final logits. Checked: the
values gathered to the sequence's order (``ds_tsp.natural_order``) and the
per-sequence sums (``ds_tsp.sequence_sums``) against Hugging Face's
log-softmax, and every gradient of ``sum(a * logp + b * H)`` (random weights
``a``, ``b`` per token) against the same loss on Hugging Face's model. Bound:
parity.TOLERANCE (1e-10), far above float64 round-off of these reordered
sums and far below a wrong head row (the guard test).
"""

import contextlib
import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ds_tsp
from ds_tsp.blocks import vocab
from ds_tsp.config import TSPConfig
from ds_tsp.parallel import layout
from ds_tsp.parallel.topology import TSPTopology
from models import GEMMA2_TINY, tiny_model
from float32_control import float32_bound
from parity import TOLERANCE, shard_grad_diffs

TEMPERATURE = 0.7


def _batch(vocab_size):
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab_size, (2, 13), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    labels = ids.clone()
    labels[0, 4:6] = -100
    labels[mask == 0] = -100
    weights = torch.randn(2, 2, 13, generator=generator, dtype=torch.float64)  # (a, b) per position
    return ids, mask, labels, weights


def _reference_scores(ref, ids, mask, labels):
    """HF's log-probabilities of the next token and entropies, ``(B, S)``, 0 where nothing is scored."""
    logits = ref(input_ids=ids, attention_mask=mask).logits.double() / TEMPERATURE
    log_softmax = F.log_softmax(logits, dim=-1)
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    real = targets != -100
    picked = log_softmax.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return torch.where(real, picked, 0), torch.where(real, entropy, 0)


class _OutputShapes(TorchDispatchMode):
    """Every op's output shapes while it is on."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@contextlib.contextmanager
def _head_ring_watched(shapes):
    """The folded head's ring, forward and backward, under ``_OutputShapes``:
    what it makes, to show no ``(tokens, V)`` tensor is among it."""

    def watched(fn):
        def run(*args, **kwargs):
            with _OutputShapes() as mode:
                result = fn(*args, **kwargs)
            shapes.extend(mode.shapes)
            return result
        return run

    with mock.patch.object(vocab, "cross_entropy_ring_forward", watched(vocab.cross_entropy_ring_forward)), \
            mock.patch.object(vocab, "cross_entropy_ring_backward", watched(vocab.cross_entropy_ring_backward)):
        yield


def _token_scores(arch, vocab_parallel, overrides, wrong_head_row=False):
    D = dist.get_world_size()
    ref = tiny_model(arch, **overrides)
    model = ds_tsp.inject(copy.deepcopy(ref), TSPTopology(D),
                          TSPConfig(enabled=True, size=D, attention_backend="sdpa", vocab_parallel=vocab_parallel))
    if wrong_head_row and dist.get_rank() == D - 1:
        with torch.no_grad():
            model.lm_head.weight[0] += 1
    ids, mask, labels, weights = _batch(ref.config.vocab_size)
    head_shapes = []
    with _head_ring_watched(head_shapes):
        out = model(input_ids=ids, attention_mask=mask, labels=labels, return_token_logprobs=True,
                    return_entropy=True, temperature=TEMPERATURE)
        local_weights = [layout.shard(layout.pad_to_multiple(w, D, 0)[0], dist.get_rank(), D, "zigzag")
                         for w in weights]
        objective = (ds_tsp.sequence_sums(local_weights[0] * out.token_logprobs, model)
                     + ds_tsp.sequence_sums(local_weights[1] * out.entropy, model)).sum()
        objective.backward()
    logprobs = ds_tsp.natural_order(out.token_logprobs, model, ids.shape[1])
    entropy = ds_tsp.natural_order(out.entropy, model, ids.shape[1])
    sums = ds_tsp.sequence_sums(out.token_logprobs, model).detach()

    ref_logprobs, ref_entropy = _reference_scores(ref, ids, mask, labels)
    (weights[0] * ref_logprobs + weights[1] * ref_entropy).sum().backward()
    vocab = ref.config.vocab_size
    return {"logprobs": (logprobs - ref_logprobs).abs().max().item(),
            "entropy": (entropy - ref_entropy).abs().max().item(),
            "sums": (sums - ref_logprobs.sum(-1)).abs().max().item(),
            "objective": abs(objective.item() - (weights[0] * ref_logprobs + weights[1] * ref_entropy).sum().item()),
            "grads": shard_grad_diffs(model, ref), "loss": out.loss.item(),
            "dtypes": (out.token_logprobs.dtype, out.entropy.dtype), "logits": out.logits is None,
            "head_ops": len(head_shapes), "vocab_wide": sorted({s for s in head_shapes if any(n >= vocab for n in s)})}


CASES = [("llama", True, {}), ("llama", False, {}), ("llama_tied", True, {}),
         ("gemma2", True, {**GEMMA2_TINY, "attn_implementation": "eager_wide_softmax"})]


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_token_logprobs_and_entropy_match_hugging_face(run_ranks, tsp_size):
    for arch, vocab_parallel, overrides in CASES:
        per_rank = run_ranks(tsp_size, _token_scores, arch=arch, vocab_parallel=vocab_parallel, overrides=overrides)
        worst = {key: max(r[key] for r in per_rank) for key in ("logprobs", "entropy", "sums", "objective")}
        grads = {k: max(r["grads"][k] for r in per_rank if k in r["grads"]) for k in per_rank[0]["grads"]}
        grad_name = max(grads, key=grads.get)
        print(f"D={tsp_size} {arch} vocab_parallel={vocab_parallel}: " + ", ".join(
            f"{key} {value:.1e}" for key, value in worst.items()) + f", gradients {grads[grad_name]:.1e} "
            f"({grad_name}); tensors of the head's ring as wide as the vocabulary: {per_rank[0]['vocab_wide']}")
        assert max(worst.values()) <= TOLERANCE and grads[grad_name] <= TOLERANCE
        assert all(r["dtypes"] == (torch.float64, torch.float64) and r["logits"] for r in per_rank)
        if vocab_parallel and tsp_size > 1:  # the folded head's ring: no (tokens, V) logits, nor any tensor that wide
            assert all(r["head_ops"] and not r["vocab_wide"] for r in per_rank), per_rank[0]["vocab_wide"]


def test_a_wrong_head_row_is_caught(run_ranks):
    per_rank = run_ranks(2, _token_scores, arch="llama", vocab_parallel=True, overrides={}, wrong_head_row=True)
    worst = max(max(r["logprobs"], r["entropy"]) for r in per_rank)
    print(f"a wrong head row on one rank: log-probabilities and entropies {worst:.1e} off")
    assert worst > 1e6 * TOLERANCE


def test_scores_need_labels_and_a_positive_temperature():
    model = ds_tsp.inject(tiny_model("llama"), TSPTopology(1), TSPConfig(enabled=True))
    ids = torch.randint(0, 61, (1, 8))
    with pytest.raises(ValueError, match="return_token_logprobs / return_entropy / fused_lm_head score the labels' tokens"):
        model(input_ids=ids, return_token_logprobs=True)
    with pytest.raises(ValueError, match=r"temperature = 0: .* a number above 0"):
        model(input_ids=ids, labels=ids, return_entropy=True, temperature=0)


FUSED_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
# TRL's own fused head rounds its logit tiles to float32 and keeps its softmax statistics and gradient sums in
# float32 whatever the model's dtype: it meets the float64 reference to float32 rounding. It is held to a bound
# measured on this machine (float32_control): the control is the same fields' definitions on HF's logits rounded
# to float32, and their gradients through that float32 softmax; relative errors (each field over its largest
# value, each gradient over its tensor's largest entry); the boolean fields exactly. The TSP head is held to
# TOLERANCE.
FLOAT_FIELDS = FUSED_FIELDS[:4]


def _reference_fused_fields(ref, ids, mask, labels, dtype=torch.float64):
    """TRL's ``FusedCausalLMOutput`` fields ``(B, S-1)`` from HF's float64 logits, by their definitions
    (computed in ``dtype``: float32 is the control's rounding)."""
    logits = ref(input_ids=ids, attention_mask=mask).logits[:, :-1].to(dtype) / TEMPERATURE
    log_softmax = F.log_softmax(logits, dim=-1)
    targets = labels[:, 1:]
    real = targets != -100
    fields = {"log_probs": log_softmax.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1),
              "entropy": -(log_softmax.exp() * log_softmax).sum(-1),
              "log_sum_sq_probs": (2 * log_softmax).logsumexp(-1), "mean_logits": logits.mean(-1),
              "is_top1": logits.argmax(-1) == targets}
    return {**{name: torch.where(real, value, 0) for name, value in fields.items()}, "label_mask": real}


def _left_padded(ids, mask, labels):
    """The batch with its first row moved right by 3 (padding before and after
    it: the prompt + completion rows TRL's GRPO scores), the prompt's labels -100."""
    ids, mask, labels = ids.clone(), mask.clone(), labels.clone()
    ids[0] = ids[0].roll(3)
    mask[0] = torch.tensor([0, 0, 0] + [1] * 8 + [0, 0])
    labels[0] = torch.where(mask[0].bool(), ids[0], -100)
    labels[:, :5] = -100
    return ids, mask, labels


def _fused_head(vocab_parallel, left_padded=False):
    """TRL's fused-LM-head contract (``add_fused_lm_head``, what its DPO, GRPO
    and SFT trainers call) on a TSP model, and TRL's own patch of the unsharded
    model, against the fields' definitions on HF's float64 logits: every field
    ``(B, S-1)`` in the sequence's order, the loss, and the gradients of
    ``sum(a * log_probs + b * entropy)``."""
    from trl.trainer.utils import add_fused_lm_head

    D = dist.get_world_size()
    ref = tiny_model("llama")
    model = ds_tsp.inject(copy.deepcopy(ref), TSPTopology(D),
                          TSPConfig(enabled=True, size=D, attention_backend="sdpa", vocab_parallel=vocab_parallel))
    trl_model = copy.deepcopy(ref)
    outputs = FUSED_FIELDS[1:5]
    add_fused_lm_head(trl_model, temperature=TEMPERATURE, outputs=outputs)
    ds_tsp.add_fused_lm_head(model, temperature=TEMPERATURE, outputs=outputs)
    ids, mask, labels, weights = _batch(ref.config.vocab_size)
    if left_padded:
        ids, mask, labels = _left_padded(ids, mask, labels)
    control_model = copy.deepcopy(ref)
    expected = _reference_fused_fields(ref, ids, mask, labels)
    (weights[0, :, :-1] * expected["log_probs"] + weights[1, :, :-1] * expected["entropy"]).sum().backward()
    control = _reference_fused_fields(control_model, ids, mask, labels, dtype=torch.float32)
    (weights[0, :, :-1].float() * control["log_probs"] + weights[1, :, :-1].float() * control["entropy"]).sum().backward()

    def relative(fields, grads_of):
        """Each float field's distance to the truth over its largest value; the boolean fields' (0 or 1); the
        gradients' largest distance over their tensor's largest entry."""
        errors = {field: ((fields[field].double() - expected[field]).abs().max()
                          / expected[field].abs().max()).item() for field in FLOAT_FIELDS}
        exact = max((fields[field] != expected[field]).any().item() for field in FUSED_FIELDS[4:])
        grads = max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
                    for p, q in zip(grads_of.parameters(), ref.parameters()) if q.grad.abs().max() > 0)
        return errors, exact, grads

    found = {}
    for name, net in (("tsp", model), ("trl", trl_model)):
        out = net(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        (weights[0, :, :-1] * out.log_probs + weights[1, :, :-1] * out.entropy).sum().backward()
        found[name] = {field: (getattr(out, field).double() - expected[field].double()).abs().max().item()
                       for field in FUSED_FIELDS}
        found[name]["loss"] = abs(out.loss.item() + (expected["log_probs"].sum() / expected["label_mask"].sum()).item())
        found[name]["shape"] = all(getattr(out, field).shape == expected[field].shape for field in FUSED_FIELDS)
        if name == "trl":
            trl_fields = {field: getattr(out, field) for field in FUSED_FIELDS}
    trl_rel, trl_flips, trl_grads = relative(trl_fields, trl_model)
    control_rel, control_flips, control_grads = relative(control, control_model)
    return {**found, "grads": shard_grad_diffs(model, ref), "trl_rel": trl_rel, "trl_flips": trl_flips,
            "trl_grads": trl_grads, "control_rel": control_rel, "control_grads": control_grads}


@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_fused_lm_head_gives_trl_fields(run_ranks, tsp_size):
    for vocab_parallel, left_padded in ((True, False), (False, False), (True, True)):
        per_rank = run_ranks(tsp_size, _fused_head, vocab_parallel=vocab_parallel, left_padded=left_padded)
        keys = (*FUSED_FIELDS, "loss")
        ours, trl = ({key: max(r[side][key] for r in per_rank) for key in keys} for side in ("tsp", "trl"))
        grads = max(max(r["grads"].values()) for r in per_rank)
        print(f"D={tsp_size} vocab_parallel={vocab_parallel} left padding {left_padded}: against the float64 "
              "definitions, TSP fused head "
              + ", ".join(f"{key} {value:.1e}" for key, value in ours.items()) + f", gradients {grads:.1e}; "
              f"TRL's own (float32 tiles) {max(trl.values()):.1e} (absolute)")
        assert all(r["tsp"]["shape"] and r["trl"]["shape"] for r in per_rank)
        assert max(ours.values()) <= TOLERANCE and grads <= TOLERANCE
        first = per_rank[0]
        fields, fields_bound = max(first["trl_rel"].values()), float32_bound(first["control_rel"].values())
        grads_bound = float32_bound([first["control_grads"]])
        print(f"  TRL's own, relative to the float64 truth: fields {fields:.1e} (bound {fields_bound:.1e}, "
              f"control {max(first['control_rel'].values()):.1e}), gradients {first['trl_grads']:.1e} "
              f"(bound {grads_bound:.1e}, control {first['control_grads']:.1e}); boolean fields differ: {first['trl_flips']}")
        assert fields <= fields_bound and first["trl_grads"] <= grads_bound and not first["trl_flips"]


def test_fused_lm_head_refusals():
    model = ds_tsp.inject(tiny_model("llama"), TSPTopology(1), TSPConfig(enabled=True))
    with pytest.raises(ValueError, match=r"fused LM head outputs \['logits'\]"):
        ds_tsp.add_fused_lm_head(model, outputs=("logits",))
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32 = True"):
        ds_tsp.add_fused_lm_head(model, cast_lm_head_to_fp32=True)
    ids = torch.randint(0, 61, (1, 8))
    with pytest.raises(ValueError, match="shift_labels .* pass labels"):
        model(input_ids=ids, labels=ids, fused_lm_head=True, shift_labels=ids)
