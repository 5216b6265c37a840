# Two commands do all the set-up on a fresh machine (Python 3.11, no GPU):
#   make train   runs the main job: the byte-level GPT, 1F1B with Muon on 2 CPU processes
#   make test    runs lint, type check and the whole test suite
#   make quick   runs lint and the one-process tests (tests/unit, under a minute): the edit loop
# Both create .venv on first use and install the pinned CPU torch build before anything that
# depends on torch, so no CUDA wheels are pulled. Override TORCH_SPEC on a GPU machine.

VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup train test quick lint typecheck docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

train: setup
	$(PY) -m lightning_pipe2bw.train

lint: setup
	$(VENV)/bin/ruff check .

typecheck: setup
	$(VENV)/bin/mypy

test: lint typecheck
	$(PY) -m pytest

quick: lint
	$(PY) -m pytest -q tests/unit

# the options' tables of README.md and docs/configuration.md, from pipeline/optiontable.py
docs: setup
	$(PY) -c 'import sys; from lightning_pipe2bw.pipeline.optiondocs import main; sys.exit(main())'

clean:
	rm -rf $(VENV) outputs lightning_logs
