"""No host synchronisation in the training forward and backward.

On an accelerator, reading a tensor's value on the host (``.item()``,
``int(t)``, ``bool(t)``, ``.tolist()``, ...) waits for every kernel queued
before it. ds_tsp reads what the host must know about a micro-batch from one
host copy of it before the step's first kernel (``ds_tsp.injection.model.TSPBatch``,
``ds_tsp.parallel.host_reads.host_copy``, the embedding's ``EmbeddingRoute``); the layers, the loss and
backward read nothing. On CPU ranks a read costs nothing, so this test
records the reads themselves: every call of those methods made from ds_tsp
code, split into the batch preparation's and the rest's, which must be none.
"""

import copy
import os
import sys
from unittest import mock

import pytest
import torch

import ds_tsp
from ds_tsp.injection import model as tsp_model_module
from ds_tsp.blocks import vocab
from ds_tsp.parallel import host_reads
from ds_tsp.config import TSPConfig
from ds_tsp.parallel.topology import TSPTopology
from models import tiny_model
from parity import packed_position_ids

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")
PACKAGE = os.path.dirname(ds_tsp.__file__)
BATCH_PREPARATION = {tsp_model_module.TSPBatch.__init__.__code__, host_reads.host_copy.__code__,
                     vocab.EmbeddingRoute.__init__.__code__}


class HostReads:
    """Records the host reads made from ds_tsp code while active, in every
    thread (autograd's backward included): ``batch`` (during the batch's
    preparation) and ``hot`` (anywhere else: ``file:line`` of the ds_tsp frame)."""

    def __init__(self):
        self.batch, self.hot = 0, []

    def _record(self):
        frame, where = sys._getframe(2), None
        while frame is not None:
            if frame.f_code in BATCH_PREPARATION:
                self.batch += 1
                return
            if where is None and frame.f_code.co_filename.startswith(PACKAGE):
                where = f"{os.path.relpath(frame.f_code.co_filename, PACKAGE)}:{frame.f_lineno}"
            frame = frame.f_back
        if where is not None:
            self.hot.append(where)

    def __enter__(self):
        self.originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
        for name, original in self.originals.items():
            def read(tensor, *args, _original=original, **kwargs):
                self._record()
                return _original(tensor, *args, **kwargs)
            setattr(torch.Tensor, name, read)
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)


def training_step_reads(arch, vocab_parallel, documents=None, checkpointing=False, break_loss=False, overrides=None,
                        **options):
    """Forward and backward of a TSP model (``overrides`` of its tiny config) after one warm-up step, as in
    training, under ``HostReads``: ``(batch reads, hot-path reads)``."""
    torch.manual_seed(3)
    model = copy.deepcopy(tiny_model(arch, **(overrides or {})))
    tsp_size = torch.distributed.get_world_size()
    ds_tsp.inject(model, TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa",
                                                          vocab_parallel=vocab_parallel, **options))
    if checkpointing:
        model.train()
        model.gradient_checkpointing_enable({"use_reentrant": False})
    input_ids = torch.randint(0, model.config.vocab_size, (2, 21))
    inputs = {"input_ids": input_ids, "labels": input_ids}
    if documents is None:
        inputs["attention_mask"] = torch.ones_like(input_ids)
        inputs["attention_mask"][1, -6:] = 0  # right padding
    else:
        inputs["position_ids"] = packed_position_ids(documents)
    model(**inputs).loss.backward()  # the warm-up: tsp.check_batch compares the first batch only
    with HostReads() as reads:
        wrong = mock.patch.object(tsp_model_module, "sum_over_group",
                                  side_effect=lambda t, group: t * float(t)) if break_loss else mock.MagicMock()
        with wrong:
            model(**inputs, num_items_in_batch=torch.tensor(30)).loss.backward()
    return reads.batch, reads.hot


CASES = {
    "llama, folded vocabulary, right padding": dict(arch="llama", vocab_parallel=True),
    "qwen3, replicated vocabulary, packed documents, recompute": dict(
        arch="qwen3", vocab_parallel=False, documents=[[9, 12], [21]], checkpointing=True),
    "mistral, token tiles": dict(arch="mistral", vocab_parallel=True, token_tile=3),
    # Its dense layers only: the token all-to-all of experts reads their counts on the host by design.
    "deepseek_v32, sparse attention, packed documents": dict(arch="deepseek_v32", vocab_parallel=True,
                                                              documents=[[9, 12], [21]],
                                                              overrides={"mlp_layer_types": ["dense", "dense"]}),
}


@pytest.mark.parametrize("tsp_size", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_no_host_reads_in_the_training_forward_and_backward(run_ranks, tsp_size, case):
    per_rank = run_ranks(tsp_size, training_step_reads, **CASES[case])
    for batch_reads, hot in per_rank:
        print(f"D={tsp_size} {case}: {batch_reads} host reads preparing the batch, {len(hot)} elsewhere {hot}")
        assert batch_reads > 0  # the recorder sees reads: the batch's are real ones
        assert hot == []


def test_a_read_in_the_hot_path_is_caught(run_ranks):
    per_rank = run_ranks(2, training_step_reads, arch="llama", vocab_parallel=True, break_loss=True)
    for _, hot in per_rank:
        print(f"a float() in the loss: recorded at {hot}")
        assert any(where.startswith("injection/model.py") for where in hot)


def test_the_batch_is_read_from_the_host_in_one_transfer():
    """``host_copy`` moves the accelerator tensors of a batch in one copy (the
    meta device stands in for one here: its copies are counted, not run)."""
    ids = torch.arange(6).view(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert host_reads.host_copy(ids, None, mask, reason="batch") == (ids, None, mask)  # host tensors: no copy at all
    copied = []

    def cpu(tensor):
        copied.append(tensor.shape)
        return torch.zeros(tensor.shape, dtype=tensor.dtype)

    with mock.patch.object(torch.Tensor, "cpu", cpu):
        copies = host_reads.host_copy(ids.to("meta"), None, mask.to("meta"), reason="batch")
    assert copied == [torch.Size([12])]  # one transfer, of both tensors' 6 elements
    assert [None if t is None else (t.device.type, t.dtype, tuple(t.shape)) for t in copies] == \
        [("cpu", torch.int64, (2, 3)), None, ("cpu", torch.bool, (2, 3))]
