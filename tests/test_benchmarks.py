"""The benchmarks (compare.py, longest.py, fidelity.py, block_overhead.py,
inference.py) end to end at the smallest settings. compare, in one run: every
strategy of the dense row at D=2 trains the single-process model, both TSP
strategies' bytes equal the planner's op by op on every rank, and every
measured peak has its planned counterpart; its MoE row likewise at D = 4, with
TSP's MoE schedules and AutoEP."""

import json
import os

import pytest

from float32_control import ROUNDING_FLOOR
from scripts import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory, rank_pools):
    """compare.py's dense row at D = 2 and MoE row at D = 4 in one run (one set of imports and one single-process
    reference per row): a one-layer model 64 wide, 32 tokens, an odd vocabulary (the folded shards carry a
    padding row at D = 2); the MoE row a Qwen3-MoE of 4 experts, top-2. Every strategy but AutoEP + ZeRO-3 (left
    out to save time)."""
    rank_pools.close()  # as own_processes: the run's ranks get the cores
    out = tmp_path_factory.mktemp("compare")
    cmd = [os.path.join(ROOT, "benchmarks", "compare.py"), "--models", "dense", "moe", "--sizes", "2",
           "--moe-sizes", "4", "--seq-lens", "32", "--layers", "1", "--hidden", "64", "--heads", "4",
           "--kv-heads", "2", "--intermediate", "128", "--experts", "4", "--top-k", "2", "--expert-intermediate", "32",
           "--vocab", "67", "--warmup", "1", "--steps", "1", "--strategy-timeout", "120", "--out", str(out),
           "--strategies", "tsp", "tsp_replicated_vocab", "tsp_ring", "tsp_all_to_all", "autotp", "ulysses",
           "ulysses_zero3", "autoep"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = run_script(cmd, env=env, cwd=ROOT, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_compare_runs_every_strategy_at_the_smallest_settings(compare_run):
    tmp_path = compare_run
    doc = json.load(open(tmp_path / "compare_2.json"))
    assert sorted(doc["strategies"]) == ["autotp", "single", "tsp", "tsp_replicated_vocab", "ulysses",
                                         "ulysses_zero3"]
    for name, entry in doc["strategies"].items():
        for seq_len, result in entry["results"].items():
            assert not isinstance(result, str), f"{name} at {seq_len}: {result}"
            summary = result["summary"]
            print(f"{name} S={seq_len}: peak {summary['peak_live_mib']:.2f} MiB, "
                  f"recv {summary['received_mib_per_step']:.3f} MiB/step, loss diff "
                  f"{summary.get('max_loss_diff_vs_single', 0):.1e}")
            assert summary["peak_live_mib"] >= summary["state_mib"] > 0
            # fp32, one layer, two steps: summation order alone moves the loss ~1e-7.
            assert summary.get("max_loss_diff_vs_single", 0.0) < 1e-4
            assert (summary["received_mib_per_step"] > 0) == (name != "single")
            planned = doc["planned_peak"][name][seq_len]
            assert planned["planned_mib"] > 0 and planned["measured_mib"] == summary["peak_live_mib"]
    assert sorted(doc["tsp_bytes"]) == ["tsp", "tsp_replicated_vocab"]
    for name, rows in doc["tsp_bytes"].items():
        for seq_len, row in rows.items():
            assert row["measured_by_op"] == row["planned_by_op"], (name, seq_len, row)
            assert row["measured"] == row["planned"] and row["max_op_deviation"] == 0, (name, seq_len, row)
    # The folded vocabulary moves the head round the ring and the embedding by all-to-all; the replicated one
    # all-reduces their gradients instead: the two TSP strategies differ in those ops only.
    folded, replicated = (doc["tsp_bytes"][name]["32"]["measured_by_op"][0]
                          for name in ("tsp", "tsp_replicated_vocab"))
    assert "all_to_all" in folded and "all_to_all" not in replicated
    assert replicated["all_reduce"] > folded["all_reduce"] and folded["ring"] > replicated["ring"]
    markdown = open(tmp_path / "compare.md").read()
    assert markdown.startswith("Command: `") and "| TSP (2) | 32 |" in markdown
    assert "| TSP, replicated vocab (2) | 32 |" in markdown and "folded / replicated" in markdown
    assert (tmp_path / "compare_memory.png").stat().st_size > 0 and (tmp_path / "compare_time.png").stat().st_size > 0


def test_compare_moe_row_at_the_smallest_settings(compare_run):
    """The MoE row (a one-layer Qwen3-MoE, 4 experts, top-2) at D = 4, one expert per rank: TSP under "auto",
    "ring" and "all_to_all", Ulysses + ZeRO-3 and AutoEP train the single-process model; the ring's counted
    bytes equal the planner's op by op on every rank, the all-to-all's are planned for even routing and
    marked so; auto picks the all-to-all at 8 local tokens and moves no more than the cheaper schedule, the
    all-to-all no more than AutoEP; AutoTP, DeepSpeed's business, either trains the model (then it is a row
    of the MoE table) or is reported as refused; TSP has the lowest peak."""
    tmp_path = compare_run
    doc = json.load(open(tmp_path / "compare_moe_4.json"))
    assert doc["model"]["arch"] == "Qwen3MoeForCausalLM" and doc["model"]["experts"] == 4
    assert sorted(doc["strategies"]) == ["autoep", "autoep_zero3", "autotp", "single", "tsp", "tsp_2x2",
                                         "tsp_2x2_ep4", "tsp_all_to_all", "tsp_ring", "ulysses", "ulysses_zero3"]
    summaries = {}
    for name in ("single", "tsp", "tsp_ring", "tsp_all_to_all", "ulysses", "ulysses_zero3", "autoep", "autotp"):
        result = doc["strategies"][name]["results"]["32"]
        if name == "autotp" and isinstance(result, str):  # whether AutoTP takes a MoE model is DeepSpeed's choice
            assert result.startswith("unsupported: ") and len(result) > len("unsupported: "), result
            continue
        assert not isinstance(result, str), f"{name}: {result}"
        summary = summaries[name] = result["summary"]
        print(f"MoE D=4 {name} S=32: peak {summary['peak_live_mib']:.3f} MiB, recv "
              f"{summary['received_mib_per_step']:.3f} MiB/step, loss diff "
              f"{summary.get('max_loss_diff_vs_single', 0):.1e}")
        assert summary.get("max_loss_diff_vs_single", 0.0) < 1e-4
    for name in ("single", "tsp_ring", "ulysses", "ulysses_zero3"):
        planned = doc["planned_peak"][name]["32"]
        assert planned["planned_mib"] > 0 and planned["measured_mib"] == summaries[name]["peak_live_mib"]
    assert not {"autotp", "autoep", "tsp_all_to_all"} & set(doc["planned_peak"])  # no planner figure for these
    assert summaries["tsp"]["peak_live_mib"] < min(summaries[n]["peak_live_mib"] for n in ("ulysses", "ulysses_zero3",
                                                                                          "autoep"))
    moved = {name: summaries[name]["received_mib_per_step"] for name in summaries}
    assert moved["tsp"] <= 1.01 * min(moved["tsp_ring"], moved["tsp_all_to_all"])
    # Every rank of AutoEP feeds the whole sequence, a TSP rank 1/D of it: TSP's all-to-all is the smaller. All
    # traffic is not, at this size (one 64-wide layer, 67 tokens of vocabulary): TSP's weight broadcasts and K/V
    # gathers outweigh AutoEP's gradient all-reduce of a model this small; the committed run shows both.
    assert summaries["tsp_all_to_all"]["all_to_all_mib_per_step"] < summaries["autoep"]["all_to_all_mib_per_step"]
    ring, all_to_all, auto = (doc["tsp_bytes"][name]["32"] for name in ("tsp_ring", "tsp_all_to_all", "tsp"))
    assert ring["measured_by_op"] == ring["planned_by_op"] and ring["max_op_deviation"] == 0
    assert (auto["moe_schedule"], all_to_all["moe_schedule"], ring["moe_schedule"]) == ("all_to_all",) * 2 + ("ring",)
    assert auto["even_routing"] and all_to_all["even_routing"] and not ring["even_routing"]
    for row in (auto, all_to_all):  # the same ops as planned; the all-to-all's rows as this batch routed them
        assert all(set(m) == set(p) for m, p in zip(row["measured_by_op"], row["planned_by_op"]))
    markdown = open(tmp_path / "compare_moe.md").read()
    assert "Qwen3-MoE-shaped" in markdown and "| TSP (4) | 32 |" in markdown
    for name, label in (("tsp", "TSP"), ("autoep", "AutoEP"), ("autotp", "AutoTP"), ("ulysses", "Ulysses")):
        assert f"| {label} (4) | 32 |" in markdown, name  # the table has every strategy that ran, or its refusal
    moe_row = next(line for line in markdown.splitlines() if line.startswith("| 4 | 32 |"))
    assert moe_row.count("|") == 2 + 2 * 6 + 3 + 1  # D, length, six strategies' bytes and peaks, three verdicts
    if "autotp" in summaries:
        assert f"{summaries['autotp']['peak_live_mib']:.1f} |" in moe_row
    else:
        assert "AutoTP at D=4: unsupported: " in markdown
    assert "within 1% of the planner's, op by op and rank by rank, at every D and length: yes" in markdown
    assert "TSP has the lowest per-rank peak memory at every D and length." in markdown
    assert "| all_to_all | yes | NO |" in markdown  # all traffic: see above


def test_longest_finds_the_boundary_of_the_budget(tmp_path, own_processes):
    # A budget a few MiB above TSP's state: the search doubles from 256 tokens, then bisects on multiples of 64.
    budget = 3.0
    cmd = [os.path.join(ROOT, "benchmarks", "longest.py"), "--sizes", "2", "--strategies",
           "tsp_offload", "ulysses", "--budget-mib", str(budget), "--start", "256", "--granularity", "64",
           "--max-len", "4096", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "2",
           "--intermediate", "64", "--vocab", "512", "--token-tile", "32", "--strategy-timeout", "120",
           "--out", str(tmp_path)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = run_script(cmd, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    doc = json.load(open(tmp_path / "longest.json"))
    assert doc["budget_mib"] == budget and doc["best_anchor"]["2"]["strategy"] == "ulysses"
    assert [(e["strategy"], e["tsp_size"]) for e in doc["results"]] == [("tsp_offload", 2), ("ulysses", 2)]
    for entry in doc["results"]:
        assert entry["error"] is None, entry["error"]
        lengths = {row["seq_len"]: row for row in entry["measured"]}
        longest, grid = entry["longest_seq_len"], entry["grid"]
        print(f"{entry['strategy']}: longest {longest}, measured "
              f"{[(s, round(r['peak_mib'], 2), round(r['planned_mib'], 2)) for s, r in sorted(lengths.items())]}")
        assert grid == 64 and longest > 0 and longest % grid == 0
        # The length found fits, the next one on the grid was measured and does not: the search found the boundary.
        assert lengths[longest]["fits"] and lengths[longest]["peak_mib"] <= budget
        assert not lengths[longest + grid]["fits"] and lengths[longest + grid]["peak_mib"] > budget
        assert entry["next_fits"] is False
        # Doubling first: 256, 512, ... up to the first length that does not fit.
        assert entry["order"][:2] == [256, 512]
        for row in lengths.values():
            assert row["fits"] == (row["peak_mib"] <= budget) and row["planned_mib"] > 0
            assert row["planned_over_measured"] == row["planned_mib"] / row["peak_mib"]
            # Issue #32: the planner within 15% of the measured peak at every measured length.
            assert abs(row["planned_over_measured"] - 1) <= 0.15, (entry["strategy"], row["seq_len"])
        # Peak memory grows with the length, as the search assumes.
        peaks = [lengths[s]["peak_mib"] for s in sorted(lengths)]
        assert peaks == sorted(peaks)
    offloaded = doc["results"][0]["measured"]
    # The offloaded optimizer and checkpoints are counted as host memory, and out of the device budget.
    assert all(row["host_peak_mib"] > 0 for row in offloaded)
    assert all(row["host_peak_mib"] == 0 for row in doc["results"][1]["measured"])
    markdown = open(tmp_path / "longest.md").read()
    assert markdown.startswith("Command: `") and "| TSP + offload | 2 |" in markdown
    assert (tmp_path / "longest.png").stat().st_size > 0

    # --replan measures nothing: the planner's side again (the same planner here: the same entries), and a run
    # measured with other options is refused by name.
    replan = run_script(cmd + ["--replan"], env=env, cwd=ROOT, timeout=300)
    assert replan.returncode == 0, replan.stderr[-3000:]
    again = json.load(open(tmp_path / "longest.json"))
    assert again["results"] == doc["results"] and "--replan" in again["replanned"]
    other = run_script(cmd + ["--replan", "--token-tile", "64"], env=env, cwd=ROOT, timeout=300)
    assert other.returncode != 0 and "measured with token_tile = 32, not 64" in other.stderr


def test_bf16_gradient_error_stays_near_the_unsharded_models(tmp_path, own_processes):
    """benchmarks/fidelity.py at D=2, small: TSP's bf16 error against float64,
    with float32 sums (the default) and bf16 ones (``tsp_bf16_sums``), is at
    most 1.5x the unsharded model's for every gradient group and the token
    losses (the committed runs: within 1.1x at D = 2, 4, 8 with float32 sums,
    up to 1.10x at D = 8 with bf16 ones)."""
    cmd = [os.path.join(ROOT, "benchmarks", "fidelity.py"), "--sizes", "2", "--samples", "1",
           "--seq-len", "512", "--loss-batches", "0", "--strategies", "tsp", "tsp_bf16_sums", "--out", str(tmp_path),
           "--name", "fidelity"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = run_script(cmd, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.load(open(tmp_path / "fidelity.json"))
    hf = doc["hf"]
    for strategy in ("tsp", "tsp_bf16_sums"):
        errors = doc["sharded"]["2"][strategy]
        ratios = {key: errors[key] / hf[key] for key in hf if key != "loss" and not key.endswith(".output")}
        print(f"{strategy} bf16 error over the unsharded model's at D=2: "
              + ", ".join(f"{key} {ratio:.2f}x" for key, ratio in ratios.items()))
        assert len(ratios) >= 7 and all(hf[key] > 0 for key in ratios)
        assert max(ratios.values()) <= 1.5


def test_block_overhead_checks_and_times_the_layer_on_cpu(tmp_path, own_processes):
    """benchmarks/block_overhead.py (the prepared GPU script) end to end on CPU: the TSP layer's parity with the
    HF layer and of its fused kernel with SDPA autograd, the grouped-query probe (CPU flash ops take the heads
    natively), and a row of timings in the JSON and the markdown table; on CPU also every other block kind
    (``layer_kinds``), each checked against its Hugging Face module before it is timed."""
    cmd = [os.path.join(ROOT, "benchmarks", "block_overhead.py"), "--device", "cpu", "--preset",
           "small", "--seq-lens", "64", "--repeats", "1", "--out", str(tmp_path)]
    proc = run_script(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.load(open(tmp_path / "block_overhead_cpu.json"))
    assert doc["backends"] == ["sdpa"] and doc["grouped_query"] == {"sdpa": True}
    diffs = doc["parity"]["sdpa"]["float32"]
    assert max(diffs["out"], diffs["grad_x"]) <= 1e-4 * diffs["scale"], diffs
    assert max(doc["kernel_check"]["sdpa"][k] for k in ("out", "dq", "dk", "dv")) <= 1e-4, doc["kernel_check"]
    (row,) = doc["rows"]
    assert row["seq_len"] == 64 and row["hf_s"] > 0 and row["tsp_sdpa_over_hf"] == row["tsp_sdpa_s"] / row["hf_s"]
    assert "| 64 |" in open(tmp_path / "block_overhead_cpu.md").read()
    kinds = {row["kind"]: row for row in doc["kinds"]}
    assert len(kinds) == len(doc["kinds"]) == 9, sorted(kinds)
    for kind, row in kinds.items():
        assert max(row["max_diff_out"], row["max_diff_grad_x"]) <= 1e-4 * row["max_diff_scale"], row
        assert row["hf_s"] > 0 and row["tsp_over_hf"] == row["tsp_s"] / row["hf_s"] and row["control"] > 0
        assert f"| {kind} | 64 |" in open(tmp_path / "block_overhead_cpu.md").read()


def test_compile_steps_times_eager_and_compiled_training(tmp_path, own_processes):
    """benchmarks/compile_steps.py on its smallest run: Llama at TSP 2, eager and under engine.compile(), the
    same losses (float32's rounding floor of their scale), step times in the JSON and the table, and each
    layer's graph breaks counted on every rank, the same on each."""
    cmd = [os.path.join(ROOT, "benchmarks", "compile_steps.py"), "--models", "llama", "--steps", "3", "--warmup",
           "1", "--seq-len", "32", "--out", str(tmp_path)]
    proc = run_script(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.load(open(tmp_path / "compile_cpu.json"))["results"]["llama"]
    assert row["max_loss_diff"] <= ROUNDING_FLOOR * max(map(abs, row["losses"])), row
    assert row["eager_s"] > 0 and row["compiled_s"] > 0 and len(row["first_compiled_s"]) == 1
    breaks = [layer["breaks"] for layer in row["breaks"]]  # the two layers are of one kind
    assert len(breaks) == 2 and breaks[0] == breaks[1] > 0 and len(row["breaks_per_rank"]) == 2
    per_rank = [[layer["breaks"] for layer in rank] for rank in row["breaks_per_rank"]]
    assert all(counts == breaks for counts in per_rank), per_rank
    assert "| llama |" in open(tmp_path / "compile_cpu.md").read()


def test_inference_runs_every_strategy_at_the_smallest_settings(tmp_path, own_processes):
    """benchmarks/inference.py: one process, DeepSpeed TP inference and TSP at
    D=2 generate the same tokens; TSP's KV cache per rank is half the single
    process's (up to the one generated token of imbalance) and its weights the least."""
    cmd = [os.path.join(ROOT, "benchmarks", "inference.py"), "--sizes", "2", "--prompt-lens", "32",
           "--batches", "2", "--new-tokens", "4", "--layers", "1", "--hidden", "64", "--heads", "4",
           "--kv-heads", "2", "--intermediate", "128", "--vocab", "67", "--strategy-timeout", "120",
           "--out", str(tmp_path)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = run_script(cmd, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    rows = {(r["strategy"], r["prompt_len"], r["batch"]): r for r in json.load(open(tmp_path / "inference.json"))["results"]}
    assert len(rows) == 3
    for (strategy, prompt_len, batch), row in rows.items():
        assert "error" not in row, row
        print(f"{strategy} prompt {prompt_len} batch {batch}: peak {row['peak_live_mib']:.3f} MiB, "
              f"KV {row['kv_cache_mib']:.4f} MiB, {row['decode_tokens_per_s']:.0f} tokens/s")
        assert row["tokens_equal_single"] and row["tokens_agree_across_ranks"]
        assert all(r["peak_live_bytes"] >= r["held_bytes"] + r["kv_cache_bytes"] > 0 for r in row["per_rank"])
        if strategy == "tsp":
            single = rows[("single", prompt_len, batch)]
            token = single["kv_cache_mib"] / (prompt_len + 1)  # prompt + 1 generated token cached
            assert abs(row["kv_cache_mib"] - single["kv_cache_mib"] / 2) <= token
            assert row["held_mib"] < rows[("tp", prompt_len, batch)]["held_mib"] < single["held_mib"]
            assert row["tsp_decode_step_received_kib"] > 0
    markdown = open(tmp_path / "inference.md").read()
    assert "| TSP | 2 | 32 | 2 |" in markdown and "TSP (2) / TP (2) peak" in markdown
    assert (tmp_path / "inference.png").stat().st_size > 0


def test_batch_check_times_the_check_against_a_step(tmp_path, own_processes):
    """benchmarks/batch_check.py at 64 tokens: the check and both steps are
    timed on every rank and the table is written (the committed run at 2048
    tokens is benchmarks/results/batch_check_cpu.md)."""
    cmd = [os.path.join(ROOT, "benchmarks", "batch_check.py"), "--seq-lens", "64", "--repeats", "1",
           "--strategy-timeout", "120", "--out", str(tmp_path)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = run_script(cmd, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.load(open(tmp_path / "batch_check_cpu.json"))["rows"]["64"]
    print(row)
    assert 0 < row["check_s"] < row["step_off_s"] and row["step_on_s"] > 0
    assert "| 64 |" in open(tmp_path / "batch_check_cpu.md").read()


def test_dpo_memory_measures_every_strategy_at_the_smallest_settings(tmp_path, own_processes):
    """benchmarks/dpo_memory.py on a tiny Llama at 256 and 512 tokens a pair: every strategy runs, its DPO loss
    starts at log 2 (policy = reference), ZeRO-3's two heads give the same losses, and TSP's per-rank peak is the
    lowest at each length and grows with it."""
    cmd = [os.path.join(ROOT, "benchmarks", "dpo_memory.py"), "--pair-tokens", "256", "512", "--hidden", "64",
           "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "128", "--vocab", "1000",
           "--out", str(tmp_path)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = run_script(cmd, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.load(open(tmp_path / "dpo_memory.json"))["results"]
    assert set(results) == {"tsp", "zero3", "zero3_tiled"}
    peaks = {name: {tokens: max(rank["peak_live_bytes"] for rank in per_rank) for tokens, per_rank in cells.items()}
             for name, cells in results.items()}
    print({name: {tokens: peak >> 10 for tokens, peak in cells.items()} for name, cells in peaks.items()}, "KiB")
    for cells in results.values():  # the first step's policy is the reference: the loss is log 2
        assert all(abs(rank["losses"][0] - 0.6931471805599453) < 1e-6 for rank in cells["256"])
    # ZeRO-3 with TRL's head and with TSP's at D = 1 train the same pairs alike: the two heads agree.
    for tokens in ("256", "512"):
        for trl_rank, tiled_rank in zip(results["zero3"][tokens], results["zero3_tiled"][tokens]):
            assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(trl_rank["losses"], tiled_rank["losses"]))
    for tokens in ("256", "512"):
        assert peaks["tsp"][tokens] < min(peaks["zero3"][tokens], peaks["zero3_tiled"][tokens])
    assert peaks["tsp"]["512"] > peaks["tsp"]["256"]
    assert "| TSP / zero3 | TSP / zero3_tiled |" in open(tmp_path / "dpo_memory.md").read()


def test_indexer_memory_scratch_does_not_grow_with_the_sequence(tmp_path, own_processes):
    """benchmarks/indexer_memory.py at 8K and 16K tokens (a small indexer: 4 heads of 16, top 128): the scoring's
    scratch beyond its inputs and output is the same at both lengths, and far below a (S, heads, S) score tensor."""
    out = str(tmp_path / "indexer")
    cmd = [os.path.join(ROOT, "benchmarks", "indexer_memory.py"), "--lengths", "8192", "16384", "--heads", "4",
           "--head-dim", "16", "--topk", "128", "--out", out]
    proc = run_script(cmd, env={**os.environ, "DS_ACCELERATOR": "cpu"}, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.load(open(out + ".json"))["results"]
    print([(r["seq_len"], r["scratch_bytes"], r["output_bytes"]) for r in rows])
    assert rows[0]["scratch_bytes"] == rows[1]["scratch_bytes"]
    assert rows[1]["output_bytes"] == 2 * rows[0]["output_bytes"]
    assert rows[1]["scratch_bytes"] < rows[1]["hf_scores_bytes"] / 100
