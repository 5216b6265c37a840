"""The per-stage 1F1B action stream, consumed in windows: one source for 1F1B, 2BW and the engine."""

from __future__ import annotations

import heapq
from collections.abc import Callable

from .action import Action, ActionKind

__all__ = ["OneFOneBStream", "PlacedStream"]


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


class PlacedStream:
    """One rank's unbounded 1F1B stream over the stages it holds under ``placement`` (several
    stages per rank, e.g. a V), with its sends and receives, consumed in windows like
    :class:`OneFOneBStream`: PipeDream-2BW on a V runs it across batches.

    Every stage of the pipeline runs its own 1F1B stream (``OneFOneBStream`` of the
    ``len(placement)`` stages). A rank runs its stages' actions in the order of their start
    times in 1F1B's ideal timing (forward and backward one unit each, no transfer time):
    stage s's forward of micro-batch k starts at ``s + k`` during its warm-up
    (``k <= S - s - 1``) and at ``2k + s`` after it, its backward of k at ``2S - 1 - s + 2k``.
    A message is received right before the action that needs it, and sent right before that,
    at the consumer's time (not the producer's): both ends of a pair of ranks then order their
    messages by the consumer's time, so one FIFO queue per pair carries them (NCCL has no tags).
    Along every dependency these keys increase (producer < send < receive < consumer; a
    stage's own actions in its stream's order), so the ranks' lists are consistent with one
    global order and cannot deadlock.

    :meth:`window` hands out the stream up to the last stage's forward of the last admitted
    micro-batch (the ideal time at which every rank's window ends), so that the loss of every
    admitted micro-batch is computed in the window that admits it, as a Lightning step needs.
    On a V the first stage starts the next batch's forwards before that (rank 0 holds the
    first and the last stage): actions of micro-batches not admitted yet are postponed, and the
    next window starts with them. Only data dependencies order actions across stages (a
    stage's own order moves only its not-yet-admitted forwards later), so the keys' argument
    holds for the postponed order too; a message's send and receive fall on the same side of
    a window's end (their keys are not multiples of 4), so both ends of a pair still agree.
    :meth:`drain` hands out what the admitted micro-batches still owe (a flush), after which
    the stream starts again at micro-batch 0.
    """

    def __init__(
        self,
        placement: tuple[int, ...],
        rank: int,
        version_of: Callable[[int], int | None] | None = None,
    ) -> None:
        self.placement = placement
        self.rank = rank
        self.num_stages = len(placement)
        self.stages = tuple(v for v, r in enumerate(placement) if r == rank)
        self.version_of = version_of or (lambda _: None)
        self._restart()

    def _restart(self) -> None:
        self._heap: list[tuple[int, int, int, Action]] = []
        self._generated = 0  # micro-batches whose events are in the heap
        self._seq = 0
        self.limit = 0  # micro-batches admitted so far
        self._forwards = self._backwards = 0  # handed out (stage, micro-batch) F and B
        self._postponed: list[Action] = []  # of micro-batches not admitted at the last window

    # the ideal start times
    def _forward_time(self, stage: int, k: int) -> int:
        warmup = self.num_stages - stage - 1
        return stage + k if k <= warmup else 2 * k + stage

    def _backward_time(self, stage: int, k: int) -> int:
        return 2 * self.num_stages - 1 - stage + 2 * k

    def _push(self, key: int, tie: int, action: Action) -> None:
        heapq.heappush(self._heap, (key, tie, self._seq, action))
        self._seq += 1

    def _generate(self, k: int) -> None:
        """Push micro-batch ``k``'s events: per stage its F and B, and the messages that
        cross to another rank (keys: 4 x time; a send at the consumer's time - 1/2, a receive at
        - 1/4; ties by the consumer's stage)."""
        version = self.version_of(k)
        placement, last = self.placement, self.num_stages - 1
        for s in self.stages:
            f, b = self._forward_time(s, k), self._backward_time(s, k)
            self._push(4 * f, s, Action(s, ActionKind.FORWARD, k, version))
            self._push(4 * b, s, Action(s, ActionKind.BACKWARD, k, version))
            if s > 0 and placement[s - 1] != self.rank:
                self._push(4 * f - 1, s, Action(s, ActionKind.RECV_F, k, version))
                send_b = 4 * self._backward_time(s - 1, k) - 2
                self._push(send_b, s - 1, Action(s, ActionKind.SEND_B, k, version))
            if s < last and placement[s + 1] != self.rank:
                self._push(4 * b - 1, s, Action(s, ActionKind.RECV_B, k, version))
                send_f = 4 * self._forward_time(s + 1, k) - 2
                self._push(send_f, s + 1, Action(s, ActionKind.SEND_F, k, version))

    def _peek(self) -> Action | None:
        """The next action (every event of a micro-batch k has a key >= 4k - 2, so those of
        later micro-batches cannot come before it)."""
        while not self._heap or 4 * self._generated - 2 <= self._heap[0][0]:
            self._generate(self._generated)
            self._generated += 1
        return self._heap[0][3]

    def _take(self) -> Action:
        action = heapq.heappop(self._heap)[3]
        if action.kind is ActionKind.FORWARD:
            self._forwards += 1
        elif action.kind is ActionKind.BACKWARD:
            self._backwards += 1
        return action

    def window(self, limit: int) -> list[Action]:
        """The actions up to the last stage's forward of micro-batch ``limit - 1`` in the
        ideal timing, those of micro-batches >= ``limit`` postponed to the next window."""
        self.limit = max(self.limit, limit)
        out = [a for a in self._postponed if a.microbatch < limit]
        self._postponed = [a for a in self._postponed if a.microbatch >= limit]
        if limit <= 0:
            return out
        end = 4 * self._forward_time(self.num_stages - 1, limit - 1)
        while True:
            self._peek()
            if self._heap[0][0] > end:
                return out
            action = self._take()
            (out if action.microbatch < limit else self._postponed).append(action)

    def drain(self) -> list[Action]:
        """What the admitted micro-batches still owe, in order; the stream then restarts at
        micro-batch 0."""
        out = [a for a in self._postponed if a.microbatch < self.limit]
        last_key = 4 * self._backward_time(0, self.limit) if self.limit else -1
        while self.limit:
            self._peek()
            if self._heap[0][0] > last_key:
                break
            action = self._take()
            if action.microbatch < self.limit:
                out.append(action)
        self._restart()
        return out

    @property
    def in_flight(self) -> int:
        """(stage, micro-batch) forwarded here whose backward has not been handed out yet."""
        return self._forwards - self._backwards
