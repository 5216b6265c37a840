"""Passes over an action list that cut backwards in two: ``I`` (the inputs' gradient) then ``W``
(the weights' gradients).

A stage's predecessor waits for the gradient of its inputs only. Where a schedule leaves that
predecessor idle while this stage computes its weights' gradients, running ``I``, sending the
gradient, then ``W`` takes about half of a backward off the step's critical path. The engine
executes whatever the list says (see ``PipelineEngine``); these passes decide, so that the
validator, the simulator, the planner and the timeline see the order that runs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

from .action import Action, ActionKind
from .comm import add_communication
from .generators import Schedule
from .registry import REGISTRY, get_schedule, virtual_schedule
from .simulate import Costs, simulate

__all__ = [
    "CUT_OVERHEAD",
    "cut_overhead",
    "cuts_that_pay",
    "early_input_grads",
    "merge_backward",
    "split_backward",
    "training_schedule",
]

# what a cut backward costs beyond the whole one, as a share of it: I + W = (1 + this) x B. The
# engine's two passes (``runtime.splitgrad``) on this project's CPU: 1.17-1.25 x the whole
# backward of a GPT stage (the weights' matrix products read their inputs again from memory, and
# the inputs' pass allocates while the graph is kept); the zero-bubble paper measures a few
# percent on GPUs, where the cut costs an engine call per node against far more work per node.
CUT_OVERHEAD = {"cpu": 0.2, "cuda": 0.05}
_DEFAULT_OVERHEAD = 0.05
_SEARCH_ACTIONS = 300_000  # what cuts_that_pay may simulate


@functools.lru_cache(maxsize=256)  # a Schedule is immutable; the planner asks for the same often
def training_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    *,
    early_input_grad: bool = True,
    cut_overhead: float | None = None,
) -> Schedule:
    """The action list a flush schedule's batch runs: the compute order of ``name`` (one stage
    per rank, or several: ``schedule.registry``),
    its communication, with ``early_input_grad`` the :func:`early_input_grads` pass, and, for a
    schedule that cuts backwards (zero bubble), :func:`cuts_that_pay` at the price
    ``cut_overhead`` (what a cut backward costs beyond a whole one, as a share of it: see
    :func:`cut_overhead`; None: every cut is kept).

    The engine's driver runs this list (adding offload actions for BPipe and ordering each
    pair of ranks' messages, neither of which moves a compute action); the planner simulates
    it, so that the step it predicts is the one that runs."""
    if name in REGISTRY and REGISTRY[name].virtual:
        compute = virtual_schedule(name, num_stages, num_microbatches)
    else:
        compute = get_schedule(name, num_stages, num_microbatches)
    built = add_communication(compute)
    built = early_input_grads(built) if early_input_grad else built
    spec = REGISTRY.get(name)
    if cut_overhead is not None and spec is not None and spec.cut_backward:
        # F = 1, B = 2, each half of a cut at its price; the first stage sends no gradient: its
        # I does nothing and its W runs the whole backward (as the engine runs it)
        price, rest = 1.0 + cut_overhead, built.num_stages - 1
        costs = Costs(input_grad=(0.0,) + (price,) * rest, weight_grad=(2.0,) + (price,) * rest)
        built = cuts_that_pay(built, costs)
    return built


def cut_overhead(device_type: str) -> float | None:
    """The price of a cut backward on ``device_type`` for :func:`cuts_that_pay`:
    :data:`CUT_OVERHEAD`'s, or the environment's ``PIPE2BW_CUT_OVERHEAD`` (a share of a whole
    backward, measured for a model; ``keep``: every cut is made, as the schedule lists it)."""
    given = os.environ.get("PIPE2BW_CUT_OVERHEAD", "").strip()
    if not given:
        return CUT_OVERHEAD.get(device_type, _DEFAULT_OVERHEAD)
    if given == "keep":
        return None
    try:
        value = float(given)
    except ValueError:
        value = -1.0
    if not value >= 0.0:
        raise ValueError(
            f"PIPE2BW_CUT_OVERHEAD={given!r}: give what a cut backward costs beyond a whole one, "
            "as a share of it (a number >= 0, e.g. 0.2), or 'keep' to make every cut"
        )
    return value


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


def merge_backward(actions: Sequence[Action], slot: int) -> list[Action]:
    """``actions`` with the cut backward whose ``I`` is at ``slot`` made whole again: ``B`` in the
    ``I``'s place, its ``W`` gone (the inverse of :func:`split_backward`)."""
    i = actions[slot]
    if i.kind is not ActionKind.INPUT_GRAD:
        raise ValueError(f"slot {slot} holds {i}, not an inputs' gradient (I) to merge")
    return _merged(actions, {(i.stage, i.microbatch)})


