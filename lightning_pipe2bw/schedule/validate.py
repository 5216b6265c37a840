"""Schedule validator: per-stage, channel (FIFO) and deadlock checks, reported on a grid."""

from __future__ import annotations

from dataclasses import dataclass

from .action import Action, ActionKind, partner
from .comm import add_communication
from .generators import Schedule, format_grid
from .simulate import DeadlockError, simulate

__all__ = ["ScheduleError", "format_grid", "validate"]

_F, _B = ActionKind.FORWARD, ActionKind.BACKWARD
_I, _W = ActionKind.INPUT_GRAD, ActionKind.WEIGHT_GRAD
_EVICT, _RETURN, _LOAD = ActionKind.EVICT, ActionKind.RETURN, ActionKind.LOAD
_MAX_LISTED = 40  # problems spelled out in the message; ScheduleError.problems has them all

# Stage offset of the peer each point-to-point comm kind talks to (offload kinds talk to the
# stage's partner p - 1 - s instead).
_PEER = {
    ActionKind.SEND_F: 1,
    ActionKind.RECV_F: -1,
    ActionKind.SEND_B: -1,
    ActionKind.RECV_B: 1,
}
# (comm kind, the compute kind it serves, whether it must come before that compute action)
_RULES = (
    (ActionKind.RECV_F, _F, True),
    (ActionKind.SEND_F, _F, False),
    (ActionKind.RECV_B, _B, True),
    (ActionKind.SEND_B, _B, False),
)


class ScheduleError(ValueError):
    """A schedule is invalid; ``problems`` lists every problem found (one line each)."""

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


@dataclass(frozen=True)
class _Problem:
    message: str
    cell: tuple[int, int] | None = None  # (stage, slot) to mark on the grid


def _where(stage: int, slot: int, action: Action) -> str:
    return f"stage {stage}, slot {slot} ({action})"


def _check_stage(schedule: Schedule, s: int, has_comm: bool) -> list[_Problem]:
    p, m = schedule.num_stages, schedule.num_microbatches
    actions = schedule.stages[s]
    out: list[_Problem] = []
    first: dict[tuple[ActionKind, int], int] = {}  # (kind, micro-batch) -> first slot
    for i, a in enumerate(actions):
        cell = (s, i)
        if a.stage != s:
            # Messages are only formatted on error paths, keeping the happy path cheap.
            msg = (
                f"{_where(s, i, a)}: its stage field is {a.stage} but it is listed under stage {s}"
            )
            out.append(_Problem(f"{msg}; set stage={s} or move it", cell))
        if not 0 <= a.microbatch < m:
            msg = f"{_where(s, i, a)}: micro-batch {a.microbatch} is out of range"
            out.append(_Problem(f"{msg}; use 0..{m - 1} (num_microbatches={m})", cell))
            continue
        if a.is_offload:
            problem = _offload_placement(schedule, s, i, a)
            if problem is not None:
                out.append(problem)
                continue
        elif a.is_comm and not 0 <= s + _PEER[a.kind] < p:
            peer = s + _PEER[a.kind]
            msg = f"{_where(s, i, a)}: {a.kind.value} needs stage {peer}, which does not exist"
            out.append(_Problem(f"{msg} (p={p}); remove it", cell))
            continue
        key = (a.kind, a.microbatch)
        if key in first:
            msg = f"{_where(s, i, a)}: duplicate {a.kind.value} of micro-batch {a.microbatch}"
            out.append(_Problem(f"{msg} (first at slot {first[key]}); keep exactly one", cell))
            continue
        first[key] = i

    for mb in range(m):
        out += _check_backward(schedule, s, mb, first)
        if has_comm:
            out += _check_comm_order(schedule, s, mb, first)
        out += _check_offload_order(schedule, s, mb, first)
    return out


def _backward_slot(first: dict[tuple[ActionKind, int], int], mb: int) -> int | None:
    """The slot of the action that starts micro-batch ``mb``'s backward: its B, or its I."""
    b = first.get((_B, mb))
    return b if b is not None else first.get((_I, mb))


