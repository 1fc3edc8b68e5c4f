"""Train a causal LM with TSP under the deepspeed launcher.

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config ds_configs/tsp2_cpu.json
    deepspeed --num_gpus 4 examples/train.py --deepspeed_config ds_configs/pp2_tsp2_cpu.json
    deepspeed --num_gpus 8 examples/train.py --deepspeed_config ds_configs/tsp8_zero1_bf16_gpu.json --model HF_DIR

Without ``--model`` it trains a small Llama-shaped model with a byte-level
vocabulary on text that ships with Python (the source of a few standard
library modules), so it needs no download. Set ``DS_ACCELERATOR=cpu`` to run
on CPU ranks. Logs loss, tokens/s and per-rank memory.
"""

import argparse
import inspect
import json
import time

import psutil
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine
from transformers import LlamaConfig, LlamaForCausalLM

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
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


def byte_corpus():
    """A few hundred KB of text that ships with every Python."""
    import argparse as m1
    import collections as m2
    import json.decoder as m3
    import textwrap as m4

    text = "\n".join(inspect.getsource(m) for m in (m1, m2, m3, m4))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def small_byte_llama(vocab_size=256):
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def batches(corpus, batch_size, seq_len, dp_rank, dp_size, seed):
    """Random windows of the corpus. Every rank of a TSP group draws the same
    micro-batch (the model takes its own tokens); DP replicas draw different ones."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(corpus) - seq_len - 1, (dp_size, batch_size), generator=generator)[dp_rank]
        yield torch.stack([corpus[s:s + seq_len] for s in starts.tolist()])


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


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    # A directory is read shard by shard: each rank loads only its own slices.
    model = args.model or small_byte_llama()
    # A client optimizer unless the config names one (those JIT-build kernels on first use).
    has_optimizer_section = "optimizer" in load_ds_config(args.deepspeed_config)
    optimizer = None if has_optimizer_section else (lambda params: torch.optim.AdamW(params, lr=args.lr))
    engine, _, _, _ = ds_tsp.initialize(args=args, model=model, optimizer=optimizer)
    topo = engine.tsp_topology
    rank = dist.get_rank()
    data = batches(byte_corpus(), engine.train_micro_batch_size_per_gpu(), args.seq_len, topo.dp_rank,
                   topo.dp_size, args.seed)
    if rank == 0:
        print(f"ds_tsp: {topo} | {sum(p.numel() for p in engine.module.parameters())} parameters on rank 0", flush=True)

    window_tokens, window_start, losses = 0, time.perf_counter(), []
    for step in range(1, args.steps + 1):
        micro_batches = [next(data).to(engine.device) for _ in range(engine.gradient_accumulation_steps())]
        losses.append(train_step(engine, micro_batches))
        window_tokens += sum(ids.numel() for ids in micro_batches) * topo.dp_size
        if step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - window_start
            memory = torch.tensor([psutil.Process().memory_info().rss / 2**20])
            memories = [torch.zeros(1) for _ in range(dist.get_world_size())]
            dist.all_gather(memories, memory)
            if rank == 0:
                print(json.dumps({"step": step, "loss": round(losses[-1], 4),
                                  "tokens_per_s": round(window_tokens / elapsed),
                                  "rss_mib_per_rank": [round(m.item()) for m in memories]}), flush=True)
            window_tokens, window_start = 0, time.perf_counter()
    if rank == 0:
        first, last = sum(losses[:5]) / min(5, len(losses)), sum(losses[-5:]) / min(5, len(losses))
        print(f"ds_tsp: loss {first:.3f} -> {last:.3f} over {args.steps} steps", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
