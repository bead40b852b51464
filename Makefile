# Two commands do all set-up on a fresh machine:
#   make run    -> venv + torch + finetune, then the default recipe (minilm-sentiment)
#   make test   -> venv + torch + finetune, then the test suite
# TORCH_SPEC picks the torch build, e.g. `make run TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124"`.
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
RECIPE     ?= minilm-sentiment
ARGS       ?=
# accelerate_configs/single_gpu.yaml etc. on a GPU machine (see README)
ACCELERATE_CONFIG ?= accelerate_configs/single_cpu.yaml
BIN        := $(VENV)/bin

export HF_HUB_OFFLINE ?= 1
export HF_UPDATE_DOWNLOAD_COUNTS ?= 0
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run test test-all clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first: any other package's torch requirement would otherwise pull a multi-GB default build.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/accelerate launch -q --config_file $(ACCELERATE_CONFIG) finetune/run.py --recipe $(RECIPE) $(ARGS)

test: setup
	$(BIN)/python -m pytest -q

test-all: setup
	$(BIN)/python -m pytest -q -m ""

clean:
	rm -rf $(VENV) runs
