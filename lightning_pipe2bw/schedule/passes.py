"""Passes over an action list that cut backwards in two: ``I`` (the inputs' gradient) then ``W``
(the weights' gradients).

A stage's predecessor waits for the gradient of its inputs only. Where a schedule leaves that
predecessor idle while this stage computes its weights' gradients, running ``I``, sending the
gradient, then ``W`` takes about half of a backward off the step's critical path. The engine
executes whatever the list says (see ``PipelineEngine``); these passes decide, so that the
validator, the simulator, the planner and the timeline see the order that runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from .action import Action, ActionKind
from .comm import add_communication
from .generators import Schedule
from .registry import REGISTRY, get_schedule, virtual_schedule

__all__ = ["early_input_grads", "split_backward", "training_schedule"]


def training_schedule(
    name: str, num_stages: int, num_microbatches: int, *, early_input_grad: bool = True
) -> Schedule:
    """The action list a flush schedule's batch runs: the compute order of ``name`` (one stage
    per rank, or several: ``schedule.registry``),
    its communication, and with ``early_input_grad`` the :func:`early_input_grads` pass.

    The engine's driver runs this list (adding offload actions for BPipe and ordering each
    pair of ranks' messages, neither of which moves a compute action); the planner simulates
    it, so that the step it predicts is the one that runs."""
    if name in REGISTRY and REGISTRY[name].virtual:
        compute = virtual_schedule(name, num_stages, num_microbatches)
    else:
        compute = get_schedule(name, num_stages, num_microbatches)
    built = add_communication(compute)
    return early_input_grads(built) if early_input_grad else built


def split_backward(actions: Sequence[Action], slot: int) -> list[Action]:
    """``actions`` with the B at ``slot`` cut in two: ``I`` in its place and ``W`` right after
    the ``SEND_B`` that follows it (or right after the ``I`` on a stage that sends none)."""
    b = actions[slot]
    if b.kind is not ActionKind.BACKWARD:
        raise ValueError(f"slot {slot} holds {b}, not a backward (B) to split")
    i = Action(b.stage, ActionKind.INPUT_GRAD, b.microbatch, b.version)
    w = Action(b.stage, ActionKind.WEIGHT_GRAD, b.microbatch, b.version)
    after = slot + 1
    following = actions[after] if after < len(actions) else None
    if (
        following is not None
        and following.kind is ActionKind.SEND_B
        and following.microbatch == b.microbatch
    ):
        after += 1
    return [*actions[:slot], i, *actions[slot + 1 : after], w, *actions[after:]]


def early_input_grads(schedule: Schedule) -> Schedule:
    """The ``early_input_grad`` option as a pass over a flush schedule with communication: on
    every stage after the first, the backward whose inputs' gradient the previous stage waits
    for with nothing else to do becomes ``I, SEND_B, W``.

    That is the stage's last backward (the previous stage waits for its gradient at the flush)
    and, where every forward comes before the first backward (GPipe), also its first (the
    previous stage, its forwards done, waits for it to start its backwards). Between them the
    previous stage has earlier gradients to work on, and cutting a backward costs a little (an
    engine call per node with weights), so they stay whole. In 1F1B the previous stage's first
    backward is not what the step waits for: the chain runs through the last stage's forwards
    and backwards. Only a B directly followed by its ``SEND_B`` is cut.
    """
    if schedule.num_stages == 1:
        return schedule  # no stage sends a gradient
    if not schedule.has_comm:
        raise ValueError(
            f"schedule {schedule.name!r} has no communication actions; early_input_grads moves "
            "sends, so run add_communication first"
        )
    stages = []
    for s, actions in enumerate(schedule.stages):
        chosen = _waited_for(actions) if s > 0 else []
        out = list(actions)
        for slot in sorted(chosen, reverse=True):  # from the end: earlier slots stay put
            out = split_backward(out, slot)
        stages.append(out)
    return schedule.with_stages(stages)


def _waited_for(actions: Sequence[Action]) -> list[int]:
    backwards = [n for n, a in enumerate(actions) if a.kind is ActionKind.BACKWARD]
    if not backwards:
        return []
    forwards = [n for n, a in enumerate(actions) if a.kind is ActionKind.FORWARD]
    first_too = max(forwards, default=-1) < backwards[0]
    candidates = {backwards[0], backwards[-1]} if first_too else {backwards[-1]}

    def sends_next(n: int) -> bool:
        after = actions[n + 1] if n + 1 < len(actions) else None
        return (
            after is not None
            and after.kind is ActionKind.SEND_B
            and after.microbatch == actions[n].microbatch
        )

    return sorted(n for n in candidates if sends_next(n))
