"""Event-driven simulator: makespan, bubbles, activation memory and deadlock detection."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from .action import Action, ActionKind, partner
from .comm import add_communication
from .generators import Schedule, format_grid

__all__ = ["Costs", "DeadlockError", "SimResult", "simulate"]

# A FIFO channel: (source stage, destination stage, what it carries): "F" activations or "B"
# gradients between neighbours, "E" evicted activations from a stage to its partner and "R" the
# same activations returned.
_Channel = tuple[int, int, str]


def _check_cost(label: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"cost {label} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class Costs:
    """Durations: per-stage sequences or one scalar for all stages; ``comm`` is transfer latency.

    ``backward`` is a whole backward (B); a backward in two actions costs ``input_grad`` (I) and
    ``weight_grad`` (W), half of ``backward`` each where they are not given.
    """

    forward: Sequence[float] | float = 1.0
    backward: Sequence[float] | float = 2.0
    comm: float = 0.0
    input_grad: Sequence[float] | float | None = None
    weight_grad: Sequence[float] | float | None = None

    def __post_init__(self) -> None:
        for label in ("forward", "backward", "input_grad", "weight_grad"):
            value = getattr(self, label)
            if value is None:
                continue
            if isinstance(value, (int, float)):
                _check_cost(label, value)
            else:
                value = tuple(value)  # normalise so Costs stays hashable
                for s, item in enumerate(value):
                    _check_cost(f"{label}[{s}]", item)
                object.__setattr__(self, label, value)
        _check_cost("comm", self.comm)

    def per_stage(self, label: str, num_stages: int) -> tuple[float, ...]:
        """The ``forward``, ``backward``, ``input_grad`` or ``weight_grad`` cost of every stage."""
        value: Sequence[float] | float | None = getattr(self, label)
        if value is None:  # a half of the whole backward
            return tuple(b / 2 for b in self.per_stage("backward", num_stages))
        if isinstance(value, (int, float)):
            return (float(value),) * num_stages
        if len(value) != num_stages:
            raise ValueError(
                f"Costs.{label} has {len(value)} entries but the schedule has {num_stages} "
                f"stages; give one cost per stage or a single scalar"
            )
        return tuple(float(item) for item in value)


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`."""

    step_time: float
    busy: tuple[float, ...]
    bubble_fraction: tuple[float, ...]
    mean_bubble_fraction: float
    # micro-batches whose F ran and whose backward (B, or W) has not finished
    peak_activations: tuple[int, ...]
    timeline: tuple[tuple[tuple[Action, float, float], ...], ...]


class DeadlockError(ValueError):
    """No stage can make progress while some still have actions left.

    ``stuck`` holds the ``(stage, slot)`` of every blocked receive (RECV_F, RECV_B, LOAD, or the
    wait of a RETURN for its EVICT) and ``reasons`` one line per blocked stage; both refer to ``schedule`` (the schedule actually simulated, i.e. with
    communication inserted).
    """

    def __init__(
        self,
        message: str,
        stuck: tuple[tuple[int, int], ...] = (),
        reasons: tuple[str, ...] = (),
        schedule: Schedule | None = None,
    ) -> None:
        super().__init__(message)
        self.stuck = stuck
        self.reasons = reasons
        self.schedule = schedule


# The action that sends on each kind of channel (named in deadlock reports).
_SENDER = {
    "F": ActionKind.SEND_F,
    "B": ActionKind.SEND_B,
    "E": ActionKind.EVICT,
    "R": ActionKind.RETURN,
}


