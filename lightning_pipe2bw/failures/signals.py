"""SIGTERM and SIGINT end every rank of a pipeline within seconds, with the signal named.

Cluster managers (SLURM, Kubernetes) send SIGTERM before they kill; a user presses Ctrl-C
(SIGINT, to every process of the terminal's group). Lightning's own SIGTERM handler runs a
collective inside the handler and one more at every training step, which a pipeline's ranks,
busy with point-to-point messages, cannot match: a SIGTERM to some ranks left the others waiting
until the process group's timeout. While a stage runs, :class:`SignalGuard` takes over:

* the handler raises in the rank's main thread: :class:`~lightning_pipe2bw.failures.record.SignalStop`
  for SIGTERM (a ``SystemExit`` with status 128 + 15), ``KeyboardInterrupt`` for SIGINT. Either
  goes through the strategy's failure path: the neighbour stages get a failure notice naming the
  signal and stop, and the launching process stops its workers;
* Python runs a handler only when the main thread is back in Python, and a rank waiting in a
  receive may wait for a peer that is itself stopping. So the signal also wakes a watchdog thread
  (``signal.set_wakeup_fd``), which says at once which signal arrived and, if the rank has not
  exited ``grace_s`` later, ends it (``os._exit(128 + signal)``) after ``on_forced_exit`` (the
  launching process kills its workers there). A rank that exits closes its connections, so the
  ranks waiting on it fail at once.

The handler the process keeps is one module-level function that finds the guard in charge
through a weak reference. Lightning saves the handlers it finds when a Trainer call starts and
puts them back when it ends, which can leave pipe2bw's handler installed after the guard has
uninstalled: a handler bound to the guard (and so to the strategy, its Trainer and the model)
kept every finished fit's model and optimizer state alive for the life of the process.
"""

from __future__ import annotations

import os
import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from lightning_pipe2bw.failures.record import SignalStop, say

__all__ = ["SignalGuard"]

SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)

_active: weakref.ReferenceType[SignalGuard] | None = None  # the guard in charge, if any
# what each signal did before pipe2bw's handler took it at the start of a Trainer call
_before: dict[signal.Signals, Any] = {}


def _dispatch(signum: int, frame: FrameType | None) -> None:
    """pipe2bw's handler: the guard in charge acts; with none, the signal does what it did
    before (the handler that was there, or Python's default)."""
    guard = _active() if _active is not None else None
    if guard is not None and guard.installed:
        guard._handle(signum, frame)
    else:
        _as_before(signum, frame)


def _as_before(signum: int, frame: FrameType | None) -> None:
    previous = _before.get(signal.Signals(signum), signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


class SignalGuard:
    """Installs the handlers and the watchdog (main thread only; idempotent) and removes them.

    Args:
        describe: who this process is, for the messages (``"rank 1 (stage 0)"``).
        on_forced_exit: called by the watchdog just before it ends the process.
        grace_s: how long the main thread has to stop on its own after a signal.
    """

    def __init__(
        self,
        describe: Callable[[], str],
        on_forced_exit: Callable[[], None] = lambda: None,
        grace_s: float = 10.0,
    ) -> None:
        self.describe = describe
        self.on_forced_exit = on_forced_exit
        self.grace_s = grace_s
        self.received: signal.Signals | None = None  # the first signal, once one arrived
        self._previous: dict[signal.Signals, Any] = {}
        self._previous_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._timer: threading.Timer | None = None

    @property
    def installed(self) -> bool:
        return self._pipe is not None

    def install(self) -> None:
        """Take over SIGTERM and SIGINT (again, if Lightning registered its own since)."""
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be set from the main thread
        global _active
        if self._timer is None:
            self.received = None  # a new stage (a signal caught by the user's code is past)
        _active = weakref.ref(self)
        first = self._pipe is None  # not a re-install over handlers the Trainer call set since
        for signum in SIGNALS:
            current = signal.getsignal(signum)
            if current is not _dispatch:
                self._previous[signum] = current
                if first:  # what the process had before this Trainer call: never a handler
                    _before[signum] = current  # of the call's own (Lightning's holds its Trainer)
                signal.signal(signum, _dispatch)
        if self._pipe is None:
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._pipe = (read, write)
            self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            threading.Thread(
                target=self._watch, args=(read,), name="pipe2bw-signals", daemon=True
            ).start()

    def uninstall(self) -> None:
        """Give the signals back to the handlers they had before. A watchdog already counting
        down after a signal keeps counting: the process is on its way out."""
        global _active
        if self._pipe is None or threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) is _dispatch:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if _active is not None and _active() is self:
            _active = None
        signal.set_wakeup_fd(self._previous_fd)
        read, write = self._pipe
        self._pipe = None
        os.close(write)  # the watchdog's read returns: it ends (unless a countdown runs)
        del read

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler, in the main thread (called by ``_dispatch``)."""
        if self.received is not None:
            return  # already stopping: a second Ctrl-C must not break the clean-up
        self.received = signal.Signals(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt(f"{self.describe()} received SIGINT")
        raise SignalStop(signum)

    def _watch(self, read: int) -> None:
        """The watchdog: woken with the number of every signal that has a Python handler."""
        try:
            while data := os.read(read, 16):
                for signum in data:
                    if signum in SIGNALS:
                        self._arm(signal.Signals(signum))
        except OSError:
            pass
        finally:
            os.close(read)

    def _arm(self, signum: signal.Signals) -> None:
        if self._timer is not None:
            return
        say(
            f"pipe2bw: {self.describe()} received {signum.name}: stopping every rank (this one "
            f"exits within {self.grace_s:.0f} s)"
        )
        self._timer = threading.Timer(self.grace_s, self._force, args=(signum,))
        self._timer.daemon = True
        self._timer.start()

    def _force(self, signum: signal.Signals) -> None:
        say(
            f"pipe2bw: {self.describe()} had not stopped {self.grace_s:.0f} s after "
            f"{signum.name} (waiting on another rank): exiting now"
        )
        try:
            self.on_forced_exit()
        finally:
            os._exit(128 + int(signum))
