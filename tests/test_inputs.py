"""Bad input is refused before it reaches a collective (``ds_tsp.injection.inputs``),
with Hugging Face's error type, on every rank, and the ranks go on.

One rank-pool call at TSP 2 feeds the model each bad micro-batch in turn and
records what every rank raised; the model's weights and gradients must be
untouched by each refusal, and a good batch afterwards must still give the
unsharded model's loss (no rank left behind in a collective). The same bad
inputs go through the Hugging Face model in the test process, whose error type
ours must be (or subclass)."""

import json
import os

import pytest
import torch
import torch.distributed as dist

import ds_tsp
from ds_tsp.checkpoint import CheckpointError
from ds_tsp.config import TSPConfig
from ds_tsp.injection.consistency import RankMismatchError
from ds_tsp.parallel.topology import TSPTopology
from models import tiny_model
from parity import reference_loss

VOCAB = 61  # tests/models.py's tiny vocabulary
SEQ = 12


def _good_batch(step=0):
    input_ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(step))
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def _label_past_vocabulary(batch):
    batch["labels"][0, 3] = VOCAB + 9


def _negative_label(batch):
    batch["labels"][1, 5] = -7


def _id_past_vocabulary(batch):
    batch["input_ids"][1, 2] = VOCAB


def _labels_of_one_row(batch):
    batch["labels"] = batch["labels"][:1]


def _labels_one_token_short(batch):
    batch["labels"] = batch["labels"][:, :-1]


def _float_input_ids(batch):
    batch["input_ids"] = batch["input_ids"].double()


def _float_labels(batch):
    batch["labels"] = batch["labels"].double()


def _mask_of_another_shape(batch):
    batch["attention_mask"] = torch.ones(2, SEQ + 1, dtype=torch.long)


def _positions_of_another_shape(batch):
    batch["position_ids"] = torch.arange(SEQ - 2).expand(2, -1)


# name: (mutation, the error type, what the message must name)
BAD_INPUTS = {
    "a label id >= vocab_size": (_label_past_vocabulary, IndexError, ["labels", "vocab_size = 61", "70"]),
    "a negative label other than -100": (_negative_label, IndexError, ["labels", "other than -100", "-7"]),
    "an input id >= vocab_size": (_id_past_vocabulary, IndexError, ["input_ids", "vocab_size = 61"]),
    "labels (1, S) for input_ids (2, S)": (_labels_of_one_row, ValueError, ["labels", "(2, 12)", "(1, 12)"]),
    "labels one token shorter": (_labels_one_token_short, ValueError, ["labels", "(2, 12)", "(2, 11)"]),
    "float input_ids": (_float_input_ids, RuntimeError, ["input_ids", "torch.float64", "Long"]),
    "float labels": (_float_labels, RuntimeError, ["labels", "torch.float64"]),
    "an attention_mask of another shape": (_mask_of_another_shape, ValueError, ["attention_mask", "(2, 13)"]),
    "position_ids of another shape": (_positions_of_another_shape, ValueError, ["position_ids", "(2, 10)"]),
}


def _weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _refusals():
    """On every rank: ``{case: (error type's names, message, weights untouched)}``
    and the loss of a good batch afterwards, against the unsharded model's."""
    tsp_size = dist.get_world_size()
    reference = tiny_model("llama")
    model = ds_tsp.inject(tiny_model("llama"), TSPTopology(tsp_size),
                          TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa"))
    before = _weights(model)
    refused = {}
    for name, (mutate, _, _) in BAD_INPUTS.items():
        batch = _good_batch()
        mutate(batch)
        try:
            model(**batch).loss.backward()
            refused[name] = None
        except Exception as error:  # what matters is which, and its message
            untouched = all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
            refused[name] = ([c.__name__ for c in type(error).__mro__], str(error), untouched)
    good = _good_batch(1)
    loss = model(**good).loss.item()
    return refused, abs(loss - reference_loss(reference, good["input_ids"]).item())


def _hugging_face_error(mutate):
    batch = _good_batch()
    mutate(batch)
    try:
        tiny_model("llama")(**batch)
    except Exception as error:
        return type(error)
    return None


def test_every_bad_input_is_refused_with_hugging_faces_error_type(run_ranks):
    per_rank = run_ranks(2, _refusals)
    for name, (_, expected, named) in BAD_INPUTS.items():
        hf_error = _hugging_face_error(BAD_INPUTS[name][0])
        print(f"{name}: Hugging Face raises {hf_error and hf_error.__name__}; TSP 2: {per_rank[0][0][name][1]}")
        for refused, _ in per_rank:
            assert refused[name] is not None, f"{name} was not refused"
            types, message, untouched = refused[name]
            assert expected.__name__ in types and all(part in message for part in named), (name, types, message)
            if hf_error is not None:  # Hugging Face's own type, where it raises one
                assert hf_error.__name__ in types, (name, hf_error, types)
            assert untouched
    for _, after in per_rank:
        print(f"a good batch after the refusals: |loss - unsharded| = {after:.1e}")
        assert after <= 1e-10


def _one_rank_differs(what, step):
    """Rank 1 gets other ``what`` (labels or input_ids) at ``step`` under the
    default ``tsp.check_batch``; returns each step's refusal, if any."""
    tsp_size = dist.get_world_size()
    model = ds_tsp.inject(tiny_model("llama"), TSPTopology(tsp_size),
                          TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa"))
    assert model.tsp_config.check_batch == "always"  # the default
    errors = []
    for s in range(step + 2):
        batch = _good_batch(s)
        if s == step and dist.get_rank() == 1:
            if what == "a label past the vocabulary":  # a bad input on one rank only: no rank waits for another
                batch["labels"][0, 0] = VOCAB
            else:
                batch[what] = torch.roll(batch[what], 1, dims=1)
        try:
            model(**batch).loss.backward()
            errors.append(None)
        except RankMismatchError as error:
            errors.append(str(error))
    return errors


@pytest.mark.parametrize("what", ["labels", "input_ids", "a label past the vocabulary"])
def test_a_rank_given_another_micro_batch_at_step_3_is_refused_by_default(run_ranks, what):
    per_rank = run_ranks(2, _one_rank_differs, what=what, step=3)
    print(per_rank[0][3])
    for errors in per_rank:
        assert [s for s, error in enumerate(errors) if error] == [3]
        assert "TSP ranks [1] (global ranks [1])" in errors[3] and "TSP rank 0 (global rank 0)" in errors[3]
        assert ("labels" if what != "input_ids" else "input_ids") in errors[3]


def test_a_truncated_or_missing_weights_file_is_named(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    model.save_pretrained(tmp_path / "truncated")
    weights = tmp_path / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[-1]
    os.remove(tmp_path / "sharded" / missing)
    for directory, file, problem in (("truncated", "model.safetensors", "truncated or corrupt"),
                                     ("sharded", missing, "does not exist")):
        with pytest.raises(CheckpointError) as refusal:
            ds_tsp.from_pretrained(tmp_path / directory, TSPTopology(1), TSPConfig(enabled=True, size=1))
        print(refusal.value)
        assert str(tmp_path / directory / file) in str(refusal.value) and problem in str(refusal.value)
