"""Train a causal LM with TSP under the deepspeed launcher.

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config ds_configs/tsp2_cpu.json
    deepspeed --num_gpus 4 examples/train.py --deepspeed_config ds_configs/pp2_tsp2_cpu.json
    deepspeed --num_gpus 8 examples/train.py --deepspeed_config ds_configs/tsp8_zero1_bf16_gpu.json --model HF_DIR

Without ``--model`` it trains a small Llama-shaped model with a byte-level
vocabulary on text that ships with Python (the source of a few standard
library modules), so it needs no download. A model directory with a tokenizer
trains on Python's LICENSE text (or ``--text FILE``) in its own tokens, each
window starting with the beginning-of-text token as in pretraining;
``--eval`` logs the loss on fixed windows of the text too and ``--sample
PROMPT`` prints a greedy continuation, before and after training
(``make demo-real``: Gemma 3 270M, ``examples/fetch_gemma3.py``). Set
``DS_ACCELERATOR=cpu`` to run on CPU ranks. Logs loss, tokens/s and per-rank
memory, with a progress bar on rank 0.
"""

import argparse
import inspect
import json
import os
import sys
import sysconfig
import time

import psutil
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine
from tqdm.auto import tqdm
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import ds_tsp
from ds_tsp.config import load_ds_config


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON/hjson config with a tsp section")
    parser.add_argument("--model", help="Hugging Face model directory (default: a small byte-level Llama)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--text", help="a text file to train on, in --model's tokens (default: Python's LICENSE)")
    parser.add_argument("--eval", action="store_true", help="log the loss on fixed windows of the text too, before "
                                                               "training and at every logged step")
    parser.add_argument("--sample", metavar="PROMPT", help="print a greedy continuation before and after training "
                                                          "(needs --model with a tokenizer)")
    parser.add_argument("--sample-tokens", type=int, default=24)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


def python_sources():
    """A few hundred KB of text that ships with every Python."""
    import argparse as m1
    import collections as m2
    import json.decoder as m3
    import textwrap as m4

    return "\n".join(inspect.getsource(m) for m in (m1, m2, m3, m4))


def byte_corpus():
    return torch.tensor(list(python_sources().encode("utf-8")), dtype=torch.long)


def python_license():
    """Python's LICENSE text (14 KB of English): beside the standard library on
    POSIX installs (Debian's and Ubuntu's included), in the prefix on Windows;
    Python's own sources where neither holds it."""
    for folder in (sysconfig.get_paths()["stdlib"], sys.base_prefix):
        path = os.path.join(folder, "LICENSE.txt")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as file:
                return file.read()
    return python_sources()


def load_tokenizer(model):
    """``--model``'s tokenizer, or None for the byte-level model or a directory without one."""
    if model is None:
        return None
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError, TypeError):
        return None


def token_corpus(tokenizer, path):
    if path is None:
        text = python_license()
    else:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)


def small_byte_llama(vocab_size=256):
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def batches(corpus, batch_size, seq_len, dp_rank, dp_size, seed, bos_token_id=None):
    """Random windows of the corpus, after ``bos_token_id`` where given. Every
    rank of a TSP group draws the same micro-batch (the model takes its own
    tokens); DP replicas draw different ones."""
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.tensor([] if bos_token_id is None else [bos_token_id], dtype=torch.long)
    width = seq_len - len(prefix)
    while True:
        starts = torch.randint(0, len(corpus) - width - 1, (dp_size, batch_size), generator=generator)[dp_rank]
        yield torch.stack([torch.cat([prefix, corpus[s:s + width]]) for s in starts.tolist()])


@torch.no_grad()
def greedy_sample(engine, tokenizer, prompt, max_new_tokens):
    """Hugging Face's ``generate`` on the TSP model, on every rank alike."""
    model = engine.module
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(engine.device)
    model.eval()
    sequence = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)[0]
    model.train()
    return tokenizer.decode(sequence[input_ids.shape[1]:], skip_special_tokens=True)


def train_step(engine, micro_batches):
    """One optimizer step over the micro-batches; works for both engine kinds."""
    if isinstance(engine, PipelineEngine):
        return engine.train_batch(data_iter=iter([(ids, ids) for ids in micro_batches])).item()
    # The step's gradient is that of the mean over every target token of the
    # global batch (all replicas, all micro-steps), however padding spreads them.
    num_items = ds_tsp.num_items_in_batch(engine, [(ids, None) for ids in micro_batches])
    losses = []
    for input_ids in micro_batches:
        loss = engine(input_ids=input_ids, labels=input_ids, num_items_in_batch=num_items).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return sum(losses) / len(losses)  # this replica's share of the step's mean loss


