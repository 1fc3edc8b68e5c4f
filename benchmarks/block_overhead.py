"""Cost of the TSP machinery itself: a TSP decoder layer at D=1 against the
Hugging Face layer it replaces, forward + backward, same dtype, with every
attention backend that serves the device (``tsp.attention_backend``: sdpa,
cudnn, flash, and auto's choice). Also checks each backend numerically against
the HF layer and its fused kernel against autograd through SDPA, and stops
before timing one that is wrong. The GPU check (one run, a few minutes):

    python benchmarks/block_overhead.py --device cuda --out benchmarks/results
    python benchmarks/block_overhead.py --device cpu --seq-lens 512 1024 --preset small

Writes ``block_overhead_<device>.json`` and a markdown table; the target is a
TSP layer within 5% of the HF layer. ``--kinds`` (default on CPU: all) adds
every other block kind (``layer_kinds``: the latent attention in both forms,
the Gated DeltaNet and gated attention layers, a Mamba-2 mixer, an expert
block under both schedules, the folded head with its loss), each against the
Hugging Face module it replaces in the same run, checked against it first. D=1 moves no data, so what is measured is
the packing, the per-chunk causal attention and the hand-written backward.
On CUDA each row also counts the host syncs of one forward + backward of each
layer (``torch.cuda.set_sync_debug_mode``), which should be none.
"""

import argparse
import json
import os
import statistics
import time
import warnings

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from ds_tsp.blocks.attention.module import TSPAttention
from ds_tsp.blocks.attention.kernels import SDPAKernel, takes_grouped_query
from ds_tsp.blocks.attention.selection import (BACKENDS, cudnn_unavailable_reason, flash_unavailable_reason,
                                               select_kernel)
from ds_tsp.blocks.mlp import TSPGatedMLP
from ds_tsp.injection.model import TSPDecoderLayer
from ds_tsp.injection.policy import PRE_NORMS
from layer_kinds import KINDS, max_diffs, pairs

PRESETS = {  # Llama-3-8B-shaped layer, and a small one for CPU runs
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    "small": dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4),
}


def backends_serving(device, dtype):
    """The explicit backends that can run here, then auto (its choice logged)."""
    unavailable = {"cudnn": cudnn_unavailable_reason, "flash": flash_unavailable_reason}
    explicit = [name for name in BACKENDS[1:] if name not in unavailable or not unavailable[name](device, dtype)]
    return explicit + (["auto"] if len(explicit) > 1 else [])


