"""What ``ds-tsp reshard`` holds and reads: its peak RSS increase and the bytes it
reads, for the DeepSpeed checkpoint of a Llama-shaped model at TSP 2 x DP 2
(ZeRO-1, one Adam step), against two blocks' states plus the largest file.

    python benchmarks/reshard_memory.py                   # 16 layers of ~1M parameters (~280 MB checkpoint)
    python benchmarks/reshard_memory.py --layers 32 --hidden 512

Four CPU ranks write the checkpoint (gloo, file rendezvous); the converter
then runs alone in a fresh process, which resets its RSS high-water mark
(``/proc/self/clear_refs``) after its imports, with the source dropped from
the page cache, and reads ``VmHWM`` and ``/proc/self/io`` after. Writes
``<out>.json`` and ``<out>.md``.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

WORLD = 4

_MEASURE = """
import json, os, sys
from ds_tsp.cli import main
import deepspeed.checkpoint.ds_to_universal  # imports are not the converter's memory

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

def io():
    with open("/proc/self/io") as f:
        return {line.split(":")[0]: int(line.split()[1]) for line in f}

# The source leaves the page cache, so that what the converter reads comes from storage and is counted once
# however often it is touched (read_bytes); rchar counts every read call, page-cache hits and the converter's
# own temporary files included, but not pages of mapped files.
os.sync()
for folder, _, names in os.walk(sys.argv[1]):
    for name in names:
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base, before = status("VmRSS"), io()
assert main(["reshard", "--checkpoint", sys.argv[1], "--out", sys.argv[2]]) == 0
after = io()
print(json.dumps({"peak_increase": status("VmHWM") - base, "read_bytes": after["read_bytes"] - before["read_bytes"],
                  "rchar": after["rchar"] - before["rchar"]}))
"""


def model_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=64)


def save_checkpoint(args):
    """One rank of the four: TSP 2 x DP 2, ZeRO-1, one Adam step, engine.save_checkpoint."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import ds_tsp

    dist.init_process_group("gloo", init_method=f"file://{args.rendezvous}", rank=args.rank, world_size=WORLD)
    torch.manual_seed(0)
    engine, *_ = ds_tsp.initialize(model=LlamaForCausalLM(model_config(args)),
                                   optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
                                   config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
                                           "steps_per_print": 1000,
                                           "tsp": {"enabled": True, "size": 2, "attention_backend": "sdpa"}})
    ids = torch.zeros(1, 8, dtype=torch.long)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(args.save)
    dist.destroy_process_group()


def measure(args):
    import torch
    from transformers import LlamaForCausalLM

    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    with tempfile.TemporaryDirectory() as root:
        saved = os.path.join(root, "saved")
        # What a launcher would set; DeepSpeed reads these.
        ranks = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank", str(rank), "--save", saved,
                                   "--rendezvous", os.path.join(root, "rendezvous")],
                                  env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD)})
                 for rank in range(WORLD)]
        if any(proc.wait() != 0 for proc in ranks):
            raise SystemExit("a rank failed to write the checkpoint")
        sizes = {os.path.relpath(os.path.join(d, n), saved): os.path.getsize(os.path.join(d, n))
                 for d, _, names in os.walk(saved) for n in names if n.endswith(".pt")}
        proc = subprocess.run([sys.executable, "-c", _MEASURE, saved, os.path.join(root, "universal")], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        measured = json.loads(proc.stdout.strip().splitlines()[-1])
    with torch.device("meta"):
        block = sum(p.numel() for p in LlamaForCausalLM(model_config(args)).model.layers[0].parameters())
    block_states = 3 * 4 * block  # float32 master, exp_avg, exp_avg_sq
    optim = max(size for name, size in sizes.items() if name.endswith("optim_states.pt"))
    model_states = max(size for name, size in sizes.items() if name.endswith("model_states.pt"))
    result = {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "source_bytes": sum(sizes.values()),
              "files": len(sizes), "largest_optimizer_file": optim, "largest_model_states_file": model_states,
              "block_states": block_states, "budget_two_blocks_one_file": 2 * block_states + optim,
              "peak_rss_increase": measured["peak_increase"], "storage_bytes_read": measured["read_bytes"],
              "read_call_bytes": measured["rchar"]}
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    mb = 1e6
    rows = [("checkpoint (all files)", f"{result['source_bytes'] / mb:.0f} MB in {len(sizes)} files"),
            ("largest optimizer / model-states file", f"{optim / mb:.0f} / {model_states / mb:.0f} MB"),
            ("one block's float32 master + Adam moments", f"{block_states / mb:.1f} MB"),
            ("budget: 2 blocks + the largest file", f"{result['budget_two_blocks_one_file'] / mb:.0f} MB"),
            ("converter peak RSS increase", f"{result['peak_rss_increase'] / mb:.0f} MB "
             f"({result['peak_rss_increase'] / result['budget_two_blocks_one_file']:.2f}x the budget)"),
            ("bytes read from storage, source cold", f"{result['storage_bytes_read'] / mb:.0f} MB "
             f"({result['storage_bytes_read'] / result['source_bytes']:.2f}x the checkpoint)"),
            ("bytes through read calls (page-cache hits, temporary files)", f"{result['read_call_bytes'] / mb:.0f} MB "
             f"({result['read_call_bytes'] / result['source_bytes']:.2f}x)")]
    with open(args.out + ".md", "w") as f:
        f.write(f"# ds-tsp reshard: memory and reads ({args.layers} layers, hidden {args.hidden}, TSP 2 x DP 2, "
                "ZeRO-1)\n\n| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows))
    print(open(args.out + ".md").read())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "reshard_memory"))
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        save_checkpoint(args)
    else:
        measure(args)


if __name__ == "__main__":
    main()
