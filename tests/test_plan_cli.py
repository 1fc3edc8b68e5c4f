"""``ds-tsp plan`` (ds_tsp.planning.cli), its tables, plot and serving plans:
what the command prints and writes."""

import argparse
import contextlib
import io
import json

import pytest

from ds_tsp import planning as planner
from plan_helpers import HOST_GB, paper_plans


def test_table_renders_with_the_paper_column():
    plans = list(paper_plans().values())
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


def test_serve_gives_the_longest_context_that_fits(tmp_path):
    """``--serve``: Llama-3-8B on 8 x 80 GB, bf16. By hand: a token's K and V
    in every layer are 2 * 32 * 8 * 128 * 2 bytes, whole on one device, an
    eighth (one head each) under TP(8) and an eighth of the tokens under TSP(8)."""
    plans = planner.serving_plans("llama3-8b", 8)
    single, tp, tsp = plans
    assert single.kv_per_token == 2 * 32 * 8 * 128 * 2 and tp.kv_per_token == single.kv_per_token / 8
    assert single.weights == planner.model_shape("llama3-8b").params * 2
    assert tsp.weights < tp.weights < single.weights  # TP keeps the embedding whole
    budget = 80e9
    for p in plans:
        longest = p.longest_context(budget)
        assert p.weights + p.kv_cache(longest) <= budget < p.weights + p.kv_cache(longest + (8 if p is tsp else 1))
    parser = planner.add_plan_arguments(argparse.ArgumentParser())
    out = io.StringIO()
    args = parser.parse_args(["--serve", "--model", "llama3-8b", "--memory-gb", "80", "--json",
                              str(tmp_path / "serve.json")])
    assert planner.run_plan(args, out=out) == 0
    assert f"| TSP(8) | 2.01 | 0.0000 | 0.0168 | {tsp.longest_context(budget):,} |" in out.getvalue()
    assert planner.run_plan(parser.parse_args(["--serve"]), out=io.StringIO()) == 1  # no --memory-gb


def test_cli_max_seq_len_and_alst(tmp_path):
    parser = planner.add_plan_arguments(argparse.ArgumentParser())
    out = io.StringIO()
    args = parser.parse_args(["--max-seq-len", "--model", "llama3.1-8b", "--devices", "8", "--memory-gb", "80",
                              "--host-memory-gb", "2000", "--json", str(tmp_path / "longest.json")])
    assert planner.run_plan(args, out=out) == 0
    text = out.getvalue()
    assert "| strategy | layout | longest sequence | binding term |" in text
    assert "| TSP(8) + offload |" in text and "host memory for offloaded checkpoints" in text
    assert "3,700,000 (3.70M)" in text and "ALST published" in text
    doc = json.loads((tmp_path / "longest.json").read_text())["max_seq_len"]
    assert [s["devices"] for s in doc] == [8]
    rows = {r["strategy"]: r for r in doc[0]["results"]}
    assert rows[planner.alst_name(8)]["published_seq_len"] == 3_700_000
    assert rows["TSP(8) + offload"]["binding_term"] == "host memory for offloaded checkpoints"
    assert rows["TSP(8) + offload"]["longest_seq_len"] > 0
    assert doc[0]["fpdt_published_seq_len"] is None
    # FPDT's published 2M for an 8B model on 4 x 80 GB, beside.
    out = io.StringIO()
    assert planner.run_plan(parser.parse_args(["--max-seq-len", "--model", "llama3.1-8b", "--devices", "4",
                                               "--memory-gb", "80"]), out=out) == 0
    assert "FPDT published 2,000,000 (2.00M) for an 8B model of this shape on 4 x 80 GB: TSP(4) + offload is" in \
        out.getvalue()

    # The ALST setting: 1, 8 and 32 x 80 GB, published lengths beside, the assumed host memory.
    out = io.StringIO()
    assert planner.run_plan(parser.parse_args(["--alst"]), out=out) == 0
    text = out.getvalue()
    for devices, published in planner.ALST_PUBLISHED.items():
        assert f"### llama3.1-8b on {devices} x 80 GB" in text and f"{published:,}" in text
    assert f"{HOST_GB:g} GB host memory per node" in text and "K/V of one head group" in text
    # Another model or device memory: no published column values.
    out = io.StringIO()
    assert planner.run_plan(parser.parse_args(["--max-seq-len", "--model", "llama3.1-8b", "--memory-gb", "141"]),
                            out=out) == 0
    assert "3,700,000" not in out.getvalue()
    for bad in (["--max-seq-len"], ["--alst", "--paper"], ["--max-seq-len", "--memory-gb", "80",
                                                           "--offload-optimizer"]):
        assert planner.run_plan(parser.parse_args(bad), out=io.StringIO()) == 1
    # The per-length table takes the new options too and says so.
    out = io.StringIO()
    assert planner.run_plan(parser.parse_args(["--seq-len", "1M", "--token-tile", "8192", "--zero-stage", "1",
                                               "--activation-checkpointing", "--offload-activations",
                                               "--offload-optimizer"]), out=out) == 0
    assert "tsp.token_tile 8192" in out.getvalue() and "Host memory per node of 8 ranks" in out.getvalue()


def test_moe_cli_prints_the_expert_facts():
    parser = planner.add_plan_arguments(argparse.ArgumentParser())
    out = io.StringIO()
    assert planner.run_plan(parser.parse_args(["--model", "qwen3-30b-a3b", "--seq-len", "32K"]), out=out) == 0
    text = out.getvalue()
    print(text[text.index("Mixture of experts"):])
    assert "30.53B total, 3.35B active" in text and "16 of 128 experts" in text
    assert "expert ring" in text and "token all-to-all" in text and "cheaper" in text
    assert 'tsp.moe_schedule "auto" (the default) picks it ("all_to_all")' in text  # 32K tokens: 9x fewer bytes
    assert "AutoTP(8) 58.0" in text and "every expert on every device" in text and "refuses" not in text
    out = io.StringIO()
    assert planner.run_plan(parser.parse_args(["--seq-len", "4K"]), out=out) == 0
    assert "Mixture of experts" not in out.getvalue()


