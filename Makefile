# Two commands do all the set-up on a fresh machine (Python 3.11, no GPU):
#   make train   runs the main job: the byte-level GPT, DualPipeV with Muon on 2 CPU processes
#   make test    runs lint, type check and the whole test suite
#   make quick   runs lint and the one-process tests (tests/unit, under a minute): the edit loop
# Both create .venv on first use and install torch (TORCH_SPEC) before anything that depends on
# it. Which build pip resolves is your pip's configuration's: from PyPI on Linux x86_64 that is
# the CUDA build and its nvidia wheels (several GB), on macOS and aarch64 a CPU build; on the
# machine this project is developed on, pip's configuration serves a local CPU build. For the
# CPU build from torch's own wheel index: make TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (not tried from here: that machine reaches only the package registries). On a GPU machine
# TORCH_SPEC=torch takes the newest build pip resolves.

VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: setup train test quick lint typecheck docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

train: setup
	$(PY) -m lightning_pipe2bw.train

lint: setup
	$(VENV)/bin/ruff check .

typecheck: setup
	$(VENV)/bin/mypy

# tests/launch runs beside the rest, since a part alone leaves a core idle much of its time: it
# starts first, in the background, on two workers (worksteal: an idle worker takes tests queued
# for a busy one), and its tests mostly wait on processes that import torch and Lightning, or on
# a fault's timeout. Beside it the type check and tests/unit run side by side, then tests/ranks in
# one process (its ranks share one pool). (All three at once was slower: 637 s against 573.)
# tests/launch's report is printed when it ends. Every part runs; the target fails if any did.
# Byte code is written first, because this machine's environment sets PYTHONDONTWRITEBYTECODE
# and every launched process would compile the package again.
# Each part's wall time is printed at the end (CI's budget is 12 minutes on 2 cores).
LAUNCH_LOG := .pytest_cache/make-test-launch.log

test: lint
	$(PY) -m compileall -q lightning_pipe2bw tests
	mkdir -p $(dir $(LAUNCH_LOG))
	rc=0; t0=$$(date +%s); \
	( $(PY) -m pytest --durations=10 -n 2 --dist worksteal tests/launch > $(LAUNCH_LOG) 2>&1; \
	  code=$$?; echo "tests/launch $$(( $$(date +%s) - t0 )) s" >> $(LAUNCH_LOG); exit $$code ) & \
	launch=$$!; \
	$(VENV)/bin/mypy & typecheck=$$!; \
	$(PY) -m pytest tests/unit || rc=$$?; \
	wait $$typecheck || rc=$$?; t1=$$(date +%s); \
	$(PY) -m pytest --durations=20 tests/ranks || rc=$$?; t2=$$(date +%s); \
	wait $$launch || rc=$$?; t3=$$(date +%s); cat $(LAUNCH_LOG); \
	echo "make test: tests/unit and mypy $$((t1 - t0)) s, then tests/ranks $$((t2 - t1)) s;" \
	     "beside them $$(tail -n 1 $(LAUNCH_LOG)); in all $$((t3 - t0)) s"; exit $$rc

quick: lint
	$(PY) -m pytest -q tests/unit

# the options' tables of docs/user-guide.md and docs/configuration.md, from pipeline/optiontable.py,
# and the figures the docs quote in more than one place, from benchmarks/results/*.json
docs: setup
	$(PY) -c 'import sys; from lightning_pipe2bw.pipeline.optiondocs import main; sys.exit(main())'
	$(PY) benchmarks/figures.py

clean:
	rm -rf $(VENV) outputs lightning_logs
