"""Generate text with a TSP-sharded model under the deepspeed launcher, through
Hugging Face's ``model.generate``.

    deepspeed --num_gpus 2 examples/generate.py --model HF_DIR --prompt "def fib(n):" --max-new-tokens 32
    deepspeed --num_gpus 2 examples/generate.py --model HF_DIR --prompt "..." --do-sample --top-p 0.9 --seed 0
    deepspeed --num_gpus 4 examples/generate.py --model HF_DIR --prompt "..." --prompt "..." --tsp-size 2 --num-beams 4

Each rank of a TSP group loads only its shards of the decoder blocks
(``ds_tsp.checkpoint.from_pretrained``), onto its own device; Hugging Face's
generation loop then runs on every rank alike (``ds_tsp.inference.generate``). Ranks
outside the first TSP group are data-parallel replicas: they generate the same
text. One prompt without beams is streamed as it is generated (rank 0); at the
end rank 0 prints the prefill time, the decode rate and every rank's peak
memory. Set ``DS_ACCELERATOR=cpu`` (and ``OMP_NUM_THREADS=1`` when ranks
outnumber cores) to run on CPU ranks. A model directory without a tokenizer is
driven byte by byte (UTF-8 bytes as token ids), which needs a vocabulary of at
least 256.
"""

import argparse
import resource
import time

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from transformers import AutoTokenizer, GenerationConfig, TextStreamer, set_seed

from ds_tsp import TSPConfig, TSPTopology, from_pretrained

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
# Hugging Face generation flags: --flag-name sets GenerationConfig.flag_name.
GENERATION_FLAGS = {"max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float, "min_p": float,
                    "num_beams": int, "num_return_sequences": int, "repetition_penalty": float,
                    "no_repeat_ngram_size": int, "length_penalty": float}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text; repeat for a batch (left padded to the longest)")
    parser.add_argument("--tsp-size", type=int, help="TSP group size (default: the world size)")
    parser.add_argument("--do-sample", action="store_true", help="sample (Hugging Face's do_sample)")
    for name, kind in GENERATION_FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, help=f"GenerationConfig.{name}")
    parser.add_argument("--seed", type=int, help="transformers.set_seed on every rank before generating")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    parser.add_argument("--attention-backend", choices=("auto", "sdpa", "flash"), default="auto")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()
    if args.max_new_tokens is None:
        args.max_new_tokens = 32
    return args


class ByteTokenizer:
    """UTF-8 bytes as token ids, for model directories that ship no tokenizer."""

    pad_token_id = 0

    def __init__(self, vocab_size):
        if vocab_size < 256:
            raise ValueError(f"the model has no tokenizer and a vocabulary of {vocab_size} < 256: "
                             "it cannot be driven byte by byte")

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids, **kwargs):
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")  # 0: padding


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


class ForwardTimes:
    """Wall time of every forward ``generate`` runs: the first is the prefill."""

    def __init__(self, model):
        self.times = []
        model.register_forward_pre_hook(lambda *_: self.times.append(-time.perf_counter()))
        model.register_forward_hook(lambda *_: self.times.append(self.times.pop() + time.perf_counter()))


def peak_memory_bytes():
    """This rank's peak: the accelerator's allocated high-water mark, or on CPU the process's peak RSS."""
    if get_accelerator().device_name() == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return get_accelerator().max_memory_allocated()


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
    generation = GenerationConfig.from_model_config(model.config)
    generation.update(do_sample=args.do_sample, pad_token_id=tokenizer.pad_token_id,
                      **{name: getattr(args, name) for name in GENERATION_FLAGS if getattr(args, name) is not None})
    streams = dist.get_rank() == 0 and len(args.prompt) == 1 and (generation.num_beams or 1) == 1
    streamer = TextStreamer(tokenizer, skip_prompt=True) if streams else None
    if args.seed is not None:
        set_seed(args.seed)
    timer = ForwardTimes(model)

    start = time.perf_counter()
    sequences = model.generate(input_ids, attention_mask=attention_mask, generation_config=generation,
                               streamer=streamer)
    elapsed = time.perf_counter() - start
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_memory_bytes())
    if dist.get_rank() == 0:
        prefill, decode_steps = timer.times[0], len(timer.times) - 1
        decode_rate = sequences.shape[0] * decode_steps / max(elapsed - prefill, 1e-9)
        print(f"\nds_tsp: {topology.tsp_size} TSP ranks x {topology.dp_size} replicas, prompt "
              f"{tuple(input_ids.shape)}: prefill {prefill:.3f} s, {decode_steps} decode steps at "
              f"{decode_rate:.1f} tokens/s ({sequences.shape[0]} sequences); peak memory per rank "
              f"{[f'{p / 2**20:.0f} MiB' for p in peaks]}", flush=True)
        for row in sequences:
            print(repr(tokenizer.decode(row.tolist(), skip_special_tokens=True)), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
