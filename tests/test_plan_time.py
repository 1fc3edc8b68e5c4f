"""The step-time model (ds_tsp.planning.timing) against hand-computed values,
its overlap and link rules, ``ds-tsp plan``'s time columns, and the published
throughput of DeepSpeed-Ulysses and Megatron context parallelism."""

import argparse
import io
import json
import math
import re

import pytest

from ds_tsp import planning as planner
from ds_tsp.planning import timing
from ds_tsp.planning.plan_types import CommPart

H100 = planner.Cluster()  # 989.4 TFLOPs x 0.5, NVLink 450 GB/s, InfiniBand 50 GB/s per device each way


def _shape(layers=2):
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
                num_key_value_heads=4, head_dim=8, vocab_size=256)


def _by_name(*args, **kwargs):
    return {p.name: p for p in planner.plan(*args, **kwargs)}


def test_one_device_is_compute_bound_at_peak_times_efficiency():
    for p in planner.plan("llama-7b", 4096, 1, 1, activation_checkpointing=True):
        assert p.comm_parts == {}  # nothing to send on one device
        time = planner.step_time(p, H100)
        assert time.seconds == pytest.approx(p.flops_per_step / (989.4e12 * 0.5), rel=1e-12)
        assert time.bound == timing.COMPUTE and time.exposed_comm == pytest.approx(0, abs=1e-15)
        assert time.tflops_per_device == pytest.approx(494.7)
        assert time.tokens_per_s_per_device == pytest.approx(4096 / time.seconds)


def test_attention_flops_by_hand_and_a_faster_matmul_peak():
    # L=2, B=2, S=32, nq=8, d=8: causal attention 2*B*S^2*nq*d forward; flash backward 2.5x; checkpointing +1x.
    attn = 2 * 2 * 32 ** 2 * 8 * 8
    for checkpointing, passes in ((False, 3.5), (True, 4.5)):
        plans = _by_name(_shape(), 32, 2, 2, activation_checkpointing=checkpointing)
        assert plans["DP(2)"].attention_flops_per_step == pytest.approx(2 * attn * passes)
        assert plans["TP(2)"].attention_flops_per_step == pytest.approx(2 * attn * passes / 2)
        assert plans["TSP(2)"].attention_flops_per_step == pytest.approx(2 * attn * passes / 2)
    # flash-attn's TSP backward runs the attention forward again
    recompute = _by_name(_shape(), 32, 2, 2, tsp_attention_backward="recompute")
    assert recompute["TSP(2)"].attention_flops_per_step == pytest.approx(2 * attn * 4.5 / 2)
    # FP8 matmuls beside BF16 attention: only the rest of the FLOPs runs at the faster peak
    p = _by_name("llama-7b", 65536, 1, 1)["DP(1)"]
    fp8 = planner.Cluster(matmul_peak_tflops=2 * 989.4)
    attention, rest = p.attention_flops_per_step, p.flops_per_step - p.attention_flops_per_step
    assert 0 < attention < p.flops_per_step
    assert timing.compute_seconds(p, fp8) == pytest.approx((attention + rest / 2) / (989.4e12 * 0.5))


def test_links_of_a_group():
    assert not timing.crosses_nodes(8, 1, 8) and not timing.crosses_nodes(4, 2, 8)
    assert timing.crosses_nodes(16, 1, 8) and timing.crosses_nodes(2, 8, 8)
    assert timing.crosses_nodes(6, 1, 8)  # groups of 6 consecutive ranks straddle nodes of 8
    assert not timing.crosses_nodes(1, 64, 8)
    nbytes = 15e9
    inside = CommPart(nbytes, 8, 1, "all_gather")
    assert timing.part_seconds(inside, 8, H100) == (timing.INTRA_NODE, pytest.approx(nbytes / 450e9))
    ring = CommPart(nbytes, 16, 1, "all_gather")  # crossing: every byte at the inter-node bandwidth
    assert timing.part_seconds(ring, 8, H100) == (timing.INTER_NODE, pytest.approx(nbytes / 50e9))
    # An all-to-all over 16 ranks on 2 nodes: 8 of the 15 peers are remote, their share goes over InfiniBand.
    a2a = CommPart(nbytes, 16, 1, "all_to_all")
    assert timing.part_seconds(a2a, 8, H100) == (timing.INTER_NODE, pytest.approx(nbytes * 8 / 15 / 50e9))
    # 4 ranks 4 apart: 2 on each node, 2 of the 3 peers remote.
    strided = CommPart(nbytes, 4, 4, "all_to_all")
    assert timing.part_seconds(strided, 8, H100) == (timing.INTER_NODE, pytest.approx(nbytes * 2 / 3 / 50e9))
    # With a network twice NVLink's speed the local share (7 peers of 15) takes longer
    fast = planner.Cluster(inter_node_gb_s=900.0)
    assert timing.part_seconds(a2a, 8, fast) == (timing.INTRA_NODE, pytest.approx(nbytes * 7 / 15 / 450e9))


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


