"""The step-time model (ds_tsp.planning.timing) against hand-computed values:
its kernel rates (ds_tsp.planning.kernels), overlap and link rules, micro-batches
and overhead, ``ds-tsp plan``'s time columns, and the published runs of
DeepSpeed-Ulysses, Megatron context parallelism, ALST and Hugging Face's blog."""

import argparse
import dataclasses
import io
import json
import math
import re

import pytest

from ds_tsp import planning as planner
from ds_tsp.planning import kernels, timing
from ds_tsp.planning.flops import elementwise_bytes
from ds_tsp.planning.plan_types import CommPart

H100 = planner.Cluster()  # H100 SXM, cuDNN attention, bf16 matmuls, NVLink 450 GB/s, InfiniBand 50 GB/s


def _shape(layers=2):
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
                num_key_value_heads=4, head_dim=8, vocab_size=256)


def _by_name(*args, **kwargs):
    return {p.name: p for p in planner.plan(*args, **kwargs)}


def test_one_device_runs_each_kernel_kind_at_its_published_rate():
    # llama-7b at 4096 tokens: cuDNN's published 477 TFLOPs at 4K (d 128), the best H100 bf16 matmul (794.5:
    # 4096 x 4096 x 4096 is far above the roofline's ridge) and the elementwise bytes at 2668 GB/s.
    for p in planner.plan("llama-7b", 4096, 1, 1, activation_checkpointing=True):
        assert p.comm_parts == {}  # nothing to send on one device
        time = planner.step_time(p, H100)
        attention = p.attention_flops_per_step
        moved = elementwise_bytes(p.setting.model, p.setting, 1, 4096)
        by_hand = attention / 477e12 + (p.flops_per_step - attention) / 794.5e12 + moved / 2668e9
        assert time.seconds == pytest.approx(by_hand, rel=1e-12)
        assert time.bound == timing.COMPUTE and time.exposed_comm == pytest.approx(0, abs=1e-15)
        assert time.tokens_per_s_per_device == pytest.approx(4096 / time.seconds)
        # the framework's overhead multiplies the step
        assert planner.step_time(p, dataclasses.replace(H100, overhead=1.5)).seconds == pytest.approx(1.5 * by_hand)
        # FlashAttention 2 on an A100, 2.5x slower attention and 2.9x slower matmuls: slower
        assert planner.step_time(p, planner.Cluster("a100")).seconds > 2.5 * time.seconds


def test_kernel_rates_as_published():
    h100, a100 = kernels.device("h100"), kernels.device("a100")
    # FlashAttention 2's published causal fwd+bwd on A100, d 128 (flash2_a100_fwd_bwd_benchmark.png)
    assert [kernels.attention_tflops(a100, "fa2", 128, n) for n in kernels.BENCH_LENGTHS] == [
        99, 133, 155, 173, 182, 189]
    # between two lengths: linear in log length; outside them the end values; the nearest published head size
    assert kernels.attention_tflops(a100, "fa2", 128, int(4096 * 2 ** 0.5)) == pytest.approx((173 + 182) / 2, rel=1e-4)
    assert kernels.attention_tflops(a100, "fa2", 128, 1 << 20) == 189
    assert kernels.attention_tflops(a100, "fa2", 128, 64) == 99
    assert kernels.attention_tflops(a100, "fa2", 80, 16384) == 171  # d 64's
    assert kernels.attention_tflops(a100, "fa2", 96, 16384) == 189  # a tie goes to the larger
    assert kernels.attention_tflops(h100, "cudnn", 192, 65536) == 538  # cuDNN's d 128, its longest
    # matmuls: the best achievable rate, or the roofline where the shape starves it (16 tokens: decode-like)
    assert kernels.matmul_tflops(h100, "bf16", 8192, 4096, 4096, 2) == 794.5
    small = kernels.matmul_tflops(h100, "bf16", 16, 4096, 4096, 2)
    intensity = 2 * 16 * 4096 * 4096 / (2 * (16 * 4096 + 4096 * 4096 + 16 * 4096))
    assert small == pytest.approx(intensity * 2668 / 1e3) and small < 50
    assert kernels.matmul_tflops(h100, "fp8", 8192, 4096, 4096, 1) == 1402.6
    # bad names are refused naming the choices
    with pytest.raises(ValueError, match="device must be one of a100, h100, h200, not 'b200'"):
        planner.Cluster("b200")
    with pytest.raises(ValueError, match="attention kernel must be one of fa1, fa2 on a100"):
        planner.Cluster("a100", "cudnn")
    with pytest.raises(ValueError, match="matmul dtype must be one of bf16 on a100"):
        planner.Cluster("a100", matmul_dtype="fp8")
    with pytest.raises(ValueError, match="overhead"):
        planner.Cluster(overhead=0)