def _check_backward(
    schedule: Schedule, s: int, mb: int, first: dict[tuple[ActionKind, int], int]
) -> list[_Problem]:
    """One F per micro-batch and, in a training schedule, one backward: a B, or an I and then
    a W (never both forms); each after the F, with the F's weight version."""
    actions, out = schedule.stages[s], []
    f = first.get((_F, mb))
    slots = {kind: first.get((kind, mb)) for kind in (_B, _I, _W)}
    present = [(kind, slot) for kind, slot in slots.items() if slot is not None]
    if f is None:
        out.append(_Problem(f"stage {s}: micro-batch {mb} has no {Action(s, _F, mb)}; add one"))
    if not schedule.training:
        for _, slot in present:
            where = _where(s, slot, actions[slot])
            msg = f"{where}: backward in a forward-only (training=False) schedule"
            out.append(
                _Problem(f"{msg}; remove it or build the schedule with training=True", (s, slot))
            )
        return out
    b, i, w = slots[_B], slots[_I], slots[_W]
    if b is not None and (i is not None or w is not None):
        other = i if i is not None else w
        assert other is not None
        msg = (
            f"{_where(s, other, actions[other])}: micro-batch {mb} also has a whole backward "
            f"{actions[b]} (slot {b})"
        )
        out.append(_Problem(f"{msg}; run its backward as one B, or as an I then a W", (s, other)))
    elif b is None and i is None and w is None:
        missing = f"{Action(s, _B, mb)} (or {Action(s, _I, mb)} and {Action(s, _W, mb)})"
        out.append(_Problem(f"stage {s}: micro-batch {mb} has no {missing}; add one"))
    elif b is None and (i is None) != (w is None):
        if i is None:
            assert w is not None
            need = Action(s, _I, mb, actions[w].version)
            msg = f"{_where(s, w, actions[w])}: no {need} computes the inputs' gradient"
            out.append(_Problem(f"{msg}; insert one before it, or make this a B", (s, w)))
        else:
            need = Action(s, _W, mb, actions[i].version)
            msg = f"{_where(s, i, actions[i])}: no {need} computes the weights' gradients"
            out.append(
                _Problem(f"{msg}; insert one after it (before the step ends), or make this a B", (s, i))
            )
    if i is not None and w is not None and w < i:
        msg = f"{_where(s, w, actions[w])}: runs before its {actions[i]} (slot {i})"
        out.append(_Problem(f"{msg}; a W follows its I", (s, w)))
    if f is not None:
        fwd = actions[f]
        for _, slot in present:
            bwd = actions[slot]
            if slot < f:
                msg = f"{_where(s, slot, bwd)}: backward runs before its forward {fwd} (slot {f})"
                out.append(_Problem(f"{msg}; move it after the forward", (s, slot)))
            if fwd.version != bwd.version:
                msg = (
                    f"{_where(s, slot, bwd)}: runs with weight version {bwd.version} but its "
                    f"forward {fwd} used {fwd.version}"
                )
                out.append(_Problem(f"{msg}; a backward must use its forward's version", (s, slot)))
    return out


def _offload_placement(schedule: Schedule, s: int, i: int, a: Action) -> _Problem | None:
    """An offload action on a stage that cannot run it: the middle stage (its own partner),
    EVICT/LOAD on the later stage of a pair, RETURN on the earlier one, or any in a
    forward-only schedule."""
    p, q = schedule.num_stages, partner(s, schedule.num_stages)
    where = _where(s, i, a)
    if not schedule.training:
        msg = f"{where}: offload in a forward-only (training=False) schedule, which keeps no "
        return _Problem(f"{msg}activations for a backward; remove it", (s, i))
    if q == s:
        msg = f"{where}: stage {s} is the middle stage of p={p}, its own partner (p - 1 - s)"
        return _Problem(f"{msg}, so it takes part in no offload; remove it", (s, i))
    if a.kind is _RETURN and q > s:
        msg = (
            f"{where}: RETURN runs on the later stage of a pair, but stage {s}'s partner is "
            f"stage {q} > {s}"
        )
        return _Problem(f"{msg}; move it to stage {q} or remove it", (s, i))
    if a.kind is not _RETURN and q < s:
        msg = (
            f"{where}: {a.kind.value} runs on the evicting stage of a pair (s < p - 1 - s), "
            f"but stage {s}'s partner is stage {q} < {s}"
        )
        return _Problem(f"{msg}; move it to stage {q} or remove it", (s, i))
    return None