def _merged(actions: Sequence[Action], keys: set[tuple[int, int]]) -> list[Action]:
    """``actions`` with the cut backwards of ``keys`` ((stage, micro-batch)) made whole, in one
    pass (:func:`merge_backward` for many)."""
    out = []
    for a in actions:
        key = (a.stage, a.microbatch)
        if key in keys and a.kind is ActionKind.INPUT_GRAD:
            out.append(Action(a.stage, ActionKind.BACKWARD, a.microbatch, a.version))
        elif not (key in keys and a.kind is ActionKind.WEIGHT_GRAD):
            out.append(a)
    return out


def _accumulates_in_order(actions: Sequence[Action]) -> bool:
    """Whether each stage's weights' gradients (its ``B``s and ``W``s) come in micro-batch order,
    as one device accumulates them (a whole ``B`` ahead of an earlier micro-batch's deferred ``W``
    would add the gradients in another order: not bitwise the same)."""
    last: dict[int, int] = {}
    for a in actions:
        if a.kind in (ActionKind.BACKWARD, ActionKind.WEIGHT_GRAD):
            if a.microbatch < last.get(a.stage, -1):
                return False
            last[a.stage] = a.microbatch
    return True


def cuts_that_pay(schedule: Schedule, costs: Costs) -> Schedule:
    """``schedule`` with each cut backward made whole again where the cut does not shorten the
    step, as :func:`~lightning_pipe2bw.schedule.simulate` runs it with ``costs`` (whose ``I`` and
    ``W`` together cost more than a whole ``B``: the cut's own price).

    A cut pays where deferring a ``W`` fills a wait: the previous stage gets its gradient sooner
    and the ``W`` runs in time that would be idle. Where the stage has no wait to fill (at p = 2
    ZB-H1's steady state is 1F1B's, each stage busy), the cut only costs. Rank by rank, the pass
    keeps the cuts of the rank's last k backwards for the k that gives the shortest step (the
    fewest cuts among equals: zero bubble's waits are at the end of the batch), then tries each
    cut left once more on its own. The step is never longer than with every cut: that is the
    first candidate. A merge that would add a stage's weights' gradients out of micro-batch
    order is not made: the gradients stay bitwise those of one device."""
    eps = 1e-9
    best = simulate(schedule, costs).step_time
    stages = [list(actions) for actions in schedule.stages]
    # the search stops when it has simulated this many actions (about a second in all), keeping the
    # best it found: a count, not a clock, so that every rank builds the same list
    budget = [_SEARCH_ACTIONS]
    size = sum(len(actions) for actions in stages)

    def step_with(rank: int, actions: list[Action]) -> float:
        budget[0] -= size
        trial = schedule.with_stages([*stages[:rank], actions, *stages[rank + 1 :]])
        return simulate(trial, costs).step_time

    # how many of a rank's last cuts to keep: none, one, two, four, ... up to twice the stages
    # (the waits the cuts fill are within the last few backwards of each stage it holds)
    limit = 2 * schedule.num_stages
    counts = sorted({0, *(2**j for j in range(limit.bit_length() + 1) if 2**j <= limit)})
    for _ in range(3):  # sweeps over the ranks, until one changes nothing
        changed = False
        for rank in range(len(stages)):
            cuts = [n for n, a in enumerate(stages[rank]) if a.kind is ActionKind.INPUT_GRAD]
            chosen, chosen_time = stages[rank], best
            for kept in (k for k in counts if k < len(cuts) and budget[0] > 0):
                merged = {(a.stage, a.microbatch) for a in (stages[rank][n] for n in cuts)}
                for n in cuts[len(cuts) - kept :]:
                    merged.discard((stages[rank][n].stage, stages[rank][n].microbatch))
                actions = _merged(stages[rank], merged)
                if not _accumulates_in_order(actions):
                    continue
                t = step_with(rank, actions)
                if t < chosen_time - eps or (t <= chosen_time + eps and len(actions) < len(chosen)):
                    chosen, chosen_time = actions, t
            if chosen is not stages[rank]:
                stages[rank], best, changed = chosen, chosen_time, True
        if not changed:
            break
    for rank in range(len(stages)):  # each cut left, on its own (one simulation each)
        if sum(a.kind is ActionKind.INPUT_GRAD for a in stages[rank]) > limit:
            continue
        slot = 0
        while slot < len(stages[rank]):
            if stages[rank][slot].kind is ActionKind.INPUT_GRAD and budget[0] > 0:
                actions = merge_backward(stages[rank], slot)
                if not _accumulates_in_order(actions):
                    slot += 1
                    continue
                t = step_with(rank, actions)
                if t <= best + eps:
                    stages[rank], best = actions, t
            slot += 1
    return schedule.with_stages(stages)


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
    if schedule.num_stages == 1 or len(schedule.stages) == 1:
        return schedule  # one stage, or every stage on one rank: no gradient is sent
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