def test_cli_prints_the_time_columns(tmp_path):
    parser = planner.add_plan_arguments(argparse.ArgumentParser())
    out = io.StringIO()
    assert planner.run_plan(parser.parse_args(["--json", str(tmp_path / "p.json")]), out=out) == 0
    rows = _rows(out.getvalue())
    assert "Time (timing): 989.4 TFLOPs peak x 0.5 efficiency" in out.getvalue()
    for name, row in rows.items():
        assert row["bound"] in timing.BOUNDS, name
        assert float(row["s/step"]) > 0 and int(row["tok/s/GPU"].replace(",", "")) > 0
    # DP(8) holds no comm it cannot hide (its gradient reduction overlaps), so a quarter efficiency halves it
    args = ["--efficiency", "0.25", "--peak-tflops", "989.4", "--intra-node-bandwidth", "450",
            "--inter-node-bandwidth", "50"]
    out = io.StringIO()
    assert planner.run_plan(parser.parse_args(args), out=out) == 0
    slower = _rows(out.getvalue())
    assert float(slower["DP(8)"]["s/step"]) == pytest.approx(2 * float(rows["DP(8)"]["s/step"]), rel=2e-3)
    plans = json.loads((tmp_path / "p.json").read_text())["plans"]
    assert {p["bound"] for p in plans} <= set(timing.BOUNDS)
    assert all(p["s_per_step"] > 0 and p["tokens_per_s_per_gpu"] > 0 for p in plans)
    assert planner.run_plan(parser.parse_args(["--efficiency", "1.5"]), out=io.StringIO()) == 1


def test_the_anchors_count_flops_as_their_sources_do():
    # Ulysses' Tables 2-3 give both time and TFLOPs: Megatron-DeepSpeed's formula with checkpointing
    # (factor 4, full s x s attention) over those times gives the published TFLOPs within 0.3%.
    ulysses = [a for a in planner.TIME_ANCHORS if a.published_seconds is not None]
    assert len(ulysses) == 5
    for anchor in ulysses:
        tflops = anchor.count_flops(anchor) / (anchor.published_seconds * anchor.gpus * 1e12)
        assert tflops == pytest.approx(anchor.published_tflops, rel=3e-3), anchor.label
    # NeMo's table gives TFLOPs and layout only; the implied step time follows from its formula.
    nemo = next(a for a in planner.TIME_ANCHORS if a.seq_len == 131072 and a.published_seconds is None)
    assert (nemo.tp, nemo.sp, nemo.dp, nemo.published_tflops) == (4, 4, 8, 555.0)
    assert nemo.seconds == pytest.approx(3.63, abs=0.01)


def test_the_model_against_published_throughput():
    comparisons = planner.compare_anchors()
    assert len(comparisons) == len(planner.TIME_ANCHORS) == 8
    for c in comparisons:
        # Compute-bound everywhere: the modelled communication exposes at most 12% of a step.
        assert c.time.bound == timing.COMPUTE and c.time.exposed_comm < 0.13 * c.time.seconds, c.anchor.label
        # At the default efficiency 0.5 the model is 1.35-1.69x too fast: these runs spend 60-86% of their
        # FLOPs in attention, which they ran near a third of peak (implied 0.29-0.36), not at the half that
        # Megatron-LM reached on dense matmuls. Reported, not tuned away.
        assert 1.3 < c.ratio < 1.75, (c.anchor.label, c.ratio)
        assert 0.28 < c.implied_efficiency < 0.37, (c.anchor.label, c.implied_efficiency)
    # One efficiency for all eight runs, two GPU generations, 64-256 GPUs and 64K-256K tokens puts every
    # one within 0.7-1.3x: what is left is the compute rate, not the shape of the model.
    for c in planner.compare_anchors(efficiency=1 / 3):
        assert 0.7 < c.ratio < 1.3, (c.anchor.label, c.ratio)
    # The Ulysses groups of 16 and 32 cross nodes of 8: their all-to-alls ride InfiniBand.
    links = {(c.anchor.gpus, c.anchor.seq_len): c.time.parts["sp_all_to_all"][0] for c in comparisons
             if c.anchor.kind == "ulysses"}
    assert links[(64, 131072)] == timing.INTRA_NODE and links[(256, 131072)] == timing.INTER_NODE
    # The implied efficiency is the one that gives the published time; the default misses it by over 20%.
    c = comparisons[1]
    again = planner.compare_anchor(c.anchor, efficiency=c.implied_efficiency)
    assert again.seconds == pytest.approx(c.anchor.seconds, rel=1e-9)
    assert not math.isclose(c.seconds, c.anchor.seconds, rel_tol=0.2)


def test_cli_prints_the_anchor_comparison(tmp_path):
    parser = planner.add_plan_arguments(argparse.ArgumentParser())
    out = io.StringIO()
    assert planner.run_plan(parser.parse_args(["--time-anchors", "--json", str(tmp_path / "a.json")]), out=out) == 0
    text = out.getvalue()
    rows = _rows(text)
    assert len(rows) == 8 and "arxiv.org/abs/2309.14509" in text and "performance_long_sequence.md" in text
    row = rows["DeepSpeed-Ulysses GPT-7B 128K, 64 A100"]
    assert row["published TFLOPs/GPU"] == "165.5" and row["published s/step"] == "32.43"
    assert float(row["model / published"]) == pytest.approx(float(row["model TFLOPs/GPU"]) / 165.526667, abs=0.01)
    assert re.search(r"At efficiency 0\.5 the model is 1\.\d\d-1\.\d\dx the published throughput", text)
    anchors = json.loads((tmp_path / "a.json").read_text())["time_anchors"]
    assert {a["run"] for a in anchors} == set(rows)