def _check_offload_order(
    schedule: Schedule, s: int, mb: int, first: dict[tuple[ActionKind, int], int]
) -> list[_Problem]:
    """On an evicting stage: F(i) before EVICT(i) before LOAD(i) before B(i), and an EVICT(i)
    and a LOAD(i) together or neither."""
    actions, out = schedule.stages[s], []
    e, load = first.get((_EVICT, mb)), first.get((_LOAD, mb))
    f, b = first.get((_F, mb)), _backward_slot(first, mb)
    if e is not None:
        evict = actions[e]
        if f is not None and e < f:
            msg = f"{_where(s, e, evict)}: must come after {actions[f]} (slot {f})"
            out.append(_Problem(f"{msg}; move it", (s, e)))
        if load is None:
            need = Action(s, _LOAD, mb, evict.version)
            msg = f"{_where(s, e, evict)}: no {need} brings the activations back"
            fix = "insert one before the backward's RECV_B (or use add_offload)"
            out.append(_Problem(f"{msg}; {fix}", (s, e)))
    if load is not None:
        loaded = actions[load]
        if e is None:
            need = Action(s, _EVICT, mb, loaded.version)
            msg = f"{_where(s, load, loaded)}: no {need} sent these activations away"
            out.append(_Problem(f"{msg}; insert one after the forward or remove this", (s, load)))
        elif load < e:
            msg = f"{_where(s, load, loaded)}: must come after {actions[e]} (slot {e})"
            out.append(_Problem(f"{msg}; move it", (s, load)))
        if b is not None and load > b:
            msg = f"{_where(s, load, loaded)}: must come before {actions[b]} (slot {b})"
            out.append(_Problem(f"{msg}; move it", (s, load)))
    return out


def _check_comm_order(
    schedule: Schedule, s: int, mb: int, first: dict[tuple[ActionKind, int], int]
) -> list[_Problem]:
    """Each F and each backward (its B or I) on a stage with a peer needs its receive before and
    its send after it."""
    actions, out = schedule.stages[s], []
    for comm_kind, compute_kind, before in _RULES:
        x = first.get((_F, mb)) if compute_kind is _F else _backward_slot(first, mb)
        if x is None or not 0 <= s + _PEER[comm_kind] < schedule.num_stages:
            continue
        compute, c = actions[x], first.get((comm_kind, mb))
        side = "before" if before else "after"
        if c is None:
            need = Action(s, comm_kind, mb, compute.version)
            msg = f"{_where(s, x, compute)}: no {need} {side} it"
            out.append(_Problem(f"{msg}; insert one (or use add_communication)", (s, x)))
        elif (c > x) if before else (c < x):
            msg = f"{_where(s, c, actions[c])}: must come {side} {compute} (slot {x})"
            out.append(_Problem(f"{msg}; move it", (s, c)))
    return out


def _firsts(schedule: Schedule, stage: int, kind: ActionKind) -> list[tuple[int, Action]]:
    """(slot, action) of the first ``kind`` action per in-range micro-batch, in slot order."""
    seen: set[int] = set()
    out: list[tuple[int, Action]] = []
    for i, a in enumerate(schedule.stages[stage]):
        if a.kind is kind and 0 <= a.microbatch < schedule.num_microbatches:
            if a.microbatch not in seen:
                seen.add(a.microbatch)
                out.append((i, a))
    return out


def _check_channel(
    schedule: Schedule, send_kind: ActionKind, recv_kind: ActionKind, src: int, dst: int
) -> list[_Problem]:
    """``send_kind`` on ``src`` and ``recv_kind`` on ``dst`` pair up, in the same (FIFO) order."""
    out: list[_Problem] = []
    sends, recvs = _firsts(schedule, src, send_kind), _firsts(schedule, dst, recv_kind)
    sent = {a.microbatch for _, a in sends}
    got = {a.microbatch for _, a in recvs}
    for i, a in sends:
        if a.microbatch not in got:
            need = f"{dst}{recv_kind.value}{a.microbatch}"
            msg = f"{_where(src, i, a)}: no matching {need} on stage {dst}"
            out.append(_Problem(f"{msg}; add one there", (src, i)))
    for i, a in recvs:
        if a.microbatch not in sent:
            need = f"{src}{send_kind.value}{a.microbatch}"
            msg = f"{_where(dst, i, a)}: no matching {need} on stage {src}"
            out.append(_Problem(f"{msg}; add one there or remove this receive", (dst, i)))
    paired_sends = [(i, a) for i, a in sends if a.microbatch in got]
    paired_recvs = [(i, a) for i, a in recvs if a.microbatch in sent]
    # Channels are FIFO: the k-th receive gets the k-th send's data, whatever its id.
    for (si, sa), (ri, ra) in zip(paired_sends, paired_recvs, strict=False):
        if sa.microbatch != ra.microbatch:
            msg = (
                f"{_where(dst, ri, ra)}: the FIFO channel {src}->{dst} delivers {sa} "
                f"(stage {src}, slot {si}) here"
            )
            fix = f"receive in the order stage {src} sends"
            out.append(_Problem(f"{msg}; {fix}", (dst, ri)))
            break  # later mismatches on this channel follow from the first
    return out


