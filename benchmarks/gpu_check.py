"""The checks only a GPU can make, in one command (``make gpu-check``; issue 60).

* CUDA kernel parity: every attention backend that serves CUDA (sdpa, cudnn,
  flash) in bf16 and fp16, on ``auto``'s parity problems, against float64
  attention within ``PARITY_TOLERANCE``, full causal and windowed, head sizes
  64, 128 and 256;
* the D = 1 overhead of the Llama decoder layer against Hugging Face's
  (``benchmarks/block_overhead.py``, its own JSON and table beside these);
* with two GPUs or more, a 2-rank NCCL run of the engine parity test (TSP 2,
  ZeRO-1, Adam, fp32 and bf16; tests/test_engine.py's ``_train_and_compare``)
  under ``torch.use_deterministic_algorithms``: fp32 within the float32
  control's bound, bf16 reported.

Writes ``gpu_check.json`` and ``gpu_check.md`` under ``--out``. Without CUDA
it says so and exits 0.

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check
"""

import argparse
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_CUDA = "gpu-check needs CUDA (torch.cuda.is_available() is False here): nothing to check"


def kernel_parity():
    """``[{backend, dtype, head_dim, window, worst, tolerance, ok}]`` for every backend serving CUDA."""
    from ds_tsp.blocks.attention.selection import (PARITY_HEADS, PARITY_KV_HEADS, PARITY_SHAPES, PARITY_TOLERANCE,
                                                   PARITY_WINDOW, AttentionProblem, parity_errors, select_kernel)
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for backend in ("sdpa", "cudnn", "flash"):
            try:
                kernel = select_kernel(backend, "cuda", dtype)
            except RuntimeError as refusal:
                rows.append(dict(backend=backend, dtype=str(dtype), refused=str(refusal), ok=True))
                continue
            for head_dim in (64, 128, 256):
                for window in (None, PARITY_WINDOW):
                    worst = 0.0
                    try:
                        for q_len, k_len in PARITY_SHAPES:
                            problem = AttentionProblem.random(2, q_len, k_len, PARITY_HEADS, PARITY_KV_HEADS,
                                                              head_dim, window, dtype, "cuda")
                            worst = max(worst, *parity_errors(kernel, problem).values())
                        error = None
                    except (RuntimeError, TypeError, ValueError) as failure:
                        error = f"{type(failure).__name__}: {failure}"
                    tolerance = PARITY_TOLERANCE[dtype]
                    rows.append(dict(backend=backend, dtype=str(dtype), head_dim=head_dim, window=window,
                                     worst=worst, tolerance=tolerance, error=error,
                                     ok=error is None and worst <= tolerance))
    return rows


def block_overhead(out):
    """``benchmarks/block_overhead.py`` on CUDA; its exit status."""
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "block_overhead.py"), "--device", "cuda",
                          "--out", out], cwd=ROOT)
    return {"returncode": run.returncode, "results": os.path.join(out, "block_overhead_cuda.json"),
            "ok": run.returncode == 0}


def nccl_engine_parity(out):
    """The 2-rank NCCL engine parity run (``--nccl-rank`` under torchrun); its ranks' results."""
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          os.path.abspath(__file__), "--nccl-rank", "--out", out], cwd=ROOT, env=env)
    ranks = []
    for rank in range(2):
        path = os.path.join(out, f"nccl_rank{rank}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else {"error": "no result"})
    return {"returncode": run.returncode, "ranks": ranks,
            "ok": run.returncode == 0 and all(r.get("ok") for r in ranks)}


def nccl_rank(out):
    """One rank of the NCCL run: the engine parity test in fp32 (bounded by the float32 control) and bf16."""
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    torch.use_deterministic_algorithms(True)
    from test_engine import _train_and_compare, assert_within_control

    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        try:
            run = _train_and_compare(tsp_size=2, zero_stage=1, optimizer="adam", dtype=dtype)
            entry = {"max_rel_to_float64": max(run["rel_exact"].values()),
                     "control": max(run["control_rel"].values()), "losses": run["losses"],
                     "ref_losses": run["ref_losses"]}
            if dtype == torch.float32:
                assert_within_control(run, f"NCCL rank {dist.get_rank()} TSP=2 ZeRO-1 adam fp32")
            entry["ok"] = True
        except Exception as failure:  # recorded, so the other dtype and the report still run
            entry = {"error": f"{type(failure).__name__}: {failure}", "ok": False}
        result[str(dtype)] = entry
    result["ok"] = all(entry["ok"] for entry in result.values())
    with open(os.path.join(out, f"nccl_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f, indent=1)
    dist.destroy_process_group()


def table(results):
    lines = ["| check | case | result |", "|---|---|---|"]
    for row in results["kernel_parity"]:
        case = f"{row['backend']} {row['dtype']}" + (f" d={row['head_dim']} window={row['window']}"
                                                     if "head_dim" in row else "")
        verdict = (f"refused: {row['refused']}" if "refused" in row else row["error"] if row.get("error")
                   else f"{row['worst']:.1e} (<= {row['tolerance']:g})" if row["ok"]
                   else f"FAIL {row['worst']:.1e} > {row['tolerance']:g}")
        lines.append(f"| kernel parity | {case} | {verdict} |")
    overhead = results["block_overhead"]
    lines.append(f"| D=1 overhead | llama layer | exit {overhead['returncode']}: {overhead['results']} |")
    nccl = results.get("nccl_engine_parity")
    if nccl is None:
        lines.append(f"| NCCL engine parity | TSP 2 ZeRO-1 | skipped: {torch.cuda.device_count()} GPU visible |")
    else:
        for rank, entry in enumerate(nccl["ranks"]):
            lines.append(f"| NCCL engine parity | rank {rank} | {json.dumps(entry)} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu_check"))
    parser.add_argument("--nccl-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    os.makedirs(args.out, exist_ok=True)
    if args.nccl_rank:
        nccl_rank(args.out)
        return 0
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "kernel_parity": kernel_parity(), "block_overhead": block_overhead(args.out)}
    if torch.cuda.device_count() >= 2:
        results["nccl_engine_parity"] = nccl_engine_parity(args.out)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(table(results))
    print(table(results))
    failed = [name for name, value in results.items() if isinstance(value, dict) and not value.get("ok", True)]
    failed += ["kernel_parity"] if not all(row["ok"] for row in results["kernel_parity"]) else []
    print(f"gpu-check: {'FAILED ' + ', '.join(failed) if failed else 'passed'}; results in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
