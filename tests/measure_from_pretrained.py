"""Peak RSS increase of loading a Hugging Face checkpoint in this process:
Hugging Face's ``from_pretrained`` of the whole model ("hf"), or ds_tsp's of
this rank's slices ("tsp"). Prints ``{"peak_increase": bytes}``.

Usage: python measure_from_pretrained.py hf|tsp PATH TSP_SIZE TSP_RANK RENDEZVOUS_FILE
"""

import json
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
    if mode == "tsp":
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=tsp_rank, world_size=tsp_size)
        topology = ds_tsp.TSPTopology(tsp_size)
    with torch.device("meta"):  # warm-up: lazy imports of the modeling code are not loading
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base, peak = status_bytes("VmRSS"), lambda: status_bytes("VmHWM")
    except OSError:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731
    if mode == "hf":
        model = AutoModelForCausalLM.from_pretrained(path)
    else:
        model = from_pretrained(path, topology, ds_tsp.TSPConfig(enabled=True, size=tsp_size))
    with torch.no_grad():
        sum(float(p.sum()) for p in model.parameters())  # every weight read
    print(json.dumps({"peak_increase": peak() - base}), flush=True)
    if mode == "tsp":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
