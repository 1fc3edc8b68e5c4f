"""The planner's strategies side by side (ds_tsp.planning.strategies): FLOPs
and step communication by hand, the TSP paper's ordering, ``recommend``, and
how each strategy shards a mixture-of-experts model."""

import pytest

from ds_tsp import planning as planner
from plan_helpers import BATCH, HEAD_DIM, HIDDEN, SEQ, paper_plans, tiny_moe_shape, tiny_shape


def test_flops_and_step_communication():
    m = planner.model_shape(tiny_shape(layers=2))
    plans = {p.name: p for p in planner.plan(tiny_shape(layers=2), SEQ, BATCH, 2, "bf16")}
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
    recompute = {p.name: p for p in planner.plan(tiny_shape(layers=2), SEQ, BATCH, 2, "bf16",
                                                 tsp_attention_backward="recompute")}
    assert recompute["TSP(2) replicated vocab"].flops_per_step == pytest.approx((dense + 2 * attn) / 2)
    # Per step: 2 layers' forward + backward, then the loss (one fp32 scalar) and the gradients of what every
    # rank holds whole all-reduced, 2(D-1)/D of them (bf16): norms, and unfolded the embedding and the head;
    # the batch check, the other rank's 128-byte fingerprint.
    norms = 2 * 2 * HIDDEN + HIDDEN
    tsp = plans["TSP(2) replicated vocab"]
    layers = 2 * (tsp.comm_forward_per_layer + tsp.comm_backward_per_layer)
    assert tsp.comm_per_step == layers + 4 + (norms + 2 * 61 * HIDDEN) * 2 + 128
    # Folded (Vs = 31 rows): embedding all-to-all 1/2 of the 16 local tokens' rows, forward and backward;
    # head ring 1 hop of the shard forward, 1 hop of it and of its fp32 accumulator backward.
    folded = plans["TSP(2)"]
    assert folded.comm_forward_per_layer == tsp.comm_forward_per_layer
    assert folded.comm_per_step == layers + 4 + norms * 2 + 2 * 8 * HIDDEN * 2 + 31 * HIDDEN * (2 + 2 + 4) + 128
    assert m.num_layers == 2


def test_paper_ordering_tsp_below_tp_below_tp_sp():
    plans = paper_plans()
    # The paper's TSP folds attention and the MLP only: its peak is set beside the replicated vocabulary.
    for tsp in ("TSP(8)", "TSP(8) replicated vocab"):
        assert plans[tsp].total < plans["TP(8)"].total < plans["TP+SP(2x4)"].total < plans["SP-Ulysses(8)"].total
    # Each estimate within the measured peak's reach: below it (tensors only), not by more than 30%.
    for name, gb in planner.PAPER_PEAK_GB.items():
        assert 0.7 < plans[name].total / (gb * planner.GB) < 1.05, name
    # Without checkpointing TP alone would not fit an MI300X: the paper must checkpoint.
    assert paper_plans(False)["TP(8)"].total > planner.PAPER_DEVICE_GB * planner.GB
    # TSP per layer, forward: 7/8 of (Wa + Wm + 2*S*nkv*d) bf16 elements.
    assert plans["TSP(8)"].comm_forward_per_layer == \
        7 * (4 * 4096 ** 2 + 3 * 4096 * 11008 + 2 * 131072 * 32 * 128) // 8 * 2


def test_recommend_filters_by_memory():
    plans = list(paper_plans().values())
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


