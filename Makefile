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

# One process runs tests/unit and tests/ranks (the ranks share one pool and need the cores);
# tests/launch runs on three workers: its tests mostly wait on processes that import torch and
# Lightning, so several at a time overlap one's waiting with another's work. Both halves always
# run; the target fails if either did. Byte code is written first, because this machine's
# environment sets PYTHONDONTWRITEBYTECODE and every launched process would compile the package.
test: lint typecheck
	$(PY) -m compileall -q lightning_pipe2bw tests
	rc=0; $(PY) -m pytest tests/unit tests/ranks || rc=$$?; \
	$(PY) -m pytest -n 3 tests/launch || rc=$$?; exit $$rc

quick: lint
	$(PY) -m pytest -q tests/unit

# the options' tables of README.md and docs/configuration.md, from pipeline/optiontable.py
docs: setup
	$(PY) -c 'import sys; from lightning_pipe2bw.pipeline.optiondocs import main; sys.exit(main())'

clean:
	rm -rf $(VENV) outputs lightning_logs
