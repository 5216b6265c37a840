"""The engine's log of every action as it starts and ends (``PIPE2BW_DEBUG=1``; see
``docs/user-guide.md``), and the logger of lines a user should see once."""

from __future__ import annotations

import logging
import sys

from lightning_pipe2bw.schedule import Action

__all__ = ["ActionLog", "user_log"]

_log = logging.getLogger("lightning_pipe2bw.actions")
# lines a user should see once, at Lightning's level (its logger prints INFO on every rank)
user_log = logging.getLogger("lightning.pytorch.pipe2bw")


class ActionLog:
    """One line per action start and end of this rank's engine, to stderr even if logging is
    not set up."""

    def __init__(self, rank: int, stage: int) -> None:
        self.rank, self.stage = rank, stage
        if not _log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("pipe2bw %(message)s"))
            _log.addHandler(handler)
            _log.setLevel(logging.INFO)
            _log.propagate = False

    def start(self, action: Action, t: float) -> None:
        _log.info(
            "rank %d stage %d start %s (micro-batch %d) t=%.6f",
            self.rank, self.stage, action, action.microbatch, t,
        )  # fmt: skip

    def end(self, action: Action, t: float, start: float) -> None:
        _log.info(
            "rank %d stage %d end %s (micro-batch %d) t=%.6f (%.3f ms)",
            self.rank, self.stage, action, action.microbatch, t, (t - start) * 1e3,
        )  # fmt: skip
