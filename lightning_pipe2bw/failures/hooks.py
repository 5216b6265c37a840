"""A rank's failure at the seam: the strategy's collectives name a rank that is gone, and a
failing rank makes its neighbours and the workers it launched stop.

Inside the schedule the engine names a lost neighbour (``failures.record``); outside it (a
checkpoint's gather, a barrier, the step values' delivery) the strategy's methods marked with
:func:`names_lost_ranks` turn the process group's ``Connection reset by peer`` into an error
naming the rank, its stage and how it died (``failures.peers``).
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from lightning_pipe2bw import compat
from lightning_pipe2bw.failures.peers import PeerDirectory
from lightning_pipe2bw.failures.record import SignalStop, StageFailure
from lightning_pipe2bw.seam.launcher import PipePopenLauncher, signal_workers, stop_workers

__all__ = ["lost_rank", "names_lost_ranks", "stop_workers_after"]

_Method = TypeVar("_Method", bound=Callable[..., Any])


class _NamesLostRanks(Protocol):
    def _lost_rank(self, error: BaseException, where: str) -> StageFailure | None: ...


def names_lost_ranks(where: str) -> Callable[[_Method], _Method]:
    """A strategy method whose collectives, when a rank's process is gone, raise an error that
    names that rank, its stage and how it died (``failures.peers``), not the process group's
    ``Connection reset by peer``; the strategy's ``_lost_rank`` (:func:`lost_rank`) finds it."""

    def wrap(method: _Method) -> _Method:
        @functools.wraps(method)
        def named(self: _NamesLostRanks, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as err:
                failure = self._lost_rank(err, where)
                if failure is None:
                    raise
                raise failure from err

        return cast(_Method, named)

    return wrap


def lost_rank(
    peers: PeerDirectory | None, launcher: object, error: BaseException, where: str
) -> StageFailure | None:
    """The error naming a rank found gone, for ``error`` raised in ``where``; None when the
    error does not say a peer is gone, or no rank is found gone (or no ``peers`` were gathered).
    ``launcher``: the strategy's, whose workers' exit codes say how they died."""
    if peers is None:
        return None

    def exit_codes() -> dict[int, int | None]:  # of the workers this process started
        if not isinstance(launcher, PipePopenLauncher):
            return {}
        return {p.pid: p.poll() for p in compat.launched_processes(launcher)}

    return peers.lost(error, where, exit_codes)


def stop_workers_after(exception: BaseException, launcher: Any, grace_s: float) -> None:
    """In the launching process of a ``popen`` run, after ``exception``: make sure the workers
    stop (passing a signal that stopped this process on to them first)."""
    if isinstance(exception, SignalStop):
        signal_workers(launcher, exception.signum)
    elif isinstance(exception, KeyboardInterrupt):
        signal_workers(launcher, signal.SIGINT)
    stop_workers(launcher, grace_s)