def _check_channels(schedule: Schedule) -> list[_Problem]:
    """Sends and receives pair up across neighbours, and offload actions across partners
    (EVICT on s with RETURN on p - 1 - s, RETURN with LOAD back on s), in FIFO order."""
    out: list[_Problem] = []
    p = schedule.num_stages
    for s in range(p - 1):
        out += _check_channel(schedule, ActionKind.SEND_F, ActionKind.RECV_F, s, s + 1)
        out += _check_channel(schedule, ActionKind.SEND_B, ActionKind.RECV_B, s + 1, s)
    for s in range(p):
        q = partner(s, p)
        if s < q:  # the evicting side of a pair; misplaced offload actions are per-stage problems
            out += _check_channel(schedule, _EVICT, _RETURN, s, q)
            out += _check_channel(schedule, _RETURN, _LOAD, q, s)
    return out


def _collect(schedule: Schedule) -> list[_Problem]:
    has_comm = schedule.has_comm
    problems = [p for s in range(schedule.num_stages) for p in _check_stage(schedule, s, has_comm)]
    if has_comm:
        problems += _check_channels(schedule)
    return problems


def _message(schedule: Schedule, problems: list[_Problem], note: str) -> str:
    s = schedule
    lines = [
        f"invalid schedule {s.name!r} ({s.num_stages} stages, {s.num_microbatches} "
        f"micro-batches){note}: {len(problems)} problem(s)"
    ]
    lines += [f"  - {problem.message}" for problem in problems[:_MAX_LISTED]]
    if len(problems) > _MAX_LISTED:
        lines.append(f"  ... and {len(problems) - _MAX_LISTED} more (see .problems)")
    marks = {problem.cell for problem in problems if problem.cell is not None}
    lines += ["grid (problem cells in [brackets]):", format_grid(schedule, marks)]
    return "\n".join(lines)


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` listing every problem in ``schedule``; return if valid.

    Checks stage fields, micro-batch ranges, exactly one F and one backward per micro-batch per
    stage (a B, or an I followed by its W: every W runs within the schedule, so before the
    optimizer step that follows it) after the F and with its weight version (one F and no
    backward if ``training=False``), and, for
    schedules with communication, send/receive placement, pairing and FIFO order across
    neighbours. Activation offload (:mod:`~lightning_pipe2bw.schedule.offload`): EVICT and LOAD
    only on the earlier stage of a pair (s < p - 1 - s), RETURN only on the later one, F(i)
    before EVICT(i) before LOAD(i) before B(i), one LOAD per EVICT, and EVICT/RETURN and
    RETURN/LOAD paired across partners in FIFO order. A compute-only schedule is also checked after :func:`add_communication`.
    Finally the schedule is simulated to rule out deadlock (only once everything else passes,
    so the deadlock report is meaningful).
    """
    checked, note = schedule, ""
    problems = _collect(schedule)
    if not problems and not schedule.has_comm:
        checked, note = add_communication(schedule), " after add_communication"
        problems = _collect(checked)
    if not problems:
        try:
            simulate(checked)
        except DeadlockError as err:
            problems = [
                _Problem(f"deadlock: {reason}", cell)
                for reason, cell in zip(err.reasons, err.stuck, strict=True)
            ]
    if problems:
        message = _message(checked, problems, note)
        raise ScheduleError(message, tuple(problem.message for problem in problems))
