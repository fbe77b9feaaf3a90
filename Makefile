# Two commands on a fresh machine:
#   make demo   sets up .venv and runs the main job (mlx search --target h100 --gkd-tokens 4096 on the embedded default)
#   make test   sets up .venv and runs the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
OUT    ?= runs/demo

.PHONY: setup demo test clean

$(BIN)/mlx: pyproject.toml setup.py scripts/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup.sh
	@touch $@

setup: $(BIN)/mlx

demo: setup
	$(BIN)/mlx search --target h100 --out $(OUT)/child --overwrite --gkd-tokens 4096

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs build *.egg-info