def test_moe_plans_shard_the_experts_as_each_strategy_does():
    m = planner.model_shape("qwen3-30b-a3b")
    plans = {p.name: p for p in planner.plan("qwen3-30b-a3b", 32768, 1, 8, "bf16", activation_checkpointing=True)}
    # TSP: 1/8 of every expert (16 of 128 per rank), attention by heads (4 query heads and, on the rank that
    # holds it, one of the 4 key/value heads), routers and norms whole, folded vocabulary.
    tsp = plans["TSP(8)"]
    attention = 4 * 128 * 2 * 2048 + 2 * 128 * 2048
    per_rank = 48 * (attention + 16 * m.expert_params + m.layer_replicated_params(True)) + \
        2 * 151936 / 8 * 2048 + 2048
    assert tsp.memory["weights"] == pytest.approx(2 * per_rank)
    # Ulysses replicates the experts: all 30.5B parameters' states on every rank; ZeRO-3 partitions them.
    ulysses = plans["SP-Ulysses(8)"]
    assert ulysses.memory["weights"] == pytest.approx(2 * m.params)
    zero3 = {p.name: p for p in planner.plan("qwen3-30b-a3b", 32768, 1, 8, "bf16", 3, True)}["SP-Ulysses(8)"]
    assert zero3.memory["weights"] == pytest.approx(2 * m.params / 8)
    # ... gathering a whole sparse layer (128 experts) at a time, which TSP never holds.
    assert zero3.detail["zero3_gathered_layers"] > 2 * 128 * m.expert_params * 2
    assert tsp.total < zero3.total < ulysses.total
    # FLOPs count the active experts only: about 8 per active parameter and token (2 forward, 4 backward, 2 in
    # the checkpoint's recompute; the embedding's rows none), where every expert counted would give 8 per
    # parameter of the 30.5B.
    matmuls = (tsp.flops_per_step - tsp.attention_flops_per_step) * 8 / 32768
    assert 7 * m.active_params < matmuls < 8 * m.active_params < 8 * m.params / 7
    # Its 4,096 local tokens fit one token tile: the experts keep their gate and up projections and the attention
    # its q, k and v. In two tiles backward computes them again, 2 FLOPs per parameter and token of each.
    tiled = {p.name: p for p in planner.plan("qwen3-30b-a3b", 32768, 1, 8, "bf16", activation_checkpointing=True,
                                             token_tile=2048)}["TSP(8)"]
    again = 2 * (m.experts_per_token * 2 * 2048 * 768 + 2048 * (32 + 2 * 4) * 128)
    assert (tiled.flops_per_step - tsp.flops_per_step) * 8 / 32768 == pytest.approx(48 * again)
    # AutoTP splits what the tp_plan names, the attention: every expert whole on every rank, computing every
    # token, with one activation all-reduce per layer (after the attention) instead of Megatron TP's two.
    autotp = planner.plan_autotp("qwen3-30b-a3b", 4096, 1, 8)
    megatron_tp = {p.name: p for p in planner.plan("qwen3-30b-a3b", 4096, 1, 8)}["TP(8)"]
    assert autotp.feasible and planner.plan_autotp(tiny_shape(), SEQ, BATCH, 2).feasible
    # 7/8 of every expert more per rank, and of the untied LM head (AutoTP's whole embedding, Megatron's split).
    experts = m.moe_layers * m.num_experts * m.expert_params
    more = 2 * (experts + m.vocab_size * m.hidden_size) * 7 / 8
    assert autotp.memory["weights"] - megatron_tp.memory["weights"] == pytest.approx(more, rel=1e-4)
    assert autotp.comm_parts["tp_activations"].nbytes < megatron_tp.comm_parts["tp_activations"].nbytes
    assert autotp.flops_per_step > megatron_tp.flops_per_step
    # TSP's shape rules: E and the shared expert's F_s divide by D, the dense F only where a dense layer exists.
    eight_heads = dict(num_attention_heads=8, intermediate_size=24)
    assert "num_experts 4 is not divisible by 8" in planner.tsp_shape_problem(
        planner.model_shape(tiny_moe_shape(**eight_heads)), 8)
    assert "shared_expert_intermediate_size 12 is not divisible by 8" in planner.tsp_shape_problem(
        planner.model_shape(tiny_moe_shape(**eight_heads, num_experts=8, shared_expert_intermediate_size=12)), 8)
    mixtral = planner.model_shape({**tiny_moe_shape(), "model_type": "mixtral", "num_local_experts": 4,
                                   "intermediate_size": 6})
    assert planner.tsp_shape_problem(mixtral, 4) is None  # experts whole: F_e = 6 need not divide


def test_autoep_spreads_the_experts_over_the_replicas_and_moves_routed_rows():
    """DeepSpeed AutoEP for a mixture of experts (data parallel, ep_size = gcd(E, devices)): a device holds
    every weight but the experts whole and E/ep experts, each of its B*S tokens sends its top-k rows to their
    owners and gets the outputs back, forward and backward; no such row for a dense model."""
    m = planner.model_shape("gpt-oss-120b")
    plans = {p.name: p for p in planner.plan(m, 32768, 1, 8, "bf16")}
    autoep, dp = plans["AutoEP(8)"], plans["DP(8)"]
    assert autoep.memory["weights"] == pytest.approx(2 * (m.params - m.routed_expert_params * 7 / 8))
    assert autoep.memory["activations"] == dp.memory["activations"]  # every device its own whole sequence
    rows = m.experts_per_token * 32768 * m.hidden_size * 2  # bf16
    assert autoep.comm_parts["ep_all_to_all"].nbytes == pytest.approx(2 * m.moe_layers * 2 * rows * 7 / 8)
    assert autoep.total < dp.total and plans["TSP(8)"].total < autoep.total
    assert planner.plan("glm-4.5-air", 4096, 1, 12)[-3].name == "AutoEP(4)"  # 128 experts over 12 devices: 4
    assert not any(p.name.startswith("AutoEP") for p in planner.plan("llama3-8b", 4096, 1, 8))


