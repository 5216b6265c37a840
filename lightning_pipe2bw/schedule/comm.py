"""Communication pass: insert point-to-point sends/receives around compute actions."""

from __future__ import annotations

from collections.abc import Callable

from .action import Action, ActionKind
from .generators import Schedule

__all__ = ["add_communication", "with_communication"]


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