def build(preset, device, dtype, backend="sdpa"):
    config = LlamaConfig(**PRESETS[preset], num_hidden_layers=1, max_position_embeddings=1 << 17,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = LlamaDecoderLayer(config, 0).to(device=device, dtype=dtype)
    tsp = TSPDecoderLayer(TSPAttention.from_hf(hf.self_attn, config, None, backend=backend),
                          TSPGatedMLP.from_hf(hf.mlp, None),
                          {"input_layernorm": hf.input_layernorm, "post_attention_layernorm": hf.post_attention_layernorm},
                          PRE_NORMS)
    return config, hf, tsp


def step(layer, x, cos_sin, grad, is_hf):
    x = x.detach().requires_grad_()
    out = layer(x, position_embeddings=cos_sin) if is_hf else layer(x, cos_sin)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    return out.detach(), x.grad


def timed_alternately(fns, device, repeats):
    """Median seconds of each of ``fns``, timed in turns (one call of each per
    round, the order rotating), so that every layer sees the same machine: a
    shared CPU's speed drifts over a run by more than the overheads measured."""
    for fn in fns:
        for _ in range(2):
            fn()
    times = [[] for _ in fns]
    for round_ in range(repeats):
        for offset in range(len(fns)):
            index = (round_ + offset) % len(fns)
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fns[index]()
            if device == "cuda":
                torch.cuda.synchronize()
            times[index].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def host_syncs(fn):
    """How often ``fn`` (after a warm-up call) makes the host wait for the GPU
    (a value read back, a blocking copy, a synchronize): torch's sync debug
    mode warns at each, from backward's threads too."""
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def parity(preset, device, dtype, backend="sdpa"):
    """Max |diff| of output and input grad, TSP (with ``backend``) vs HF, on ``device``."""
    config, hf, tsp = build(preset, device, dtype, backend)
    x = torch.randn(1, 1024, config.hidden_size, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    pos = torch.arange(1024, device=device).unsqueeze(0)
    cos_sin = LlamaRotaryEmbedding(config).to(device)(x, pos)
    y_ref, dx_ref = step(hf, x, cos_sin, grad, True)
    y, dx = step(tsp, x, cos_sin, grad, False)
    return {"out": (y - y_ref).abs().max().item(), "grad_x": (dx - dx_ref).abs().max().item(),
            "scale": y_ref.abs().max().item()}


def kernel_check(device, dtype, backend="sdpa"):
    """``backend``'s fused-backward kernel against autograd through SDPA, for a
    query chunk over a longer key prefix (the zigzag case), GQA 4:1."""
    kernel = select_kernel(backend, device, dtype)
    if not hasattr(kernel, "backward"):
        return "no explicit backward for this device and dtype"
    torch.manual_seed(0)
    # Slices of longer tensors, as the TSP layer passes them (strided views).
    q = torch.randn(1, 1024, 8, 128, device=device, dtype=dtype)[:, 512:].requires_grad_()
    k, v = (torch.randn(1, 4096, 2, 128, device=device, dtype=dtype)[:, :2048].requires_grad_() for _ in range(2))
    ref, _ = SDPAKernel().attend(q, k, v, 128 ** -0.5)
    grad = torch.randn(1, 1024, 8, 128, device=device, dtype=dtype)[:, 512:]
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    out, lse = kernel.forward(q.detach(), k.detach(), v.detach(), 128 ** -0.5)
    # The layer hands the backward a chunk of a longer log-sum-exp: a strided view.
    lse = torch.cat([lse, lse], dim=-1).chunk(2, dim=-1)[0]
    grads = kernel.backward(grad, q.detach(), k.detach(), v.detach(), out, lse, 128 ** -0.5)
    return {"out": (out - ref).abs().max().item(), "scale": ref.abs().max().item(),
            **{f"d{n}": (a - b).abs().max().item() for n, a, b in zip("qkv", grads, ref_grads)}}


def check_parity(result):
    """Stop before timing a layer that computes the wrong thing. float32 differs
    from the HF layer by rounding only (~1e-6 of the output's scale); bfloat16
    by its 8-bit mantissa (~1e-2)."""
    bounds = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
    for backend, by_dtype in result["parity"].items():
        for dtype, diffs in by_dtype.items():
            if max(diffs["out"], diffs["grad_x"]) > bounds[dtype] * diffs["scale"]:
                raise SystemExit(f"{backend} {dtype}: TSP layer differs from the HF layer beyond {bounds[dtype]} of "
                                 f"scale: {diffs}")
    # The gradients' scale is not the output's: a loose bound that still
    # catches a wrong block, merge or layout (those are off by O(scale)).
    for backend, check in result["kernel_check"].items():
        if isinstance(check, dict) and max(check[k] for k in ("out", "dq", "dk", "dv")) > 0.2 * check["scale"]:
            raise SystemExit(f"{backend}: fused attention kernel differs from SDPA autograd: {check}")


def kind_rows(seq_lens, kinds, repeats):
    """Per block kind and length: TSP at D=1 against its Hugging Face module, checked (float32: within 1e-4 of
    the larger of the output's and the input gradient's scale, as ``check_parity``) and then timed in turns,
    the HF module twice: the ratio of its two medians (``control``, 1 on a quiet machine) is the noise of
    the machine the run had."""
    rows = []
    for seq_len in seq_lens:
        for pair in pairs(seq_len, kinds=kinds):
            diffs = max_diffs(pair)
            if max(diffs["out"], diffs["grad_x"]) > 1e-4 * diffs["scale"]:
                raise SystemExit(f"{pair.kind} at {seq_len} tokens: TSP differs from Hugging Face's: {diffs}")
            hf_s, tsp_s, hf_again_s = timed_alternately([pair.hf, pair.tsp, pair.hf], "cpu", repeats)
            rows.append({"kind": pair.kind, "seq_len": seq_len, "hf_s": hf_s, "tsp_s": tsp_s,
                         "tsp_over_hf": tsp_s / hf_s, "control": hf_again_s / hf_s,
                         **{f"max_diff_{k}": v for k, v in diffs.items()}})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def kinds_table(rows, repeats):
    lines = [f"\nEvery block kind, TSP D=1 against the Hugging Face module it replaces (``layer_kinds``), fwd+bwd, "
             f"median of {repeats} (timed in turns, the HF module twice: HF / HF is the run's noise); max |diff| "
             "of the output and the input gradient, and their scale\n",
             "| block kind | seq len | HF (s) | TSP D=1 (s) | / HF | HF / HF | max diff out | grad | scale |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['kind']} | {row['seq_len']} | {row['hf_s']:.4f} | {row['tsp_s']:.4f} | "
                     f"{row['tsp_over_hf']:.3f} | {row['control']:.3f} | {row['max_diff_out']:.1e} | "
                     f"{row['max_diff_grad_x']:.1e} | {row['max_diff_scale']:.1f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS))
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--kinds", nargs="*", default=None, choices=KINDS,
                        help="block kinds besides the attention backends' Llama layer (default on CPU: all)")
    args = parser.parse_args()
    device = args.device
    preset = args.preset or ("llama8b" if device == "cuda" else "small")
    seq_lens = args.seq_lens or ([4096, 16384, 32768] if device == "cuda" else [512, 1024])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    backends = backends_serving(device, dtype)
    explicit = [b for b in backends if b != "auto"]
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "preset": preset,
              "dtype": str(dtype), "torch": torch.__version__, "backends": backends,
              "flash_attn": flash_unavailable_reason(device, dtype) or "available",
              "cudnn_attention": cudnn_unavailable_reason(device, dtype) or "available",
              "kernel": {b: type(select_kernel(b, device, dtype)).__name__ for b in backends},
              # Whether each blockwise kernel takes grouped-query heads itself (else K/V are repeated per call).
              "grouped_query": {b: takes_grouped_query(select_kernel(b, device, dtype).ops, device, dtype)
                                for b in explicit if hasattr(select_kernel(b, device, dtype), "ops")},
              "parity": {b: {str(t)[6:]: parity(preset, device, t, b) for t in {torch.float32, dtype}
                             if b in backends_serving(device, t)} for b in explicit},
              "kernel_check": {b: kernel_check(device, dtype, b) for b in explicit}, "rows": []}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    check_parity(result)
    config, hf, _ = build(preset, device, dtype)
    layers = [("hf", hf, True)] + [(f"tsp_{b}", build(preset, device, dtype, b)[2], False) for b in backends]
    rotary = LlamaRotaryEmbedding(config).to(device)
    for seq_len in seq_lens:
        x = torch.randn(1, seq_len, config.hidden_size, device=device, dtype=dtype)
        grad = torch.randn_like(x)
        cos_sin = rotary(x, torch.arange(seq_len, device=device).unsqueeze(0))
        row = {"seq_len": seq_len}
        steps = [lambda layer=layer, is_hf=is_hf: step(layer, x, cos_sin, grad, is_hf) for _, layer, is_hf in layers]
        for (name, _, _), seconds in zip(layers, timed_alternately(steps, device, args.repeats)):
            row[f"{name}_s"] = seconds
        if device == "cuda":
            for (name, _, _), fn in zip(layers, steps):
                torch.cuda.reset_peak_memory_stats()
                fn()
                row[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                row[f"{name}_host_syncs"] = host_syncs(fn)  # the training forward and backward: 0 expected
        for backend in backends:
            row[f"tsp_{backend}_over_hf"] = row[f"tsp_{backend}_s"] / row["hf_s"]
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    kinds = args.kinds if args.kinds is not None else (KINDS if device == "cpu" else ())
    result["kinds"] = kind_rows(seq_lens, kinds, args.repeats) if kinds else []

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"block_overhead_{device}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"{result['device']}, {preset} layer, {dtype}, fwd+bwd, median of {args.repeats} "
                f"(the layers timed in turns)\n\n")
        f.write("| seq len | HF layer (s) | " + " | ".join(f"TSP D=1, {b} (s) | / HF" for b in backends) + " |\n")
        f.write("|---|---|" + "---|---|" * len(backends) + "\n")
        for row in result["rows"]:
            f.write(f"| {row['seq_len']} | {row['hf_s']:.4f} | " + " | ".join(
                f"{row[f'tsp_{b}_s']:.4f} | {row[f'tsp_{b}_over_hf']:.3f}" for b in backends) + " |\n")
        if result["kinds"]:
            f.write(kinds_table(result["kinds"], args.repeats))
    print(open(stem + ".md").read())


if __name__ == "__main__":
    main()
