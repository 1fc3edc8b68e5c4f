"""``ds-tsp plan``: the per-strategy table at one sequence length (with each
strategy's step time on a cluster), or with ``--max-seq-len`` the longest
sequence each strategy trains (``--alst``: in ALST's setting, with its
published lengths beside), or with ``--serve`` the longest context each
serves, or with ``--time-anchors`` the step-time model beside published
throughput."""

import argparse
import json
import re
import sys
from pathlib import Path

from ds_tsp.planning.anchors import ALST_DEVICE_GB, ALST_HOST_MEMORY_GB, ALST_MODEL, ALST_PUBLISHED, PAPER_PEAK_GB
from ds_tsp.planning.longest import fpdt_published, max_seq_len
from ds_tsp.planning.serving import format_serving_table, serving_plans
from ds_tsp.planning.shapes import (
    DEFAULT_DEVICES_PER_NODE,
    DEFAULT_LOGITS_TILE_MIB,
    DEFAULT_TOKEN_TILE,
    GB,
    LORA_TARGETS,
    PRECISIONS,
    PRESETS,
    TSP_ATTENTION_BACKWARDS,
    model_fields,
    model_shape,
)
from ds_tsp.planning.strategies import TSP_MOE_SCHEDULES, plan, recommend
from ds_tsp.planning.tables import (
    format_gb,
    format_longest_table,
    format_moe_facts,
    format_table,
    format_time_anchors,
    format_tower_table,
    moe_facts,
    plot_memory_vs_seq,
)
from ds_tsp.planning.kernels import DEVICES, MATMUL_DTYPES
from ds_tsp.planning.timing import DEFAULT_CLUSTER, Cluster, compare_anchors, step_time
from ds_tsp.planning.visual import vision_shape

DEFAULT_MODEL = "llama-7b"


def _tokens(text):
    """An integer with an optional K/M suffix (powers of 2): 131072, 128K, 1M."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a positive integer like 131072 or 128K, got {text!r}")
    value = int(match.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[match.group(2).lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _int_at_least(minimum):
    """An argparse type: an integer >= ``minimum``."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value
    return parse


_positive_int, _non_negative_int = _int_at_least(1), _int_at_least(0)


def _expert_parallel_size(text):
    """``--expert-parallel-size``: an integer >= 1, or "auto"."""
    return text if text == "auto" else _positive_int(text)


