"""``ds-tsp``: command-line tools.

``ds-tsp convert --in HF_DIR --out DIR --tsp-size D`` pre-shards a Hugging Face
checkpoint into one safetensors file per TSP rank (no torch.distributed, one
process); ``ds-tsp convert --join --in DIR --out HF_DIR`` turns such a
directory back into a Hugging Face checkpoint. Both check the model before
writing anything and refuse to write into a non-empty directory without
``--force``.
"""

import argparse
import sys

from .checkpoint import join_checkpoint, shard_checkpoint
from .config import POLICY_NAMES


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


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
    convert.add_argument("--policy", default="auto", choices=("auto", *POLICY_NAMES),
                         help="architecture table to shard with, as tsp.policy (default: auto)")
    convert.set_defaults(run=run_convert, usage=convert)
    return parser


def run_convert(args):
    if args.join:
        join_checkpoint(args.in_dir, args.out_dir, tsp_size=args.tsp_size, force=args.force)
        return
    if args.tsp_size is None:
        args.usage.error("--tsp-size D is required without --join")
    shard_checkpoint(args.in_dir, args.out_dir, args.tsp_size, policy=args.policy, force=args.force)


def main(argv=None):
    """Entry point of the ``ds-tsp`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, OSError) as err:  # policy, size, checkpoint and file errors: the message is the fix
        print(f"ds-tsp {args.command}: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
