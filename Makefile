# Two commands on a fresh machine:
#   make demo   sets up .venv and runs the main job (mlx search --target h100 --gkd-tokens 4096 on the embedded default)
#   make test   sets up .venv (and vLLM's CPU build in .venv-vllm, for the `vllm` tests) and runs the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
OUT    ?= runs/demo

.PHONY: setup setup-vllm demo test clean gpu-prepare gpu-rehearsal

$(BIN)/mlx: pyproject.toml setup.py scripts/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup.sh
	@touch $@

setup: $(BIN)/mlx

# vLLM pins its own torch and transformers, so it gets an environment of its own (kept between runs).
setup-vllm:
	PYTHON=$(PYTHON) bash scripts/setup_vllm.sh

demo: setup
	$(BIN)/mlx search --target h100 --out $(OUT)/child --overwrite --gkd-tokens 4096

test: setup setup-vllm
	$(BIN)/python -m pytest -q

# The GPU check (bench/gpu_check.sh): gpu-prepare fills .device/ with what the offline GPU machine lacks;
# gpu-rehearsal runs the whole check here on a CPU, in an environment of the GPU image's versions.
gpu-prepare:
	bash scripts/prepare_device.sh

gpu-rehearsal:
	bash scripts/gpu_rehearsal.sh

clean:
	rm -rf $(VENV) .venv-vllm runs build *.egg-info