def add_plan_arguments(parser):
    """Options of ``ds-tsp plan``."""
    parser.add_argument("--model", help=f"preset ({', '.join(PRESETS)}), or a Hugging Face config directory or JSON "
                                        f"file (default: {DEFAULT_MODEL}; {ALST_MODEL} with --alst)")
    parser.add_argument("--seq-len", type=_tokens, default=131072, help="tokens per sequence, e.g. 131072 or 128K")
    parser.add_argument("--micro-batch", type=_positive_int, default=1, help="sequences per micro-batch (default 1)")
    parser.add_argument("--devices", type=_positive_int, default=8, help="devices per model replica, N (default 8)")
    parser.add_argument("--dtype", choices=tuple(PRECISIONS), default="bf16", help="training precision")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3),
                        help="ZeRO stage over the weight-replica axis (default 0; 1 with --max-seq-len, whose ALST "
                             "row runs 3)")
    parser.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="recompute each layer in backward (default: off, on with --paper; --max-seq-len "
                             "always checkpoints)")
    parser.add_argument("--tsp-attention-backward", choices=TSP_ATTENTION_BACKWARDS,
                        help="fused: TSP attention saves its output and lse (ds_tsp's torch-flash kernels); "
                             "recompute: it runs the forward again (flash-attn). Default: fused unless the model "
                             "has a sliding window or head_dim > 256")
    parser.add_argument("--logits-tile-mib", type=_positive_float, default=DEFAULT_LOGITS_TILE_MIB,
                        help="tsp.logits_tile_mib: the largest fp32 logits tile of TSP's fused LM head + loss "
                             f"(default {DEFAULT_LOGITS_TILE_MIB:g})")
    parser.add_argument("--token-tile", type=_non_negative_int,
                        help="tsp.token_tile: the most local tokens a TSP MLP ring step or attention query tile "
                             f"processes at once, 0 for no tiling (default 0; {DEFAULT_TOKEN_TILE}, the runtime's "
                             "default, with --max-seq-len)")
    parser.add_argument("--fp32-accumulators", action=argparse.BooleanOptionalAction, default=True,
                        help="tsp.fp32_accumulators: TSP sums head groups, ring steps and input gradients in fp32 "
                             "(default: on)")
    parser.add_argument("--recompute-norms", action=argparse.BooleanOptionalAction, default=None,
                        help="tsp.recompute_norms: TSP's RMSNorms keep only their input and run again in backward "
                             "(default: off; on with --max-seq-len)")
    parser.add_argument("--offload-activations", action="store_true",
                        help="activation checkpoints in host memory (activation_checkpointing.cpu_checkpointing); "
                             "needs --activation-checkpointing")
    parser.add_argument("--offload-optimizer", action="store_true",
                        help="ZeRO's offload_optimizer to the CPU (needs --zero-stage >= 1)")
    parser.add_argument("--lora-rank", type=_non_negative_int, default=0,
                        help="plan LoRA fine-tuning: adapters of this rank, the base frozen in the model dtype "
                             "(default 0: full fine-tuning)")
    parser.add_argument("--lora-targets", nargs="+", default=list(LORA_TARGETS), choices=LORA_TARGETS,
                        help="the projections with adapters (default: all seven)")
    parser.add_argument("--tsp-size", type=_positive_int,
                        help="the TSP rows' group size D, dividing --devices: the other devices / D are data-parallel "
                             "replicas, ZeRO-1/2 partitioning over them (default: --devices)")
    parser.add_argument("--expert-parallel-size", type=_expert_parallel_size, metavar="EP",
                        help="tsp.expert_parallel_size: add a TSP row whose sparse layers' experts fold across the "
                             "replicas, E/EP a rank over EP consecutive ranks (a multiple of --tsp-size dividing "
                             "--devices and the experts), met by the token all-to-all; auto: the EP of least "
                             "memory, then fewest bytes")
    parser.add_argument("--moe-schedule", choices=TSP_MOE_SCHEDULES, default="ring",
                        help="tsp.moe_schedule of the TSP rows' sparse layers (default: ring; the runtime's default "
                             "is auto)")
    parser.add_argument("--video-frames", type=_non_negative_int, default=0,
                        help="a vision-language model's video: frames per sequence as its tower encodes them (Qwen: "
                             "temporal patches of 2 sampled frames), --video-frames x --video-tokens-per-frame "
                             "visual tokens of each --seq-len; every plan gains the tower's memory, bytes and FLOPs "
                             "(default 0: the text decoder alone)")
    parser.add_argument("--video-tokens-per-frame", type=_positive_int,
                        help="visual tokens a frame becomes after merging (default: the model's: a 448 x 448 frame "
                             "for Qwen, (448/patch)^2/merge^2, 196 for Qwen3-VL's 16-pixel patches; the tower's "
                             "image size for LLaVA, Gemma 3 and Mistral 3)")
    parser.add_argument("--memory-gb", type=float, help="device memory in GB: list the strategies that fit, best "
                                                        "first; with --max-seq-len, the device budget")
    parser.add_argument("--host-memory-gb", type=float,
                        help=f"host memory per node in GB, for offloaded checkpoints and optimizer (default "
                             f"{ALST_HOST_MEMORY_GB:g}, a DGX H100's, assumed for ALST's nodes)")
    parser.add_argument("--devices-per-node", type=_positive_int, default=DEFAULT_DEVICES_PER_NODE,
                        help=f"ranks sharing one node's host memory (default {DEFAULT_DEVICES_PER_NODE})")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of peak memory against sequence length")
    parser.add_argument("--paper", action="store_true",
                        help="print the paper's measured peaks (38.8 / 70.0 / 85.0-140.0 GB) beside the estimates")
    parser.add_argument("--max-seq-len", action="store_true",
                        help="the longest sequence each strategy trains on --devices x --memory-gb with "
                             "--host-memory-gb per node, and the memory term that binds")
    parser.add_argument("--alst", action="store_true",
                        help=f"--max-seq-len in ALST's setting: {ALST_MODEL} on "
                             f"{' / '.join(str(n) for n in ALST_PUBLISHED)} x {ALST_DEVICE_GB} GB, with ALST's "
                             f"published lengths beside")
    _add_time_arguments(parser)
    parser.add_argument("--serve", action="store_true",
                        help="inference: the longest context each strategy (one device, DeepSpeed TP inference, "
                             "TSP) holds in --memory-gb per device with its weights and KV cache, at --devices, "
                             "--micro-batch (sequences decoded at once) and --dtype")
    parser.add_argument("--time-anchors", action="store_true",
                        help="the step-time model beside published runs (DeepSpeed-Ulysses, Megatron context "
                             "parallelism through NeMo, ALST, Hugging Face's Ulysses blog, Megatron-Core's MoE "
                             "layouts), each on its own hardware and kernels, with a fitted overhead in sample and "
                             "left out")
    parser.add_argument("--json", metavar="PATH", help="also write the table(s) as JSON")
    return parser


