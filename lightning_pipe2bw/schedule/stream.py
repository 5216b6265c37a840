"""Action streams a rank consumes in windows: a stage's 1F1B (one source for 1F1B, 2BW and the
engine) and 2BW's on the V (a list schedule of every rank, with its messages)."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable

from .action import Action, ActionKind

__all__ = ["OneFOneBStream", "VListStream"]


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


class VListStream:
    """One rank's unbounded PipeDream-2BW stream on the V placement (rank r holds stages r and
    2p - 1 - r), with its sends and receives, consumed one batch of ``microbatches`` per
    window as :class:`OneFOneBStream` is.

    The order is a list schedule of every rank, simulated on each rank alike (``costs``: a
    stage's forward and backward; at 1:1.8 the order leaves no gap in the simulator for real
    ratios from 1:1.4 to 1:2.4, where one made for 1:2 does below 1:2): whenever a rank is
    free it runs the forward whose input has arrived (the later stage's first), while it
    holds fewer than 2p + 1 stage micro-batches between their forward and backward (about
    1F1B's first-stage peak, p whole ones), and else the oldest backward whose gradient has
    arrived (the later stage's first). Each stage runs its forwards and its backwards in
    micro-batch order, so its gradients add up as gradient accumulation adds them.

    Two rules make the order one that a Lightning step per batch can run:

    * a batch's first forward waits for the previous batch's last loss (the last stage's
      forward of its last micro-batch): both stages are rank 0's, and the next batch's data
      and weights come with the next step;
    * a rank starts batch t + 2 only once it has run every backward of batch t, so that batch
      t's gradient is due at the end of the window that admits batch t + 1, as 2BW applies it.

    Forwards go first because the cut at each batch leaves the pipeline's first ranks without
    work until the next batch's forwards have come down the V: a rank that keeps its
    backwards for then stays busy, which the ideal 1F1B order, cut the same way, does not.

    Messages: a receive sits right before the action that needs it, a send right after the
    action that makes it. Each ordered pair of ranks carries one FIFO queue (NCCL has no tags),
    so a rank takes a peer's messages in the order the peer sent them: where it needs one sent
    after others it has not taken yet, it takes those first (their data waits in the engine).

    :meth:`window` hands out this rank's actions up to (not including) its first action of a
    micro-batch not admitted yet; :meth:`drain` hands out what the admitted micro-batches still
    owe (a flush), after which the stream starts again at micro-batch 0. Both ends of every
    message see the same order with the later micro-batches left out, so a drain cannot
    deadlock.
    """

    def __init__(
        self,
        placement: tuple[int, ...],
        rank: int,
        microbatches: int,
        version_of: Callable[[int], int | None] | None = None,
        costs: tuple[float, float] = (1.0, 1.8),
    ) -> None:
        self.placement = placement
        self.rank = rank
        self.m = microbatches
        self.num_stages = len(placement)
        self.num_ranks = max(placement) + 1
        self.stages = tuple(v for v, r in enumerate(placement) if r == rank)
        self.version_of = version_of or (lambda _: None)
        self.costs = costs
        self.places = 2 * self.num_ranks + 1
        # per rank: its stages, the later one first (its forwards and backwards go first)
        self._held_by = [
            sorted((v for v, r in enumerate(placement) if r == q), reverse=True)
            for q in range(self.num_ranks)
        ]
        self._restart()

    def _restart(self) -> None:
        stages, p = self.num_stages, self.num_ranks
        self.limit = 0  # micro-batches admitted so far
        self._next_f = [0] * stages  # per stage: the next micro-batch to forward
        self._next_b = [0] * stages
        self._input_at: dict[tuple[int, int], float] = {}  # (stage, k): its F's input arrived
        self._grad_at: dict[tuple[int, int], float] = {}  # (stage, k): its B's gradient arrived
        self._loss_at: dict[int, float] = {}  # batch: its last loss computed
        self._held = [0] * p
        self._free_at = [0.0] * p
        self._events = [(0.0, q) for q in range(p)]
        self._mine: deque[Action] = deque()  # this rank's compute, simulated, not yet emitted
        self._inbox: list[deque[tuple[ActionKind, int, int]]] = [deque() for _ in range(p)]
        self._taken: set[tuple[ActionKind, int, int]] = set()  # received ahead of their turn
        self._out: list[Action] = []  # emitted, not handed out
        self._backwards = dict.fromkeys(self.stages, 0)  # per stage here: backwards emitted

    # ------------------------------------------------------------------ the simulation
    def _forward(self, q: int, t: float) -> Action | None:
        """The forward rank ``q`` runs at time ``t``, if any."""
        if self._held[q] >= self.places:
            return None
        m, last = self.m, self.num_stages - 1
        for v in self._held_by[q]:
            k = self._next_f[v]
            batch = k // m
            if batch >= 2 and any(self._next_b[s] < (batch - 1) * m for s in self._held_by[q]):
                continue  # batch k // m - 2 is not done here yet
            if v == 0:
                if batch and self._loss_at.get(batch - 1, math.inf) > t:
                    continue
            elif self._input_at.get((v, k), math.inf) > t:
                continue
            self._input_at.pop((v, k), None)
            self._next_f[v] += 1
            self._held[q] += 1
            if v == last and k % m == m - 1:
                self._loss_at[batch] = t + self.costs[0]
                self._loss_at.pop(batch - 1, None)  # its first forwards have all run
            return Action(v, ActionKind.FORWARD, k)
        return None

    def _backward(self, q: int, t: float) -> Action | None:
        for v in self._held_by[q]:
            k = self._next_b[v]
            if k < self._next_f[v] and self._grad_at.get((v, k), math.inf) <= t:
                del self._grad_at[(v, k)]
                self._next_b[v] += 1
                self._held[q] -= 1
                return Action(v, ActionKind.BACKWARD, k)
        return None

    def _advance(self) -> None:
        """Simulate until this rank has a new action to emit."""
        placement, last, rank = self.placement, self.num_stages - 1, self.rank
        while not self._mine:
            if not self._events:  # pragma: no cover - the list order never stalls
                raise RuntimeError("the 2BW-on-a-V list schedule stalled")
            t, q = heapq.heappop(self._events)
            if self._free_at[q] > t:
                continue
            action = self._forward(q, t) or self._backward(q, t)
            if action is None:
                continue  # woken again when an input, a gradient or a loss arrives
            v, k = action.stage, action.microbatch
            end = t + self.costs[0 if action.kind is ActionKind.FORWARD else 1]
            self._free_at[q] = end
            heapq.heappush(self._events, (end, q))
            if action.kind is ActionKind.FORWARD:
                if v < last:
                    self._input_at[(v + 1, k)] = end
                    heapq.heappush(self._events, (end, placement[v + 1]))
                    if placement[v + 1] == rank and q != rank:
                        self._inbox[q].append((ActionKind.SEND_F, v + 1, k))
                else:
                    self._grad_at[(v, k)] = end
                    if k % self.m == self.m - 1:  # the next batch's first forward may go
                        heapq.heappush(self._events, (end, placement[0]))
            elif v > 0:
                self._grad_at[(v - 1, k)] = end
                heapq.heappush(self._events, (end, placement[v - 1]))
                if placement[v - 1] == rank and q != rank:
                    self._inbox[q].append((ActionKind.SEND_B, v - 1, k))
            if q == rank:
                self._mine.append(action)

    # ------------------------------------------------------------------ this rank's actions
    def _action(self, stage: int, kind: ActionKind, k: int) -> Action:
        return Action(stage, kind, k, self.version_of(k))

    def _emit(self) -> None:
        """Emit this rank's next compute action with its messages."""
        self._advance()
        action = self._mine.popleft()
        v, k, placement, rank = action.stage, action.microbatch, self.placement, self.rank
        if action.kind is ActionKind.FORWARD:
            source = placement[v - 1] if v > 0 else rank
            needed = (ActionKind.SEND_F, v, k)
        else:
            source = placement[v + 1] if v < self.num_stages - 1 else rank
            needed = (ActionKind.SEND_B, v, k)
        if source != rank:
            if needed in self._taken:
                self._taken.remove(needed)
            else:  # the peer's earlier messages first, in the order it sent them
                inbox = self._inbox[source]
                while True:
                    message = inbox.popleft()
                    sent, stage, mb = message
                    receive = ActionKind.RECV_F if sent is ActionKind.SEND_F else ActionKind.RECV_B
                    self._out.append(self._action(stage, receive, mb))
                    if message == needed:
                        break
                    self._taken.add(message)
        self._out.append(self._action(v, action.kind, k))
        if action.kind is ActionKind.FORWARD:
            if v < self.num_stages - 1 and placement[v + 1] != rank:
                self._out.append(self._action(v, ActionKind.SEND_F, k))
        else:
            self._backwards[v] = k + 1
            if v > 0 and placement[v - 1] != rank:
                self._out.append(self._action(v, ActionKind.SEND_B, k))

    def window(self, limit: int) -> list[Action]:
        """This rank's actions up to its first one of a micro-batch >= ``limit`` (a multiple of
        the batch's micro-batches: the admitted ones are those below it)."""
        if limit % self.m or limit < self.limit:
            raise ValueError(
                f"a window admits whole batches of {self.m} micro-batches, in order: got "
                f"limit={limit} after {self.limit}"
            )
        self.limit = limit
        start = 0
        while True:
            for n in range(start, len(self._out)):
                if self._out[n].microbatch >= limit:
                    out, self._out = self._out[:n], self._out[n:]
                    return out
            start = len(self._out)
            self._emit()

    def drain(self) -> list[Action]:
        """What the admitted micro-batches still owe, in order; the stream then restarts at
        micro-batch 0. The simulation goes on with the later micro-batches in it, and leaves
        them out: every rank leaves out the same ones, at both ends of every message."""
        limit = self.limit
        # a stage runs its backwards in order: its backward of micro-batch limit - 1 is the last
        while any(self._backwards[v] < limit for v in self.stages):
            self._emit()
        out = [a for a in self._out if a.microbatch < limit]
        self._restart()
        return out
