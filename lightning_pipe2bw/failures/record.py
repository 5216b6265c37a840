"""Failures that explain themselves: which rank failed, in which stage and action, and why.

When a rank fails (any exception during fit), the strategy sends a *failure notice* to its
pipeline neighbours on the channels they already read from (see ``P2PTransport.notify``). A
neighbour that is waiting for a message from that rank, or posts its next receive there, gets
the notice instead of a tensor and raises :class:`StageFailure`, which names the rank that failed
first, its stage, the schedule action it was in (``1B3``: stage 1, backward of micro-batch 3)
and the original exception; it then passes the notice on to its own other neighbour, so the
failure travels along the whole pipeline in well under a second.

A rank that is killed (SIGKILL, the out-of-memory killer, a lost node) sends nothing; its
connections close, so a neighbour waiting for it fails at once, and the :class:`StageFailure` it
raises says which rank went silent, with no error of its own.

A rank that hangs without failing (a deadlock in user code) sends nothing and closes nothing.
Its neighbours wait for it until a deadline, then fail naming it. The ranks further along wait
for those neighbours in turn, so their deadlines are longer (:func:`wait_limits`): the rank next
to the hang gives up first, and its notice reaches the others before their own deadlines pass.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "FailureRecord",
    "SignalStop",
    "StageFailure",
    "action_of",
    "lost_peer",
    "mark_action",
    "new_run",
    "say",
    "wait_limits",
]

_ACTION_ATTR = "_pipe2bw_action"
_runs = 0


def new_run() -> int:
    """A new run number. Every rank creates its pipeline transports in the same order, so the
    numbers agree across ranks; each transport sends on a tag of its own run, so a notice left
    unread on a channel by an earlier run (whose ranks all failed at once) is never taken for a
    message of this one."""
    global _runs
    _runs += 1
    return _runs


@dataclass(frozen=True)
class FailureRecord:
    """The first failure of a run, as passed from rank to rank."""

    rank: int
    stage: int
    action: str  # the compact action (``1B3``), or where outside the pipeline it happened
    error: str  # ``TypeName: message``
    run: int = 0  # the run number of the transport that sent it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FailureRecord:
        return cls(
            int(data["rank"]),
            int(data["stage"]),
            str(data["action"]),
            str(data["error"]),
            int(data["run"]),
        )

    def describe(self) -> str:
        return f"rank {self.rank} (stage {self.stage}) failed in {self.action}: {self.error}"


class StageFailure(RuntimeError):
    """Another rank of the pipeline failed or vanished; the message says which and why."""

    def __init__(self, message: str, record: FailureRecord, source: int) -> None:
        super().__init__(message)
        self.record = record  # the first failure (for a vanished rank: that rank, no error)
        self.source = source  # the rank this rank heard it from (or lost contact with)


class SignalStop(SystemExit):
    """This rank received a signal that ends the run (SIGTERM): raised in its main thread, it
    takes the failure path (the other ranks are told) and exits with status 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + int(signum))
        self.signum = int(signum)

    def __str__(self) -> str:
        return f"received {signal.Signals(self.signum).name}"


def mark_action(error: BaseException, action: str) -> None:
    """Remember the schedule action ``error`` was raised in (the innermost one wins)."""
    if getattr(error, _ACTION_ATTR, None) is None:
        try:
            setattr(error, _ACTION_ATTR, action)
        except (AttributeError, TypeError):  # an exception type that refuses attributes
            pass


def action_of(error: BaseException) -> str | None:
    return getattr(error, _ACTION_ATTR, None)


def wait_limits(stage: int, num_stages: int, timeout_s: float) -> tuple[float, float]:
    """How long ``stage`` waits for a forward input and for a backward gradient, in seconds.

    A receive at stage ``s`` waits, through its neighbour, on every stage before it (forward) or
    after it (backward). Its limit grows with the number of stages it can be waiting on, from
    half of ``timeout_s`` for none in between to all of ``timeout_s`` for the whole pipeline, so
    the rank next to a hung one times out first and names it: the others get its notice instead
    of timing out on a neighbour that is itself only waiting. (Ranks that started waiting more
    than ``timeout_s / (2 (p - 1))`` apart can still both time out.) Every limit is within the
    process group's own timeout, which bounds everything else.
    """
    span = num_stages - 1
    if span <= 1:
        return timeout_s, timeout_s
    forward = timeout_s * (0.5 + 0.5 * stage / span)
    backward = timeout_s * (0.5 + 0.5 * (span - stage) / span)
    return forward, backward


def say(text: str) -> None:
    """Write ``text`` and a newline to stderr in one write, so that lines from several ranks
    sharing the launcher's stderr do not run into each other."""
    data = (text.rstrip("\n") + "\n").encode()
    try:
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), data)
    except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor
        print(text, file=sys.stderr, flush=True)


def lost_peer(
    peer: int, peer_stage: int, stage: int, action: str, error: BaseException
) -> StageFailure:
    """The error for a receive or send of ``action`` on ``stage`` that failed because the peer
    (rank ``peer``, stage ``peer_stage``) is gone or stopped answering (the process group's
    timeout passed)."""
    if "timed out" in str(error).lower():
        what = (
            "it stopped answering: nothing came from it within the process-group timeout (it "
            "hangs, or keeps the pipeline waiting longer than the timeout allows; raise "
            "Pipe2BWStrategy(timeout=...) if that is expected)"
        )
        verb = "rank {peer} (stage {peer_stage}) timed out"
    else:
        what = (
            "its process vanished without reporting an error (killed by a signal or the "
            "out-of-memory killer, or its node was lost; or it timed out waiting for another "
            "rank, which breaks its connections before it can tell anyone: see its own error)"
        )
        verb = "lost rank {peer} (stage {peer_stage})"
    record = FailureRecord(rank=peer, stage=peer_stage, action="an unknown action", error=what)
    message = (
        f"{verb.format(peer=peer, peer_stage=peer_stage)} while this stage ({stage}) ran "
        f"action {action}: {type(error).__name__}: {error}. {record.describe()}"
    )
    return StageFailure(message, record, source=peer)
