"""The analytic planner against hand-computed values and against what ds_tsp
itself counts (comm.counter bytes) and saves for backward (saved-tensor hooks)."""

import argparse
import io
import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ds_tsp import comm
from ds_tsp import plan as planner
from ds_tsp.attention import HeadGroups, TSPAttention
from ds_tsp.mlp import TSPGatedMLP

# Rank bodies live in this module, so every spawned rank imports it: what needs
# DeepSpeed (topology, config) or the Hugging Face model classes is imported
# inside the tests that use it, keeping the ranks' start-up short.

# The shapes of the issue: H=16, F=32, nq=4, nkv=2, d=4, S=16, B=2.
HIDDEN, INTER, HEAD_DIM, SEQ, BATCH = 16, 32, 4, 16, 2


def _shape(num_heads=4, num_kv_heads=2, bias=False, layers=1):
    return dict(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers, num_attention_heads=num_heads,
                num_key_value_heads=num_kv_heads, head_dim=HEAD_DIM, vocab_size=61, attention_bias=bias,
                mlp_bias=bias)


def test_tsp_layer_bytes_by_hand():
    # Wa = 16*(4 + 2*2)*4 + 4*4*16 = 768, Wm = 3*16*32 = 1536, K/V = 2*B*S*nkv*d = 512 elements.
    # bf16: 2 B per element moved; gradient reduces and ring accumulators in fp32 (4 B).
    m = _shape()
    # D=2: forward 1/2 * (768 + 1536 + 512) * 2 B; backward = forward + 1/2 * (768 + 1536) * 4 B + 1/2 * 512 * 2 B.
    assert planner.tsp_bytes_per_layer(m, SEQ, BATCH, 2, 2, "forward") == 2816
    assert planner.tsp_bytes_per_layer(m, SEQ, BATCH, 2, 2, "backward") == 2816 + 4608 + 512 == 7936
    # D=4 on average: 3/4 of the same.
    assert planner.tsp_bytes_per_layer(m, SEQ, BATCH, 4, 2, "forward") == 4224
    assert planner.tsp_bytes_per_layer(m, SEQ, BATCH, 4, 2, "backward") == 4224 + 2304 + 4608 + 768 == 11904
    # D=4 > nkv=2: ranks 0 and 2 hold a key/value head (own shard 256 elements), 1 and 3 only queries (128).
    # Rank 0 forward: (768-256) broadcast + 3/4*512 gather + 3/4*1536 ring = 2048 elements.
    assert planner.tsp_bytes_per_layer(m, SEQ, BATCH, 4, 2, "forward", tsp_rank=0) == 2048 * 2
    assert planner.tsp_bytes_per_layer(m, SEQ, BATCH, 4, 2, "forward", tsp_rank=1) == (640 + 384 + 1152) * 2
    # Rank 0 backward: forward + reduce 3*256 and ring accumulators 1152 in fp32, + dK/dV 384 in bf16.
    assert planner.tsp_bytes_per_layer(m, SEQ, BATCH, 4, 2, "backward", tsp_rank=0) == 4096 + (768 + 1152) * 4 + 768
    assert planner.tsp_bytes_by_op(m, SEQ, BATCH, 4, 2, "both", tsp_rank=1) == {
        "broadcast": 2 * 640 * 2, "ring": 1152 * (2 + 2 + 4), "all_gather": 2 * 384 * 2, "reduce": 3 * 128 * 4,
        "reduce_scatter": 384 * 2}
    # The design formula of DESIGN.md section 8, where every shard is equal.
    for D in (2, 4):
        wa, wm = 768, 1536
        assert planner.tsp_bytes_per_layer(_shape(4, 4), SEQ, BATCH, D, 2, "forward") == \
            (D - 1) * (wa + 256 + wm + 2 * BATCH * SEQ * 4 * HEAD_DIM) // D * 2