def test_tsp_rows_fold_the_experts_across_the_replicas():
    """``tsp_size`` and ``expert_parallel_size`` (DESIGN.md 6k): TSP groups of D = 2 on 8 devices, 4 replicas,
    a Qwen3-MoE-like model of 8 experts; the folded row's bytes by kind and group, the choice "auto" makes, and
    the refusals, named as ``tsp.expert_parallel_size``'s are."""
    m = tiny_moe_shape(model_type="qwen3_moe", num_experts=8, shared_expert_intermediate_size=0)
    plans = {p.name: p for p in planner.plan(m, SEQ, BATCH, 8, "bf16", 1, tsp_size=2, expert_parallel_size=8)}
    assert [name for name in plans if name.startswith("TSP")] == \
        ["TSP(2) x DP(4) replicated vocab", "TSP(2) x DP(4)", "TSP(2) x DP(4), EP(8)"]
    folded = plans["TSP(2) x DP(4), EP(8)"]
    assert folded.layout == "tsp=2 x dp=4, ep=8, moe_schedule=all_to_all, vocab_parallel=true"
    assert folded.devices_per_replica == 2 and folded.tokens_per_device == BATCH * SEQ // 2
    # The sparse layers' all-to-all over the 8 ranks holding the experts, the rest of ds_tsp's over the TSP group.
    parts = folded.comm_parts
    a2a = planner.tsp_layers_bytes_by_op(m, SEQ, BATCH, 2, 2, "both", expert_parallel_size=8)["all_to_all"]
    assert (parts["tsp_expert_all_to_all"].nbytes, parts["tsp_expert_all_to_all"].group_size) == (a2a, 8)
    assert parts["tsp_kv_gather"].group_size == 2
    # ZeRO-1 over the replicas: the dense weights' gradients reduce-scattered over the 4 replicas, 2 apart, and
    # gathered back; the experts' (X/8 a rank, 2 layers x 1 expert x 384) over their group of 8/8 = 1: nothing.
    experts = 2 * 1 * 3 * 16 * 8
    dense = folded.memory["weights"] / 2 - experts
    assert (parts["grad_reduce"].nbytes, parts["grad_reduce"].group_size, parts["grad_reduce"].stride) == \
        (pytest.approx(3 / 4 * dense * 2), 4, 2)
    assert parts["param_gather"].nbytes == pytest.approx(3 / 4 * dense * 2)
    assert "expert_grad_reduce" not in parts
    step = planner.tsp_step_bytes_by_op(m, SEQ, BATCH, 2, 2, expert_parallel_size=8)
    assert folded.comm_per_step == pytest.approx(sum(step.values()) + 2 * 3 / 4 * dense * 2)
    # Over 4 ranks, the experts' own group of 2 replicas, 4 apart.
    half = {p.name: p for p in planner.plan(m, SEQ, BATCH, 8, "bf16", 1, tsp_size=2, expert_parallel_size=4)}
    reduce = half["TSP(2) x DP(4), EP(4)"].comm_parts["expert_grad_reduce"]
    assert (reduce.nbytes, reduce.group_size, reduce.stride) == (pytest.approx(1 / 2 * 2 * experts * 2), 2, 4)
    # Experts over D alone, ep = D: the same as no expert_parallel_size, and no folded row.
    same = planner.plan(m, SEQ, BATCH, 8, "bf16", 1, tsp_size=2, expert_parallel_size=2)
    assert [p.name for p in same][-2:] == ["TSP(2) x DP(4) replicated vocab", "TSP(2) x DP(4)"]
    assert same[-1].total == plans["TSP(2) x DP(4)"].total
    # "auto": the least memory, the experts over every rank here.
    assert planner.plan(m, SEQ, BATCH, 8, "bf16", 1, tsp_size=2, expert_parallel_size="auto")[-1].name == \
        "TSP(2) x DP(4), EP(8)"
    refusals = [(dict(tsp_size=2, expert_parallel_size=6), "expert_parallel_size = 6 must be a multiple of "
                 "tsp_size \\(2\\) dividing tsp_size x the data-parallel size \\(2 x 4\\) and custom's 8 experts a "
                 "layer: choose one of 2, 4, 8"),
                (dict(tsp_size=2, expert_parallel_size=3), "multiple of tsp_size"),
                (dict(tsp_size=1, expert_parallel_size=16), "choose one of 1, 2, 4, 8"),
                (dict(tsp_size=3), "tsp_size must be an integer dividing devices \\(8\\)"),
                (dict(expert_parallel_size=4), "no replica to fold the experts over: set tsp_size"),
                (dict(expert_parallel_size="auto"), "no size above tsp_size 8"),
                (dict(moe_schedule="broadcast"), "moe_schedule must be one of ring, all_to_all, auto")]
    for options, message in refusals:
        with pytest.raises(ValueError, match=message):
            planner.plan(m, SEQ, BATCH, 8, "bf16", 1, **options)
    with pytest.raises(ValueError, match="expert_parallel_size = 4: custom has no mixture-of-experts layer"):
        planner.plan(tiny_shape(), SEQ, BATCH, 8, "bf16", 1, tsp_size=2, expert_parallel_size=4)
    with pytest.raises(ValueError, match="does not divide"):  # at the formula too
        planner.tsp_moe_bytes_by_op(tiny_moe_shape(), SEQ, BATCH, 2, 2, "both", "all_to_all", expert_parallel_size=8)
