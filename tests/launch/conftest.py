"""What the launch tests share: ``node_job.py`` (a small 2BW fit under any launcher) started by
the strategy on one node, and the weights it ends with, the reference of every test that
launches the same job another way (torchrun nodes, an elastic restart, a crash and a resume).

``make test`` runs this folder on several pytest-xdist workers; the reference is computed once
for all of them (the first worker to need it holds a file lock while it runs the job, the others
read its weights), since a launch is the costly part of every test here.
"""

from __future__ import annotations

import os

import pytest
import torch
from filelock import FileLock
from helpers.launching import run_node_job, weights


@pytest.fixture(scope="session")
def one_node_2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The 2-rank ``node_job.py`` on one node, uninterrupted: its final weights."""
    # every xdist worker's base temp is a folder of the run's; the reference lives beside them
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out = shared / "one-node-2.pt"
    with FileLock(str(out) + ".lock"):
        if not out.is_file():
            partial = out.with_suffix(".partial")
            proc = run_node_job(shared, "--weights", str(partial))
            assert proc.returncode == 0, proc.stderr[-3000:]
            partial.rename(out)  # whole, or not there for the next worker to run again
    return weights(out)
