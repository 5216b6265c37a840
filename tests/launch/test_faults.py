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
from typing import Any

import pytest
from helpers import JOBS

JOB = JOBS / "fault_job.py"
LIMIT_S = 90  # startup is ~10 s here; a hang would last until the 3-minute timeout


def _run_job(
    tmp_path: Path, mode: str, rank: int, *options: str, transport: str = "auto"
) -> tuple[subprocess.CompletedProcess[str], float]:
    token = f"fault-{uuid.uuid4().hex[:12]}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PIPE2BW_TRANSPORT=transport)
    cmd = [sys.executable, str(JOB), "--mode", mode, "--rank", str(rank), "--token", token]
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


@pytest.mark.parametrize(("rank", "stage", "other"), [(0, 1, 1), (1, 0, 0)])
def test_a_raising_rank_stops_every_rank(tmp_path: Path, rank: int, stage: int, other: int) -> None:
    proc, elapsed = _run_job(tmp_path, "raise", rank)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < LIMIT_S
    assert "finished without a failure" not in out
    # the other rank reports the first failure: rank, stage, action (a forward of this stage,
    # PipeDream-2BW version 1) and the original exception
    expected = (
        f"[rank{other}]: lightning_pipe2bw.runtime.failure.StageFailure: rank {rank} (stage "
        f"{stage}) failed in action {stage}F4v1: ValueError: failing on purpose at step 2"
    )
    assert expected in out, out[-4000:]
    # and the failing rank printed its own traceback before anything could stop it
    assert f"pipe2bw: rank {rank} (stage {stage}) failed in action {stage}F4v1" in out
    assert 'raise ValueError(f"failing on purpose' in out


@pytest.mark.parametrize(
    ("rank", "stage", "other", "transport"),
    [(0, 1, 1, "auto"), (1, 0, 0, "auto"), (1, 0, 0, "gloo")],
    ids=["rank0", "rank1", "rank1-gloo"],
)
def test_a_killed_rank_stops_every_rank(
    tmp_path: Path, rank: int, stage: int, other: int, transport: str
) -> None:
    """Over shared memory (the default here) the neighbour sees the killed rank's socket close;
    over gloo its connection break."""
    proc, elapsed = _run_job(tmp_path, "kill", rank, transport=transport)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0  # -9 when the launching process itself was killed
    assert elapsed < LIMIT_S
    assert (
        f"[rank{other}]: lightning_pipe2bw.runtime.failure.StageFailure: lost rank {rank} " in out
    )
    assert f"rank {rank} (stage {stage}) failed in an unknown action: its process vanished" in out


@pytest.mark.parametrize(
    ("rank", "stage", "other", "how"),
    [
        (0, 1, 1, "its process vanished without reporting an error"),
        (1, 0, 0, "its process was killed by SIGKILL (signal 9)"),  # a worker rank 0 started
    ],
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
        f"[rank{other}]: lightning_pipe2bw.runtime.failure.StageFailure: lost rank {rank} "
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
    assert "trainer.save_checkpoint on rank 0 (stage 1): not every rank took part" in out, out[-3000:]
    assert "Ranks 1 failed to pass monitoredBarrier" in out
    assert "must be called on every rank" in out
    assert "call it outside `if trainer.global_rank == 0:`" in out
    assert not (tmp_path / "whole.ckpt").exists()


@pytest.mark.parametrize(("rank", "stage", "other"), [(0, 1, 1), (1, 0, 0)])
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
        f"[rank{other}]: lightning_pipe2bw.runtime.failure.StageFailure: rank {rank} (stage "
        f"{stage}) timed out while this stage ({1 - other}) ran action" in out
    ), out[-4000:]
    assert "it stopped answering" in out
    if rank == 1:  # the worker hangs; the launching process (rank 0) kills it
        assert "pipe2bw: killing worker process" in out