def test_fp8_matmuls_run_faster_and_cast_their_inputs():
    p = _by_name("llama-7b", 65536, 1, 1)["DP(1)"]
    fp8 = planner.Cluster(matmul_dtype="fp8")
    bf16, fast = timing.kernel_seconds(p, H100), timing.kernel_seconds(p, fp8)
    assert bf16["attention"] == fast["attention"] > 0
    assert fast["matmul"] == pytest.approx(bf16["matmul"] * 794.5 / 1402.6)
    assert fast["elementwise"] > bf16["elementwise"]  # the casts


def test_links_of_a_group():
    assert not timing.crosses_nodes(8, 1, 8) and not timing.crosses_nodes(4, 2, 8)
    assert timing.crosses_nodes(16, 1, 8) and timing.crosses_nodes(2, 8, 8)
    assert timing.crosses_nodes(6, 1, 8)  # groups of 6 consecutive ranks straddle nodes of 8
    assert not timing.crosses_nodes(1, 64, 8)
    # NCCL's achieved bus bandwidth on a DGX H100: 370 GB/s for rings in a node, 320 for all-to-alls, 48 of a
    # NIC's 50 across nodes.
    nbytes = 15e9
    inside = CommPart(nbytes, 8, 1, "all_gather")
    assert timing.part_seconds(inside, 8, H100) == (timing.INTRA_NODE, pytest.approx(nbytes / 370e9))
    ring = CommPart(nbytes, 16, 1, "all_gather")  # crossing: every byte at the inter-node bandwidth
    assert timing.part_seconds(ring, 8, H100) == (timing.INTER_NODE, pytest.approx(nbytes / 48e9))
    # An all-to-all over 16 ranks on 2 nodes: 8 of the 15 peers are remote, their share goes over InfiniBand.
    a2a = CommPart(nbytes, 16, 1, "all_to_all")
    assert timing.part_seconds(a2a, 8, H100) == (timing.INTER_NODE, pytest.approx(nbytes * 8 / 15 / 48e9))
    # 4 ranks 4 apart: 2 on each node, 2 of the 3 peers remote.
    strided = CommPart(nbytes, 4, 4, "all_to_all")
    assert timing.part_seconds(strided, 8, H100) == (timing.INTER_NODE, pytest.approx(nbytes * 2 / 3 / 48e9))
    # With a network twice NVLink's speed the local share (7 peers of 15) takes longer
    fast = planner.Cluster(inter_node_gb_s=900.0)
    assert timing.part_seconds(a2a, 8, fast) == (timing.INTRA_NODE, pytest.approx(nbytes * 7 / 15 / 320e9))


def test_a_group_across_nodes_is_inter_node_bound_when_the_network_is_slow():
    slow = planner.Cluster(inter_node_gb_s=1.0)
    across = _by_name("llama3-8b", 8192, 1, 16, devices_per_node=8)
    inside = _by_name("llama3-8b", 8192, 1, 16, devices_per_node=16)
    for name in ("TP(16)", "TSP(16)", "SP-Ulysses(16)"):
        time = planner.step_time(across[name], slow)
        assert time.bound == timing.INTER_NODE, name
        assert time.seconds > 10 * time.compute, name
        assert all(link == timing.INTER_NODE for link, _ in time.parts.values()), name
        assert planner.step_time(inside[name], slow).bound != timing.INTER_NODE, name
    # TP+SP(8x2): TP inside a node, the SP pairs 8 apart cross
    parts = planner.step_time(across["TP+SP(8x2)"], slow).parts
    assert parts["tp_activations"][0] == timing.INTRA_NODE and parts["sp_all_to_all"][0] == timing.INTER_NODE


