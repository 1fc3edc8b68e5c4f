"""benchmarks/compare.py end to end at the smallest settings: every strategy
runs at D=2, trains the single-process model, and TSP's bytes equal the plan."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_compare_runs_every_strategy_at_the_smallest_settings(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "compare.py"), "--sizes", "2", "--seq-lens", "16", "32",
           "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
           "--vocab", "64", "--warmup", "1", "--steps", "1", "--strategy-timeout", "60", "--out", str(tmp_path)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    doc = json.load(open(tmp_path / "compare_2.json"))
    assert sorted(doc["strategies"]) == ["autotp", "single", "tsp", "ulysses", "ulysses_zero3"]
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
    for seq_len, row in doc["tsp_bytes"].items():
        assert row["measured_total"] == row["total"] and row["measured_blocks"] == row["blocks"], (seq_len, row)
    markdown = open(tmp_path / "compare.md").read()
    assert markdown.startswith("Command: `") and "| TSP (2) | 32 |" in markdown
    assert (tmp_path / "compare_memory.png").stat().st_size > 0 and (tmp_path / "compare_time.png").stat().st_size > 0
