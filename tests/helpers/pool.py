"""A pool of local gloo ranks, started once, that run functions on request (tests, benchmarks).

Workers look to Lightning like ranks started by ``torchrun`` (see
:func:`~lightning_pipe2bw.seam.launcher.torchrun_environment`), so a ``Trainer(strategy=...,
devices=N)`` built inside them launches nothing, and many Trainer runs share one process group.
A task that fails or times out on any rank tears the pool down (a stuck rank cannot be reused);
the next task starts a fresh one. Ranks are forked from a fork server that imported torch,
Lightning and the package once (:data:`PRELOAD`), so a fresh pool costs a fork instead of an
interpreter that imports them again (about 8 s here, and many tests end with a failing task);
each rank starts with the environment the test process had when the pool started, as a spawned
one would.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_pipe2bw.seam.launcher import torchrun_environment

__all__ = ["Pools", "RankPool", "TaskError"]

# imported once, by the fork server every pool's ranks are forked from (with one intra-op thread:
# torch reads OMP_NUM_THREADS when it loads)
PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_pipe2bw.strategy"]


class TaskError(RuntimeError):
    """A task raised or timed out on some rank: ``reason`` is one line, the message also holds
    every failing rank's traceback."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}\n{detail}" if detail else reason)
        self.reason = reason


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _last_line(tb: str) -> str:
    lines = [line.strip() for line in tb.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "unknown error"


def _worker(
    rank: int,
    world_size: int,
    port: int,
    run_id: str,
    pg_timeout_s: float,
    initializer: Callable[[], None] | None,
    environ: dict[str, str],
    tasks: Any,
    results: Any,
) -> None:
    os.environ.clear()  # the fork server's, from when it started: the test process's now instead
    os.environ.update(environ)
    os.environ.update(torchrun_environment(rank, world_size, port, run_id))
    torch.set_num_threads(1)
    if initializer is not None:
        initializer()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout_s))
    while (task := tasks.get()) is not None:
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` gloo ranks, one intra-op thread each, that run picklable
    module-level functions; restarted after a failure.

    Args:
        world_size: number of ranks.
        run_id: the ``TORCHELASTIC_RUN_ID`` the workers carry.
        pg_timeout_s: the process group's timeout.
        initializer: a picklable function each worker calls once at start.
    """

    def __init__(
        self,
        world_size: int,
        run_id: str = "pipe2bw-pool",
        pg_timeout_s: float = 120.0,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        self.world_size = world_size
        self.run_id = run_id
        self.pg_timeout_s = pg_timeout_s
        self.initializer = initializer
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # no effect once the fork server runs
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        environ = {**os.environ, "OMP_NUM_THREADS": "1"}
        args = (self.run_id, self.pg_timeout_s, self.initializer, environ)
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, *args, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        # the fork server (started by the first start) reads OMP_NUM_THREADS when torch loads
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            for proc in self._procs:
                proc.start()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 240, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; the results in rank order, or
        :class:`TaskError` if any rank raised or ``timeout`` seconds passed."""
        if not self._procs or not all(proc.is_alive() for proc in self._procs):
            self.close()
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                break
            (out if ok else errors)[rank] = value
            if errors:  # the other ranks may now wait forever for the failed one
                deadline = min(deadline, time.monotonic() + 10)
        if errors or len(out) < self.world_size:
            self.close()
            detail = "".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            missing = sorted(set(range(self.world_size)) - out.keys() - errors.keys())
            if errors:
                reason = f"{fn.__name__} failed on ranks {sorted(errors)}: {_last_line(errors[min(errors)])}"
            else:
                reason = f"ranks {missing} did not finish {fn.__name__} within {timeout:.0f} s"
            raise TaskError(reason, detail)
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q, proc in zip(self._tasks, self._procs, strict=False):
            if proc.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs = []
        self._tasks = []


class Pools:
    """``pools(n)``: one :class:`RankPool` of n ranks per n, started on first use (the
    ``pools`` fixture of ``tests/conftest.py`` holds one for the whole session)."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def __call__(self, world_size: int) -> RankPool:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size)
        return self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
