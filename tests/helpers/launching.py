"""Launching ``jobs/node_job.py`` (a small 2BW fit under any launcher) as the launch tests do,
and reading the weights it writes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from helpers import JOBS

NODE_JOB = JOBS / "node_job.py"


def job_env() -> dict[str, str]:
    """The environment a launched job gets: one intra-op thread, no leftover elastic state."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    return env


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The full state dict a job's global rank 0 saved."""
    return torch.load(path, weights_only=True)  # type: ignore[no-any-return]


def run_node_job(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``node_job.py`` started by the strategy itself (popen: this process is rank 0's)."""
    return subprocess.run(
        [sys.executable, str(NODE_JOB), *args],
        cwd=cwd, env=job_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def run_main_job(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m lightning_pipe2bw.train ARGS`` as a user runs it (one intra-op thread, Hydra's
    full errors), its output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    env.pop("LOCAL_RANK", None)  # a leftover rank would make Lightning start no process
    return subprocess.run(
        [sys.executable, "-m", "lightning_pipe2bw.train", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
