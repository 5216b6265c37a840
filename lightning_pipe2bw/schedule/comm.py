"""Communication pass: insert point-to-point sends/receives around compute actions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .action import Action, ActionKind
from .generators import Schedule

__all__ = ["add_communication", "one_channel_per_pair", "with_communication"]


def with_communication(
    action: Action, num_stages: int, crosses: Callable[[int, int], bool] | None = None
) -> list[Action]:
    """The communication a compute action needs, around it (the rule of :func:`add_communication`).
    ``crosses(stage, neighbour)``: whether data between them travels between ranks (default:
    every existing neighbour is on another rank)."""
    s = action.stage
    i, v = action.microbatch, action.version
    if crosses is None:
        first, last = s == 0, s == num_stages - 1
    else:
        first, last = not crosses(s, s - 1), not crosses(s, s + 1)
    if action.kind is ActionKind.FORWARD:
        before = [] if first else [Action(s, ActionKind.RECV_F, i, v)]
        after = [] if last else [Action(s, ActionKind.SEND_F, i, v)]
    elif action.starts_backward:  # B, or I (its W needs no communication)
        before = [] if last else [Action(s, ActionKind.RECV_B, i, v)]
        after = [] if first else [Action(s, ActionKind.SEND_B, i, v)]
    else:
        before = after = []
    return [*before, action, *after]


def add_communication(schedule: Schedule) -> Schedule:
    """Return ``schedule`` with sends/receives added around every F and B (or I).

    With virtual stages, only data between stages on different ranks travels: a stage hands its
    activations to the next one on its own rank, and the gradient back, with no action.

    * ``RECV_F(i)`` right before ``F(i)`` on stages s > 0 (activation from s - 1),
    * ``SEND_F(i)`` right after ``F(i)`` on stages s < p - 1 (activation to s + 1),
    * ``RECV_B(i)`` right before ``B(i)`` or ``I(i)`` on stages s < p - 1 (gradient from s + 1),
    * ``SEND_B(i)`` right after ``B(i)`` or ``I(i)`` on stages s > 0 (gradient to s - 1).

    ``W(i)`` (the weights' gradients) needs no communication.

    Comm actions copy the compute action's ``version``. The runtime posts sends without
    waiting and blocks at each receive, so placing a receive right before its consumer is
    enough; a receive never needs to be hoisted for correctness. The stage an action runs on is
    its position in ``schedule.stages`` (the validator checks ``action.stage`` agrees).
    """
    found = schedule.find(lambda action: action.is_comm)
    if found is not None:
        s, slot, action = found
        raise ValueError(
            f"schedule {schedule.name!r} already has communication actions "
            f"({action} at stage {s}, slot {slot}); pass the compute-only schedule "
            "to add_communication"
        )
    p = schedule.num_stages
    crosses = None if schedule.placement is None else schedule.crosses
    return schedule.with_stages(
        [comm for action in actions for comm in with_communication(action, p, crosses)]
        for actions in schedule.stages
    )


def _message(action: Action) -> tuple[ActionKind, int, int] | None:
    """The message a send or a receive is about, named the same at both ends: (the sending
    kind, the stage it is for, the micro-batch); None for other actions."""
    if action.kind is ActionKind.SEND_F:
        return ActionKind.SEND_F, action.stage + 1, action.microbatch
    if action.kind is ActionKind.SEND_B:
        return ActionKind.SEND_B, action.stage - 1, action.microbatch
    if action.kind is ActionKind.RECV_F:
        return ActionKind.SEND_F, action.stage, action.microbatch
    if action.kind is ActionKind.RECV_B:
        return ActionKind.SEND_B, action.stage, action.microbatch
    return None


def _source(schedule: Schedule, action: Action) -> int:
    """The rank a receive takes its message from."""
    offset = -1 if action.kind is ActionKind.RECV_F else 1
    return schedule.rank_of(action.stage + offset)


def one_channel_per_pair(schedule: Schedule) -> Schedule:
    """``schedule`` (with communication) reordered so that each ordered pair of ranks needs one
    FIFO channel: every rank takes the messages from a peer in the order the peer sends them.

    With one stage per rank, activations and gradients travel in opposite directions, so a pair
    of ranks carries one kind of message each way. With virtual stages, activations and
    gradients can travel the same way (p = 2, or the V's return leg), and the schedules order
    them per kind only, while a transport keeps one queue per pair of ranks (NCCL has no
    tags). So where a rank would receive a message before one its peer sent earlier, the
    earlier one's receive moves up to just before it (its data waits in the engine until its
    computation). A rank then blocks exactly when it blocked before, waiting for the same
    message (the ones received early were sent before it), so a deadlock-free schedule stays
    deadlock-free. A schedule whose pairs already agree is returned unchanged.
    """
    sent: dict[tuple[int, int], list[tuple[ActionKind, int, int]]] = {}
    for r, actions in enumerate(schedule.stages):
        for a in actions:
            if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                message = _message(a)
                assert message is not None
                dst = schedule.rank_of(message[1])
                sent.setdefault((r, dst), []).append(message)
    lanes = []
    for r, actions in enumerate(schedule.stages):
        receives = {
            _message(a): a for a in actions if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B)
        }
        done: set[Any] = set()
        position = {pair: 0 for pair in sent if pair[1] == r}  # per source: next in send order
        lane: list[Action] = []
        for a in actions:
            if a.kind not in (ActionKind.RECV_F, ActionKind.RECV_B):
                lane.append(a)
                continue
            message = _message(a)
            if message in done:
                continue  # received early
            pair = (_source(schedule, a), r)
            order = sent.get(pair, [])
            # the peer's sends up to this one, received in its order
            while position.get(pair, 0) < len(order):
                earlier = order[position[pair]]
                position[pair] += 1
                if earlier in receives and earlier not in done:
                    done.add(earlier)
                    lane.append(receives[earlier])
                if earlier == message:
                    break
            if message not in done:  # sent by no one: the validator names it
                done.add(message)
                lane.append(a)
        lanes.append(lane)
    return schedule.with_stages(lanes)
