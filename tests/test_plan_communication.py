"""The planner's bytes received per TSP rank (ds_tsp.planning.communication)
against hand-computed values and against what ds_tsp itself counts
(comm.counter bytes), per layer and per training step, dense and MoE."""

from unittest import mock

import dataclasses
import pytest
import torch
import torch.distributed as dist
from torch import nn

from ds_tsp.parallel import comm
from ds_tsp import planning as planner
from ds_tsp.blocks.attention.module import TSPAttention
from ds_tsp.blocks.attention.head_groups import HeadGroups
from ds_tsp.blocks.mlp import TSPGatedMLP
from plan_helpers import (BATCH, HEAD_DIM, HIDDEN, INTER, SEQ, saved_bytes, tiny_hybrid_shape, tiny_moe_shape,
                          tiny_shape)

# Rank bodies live in this module, so every spawned rank imports it: what needs
# DeepSpeed (topology, config) or the Hugging Face model classes is imported
# inside the tests that use it, keeping the ranks' start-up short.


def test_tsp_layer_bytes_by_hand():
    # Wa = 16*(4 + 2*2)*4 + 4*4*16 = 768, Wm = 3*16*32 = 1536, K/V = 2*B*S*nkv*d = 512 elements.
    # bf16: 2 B per element moved; gradient reduces and ring accumulators in fp32 (4 B).
    m = tiny_shape()
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
    # communication_data_type "bf16": the reduce and the accumulator hops in 2 B, the rest as it was;
    # a float64 model keeps its 8 B sums whatever the wire setting.
    assert planner.tsp_bytes_by_op(m, SEQ, BATCH, 4, 2, "both", tsp_rank=1, grad_wire_bytes=2) == {
        "broadcast": 2 * 640 * 2, "ring": 1152 * (2 + 2 + 2), "all_gather": 2 * 384 * 2, "reduce": 3 * 128 * 2,
        "reduce_scatter": 384 * 2}
    # float32, rank 0: forward 2048 elements, reduce 3*256 and accumulators 1152 in 2 B, dK/dV 384 in 4 B.
    assert planner.tsp_bytes_per_layer(m, SEQ, BATCH, 4, 4, "backward", tsp_rank=0, grad_wire_bytes=2) == \
        2048 * 4 + (768 + 1152) * 2 + 384 * 4
    assert planner.tsp_bytes_by_op(m, SEQ, BATCH, 4, 8, "both", grad_wire_bytes=2) == \
        planner.tsp_bytes_by_op(m, SEQ, BATCH, 4, 8, "both")
    # The design formula of DESIGN.md section 8, where every shard is equal.
    for D in (2, 4):
        wa, wm = 768, 1536
        assert planner.tsp_bytes_per_layer(tiny_shape(4, 4), SEQ, BATCH, D, 2, "forward") == \
            (D - 1) * (wa + 256 + wm + 2 * BATCH * SEQ * 4 * HEAD_DIM) // D * 2


@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1])
def test_attention_bytes_match_the_attention_tests_formula(num_kv_heads):
    # tests/test_attention.py::test_bytes_equal_the_design_formula, float64, nq=8, S=16, B=2.
    nq, elem = 8, 8
    wa = HIDDEN * (nq + 2 * num_kv_heads) * HEAD_DIM + nq * HEAD_DIM * HIDDEN
    m = tiny_shape(nq, num_kv_heads)
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
        ops = planner.tsp_bytes_by_op(tiny_shape(bias=bias), 24, BATCH, D, element, "both")
        assert ops["ring"] == 2 * weight_hops + (D - 1) * sharded // D * accumulator


def test_vocab_bytes_by_hand():
    # V=61 over D=2: Vs = 31 rows of H=16 per rank (row 61 is padding). B*S/D = 16 local tokens, bf16.
    m = tiny_shape()
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
    # float32 with a bf16 gradient wire: the shard in 4 B, its accumulator in 2 B.
    assert planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, 2, 4, "backward", grad_wire_bytes=2)["ring"] == 31 * 16 * 6
    # Nothing moves at D=1; the expected rows are fractional where D*D does not divide B*S.
    assert planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, 1, 2, "both") == {}
    assert planner.tsp_vocab_bytes_by_op(m, 12, 1, 4, 2, "forward")["all_to_all"] == 3 * 12 / 16 * 16 * 2
    with pytest.raises(ValueError, match="direction"):
        planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, 2, 2, "sideways")


