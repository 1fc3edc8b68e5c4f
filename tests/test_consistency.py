"""Every rank of a TSP group holds one model and sees one micro-batch
(``ds_tsp.injection.consistency``): what differs is refused or made equal."""

import copy

import pytest
import torch
import torch.distributed as dist

import ds_tsp
from ds_tsp.config import TSPConfig
from ds_tsp.injection.consistency import RankMismatchError
from ds_tsp.parallel.topology import TSPTopology
from models import tiny_model
from parity import check, model_parity, reference_loss, shard_grad_diffs


def _inject(model, tsp_size, **options):
    return ds_tsp.inject(model, TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size, **options))


def different_vocabularies():
    """Rank 1 resized its embeddings; nothing may be injected."""
    model = tiny_model("llama")
    if dist.get_rank() == 1:
        model.resize_token_embeddings(64)
    try:
        _inject(model, dist.get_world_size())
    except RankMismatchError as err:
        return str(err)
    return None


def test_ranks_with_different_models_are_refused(run_ranks):
    messages = run_ranks(2, different_vocabularies)
    print(messages[0])
    for message in messages:
        assert message is not None and "model.embed_tokens.weight" in message
        assert "(61, 16)" in message and "(64, 16)" in message and "resize_token_embeddings" in message


def unseeded_replicated_weights():
    """Every rank perturbs its replicated weights (norms) differently, as an
    unseeded initialisation would; after injection they equal TSP rank 0's, and
    the model matches HF built from rank 0's weights."""
    tsp_size = dist.get_world_size()
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * dist.get_rank())
    _inject(model, tsp_size)
    input_ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    ref_loss = reference_loss(ref, input_ids)
    ref_loss.backward()
    return {"loss": abs(loss.item() - ref_loss.item()), **shard_grad_diffs(model, ref)}


def test_replicated_weights_start_from_tsp_rank_0(run_ranks):
    check(run_ranks(2, unseeded_replicated_weights), "D=2 norms perturbed on rank 1, broadcast from rank 0")


def different_batches(check_batch, shift_on_step):
    """Rank 1 gets another micro-batch (as a sampler over the world would give
    it) on step ``shift_on_step``; returns the error each step raised, if any.
    The vocabulary stays replicated: the folded embedding's exchange, sized
    from every rank's ids, would fail on an unchecked mismatch."""
    model = _inject(tiny_model("llama"), dist.get_world_size(), check_batch=check_batch, vocab_parallel=False)
    errors = []
    for step in range(2):
        input_ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(step))
        if step == shift_on_step and dist.get_rank() == 1:
            input_ids = torch.roll(input_ids, 1, dims=1)  # same tokens, another order
        try:
            model(input_ids=input_ids, labels=input_ids)
            errors.append(None)
        except RankMismatchError as err:
            errors.append(str(err))
    return errors


@pytest.mark.parametrize("check_batch, shift_on_step, refused_steps", [
    ("first", 0, [0]), ("first", 1, []), ("always", 1, [1]), ("never", 0, []),
])
def test_ranks_with_different_micro_batches_are_refused(run_ranks, check_batch, shift_on_step, refused_steps):
    per_rank = run_ranks(2, different_batches, check_batch=check_batch, shift_on_step=shift_on_step)
    for errors in per_rank:
        assert [step for step, error in enumerate(errors) if error] == refused_steps
        for error in filter(None, errors):
            assert "input_ids" in error and "labels" in error and "DistributedSampler" in error
    if refused_steps:
        print(per_rank[0][refused_steps[0]])


def unfrozen_after_injection():
    """The final norm is frozen when the model is injected and unfrozen before
    the backward: its gradient is still the sum over the TSP group."""
    tsp_size = dist.get_world_size()
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    model.model.norm.weight.requires_grad_(False)
    _inject(model, tsp_size)
    model.model.norm.weight.requires_grad_(True)
    input_ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(5))
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    ref_loss = reference_loss(ref, input_ids)
    ref_loss.backward()
    return {"loss": abs(loss.item() - ref_loss.item()),
            "model.norm.weight": (model.model.norm.weight.grad - ref.model.norm.weight.grad).abs().max().item()}


def test_a_parameter_unfrozen_after_injection_is_still_summed(run_ranks):
    check(run_ranks(2, unfrozen_after_injection), "D=2 final norm unfrozen after injection")


def frozen_before_injection(frozen):
    model = tiny_model("llama")
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    try:
        _inject(model, dist.get_world_size())
    except ValueError as err:
        return str(err)
    return {name: param.requires_grad for name, param in model.named_parameters()}


def test_frozen_weights_stay_frozen_and_mixed_shards_are_refused(run_ranks):
    attention = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
    frozen = run_ranks(2, frozen_before_injection, frozen=attention + ["model.embed_tokens.weight"])[0]
    assert frozen["model.layers.0.self_attn.packed"] is False and frozen["model.embed_tokens.weight"] is False
    assert frozen["model.layers.1.self_attn.packed"] is True and frozen["model.layers.0.mlp.packed"] is True
    message = run_ranks(2, frozen_before_injection, frozen=attention[:1])[0]
    print(message)
    assert "['q_proj.weight'] are frozen" in message and "freeze all of them or none" in message


def test_the_checks_leave_the_numbers_alone(run_ranks):
    check(run_ranks(2, model_parity, arch="qwen2", batch=2, seq_len=13, check_batch="always"),
          "D=2 qwen2 with tsp.check_batch always")


def pipeline_embedding_with_different_batches():
    """The first pipeline stage's embedding checks the micro-batch too."""
    from ds_tsp.injection.pipeline import TSPEmbeddingPipe

    model = _inject(tiny_model("llama"), dist.get_world_size())
    pipe = TSPEmbeddingPipe(model.model.embed_tokens, model.tsp_topology, "zigzag", model.tsp_batch_check)
    input_ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        pipe(input_ids if dist.get_rank() == 0 else torch.roll(input_ids, 1, dims=1))
    except RankMismatchError as err:
        return str(err)
    return None


def test_pipeline_stages_check_the_micro_batch(run_ranks):
    for message in run_ranks(2, pipeline_embedding_with_different_batches):
        assert message is not None and "input_ids" in message