def test_hybrid_cli_marks_the_inexact_strategies(tmp_path):
    parser = planner.add_plan_arguments(argparse.ArgumentParser())
    out = io.StringIO()
    args = ["--model", "qwen3-next-80b-a3b", "--seq-len", "128K", "--devices", "16", "--zero-stage", "3",
            "--memory-gb", "141", "--json", str(tmp_path / "plan.json")]
    assert planner.run_plan(parser.parse_args(args), out=out) == 0
    text = out.getvalue()
    assert "36 of the 48 layers Gated DeltaNet" in text and "| TSP(16) |" in text and "| TP(16) |" in text
    assert "| SP-Ulysses(16) (not exact) |" in text and "Not exact: SP-Ulysses(16), CP-allgather(16)" in text
    assert "Recommended: TSP(16)" in text and "Mixture of experts" in text
    inexact = {p["strategy"]: p["inexact"] for p in json.loads((tmp_path / "plan.json").read_text())["plans"]}
    assert inexact["SP-Ulysses(16)"] and not inexact["TSP(16)"]
    # Not modelled for hybrids: LoRA (no adapters on the linear layers).
    assert planner.run_plan(parser.parse_args(["--model", "qwen3.5-27b", "--lora-rank", "8"]),
                            out=io.StringIO()) == 1


def test_serving_a_recurrent_hybrid_keeps_its_states_whatever_the_context():
    """``--serve`` for Nemotron-H-8B on 8 x 80 GB, bf16. By hand: its 4 attention layers cache K and V, 2 * 4 *
    8 * 128 * 2 bytes a token; its 24 Mamba-2 mixers keep a state each (128 heads of 64 x 128, float32) and their
    convolutions' last 3 inputs (8192 + 2 * 1024 channels, bf16), whatever the context: whole on one device and
    under AutoTP (which leaves them whole), an eighth on each TSP rank."""
    single, tp, tsp = planner.serving_plans("nemotron-h-8b", 8)
    state = 24 * (4 * 128 * 64 * 128 + 2 * (8192 + 2048) * 3)
    assert single.kv_per_token == 2 * 4 * 8 * 128 * 2 and tsp.kv_per_token == single.kv_per_token
    assert single.recurrent_state == tp.recurrent_state == state and tsp.recurrent_state == state / 8
    budget = 80e9
    for p in (single, tp, tsp):
        longest = p.longest_context(budget)
        resident = p.weights + p.recurrent_state
        assert resident + p.kv_cache(longest) <= budget < resident + p.kv_cache(longest + (8 if p is tsp else 1))
    assert tsp.longest_context(budget) > tp.longest_context(budget) > single.longest_context(budget)
    # Twice the batch, twice the states.
    assert planner.serving_plans("nemotron-h-8b", 8, micro_batch=2)[2].recurrent_state == 2 * tsp.recurrent_state


def test_cli_plans_experts_folded_across_the_replicas(tmp_path):
    # Qwen3-30B-A3B on 16 devices in TSP groups of 4: experts over the 4 (32 of 128 a layer) and, "auto",
    # folded over all 16 (8 a layer) with ZeRO-1; the options' refusals name them.
    parser = planner.add_plan_arguments(argparse.ArgumentParser())
    out = io.StringIO()
    args = ["--model", "qwen3-30b-a3b", "--seq-len", "32K", "--devices", "16", "--tsp-size", "4", "--zero-stage", "1",
            "--expert-parallel-size", "auto", "--json", str(tmp_path / "plan.json")]
    assert planner.run_plan(parser.parse_args(args), out=out) == 0
    text = out.getvalue()
    assert "| TSP(4) x DP(4) |" in text and "| TSP(4) x DP(4), EP(16) |" in text
    assert "tsp.expert_parallel_size 16" in text and "TSP(4) x DP(4), EP(16) 3.6 (8 a layer" in text
    assert "the token all-to-all over 16 ranks" in text
    # A quarter of the experts' weights, but the all-to-all keeps its rows (2 k H a token and layer) where the
    # ring keeps none: under the same schedule, the folded row's peak is the lower.
    rows = {p["strategy"]: p for p in json.loads((tmp_path / "plan.json").read_text())["plans"]}
    assert rows["TSP(4) x DP(4), EP(16)"]["memory_gb"]["weights"] < rows["TSP(4) x DP(4)"]["memory_gb"]["weights"] / 3
    assert planner.run_plan(parser.parse_args(args + ["--moe-schedule", "all_to_all"]), out=io.StringIO()) == 0
    rows = {p["strategy"]: p for p in json.loads((tmp_path / "plan.json").read_text())["plans"]}
    assert rows["TSP(4) x DP(4), EP(16)"]["peak_gb"] < rows["TSP(4) x DP(4)"]["peak_gb"]
    for refused, message in ((["--expert-parallel-size", "12"], "expert_parallel_size = 12 must be a multiple"),
                             (["--tsp-size", "3"], "tsp_size must be an integer dividing devices"),
                             (["--max-seq-len", "--memory-gb", "80"], "--tsp-size, --expert-parallel-size")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = planner.run_plan(parser.parse_args(args[:8] + ["--expert-parallel-size", "16"] + refused),
                                    out=io.StringIO())
        assert code == 1 and message in err.getvalue()
    with pytest.raises(SystemExit):
        parser.parse_args(["--expert-parallel-size", "many"])