def _channels(
    schedule: Schedule, lane: int, action: Action
) -> tuple[_Channel | None, _Channel | None]:
    """(the channel a communication action on list ``lane`` receives on, the channel it then
    sends on); None where it does not. RETURN does both: it waits for the EVICT, then sends the
    data back. Channels join action lists (ranks); with one stage per rank, stages."""
    kind, stage = action.kind, action.stage
    q = partner(lane, schedule.num_ranks)
    if kind is ActionKind.SEND_F:
        return None, (lane, schedule.rank_of(stage + 1), "F")
    if kind is ActionKind.SEND_B:
        return None, (lane, schedule.rank_of(stage - 1), "B")
    if kind is ActionKind.RECV_F:
        return (schedule.rank_of(stage - 1), lane, "F"), None
    if kind is ActionKind.RECV_B:
        return (schedule.rank_of(stage + 1), lane, "B"), None
    if kind is ActionKind.EVICT:
        return None, (lane, q, "E")
    if kind is ActionKind.RETURN:
        return (q, lane, "E"), (lane, q, "R")
    if kind is ActionKind.LOAD:
        return (q, lane, "R"), None
    raise ValueError(f"{kind.value} is not a communication action")


def _delivers(send: Action, receive: Action) -> bool:
    """Whether ``send``'s data is what ``receive`` waits for (same micro-batch, and the stage
    next to it in the direction the data travels; offload moves a stage's own data)."""
    if send.microbatch != receive.microbatch:
        return False
    if send.kind is ActionKind.SEND_F:
        return send.stage + 1 == receive.stage
    if send.kind is ActionKind.SEND_B:
        return send.stage - 1 == receive.stage
    return True


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    delays: Mapping[tuple[int, int], float] | None = None,
) -> SimResult:
    """Run ``schedule`` on an idealised machine (one action at a time per stage).

    Compute takes the stage's cost; a send takes no time on the sender and its item reaches the
    receiver ``costs.comm`` later; a receive blocks until the matching item has arrived. The
    k-th receive on a channel consumes the k-th send (FIFO). Compute-only schedules get
    :func:`add_communication` first. Raises :class:`DeadlockError` if the stages get stuck.

    Activation offload takes no compute time: ``EVICT(i)`` on stage s is a send to its partner
    q = p - 1 - s; ``RETURN(i)`` on q receives it and, when it has, sends it back; ``LOAD(i)`` on
    s receives that. ``peak_activations`` still counts micro-batches between F and B, wherever
    their activations are held.

    ``delays[(stage, slot)]`` is work the stage does outside the schedule just before the action
    in that slot (of the schedule as simulated, with communication), e.g. the optimizer step and
    the training loop between two calls of a 2BW stream; it counts as busy time.
    """
    costs = Costs() if costs is None else costs
    delays = dict(delays or {})
    for (ds, di), seconds in delays.items():
        _check_cost(f"delays[({ds}, {di})]", seconds)
    v = schedule.num_stages  # costs are per stage; a rank with several adds theirs
    compute = {
        ActionKind.FORWARD: costs.per_stage("forward", v),
        ActionKind.BACKWARD: costs.per_stage("backward", v),
        ActionKind.INPUT_GRAD: costs.per_stage("input_grad", v),
        ActionKind.WEIGHT_GRAD: costs.per_stage("weight_grad", v),
    }
    if not schedule.has_comm:
        schedule = add_communication(schedule)
    stages = schedule.stages
    p = schedule.num_ranks

    clock, slot, busy = [0.0] * p, [0] * p, [0.0] * p
    in_flight, peak = [0] * p, [0] * p
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    sent: dict[_Channel, list[tuple[float, Action]]] = {}  # (arrival time, send), in send order
    received: dict[_Channel, int] = {}
    waiting: dict[_Channel, int] = {}  # channel -> the stage blocked receiving on it
    ready = deque(range(p))
    # Each stage runs until it blocks on a receive; a send wakes the stage waiting on its
    # channel. Every action is executed once, so this is linear in the schedule size.
    while ready:
        s = ready.popleft()
        actions, i, t = stages[s], slot[s], clock[s]
        while i < len(actions):
            action = actions[i]
            kind = action.kind
            extra = delays.pop((s, i), 0.0)  # popped: a blocked receive comes back to this slot
            t += extra
            busy[s] += extra
            end = t
            if kind in compute:
                end = t + compute[kind][action.stage]
                busy[s] += end - t
                # Forward-only schedules keep no activations for a backward.
                if kind is ActionKind.FORWARD and schedule.training:
                    in_flight[s] += 1
                    peak[s] = max(peak[s], in_flight[s])
                elif action.ends_backward:
                    in_flight[s] -= 1
            else:
                if action.is_offload and partner(s, p) == s:
                    raise ValueError(
                        f"stage {s}, slot {i}: {action} needs a partner stage, but stage {s} is "
                        f"the middle stage of p={p} (its own partner); remove it (validate() "
                        "lists all problems)"
                    )
                recv, send_on = _channels(schedule, s, action)
                if recv is not None:
                    k = received.get(recv, 0)
                    queue = sent.get(recv, [])
                    if k >= len(queue):
                        waiting[recv] = s
                        break
                    arrival, send = queue[k]
                    if not _delivers(send, action):
                        raise ValueError(
                            f"stage {s}, slot {i}: {action} would receive the data of {send} "
                            f"because channels are FIFO; make the receive order on stage {s} "
                            f"match the send order on stage {recv[0]} (validate() lists all "
                            "problems)"
                        )
                    received[recv] = k + 1
                    end = max(t, arrival)
                if send_on is not None:  # a RETURN sends once its receive has completed
                    sent.setdefault(send_on, []).append((end + costs.comm, action))
                    if send_on in waiting:
                        ready.append(waiting.pop(send_on))
            timeline[s].append((action, t, end))
            t = end
            i += 1
        slot[s], clock[s] = i, t

    if any(slot[s] < len(stages[s]) for s in range(p)):
        _raise_deadlock(schedule, slot, sent, received)

    step_time = max(clock, default=0.0)
    bubble = tuple(1.0 - b / step_time if step_time > 0 else 0.0 for b in busy)
    return SimResult(
        step_time=step_time,
        busy=tuple(busy),
        bubble_fraction=bubble,
        mean_bubble_fraction=sum(bubble) / p,
        peak_activations=tuple(peak),
        timeline=tuple(tuple(row) for row in timeline),
    )


