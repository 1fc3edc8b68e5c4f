# Set-up and entry points. `make demo` and `make test` each install what they
# need on a fresh machine: the CPU build of torch when no torch is present (GPU
# users keep the torch they brought), then ds_tsp with its extras.
PYTHON ?= python3
NUM_RANKS ?= 2
CONFIG ?= ds_configs/tsp2_cpu.json

TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions

.PHONY: install ops demo test

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test,bench]"

# DeepSpeed JIT-builds a shared-memory comm op the first time a CPU rank joins
# (~30 s), and its CPU Adam the first time a config's "optimizer" section meets
# optimizer offload (~50 s). Build them here, in one process, so that ranks never race inside the
# build and a rank killed by a test timeout never holds its lock; a lock left
# by a build killed long ago (builds take a minute) would hang every rank.
ops: install
	@find "$(TORCH_EXTENSIONS_DIR)" -name lock -mmin +30 -delete 2>/dev/null || true
	DS_ACCELERATOR=cpu timeout 900 $(PYTHON) -c "from deepspeed.accelerator import get_accelerator; \
		get_accelerator().create_op_builder('ShareMemCommBuilder').load(); \
		get_accelerator().create_op_builder('CPUAdamBuilder').load()"

demo: ops
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} OMP_NUM_THREADS=1 \
		deepspeed --num_gpus $(NUM_RANKS) examples/train.py --deepspeed_config $(CONFIG)

test: ops
	DS_ACCELERATOR=cpu $(PYTHON) -m pytest -q tests --durations=10