@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1])
def test_attention_bytes_match_the_attention_tests_formula(num_kv_heads):
    # tests/test_attention.py::test_bytes_equal_the_design_formula, float64, nq=8, S=16, B=2.
    nq, elem = 8, 8
    wa = HIDDEN * (nq + 2 * num_kv_heads) * HEAD_DIM + nq * HEAD_DIM * HIDDEN
    m = _shape(nq, num_kv_heads)
    for D in (2, 4):
        heads = HeadGroups(nq, num_kv_heads, HEAD_DIM, D)
        kv = (D - 1) * 2 * BATCH * SEQ * num_kv_heads * HEAD_DIM // D
        for rank in range(D):
            own = heads.q_heads * HEAD_DIM * 2 * HIDDEN + (2 * heads.kv_heads * HEAD_DIM * HIDDEN
                                                          if heads.holds_kv(rank) else 0)
            ops = planner.tsp_bytes_by_op(m, SEQ, BATCH, D, elem, "both", tsp_rank=rank)
            forward = (wa - own + kv) * elem
            assert ops["broadcast"] // 2 + ops["all_gather"] // 2 == forward
            assert ops["broadcast"] + ops["all_gather"] + ops["reduce"] + ops["reduce_scatter"] == \
                2 * forward + (kv + (D - 1) * own) * elem


@pytest.mark.parametrize("dtype, bias", [(torch.float64, True), (torch.bfloat16, False)])
def test_mlp_bytes_match_the_mlp_tests_formula(dtype, bias):
    # tests/test_mlp.py::test_ring_bytes: H=16, F=32, S=24, B=2.
    element, accumulator = dtype.itemsize, max(dtype.itemsize, 4)
    sharded = 3 * HIDDEN * INTER + (2 * INTER if bias else 0)
    for D in (2, 4):
        weight_hops = (D - 1) * sharded // D * element
        ops = planner.tsp_bytes_by_op(_shape(bias=bias), 24, BATCH, D, element, "both")
        assert ops["ring"] == 2 * weight_hops + (D - 1) * sharded // D * accumulator


def test_vocab_bytes_by_hand():
    # V=61 over D=2: Vs = 31 rows of H=16 per rank (row 61 is padding). B*S/D = 16 local tokens, bf16.
    m = _shape()
    assert planner.vocab_rows_per_rank(61, 2) == 31 and planner.vocab_rows_per_rank(64, 4) == 16
    forward = planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, 2, 2, "forward")
    # Embedding: expected 1/2 of the 16 local tokens' rows from the other rank; head ring: 1 hop of the shard.
    assert forward == {"all_to_all": 8 * 16 * 2, "ring": 31 * 16 * 2}
    backward = planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, 2, 2, "backward")
    # Row gradients back to their owner (bf16); the shard again and its accumulator in fp32.
    assert backward == {"all_to_all": 8 * 16 * 2, "ring": 31 * 16 * (2 + 4)}
    assert planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, 2, 2, "both") == {"all_to_all": 512, "ring": 31 * 16 * 8}
    # D=4 (Vs = 16): 3/4 of the 8 local tokens; 3 hops. float64 accumulates in float64.
    assert planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, 4, 8, "both") == {
        "all_to_all": 2 * 6 * 16 * 8, "ring": 3 * 16 * 16 * (8 + 8 + 8)}
    # One batch's exact counts: 5 of this rank's tokens owned elsewhere, 11 of the other's owned here.
    exact = planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, 2, 2, "both", rows_exchanged=(5, 11))
    assert exact["all_to_all"] == (5 + 11) * 16 * 2
    # Nothing moves at D=1; the expected rows are fractional where D*D does not divide B*S.
    assert planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, 1, 2, "both") == {}
    assert planner.tsp_vocab_bytes_by_op(m, 12, 1, 4, 2, "forward")["all_to_all"] == 3 * 12 / 16 * 16 * 2
    with pytest.raises(ValueError, match="direction"):
        planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, 2, 2, "sideways")