def test_overlapped_communication_below_compute_costs_no_time():
    plans = _by_name("llama3-8b", 131072, 1, 8, activation_checkpointing=True)
    tsp = planner.step_time(plans["TSP(8)"], H100)
    overlapped = {n for n in plans["TSP(8)"].comm_parts if timing.OVERLAPPED[n]}
    assert {"tsp_weight_broadcast", "tsp_ring", "tsp_kv_gather", "tsp_kv_grad_scatter"} <= overlapped
    assert 0 < max(tsp.overlapped.values()) < tsp.compute
    assert tsp.seconds == pytest.approx(tsp.compute + sum(tsp.blocking.values()))
    assert tsp.bound == timing.COMPUTE
    # Slower links that keep it under compute change only the blocking parts (embedding all-to-all, replicated
    # gradients), which take twice as long.
    slower = planner.step_time(plans["TSP(8)"], planner.Cluster(intra_node_gb_s=225.0))
    assert slower.seconds - slower.compute == pytest.approx(2 * (tsp.seconds - tsp.compute))
    # Above compute it is exposed, and the link is the bound.
    starved = planner.step_time(plans["TSP(8)"], planner.Cluster(intra_node_gb_s=5.0))
    assert starved.bound == timing.INTRA_NODE
    assert starved.seconds == pytest.approx(sum(starved.blocking.values()) + starved.overlapped[timing.INTRA_NODE])
    # Ulysses' all-to-alls are on the critical path however small.
    ulysses = planner.step_time(plans["SP-Ulysses(8)"], H100)
    assert ulysses.seconds == pytest.approx(ulysses.compute + ulysses.parts["sp_all_to_all"][1])
    assert not timing.OVERLAPPED["sp_all_to_all"] and not timing.OVERLAPPED["tp_activations"]


@pytest.mark.parametrize("devices, checkpointing", [(8, False), (8, True), (16, True)])
def test_step_time_grows_with_sequence_length(devices, checkpointing):
    seconds = {}
    for seq_len in (4096, 16384, 65536, 262144):
        for p in planner.plan("llama3-8b", seq_len, 1, devices, activation_checkpointing=checkpointing):
            if p.feasible:
                seconds.setdefault(p.name, []).append(planner.step_time(p, H100).seconds)
    assert len(seconds) >= 6
    for name, series in seconds.items():
        assert len(series) == 4 and all(a < b for a, b in zip(series, series[1:])), (name, series)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_comm_parts_sum_to_the_step_bytes(zero_stage, checkpointing):
    plans = planner.plan("llama3-8b", 16384, 1, 8, zero_stage=zero_stage, activation_checkpointing=checkpointing)
    plans.append(planner.plan_alst("llama3.1-8b", 65536, 8))
    for p in plans:
        assert sum(part.nbytes for part in p.comm_parts.values()) == pytest.approx(p.comm_per_step, rel=1e-12)
        assert set(p.comm_parts) <= set(timing.OVERLAPPED), p.name
    by_name = {p.name: p for p in plans}
    assert ("zero3_gather" in by_name["SP-Ulysses(8)"].comm_parts) == (zero_stage == 3)
    assert ("param_gather" in by_name["TP+SP(2x4)"].comm_parts) == (zero_stage in (1, 2))
    assert by_name["TP+SP(2x4)"].comm_parts["sp_all_to_all"].stride == 2


def test_tokens_per_second_compare_replicas_fairly():
    plans = _by_name("llama-7b", 8192, 1, 8)
    dp, tp = (planner.step_time(plans[n], H100) for n in ("DP(8)", "TP(8)"))
    # DP runs a whole sequence per device, TP one per 8 devices
    assert dp.tokens_per_s_per_device == pytest.approx(8192 / dp.seconds)
    assert tp.tokens_per_s_per_device == pytest.approx(8192 / 8 / tp.seconds)
    assert dp.seconds > 5 * tp.seconds and dp.tokens_per_s_per_device > tp.tokens_per_s_per_device


def _rows(text):
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    head = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return {cells[0]: dict(zip(head, cells)) for cells in
            ([cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:])}


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_micro_batches_pay_the_once_a_step_parts_once(zero_stage):
    p = _by_name("llama3-8b", 4096, 1, 8, zero_stage=zero_stage)["TP+SP(2x4)"]
    slow = planner.Cluster(intra_node_gb_s=0.5)  # every part exposed, so each shows in the step
    one, four = planner.step_time(p, slow), planner.step_time(p, slow, micro_batches=4)
    once = {"param_gather"} | ({"grad_reduce"} if zero_stage < 2 else set())
    assert once | {"grad_reduce"} <= set(p.comm_parts)  # ZeRO-2 reduces every micro-batch
    without = dataclasses.replace(p, comm_parts={n: c for n, c in p.comm_parts.items() if n not in once})
    assert four.seconds == pytest.approx(3 * planner.step_time(without, slow).seconds + one.seconds, rel=1e-12)
    assert four.compute == pytest.approx(4 * one.compute)
    assert four.tokens_per_s_per_device == pytest.approx(4 * 4096 / 8 / four.seconds)


