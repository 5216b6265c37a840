"""The strategy starts its own processes (``popen``, like ``ddp``) and also runs under torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import JOBS, ROOT

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
    ckpt, weights = tmp_path / "final.ckpt", tmp_path / "weights.pt"
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--steps",
        "6",
        "--ckpt",
        str(ckpt),
        "--weights",
        str(weights),
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
    saved = torch.load(weights, weights_only=True)
    assert saved.keys() == fresh.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(saved[name], value), name


def test_torchrun_launch(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={_free_port()}", str(EXAMPLE), "--steps", "4",
    ]  # fmt: skip
    proc = _run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final metrics" in proc.stdout


# ---------------------------------------------------------------------- beyond one machine
JOB = JOBS / "node_job.py"


def _job_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    return env


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)  # type: ignore[no-any-return]


def _one_node(tmp_path: Path, devices: int, data_parallel: int) -> dict[str, torch.Tensor]:
    """The same job started by the strategy on one node (``popen``)."""
    out = tmp_path / f"one-node-{devices}.pt"
    cmd = [sys.executable, str(JOB), "--weights", str(out), "--devices", str(devices)]
    cmd += ["--data-parallel", str(data_parallel)]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_job_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _weights(out)


@pytest.fixture(scope="module")
def one_node_2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The 2-rank job on one node, shared by the tests that compare with it."""
    return _one_node(tmp_path_factory.mktemp("one-node"), 2, 1)


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


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# one process per node is covered by the SLURM test below (two tasks on two nodes); here two
# processes per node, as two 2-stage replicas
@pytest.mark.parametrize(("per_node", "data_parallel"), [(2, 2)])
def test_two_torchrun_nodes_on_one_host_train_as_one_node(
    tmp_path: Path, per_node: int, data_parallel: int, one_node_2: dict[str, torch.Tensor]
) -> None:
    """Two torchrun agents as two "nodes" (``--nnodes=2``, c10d rendezvous): the pipeline's
    stages (with data_parallel=2 and 2 processes each: two 2-stage replicas) span them, and the
    weights equal those of the same job on one node."""
    port = _free_port()
    out = tmp_path / "two-nodes.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
        f"--nproc_per_node={per_node}", "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-nodes", str(JOB),
        "--weights", str(out), "--nodes", "2", "--devices", str(per_node),
        "--data-parallel", str(data_parallel),
    ]  # fmt: skip
    logs = _run_together([(cmd, _job_env()), (cmd, _job_env())], tmp_path)
    world = 2 * per_node
    assert sum(log.count(f"of {world}: done at step 6") for log in logs) == world
    reference = one_node_2 if world == 2 else _one_node(tmp_path, world, data_parallel)
    diff = _same(_weights(out), reference)
    print(
        f"LAUNCH torchrun 2 nodes x {per_node}, data_parallel={data_parallel}: max|dW| vs one node {diff:.1e}"
    )
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
        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{_free_port()}", str(JOB),
        "--weights", str(out), "--ckpt-dir", str(tmp_path / "ckpt"), "--kill-at", "4",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_job_env(), capture_output=True, text=True, timeout=300
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "exitcode: -9" in log  # the first attempt lost a worker
    assert "rank 0 of 2: done at step 6" in log
    diff = _same(_weights(out), one_node_2)
    print(f"LAUNCH elastic restart: max|dW| vs an uninterrupted run {diff:.1e}")
    assert diff == 0.0


def _slurm_tasks(
    args: list[str], port: int, tmp_path: Path, per_node: int = 1, **extra: str
) -> list[tuple[list[str], dict[str, str]]]:
    """The commands and environments ``srun`` gives the tasks of a job on two nodes."""
    cmd = [sys.executable, str(JOB), *args, "--nodes", "2", "--devices", str(per_node)]
    tasks = []
    for rank in range(2 * per_node):
        env = _job_env()
        env.update(
            SLURM_JOB_ID="4242", SLURM_JOB_NAME="pipe", SLURM_NTASKS=str(2 * per_node),
            SLURM_NNODES="2", SLURM_NTASKS_PER_NODE=str(per_node), SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank % per_node), SLURM_NODEID=str(rank // per_node),
            SLURM_NODELIST="127.0.0.1", MASTER_PORT=str(port), **extra,
        )  # fmt: skip
        tasks.append((cmd, env))
    return tasks


def test_a_two_task_slurm_job_trains_as_one_node(
    tmp_path: Path, one_node_2: dict[str, torch.Tensor]
) -> None:
    """The environment ``srun`` gives the two tasks of a job on two nodes (one task each):
    Lightning's SLURMEnvironment takes the ranks from it, the strategy launches nothing, and
    the weights equal the same job on one node."""
    out = tmp_path / "slurm.pt"
    logs = _run_together(_slurm_tasks(["--weights", str(out)], _free_port(), tmp_path), tmp_path)
    assert "rank 1 of 2: done at step 6" in logs[1]
    diff = _same(_weights(out), one_node_2)
    print(f"LAUNCH SLURM 2 tasks on 2 nodes: max|dW| vs one node {diff:.1e}")
    assert diff == 0.0


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
    """SLURM's warning before a job's time ends (``--signal=USR1@T``: SIGUSR1, to every task
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
    diff = _same(_weights(second), _weights(first))
    print(f"LAUNCH SLURM requeue ({schedule}): the requeued job vs the first max|dW| {diff:.1e}")
    assert diff == 0.0