def test_step_bytes_by_op():
    m, layers = _shape(layers=3), 3
    layer = planner.tsp_bytes_by_op(m, SEQ, BATCH, 2, 2, "both")
    vocab = planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, 2, 2, "both")
    # all_reduce at D=2 receives each tensor's bytes once: the fp32 loss and 2L + 1 norms of H, bf16.
    folded = planner.tsp_step_bytes_by_op(m, SEQ, BATCH, 2, 2)
    assert folded == {**{op: layers * v for op, v in layer.items()}, "ring": layers * layer["ring"] + vocab["ring"],
                      "all_to_all": vocab["all_to_all"], "all_reduce": 4 + 7 * HIDDEN * 2}
    replicated = planner.tsp_step_bytes_by_op(m, SEQ, BATCH, 2, 2, vocab_parallel=False)
    assert replicated == {**{op: layers * v for op, v in layer.items()},
                          "all_reduce": 4 + (7 * HIDDEN + 2 * 61 * HIDDEN) * 2}
    # Checkpointing runs each layer's forward again; the vocabulary is outside the layers.
    ckpt = planner.tsp_step_bytes_by_op(m, SEQ, BATCH, 2, 2, activation_checkpointing=True)
    forward = planner.tsp_bytes_by_op(m, SEQ, BATCH, 2, 2, "forward")
    assert ckpt["all_gather"] == layers * (layer["all_gather"] + forward["all_gather"])
    assert ckpt["all_to_all"] == folded["all_to_all"]
    # Tied: one matrix all-reduced unfolded; folded, the ring still moves the one shard.
    tied = {**m, "tie_word_embeddings": True}
    assert planner.tsp_step_bytes_by_op(tied, SEQ, BATCH, 2, 2, vocab_parallel=False)["all_reduce"] == \
        4 + (7 * HIDDEN + 61 * HIDDEN) * 2
    assert planner.tsp_step_bytes_by_op(tied, SEQ, BATCH, 2, 2) == folded
    # comm.all_reduce counts 2(D-1)n // D per tensor: at D=3 the fp32 loss is 5 bytes (not 16/3) and each of
    # the 3 norms 42 (not 128/3), 131 in all where one sum over the tensors would give 133.
    assert planner.tsp_step_bytes_by_op({**_shape(6, 3), "intermediate_size": 33}, 12, 1, 3, 2)["all_reduce"] == \
        5 + 3 * (2 * 2 * HIDDEN * 2 // 3) == 131


def test_logits_tile_tokens():
    # 32 MiB of fp32 logits over Vs = 16032 (llama3's 128256 over 8) rows: 523 tokens; capped by the local tokens.
    assert planner.logits_tile_tokens(16032, 16384) == 33554432 // (4 * 16032) == 523
    assert planner.logits_tile_tokens(16032, 100) == 100
    assert planner.logits_tile_tokens(16032, 16384, logits_tile_mib=0.01) == 1
    assert planner.logits_tile_tokens(16, 1000, logits_tile_mib=0.5) == 1000
    assert planner.logits_tile_tokens(16, 10000, logits_tile_mib=0.5) == 2**19 // 64


def test_folded_vocabulary_fits_llama3_8b_at_128k():
    # Issue #12: ds-tsp plan --model llama3-8b --seq-len 128K --devices 8 --activation-checkpointing
    # --zero-stage 1. With the embedding and LM head whole TSP needed 71.6 GB by the count, most of it
    # the vocabulary's: 12.6 GB of logits, 21.0 GB of loss backward, 16 B x 1.05B embedding + head parameters.
    # The loss backward runs before any gradient exists, so it overlaps the 3.9 GB of gradients: 67.7 GB.
    plans = {p.name: p for p in planner.plan("llama3-8b", 128 * 1024, 1, 8, "bf16", zero_stage=1,
                                             activation_checkpointing=True)}
    replicated, folded = plans["TSP(8) replicated vocab"], plans["TSP(8)"]
    assert f"{replicated.total / planner.GB:.1f}" == "67.7"
    assert f"{(replicated.total + replicated.memory['grads']) / planner.GB:.1f}" == "71.6"
    assert replicated.memory["logits"] == 16384 * (2 * 128256 + 8 + 4 * 128256) + 4
    assert folded.total <= 30 * planner.GB
    H, L, Vs, N = 4096, 32, 16032, 16384
    blocks = L * (4096 * 48 * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336) // 8
    assert folded.memory["weights"] + folded.memory["grads"] + folded.memory["optimizer"] == \
        16 * (blocks + L * 2 * H + H + 2 * Vs * H)
    assert folded.memory["logits"] == N * (8 + 4) and folded.detail["logits_output"] == 0
    assert folded.detail["logits_tiles"] == 3 * 523 * Vs * 4
    assert folded.detail["grad_hidden"] == N * H * 4
    assert folded.detail["head_shards_in_flight"] == 2 * Vs * H * 2
    assert folded.detail["head_grad_accumulators"] == 4 * Vs * H * 4
    assert folded.detail["embedding_backward"] == 2 * N * H * 2 + Vs * H * (4 + 2)
    assert folded.memory["activations"] == replicated.memory["activations"] + N * 8
    # What is left: model states ~16.1 GB (the fp32 master weights and Adam moments, 12 GB, with nothing for
    # ZeRO to partition), 7.2 GB of checkpointed layer inputs and one layer's saved tensors, and a transient
    # that one layer's backward now sets rather than the loss (1.83 against the head's 1.68 GB).
    loss = sum(folded.detail[k] for k in planner.HEAD_BACKWARD)
    assert folded.memory["transient"] > loss > folded.detail["embedding_backward"]
    # Per step, the head ring (7 hops of the shard forward, 7 of it and of its fp32 accumulator backward)
    # receives what the all-reduce of the whole embedding and head gradients did, 2 x 2 (D-1)/D V H bf16,
    # as V = 8 Vs and 2 + 2 + 4 = 4 x 2 bytes; the embedding all-to-all, 2 x 7/8 N H bf16, is the extra.
    steps = {vocab: planner.tsp_step_bytes_by_op("llama3-8b", 128 * 1024, 1, 8, 2, vocab_parallel=vocab,
                                                 activation_checkpointing=True) for vocab in (True, False)}
    assert steps[True]["all_to_all"] == 2 * 7 * N // 8 * H * 2
    assert steps[True]["ring"] - steps[False]["ring"] == 7 * Vs * H * (2 + 2 + 4) == \
        steps[False]["all_reduce"] - steps[True]["all_reduce"] == 2 * 2 * 7 * 128256 * H * 2 // 8
    assert folded.comm_per_step == sum(steps[True].values())
    assert replicated.comm_per_step == sum(steps[False].values())


def test_tsp_shape_rules_are_the_attention_modules():
    for num_heads in (4, 6, 8, 12):
        for num_kv_heads in (1, 2, 3, 4, 6):
            for D in (1, 2, 3, 4, 8):
                try:
                    HeadGroups(num_heads, num_kv_heads, HEAD_DIM, D)
                    refused = False
                except ValueError:
                    refused = True
                m = planner.model_shape({**_shape(num_heads, num_kv_heads), "intermediate_size": 24 * D})
                assert (planner.tsp_shape_problem(m, D) is not None) == refused, (num_heads, num_kv_heads, D)


def _saved_bytes(params, run):
    """Bytes of the storages autograd saves for backward while ``run()`` runs, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in params}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(saved.values())


def _counted_layer(num_heads, num_kv_heads, dtype, bias):
    """One decoder layer's two TSP blocks on every rank of the world: bytes
    received per op (forward, backward) and bytes saved for backward."""
    group, rank, D = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    attn = TSPAttention(HIDDEN, num_heads, num_kv_heads, HEAD_DIM, group, qkv_bias=bias, backend="sdpa", dtype=dtype)
    with torch.no_grad():
        attn.packed.normal_(0, 0.3)
    mlp = TSPGatedMLP(HIDDEN, INTER, nn.SiLU(), group, bias=bias, dtype=dtype)
    x = torch.randn(BATCH, SEQ // D, HIDDEN, dtype=dtype, requires_grad=True)
    cos, sin = torch.randn(2, BATCH, SEQ // D, HEAD_DIM, dtype=dtype)
    comm.counter.reset()
    y, saved = _saved_bytes([*attn.parameters(), *mlp.parameters()], lambda: mlp(attn(x, (cos, sin))))
    forward = {op: c["received"] for op, c in comm.counter.snapshot().items()}
    y.backward(torch.ones_like(y))
    total = {op: c["received"] for op, c in comm.counter.snapshot().items()}
    return rank, forward, {op: total[op] - forward.get(op, 0) for op in total}, saved


def test_tsp_bytes_equal_what_the_code_counts(run_ranks):
    # Two ranks keep the test quick; nkv=1 < D covers a rank that holds the
    # key/value head and one that does not, nkv=2 equal shards. D=4 is
    # checked above against the formulas tests/test_attention.py and
    # tests/test_mlp.py assert on the code's counters.
    D = 2
    for num_heads, num_kv_heads, dtype, bias in [(4, 2, torch.bfloat16, False), (8, 1, torch.float64, True)]:
        m, e = _shape(num_heads, num_kv_heads, bias), dtype.itemsize
        for rank, forward, backward, saved in run_ranks(D, _counted_layer, num_heads=num_heads,
                                                        num_kv_heads=num_kv_heads, dtype=dtype, bias=bias):
            planned = {d: planner.tsp_bytes_by_op(m, SEQ, BATCH, D, e, d, tsp_rank=rank)
                       for d in ("forward", "backward")}
            print(f"D={D} nq={num_heads} nkv={num_kv_heads} {dtype} rank {rank}: counted forward "
                  f"{sum(forward.values())} B, backward {sum(backward.values())} B; planned "
                  f"{planner.tsp_bytes_per_layer(m, SEQ, BATCH, D, e, 'forward', rank)} / "
                  f"{planner.tsp_bytes_per_layer(m, SEQ, BATCH, D, e, 'backward', rank)} B")
            assert forward == planned["forward"]
            assert backward == planned["backward"]
            # Saved for backward, 1/D of the sequence: the local tokens' x (attention, MLP), q, k, v, cos/sin,
            # the fused attention backward's output and fp32 (or wider) log-sum-exp, and the MLP's gate/up.
            tokens = BATCH * SEQ // D
            assert saved == tokens * (e * (2 * HIDDEN + (2 * num_heads + 2 * num_kv_heads) * HEAD_DIM + 2 * HEAD_DIM
                                           + 2 * INTER) + max(e, 4) * num_heads)
        # Guard: sums in the model dtype (bf16) would count differently from the fp32 the code uses.
        if dtype == torch.bfloat16:
            fp32_sums = planner.tsp_bytes_by_op(m, SEQ, BATCH, D, e, "backward", tsp_rank=rank)
            same_dtype = {**fp32_sums, "reduce": fp32_sums["reduce"] // 2, "ring": fp32_sums["ring"] * 2 // 3}
            assert backward == fp32_sums != same_dtype


def _counted_model_steps(cases):
    """Bytes this rank receives per ``comm`` op in one training step (forward and
    backward with labels) of a tiny injected model, for each ``(arch, dtype,
    vocab_parallel, checkpointing)``, with the embedding rows one batch exchanges:
    (this rank's local ids owned elsewhere, the other ranks' ids owned here)."""
    from ds_tsp import inject, layout
    from ds_tsp.config import TSPConfig
    from ds_tsp.topology import TSPTopology
    from models import tiny_model

    D, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for arch, dtype, vocab_parallel, checkpointing in cases:
        # check_batch "never": the first forward's batch check is not a step's traffic.
        model = inject(tiny_model(arch, dtype=dtype), TSPTopology(D),
                       TSPConfig(enabled=True, size=D, attention_backend="sdpa", vocab_parallel=vocab_parallel,
                                 check_batch="never"))
        if checkpointing:
            model.train()
            model.activation_checkpointing_enable()
        torch.manual_seed(3)  # the same batch on every rank
        input_ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
        owners = torch.stack([layout.shard(input_ids, j, D, "zigzag") for j in range(D)]).flatten(1) // \
            planner.vocab_rows_per_rank(model.config.vocab_size, D)  # (D, N)
        rows = (int((owners[rank] != rank).sum()), int((owners[torch.arange(D) != rank] == rank).sum()))
        comm.counter.reset()
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        results.append(({op: c["received"] for op, c in comm.counter.snapshot().items()}, rows))
    return results


def test_step_bytes_equal_what_the_model_counts(run_ranks):
    # The whole model at D=2: layers, embedding all-to-all, head ring, the loss and the gradients of
    # what every rank holds whole, against tsp_step_bytes_by_op with the batch's exact embedding rows.
    from models import tiny_config

    cases = [("llama", torch.float64, True, False), ("llama", torch.float64, False, False),
             ("llama_tied", torch.bfloat16, True, False), ("llama_tied", torch.bfloat16, False, False),
             ("llama", torch.bfloat16, True, True)]
    per_rank = run_ranks(2, _counted_model_steps, cases=cases)
    for rank, per_case in enumerate(per_rank):
        for (arch, dtype, vocab_parallel, checkpointing), (counted, rows) in zip(cases, per_case):
            planned = planner.tsp_step_bytes_by_op(tiny_config(arch).to_dict(), SEQ, BATCH, 2, dtype.itemsize,
                                                   vocab_parallel=vocab_parallel,
                                                   activation_checkpointing=checkpointing, tsp_rank=rank,
                                                   rows_exchanged=rows)
            print(f"{arch} {dtype} vocab_parallel={vocab_parallel} checkpointing={checkpointing} rank {rank}: "
                  f"counted {counted}, planned {planned}")
            assert {op: v for op, v in counted.items() if op != "barrier"} == planned
    # Guard: this batch's rows are not the expected (D-1)/D, so the exact counts are what matched.
    expected = planner.tsp_vocab_bytes_by_op(tiny_config("llama").to_dict(), SEQ, BATCH, 2, 8, "both")
    assert per_rank[0][0][0]["all_to_all"] != expected["all_to_all"]


def _tsp_model_saved(tsp_size, dtype, arch="llama", vocab_parallel=True):
    from ds_tsp import inject
    from ds_tsp.config import TSPConfig
    from ds_tsp.topology import TSPTopology
    from models import tiny_model

    model = inject(tiny_model(arch, dtype=dtype), TSPTopology(tsp_size),
                   TSPConfig(enabled=True, size=tsp_size, attention_backend="sdpa", vocab_parallel=vocab_parallel))
    input_ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    return _saved_bytes(model.parameters(), lambda: model(input_ids=input_ids, labels=input_ids))[1]


def _planned(name, devices, dtype, arch="llama"):
    from models import tiny_config

    return {p.name: p for p in planner.plan(tiny_config(arch).to_dict(), SEQ, BATCH, devices, dtype)}[name]


@pytest.mark.parametrize("dtype, name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_saved_activations_equal_the_models(dtype, name):
    from models import tiny_model

    # The whole TSP model (embedding, layers, final norm, LM head, loss), one rank. Mistral's sliding
    # window takes the attention backward that recomputes instead of saving the output and lse. The
    # folded vocabulary saves no embedding ids and no log-probs, only the loss's labels and fp32 lse.
    for arch, vocab_parallel in (("llama", True), ("llama", False), ("mistral", True)):
        measured = _tsp_model_saved(1, dtype, arch, vocab_parallel)
        plan_name = planner.tsp_name(1, vocab_parallel)
        planned = _planned(plan_name, 1, name, arch).detail["saved_for_backward"]
        print(f"{plan_name} {arch} {name}: saved {measured} B, planned {planned:.0f} B")
        assert measured == planned
    # The baselines' count is the Hugging Face layer's: the unsharded model.
    hf = tiny_model("llama", dtype=dtype)
    input_ids = torch.randint(0, hf.config.vocab_size, (BATCH, SEQ))
    measured = _saved_bytes(hf.parameters(), lambda: hf(input_ids=input_ids, labels=input_ids))[1]
    planned = _planned("DP(1)", 1, name).detail["saved_for_backward"]
    print(f"HF {name}: saved {measured} B, planned {planned:.0f} B")
    assert measured == planned


def test_memory_breakdown_and_model_states():
    plans = planner.plan("llama-7b", 4096, 2, 8, "bf16")
    m = planner.model_shape("llama-7b")
    assert m.params == 32 * (4 * 4096 ** 2 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 32000 * 4096 + 4096
    for p in plans:
        assert set(p.memory) == set(planner.MEMORY_PARTS)
        assert all(v >= 0 for v in p.memory.values())
        assert p.total == pytest.approx(sum(p.memory.values()))
    by_name = {p.name: p for p in plans}
    assert by_name["DP(8)"].memory["weights"] + by_name["DP(8)"].memory["grads"] + \
        by_name["DP(8)"].memory["optimizer"] == 16 * m.params
    # TSP: 1/8 of every block, norms whole; embedding and LM head whole, or 32000/8 rows of each when folded.
    blocks = 32 * (4 * 4096 ** 2 + 3 * 4096 * 11008) / 8
    norms = 32 * 2 * 4096 + 4096
    tsp = by_name["TSP(8) replicated vocab"]
    assert tsp.memory["weights"] == 2 * (blocks + norms + 2 * 32000 * 4096)
    assert tsp.memory["optimizer"] == 6 * tsp.memory["weights"]
    folded = by_name["TSP(8)"]
    assert folded.memory["weights"] == 2 * (blocks + norms + 2 * 4000 * 4096)
    assert folded.memory["optimizer"] == 6 * folded.memory["weights"]
    # Same blocks; the folded embedding keeps its route (two int64 a token) instead of the ids, and the
    # folded loss saves labels and fp32 lse, no logits.
    assert folded.memory["activations"] == tsp.memory["activations"] + 2 * 4096 / 8 * 8
    assert folded.memory["logits"] == 2 * 4096 / 8 * (8 + 4)
    # Checkpointing: every layer keeps only its input, (B, S/D, H) bf16, plus one layer recomputed.
    ckpt = {p.name: p for p in planner.plan("llama-7b", 4096, 2, 8, "bf16", activation_checkpointing=True)}
    tokens = 2 * 4096 / 8
    # norms, x twice, q/k/v, (fused attention backward) the output and fp32 lse of 32 heads, MLP gate/up
    per_layer = 2 * (4 * 4096 + 4 + 2 * 4096) + 2 * 2 * 4096 + 2 * 3 * 4096 + 2 * 4096 + 4 * 32 + 2 * 2 * 11008
    assert tsp.memory["activations"] - ckpt["TSP(8) replicated vocab"].memory["activations"] == \
        pytest.approx(32 * tokens * per_layer - (32 * tokens * 2 * 4096 + tokens * per_layer))
    # ZeRO partitions over DP (and the sequence axis of SP), never inside TSP or TP.
    zero = {p.name: p for p in planner.plan("llama-7b", 4096, 2, 8, "bf16", zero_stage=3)}
    assert zero["DP(8)"].memory["optimizer"] == by_name["DP(8)"].memory["optimizer"] / 8
    assert zero["SP-Ulysses(8)"].memory["weights"] == by_name["SP-Ulysses(8)"].memory["weights"] / 8
    assert zero["TSP(8)"].memory["optimizer"] == folded.memory["optimizer"]
    assert zero["TSP(8) replicated vocab"].memory["optimizer"] == tsp.memory["optimizer"]


def test_flops_and_step_communication():
    m = planner.model_shape(_shape(layers=2))
    plans = {p.name: p for p in planner.plan(_shape(layers=2), SEQ, BATCH, 2, "bf16")}
    T, wa, wm = BATCH * SEQ, 768, 1536
    attn = 2 * BATCH * SEQ ** 2 * 4 * HEAD_DIM
    head = 2 * T * 61 * HIDDEN
    dense = 2 * (2 * T * (wa + wm) + attn) + head  # forward
    dense += 2 * (4 * T * (wa + wm) + 2.5 * attn) + 2 * head  # backward
    assert plans["DP(2)"].flops_per_step == pytest.approx(dense)
    assert plans["TP(2)"].flops_per_step == pytest.approx(dense / 2)
    # TSP does the dense work, split over its ranks; with flash-attn (no fused
    # backward) it runs the attention forward again in backward. The folded
    # vocabulary's fused loss recomputes the logits in backward: the head forward once more.
    assert plans["TSP(2) replicated vocab"].flops_per_step == pytest.approx(dense / 2)
    assert plans["TSP(2)"].flops_per_step == pytest.approx((dense + head) / 2)
    recompute = {p.name: p for p in planner.plan(_shape(layers=2), SEQ, BATCH, 2, "bf16",
                                                 tsp_attention_backward="recompute")}
    assert recompute["TSP(2) replicated vocab"].flops_per_step == pytest.approx((dense + 2 * attn) / 2)
    # Per step: 2 layers' forward + backward, then the loss (one fp32 scalar) and the gradients of what every
    # rank holds whole all-reduced, 2(D-1)/D of them (bf16): norms, and unfolded the embedding and the head.
    norms = 2 * 2 * HIDDEN + HIDDEN
    tsp = plans["TSP(2) replicated vocab"]
    layers = 2 * (tsp.comm_forward_per_layer + tsp.comm_backward_per_layer)
    assert tsp.comm_per_step == layers + 4 + (norms + 2 * 61 * HIDDEN) * 2
    # Folded (Vs = 31 rows): embedding all-to-all 1/2 of the 16 local tokens' rows, forward and backward;
    # head ring 1 hop of the shard forward, 1 hop of it and of its fp32 accumulator backward.
    folded = plans["TSP(2)"]
    assert folded.comm_forward_per_layer == tsp.comm_forward_per_layer
    assert folded.comm_per_step == layers + 4 + norms * 2 + 2 * 8 * HIDDEN * 2 + 31 * HIDDEN * (2 + 2 + 4)
    assert m.num_layers == 2


def _paper_plans(checkpointing=True):
    return {p.name: p for p in planner.plan("llama-7b", 131072, 1, 8, "bf16", activation_checkpointing=checkpointing)}


def test_paper_ordering_tsp_below_tp_below_tp_sp():
    plans = _paper_plans()
    # The paper's TSP folds attention and the MLP only: its peak is set beside the replicated vocabulary.
    for tsp in ("TSP(8)", "TSP(8) replicated vocab"):
        assert plans[tsp].total < plans["TP(8)"].total < plans["TP+SP(2x4)"].total < plans["SP-Ulysses(8)"].total
    # Each estimate within the measured peak's reach: below it (tensors only), not by more than 30%.
    for name, gb in planner.PAPER_PEAK_GB.items():
        assert 0.7 < plans[name].total / (gb * planner.GB) < 1.05, name
    # Without checkpointing TP alone would not fit an MI300X: the paper must checkpoint.
    assert _paper_plans(False)["TP(8)"].total > planner.PAPER_DEVICE_GB * planner.GB
    # TSP per layer, forward: 7/8 of (Wa + Wm + 2*S*nkv*d) bf16 elements.
    assert plans["TSP(8)"].comm_forward_per_layer == \
        7 * (4 * 4096 ** 2 + 3 * 4096 * 11008 + 2 * 131072 * 32 * 128) // 8 * 2


def test_recommend_filters_by_memory():
    plans = list(_paper_plans().values())
    fits = planner.recommend(plans, 80 * planner.GB)
    assert {p.name for p in fits} == {p.name for p in plans if p.total <= 80 * planner.GB}
    assert "TSP(8)" in {p.name for p in fits} and "SP-Ulysses(8)" not in {p.name for p in fits}
    per_flop = [p.comm_per_step / p.flops_per_step for p in fits]
    assert per_flop == sorted(per_flop)
    assert planner.recommend(plans, 1 * planner.GB) == []
    # An infeasible layout is never recommended: 32 heads do not split over 3.
    odd = planner.plan("llama-7b", 4096, 1, 3, "bf16")
    assert not {p.name: p for p in odd}["TSP(3)"].feasible
    assert "TSP(3)" not in {p.name for p in planner.recommend(odd, 1e15)}


def test_table_renders_with_the_paper_column():
    plans = list(_paper_plans().values())
    table = planner.format_table(plans, planner.PAPER_PEAK_GB)
    lines = table.splitlines()
    assert lines[0].count("|") == lines[2].count("|") and len([line for line in lines if line.startswith("| ")]) \
        == len(plans) + 1
    for name in ("TSP(8)", "TSP(8) replicated vocab", "TP(8)", "TP+SP(2x4)", "TP+SP(4x2)", "SP-Ulysses(8)",
                 "CP-allgather(8)", "DP(8)"):
        assert f"| {name} |" in table
    for gb in ("38.8", "70.0", "85.0", "140.0"):
        assert gb in table
    assert "reproduced" in table and "NOT reproduced" not in table
    assert "activation checkpointing" in table
    assert "paper" not in planner.format_table(plans).lower()


def test_plot_file_written(tmp_path):
    path = tmp_path / "memory.png"
    planner.plot_memory_vs_seq("llama-7b", [8192, 32768, 131072], 8, path, memory_per_device_bytes=192e9)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_from_config_object_dict_and_directory(tmp_path):
    preset = planner.model_shape("llama-7b")
    fields = dict(planner.PRESETS["llama-7b"])
    (tmp_path / "config.json").write_text(json.dumps(fields))
    shapes = [planner.model_shape(source) for source in (str(tmp_path), str(tmp_path / "config.json"), fields)]
    assert len({replace(shape, name="") for shape in shapes}) == 1 and shapes[0].name == tmp_path.name
    assert planner.model_shape(fields).params == preset.params
    from models import tiny_config

    hf = planner.model_shape(tiny_config("llama_tied"))
    assert (hf.head_dim, hf.num_kv_heads, hf.tie_word_embeddings) == (4, 2, True)
    with pytest.raises(ValueError, match="neither a preset"):
        planner.model_shape("no-such-model")


def test_cli(tmp_path):
    parser = planner.add_plan_arguments(argparse.ArgumentParser())
    out = io.StringIO()
    args = parser.parse_args(["--seq-len", "128K", "--paper", "--memory-gb", "80", "--plot", str(tmp_path / "m.png")])
    assert planner.run_plan(args, out=out) == 0
    text = out.getvalue()
    assert "| TSP(8) |" in text and "| TSP(8) replicated vocab |" in text and "Recommended:" in text
    assert (tmp_path / "m.png").exists()
    # A smaller logits tile changes only the folded loss backward's tiles.
    out = io.StringIO()
    assert planner.run_plan(parser.parse_args(["--seq-len", "4K", "--logits-tile-mib", "0.5"]), out=out) == 0
    assert "0.5 MiB fp32 logits tiles" in out.getvalue()
    with pytest.raises(SystemExit):
        parser.parse_args(["--logits-tile-mib", "0"])
    assert planner.run_plan(parser.parse_args(["--model", "no-such-model"]), out=io.StringIO()) == 1