def test_cli_prints_the_time_columns(tmp_path):
    parser = planner.add_plan_arguments(argparse.ArgumentParser())
    out = io.StringIO()
    assert planner.run_plan(parser.parse_args(["--json", str(tmp_path / "p.json")]), out=out) == 0
    rows = _rows(out.getvalue())
    assert "Time (timing): H100: cudnn attention, bf16 matmuls at up to 794.5 TFLOPs" in out.getvalue()
    for name, row in rows.items():
        assert row["bound"] in timing.BOUNDS, name
        assert float(row["s/step"]) > 0 and int(row["tok/s/GPU"].replace(",", "")) > 0
    # DP(8) holds no comm it cannot hide (its gradient reduction overlaps), so twice the overhead doubles it
    out = io.StringIO()
    assert planner.run_plan(parser.parse_args(["--overhead", "2", "--intra-node-bandwidth", "450"]), out=out) == 0
    slower = _rows(out.getvalue())
    assert float(slower["DP(8)"]["s/step"]) == pytest.approx(2 * float(rows["DP(8)"]["s/step"]), rel=2e-3)
    out = io.StringIO()
    assert planner.run_plan(parser.parse_args(["--device", "a100", "--attention-kernel", "fa1"]), out=out) == 0
    assert float(_rows(out.getvalue())["DP(8)"]["s/step"]) > 2 * float(rows["DP(8)"]["s/step"])
    plans = json.loads((tmp_path / "p.json").read_text())["plans"]
    assert {p["bound"] for p in plans} <= set(timing.BOUNDS)
    assert all(p["s_per_step"] > 0 and p["tokens_per_s_per_gpu"] > 0 for p in plans)
    assert planner.run_plan(parser.parse_args(["--device", "a100", "--attention-kernel", "cudnn"]),
                            out=io.StringIO()) == 1


def test_the_anchors_count_flops_as_their_sources_do():
    # Ulysses' Tables 2-3 and ALST's Tables 2-4 give both time and TFLOPs: Megatron-DeepSpeed's formula with
    # checkpointing (factor 4, full s x s attention) over those times gives the published TFLOPs within 0.4%
    # (ALST's at its recipes' lengths, 0.5M, 3.8M and 15.5M).
    timed = [a for a in planner.TIME_ANCHORS if a.published_tflops is not None and a.published_seconds is not None]
    assert len(timed) == 8
    for anchor in timed:
        tflops = anchor.count_flops(anchor) / (anchor.published_seconds * anchor.gpus * 1e12)
        assert tflops == pytest.approx(anchor.published_tflops, rel=4e-3), anchor.label
    # NeMo's table gives TFLOPs, layout and global batch; the implied step time follows from its formula.
    nemo = next(a for a in planner.TIME_ANCHORS if a.seq_len == 131072 and a.published_seconds is None)
    assert (nemo.tp, nemo.sp, nemo.dp, nemo.sequences_per_step, nemo.micro_batches) == (4, 4, 8, 32, 4)
    assert nemo.seconds == pytest.approx(14.51, abs=0.01)
    # The blog gives tokens/s: 8 sequences of 64K a step at 13,396 tokens/s
    blog = next(a for a in planner.TIME_ANCHORS if a.label == "HF Ulysses blog Qwen3-4B 64K, 4 H100")
    assert blog.seconds == pytest.approx(8 * 65536 / 13396) and not blog.in_fit


