"""SIGTERM and SIGINT, to the launching process, to the whole process group or to one worker,
end every rank of a running pipeline within 30 seconds, exit non-zero, name the signal and leave
no process; and a rendezvous port held by another process fails at once with an error naming it.

Each test starts a real 2-process fit (``tests/helpers/jobs/signal_job.py``, ``start_method="popen"``:
the launching process is rank 0 and re-runs the script for rank 1) in a session of its own,
waits until both ranks train, sends the signal and times how long until no process of the
session is left. (Before ``SignalGuard``, SIGTERM to the group or to a worker left the ranks
waiting for the 3-minute process-group timeout, and SIGTERM to the launching process exited 0.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from helpers import JOBS

from lightning_pipe2bw.seam.launcher import WorkerWatch

LIMIT_S = 30.0  # every process gone within this of the signal


def _session(proc: subprocess.Popen[str]) -> list[int]:
    """The live processes of the job's session (its launching process and workers)."""
    proc.poll()  # reap the launching process once it has exited (it is this test's child)
    out = subprocess.run(["ps", "-eo", "pid=,sid=,stat="], capture_output=True, text=True).stdout
    rows = (line.split() for line in out.splitlines())
    return [int(p) for p, s, stat in rows if int(s) == proc.pid and not stat.startswith("Z")]


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    token = f"signal-{uuid.uuid4().hex[:12]}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    log = tmp_path / "out.txt"
    proc = subprocess.Popen(
        [sys.executable, str(JOBS / "signal_job.py"), "--token", token, *args],
        cwd=tmp_path,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and log.read_text().count("training rank") < 2:
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    assert log.read_text().count("training rank") == 2, log.read_text()[-3000:]
    return proc, token


# each target once and each signal at the launching process (its exit status differs by signal);
# the ranks' handler is one for both signals
@pytest.mark.parametrize(
    ("target", "signum"),
    [
        ("launcher", signal.SIGTERM),
        ("launcher", signal.SIGINT),
        ("group", signal.SIGINT),
        ("worker", signal.SIGTERM),
    ],
    ids=["launcher-SIGTERM", "launcher-SIGINT", "group-SIGINT", "worker-SIGTERM"],
)
def test_a_signal_ends_every_rank(tmp_path: Path, target: str, signum: signal.Signals) -> None:
    proc, token = _start(tmp_path)
    log = tmp_path / "out.txt"
    worker = next(
        int(line.split()[-1]) for line in log.read_text().splitlines() if "training rank 1" in line
    )
    start = time.monotonic()
    if target == "launcher":
        os.kill(proc.pid, signum)
    elif target == "group":
        os.killpg(proc.pid, signum)
    else:
        os.kill(worker, signum)
    while _session(proc) and time.monotonic() - start < LIMIT_S * 2:
        time.sleep(0.1)
    elapsed = time.monotonic() - start
    left = _session(proc)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=10)
    out = log.read_text()
    print(
        f"SIGNAL {signum.name} to the {target}: every rank gone in {elapsed:.1f} s, exit code "
        f"{proc.returncode}"
    )
    assert not left, f"processes left behind: {left}\n{out[-3000:]}"
    assert elapsed < LIMIT_S, out[-3000:]
    # the launching process exits on its own, with a status (before WorkerWatch, Lightning's
    # observer often killed it with SIGKILL, -9, while it was stopping)
    assert proc.returncode > 0, out[-3000:]
    if target == "launcher":  # 128 + 15 after SIGTERM; 1 after SIGINT, as Lightning exits
        assert proc.returncode == (143 if signum == signal.SIGTERM else 1), out[-3000:]
    assert f"received {signum.name}" in out, out[-3000:]
    assert "finished without a signal" not in out
    assert not subprocess.run(["pgrep", "-f", token], capture_output=True).stdout


def test_a_port_in_use_fails_at_once_naming_it(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        token = f"signal-{uuid.uuid4().hex[:12]}"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MASTER_PORT=str(port))
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, str(JOBS / "signal_job.py"), "--token", token],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    print(f"PORT in use: failed in {elapsed:.1f} s, exit code {proc.returncode}")
    assert proc.returncode != 0
    assert f"MASTER_PORT={port} is already in use on this machine" in out, out[-3000:]
    assert "unset MASTER_PORT to let Lightning pick a free port" in out
    assert "training rank" not in out  # no worker was started
    assert not subprocess.run(["pgrep", "-f", token], capture_output=True).stdout


def test_the_worker_watch_ends_a_launching_process_that_outlives_a_failed_worker() -> None:
    """A worker exits with an error while another still runs: ``grace_s`` later the watch kills
    the one left and ends the launching process (here: sets an event instead of SIGKILL)."""
    failing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); exit(3)"])
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ended = threading.Event()
    start = time.monotonic()
    WorkerWatch([failing, running], grace_s=2.0, poll_s=0.1, end=ended.set).start()
    assert ended.wait(timeout=30), "the watch did not end the launching process"
    elapsed = time.monotonic() - start
    assert failing.returncode == 3
    assert running.wait(timeout=5) == -signal.SIGKILL
    assert 2.5 <= elapsed < 10, elapsed  # the failure (0.5 s) plus the grace, not at once


def test_the_worker_watch_leaves_a_run_whose_workers_succeed() -> None:
    worker = subprocess.Popen([sys.executable, "-c", "exit(0)"])
    ended = threading.Event()
    watch = WorkerWatch([worker], grace_s=0.1, poll_s=0.05, end=ended.set)
    watch.start()
    watch.join(timeout=30)
    assert not watch.is_alive() and not ended.is_set()
