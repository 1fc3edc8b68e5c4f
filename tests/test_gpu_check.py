"""``make gpu-check`` on a machine without CUDA: it says so and exits 0."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the checks")
def test_gpu_check_without_cuda_says_so_and_exits_0():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--out",
                          os.path.join(ROOT, "benchmarks", "results", "gpu_check")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "gpu-check needs CUDA (torch.cuda.is_available() is False here): nothing to check"