def _add_time_arguments(parser):
    """The step-time options of ``ds-tsp plan``: the device, its kernels, the overhead and the links."""
    parser.add_argument("--device", choices=sorted(DEVICES), default=DEFAULT_CLUSTER.device,
                        help="the accelerator whose published kernel rates price the step time (default "
                             f"{DEFAULT_CLUSTER.device}; ds_tsp/planning/kernels.py lists each rate's source)")
    parser.add_argument("--attention-kernel", choices=sorted({k for d in DEVICES.values() for k in d.attention}),
                        help="the attention kernel the layers run, for the step time (default: the fastest "
                             "published on --device)")
    parser.add_argument("--matmul-dtype", choices=MATMUL_DTYPES, default=DEFAULT_CLUSTER.matmul_dtype,
                        help="the matmuls' dtype, for the step time (fp8: Transformer Engine's FP8 GEMMs beside "
                             "bf16 attention; default bf16)")
    parser.add_argument("--overhead", type=_positive_float, default=DEFAULT_CLUSTER.overhead,
                        help="the framework's time over its kernels', a factor on the step time (default "
                             f"{DEFAULT_CLUSTER.overhead:g}: the kernels alone; --time-anchors prints what published "
                             "runs imply)")
    parser.add_argument("--intra-node-bandwidth", type=_positive_float, metavar="GB_S",
                        help="line rate in GB/s per device each way inside a node, of which NCCL reaches its "
                             "published share (default: --device's, NVLink 4's 450 on H100; NVLink 3's 300 on A100)")
    parser.add_argument("--inter-node-bandwidth", type=_positive_float, metavar="GB_S",
                        help="line rate in GB/s per device each way between nodes (default: --device's, one 400 "
                             "Gb/s NDR NIC per GPU, 50, on H100; one 200 Gb/s HDR NIC, 25, on A100)")


def _write_json(path, document, out):
    Path(path).write_text(json.dumps(document, indent=1) + "\n")
    print(f"Wrote {path}", file=out)


def _refuse_video(args, mode):
    if args.video_frames or args.video_tokens_per_frame is not None:
        raise ValueError(f"--video-frames and --video-tokens-per-frame go with the per-length table, not with {mode}")


def _tsp_layout_given(args):
    return args.tsp_size is not None or args.expert_parallel_size is not None or args.moe_schedule != "ring"


def _run_max_seq_len(args, out):
    """``--max-seq-len`` (and ``--alst``): one table per device count."""
    if args.paper or args.plot:
        raise ValueError("--paper and --plot go with the per-length table, not with --max-seq-len")
    if _tsp_layout_given(args):
        raise ValueError("--tsp-size, --expert-parallel-size and --moe-schedule go with the per-length table, not "
                         "with --max-seq-len")
    if args.offload_activations or args.offload_optimizer:
        raise ValueError("--max-seq-len plans TSP with and without offloads itself: drop --offload-*")
    model = args.model or (ALST_MODEL if args.alst else DEFAULT_MODEL)
    memory_gb = args.memory_gb if args.memory_gb is not None else (ALST_DEVICE_GB if args.alst else None)
    if memory_gb is None:
        raise ValueError("--max-seq-len needs --memory-gb (the device memory the sequence must fit)")
    host_memory_gb = ALST_HOST_MEMORY_GB if args.host_memory_gb is None else args.host_memory_gb
    token_tile = DEFAULT_TOKEN_TILE if args.token_tile is None else args.token_tile
    zero_stage = 1 if args.zero_stage is None else args.zero_stage
    recompute_norms = args.recompute_norms is not False
    settings = []
    for devices in (tuple(ALST_PUBLISHED) if args.alst else (args.devices,)):
        results = max_seq_len(model, devices, memory_gb, host_memory_gb, micro_batch=args.micro_batch,
                              dtype=args.dtype, zero_stage=zero_stage, token_tile=token_tile,
                              fp32_accumulators=args.fp32_accumulators, recompute_norms=recompute_norms,
                              tsp_attention_backward=args.tsp_attention_backward,
                              logits_tile_mib=args.logits_tile_mib, devices_per_node=args.devices_per_node)
        if args.alst:
            print(f"### {results[0].plan.setting.model.name} on {devices} x {memory_gb:g} GB\n", file=out)
        print(format_longest_table(results, memory_gb, host_memory_gb), file=out)
        settings.append({"model": results[0].plan.setting.model.name, "devices": devices, "memory_gb": memory_gb,
                         "host_memory_gb": host_memory_gb, "devices_per_node": args.devices_per_node,
                         "micro_batch": args.micro_batch, "dtype": args.dtype, "zero_stage": zero_stage,
                         "token_tile": token_tile, "fp32_accumulators": args.fp32_accumulators,
                         "recompute_norms": recompute_norms,
                         "fpdt_published_seq_len": fpdt_published(model, devices, memory_gb, args.micro_batch,
                                                                  args.dtype),
                         "results": [result.as_dict() for result in results]})
    if args.json:
        _write_json(args.json, {"max_seq_len": settings}, out)


