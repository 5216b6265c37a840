"""Who the other ranks are (host, process id), and what became of one that is gone.

Inside the pipeline schedule a lost neighbour is named by the engine. Outside it (a checkpoint's
gather, a barrier, the step values' delivery) a rank that dies leaves the others with the
process group's own error: ``Connection reset by peer`` from gloo, naming an address. The
:class:`PeerDirectory` (gathered once at set-up) turns that into an error naming the rank, its
stage and how it died: the exit status of a worker this process launched, else whether its
process still exists on this host.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from lightning_pipe2bw.failures.record import FailureRecord, StageFailure

__all__ = ["PeerDirectory"]

# what a collective's error says when the process at the other end is gone
_LOST_MARKS = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "process is gone",
)


def looks_lost(error: BaseException) -> bool:
    """Whether ``error`` (from a collective or a send) says the other end's process is gone."""
    text = str(error).lower()
    return isinstance(error, (RuntimeError, ConnectionError, OSError)) and any(
        mark in text for mark in _LOST_MARKS
    )


@dataclass(frozen=True)
class RankProcess:
    rank: int
    host: str
    pid: int


class PeerDirectory:
    """Every rank's host and process id (see the module notes)."""

    def __init__(
        self, processes: list[RankProcess], me: int, stage_of: Callable[[int], int]
    ) -> None:
        self.processes = processes
        self.me = me
        self.stage_of = stage_of

    @classmethod
    def gather(cls, stage_of: Callable[[int], int]) -> PeerDirectory:
        """Collective over the default group: every rank's host and process id."""
        mine = RankProcess(dist.get_rank(), socket.gethostname(), os.getpid())
        found: list[RankProcess | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
        return cls([p for p in found if p is not None], dist.get_rank(), stage_of)

    def fate(self, process: RankProcess, exit_codes: Mapping[int, int | None]) -> str | None:
        """How ``process`` ended, or None while it runs (or when it runs on another host, where
        this process cannot look). ``exit_codes``: the exit status of the processes this one
        launched, by process id (None: still running)."""
        code = exit_codes.get(process.pid)
        if process.pid in exit_codes:
            if code is None:
                return None
            if code < 0:
                name = signal.Signals(-code).name
                return f"its process was killed by {name} (signal {-code})"
            return f"its process exited with status {code} without reporting an error"
        if process.host != socket.gethostname():
            return None
        try:
            os.kill(process.pid, 0)
        except ProcessLookupError:
            return _VANISHED
        except PermissionError:
            return None
        if _zombie(process.pid):
            return _VANISHED
        return None

    def check_readable(self, path: str) -> None:
        """Collective over the default group: every rank can read the checkpoint ``path``
        (each rank reads it to take its own stage's part), else a ``FileNotFoundError``
        (``ValueError`` for a damaged file) naming each rank that cannot, its host and what it
        found, raised on every rank at once, before any rank waits on another."""
        mine = checkpoint_problem(path)
        sharded = Path(path).is_dir()
        found: list[tuple[int, str, str | None] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, (self.me, socket.gethostname(), mine))
        bad = [(r, host, why) for r, host, why in filter(None, found) if why is not None]
        if not bad:
            return
        lines = "; ".join(
            f"rank {r} (stage {self.stage_of(r)}) on host {host}: {why}" for r, host, why in bad
        )
        hosts = {host for _, host, _ in filter(None, found)}
        missing = all(why.startswith("no such") for _, _, why in bad)
        if missing:
            where = (
                "every rank reads the checkpoint (each takes its own stage's part), so it must be "
                "at this path on every node: put it on a file system every node mounts, or copy "
                "it to the same path on each node"
            )
            if len(hosts) > 1 and not sharded:
                where += (
                    " (a sharded checkpoint, state_dict_type='sharded', still needs its directory "
                    "on every node)"
                )
            raise FileNotFoundError(f"cannot resume from {path!r}: {lines}. {where}")
        raise ValueError(
            f"cannot resume from {path!r}: {lines}. The file is damaged or was cut short (a "
            "save that did not finish, a copy still in progress, a full disk): resume from an "
            "earlier checkpoint"
        )

    def lost(
        self,
        error: BaseException,
        where: str,
        exit_codes: Callable[[], Mapping[int, int | None]],
        settle_s: float = 3.0,
    ) -> StageFailure | None:
        """The error naming the rank ``error`` lost contact with, when it says the other end
        is gone and a rank's process is found gone within ``settle_s``; None otherwise (the
        error stands). ``exit_codes()``: the exit status of the processes this one launched."""
        if isinstance(error, StageFailure) or not looks_lost(error):
            return None
        # a process closes its connections before it is gone: give it a moment to be
        deadline = time.monotonic() + settle_s
        while True:
            gone = [
                (p, why)
                for p in self.processes
                if p.rank != self.me and (why := self.fate(p, exit_codes())) is not None
            ]
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if not gone:
            return None
        process, why = gone[0]
        stage = self.stage_of(process.rank)
        record = FailureRecord(process.rank, stage, "code outside the pipeline schedule", why)
        others = f" (also gone: ranks {[p.rank for p, _ in gone[1:]]})" if len(gone) > 1 else ""
        message = (
            f"lost rank {process.rank} (stage {stage}, process {process.pid} on "
            f"{process.host}){others} while this rank ({self.me}, stage {self.stage_of(self.me)}) "
            f"was in {where}, outside the pipeline schedule: {type(error).__name__}: "
            f"{_first_line(error)}. {record.describe()}"
        )
        return StageFailure(message, record, source=process.rank)


_VANISHED = (
    "its process vanished without reporting an error (killed by a signal or the out-of-memory "
    "killer)"
)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits for its parent to collect it (Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def checkpoint_problem(path: str) -> str | None:
    """What keeps this process from reading the checkpoint ``path``, or None. A ``torch.save``
    file is a zip archive whose directory is at its end: a file cut short has none."""
    target = Path(path)
    if not target.exists():
        return "no such file or directory"
    if target.is_dir():  # a sharded checkpoint: torch.distributed.checkpoint reads it
        return None if os.access(target, os.R_OK | os.X_OK) else "the directory is not readable"
    try:
        with target.open("rb") as f:
            head = f.read(4)
    except OSError as err:
        return f"cannot open it ({err})"
    size = target.stat().st_size
    if head[:2] != b"PK":  # torch's older pickle format, or not torch's at all
        return None if head[:1] == b"\x80" else f"not a torch checkpoint ({size} bytes)"
    try:
        with zipfile.ZipFile(target):
            pass
    except (zipfile.BadZipFile, OSError) as err:
        return f"a damaged or truncated file of {size} bytes ({err})"
    return None
