"""Peak RSS increase of loading a Hugging Face checkpoint in this process:
Hugging Face's ``from_pretrained`` of the whole model ("hf"), or ds_tsp's of
this rank's slices ("tsp"). Prints ``{"peak_increase": bytes}``.

Usage: python measure_from_pretrained.py hf|tsp PATH TSP_SIZE TSP_RANK RENDEZVOUS_FILE
"""

import json
import os
import resource
import sys

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import ds_tsp
from ds_tsp.checkpoint import from_pretrained


def status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024


def main():
    mode, path, tsp_size, tsp_rank, rendezvous = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        sys.argv[5]
    # Warm-up: the lazy imports the loader makes (modeling code, PEFT, hub
    # helpers: ~10 MB of modules) are not loading, so it first loads a
    # one-layer copy of the model's config.
    config = AutoConfig.from_pretrained(path)
    config.num_hidden_layers = 1
    tiny = os.path.join(os.path.dirname(rendezvous), f"warm-up-{mode}-{tsp_rank}")
    torch.manual_seed(0)  # the same weights on every rank
    AutoModelForCausalLM.from_config(config).save_pretrained(tiny)
    if mode == "tsp":
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=tsp_rank, world_size=tsp_size)
        topology = ds_tsp.TSPTopology(tsp_size)
    load = (lambda where: AutoModelForCausalLM.from_pretrained(where)) if mode == "hf" else \
        (lambda where: from_pretrained(where, topology, ds_tsp.TSPConfig(enabled=True, size=tsp_size)))
    load(tiny)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base, peak = status_bytes("VmRSS"), lambda: status_bytes("VmHWM")
    except OSError:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731
    model = load(path)
    with torch.no_grad():
        sum(float(p.sum()) for p in model.parameters())  # every weight read
    print(json.dumps({"peak_increase": peak() - base}), flush=True)
    if mode == "tsp":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
