"""The strategy starts its own processes (``popen``, like ``ddp``) and also runs under torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from helpers.launching import NODE_JOB, job_env, weights
from helpers.models import max_abs_diff

EXAMPLE = ROOT / "examples" / "train.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_popen_launch_trains_and_writes_consolidated_checkpoint(tmp_path: Path) -> None:
    ckpt, state = tmp_path / "final.ckpt", tmp_path / "weights.pt"
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--steps",
        "6",
        "--ckpt",
        str(ckpt),
        "--weights",
        str(state),
    ]
    proc = _run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final metrics" in proc.stdout
    # each rank runs one stage with cores // local ranks intra-op threads (at least one)
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert f"rank 1: stage 0 of 2, blocks [0, 1, 2, 3], threads {threads}" in proc.stdout
    assert f"rank 0: stage 1 of 2, blocks [4, 5, 6, 7, 8], threads {threads}" in proc.stdout
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from train import Classifier  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    model = Classifier.load_from_checkpoint(str(ckpt), map_location="cpu")
    fresh = Classifier()
    assert model.state_dict().keys() == fresh.state_dict().keys()
    # six optimizer steps moved every block's weights (every stage's part was gathered)
    for name, value in model.state_dict().items():
        if name.endswith("weight"):
            assert not torch.equal(value, fresh.state_dict()[name]), name
    # and the launching process's own model.state_dict() after fit is the whole trained model
    saved = weights(state)
    assert saved.keys() == fresh.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(saved[name], value), name


# ---------------------------------------------------------------------- beyond one machine
# Each job below is tests/helpers/jobs/node_job.py, a 2BW fit; a test that compares its weights
# with the same job started on one node uses the session's one reference (conftest.py).


def _run_together(commands: list[tuple[list[str], dict[str, str]]], cwd: Path) -> list[str]:
    """Start every (command, environment) at once, as the nodes or tasks of one job; their
    combined outputs, after each has exited with 0."""
    procs = [
        subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for cmd, env in commands
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-2000:] for log in logs)
    return logs


def test_two_torchrun_nodes_on_one_host_train_as_one_node(
    tmp_path: Path, one_node_2: dict[str, torch.Tensor]
) -> None:
    """Two torchrun agents as two "nodes" (``--nnodes=2``, c10d rendezvous, one process each):
    the pipeline's two stages span them, and the weights equal those of the same job on one
    node. (Replicas across nodes: the SLURM test below, with two processes per node.)"""
    port = _free_port()
    out = tmp_path / "two-nodes.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-nodes",
        str(NODE_JOB), "--weights", str(out), "--nodes", "2", "--devices", "1",
    ]  # fmt: skip
    logs = _run_together([(cmd, job_env()), (cmd, job_env())], tmp_path)
    assert sum(log.count("of 2: done at step 6") for log in logs) == 2
    diff = max_abs_diff(weights(out), one_node_2)
    print(f"LAUNCH torchrun 2 nodes x 1: max|dW| vs one node {diff:.1e}")
    assert diff == 0.0


def test_an_elastic_restart_resumes_from_the_last_checkpoint(
    tmp_path: Path, one_node_2: dict[str, torch.Tensor]
) -> None:
    """``torchrun --max-restarts=1``: a worker killed in step 5 (SIGKILL) ends the first attempt;
    torchrun restarts every worker, and the fit (``ckpt_path="last"``) resumes from the
    checkpoint of step 3 and ends with the weights of an uninterrupted run."""
    out = tmp_path / "elastic.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{_free_port()}", str(NODE_JOB),
        "--weights", str(out), "--ckpt-dir", str(tmp_path / "ckpt"), "--kill-at", "4",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=300
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "exitcode: -9" in log  # the first attempt lost a worker
    assert "rank 0 of 2: done at step 6" in log
    diff = max_abs_diff(weights(out), one_node_2)
    print(f"LAUNCH elastic restart: max|dW| vs an uninterrupted run {diff:.1e}")
    assert diff == 0.0


def _slurm_tasks(
    args: list[str], port: int, tmp_path: Path, per_node: int = 1, **extra: str
) -> list[tuple[list[str], dict[str, str]]]:
    """The commands and environments ``srun`` gives the tasks of a job on two nodes."""
    cmd = [sys.executable, str(NODE_JOB), *args, "--nodes", "2", "--devices", str(per_node)]
    tasks = []
    for rank in range(2 * per_node):
        env = job_env()
        env.update(
            SLURM_JOB_ID="4242", SLURM_JOB_NAME="pipe", SLURM_NTASKS=str(2 * per_node),
            SLURM_NNODES="2", SLURM_NTASKS_PER_NODE=str(per_node), SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank % per_node), SLURM_NODEID=str(rank // per_node),
            SLURM_NODELIST="127.0.0.1", MASTER_PORT=str(port), **extra,
        )  # fmt: skip
        tasks.append((cmd, env))
    return tasks


# one task warned (the others learn it at the step boundary they agree on), 2bw (a drain before
# the save), two replicas (their last stages agree too): the warning's hardest path. The warning
# to every task is the same agreement with every rank voting; the save leaving the first run as
# it was shows in the requeued job's weights equalling the first's.
@pytest.mark.parametrize(
    ("schedule", "at", "ranks", "data_parallel"),
    [("2bw", 1, 3, 2)],
    ids=["2bw-data-parallel-one-task"],
)
def test_the_slurm_requeue_warning_checkpoints_at_a_step_boundary_and_the_requeued_job_resumes(
    tmp_path: Path,
    schedule: str,
    at: int,
    ranks: int | None,
    data_parallel: int,
) -> None:
    """A job of two tasks per node on two nodes, as ``srun`` starts it: Lightning's
    SLURMEnvironment takes the ranks from the environment and the strategy launches nothing.
    SLURM's warning before a job's time ends (``--signal=USR1@T``: SIGUSR1, to every task
    or, here too, to one that holds a first stage): every rank writes Lightning's HPC
    checkpoint at one step boundary, global rank 0 asks ``scontrol`` for the requeue, and the
    fit goes on. The requeued job resumes from that checkpoint and ends with the weights of the
    first (before, the save began wherever the signal landed and the ranks waited on each other
    until the timeout). With data_parallel=2 the replicas' last stages agree on the step."""
    bin_dir = tmp_path / "bin"  # scontrol, as on a cluster: here it notes its arguments
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.log"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    first, second = tmp_path / "first.pt", tmp_path / "requeued.pt"
    warn = ["--sigusr1-at", str(at)] + ([] if ranks is None else ["--sigusr1-rank", str(ranks)])
    common = ["--schedule", schedule, "--data-parallel", str(data_parallel)]
    args = ["--weights", str(first), *common, *warn]
    logs = _run_together(
        _slurm_tasks(args, _free_port(), tmp_path, data_parallel, PATH=path), tmp_path
    )
    assert f"rank 1 of {2 * data_parallel}: done at step 6" in logs[1], logs[1][-2000:]
    saved = tmp_path / "hpc_ckpt_1.ckpt"
    assert saved.exists() and not (tmp_path / "hpc_ckpt_2.ckpt").exists(), sorted(
        tmp_path.iterdir()
    )
    assert calls.read_text().split("\n") == ["requeue 4242", ""]  # from global rank 0, once
    step = torch.load(saved, weights_only=False, map_location="cpu")["global_step"]
    assert step == 3, step  # the start of the second epoch (batch 3 of the fit)
    # the requeued job: Lightning finds the HPC checkpoint in default_root_dir and resumes
    args = ["--weights", str(second), *common]
    logs = _run_together(
        _slurm_tasks(args, _free_port(), tmp_path, data_parallel, PATH=path), tmp_path
    )
    assert "Restored all states from the checkpoint" in "".join(logs), logs[0][-2000:]
    diff = max_abs_diff(weights(second), weights(first))
    print(f"LAUNCH SLURM requeue ({schedule}): the requeued job vs the first max|dW| {diff:.1e}")
    assert diff == 0.0
