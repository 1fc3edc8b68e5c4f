"""Generate text with a TSP-sharded model under the deepspeed launcher.

    deepspeed --num_gpus 2 examples/generate.py --model HF_DIR --prompt "def fib(n):" --max-new-tokens 32
    deepspeed --num_gpus 4 examples/generate.py --model HF_DIR --prompt "..." --tsp-size 2 --do-sample --seed 0

Each rank of a TSP group loads only its shards of the decoder blocks
(``ds_tsp.checkpoint.from_pretrained``), onto its own device. Ranks outside the first TSP group are
data-parallel replicas: they generate the same text. Set ``DS_ACCELERATOR=cpu``
(and ``OMP_NUM_THREADS=1`` when ranks outnumber cores) to run on CPU ranks.
A model directory without a tokenizer is driven byte by byte (UTF-8 bytes as
token ids), which needs a vocabulary of at least 256.
"""

import argparse
import time

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from transformers import AutoTokenizer

from ds_tsp.checkpoint import from_pretrained
from ds_tsp.config import TSPConfig
from ds_tsp.generate import generate
from ds_tsp.topology import TSPTopology

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text; repeat for a batch (left padded to the longest)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--tsp-size", type=int, help="TSP group size (default: the world size)")
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    parser.add_argument("--attention-backend", choices=("auto", "sdpa", "flash"), default="auto")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


class ByteTokenizer:
    """UTF-8 bytes as token ids, for model directories that ship no tokenizer."""

    pad_token_id = 0

    def __init__(self, vocab_size):
        if vocab_size < 256:
            raise ValueError(f"the model has no tokenizer and a vocabulary of {vocab_size} < 256: "
                             "it cannot be driven byte by byte")

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def load_tokenizer(path, vocab_size):
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return ByteTokenizer(vocab_size)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return tokenizer


def left_padded(token_lists, pad_id):
    """``(input_ids, attention_mask)`` of prompts padded on the left to the longest."""
    width = max(len(ids) for ids in token_lists)
    input_ids = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(token_lists):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids):] = 1
    return input_ids, attention_mask


def main():
    args = parse_args()
    deepspeed.init_distributed()
    tsp_size = args.tsp_size or dist.get_world_size()
    tsp_config = TSPConfig(enabled=True, size=tsp_size, attention_backend=args.attention_backend)
    topology = TSPTopology(tsp_size, timeout_minutes=tsp_config.timeout_minutes)
    # Each rank reads only its own slices, straight onto its device.
    device = get_accelerator().current_device_name()
    model = from_pretrained(args.model, topology, tsp_config, torch_dtype=DTYPES[args.dtype], device=device).eval()
    tokenizer = load_tokenizer(args.model, model.config.vocab_size)
    input_ids, attention_mask = left_padded([tokenizer.encode(p) for p in args.prompt], tokenizer.pad_token_id)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)

    start = time.perf_counter()
    sequences = generate(model, input_ids, args.max_new_tokens, do_sample=args.do_sample,
                         temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                         attention_mask=attention_mask)
    elapsed = time.perf_counter() - start
    if dist.get_rank() == 0:
        new_tokens = sequences.shape[1] - input_ids.shape[1]
        print(f"ds_tsp: {topology.tsp_size} TSP ranks x {topology.dp_size} replicas, {new_tokens} new tokens "
              f"in {elapsed:.2f} s ({new_tokens * len(args.prompt) / elapsed:.1f} tokens/s)", flush=True)
        for prompt, row in zip(args.prompt, sequences):
            print(repr(prompt + tokenizer.decode(row[input_ids.shape[1]:].tolist())), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
