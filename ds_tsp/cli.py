"""``ds-tsp``: command-line tools.

``ds-tsp convert --in HF_DIR --out DIR --tsp-size D`` pre-shards a Hugging Face
checkpoint into one safetensors file per TSP rank (no torch.distributed, one
process); ``ds-tsp convert --join --in DIR --out HF_DIR`` turns such a
directory back into a Hugging Face checkpoint. Both check the model before
writing anything and refuse to write into a non-empty directory without
``--force``. ``ds-tsp export --checkpoint DS_DIR --model HF_DIR --out DIR``
turns a DeepSpeed checkpoint of a TSP run into a Hugging Face checkpoint
(``--fp32-master``: the ZeRO optimizer's float32 master weights).
``ds-tsp reshard --checkpoint DS_DIR --out DIR`` turns it into a universal
checkpoint that an engine of any TSP x DP x PP layout and ZeRO stage loads.
``ds-tsp plan --paper`` prints per-device memory, communication and FLOPs of
every parallel layout for the paper's setting (or any model, length and size);
``ds-tsp plan --max-seq-len`` the longest sequence each trains on given device
and host memory (``--alst``: in ALST's setting, its published lengths beside).
"""

import argparse
import ctypes
import sys

from ds_tsp.checkpoint import join_checkpoint, shard_checkpoint
from ds_tsp.checkpoint.export import export_deepspeed_checkpoint
from ds_tsp.checkpoint.resharding import reshard
from ds_tsp.checkpoint.writing import DEFAULT_MAX_SHARD_SIZE, check_max_shard_size
from ds_tsp.config import POLICY_NAMES
from ds_tsp.planning import add_plan_arguments, run_plan


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _shard_size(text):
    """Bytes as an int, or a size with a unit ("500MB") as Hugging Face takes it."""
    size = int(text) if text.isdigit() else text
    try:
        check_max_shard_size(size)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return size