@pytest.mark.parametrize(("mode", "rank"), [("raise", 1), ("kill", 1), ("hang", 0)])
def test_a_failure_travels_along_a_longer_pipeline(tmp_path: Path, mode: str, rank: int) -> None:
    """Three stages (rank 1 runs the middle one, rank 0 the last); the failure happens in a body
    block. A failure in the middle reaches both ends. A hang at the end is noticed first by its
    neighbour (whose wait limit is shorter, see ``failure.wait_limits``), which names it and
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


@pytest.mark.parametrize(("mode", "rank"), [("raise", 3), ("kill", 0)])
def test_a_failure_at_either_end_of_a_balanced_pair_stops_every_rank(
    tmp_path: Path, mode: str, rank: int
) -> None:
    """With BPipe on 4 stages, stage 0 (rank 3) and stage 3 (rank 0) also exchange activations
    over their offload link, on threads of the holding stage: a failure at either end of that
    pair still stops every rank well before the timeout."""
    options = ("--devices", "4", "--in-block", "--balance-activations")
    proc, elapsed = _run_job(tmp_path, mode, rank, *options)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < LIMIT_S
    if mode == "raise":
        assert "rank 3 (stage 0) failed in action 0F" in out, out[-4000:]
        assert "pipe2bw: rank 0 (stage 3) stops: rank 3 (stage 0) failed in" in out, out[-4000:]


def _fit_with_rank_dependent_options(option: str) -> str:
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    rank = dist.get_rank()
    kwargs: dict[str, object] = {"microbatches": 2}
    if option == "schedule":
        kwargs["schedule"] = ["2bw", "1f1b"][rank]
    elif option == "microbatches":
        kwargs["microbatches"] = [2, 4][rank]
    elif option == "balance":
        kwargs["balance"] = [[4, 4], [3, 5]][rank]
    trainer = quiet_trainer(
        devices=dist.get_world_size(), strategy=Pipe2BWStrategy(**kwargs), max_steps=2
    )
    try:
        trainer.fit(RegressionModel(), loader(8))
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    ("option", "listed"),
    [
        ("schedule", "schedule (rank 0: '2bw', rank 1: '1f1b')"),
        ("microbatches", "microbatches (rank 0: 2, rank 1: 4)"),
        ("balance", "balance (rank 0: (4, 4), rank 1: (3, 5))"),
    ],
)
def test_ranks_set_up_differently_are_refused(pools: Any, option: str, listed: str) -> None:
    """A mismatch that would deadlock the schedule is caught at set-up, on every rank."""
    for message in pools(2).run(_fit_with_rank_dependent_options, option, timeout=60):
        assert message.startswith("the ranks of this pipeline were set up differently"), message
        assert listed in message, message


def _fit_with_debug_log() -> list[str]:
    import logging
    import os

    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("lightning_pipe2bw.actions")
    handler = Collect()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    os.environ["PIPE2BW_DEBUG"] = "1"
    try:
        trainer = quiet_trainer(
            devices=dist.get_world_size(),
            strategy=Pipe2BWStrategy(schedule="1f1b", microbatches=2),
            max_steps=2,
        )
        trainer.fit(RegressionModel(), loader(8))
    finally:
        del os.environ["PIPE2BW_DEBUG"]
        logger.removeHandler(handler)
    return messages


def test_debug_mode_logs_every_action(pools: Any) -> None:
    """PIPE2BW_DEBUG=1: each action's start and end, with rank, stage, micro-batch and time."""
    for rank, messages in enumerate(pools(2).run(_fit_with_debug_log)):
        stage = 1 - rank
        starts = [m for m in messages if " start " in m]
        ends = [m for m in messages if " end " in m]
        # 1F1B with 2 micro-batches: 2 forwards, 2 backwards and 4 transfers per step, 2 steps
        assert len(starts) == len(ends) == 16, messages
        assert all(m.startswith(f"rank {rank} stage {stage} ") for m in messages)
        first = f"{stage}F0" if stage == 0 else f"{stage}RECV_F0"  # the last stage waits first
        assert f"rank {rank} stage {stage} start {first} (micro-batch 0) t=" in messages[0]
        assert messages[-1].startswith(f"rank {rank} stage {stage} end ")


RESUME_JOB = JOBS / "resume_job.py"


