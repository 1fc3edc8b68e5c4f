# Set-up and entry points. `make demo` and `make test` each install what they
# need on a fresh machine: the CPU build of torch when no torch is present (GPU
# users keep the torch they brought), then ds_tsp with its extras.
PYTHON ?= python3
NUM_RANKS ?= 2
CONFIG ?= ds_configs/tsp2_cpu.json

.PHONY: install demo test

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test,bench]"

demo: install
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} OMP_NUM_THREADS=1 \
		deepspeed --num_gpus $(NUM_RANKS) examples/train.py --deepspeed_config $(CONFIG)

test: install
	DS_ACCELERATOR=cpu $(PYTHON) -m pytest -q tests
