"""The per-stage 1F1B action stream, consumed in windows: one source for 1F1B, 2BW and the engine."""

from __future__ import annotations

from collections.abc import Callable

from .action import Action, ActionKind

__all__ = ["OneFOneBStream"]


class OneFOneBStream:
    """Stage ``stage``'s unbounded 1F1B stream: ``w = p - stage - 1`` warm-up forwards
    ``F0 .. F(w-1)``, then pairs ``F(w+i), B(i)`` for i = 0, 1, ...

    :meth:`window` hands out the stream up to (not including) the first forward of a
    micro-batch that is not admitted yet; :meth:`drain` ends the stream with the backwards of
    every micro-batch forwarded so far (a flush), after which it starts again with a warm-up.
    A finite 1F1B schedule over n micro-batches is ``window(n) + drain()``; PipeDream-2BW is
    the same stream across batches, flushed only at flush points.

    ``version_of(microbatch)`` annotates each action with the weight version it runs with.
    """

    def __init__(
        self, stage: int, num_stages: int, version_of: Callable[[int], int | None] | None = None
    ) -> None:
        self.stage = stage
        self.warmup = num_stages - stage - 1
        self.version_of = version_of or (lambda _: None)
        self.next_f = 0
        self.next_b = 0

    def _action(self, kind: ActionKind, microbatch: int) -> Action:
        return Action(self.stage, kind, microbatch, self.version_of(microbatch))

    def window(self, limit: int) -> list[Action]:
        """Advance through every action before the first forward of micro-batch >= ``limit``."""
        out: list[Action] = []
        while True:
            ahead = self.next_f - self.next_b
            if self.next_f < self.warmup or ahead == self.warmup:
                if self.next_f >= limit:
                    return out
                out.append(self._action(ActionKind.FORWARD, self.next_f))
                self.next_f += 1
            else:  # ahead == warmup + 1: the backward of the pair
                out.append(self._action(ActionKind.BACKWARD, self.next_b))
                self.next_b += 1

    def drain(self) -> list[Action]:
        """The backwards still owed, in order; the stream then restarts at micro-batch 0."""
        out = [self._action(ActionKind.BACKWARD, i) for i in range(self.next_b, self.next_f)]
        self.next_f = self.next_b = 0
        return out

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded whose backward has not been handed out yet."""
        return self.next_f - self.next_b