def test_the_model_against_published_throughput():
    comparisons = planner.compare_anchors()
    assert len(comparisons) == len(planner.TIME_ANCHORS) == 23
    by_source = {}
    for c in comparisons:
        by_source.setdefault(c.anchor.label.split(" ")[0], []).append(c)
    for c in comparisons:
        if c.anchor.ep == 1:  # the dense runs: compute-bound, the communication exposing at most 12% of a step
            assert c.time.bound == timing.COMPUTE and c.time.exposed_comm < 0.12 * c.time.seconds, c.anchor.label
    # The kernels alone, nothing fitted: DeepSpeed-Ulysses (FlashAttention 1 on A100), ALST (FlashAttention 2
    # on H100) and Megatron-Core's MoE layouts (pipelines of 4-8 stages, experts over 4-8 ranks) land within
    # 0.93-1.21x; NeMo's context-parallel runs (cuDNN attention, FP8 matmuls) ran 1.26-1.67x slower than the
    # published kernels give, the more the longer; the blog's short rows 2.7-11x (not fitted).
    for c in by_source["DeepSpeed-Ulysses"] + by_source["ALST"] + by_source["Megatron-Core"]:
        assert 0.93 < c.ratio(1.0) < 1.21, (c.anchor.label, c.ratio(1.0))
    nemo = [c.ratio(1.0) for c in by_source["Megatron"]]
    assert len(nemo) == 8 and all(1.25 < r < 1.7 for r in nemo) and min(nemo) == nemo[0] and max(nemo) == nemo[-1]
    # The fine-grained experts' all-to-all crosses nodes and binds: two thirds of the modelled step.
    g8t8 = by_source["Megatron-Core"][-1]
    assert g8t8.time.bound == timing.INTER_NODE and g8t8.time.exposed_comm > 0.6 * g8t8.time.seconds
    # In sample, the overhead is the geometric mean of the fitted runs' published over kernel times; left out,
    # of the others': a run's own time never enters its left-out figure.
    fitted = [c for c in comparisons if c.anchor.in_fit]
    n = len(fitted)
    assert n == 19
    assert fitted[0].in_sample == pytest.approx(math.exp(sum(math.log(c.implied_overhead) for c in fitted) / n))
    for i, c in enumerate(fitted):
        others = fitted[:i] + fitted[i + 1:]
        assert c.left_out == pytest.approx(math.exp(sum(math.log(o.implied_overhead) for o in others) / (n - 1)))
    slower = dataclasses.replace(fitted[0].anchor, published_seconds=2 * fitted[0].anchor.seconds)
    again = planner.compare_anchors((slower,) + tuple(c.anchor for c in fitted[1:]))
    assert again[0].left_out == pytest.approx(fitted[0].left_out) and again[0].in_sample > fitted[0].in_sample
    # One overhead cannot serve both families: left out it misses some of each by more than 15%.
    left_out = [c.ratio(c.left_out) for c in fitted]
    assert min(left_out) < 0.85 and max(left_out) > 1.25
    # The Ulysses groups of 16 and 32 cross nodes of 8: their all-to-alls ride InfiniBand.
    links = {(c.anchor.gpus, c.anchor.seq_len): c.time.parts["sp_all_to_all"][0] for c in by_source["DeepSpeed-Ulysses"]}
    assert links[(64, 131072)] == timing.INTRA_NODE and links[(256, 131072)] == timing.INTER_NODE
    # The implied overhead is the one that gives the published time.
    c = comparisons[1]
    assert c.seconds(c.implied_overhead) == pytest.approx(c.anchor.seconds, rel=1e-12)


def test_a_pipeline_anchor_times_its_slowest_stage_with_the_bubble():
    moe = next(a for a in planner.TIME_ANCHORS if a.label == "Megatron-Core MoE Mixtral-8x22B, 128 H100")
    assert (moe.tp, moe.ep, moe.pp, moe.dp, moe.micro_batches) == (2, 4, 8, 8, 32)
    plan = timing.anchor_plan(moe)
    assert plan.setting.model.num_layers == 7 and plan.setting.model.experts_per_token == 2
    c = next(c for c in planner.compare_anchors() if c.anchor is moe)
    cluster = planner.Cluster(overhead=1.0, **moe.cluster)
    assert c.time.seconds == pytest.approx(planner.step_time(plan, cluster, 32 + 7).seconds)
    # MFU 46.3% of 989.5 TFLOPs, by Megatron-LM's count
    assert moe.tflops == pytest.approx(0.463 * 989.5)


def test_cli_prints_the_anchor_comparison(tmp_path):
    parser = planner.add_plan_arguments(argparse.ArgumentParser())
    out = io.StringIO()
    assert planner.run_plan(parser.parse_args(["--time-anchors", "--json", str(tmp_path / "a.json")]), out=out) == 0
    text = out.getvalue()
    rows = _rows(text)
    assert len(rows) == 23 and "arxiv.org/abs/2309.14509" in text and "performance_long_sequence.md" in text
    assert "arxiv.org/abs/2506.13996" in text and "huggingface.co/blog/ulysses-sp" in text
    row = rows["DeepSpeed-Ulysses GPT-7B 128K, 64 A100"]
    assert row["published TFLOPs/GPU"] == "165.5" and row["published s/step"] == "32.43"
    assert row["kernels"] == "a100 fa1, bf16"
    assert float(row["model / published"]) == pytest.approx(float(row["model TFLOPs/GPU"]) / 165.526667, abs=0.01)
    assert rows["HF Ulysses blog Qwen3-4B 8K, 4 H100"]["left out"] == "(not fitted)"
    assert re.search(r"The kernels alone land \d+ of 23 runs within 0\.8-1\.25x", text)
    anchors = json.loads((tmp_path / "a.json").read_text())["time_anchors"]
    assert {a["run"] for a in anchors} == set(rows)
    assert all(a["model_over_published_left_out"] is None for a in anchors if not a["in_fit"])
