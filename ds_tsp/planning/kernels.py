"""What each kind of kernel achieves on a device, from public benchmarks: the
step-time model (``timing``) prices a plan's attention, matmuls, elementwise
work and communication each at its own rate, not at one efficiency for all.

Every number below is published (source beside it); none is fitted to the
training runs the model is set beside (``anchors.TIME_ANCHORS``).

* Attention: FlashAttention's benchmark, forward + backward of causal
  attention in TFLOPs/s as it counts them (forward ``4 b s^2 h d / 2``,
  backward 2.5x forward, the count ``flops`` uses), batch x length = 16K
  tokens, by head size and sequence length. Between lengths the rate is
  interpolated in log length; past the longest it stays the longest's.
* Matmuls: the best achievable matmul rate (MAMF, a shape search per device
  and dtype), cut by the roofline where a shape moves more bytes than the
  rate can use (``matmul_tflops``).
* Elementwise and norm kernels: the bytes they move at the achievable share
  of the HBM bandwidth.
* Links: what NCCL achieves (nccl-tests bus bandwidth, large messages) as a
  share of the link's rate, all-to-all apart from the rest.
"""

import bisect
import math
from dataclasses import dataclass

# FlashAttention's benchmark lengths (benchmarks/benchmark_flash_attention.py: batch 16K / length, hidden 2048).
BENCH_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
# cuDNN's SDPA training benchmark lengths (cudnn-frontend benchmark/sdpa_benchmark, batch 4, 2, 1, 1, 1).
CUDNN_LENGTHS = (4096, 8192, 16384, 32768, 65536)

FA_SOURCE = "Dao-AILab/flash-attention assets/flash2_{gpu}_fwd_bwd_benchmark.png (causal, fwd+bwd)"
CUDNN_SOURCE = ("NVIDIA/cudnn-frontend benchmark/sdpa_benchmark/benchmark_results.csv (FE 1.7.0, cuDNN 9.4.0, "
                "BF16, causal, d 128, fwd+bwd)")
MAMF_SOURCE = "stas00/ml-engineering compute/accelerator/README.md, Maximum Achievable Matmul FLOPS table"
NCCL_SOURCE = "NVIDIA GTC25 S72583 slides 12-13 (nccl-tests busbw, large messages), ml-engineering network/"


@dataclass(frozen=True)
class Device:
    """One accelerator and its node's links, with the published rates of its
    kernels. ``attention``: kernel -> {head size: TFLOPs/s at each of
    ``lengths[kernel]``}; ``matmul``: dtype -> achievable TFLOPs/s;
    ``link_share``: (intra-node?, all-to-all?) -> achieved share of the link;
    ``sources``: where the rates come from (``ds-tsp plan --time-anchors`` prints them)."""

    name: str
    hbm_gb_s: float
    hbm_share: float
    intra_node_gb_s: float
    inter_node_gb_s: float
    matmul: dict
    attention: dict
    lengths: dict
    link_share: dict
    default_attention: str
    sources: str


# A100 SXM 80GB: 312 TFLOPs BF16 dense, HBM2e 2039 GB/s (NVIDIA's datasheet), of which a read kernel reaches 88%
# (forums.developer.nvidia.com thread 339083, Nsight Compute); NVLink 3 300 GB/s each way; one 200 Gb/s HDR NIC.
# Links: all-reduce busbw 232 GB/s and all-to-all 210 in a DGX A100, all-to-all 24 GB/s over 8x200Gb at 32 GPUs.
A100 = Device(
    "a100", 2039.0, 0.88, 300.0, 25.0,
    matmul={"bf16": 271.2},
    attention={"fa1": {64: (58, 70, 77, 87, 92, 97), 128: (55, 62, 69, 76, 80, 83)},
               "fa2": {64: (88, 119, 140, 156, 165, 171), 128: (99, 133, 155, 173, 182, 189)}},
    lengths={"fa1": BENCH_LENGTHS, "fa2": BENCH_LENGTHS},
    link_share={(True, False): 232 / 300, (True, True): 210 / 300, (False, False): 24 / 25, (False, True): 24 / 25},
    default_attention="fa2",
    sources=f"{FA_SOURCE.format(gpu='a100')}; {MAMF_SOURCE}; {NCCL_SOURCE}")

