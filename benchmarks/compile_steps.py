"""``engine.compile()`` on TSP models, on CPU gloo ranks: per model the step
time eager and compiled (the first steps, which compile, and the median of the
rest), the losses of both, and the graph breaks of each decoder layer
(``ds_tsp.layer_graph_breaks``: ``torch._dynamo.explain`` on the layer's
inputs from one forward).

Models (``--models``), ``compare_model``'s width unless said: ``llama`` (its
dense row), ``deepseek_v3`` (its latent-attention row with experts from the
second layer on: 8 routed of 128, top 2, and a shared one), ``qwen3_5`` (its
Gated DeltaNet hybrid row) and ``gpt_oss`` (GPT-OSS's attention with sinks,
sliding and full layers in turn, 8 experts of 128, top 2), each half
``--layers`` deep (2 by default: DeepSeek-V3's dense and expert layer,
GPT-OSS's sliding and full one, Qwen3.5's first two, both Gated DeltaNet; its
gated attention layer, the fourth, is compiled in ``tests/test_compile.py``).

    python benchmarks/compile_steps.py        # benchmarks/results/compile_cpu.{json,md}
    python benchmarks/compile_steps.py --models llama --steps 3 --seq-len 32 --out /tmp/c   # a smoke run
"""

import argparse
import copy
import json
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, GptOssConfig

import ds_tsp
from compare_model import add_model_arguments, model_config
from ranks import run_on_ranks

MODELS = ("llama", "deepseek_v3", "qwen3_5", "gpt_oss")
ROWS = {"llama": "dense", "deepseek_v3": "mla", "qwen3_5": "hybrid"}


def config_of(name, args):
    if name == "gpt_oss":
        return GptOssConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=128,
                            num_hidden_layers=args.layers, num_attention_heads=args.heads,
                            num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                            num_local_experts=8, num_experts_per_tok=2, sliding_window=args.seq_len // 2,
                            layer_types=["sliding_attention", "full_attention"] * (args.layers // 2),
                            max_position_embeddings=args.seq_len, attn_implementation="eager")
    config = model_config(argparse.Namespace(**{**vars(args), "model": ROWS[name], "seq_lens": [args.seq_len]}))
    if name == "deepseek_v3":  # experts from the second layer on
        config.first_k_dense_replace, config.n_routed_experts, config.num_experts_per_tok = 1, 8, 2
        config.moe_intermediate_size, config.n_shared_experts, config.n_group, config.topk_group = 128, 1, 1, 1
    return config


def build(world, args):
    """The eager and the compiled engine of ``args.model`` at TSP = ``world``, from the same weights."""
    config = config_of(args.model, args)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9,
                 "tsp": {"enabled": True, "size": world, "attention_backend": "sdpa"}}
    engines = {}
    for mode in ("eager", "compiled"):
        engine, *_ = ds_tsp.initialize(model=copy.deepcopy(model), config=ds_config,
                                       optimizer=lambda params: torch.optim.SGD(params, lr=0.01))
        if mode == "compiled":
            engine.compile()
        engines[mode] = engine
    batches = [torch.randint(0, config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(i))
               for i in range(args.steps)]
    return engines, batches


def measure(run, mode, args):
    engines, batches = run
    engine = engines[mode]
    losses, seconds = [], []
    for batch in batches:
        start = time.perf_counter()
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    result = {"losses": losses, "seconds": seconds}
    if mode == "eager":
        result["breaks"] = [vars(layer) for layer in ds_tsp.layer_graph_breaks(engine.module, input_ids=batches[0])]
    return result


def table(results, args):
    lines = [f"CPU, {args.world} gloo ranks (TSP {args.world}), {args.seq_len} tokens, SGD, {args.steps} steps; "
             f"steady step: median of steps {args.warmup + 1}-{args.steps}\n",
             "| model | eager step (s) | compiled step (s) | compiled / eager | first compiled steps (s) | "
             "max loss diff | graph breaks per layer (rank 0) |", "|---|---|---|---|---|---|---|"]
    for name, row in results.items():
        if isinstance(row, str):
            lines.append(f"| {name} | {row} | | | | | |")
            continue
        breaks = ", ".join(f"{b['index']}: {b['breaks']}" for b in row["breaks"])
        lines.append(f"| {name} | {row['eager_s']:.3f} | {row['compiled_s']:.3f} | "
                     f"{row['compiled_s'] / row['eager_s']:.2f} | "
                     f"{', '.join(f'{s:.1f}' for s in row['first_compiled_s'])} | {row['max_loss_diff']:.1e} | "
                     f"{breaks} |")
    lines.append("\nGraph breaks, by layer kind (rank 0): " + "; ".join(
        f"{name}: " + ", ".join(sorted({f"{b['kind']} {b['graphs']} graphs ({'; '.join(b['reasons'])})"
                                         for b in row["breaks"]}))
        for name, row in results.items() if not isinstance(row, str)))
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the steady step time")
    parser.add_argument("--strategy-timeout", type=float, default=1800)
    parser.add_argument("--collective-timeout", type=float, default=900)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    args.layers = max(2, args.layers // 2)  # the module docstring says which layers that keeps
    results = {}
    for name in args.models:
        args.model = name
        cells = run_on_ranks(build, measure, ("eager", "compiled"), args.world, args)
        if any(isinstance(cell, str) for cell in cells.values()):
            results[name] = next(cell for cell in cells.values() if isinstance(cell, str))
            continue
        eager, compiled = cells["eager"][0], cells["compiled"][0]
        results[name] = {"eager_s": statistics.median(eager["seconds"][args.warmup:]),
                         "compiled_s": statistics.median(compiled["seconds"][args.warmup:]),
                         "first_compiled_s": compiled["seconds"][:args.warmup],
                         "max_loss_diff": max(abs(a - b) for rank in range(args.world) for a, b in
                                              zip(cells["eager"][rank]["losses"], cells["compiled"][rank]["losses"])),
                         "breaks": eager["breaks"], "breaks_per_rank": [cell["breaks"] for cell in cells["eager"]],
                         "losses": eager["losses"], "compiled_losses": compiled["losses"]}
        print(name, json.dumps({k: v for k, v in results[name].items() if "breaks" not in k}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "compile_cpu")
    with open(stem + ".json", "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k != "model"}, "torch": torch.__version__,
                   "results": results}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(table(results, args))
    print(open(stem + ".md").read())


if __name__ == "__main__":
    main()
