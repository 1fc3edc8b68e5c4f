"""The folded vocabulary (ds_tsp.blocks.vocab) against unsharded torch / Hugging Face, float64.

Block level: every rank builds the same seeded ``nn.Embedding`` and bias-free
head, runs its zigzag tokens through ``embedding -> tanh -> head + loss`` and
returns the loss, its shard gradients, the logits of the no-label path and the
bytes each collective moved; the test compares them with the full modules and
with the byte formulas of the ``ds_tsp.blocks.vocab`` docstring. Model level: the
shared ``parity.model_parity`` body at D = 1..4. The bound 1e-10 is far above
float64 round-off of these reordered sums (~1e-15) and far below a wrong row
(~1e-1, see the guard tests).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ds_tsp
from ds_tsp.parallel import comm, layout
from ds_tsp.config import TSPConfig
from ds_tsp.parallel.mappings import sum_over_group
from ds_tsp.parallel.topology import TSPTopology
from ds_tsp.blocks.vocab import VocabError, VocabParallelEmbedding, VocabParallelLMHead, shard_rows
from models import tiny_model
from parity import NOT_DIFFS, TOLERANCE, check, model_parity

HIDDEN, SEQ, PADDING_IDX = 8, 24, 5  # SEQ is a multiple of 2*D for D = 1..4
F64 = 8


def _reference(vocab_size, tied, batch):
    torch.manual_seed(11)
    embed = nn.Embedding(vocab_size, HIDDEN, padding_idx=PADDING_IDX).double()
    head = nn.Linear(HIDDEN, vocab_size, bias=False).double()
    if tied:
        head.weight = embed.weight
    ids = torch.randint(0, vocab_size, (batch, SEQ))
    ids[0, :3] = PADDING_IDX  # the padding row gets no gradient
    labels = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
    labels[-1, 4:9] = -100
    return embed, head, ids, labels


def _reference_run(vocab_size, tied, batch):
    embed, head, ids, labels = _reference(vocab_size, tied, batch)
    hidden = torch.tanh(embed(ids))
    logits = head(hidden)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    return {"loss": loss.item(), "embed": embed.weight.grad, "head": head.weight.grad, "logits": logits.detach()}


def _tsp_blocks(vocab_size, tied, batch, logits_tile_mib, wrong_shard=False):
    topo = TSPTopology(dist.get_world_size())
    r, D = topo.tsp_rank, topo.tsp_size
    embed_ref, head_ref, ids, labels = _reference(vocab_size, tied, batch)
    embed = VocabParallelEmbedding.from_hf(embed_ref, topo.tsp_group)
    head = VocabParallelLMHead.from_hf(head_ref, topo.tsp_group, logits_tile_mib=logits_tile_mib,
                                       tied_to=embed if tied else None)
    if wrong_shard and r == D - 1:
        with torch.no_grad():
            head.weight.mul_(1.5)
    rank_ids = [layout.shard(ids, j, D, "zigzag") for j in range(D)]
    local_labels = layout.shard(labels, r, D, "zigzag")
    comm.counter.reset()
    hidden = torch.tanh(embed(rank_ids))
    local_sum = head.loss_sum(hidden, local_labels)
    loss = sum_over_group(local_sum, topo.tsp_group) / int((labels != -100).sum())
    forward_ops = comm.counter.snapshot()
    comm.counter.reset()
    loss.backward()
    backward_ops = comm.counter.snapshot()
    with torch.no_grad():
        logits = head(torch.tanh(embed(rank_ids)))
    # Evaluation: the loss and the predicted ids found on the same ring, without full logits.
    eval_sum, predicted = head.loss_sum_and_argmax(torch.tanh(embed(rank_ids)), local_labels)
    _, start, length = embed.shard_piece("weight")
    owners = torch.stack(rank_ids).flatten(1) // embed.rows  # (D, N)
    counts = [[int((owners[k] == j).sum()) for j in range(D)] for k in range(D)]
    return {"loss": loss.item(), "piece": (start, length), "embed": embed.weight.grad, "head": head.weight.grad,
            "logits": logits, "forward_ops": forward_ops, "backward_ops": backward_ops, "counts": counts,
            "tile": head.tile, "tsp_rank": r, "predicted": predicted, "eval_loss_sum": eval_sum.item(),
            "loss_sum": local_sum.item()}


def _received(ops, op):
    return ops.get(op, {}).get("received", 0)


CASES = {  # name: (vocab_size, tied, batch, logits_tile_mib)
    "untied V=61": (61, False, 2, 32.0),
    "tied V=61": (61, True, 2, 32.0),
    "V divisible by D": (48, False, 1, 32.0),
    "one-token tiles": (61, False, 2, 1e-5),
}


@pytest.mark.parametrize("tsp_size", [1, 2, 3, 4])
def test_embedding_and_fused_loss_match_torch_and_move_the_formula_bytes(run_ranks, tsp_size):
    for name, (vocab_size, tied, batch, tile_mib) in CASES.items():
        ref = _reference_run(vocab_size, tied, batch)
        per_rank = run_ranks(tsp_size, _tsp_blocks, vocab_size=vocab_size, tied=tied, batch=batch,
                             logits_tile_mib=tile_mib)
        rows = shard_rows(vocab_size, tsp_size)
        ref_logits = layout.stack_shards(ref["logits"], tsp_size, "zigzag")
        worst = {"loss": 0.0, "embed": 0.0, "head": 0.0, "padding rows": 0.0, "logits": 0.0}
        for res in per_rank:
            start, length = res["piece"]
            worst["loss"] = max(worst["loss"], abs(res["loss"] - ref["loss"]))
            worst["embed"] = max(worst["embed"], (res["embed"][:length] - ref["embed"][start:start + length])
                                 .abs().max().item())
            worst["head"] = max(worst["head"], (res["head"][:length] - ref["head"][start:start + length])
                                .abs().max().item())
            worst["padding rows"] = max(worst["padding rows"], res["embed"][length:].abs().max().item()
                                        if length < rows else 0.0)
            worst["logits"] = max(worst["logits"], (res["logits"] - ref_logits[res["tsp_rank"]]).abs().max().item())
            worst["eval loss"] = max(worst.get("eval loss", 0.0), abs(res["eval_loss_sum"] - res["loss_sum"]))
        wrong_ids = sum(int((res["predicted"] != ref_logits[res["tsp_rank"]].argmax(-1)).sum()) for res in per_rank)
        print(f"D={tsp_size} {name}: tile {per_rank[0]['tile']} tokens; max|diff| "
              + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + f"; {wrong_ids} predicted ids differ")
        assert max(worst.values()) <= TOLERANCE, worst
        assert wrong_ids == 0
        if not tied:  # the padding row had no gradient to match (a tied head still gives it one)
            assert ref["embed"][PADDING_IDX].abs().max() == 0
        for res in per_rank:  # DESIGN section 6 / ds_tsp.blocks.vocab, float64 (e = a = 8 bytes)
            r, counts = res["tsp_rank"], res["counts"]
            assert _received(res["forward_ops"], "all_to_all") == sum(
                counts[r][j] for j in range(tsp_size) if j != r) * HIDDEN * F64
            assert _received(res["backward_ops"], "all_to_all") == sum(
                counts[k][r] for k in range(tsp_size) if k != r) * HIDDEN * F64
            assert _received(res["forward_ops"], "ring") == (tsp_size - 1) * rows * HIDDEN * F64
            assert _received(res["backward_ops"], "ring") == 2 * (tsp_size - 1) * rows * HIDDEN * F64
            assert set(res["forward_ops"]) <= {"all_to_all", "ring", "all_reduce"}


def test_a_wrong_head_shard_is_caught(run_ranks):
    ref = _reference_run(61, False, 2)
    per_rank = run_ranks(2, _tsp_blocks, vocab_size=61, tied=False, batch=2, logits_tile_mib=32.0, wrong_shard=True)
    moved = max(abs(per_rank[0]["loss"] - ref["loss"]),
                max((res["embed"][:res["piece"][1]] - ref["embed"][res["piece"][0]:sum(res["piece"])]).abs().max()
                    .item() for res in per_rank))
    ref_logits = layout.stack_shards(ref["logits"], 2, "zigzag")
    wrong_ids = sum(int((res["predicted"] != ref_logits[res["tsp_rank"]].argmax(-1)).sum()) for res in per_rank)
    print(f"wrong head shard: loss / embedding gradient moved by {moved:.2e}, {wrong_ids} predicted ids differ")
    assert moved > 1e3 * TOLERANCE and wrong_ids > 0


def _d3_model():
    """Heads and intermediate size divisible by 3."""
    return {"hidden_size": 24, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 48}


@pytest.mark.parametrize("tsp_size", [1, 2, 3, 4])
def test_whole_model_with_folded_vocabulary_matches_hugging_face(run_ranks, tsp_size):
    overrides = _d3_model() if tsp_size == 3 else {}
    cases = {
        "untied, V=61 (not divisible)": dict(arch="llama", batch=2, seq_len=13),
        "tied, right padding": dict(arch="llama_tied", batch=2, seq_len=19, right_padding=5),
        "num_items_in_batch": dict(arch="qwen2", batch=2, seq_len=16, num_items_in_batch=40),
        "replicated vocabulary": dict(arch="llama", batch=2, seq_len=13, vocab_parallel=False),
        "scaled embedding (Gemma), tied": dict(arch="gemma", batch=2, seq_len=13),
    }
    for label, case in cases.items():
        per_rank = run_ranks(tsp_size, model_parity, model_overrides=overrides, **case)
        check(per_rank, f"D={tsp_size} {label}")


@pytest.mark.parametrize("wrong_shard", ["model.embed_tokens", "lm_head"])
def test_a_wrong_vocabulary_shard_is_caught_in_the_model(run_ranks, wrong_shard):
    per_rank = run_ranks(2, model_parity, arch="llama", batch=1, seq_len=16, wrong_shard=wrong_shard)
    worst = max(v for d in per_rank for k, v in d.items() if k not in NOT_DIFFS)
    print(f"wrong {wrong_shard} shard: max|diff| {worst:.2e}")
    assert worst > 1e3 * TOLERANCE


def _model_memory(vocab_parallel):
    """Parameters on this rank, and the shapes the forward returns with and without labels."""
    tsp_size = dist.get_world_size()
    model = tiny_model("llama", vocab_size=1000)
    ds_tsp.inject(model, TSPTopology(tsp_size), TSPConfig(enabled=True, size=tsp_size, vocab_parallel=vocab_parallel))
    ids = torch.randint(0, 1000, (1, 16))
    with torch.no_grad():
        with_labels = model(input_ids=ids, labels=ids)
        without = model(input_ids=ids)
    return {"params": sum(p.numel() for p in model.parameters()), "logits_with_labels": with_labels.logits,
            "logits_shape": tuple(without.logits.shape), "embed_shape": tuple(model.model.embed_tokens.weight.shape)}


def test_each_rank_holds_its_rows_and_no_logits_come_with_labels(run_ranks):
    folded = run_ranks(2, _model_memory, vocab_parallel=True)
    replicated = run_ranks(2, _model_memory, vocab_parallel=False)
    print(f"parameters per rank: folded {folded[0]['params']}, replicated {replicated[0]['params']}")
    assert folded[0]["embed_shape"] == (500, 16) and replicated[0]["embed_shape"] == (1000, 16)
    assert replicated[0]["params"] - folded[0]["params"] == 2 * 500 * 16
    assert folded[0]["logits_with_labels"] is None and replicated[0]["logits_with_labels"] is not None
    assert folded[0]["logits_shape"] == replicated[0]["logits_shape"] == (1, 8, 1000)


class _ScaledEmbedding(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2.0


def test_what_cannot_be_folded_is_refused_before_any_weight_moves():
    model = tiny_model("llama")
    model.model.embed_tokens = _ScaledEmbedding(61, 16).double()
    with pytest.raises(VocabError, match="_ScaledEmbedding, not a plain nn.Embedding.*tsp.vocab_parallel to false"):
        ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True))
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"  # untouched
    ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True, vocab_parallel=False))

    # Named like transformers' scaled embeddings, but its forward is not the lookup times embed_scale: the probe.
    pretender = type("FakeScaledWordEmbedding", (nn.Embedding,), {
        "__module__": "transformers.fake", "forward": lambda self, ids: nn.Embedding.forward(self, ids) * 2.0 + 1.0})
    model = tiny_model("llama")
    model.model.embed_tokens = pretender(61, 16).double()
    model.model.embed_tokens.embed_scale = torch.tensor(2.0, dtype=torch.float64)
    with pytest.raises(VocabError, match="its forward is not its lookup times embed_scale"):
        ds_tsp.inject(model, TSPTopology(1), TSPConfig(enabled=True))

    biased = tiny_model("llama")
    biased.lm_head = nn.Linear(16, 61, bias=True).double()
    with pytest.raises(VocabError, match="LM head is a Linear with a bias"):
        ds_tsp.inject(biased, TSPTopology(1), TSPConfig(enabled=True))


def test_ids_outside_the_vocabulary_are_refused():
    model = ds_tsp.inject(tiny_model("llama"), TSPTopology(1), TSPConfig(enabled=True))
    with pytest.raises(ValueError, match=r"1 id\(s\) outside \[0, vocab_size = 61\)"):
        model(input_ids=torch.tensor([[1, 2, 61, 3]]))
