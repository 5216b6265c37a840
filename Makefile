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

# The type check runs beside tests/unit (each needs one core); tests/ranks then runs in one
# process (its ranks share one pool and need both cores); tests/launch runs on three workers:
# its tests mostly wait on processes that import torch and Lightning, so several at a time
# overlap one's waiting with another's work, and an idle worker takes tests queued for a busy
# one (worksteal: the slowest tests do not end the run alone). Every part runs; the target
# fails if any did.
# Byte code is written first, because this machine's environment sets PYTHONDONTWRITEBYTECODE
# and every launched process would compile the package again.
# Each part's wall time is printed at the end (CI's budget is 12 minutes on 2 cores).
test: lint
	$(PY) -m compileall -q lightning_pipe2bw tests
	rc=0; t0=$$(date +%s); $(VENV)/bin/mypy & typecheck=$$!; \
	$(PY) -m pytest tests/unit || rc=$$?; \
	wait $$typecheck || rc=$$?; t1=$$(date +%s); \
	$(PY) -m pytest --durations=20 tests/ranks || rc=$$?; t2=$$(date +%s); \
	$(PY) -m pytest --durations=10 -n 3 --dist worksteal tests/launch || rc=$$?; t3=$$(date +%s); \
	echo "make test: tests/unit and mypy $$((t1 - t0)) s, tests/ranks $$((t2 - t1)) s," \
	     "tests/launch $$((t3 - t2)) s, in all $$((t3 - t0)) s"; exit $$rc

quick: lint
	$(PY) -m pytest -q tests/unit

# the options' tables of docs/user-guide.md and docs/configuration.md, from pipeline/optiontable.py,
# and the figures the docs quote in more than one place, from benchmarks/results/*.json
docs: setup
	$(PY) -c 'import sys; from lightning_pipe2bw.pipeline.optiondocs import main; sys.exit(main())'
	$(PY) benchmarks/figures.py

clean:
	rm -rf $(VENV) outputs lightning_logs
