"""Starting and stopping the workers: spawned workers whose results (gathered weights,
predictions) come back to the launching process, and the clean-up after a failure.

The launcher knows the strategy only through :class:`GatheringStrategy` (what it calls), so the
two modules do not import each other.
"""

from __future__ import annotations

import errno
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_pipe2bw.compat import (
    GlobalStateSnapshot,
    Launcher,
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    WorkerOutput,
    launched_processes,
    set_num_threads_if_needed,
    start_worker_scripts,
    unshare_module_memory,
)
from lightning_pipe2bw.failures.record import say

__all__ = [
    "PipePopenLauncher",
    "PipeSpawnLauncher",
    "kill_workers",
    "signal_workers",
    "stop_workers",
    "torchrun_environment",
]


class GatheringStrategy(Protocol):
    """What the spawn launcher needs of the strategy whose workers it starts."""

    @property
    def global_rank(self) -> int: ...

    @property
    def checkpoint_io(self) -> Any: ...

    @property
    def cluster_environment(self) -> Any: ...

    @property
    def accelerator(self) -> Any: ...

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's state dict on global rank 0 (collective; ``{}`` elsewhere)."""
        ...


def torchrun_environment(rank: int, world_size: int, port: int, run_id: str) -> dict[str, str]:
    """The environment that makes a process look like a ``torchrun`` rank on one machine, one
    intra-op thread. Lightning then launches nothing and joins the process group the process
    initialises itself; process pools for tests and benchmarks start their workers with it."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "OMP_NUM_THREADS": "1",
    }


def check_port_free(address: str, port: int) -> None:
    """Raise a clear error if ``port`` cannot be listened on here: the process group's store
    (on global rank 0) needs it, and workers started with a port that another process holds
    connect to that process and wait for ever."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # as the store does: a port left in TIME_WAIT by an earlier run is free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("" if address in ("127.0.0.1", "localhost") else address, port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                return  # another address family or an address of another machine: not ours
            raise RuntimeError(
                f"MASTER_PORT={port} is already in use on this machine (another process "
                f"listens on it), so the ranks could not meet there; unset MASTER_PORT to let "
                f"Lightning pick a free port, or set MASTER_PORT to a free one (e.g. "
                f"MASTER_PORT={_free_port()})"
            ) from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class PipePopenLauncher(SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher (the script re-run once per rank), with two changes.

    * It first checks that the rendezvous port is free: with a port in use, the workers it
      started would connect to whatever holds it and hang, and only rank 0 would report the error.
    * The workers are watched by a :class:`WorkerWatch` instead of Lightning's observer, which
      kills the launching process (``SIGKILL``) within 5 s of any worker exiting with an error.
      Here the launching process is a stage too, and when a worker fails it is told at once and
      stops on its own: its error, its exit status (143 after ``SIGTERM``) and its clean-up
      (loggers, the other workers) would be cut short. The watch kills it only if it has not
      stopped ``grace_s`` after the worker's exit.

    Args:
        grace_s: how long the launching process has to stop on its own after a worker failed.
    """

    def __init__(self, *args: Any, grace_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grace_s = grace_s

    @override
    def launch(
        self, function: Any, *args: Any, trainer: Trainer | None = None, **kwargs: Any
    ) -> Any:
        env = self.cluster_environment
        env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not env.creates_processes_externally:
            if self.num_processes > 1 and env.node_rank() == 0:
                check_port_free(env.main_address, env.main_port)
            start_worker_scripts(self)
            WorkerWatch(launched_processes(self), self.grace_s).start()
        set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class WorkerWatch(threading.Thread):
    """Watches the worker processes of a ``popen`` run from the launching process. Once one has
    exited with an error and the launching process is still alive ``grace_s`` later, it kills
    every worker left and calls ``end``, which ends the launching process (by default ``SIGKILL``
    to itself): a launching process stuck outside the pipeline (in a user's collective, say)
    cannot outlive its workers. A daemon thread: it ends with the process, or once every worker
    exited with 0.

    Args:
        workers: the worker processes (``subprocess.Popen``).
        grace_s: how long the launching process has to stop on its own.
        poll_s: how often the workers are looked at.
        end: what ends the launching process.
    """

    def __init__(
        self,
        workers: Sequence[subprocess.Popen[Any]],
        grace_s: float,
        poll_s: float = 1.0,
        end: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGKILL),
    ) -> None:
        super().__init__(daemon=True, name="pipe2bw-worker-watch")
        self.workers = list(workers)
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.end = end

    @override
    def run(self) -> None:
        failed: subprocess.Popen[Any] | None = None
        while failed is None:
            time.sleep(self.poll_s)
            codes = [proc.poll() for proc in self.workers]
            if all(code == 0 for code in codes):
                return
            failed = next(
                (p for p, c in zip(self.workers, codes, strict=True) if c not in (None, 0)), None
            )
        time.sleep(self.grace_s)
        say(
            f"pipe2bw: worker process {failed.pid} exited with code {failed.returncode} and the "
            f"launching process has not stopped {self.grace_s:.0f} s later: killing every "
            f"process of the run"
        )
        for proc in self.workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.end()


def preload_fork_server() -> None:
    """Have the fork server import torch, Lightning, this package and the main module (when it
    runs as ``python -m``) once, so that each worker forked from it starts without importing them
    again (several seconds a worker: a sweep's jobs start theirs from one fork server). It takes
    effect only where the fork server has not started yet."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    modules = ["__main__", "torch", "lightning.pytorch", "lightning_pipe2bw"]
    if spec is not None and spec.name:
        modules.append(spec.name)
    mp.get_context("forkserver").set_forkserver_preload(modules)


class _GatheringLauncher(MultiProcessingLauncher):
    """Lightning's multiprocessing launcher, but the weights sent back are the whole model's,
    gathered from every stage (each worker holds only its own stage), and ``forkserver`` workers
    start as ``spawn`` workers do.

    Lightning hands a spawned worker the launching process's environment (``os.environ`` when it
    starts), its random states and deterministic flags, and on the CPU a copy of the model's
    tensors. A worker forked from the fork server gets none of these: the fork server's
    environment is the launching process's from when the server started (an earlier job of a
    sweep), and the model's tensors come through shared memory, so that every stage trains on the
    same storage (a weight tied across two stages is updated by both). This launcher sends the
    three along and applies them before the worker starts.
    """

    _strategy: GatheringStrategy  # type: ignore[assignment]

    def __init__(
        self,
        strategy: GatheringStrategy,
        start_method: Literal["spawn", "fork", "forkserver"] = "spawn",
    ) -> None:
        super().__init__(strategy, start_method=start_method)  # type: ignore[arg-type]
        # what a forkserver worker takes from the launching process: set by launch
        self._launching: tuple[dict[str, str], GlobalStateSnapshot] | None = None

    @override
    def launch(
        self, function: Any, *args: Any, trainer: Trainer | None = None, **kwargs: Any
    ) -> Any:
        if self._start_method == "forkserver":
            preload_fork_server()
            # the port Lightning's launch sets is in the environment the worker gets
            assert self._strategy.cluster_environment is not None
            os.environ["MASTER_PORT"] = str(self._strategy.cluster_environment.main_port)
            self._launching = (dict(os.environ), GlobalStateSnapshot.capture())
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _wrapping_function(
        self,
        process_idx: int,
        trainer: Trainer | None,
        function: Callable[..., Any],
        args: Any,
        kwargs: Any,
        return_queue: Any,
        global_states: GlobalStateSnapshot | None = None,
    ) -> None:
        if self._launching is not None:
            environ, global_states = self._launching
            os.environ.clear()
            os.environ.update(environ)
            if isinstance(self._strategy.accelerator, CPUAccelerator):
                args, kwargs = unshare_module_memory((args, kwargs))
        super()._wrapping_function(
            process_idx, trainer, function, args, kwargs, return_queue, global_states
        )

    @override
    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> WorkerOutput | None:
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        state_dict = self._strategy.full_state_dict()  # collective: every rank takes part
        # these workers end right after this; tear the process group down while every rank is
        # still alive (gloo threads torn down at interpreter exit can abort the process)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        if self._strategy.global_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        # results (predictions) travel as bytes: tensors put on a multiprocessing queue are shared
        # through file descriptors that vanish when the worker exits before the parent reads them
        buffer = io.BytesIO()
        torch.save(results, buffer)
        return WorkerOutput(best_model_path, weights_path, trainer.state, buffer.getvalue(), extra)


class PipeSpawnLauncher(Launcher):
    """Starts one worker per stage with ``torch.multiprocessing`` (spawn, fork or forkserver).

    It wraps rather than subclasses Lightning's launcher: Lightning refuses to return
    predictions from launchers of that class, whereas this one brings them back (the last stage
    broadcasts them, so rank 0 returns them).
    """

    def __init__(
        self,
        strategy: GatheringStrategy,
        start_method: Literal["spawn", "fork", "forkserver"] = "spawn",
    ) -> None:
        self._inner = _GatheringLauncher(strategy, start_method=start_method)

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return self._inner.is_interactive_compatible

    @override
    def launch(
        self, function: Any, *args: Any, trainer: Trainer | None = None, **kwargs: Any
    ) -> Any:
        results = self._inner.launch(function, *args, trainer=trainer, **kwargs)
        if trainer is None:
            return results
        # written by this package's own worker a moment ago (see _collect_rank_zero_results)
        return torch.load(io.BytesIO(results), weights_only=False)

    @override
    def kill(self, signum: Any) -> None:
        self._inner.kill(signum)


def stop_workers(launcher: Any, grace_s: float) -> None:
    """In the launching process of a ``popen`` run (``launcher``), wait for the workers it
    started to stop (a failure notice stops them within seconds), then kill those that have
    not: a worker that hangs would otherwise outlive the run. ``torchrun`` and the spawn
    launchers do the same for their own workers; for them this does nothing."""
    if not isinstance(launcher, SubprocessScriptLauncher):
        return
    deadline = time.monotonic() + grace_s
    for proc in launched_processes(launcher):
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            say(
                f"pipe2bw: killing worker process {proc.pid}, which did not stop within "
                f"{grace_s:.0f} s of the failure"
            )
            proc.kill()
            proc.wait()


def kill_workers(launcher: Any) -> None:
    """Kill at once the workers a ``popen`` launcher started (the launching process is about
    to exit and must leave none behind)."""
    if not isinstance(launcher, SubprocessScriptLauncher):
        return
    for proc in launched_processes(launcher):
        if proc.poll() is None:
            proc.kill()


def signal_workers(launcher: Any, signum: int) -> None:
    """Pass ``signum`` on to the workers a ``popen`` launcher started, so that they stop as
    this process does (each takes its own failure path)."""
    if not isinstance(launcher, SubprocessScriptLauncher):
        return
    for proc in launched_processes(launcher):
        if proc.poll() is None:
            proc.send_signal(signum)
