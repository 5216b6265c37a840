"""A failing rank stops the whole run quickly, with an error that names it.

Each test launches a real 2-process fit (``tests/helpers/jobs/fault_job.py``, start_method="popen": the
launching process is rank 0 and re-runs the script for rank 1) in which one rank raises or is
killed with SIGKILL in the middle of step 2. Global rank 0 runs the last stage, rank 1 the first.
The run must end well before the process group's timeout (3 minutes by default), exit non-zero,
print which rank failed, in which stage and schedule action, and leave no process behind. The
hang tests set an 8-second timeout: a rank that neither fails nor dies is stopped by it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import JOBS
from helpers.launching import run_node_job, weights
from helpers.models import max_abs_diff

JOB = JOBS / "fault_job.py"
LIMIT_S = 90  # startup is ~10 s here; a hang would last until the 3-minute timeout
# how long a failing launching process lets its workers stop on their own before it kills them
# (its worker watch waits twice that for a launching process that hangs); 15 s by default
GRACE_S = "5"


def _run_job(
    tmp_path: Path, mode: str, rank: int, *options: str, transport: str = "auto"
) -> tuple[subprocess.CompletedProcess[str], float]:
    token = f"fault-{uuid.uuid4().hex[:12]}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PIPE2BW_TRANSPORT=transport)
    cmd = [sys.executable, str(JOB), "--mode", mode, "--rank", str(rank), "--token", token]
    cmd += ["--grace", GRACE_S]
    cmd += options
    start = time.monotonic()
    # run() returns when every process holding the output pipes has exited, rank 1 included
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=LIMIT_S * 2
    )
    elapsed = time.monotonic() - start
    left = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left behind: {left}"
    label = " ".join([mode, "rank", str(rank), *options])
    print(f"FAULT {label}: stopped in {elapsed:.1f} s, exit code {proc.returncode}")
    return proc, elapsed


# the launching process raising; a worker raising: test_a_failure_in_a_balanced_pair_stops_every_rank
@pytest.mark.parametrize(("rank", "stage", "other"), [(0, 1, 1)])
def test_a_raising_rank_stops_every_rank(tmp_path: Path, rank: int, stage: int, other: int) -> None:
    proc, elapsed = _run_job(tmp_path, "raise", rank)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < LIMIT_S
    assert "finished without a failure" not in out
    # the other rank reports the first failure: rank, stage, action (a forward of this stage,
    # PipeDream-2BW version 1) and the original exception
    expected = (
        f"[rank{other}]: lightning_pipe2bw.failures.record.StageFailure: rank {rank} (stage "
        f"{stage}) failed in action {stage}F4v1: ValueError: failing on purpose at step 2"
    )
    assert expected in out, out[-4000:]
    # and the failing rank printed its own traceback before anything could stop it
    assert f"pipe2bw: rank {rank} (stage {stage}) failed in action {stage}F4v1" in out
    assert 'raise ValueError(f"failing on purpose' in out


@pytest.mark.parametrize(
    ("rank", "stage", "other", "transport"),
    [(0, 1, 1, "auto"), (1, 0, 0, "gloo")],
    ids=["rank0", "rank1-gloo"],
)
def test_a_killed_rank_stops_every_rank(
    tmp_path: Path, rank: int, stage: int, other: int, transport: str
) -> None:
    """Over shared memory (the default here) the neighbour sees the killed rank's socket close;
    over gloo its connection break. The launching process (rank 0) is killed over shared memory,
    a worker over gloo: each transport and each kind of process once."""
    proc, elapsed = _run_job(tmp_path, "kill", rank, transport=transport)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0  # -9 when the launching process itself was killed
    assert elapsed < LIMIT_S
    assert (
        f"[rank{other}]: lightning_pipe2bw.failures.record.StageFailure: lost rank {rank} " in out
    )
    assert f"rank {rank} (stage {stage}) failed in an unknown action: its process vanished" in out


@pytest.mark.parametrize(
    ("rank", "stage", "other", "how"),
    # a worker rank 0 started: the launching process knows how it died (a killed launching
    # process "vanished", as test_a_killed_rank_stops_every_rank[rank0] shows)
    [(1, 0, 0, "its process was killed by SIGKILL (signal 9)")],
)
def test_a_rank_killed_outside_the_schedule_is_named(
    tmp_path: Path, rank: int, stage: int, other: int, how: str
) -> None:
    """A rank killed in the middle of a checkpoint (between two steps): the other rank's
    collective breaks outside the schedule, and its error names the lost rank, its stage and
    how it died instead of gloo's "Connection closed by peer" alone."""
    proc, elapsed = _run_job(tmp_path, "kill-in-save", rank)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < LIMIT_S
    expected = (
        f"[rank{other}]: lightning_pipe2bw.failures.record.StageFailure: lost rank {rank} "
        f"(stage {stage}, process "
    )
    assert expected in out, out[-4000:]
    assert f"while this rank ({other}, stage {1 - stage}) was in trainer.save_checkpoint" in out
    assert f"rank {rank} (stage {stage}) failed in code outside the pipeline schedule: {how}" in out


def test_a_checkpoint_saved_on_rank_0_only_is_refused_in_time(tmp_path: Path) -> None:
    """``trainer.save_checkpoint`` under ``if trainer.global_rank == 0`` (the single-process
    habit) while the other rank goes on: the save's first barrier says that every rank must
    call it, after at most the process-group timeout (8 s here), not gloo's timeout words."""
    proc, elapsed = _run_job(tmp_path, "save-on-rank0", 0, "--timeout", "8")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < LIMIT_S
    assert "trainer.save_checkpoint on rank 0 (stage 1): not every rank took part" in out, out[
        -3000:
    ]
    assert "Ranks 1 failed to pass monitoredBarrier" in out
    assert "must be called on every rank" in out
    assert "call it outside `if trainer.global_rank == 0:`" in out
    assert not (tmp_path / "whole.ckpt").exists()