# H100 SXM: 989.4 TFLOPs BF16 dense, 1978.9 FP8, HBM3 3350 GB/s, of which DeepGEMM's memory-bound FP8 GEMMs reach
# 2668 GB/s on an H800 of the same memory (deepseek-ai/DeepGEMM README); NVLink 4 450 GB/s each way; one 400 Gb/s
# NDR NIC. Links: all-reduce busbw 370 GB/s and all-to-all 320 in a DGX H100, all-to-all 48 over 8x400Gb at 32
# GPUs. cuDNN's rates were measured on an H200, whose compute is an H100's.
H100 = Device(
    "h100", 3350.0, 2668 / 3350, 450.0, 50.0,
    matmul={"bf16": 794.5, "fp8": 1402.6},
    attention={"fa1": {64: (104, 123, 136, 138, 149, 156), 128: (98, 109, 108, 126, 135, 137)},
               "fa2": {64: (141, 192, 232, 257, 273, 284), 128: (163, 221, 265, 294, 308, 328)},
               "cudnn": {128: (477, 503, 526, 536, 538)}},
    lengths={"fa1": BENCH_LENGTHS, "fa2": BENCH_LENGTHS, "cudnn": CUDNN_LENGTHS},
    link_share={(True, False): 370 / 450, (True, True): 320 / 450, (False, False): 48 / 50, (False, True): 48 / 50},
    default_attention="cudnn",
    sources=f"{FA_SOURCE.format(gpu='h100')}; {CUDNN_SOURCE}; {MAMF_SOURCE}; {NCCL_SOURCE}")

# H200: an H100's compute and links with HBM3e at 4800 GB/s (same achieved share assumed).
H200 = Device(**{**H100.__dict__, "name": "h200", "hbm_gb_s": 4800.0})

DEVICES = {d.name: d for d in (A100, H100, H200)}
MATMUL_DTYPES = ("bf16", "fp8")


def device(name):
    """The ``Device`` called ``name`` (``DEVICES``), or a ValueError naming the choices."""
    if name not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {name!r}")
    return DEVICES[name]


def check_kernels(dev, attention_kernel, matmul_dtype):
    """A ValueError where ``dev`` has no published rate for the kernel or dtype asked."""
    if attention_kernel not in dev.attention:
        raise ValueError(f"attention kernel must be one of {', '.join(dev.attention)} on {dev.name} (the ones "
                         f"with published rates there), not {attention_kernel!r}")
    if matmul_dtype not in dev.matmul:
        raise ValueError(f"matmul dtype must be one of {', '.join(dev.matmul)} on {dev.name}, not {matmul_dtype!r}")


def attention_tflops(dev, kernel, head_dim, length):
    """Forward + backward causal attention rate (TFLOPs/s, FlashAttention's
    count) of ``kernel`` on ``dev`` at ``head_dim`` (the published head size
    nearest it, the larger on a tie) and query length ``length`` (log-linear
    between the published lengths, the end values outside them)."""
    by_size = dev.attention[kernel]
    size = min(by_size, key=lambda d: (abs(d - head_dim), -d))
    rates, lengths = by_size[size], dev.lengths[kernel]
    if length <= lengths[0]:
        return rates[0]
    if length >= lengths[-1]:
        return rates[-1]
    i = bisect.bisect_right(lengths, length)
    t = math.log(length / lengths[i - 1]) / math.log(lengths[i] / lengths[i - 1])
    return rates[i - 1] + t * (rates[i] - rates[i - 1])


def matmul_tflops(dev, dtype, m, n, k, element_bytes):
    """Rate of an ``m x k`` by ``k x n`` matmul: the best achievable one (MAMF),
    or what the HBM feeds where the shape's intensity (FLOPs per byte of its
    three matrices) is below the rate's."""
    best = dev.matmul[dtype]
    intensity = 2 * m * n * k / (element_bytes * (m * k + k * n + m * n))
    return min(best, intensity * dev.hbm_gb_s * dev.hbm_share / 1e3)


def link_gb_s(dev, intra_node, all_to_all, line_gb_s=None):
    """What NCCL moves per device each way on one link: the line rate (``line_gb_s`` or the device's) times
    the share its collectives reach there."""
    line = line_gb_s or (dev.intra_node_gb_s if intra_node else dev.inter_node_gb_s)
    return line * dev.link_share[(intra_node, all_to_all)]