def _launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(RESUME_JOB), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=LIMIT_S * 2,
    )  # fmt: skip


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_crash_and_resume_from_last_is_exact(tmp_path: Path, schedule: str) -> None:
    """Kill the whole run (SIGKILL, every rank) after the checkpoint at step 3, start it again
    with ckpt_path="last": the weights after 6 steps equal an uninterrupted run's, bit for bit."""
    import torch
    from helpers.models import max_abs_diff

    straight = _launch(
        tmp_path, "--schedule", schedule, "--ckpt-dir", str(tmp_path / "a"), "--out", "a.pt"
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    crashed = _launch(
        tmp_path, "--schedule", schedule, "--ckpt-dir", str(tmp_path / "b"), "--kill-after", "4"
    )
    assert crashed.returncode == -9  # the launching process (rank 0) was killed too
    assert (tmp_path / "b" / "last.ckpt").is_file()
    assert not list((tmp_path / "b").glob("*.tmp"))
    resumed = _launch(
        tmp_path, "--schedule", schedule, "--ckpt-dir", str(tmp_path / "b"), "--resume",
        "--out", "b.pt",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    diff = max_abs_diff(a, b)
    print(f"CRASH-RESUME {schedule}: max|dW| = {diff:.3e}")
    assert diff <= 1e-6


def _fit_with_bad_input(case: str) -> None:
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    class DetachedLoss(RegressionModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return super().training_step(batch, batch_idx).detach()

    rank = dist.get_rank()
    model = DetachedLoss() if case == "detached_loss" else RegressionModel()
    batch_size = [8, 6][rank] if case == "different_batches" else 8
    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule="1f1b", microbatches=2),
        max_steps=2,
    )
    # the error leaves the task, as it leaves a real run: the pool then starts fresh ranks, since
    # the failed run left messages in flight on the process group it shared with later tests
    trainer.fit(model, loader(batch_size))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "different_batches",
            "ValueError: the ranks read different batches: stage 0 split micro-batch 0 into "
            "tensors of shapes [(3, 6), (3, 3)], this stage (1) into [(4, 6), (4, 3)]",
        ),
        ("detached_loss", "ValueError: the loss of micro-batch 0 does not require grad"),
    ],
)
def test_bad_input_fails_on_the_stage_that_sees_it(pools: Any, case: str, message: str) -> None:
    """The last stage (rank 0) raises the error; the first stage (rank 1) stops with a
    StageFailure that carries it, instead of waiting for gradients that never come."""
    from helpers.pool import TaskError

    with pytest.raises(TaskError) as info:
        pools(2).run(_fit_with_bad_input, case, timeout=60)
    text = str(info.value)
    assert info.value.reason.startswith("_fit_with_bad_input failed on ranks [0, 1]"), text
    rank0, rank1 = text.split("--- rank 1 ---")
    assert message in rank0, rank0[-2000:]
    assert "StageFailure: rank 0 (stage 1) failed in action 1" in rank1, rank1[-2000:]
    assert message.split(": ", 1)[1] in rank1, rank1[-2000:]


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_wait_limits_grow_away_from_a_hang(stages: int) -> None:
    """Wherever a rank hangs, its neighbour's limit is the shortest on the waiting chain: the
    limits are within the timeout, at least half of it, and grow by stage in the direction of the
    wait (forward inputs flow to higher stages, gradients to lower)."""
    from lightning_pipe2bw.runtime.failure import wait_limits

    limits = [wait_limits(s, stages, 60.0) for s in range(stages)]
    for forward, backward in limits:
        assert 30.0 <= forward <= 60.0 and 30.0 <= backward <= 60.0
    if stages > 2:
        forwards = [f for f, _ in limits[1:]]  # stage 0 receives no forward input
        backwards = [b for _, b in limits[:-1]]  # the last stage receives no gradient
        assert forwards == sorted(forwards) and len(set(forwards)) == len(forwards)
        assert backwards == sorted(backwards, reverse=True)
        assert len(set(backwards)) == len(backwards)
        assert limits[-1][0] == 60.0 and limits[0][1] == 60.0
    else:
        assert limits == [(60.0, 60.0)] * stages