def _run_serve(args, out):
    """``--serve``: the longest context per strategy for inference."""
    if args.max_seq_len or args.alst or args.paper or args.plot:
        raise ValueError("--serve is its own table: drop --max-seq-len, --alst, --paper and --plot")
    if args.memory_gb is None:
        raise ValueError("--serve needs --memory-gb (the device memory the weights and KV cache must fit)")
    if _tsp_layout_given(args):
        raise ValueError("--tsp-size, --expert-parallel-size and --moe-schedule go with the per-length table, not "
                         "with --serve")
    model = args.model or DEFAULT_MODEL
    plans = serving_plans(model, args.devices, args.micro_batch, args.dtype)
    name = model_shape(model).name
    print(format_serving_table(plans, args.memory_gb, name, args.micro_batch, args.dtype), file=out)
    if args.json:
        _write_json(args.json, {"serve": {"model": name, "devices": args.devices, "micro_batch": args.micro_batch,
                                          "dtype": args.dtype, "memory_gb": args.memory_gb,
                                          "plans": [p.as_dict(args.memory_gb * GB) for p in plans]}}, out)


def _run_time_anchors(args, out):
    """``--time-anchors``: the model beside every published run, on the run's own hardware."""
    comparisons = compare_anchors()
    print(format_time_anchors(comparisons), file=out)
    if args.json:
        _write_json(args.json, {"time_anchors": [
            {"run": c.anchor.label, "source": c.anchor.source, "layout": c.plan.layout, "kernels": c.anchor.cluster,
             "published_tflops_per_gpu": c.anchor.tflops, "model_tflops_per_gpu": c.tflops(1.0),
             "model_over_published": c.ratio(1.0), "in_fit": c.anchor.in_fit,
             "model_over_published_in_sample": c.ratio(c.in_sample),
             "model_over_published_left_out": c.ratio(c.left_out) if c.anchor.in_fit else None,
             "overhead_in_sample": c.in_sample, "overhead_left_out": c.left_out,
             "published_s_per_step": c.anchor.seconds, "model_s_per_step": c.seconds(1.0), "bound": c.time.bound,
             "implied_overhead": c.implied_overhead}
            for c in comparisons]}, out)