def test_step_bytes_by_op():
    m, layers = tiny_shape(layers=3), 3
    layer = planner.tsp_bytes_by_op(m, SEQ, BATCH, 2, 2, "both")
    vocab = planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, 2, 2, "both")
    # all_reduce at D=2 receives each tensor's bytes once: the fp32 loss and 2L + 1 norms of H, bf16; the
    # batch check (tsp.check_batch "always") the other rank's fingerprint, 4 tensors x 4 int64.
    folded = planner.tsp_step_bytes_by_op(m, SEQ, BATCH, 2, 2)
    assert folded == {**{op: layers * v for op, v in layer.items()}, "ring": layers * layer["ring"] + vocab["ring"],
                      "all_to_all": vocab["all_to_all"], "all_reduce": 4 + 7 * HIDDEN * 2, "batch_check": 128}
    replicated = planner.tsp_step_bytes_by_op(m, SEQ, BATCH, 2, 2, vocab_parallel=False)
    assert replicated == {**{op: layers * v for op, v in layer.items()},
                          "all_reduce": 4 + (7 * HIDDEN + 2 * 61 * HIDDEN) * 2, "batch_check": 128}
    assert planner.tsp_step_bytes_by_op(m, SEQ, BATCH, 4, 2, check_batch="first").keys() == \
        planner.tsp_step_bytes_by_op(m, SEQ, BATCH, 4, 2).keys() - {"batch_check"}
    assert planner.tsp_step_bytes_by_op(m, SEQ, BATCH, 4, 2)["batch_check"] == 3 * 128
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
    assert planner.tsp_step_bytes_by_op({**tiny_shape(6, 3), "intermediate_size": 33}, 12, 1, 3, 2)["all_reduce"] == \
        5 + 3 * (2 * 2 * HIDDEN * 2 // 3) == 131


def _counted_layer(num_heads, num_kv_heads, dtype, bias, grad_wire_dtype=None):
    """One decoder layer's two TSP blocks on every rank of the world: bytes
    received per op (forward, backward) and bytes saved for backward."""
    group, rank, D = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    attn = TSPAttention(HIDDEN, num_heads, num_kv_heads, HEAD_DIM, group, qkv_bias=bias, backend="sdpa", dtype=dtype)
    with torch.no_grad():
        attn.packed.normal_(0, 0.3)
    mlp = TSPGatedMLP(HIDDEN, INTER, nn.SiLU(), group, bias=bias, dtype=dtype)
    attn.grad_wire_dtype = mlp.grad_wire_dtype = grad_wire_dtype
    x = torch.randn(BATCH, SEQ // D, HIDDEN, dtype=dtype, requires_grad=True)
    cos, sin = torch.randn(2, BATCH, SEQ // D, HEAD_DIM, dtype=dtype)
    comm.counter.reset()
    y, saved = saved_bytes([*attn.parameters(), *mlp.parameters()], lambda: mlp(attn(x, (cos, sin))))
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
        m, e = tiny_shape(num_heads, num_kv_heads, bias), dtype.itemsize
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
            # Saved for backward, 1/D of the sequence: the local tokens' x (attention, MLP), their q, k and v
            # projections, cos/sin, the fused attention backward's output and fp32 (or wider) log-sum-exp, and
            # the MLP's gate/up (the local tokens fit one tile: nothing is projected again in backward).
            tokens = BATCH * SEQ // D
            qkv = (num_heads + 2 * num_kv_heads) * HEAD_DIM
            assert saved == tokens * (e * (2 * HIDDEN + qkv + num_heads * HEAD_DIM + 2 * HEAD_DIM
                                           + 2 * INTER) + max(e, 4) * num_heads)
        # Guard: sums in the model dtype (bf16) would count differently from the fp32 the code uses.
        if dtype == torch.bfloat16:
            fp32_sums = planner.tsp_bytes_by_op(m, SEQ, BATCH, D, e, "backward", tsp_rank=rank)
            same_dtype = {**fp32_sums, "reduce": fp32_sums["reduce"] // 2, "ring": fp32_sums["ring"] * 2 // 3}
            assert backward == fp32_sums != same_dtype


def _counted_model_steps(cases, grad_wire_dtype=None):
    """Bytes this rank receives per ``comm`` op in one training step (forward and
    backward with labels) of a tiny injected model, for each ``(arch, dtype,
    vocab_parallel, checkpointing)``, with the embedding rows one batch exchanges:
    (this rank's local ids owned elsewhere, the other ranks' ids owned here)."""
    from ds_tsp import inject
    from ds_tsp.parallel import layout
    from ds_tsp.config import TSPConfig
    from ds_tsp.runtime.engine import set_grad_wire_dtype
    from ds_tsp.parallel.topology import TSPTopology
    from models import tiny_model

    D, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for arch, dtype, vocab_parallel, checkpointing in cases:
        # The default check_batch "always": every step's batch check is planned too. The expert ring, whose
        # bytes do not depend on the routing (the all-to-all's are checked in test_moe.py).
        model = inject(tiny_model(arch, dtype=dtype), TSPTopology(D),
                       TSPConfig(enabled=True, size=D, attention_backend="sdpa", vocab_parallel=vocab_parallel,
                                 moe_schedule="ring"))
        set_grad_wire_dtype(model, grad_wire_dtype)
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


def _check_counted_steps(D, cases, per_rank):
    """Every rank's counted bytes per op (``_counted_model_steps``) equal ``tsp_step_bytes_by_op``'s."""
    from models import tiny_config

    for rank, per_case in enumerate(per_rank):
        for (arch, dtype, vocab_parallel, checkpointing), (counted, rows) in zip(cases, per_case):
            planned = planner.tsp_step_bytes_by_op(tiny_config(arch).to_dict(), SEQ, BATCH, D, dtype.itemsize,
                                                   vocab_parallel=vocab_parallel,
                                                   activation_checkpointing=checkpointing, tsp_rank=rank,
                                                   rows_exchanged=rows)
            print(f"D={D} {arch} {dtype} vocab_parallel={vocab_parallel} checkpointing={checkpointing} "
                  f"rank {rank}: counted {counted}, planned {planned}")
            assert {op: v for op, v in counted.items() if op != "barrier"} == planned


def test_step_bytes_equal_what_the_model_counts(run_ranks):
    # The whole model at D=2: layers, embedding all-to-all, head ring, the loss and the gradients of
    # what every rank holds whole, against tsp_step_bytes_by_op with the batch's exact embedding rows.
    from models import tiny_config

    cases = [("llama", torch.float64, True, False), ("llama", torch.float64, False, False),
             ("llama_tied", torch.bfloat16, True, False), ("llama_tied", torch.bfloat16, False, False),
             ("llama", torch.bfloat16, True, True)]
    per_rank = run_ranks(2, _counted_model_steps, cases=cases)
    _check_counted_steps(2, cases, per_rank)
    # Guard: this batch's rows are not the expected (D-1)/D, so the exact counts are what matched.
    expected = planner.tsp_vocab_bytes_by_op(tiny_config("llama").to_dict(), SEQ, BATCH, 2, 8, "both")
    assert per_rank[0][0][0]["all_to_all"] != expected["all_to_all"]


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_layer_anatomy_step_bytes_equal_what_the_model_counts(run_ranks, tsp_size):
    """Issue 62's dense families, whose configs do not say what their layers hold (planning.anatomy reads it off
    Hugging Face's layer on the meta device): Nemotron's and Jais-2's ungated MLPs and layer norms with biases,
    GLM-4's four norms a layer, Cohere's one, ERNIE 4.5's biases on every projection (use_bias), Hunyuan's q/k
    norms; every op of a training step, per rank, against tsp_step_bytes_by_op."""
    dtype = torch.float64 if tsp_size == 2 else torch.bfloat16
    cases = [(arch, dtype, True, False)
             for arch in ("nemotron", "jais2", "glm4", "cohere", "cohere2", "ernie4_5", "hunyuan_v1_dense")]
    _check_counted_steps(tsp_size, cases, run_ranks(tsp_size, _counted_model_steps, cases=cases))


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_gemma4_step_bytes_equal_what_the_model_counts(run_ranks, tsp_size):
    """Gemma 4: sliding layers of 4-wide heads beside full layers of 8-wide heads with one key/value head whose
    keys are their values (ModelShape.mixer_view), and its experts beside every MLP (planned as an ungated
    shared expert: the same weights round a ring); every op of a training step, per rank, against
    tsp_step_bytes_by_op."""
    dtype = torch.float64 if tsp_size == 2 else torch.bfloat16
    cases = [("gemma4", dtype, True, False), ("gemma4_moe", dtype, True, False)]
    _check_counted_steps(tsp_size, cases, run_ranks(tsp_size, _counted_model_steps, cases=cases))


def test_gemma4_full_layers_are_what_makes_those_bytes_match():
    # Guard: planned with every layer as its sliding ones (no full-layer shape), Gemma 4's broadcast, shard
    # gradient reduce and q/k norms' all-reduce are planned otherwise (its K/V, 2 heads of 4 or 1 of 8 a token,
    # are as wide), so the bytes above matched the full layers' own shapes.
    from models import tiny_config

    m = planner.model_shape(tiny_config("gemma4").to_dict())
    uniform = dataclasses.replace(m, global_layers=0)
    with_full, without = (planner.tsp_step_bytes_by_op(shape, SEQ, BATCH, 2, 8) for shape in (m, uniform))
    print(f"Gemma 4 at D=2: with its full layers' shape {with_full}, every layer a sliding one's {without}")
    assert all(with_full[op] != without[op] for op in ("broadcast", "reduce", "all_reduce"))
    # One layer's bytes name its kind: the step is the sum of each kind's layers'.
    layers = {kind: planner.tsp_bytes_by_op(m, SEQ, BATCH, 2, 8, "both", mixer=kind)
              for kind in ("attention", "global_attention")}
    assert planner.tsp_layers_bytes_by_op(m, SEQ, BATCH, 2, 8, "both") == \
        {op: 2 * layers["attention"][op] + 2 * layers["global_attention"][op] for op in layers["attention"]}
    with pytest.raises(ValueError, match=r"attention layers of two shapes .*: say which with mixer="):
        planner.tsp_bytes_by_op(m, SEQ, BATCH, 2, 8, "both")


def test_the_layer_anatomy_is_what_makes_those_bytes_match():
    # Guard: from the config's fields alone (two norms, a gated MLP, no biases) Nemotron's ring and replicated
    # all-reduce are planned otherwise, so the counted bytes above matched what the meta layer said.
    from models import tiny_config

    fields = tiny_config("nemotron").to_dict()
    with_anatomy = planner.tsp_step_bytes_by_op(planner.model_shape(fields), SEQ, BATCH, 2, 8)
    with mock.patch("ds_tsp.planning.shapes.layer_anatomy", return_value={}):
        from_fields = planner.tsp_step_bytes_by_op(planner.model_shape(fields), SEQ, BATCH, 2, 8)
    print(f"Nemotron at D=2: with the layer's anatomy {with_anatomy}, from the config alone {from_fields}")
    assert with_anatomy["ring"] < from_fields["ring"] and with_anatomy["all_reduce"] > from_fields["all_reduce"]


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_issue62_mixtures_of_experts_step_bytes_equal_what_the_model_counts(run_ranks, tsp_size):
    """PhiMoE and Granite-MoE (Mixtral's kind: block_sparse_moe's too), Hunyuan-MoE (a shared MLP beside every
    MoE block), Cohere2-MoE and ERNIE 4.5-MoE (a dense first layer, shared experts, a frozen score-correction
    bias, which takes no gradient): every op of a training step, per rank, against tsp_step_bytes_by_op."""
    dtype = torch.float64 if tsp_size == 2 else torch.bfloat16
    cases = [(arch, dtype, True, False)
             for arch in ("phimoe", "granitemoe", "hunyuan_v1_moe", "cohere2_moe", "ernie4_5_moe")]
    _check_counted_steps(tsp_size, cases, run_ranks(tsp_size, _counted_model_steps, cases=cases))


def test_mixtures_of_experts_the_planner_does_not_model_are_refused():
    from models import tiny_config

    for arch in ("flint",):
        with pytest.raises(ValueError, match="the planner models the mixture-of-experts layers of"):
            planner.model_shape(tiny_config(arch).to_dict())


def test_latent_attention_step_bytes_equal_what_the_model_counts(run_ranks):
    """DeepSeek-V3's shape (latent attention, its down projections' rows uneven over 4 ranks) at D=4: every
    op of a training step, per rank, against tsp_step_bytes_by_op."""
    cases = [("deepseek_v3_dense", torch.float64, True, False), ("deepseek_v3_biased", torch.float64, True, False)]
    _check_counted_steps(4, cases, run_ranks(4, _counted_model_steps, cases=cases))


def test_bf16_wire_bytes_equal_what_the_code_counts(run_ranks):
    # communication_data_type "bf16": the weight-gradient reduce and the ring accumulators in a = 2 bytes an
    # element, op by op as the code counts, per layer (the attention's reduce, the MLP ring) and per step (the
    # LM head's ring too), at D = 2. A float64 model keeps float64: its bytes are the default formula's.
    D, wire = 2, torch.bfloat16
    for num_heads, num_kv_heads, dtype, bias in [(8, 1, torch.float32, True), (4, 2, torch.bfloat16, False),
                                                 (4, 2, torch.float64, False)]:
        m, e = tiny_shape(num_heads, num_kv_heads, bias), dtype.itemsize
        for rank, forward, backward, _ in run_ranks(D, _counted_layer, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                                    dtype=dtype, bias=bias, grad_wire_dtype=wire):
            planned = {d: planner.tsp_bytes_by_op(m, SEQ, BATCH, D, e, d, tsp_rank=rank, grad_wire_bytes=2)
                       for d in ("forward", "backward")}
            default = planner.tsp_bytes_by_op(m, SEQ, BATCH, D, e, "backward", tsp_rank=rank)
            print(f"nq={num_heads} nkv={num_kv_heads} {dtype} rank {rank}, bf16 wire: backward {backward}, "
                  f"fp32 wire's formula {default}")
            assert forward == planned["forward"]
            assert backward == planned["backward"]
            if dtype == torch.float32:  # the reduce and the accumulator hops exactly halved, nothing else
                weight_hops = default["ring"] // 2  # the ring's backward: (e + a) = (4 + 4) B an element
                assert backward == {**default, "reduce": default["reduce"] // 2,
                                    "ring": weight_hops + weight_hops // 2}
            if dtype == torch.float64:
                assert backward == default
    from models import tiny_config

    cases = [("llama", torch.float32, True, False), ("llama", torch.float64, True, False)]
    for rank, per_case in enumerate(run_ranks(D, _counted_model_steps, cases=cases, grad_wire_dtype=wire)):
        for (arch, dtype, vocab_parallel, checkpointing), (counted, rows) in zip(cases, per_case):
            planned = planner.tsp_step_bytes_by_op(tiny_config(arch).to_dict(), SEQ, BATCH, D, dtype.itemsize,
                                                   tsp_rank=rank, rows_exchanged=rows, grad_wire_bytes=2)
            print(f"{arch} {dtype} rank {rank}, bf16 wire: counted {counted}, planned {planned}")
            assert {op: v for op, v in counted.items() if op != "barrier"} == planned
            fp32_wire = planner.tsp_step_bytes_by_op(tiny_config(arch).to_dict(), SEQ, BATCH, D, dtype.itemsize,
                                                     tsp_rank=rank, rows_exchanged=rows)
            assert (planned == fp32_wire) == (dtype == torch.float64)


def test_moe_bytes_by_hand():
    m = tiny_moe_shape()
    # W = E/D * 3 H F_e + 3 H F_s / D elements a rank's packed shard: at D=2, 2*384 + 384 = 1152.
    # bf16 ring: forward (D-1) W * 2, backward (D-1) W (2 + 4).
    ring = planner.tsp_moe_bytes_by_op(m, SEQ, BATCH, 2, 2, "both")
    assert ring == {"ring": 1152 * 2 + 1152 * 6}
    assert planner.tsp_moe_bytes_by_op(m, SEQ, BATCH, 2, 2, "forward") == {"ring": 1152 * 2}
    # The layer: the attention's bytes and the expert ring in the MLP's place.
    dense = planner.tsp_bytes_by_op(m, SEQ, BATCH, 2, 2, "both", sparse=False)
    sparse = planner.tsp_bytes_by_op(m, SEQ, BATCH, 2, 2, "both", sparse=True)
    assert sparse == {**dense, "ring": ring["ring"]}
    # D=4: W = 1*384 + 192 = 576, 3 hops.
    assert planner.tsp_moe_bytes_by_op(m, SEQ, BATCH, 4, 4, "both") == {"ring": 3 * 576 * (4 + 4 + 4)}
    # The token all-to-all: N = B*S/D = 16 local tokens, k=2 copies of H=16 out and back, (D-1)/D of them
    # leave the rank: 2*2*16*16/2 = 512 elements each way; E/D = 2 int64 split sizes received; the shared
    # expert's (D-1)/D * 3 H F_s = 384 elements still on the ring. Backward: the gradients of both.
    a2a = planner.tsp_moe_bytes_by_op(m, SEQ, BATCH, 2, 2, "forward", "all_to_all")
    assert a2a == {"all_to_all": 512 * 2 + 16, "ring": 384 * 2}
    assert planner.tsp_moe_bytes_by_op(m, SEQ, BATCH, 2, 2, "backward", "all_to_all") == \
        {"all_to_all": 512 * 2, "ring": 384 * 6}
    # No shared expert (Qwen3-MoE): nothing on the ring.
    assert planner.tsp_moe_bytes_by_op(tiny_moe_shape(shared_expert_intermediate_size=0), SEQ, BATCH, 2, 2, "forward",
                                       "all_to_all") == {"all_to_all": 512 * 2 + 16}
    # Crossover, forward, no shared expert, split sizes aside: 1.5 E F_e D / k = 1.5*4*8*2/2 = 48 tokens.
    plain = tiny_moe_shape(shared_expert_intermediate_size=0)
    forward = planner.moe_crossover_tokens(plain, 2, 2, "forward")
    assert forward == pytest.approx(48 - 16 / (2 * 2 * 16 * 2 / 2 / 2))
    # Both directions, bf16 with fp32 accumulators (2e + a = 8 B vs 2 x 2e = 8 B a token element): 3 E F_e D / k.
    both = planner.moe_crossover_tokens(plain, 2, 2)
    assert both == pytest.approx(3 * 4 * 8 * 2 / 2 - 16 / (4 * 2 * 16 / 2 * 2 / 2))
    # The ring's bytes do not grow with the tokens, the all-to-all's do: the ring is the cheaper past the crossover.
    for S in (94, 96):
        moved = {schedule: sum(planner.tsp_moe_bytes_by_op(plain, S, 1, 2, 2, "both", schedule).values())
                 for schedule in ("ring", "all_to_all")}
        assert (moved["ring"] < moved["all_to_all"]) == (S > both)
        # tsp.moe_schedule "auto" takes the cheaper, from the block's sizes and N = S/D local tokens.
        assert planner.cheaper_moe_schedule(16, 4, 8, 0, 2, S // 2, 2, 2, "both") == min(moved, key=moved.get)
    with pytest.raises(ValueError, match="schedule"):
        planner.tsp_moe_bytes_by_op(m, SEQ, BATCH, 2, 2, "both", "broadcast")
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        planner.tsp_moe_bytes_by_op(tiny_shape(), SEQ, BATCH, 2, 2, "both")
    with pytest.raises(ValueError, match="no mixture-of-experts"):  # not a ring of 0 bytes
        planner.tsp_bytes_by_op(tiny_shape(), SEQ, BATCH, 2, 2, "both", sparse=True)
    mixed = tiny_moe_shape(num_hidden_layers=3, decoder_sparse_step=2)
    with pytest.raises(ValueError, match="say which with sparse="):
        planner.tsp_bytes_by_op(mixed, SEQ, BATCH, 2, 2, "both")


def test_moe_step_bytes_by_op():
    # 1 dense and 2 sparse layers; every layer's norms, the routers (4 x 16) and shared-expert gates (1 x 16)
    # all-reduced at D=2 (bf16: each tensor's bytes once), the loss, and the load-balancing statistics
    # (2E+1 = 9 float64 values) when output_router_logits.
    m = tiny_moe_shape(num_hidden_layers=3, mlp_only_layers=[1])
    dense = planner.tsp_bytes_by_op(m, SEQ, BATCH, 2, 2, "both", sparse=False)
    sparse = planner.tsp_bytes_by_op(m, SEQ, BATCH, 2, 2, "both", sparse=True)
    vocab = planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, 2, 2, "both")
    step = planner.tsp_step_bytes_by_op(m, SEQ, BATCH, 2, 2)
    whole = 7 * HIDDEN + 2 * (4 + 1) * HIDDEN
    assert step == {**{op: dense[op] + 2 * sparse[op] for op in dense}, "ring": dense["ring"] + 2 * sparse["ring"]
                    + vocab["ring"], "all_to_all": vocab["all_to_all"], "all_reduce": 4 + whole * 2,
                    "batch_check": 128}
    aux = planner.tsp_step_bytes_by_op({**m, "output_router_logits": True}, SEQ, BATCH, 2, 2)
    assert aux == {**step, "all_reduce": step["all_reduce"] + 9 * 8}
    # The plan's per-layer figures are the mean over the layers.
    plans = {p.name: p for p in planner.plan(m, SEQ, BATCH, 2, "bf16")}
    forward = [planner.tsp_bytes_per_layer(m, SEQ, BATCH, 2, 2, "forward", sparse=s) for s in (False, True)]
    assert plans["TSP(2)"].comm_forward_per_layer == pytest.approx((forward[0] + 2 * forward[1]) / 3)
    assert plans["TSP(2)"].comm_per_step == sum(step.values())


def test_moe_bytes_with_experts_folded_by_hand():
    # tsp.expert_parallel_size = ep: the experts E/ep a rank over ep consecutive ranks (DESIGN.md 6k).
    m, D, ep = tiny_moe_shape(), 2, 4
    sizes = (HIDDEN, 4, 8, 16, 2, 16)  # H, E, F_e, F_s, k, N = B*S/D local tokens
    # ep = D is today's block, op by op, schedule by schedule, and so is every layer and step.
    for schedule in ("ring", "all_to_all"):
        for direction in ("forward", "backward", "both"):
            assert planner.moe_block_bytes_by_op(*sizes, D, 2, direction, schedule, expert_parallel_size=D) == \
                planner.moe_block_bytes_by_op(*sizes, D, 2, direction, schedule)
        assert planner.tsp_step_bytes_by_op(m, SEQ, BATCH, D, 2, moe_schedule=schedule, expert_parallel_size=D) == \
            planner.tsp_step_bytes_by_op(m, SEQ, BATCH, D, 2, moe_schedule=schedule)
    # ep = 4 over D = 2: N = 16 local tokens, k = 2 rows each; (ep-1)/ep of the rows routed to the other three
    # ranks' experts and of the outputs computed there: 2*2*16*3/4 = 48 rows of H = 16 in bf16, 1536 B each way;
    # the split sizes, one int64 for the E/ep = 1 expert of each of the 3 others, 24 B. The shared expert stays
    # on the TSP ring of D = 2: (D-1)/D * 3 H F_s = 384 elements, backward with its fp32 accumulators.
    forward = planner.moe_block_bytes_by_op(*sizes, D, 2, "forward", "all_to_all", expert_parallel_size=ep)
    assert forward == {"all_to_all": 1536 + 24, "ring": 384 * 2}
    assert planner.moe_block_bytes_by_op(*sizes, D, 2, "backward", "all_to_all", expert_parallel_size=ep) == \
        {"all_to_all": 1536, "ring": 384 * (2 + 4)}
    # A rank's exact rows (what the block counts) in place of the expected ones.
    assert planner.moe_block_bytes_by_op(*sizes, D, 2, "forward", "all_to_all", expert_parallel_size=ep,
                                         rows_received=10) == {"all_to_all": 10 * 16 * 2 + 24, "ring": 384 * 2}
    assert planner.tsp_moe_bytes_by_op(m, SEQ, BATCH, D, 2, "forward", "all_to_all", expert_parallel_size=ep) == forward
    # TSP of one rank, experts over two: N = 32 tokens, 2*2*32/2 = 64 rows; no ring, no attention bytes.
    assert planner.tsp_bytes_by_op(m, SEQ, BATCH, 1, 2, "forward", sparse=True, expert_parallel_size=2) == \
        {"all_to_all": 64 * 16 * 2 + 8 * 1 * 2}
    # The layer: the sparse layer of today's all-to-all with the folded block in its block's place, whatever
    # moe_schedule says.
    both = planner.moe_block_bytes_by_op(*sizes, D, 2, "both", "all_to_all", expert_parallel_size=ep)
    today = planner.moe_block_bytes_by_op(*sizes, D, 2, "both", "all_to_all")
    layer = planner.tsp_bytes_by_op(m, SEQ, BATCH, D, 2, "both", sparse=True, moe_schedule="all_to_all")
    for schedule in ("ring", "auto", "all_to_all"):
        assert planner.tsp_moe_schedule(m, SEQ, BATCH, D, 2, schedule, expert_parallel_size=ep) == "all_to_all"
        assert planner.tsp_bytes_by_op(m, SEQ, BATCH, D, 2, "both", sparse=True, moe_schedule=schedule,
                                       expert_parallel_size=ep) == \
            {op: v - today.get(op, 0) + both.get(op, 0) for op, v in layer.items()}
    assert planner.cheaper_moe_schedule(*sizes, D, 2, "both", expert_parallel_size=ep) == "all_to_all"
    # The step: every sparse layer's all-to-all beside the embedding's.
    step = planner.tsp_step_bytes_by_op(m, SEQ, BATCH, D, 2, expert_parallel_size=ep)
    vocab = planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, D, 2, "both")
    assert step["all_to_all"] == m["num_hidden_layers"] * both["all_to_all"] + vocab["all_to_all"]
    # Refused: the ring over experts its group does not hold, a size that is no multiple of D, one that does not
    # divide the experts, a dense model.
    with pytest.raises(ValueError, match="expert_parallel_size 4 > tsp_size 2"):
        planner.moe_block_bytes_by_op(*sizes, D, 2, "both", "ring", expert_parallel_size=ep)
    with pytest.raises(ValueError, match="expert_parallel_size must be a multiple of tsp_size 2"):
        planner.moe_block_bytes_by_op(*sizes, D, 2, "both", "all_to_all", expert_parallel_size=3)
    with pytest.raises(ValueError, match="expert_parallel_size 8 does not divide"):
        planner.tsp_moe_bytes_by_op(m, SEQ, BATCH, D, 2, "both", "all_to_all", expert_parallel_size=8)
    with pytest.raises(ValueError, match="expert_parallel_size 4: custom has no mixture-of-experts"):
        planner.tsp_step_bytes_by_op(tiny_shape(), SEQ, BATCH, D, 2, expert_parallel_size=ep)


def test_moe_step_bytes_equal_what_the_model_counts(run_ranks):
    # The whole model, layers, expert ring, vocabulary, router and shared-expert-gate gradients and the
    # load-balancing loss's all-reduce (the tiny configs have output_router_logits on), against
    # tsp_step_bytes_by_op with the batch's exact embedding rows, at D=2 and 4 (Mixtral and Qwen2-MoE have
    # 4 experts, Qwen3-MoE 8); Qwen3's q/k norms are replicated too. OLMoE: q/k norms over the whole projection;
    # GLM-4.5: a dense first layer, an ungated shared expert (no gate's gradient), a router whose
    # score-correction bias is a buffer (no gradient), no load-balancing loss whatever the config says.
    # MiniMax-M2: the score-correction bias the block hands its router, q/k norms over the whole projection.
    # GPT-OSS: sinks in the attention shards, biased experts, the router's bias and o_proj's bias replicated.
    # Llama 4: a dense layer of intermediate_size_mlp, MoE layers with a shared expert, a weightless q/k norm
    # (nothing replicated to reduce), no load-balancing loss.
    from models import tiny_config

    cases = {2: [("mixtral", torch.float64, True, False), ("qwen2_moe", torch.bfloat16, True, False),
                 ("qwen3_moe", torch.float32, False, False), ("qwen3_moe", torch.float32, True, True),
                 ("qwen3", torch.float32, True, False), ("olmoe", torch.float32, True, False),
                 ("glm4_moe", torch.float64, True, False), ("minimax_m2", torch.float64, True, False),
                 ("gpt_oss", torch.float64, True, False), ("llama4", torch.float64, True, False)],
             4: [("qwen2_moe", torch.float32, True, False), ("qwen3_moe", torch.bfloat16, True, False),
                 ("glm4_moe", torch.bfloat16, True, False), ("gpt_oss", torch.bfloat16, True, True),
                 ("llama4", torch.bfloat16, True, False)]}
    for D, per_world in cases.items():
        _check_counted_steps(D, per_world, run_ranks(D, _counted_model_steps, cases=per_world))
        for arch, dtype, _, _ in per_world:
            if arch != "qwen3":
                # Guard: the MoE layers counted as dense MLPs of intermediate_size would not match.
                m = planner.model_shape(tiny_config(arch).to_dict())
                dense = planner.tsp_bytes_by_op(m, SEQ, BATCH, D, dtype.itemsize, "both", 0, sparse=False)
                assert dense["ring"] != planner.tsp_bytes_by_op(m, SEQ, BATCH, D, dtype.itemsize, "both", 0,
                                                                sparse=True)["ring"]


def test_hybrid_step_bytes_are_the_layers_formulas():
    # Qwen3.5's tiny shape: 3 Gated DeltaNet layers (4 key and 8 value heads of 4, a 4-tap convolution) and one
    # gated attention layer (q_proj of 2 * 4 heads of 8 rows), dense MLPs, at D=2 in bf16. Each layer's bytes are
    # its mixer's formula (the attention's, or delta_net_bytes_by_op) and the MLP ring's.
    m, D, e = planner.model_shape(tiny_hybrid_shape()), 2, 2
    attention = planner.tsp_bytes_by_op(m, SEQ, BATCH, D, e, "both", linear=False)
    linear = planner.tsp_bytes_by_op(m, SEQ, BATCH, D, e, "both", linear=True)
    ring = (D - 1) * 3 * HIDDEN * INTER // D * (e + e + 4)  # the weights both ways, the accumulators in fp32
    assert linear == {**planner.delta_net_bytes_by_op(HIDDEN, 4, 8, 4, 4, 4, BATCH, SEQ // D, D, e, "both"),
                      "ring": ring}
    # Wa = 16 * (4 * 16 + 2 * 2 * 8) + 4 * 8 * 16 = 2048 with the gate's rows: half of it broadcast each way.
    assert attention["broadcast"] == 2 * 2048 // 2 * e and attention["ring"] == ring
    vocab = planner.tsp_vocab_bytes_by_op(m, SEQ, BATCH, D, e, "both")
    step = planner.tsp_step_bytes_by_op(m, SEQ, BATCH, D, e)
    layers = {op: attention.get(op, 0) + 3 * linear.get(op, 0) for op in {**attention, **linear}}
    # All-reduced at D=2, each tensor's bytes once: the fp32 loss; the final norm, every layer's two norms, the
    # attention's per-head q/k norms (8 each) and each linear layer's gated norm (4).
    assert step == {**layers, "ring": layers["ring"] + vocab["ring"], "all_to_all": vocab["all_to_all"],
                    "all_reduce": 4 + (HIDDEN + 4 * 2 * HIDDEN + 2 * 8 + 3 * 4) * e, "batch_check": 128}
    assert planner.tsp_layers_bytes_by_op(m, SEQ, BATCH, D, e, "both") == layers
    # Checkpointing runs every layer's forward again, the state maps' gather and the broadcasts included.
    forward = {kind: planner.tsp_bytes_by_op(m, SEQ, BATCH, D, e, "forward", linear=kind) for kind in (False, True)}
    checkpointed = planner.tsp_step_bytes_by_op(m, SEQ, BATCH, D, e, activation_checkpointing=True)
    assert checkpointed["all_gather"] == step["all_gather"] + forward[False]["all_gather"] + \
        3 * forward[True]["all_gather"]
    # The plan's per-layer figures are the mean over the layers.
    plans = {p.name: p for p in planner.plan(m, SEQ, BATCH, D, "bf16")}
    assert plans["TSP(2)"].comm_forward_per_layer == pytest.approx(
        (sum(forward[False].values()) + 3 * sum(forward[True].values())) / 4)
    assert plans["TSP(2)"].comm_per_step == sum(step.values())
    with pytest.raises(ValueError, match="say which with linear="):
        planner.tsp_bytes_by_op(m, SEQ, BATCH, D, e, "both")
    with pytest.raises(ValueError, match="no recurrent layer"):
        planner.tsp_bytes_by_op(tiny_shape(), SEQ, BATCH, D, e, "both", linear=True)


def test_hybrid_step_bytes_equal_what_the_model_counts(run_ranks):
    # The whole hybrid at D=2: the Gated DeltaNet layers' head groups and state maps, the gated attention, the
    # experts' ring, the gated norms' gradients, against tsp_step_bytes_by_op with the batch's exact rows.
    cases = [("qwen3_5", torch.float64, True, False), ("qwen3_next", torch.float32, True, True)]
    _check_counted_steps(2, cases, run_ranks(2, _counted_model_steps, cases=cases))


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_recurrent_hybrid_step_bytes_equal_what_the_model_counts(run_ranks, tsp_size):
    """Issue 63's hybrids as the planner reads their configs: Mamba-2's pieces, halos and state maps (Bamba,
    Granite-4.0-H with its experts on the ring, Nemotron-H's layers of one block, checkpointed), KDA's head
    groups beside a latent attention (Kimi Linear, float32: its strict-float32 dt_bias is refused narrower),
    Jamba's Mamba-1 channels and experts, LFM2's short convolutions (biased, checkpointed) and LFM2-MoE's."""
    dtype = torch.float64 if tsp_size == 2 else torch.bfloat16
    cases = [("bamba", dtype, True, False), ("granitemoehybrid_moe", dtype, True, False),
             ("nemotron_h_dense", dtype, True, tsp_size == 2), ("kimi_linear", torch.float32, True, False),
             ("jamba", dtype, True, False), ("lfm2_biased", dtype, True, tsp_size == 4),
             ("lfm2_moe", dtype, True, False)]
    _check_counted_steps(tsp_size, cases, run_ranks(tsp_size, _counted_model_steps, cases=cases))


def test_recurrent_maps_bytes_do_not_grow_with_the_sequence():
    """A Mamba-2 and a KDA layer at D = 4: the planner's bytes by op are the same at S = 256 and 4096 (the
    blocks' counted bytes equal these formulas: tests/test_mamba2.py, tests/test_linear_attention.py)."""
    for preset in ("nemotron-h-8b", "kimi-linear-48b-a3b"):
        m = planner.model_shape(preset)
        short, long = (planner.tsp_bytes_by_op(m, S, 1, 4, 2, "both", mixer="linear", sparse=m.is_moe)
                       for S in (256, 4096))
        print(f"{preset} {m.recurrent.kind}: S=256 {short}, S=4096 {long}")
        assert short == long and short["all_gather"] > 0