def log(message):
    """A line on stdout that the progress bar (stderr) moves out of the way of."""
    tqdm.write(message)
    sys.stdout.flush()


def main():
    start = time.perf_counter()
    args = parse_args()
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.model)
    if tokenizer is None and (args.text or args.sample):
        raise SystemExit("--text and --sample need --model with a tokenizer")
    # A directory is read shard by shard: each rank loads only its own slices.
    model = args.model or small_byte_llama()
    # A client optimizer unless the config names one (those JIT-build kernels on first use).
    has_optimizer_section = "optimizer" in load_ds_config(args.deepspeed_config)
    optimizer = None if has_optimizer_section else (lambda params: torch.optim.AdamW(params, lr=args.lr))
    engine, _, _, _ = ds_tsp.initialize(args=args, model=model, optimizer=optimizer)
    topo = engine.tsp_topology
    rank = dist.get_rank()
    corpus, bos = (byte_corpus(), None) if tokenizer is None else (token_corpus(tokenizer, args.text),
                                                                   tokenizer.bos_token_id)
    data = batches(corpus, engine.train_micro_batch_size_per_gpu(), args.seq_len, topo.dp_rank, topo.dp_size,
                   args.seed, bos)
    if rank == 0:
        log(f"ds_tsp: {topo} | {sum(p.numel() for p in engine.module.parameters())} parameters on rank 0 | "
            f"corpus {len(corpus)} tokens | loaded in {time.perf_counter() - start:.0f} s")
    fixed_loss = None
    if args.eval or args.sample:
        if isinstance(engine, PipelineEngine):
            raise SystemExit("--eval and --sample need a config without pipeline stages")
        # One draw of windows apart from the training batches', measured again at every log.
        fixed = next(batches(corpus, engine.train_micro_batch_size_per_gpu(), args.seq_len, topo.dp_rank,
                             topo.dp_size, args.seed + 1, bos)).to(engine.device)
        fixed_loss = loss_on(engine, fixed) if args.eval else None
        report(engine, tokenizer, fixed_loss, args, "before training")

    window_tokens, window_start, losses = 0, time.perf_counter(), []
    train_start = window_start
    progress = tqdm(total=args.steps, desc="training", unit="step", disable=rank != 0)
    for step in range(1, args.steps + 1):
        micro_batches = [next(data).to(engine.device) for _ in range(engine.gradient_accumulation_steps())]
        losses.append(train_step(engine, micro_batches))
        window_tokens += sum(ids.numel() for ids in micro_batches) * topo.dp_size
        progress.update()
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
        if step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - window_start
            memory = torch.tensor([psutil.Process().memory_info().rss / 2**20])
            memories = [torch.zeros(1) for _ in range(dist.get_world_size())]
            dist.all_gather(memories, memory)
            record = {"step": step, "loss": round(losses[-1], 4), "tokens_per_s": round(window_tokens / elapsed),
                      "rss_mib_per_rank": [round(m.item()) for m in memories]}
            if args.eval:
                fixed_loss = loss_on(engine, fixed)
                record["fixed_windows_loss"] = round(fixed_loss, 4)
            if rank == 0:
                log(json.dumps(record))
            window_tokens, window_start = 0, time.perf_counter()
    progress.close()
    train_time = time.perf_counter() - train_start
    if args.sample or args.eval:
        report(engine, tokenizer, fixed_loss, args, f"after {args.steps} steps")
    if rank == 0:
        first, last = sum(losses[:5]) / min(5, len(losses)), sum(losses[-5:]) / min(5, len(losses))
        log(f"ds_tsp: loss {first:.3f} -> {last:.3f} over {args.steps} steps (means of the first and last 5) | "
            f"training {train_time:.0f} s, {time.perf_counter() - start:.0f} s in all")
    dist.barrier()
    dist.destroy_process_group()


@torch.no_grad()
def loss_on(engine, input_ids):
    return engine(input_ids=input_ids, labels=input_ids).loss.item()


def report(engine, tokenizer, fixed_loss, args, when):
    """The loss on the fixed windows and the prompt's greedy continuation, as asked, printed by rank 0."""
    parts = [] if fixed_loss is None else [f"loss {fixed_loss:.3f} on the fixed windows"]
    if args.sample:
        sample = greedy_sample(engine, tokenizer, args.sample, args.sample_tokens)
        parts.append(f"greedy: {args.sample!r} -> {sample!r}")
    if dist.get_rank() == 0:
        log(f"ds_tsp: {when}: " + " | ".join(parts))


if __name__ == "__main__":
    main()