# a hanging worker; a hanging launching process: test_a_failure_travels_along_a_longer_pipeline
@pytest.mark.parametrize(("rank", "stage", "other"), [(1, 0, 0)])
def test_a_hanging_rank_is_stopped_by_the_timeout(
    tmp_path: Path, rank: int, stage: int, other: int
) -> None:
    """A rank that neither fails nor dies (it sleeps in ``training_step``) keeps its neighbour
    waiting only for the process-group timeout (8 s here); the neighbour's error names it, and
    the launching process kills a worker that still hangs."""
    proc, elapsed = _run_job(tmp_path, "hang", rank, "--timeout", "8")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < LIMIT_S
    assert (
        f"[rank{other}]: lightning_pipe2bw.failures.record.StageFailure: rank {rank} (stage "
        f"{stage}) timed out while this stage ({1 - other}) ran action" in out
    ), out[-4000:]
    assert "it stopped answering" in out
    if rank == 1:  # the worker hangs; the launching process (rank 0) kills it
        assert "pipe2bw: killing worker process" in out


# (a raising rank's path is the killed one's once its notice is out: two stages show it)
@pytest.mark.parametrize(("mode", "rank"), [("kill", 1), ("hang", 0)])
def test_a_failure_travels_along_a_longer_pipeline(tmp_path: Path, mode: str, rank: int) -> None:
    """Three stages (rank 1 runs the middle one, rank 0 the last); the failure happens in a body
    block. A failure in the middle reaches both ends. A hang at the end is noticed first by its
    neighbour (whose wait limit is shorter, see ``failures.record.wait_limits``), which names it and
    passes it on: the first stage stops naming the hung rank too (its notice comes over the
    shared-memory transport, which a timed-out gloo group would have closed)."""
    proc, elapsed = _run_job(tmp_path, mode, rank, "--devices", "3", "--timeout", "8", "--in-block")
    out = proc.stdout + proc.stderr
    stage = 2 - rank
    assert proc.returncode != 0
    assert elapsed < LIMIT_S

    def stop_line(other: int) -> str:  # what rank ``other`` printed when it stopped
        prefix = f"pipe2bw: rank {other} (stage {2 - other}) stops: "
        return next((x for x in out.splitlines() if x.startswith(prefix)), "")

    if mode == "hang":
        assert "stops: rank 0 (stage 2) timed out while this stage (1) ran" in stop_line(1), out
        assert "stops: rank 0 (stage 2) failed in an unknown action: it stopped answering" in (
            stop_line(2)
        ), out
    else:  # both other ranks name the first failure
        first = f"rank {rank} (stage {stage}) failed in"
        for other in (0, 2):
            assert first in stop_line(other), out[-4000:]


@pytest.mark.parametrize(("mode", "rank"), [("raise", 3)])
def test_a_failure_in_a_balanced_pair_stops_every_rank(
    tmp_path: Path, mode: str, rank: int
) -> None:
    """With BPipe on 4 stages, stage 0 (rank 3) and stage 3 (rank 0) also exchange activations
    over their offload link, on threads of the holding stage: a failure at the evicting end of
    that pair still stops every rank well before the timeout."""
    options = ("--devices", "4", "--in-block", "--balance-activations")
    proc, elapsed = _run_job(tmp_path, mode, rank, *options)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < LIMIT_S
    if mode == "raise":  # a worker raising: the launching process reports its error
        expected = (
            "[rank0]: lightning_pipe2bw.failures.record.StageFailure: rank 3 (stage 0) failed "
            "in action 0F"
        )
        assert expected in out, out[-4000:]
        assert "ValueError: failing on purpose at step 2" in out
        assert "pipe2bw: rank 0 (stage 3) stops: rank 3 (stage 0) failed in" in out, out[-4000:]
        # and the failing worker printed its own traceback before anything could stop it
        assert "pipe2bw: rank 3 (stage 0) failed in action 0F" in out
        assert 'raise ValueError(f"failing on purpose' in out


# 2bw (node_job.py's schedule): the schedule with the most state to resume (its second weight
# version and batch count); resuming every schedule exactly is tests/ranks/test_checkpoint.py's,
# without killing processes. Killing one rank and restarting under torchrun:
# tests/launch/test_launch.py's elastic restart.
def test_crash_and_resume_from_last_is_exact(
    tmp_path: Path, one_node_2: dict[str, torch.Tensor]
) -> None:
    """Kill the whole run (SIGKILL, every rank) after step 4, past the checkpoint at step 3,
    and start it again: the fit resumes from ``last.ckpt`` and the weights after 6 steps equal
    an uninterrupted run's (without checkpoints), bit for bit."""
    ckpt = tmp_path / "ckpt"
    crashed = run_node_job(tmp_path, "--weights", "unused.pt", "--ckpt-dir", str(ckpt),
                           "--kill-all-after", "4")  # fmt: skip
    assert crashed.returncode == -9, crashed.stderr[-3000:]  # the launching process too
    assert (ckpt / "last.ckpt").is_file()
    assert not list(ckpt.glob("*.tmp"))
    assert not (tmp_path / "unused.pt").exists()
    out = tmp_path / "resumed.pt"
    resumed = run_node_job(tmp_path, "--weights", str(out), "--ckpt-dir", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    diff = max_abs_diff(weights(out), one_node_2)
    print(f"CRASH-RESUME 2bw: max|dW| vs an uninterrupted run {diff:.1e}")
    assert diff == 0.0
