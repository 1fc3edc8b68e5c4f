"""benchmarks/compare.py end to end at the smallest settings: every strategy
runs at D=2 and trains the single-process model, both TSP strategies' bytes
equal the planner's op by op on every rank, and every measured peak has its
planned counterpart."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_compare_runs_every_strategy_at_the_smallest_settings(tmp_path):
    # An odd vocabulary: the folded shards carry a padding row at D=2.
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "compare.py"), "--sizes", "2", "--seq-lens", "16", "32",
           "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
           "--vocab", "67", "--warmup", "1", "--steps", "1", "--strategy-timeout", "60", "--out", str(tmp_path)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

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