def _run_table(args, out):
    """The per-strategy table at ``--seq-len`` (and recommendation, plot)."""
    if args.alst:
        raise ValueError("--alst is a --max-seq-len setting")
    cluster = Cluster(args.device, args.attention_kernel, args.matmul_dtype, args.overhead,
                      args.intra_node_bandwidth, args.inter_node_bandwidth)
    model = args.model or DEFAULT_MODEL
    zero_stage = args.zero_stage or 0
    checkpointing = args.activation_checkpointing
    if checkpointing is None:
        checkpointing = bool(args.paper)
    options = dict(token_tile=args.token_tile or 0, fp32_accumulators=args.fp32_accumulators,
                   recompute_norms=bool(args.recompute_norms), offload_activations=args.offload_activations,
                   offload_optimizer=args.offload_optimizer,
                   devices_per_node=args.devices_per_node, lora_rank=args.lora_rank,
                   lora_targets=tuple(args.lora_targets), tsp_size=args.tsp_size,
                   expert_parallel_size=args.expert_parallel_size, moe_schedule=args.moe_schedule)
    options.update(_video_options(args, model))
    plans = plan(model, args.seq_len, args.micro_batch, args.devices, args.dtype, zero_stage, checkpointing,
                 args.tsp_attention_backward, args.logits_tile_mib, **options)
    print(format_table(plans, PAPER_PEAK_GB if args.paper else None, cluster), file=out)
    if plans[0].setting.vision:
        print(format_tower_table(plans), file=out)
    if plans[0].setting.model.is_moe:
        print(format_moe_facts(plans), file=out)
    if args.memory_gb is not None:
        fits = recommend(plans, args.memory_gb * GB)
        if fits:
            print(f"Fit in {args.memory_gb:g} GB, fewest bytes received per FLOP first: "
                  + ", ".join(f"{p.name} ({format_gb(p.total)} GB)" for p in fits), file=out)
            print(f"Recommended: {fits[0].name} ({fits[0].layout})", file=out)
        else:
            best = min((p for p in plans if p.feasible and not p.inexact), key=lambda p: p.total)
            print(f"Nothing fits in {args.memory_gb:g} GB; the smallest is {best.name} at {format_gb(best.total)} GB "
                  f"(try activation checkpointing, more devices or a shorter sequence)", file=out)
    if args.plot:
        seq_lens = [args.seq_len >> k for k in range(6, -1, -1)
                    if args.seq_len >> k >= max(2 * args.devices, options.get("visual_tokens", 0))]
        plot_memory_vs_seq(model, seq_lens, args.devices, args.plot, args.micro_batch, args.dtype, zero_stage,
                           checkpointing, None if args.memory_gb is None else args.memory_gb * GB,
                           args.tsp_attention_backward, args.logits_tile_mib, **options)
        print(f"Wrote {args.plot}", file=out)
    if args.json:
        facts = moe_facts(plans[0].setting)
        _write_json(args.json, {**({"moe": facts} if facts else {}),
                                "plans": [{"strategy": p.name, "layout": p.layout, "feasible": p.feasible,
                                           "inexact": p.inexact,
                                           "memory_gb": {k: v / GB for k, v in p.memory.items()},
                                           "peak_gb": p.total / GB, "host_gb_per_node": p.host_total / GB,
                                           "terms_gb": {k: v / GB for k, v in p.terms.items()},
                                           "comm_gb_per_step": p.comm_per_step / GB,
                                           "tflop_per_step": p.flops_per_step / 1e12, **_time_fields(p, cluster),
                                           **({"vision_tower": p.tower} if p.tower else {})}
                                          for p in plans]}, out)


def _video_options(args, model):
    """``plan``'s ``visual_tokens`` and ``frame_tokens`` of ``--video-frames`` and ``--video-tokens-per-frame``;
    none without a video. Refused: a model without a vision tower, a video longer than ``--seq-len``."""
    if not args.video_frames:
        if args.video_tokens_per_frame is not None:
            raise ValueError("--video-tokens-per-frame sizes the frames of --video-frames: give --video-frames too")
        return {}
    vision = vision_shape(model_fields(model))
    if vision is None:
        raise ValueError(f"--video-frames {args.video_frames}: {model_shape(model).name} has no vision tower (its "
                         f"config has no vision_config): drop --video-frames and --video-tokens-per-frame, or plan "
                         f"a vision-language model (qwen3-vl-8b, qwen3.5-27b-vl, or a config with vision_config)")
    frame_tokens = args.video_tokens_per_frame or vision.frame_tokens
    visual_tokens = args.video_frames * frame_tokens
    if visual_tokens > args.seq_len:
        raise ValueError(f"--video-frames {args.video_frames} x --video-tokens-per-frame {frame_tokens} = "
                         f"{visual_tokens:,} visual tokens do not fit in --seq-len {args.seq_len:,}: raise --seq-len "
                         f"to at least {visual_tokens:,}, or lower --video-frames or --video-tokens-per-frame")
    return {"visual_tokens": visual_tokens, "frame_tokens": frame_tokens}


def _time_fields(plan_, cluster):
    time = step_time(plan_, cluster)
    return {"s_per_step": time.seconds, "tokens_per_s_per_gpu": time.tokens_per_s_per_device,
            "tflops_per_gpu": time.tflops_per_device, "bound": time.bound}


def run_plan(args, out=None):
    """``ds-tsp plan``: print the table(s); returns the exit status."""
    out = out or sys.stdout
    try:
        if args.time_anchors:
            _refuse_video(args, "--time-anchors")
            _run_time_anchors(args, out)
        elif args.serve:
            _refuse_video(args, "--serve")
            _run_serve(args, out)
        elif args.max_seq_len or args.alst:
            _refuse_video(args, "--max-seq-len")
            _run_max_seq_len(args, out)
        else:
            _run_table(args, out)
    except (ValueError, OSError) as err:
        print(f"ds-tsp plan: error: {err}", file=sys.stderr)
        return 1
    return 0
