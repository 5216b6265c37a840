"""A pool of worker processes with torch.distributed initialised once, for multi-process tests.

Workers look to Lightning like ranks started by ``torchrun`` (TorchElastic environment), so a
``Trainer(strategy=Pipe2BWStrategy(...), devices=N)`` built inside them runs without launching
anything, and many Trainer runs share one process group. A task that fails or times out on any
rank tears the pool down (a stuck rank cannot be reused) and the next task starts a fresh one.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from lightning_pipe2bw.launcher import torchrun_environment

__all__ = ["DistPool", "TaskError"]


class TaskError(RuntimeError):
    """A task raised on a worker; the message holds every failing rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    os.environ.update(torchrun_environment(rank, world_size, port, "pipe2bw-tests"))
    torch.set_num_threads(1)
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistPool:
    """``world_size`` gloo ranks that run picklable module-level functions on request."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 240, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            while len(out) + len(errors) < self.world_size:
                rank, ok, value = self._results.get(timeout=timeout)
                (out if ok else errors)[rank] = value
                if errors and len(out) + len(errors) < self.world_size:
                    # the other ranks may now be stuck waiting for the failed one
                    timeout = min(timeout, 10)
        except queue.Empty:
            self.close()
            missing = sorted(set(range(self.world_size)) - out.keys() - errors.keys())
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise TaskError(f"ranks {missing} did not finish {fn.__name__}{detail}") from None
        if errors:
            self.close()
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise TaskError(f"{fn.__name__} failed on ranks {sorted(errors)}{detail}")
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs, strict=False):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        self._tasks = []