def _raise_deadlock(
    schedule: Schedule,
    slot: list[int],
    sent: dict[_Channel, list[tuple[float, Action]]],
    received: dict[_Channel, int],
) -> NoReturn:
    stages, p = schedule.stages, schedule.num_ranks
    stuck: list[tuple[int, int]] = []
    reasons: list[str] = []
    lane = "stage" if schedule.placement is None else "rank"
    for s in range(p):
        if slot[s] >= len(stages[s]):
            continue
        action = stages[s][slot[s]]
        channel = _channels(schedule, s, action)[0]
        assert channel is not None, f"{action} cannot block"  # only receives block
        src, _, carries = channel
        n_sent = len(sent.get(channel, []))
        if not 0 <= src < p:
            peer = f"{lane} {src} does not exist"
        elif slot[src] >= len(stages[src]):
            peer = f"{lane} {src} finished after {n_sent} send(s) on this channel"
        else:
            peer = (
                f"{lane} {src} is stuck at slot {slot[src]} on {stages[src][slot[src]]} "
                f"after {n_sent} send(s) on this channel"
            )
        sender = {ActionKind.RECV_F: action.stage - 1, ActionKind.RECV_B: action.stage + 1}
        stuck.append((s, slot[s]))
        reasons.append(
            f"{lane} {s} is stuck at slot {slot[s]} on {action}: waits for "
            f"{sender.get(action.kind, src)}{_SENDER[carries].value}{action.microbatch} "
            f"(send #{received.get(channel, 0) + 1} "
            f"from {lane} {src} to {lane} {s}); {peer}"
        )
    message = "\n".join(
        [
            f"deadlock in schedule {schedule.name!r}: no stage can make progress",
            *(f"  - {reason}" for reason in reasons),
            "grid (stuck actions in [brackets]):",
            format_grid(schedule, stuck),
        ]
    )
    raise DeadlockError(message, tuple(stuck), tuple(reasons), schedule)