def build_parser():
    parser = argparse.ArgumentParser(prog="ds-tsp", description="Tools for TSP (tensor-sequence parallel) models.")
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser(
        "convert", help="pre-shard a Hugging Face checkpoint per TSP rank, or join such shards back",
        description="Without --join: write rank{r}-of-{D}.safetensors (each rank's pieces under Hugging Face "
                    "names) and tsp_shards.json into --out. With --join: write a Hugging Face checkpoint "
                    "(model.safetensors) from such a directory.")
    convert.add_argument("--in", dest="in_dir", required=True, metavar="DIR", help="input checkpoint directory")
    convert.add_argument("--out", dest="out_dir", required=True, metavar="DIR", help="output directory")
    convert.add_argument("--tsp-size", type=_positive_int, metavar="D",
                         help="TSP group size to shard for (required without --join)")
    convert.add_argument("--join", action="store_true", help="join per-rank shards into a Hugging Face checkpoint")
    convert.add_argument("--force", action="store_true", help="write into a non-empty output directory")
    convert.add_argument("--no-vocab-parallel", dest="vocab_parallel", action="store_false",
                         help="keep the embedding and LM head whole in every rank's file (tsp.vocab_parallel false)")
    convert.add_argument("--policy", default="auto", choices=("auto", *POLICY_NAMES),
                         help="architecture table to shard with, as tsp.policy (default: auto)")
    convert.set_defaults(run=run_convert, usage=convert)
    export = commands.add_parser(
        "export", help="turn a DeepSpeed checkpoint of a TSP model into a Hugging Face checkpoint",
        description="Join the per-TSP-rank model files of a DeepSpeed checkpoint (engine.save_checkpoint) into "
                    "config.json + model.safetensors. --model names the Hugging Face directory the run started "
                    "from, for the config and tokenizer files.")
    export.add_argument("--checkpoint", required=True, metavar="DIR", help="DeepSpeed checkpoint directory")
    export.add_argument("--tag", help="checkpoint tag (default: the one named in DIR/latest)")
    export.add_argument("--model", required=True, metavar="HF_DIR", help="the original Hugging Face directory")
    export.add_argument("--out", dest="out_dir", required=True, metavar="DIR", help="output directory")
    export.add_argument("--force", action="store_true", help="write into a non-empty output directory")
    export.add_argument("--fp32-master", action="store_true",
                        help="write the float32 master weights of the ZeRO optimizer files (zero_optimization.stage "
                             "1-3) instead of the model-dtype weights, as DeepSpeed's zero_to_fp32 does")
    export.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, type=_shard_size, metavar="SIZE",
                        help="largest weights file, in bytes or with a unit (e.g. 500MB); larger models get several "
                             f"files and model.safetensors.index.json (default: {DEFAULT_MAX_SHARD_SIZE})")
    export.set_defaults(run=run_export)
    reshard = commands.add_parser(
        "reshard", help="make a DeepSpeed checkpoint of a TSP run loadable at any TSP x DP x PP layout and ZeRO stage",
        description="Run DeepSpeed's universal-checkpoint converter over a ds_tsp engine's checkpoint "
                    "(engine.save_checkpoint): --out then holds one full tensor per parameter with its float32 "
                    "master and Adam moments, which an engine of any layout loads with "
                    "\"checkpoint\": {\"load_universal\": true} in its DeepSpeed config.")
    reshard.add_argument("--checkpoint", required=True, metavar="DIR", help="DeepSpeed checkpoint directory")
    reshard.add_argument("--tag", help="checkpoint tag (default: the one named in DIR/latest)")
    reshard.add_argument("--out", dest="out_dir", required=True, metavar="DIR", help="output directory")
    reshard.add_argument("--force", action="store_true", help="replace an existing output directory")
    reshard.set_defaults(run=run_reshard)
    plan = commands.add_parser(
        "plan", help="per-device memory, communication and FLOPs of DP, TP, SP, TP+SP and TSP for a model",
        description="Analytic plan of every parallel layout for a model at a sequence length and device count; "
                    "--paper prints the paper's 7B / 128K / 8-device numbers beside. --max-seq-len: the longest "
                    "sequence each layout trains on --devices x --memory-gb (--alst: ALST's setting). --serve: the "
                    "longest context each serves with its weights and KV cache.")
    add_plan_arguments(plan)
    plan.set_defaults(run=run_plan)
    return parser


def run_convert(args):
    if args.join:
        join_checkpoint(args.in_dir, args.out_dir, tsp_size=args.tsp_size, force=args.force)
        return
    if args.tsp_size is None:
        args.usage.error("--tsp-size D is required without --join")
    shard_checkpoint(args.in_dir, args.out_dir, args.tsp_size, policy=args.policy, force=args.force,
                     vocab_parallel=args.vocab_parallel)


def run_export(args):
    export_deepspeed_checkpoint(args.checkpoint, args.model, args.out_dir, tag=args.tag, force=args.force,
                                fp32_master=args.fp32_master, max_shard_size=args.max_shard_size)


def run_reshard(args):
    _return_freed_memory()
    tag = reshard(args.checkpoint, args.out_dir, tag=args.tag, force=args.force)
    print(f"ds-tsp reshard: {args.out_dir}/{tag} loads at any layout with \"checkpoint\": "
          "{\"load_universal\": true}")


def _return_freed_memory():
    """DeepSpeed's converter loads one checkpoint file after another and frees
    each; glibc's allocator keeps freed large blocks for reuse, so the process
    would grow to the sum of several files. Large blocks are mapped and unmapped
    instead (glibc's ``mallopt``; elsewhere nothing changes)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 0)


def main(argv=None):
    """Entry point of the ``ds-tsp`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = args.run(args)
    except (ValueError, OSError) as err:  # policy, size, checkpoint and file errors: the message is the fix
        print(f"ds-tsp {args.command}: error: {err}", file=sys.stderr)
        return 1
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
