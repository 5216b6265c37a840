"""Schedule validator: per-stage, channel (FIFO) and deadlock checks, reported on a grid."""

from __future__ import annotations

from dataclasses import dataclass

from .action import Action, ActionKind, partner
from .comm import add_communication
from .generators import Schedule, format_grid
from .simulate import DeadlockError, simulate

__all__ = ["ScheduleError", "validate"]

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


def _where(schedule: Schedule, lane: int, slot: int, action: Action) -> str:
    return f"{_lane(schedule, lane)}, slot {slot} ({action})"


def _lane(schedule: Schedule, r: int) -> str:
    return f"stage {r}" if schedule.placement is None else f"rank {r}"


def _check_stage(schedule: Schedule, s: int, has_comm: bool) -> list[_Problem]:
    """The checks of action list ``s`` (stage s; rank s with virtual stages)."""
    p, m = schedule.num_stages, schedule.num_microbatches
    virtual = schedule.placement is not None
    actions = schedule.stages[s]
    out: list[_Problem] = []
    # per stage on this list: (kind, micro-batch) -> first slot
    firsts: dict[int, dict[tuple[ActionKind, int], int]] = {v: {} for v in schedule.stages_of(s)}
    for i, a in enumerate(actions):
        cell = (s, i)
        if not virtual and a.stage != s:
            # Messages are only formatted on error paths, keeping the happy path cheap.
            msg = f"{_where(schedule, s, i, a)}: its stage field is {a.stage} but it is listed under stage {s}"
            out.append(_Problem(f"{msg}; set stage={s} or move it", cell))
        elif virtual and (not 0 <= a.stage < p or schedule.rank_of(a.stage) != s):
            held = list(schedule.stages_of(s))
            msg = f"{_where(schedule, s, i, a)}: stage {a.stage} is not on rank {s}, which holds {held}"
            out.append(_Problem(f"{msg}; move it to its rank's list", cell))
            continue
        if not 0 <= a.microbatch < m:
            msg = f"{_where(schedule, s, i, a)}: micro-batch {a.microbatch} is out of range"
            out.append(_Problem(f"{msg}; use 0..{m - 1} (num_microbatches={m})", cell))
            continue
        if a.is_offload:
            problem = _offload_placement(schedule, s, i, a)
            if problem is not None:
                out.append(problem)
                continue
        elif a.is_comm and not virtual and not 0 <= s + _PEER[a.kind] < p:
            peer = s + _PEER[a.kind]
            msg = f"{_where(schedule, s, i, a)}: {a.kind.value} needs stage {peer}, which does not exist"
            out.append(_Problem(f"{msg} (p={p}); remove it", cell))
            continue
        elif a.is_comm and virtual and not schedule.crosses(a.stage, a.stage + _PEER[a.kind]):
            peer = a.stage + _PEER[a.kind]
            where = "does not exist" if not 0 <= peer < p else f"is on rank {s} too"
            msg = f"{_where(schedule, s, i, a)}: {a.kind.value} needs stage {peer} on another rank; it {where}"
            out.append(_Problem(f"{msg}; remove it (a stage hands over to one on its rank)", cell))
            continue
        first = firsts[a.stage if virtual else s]
        key = (a.kind, a.microbatch)
        if key in first:
            msg = f"{_where(schedule, s, i, a)}: duplicate {a.kind.value} of micro-batch {a.microbatch}"
            out.append(_Problem(f"{msg} (first at slot {first[key]}); keep exactly one", cell))
            continue
        first[key] = i

    for v, first in firsts.items():
        for mb in range(m):
            out += _check_backward(schedule, s, mb, first, v)
            if has_comm:
                out += _check_comm_order(schedule, s, mb, first, v)
            out += _check_offload_order(schedule, s, mb, first)
            if virtual:
                out += _check_hand_over(schedule, s, mb, firsts, v)
    return out


def _check_hand_over(
    schedule: Schedule,
    s: int,
    mb: int,
    firsts: dict[int, dict[tuple[ActionKind, int], int]],
    v: int,
) -> list[_Problem]:
    """Stages v - 1 and v on one rank: F(v - 1) hands its output to F(v), so it runs first; the
    backward of v hands its inputs' gradient to that of v - 1, so it runs first."""
    out: list[_Problem] = []
    before = v - 1
    if before < 0 or schedule.crosses(v, before):
        return out
    actions = schedule.stages[s]
    mine, theirs = firsts[v], firsts[before]
    f, upstream = mine.get((_F, mb)), theirs.get((_F, mb))
    if f is not None and upstream is not None and f < upstream:
        msg = f"{_where(schedule, s, f, actions[f])}: runs before {actions[upstream]} (slot {upstream}), whose output it takes"
        out.append(_Problem(f"{msg}; move it after", (s, f)))
    b, downstream = _backward_slot(theirs, mb), _backward_slot(mine, mb)
    if b is not None and downstream is not None and b < downstream:
        msg = (
            f"{_where(schedule, s, b, actions[b])}: runs before {actions[downstream]} (slot {downstream}), "
            "whose inputs' gradient it takes"
        )
        out.append(_Problem(f"{msg}; move it after", (s, b)))
    return out


def _backward_slot(first: dict[tuple[ActionKind, int], int], mb: int) -> int | None:
    """The slot of the action that starts micro-batch ``mb``'s backward: its B, or its I."""
    b = first.get((_B, mb))
    return b if b is not None else first.get((_I, mb))


def _check_backward(
    schedule: Schedule, s: int, mb: int, first: dict[tuple[ActionKind, int], int], v: int
) -> list[_Problem]:
    """One F per micro-batch and, in a training schedule, one backward: a B, or an I and then
    a W (never both forms); each after the F, with the F's weight version. ``s``: the action
    list, ``v``: the stage (the same with one stage per rank)."""
    actions, out = schedule.stages[s], []
    f = first.get((_F, mb))
    slots = {kind: first.get((kind, mb)) for kind in (_B, _I, _W)}
    present = [(kind, slot) for kind, slot in slots.items() if slot is not None]
    if f is None:
        out.append(
            _Problem(f"{_lane(schedule, s)}: micro-batch {mb} has no {Action(v, _F, mb)}; add one")
        )
    if not schedule.training:
        for _, slot in present:
            where = _where(schedule, s, slot, actions[slot])
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
            f"{_where(schedule, s, other, actions[other])}: micro-batch {mb} also has a whole backward "
            f"{actions[b]} (slot {b})"
        )
        out.append(_Problem(f"{msg}; run its backward as one B, or as an I then a W", (s, other)))
    elif b is None and i is None and w is None:
        missing = f"{Action(v, _B, mb)} (or {Action(v, _I, mb)} and {Action(v, _W, mb)})"
        out.append(_Problem(f"{_lane(schedule, s)}: micro-batch {mb} has no {missing}; add one"))
    elif b is None and (i is None) != (w is None):
        if i is None:
            assert w is not None
            need = Action(v, _I, mb, actions[w].version)
            msg = f"{_where(schedule, s, w, actions[w])}: no {need} computes the inputs' gradient"
            out.append(_Problem(f"{msg}; insert one before it, or make this a B", (s, w)))
        else:
            need = Action(v, _W, mb, actions[i].version)
            msg = f"{_where(schedule, s, i, actions[i])}: no {need} computes the weights' gradients"
            out.append(
                _Problem(
                    f"{msg}; insert one after it (before the step ends), or make this a B", (s, i)
                )
            )
    if i is not None and w is not None and w < i:
        msg = f"{_where(schedule, s, w, actions[w])}: runs before its {actions[i]} (slot {i})"
        out.append(_Problem(f"{msg}; a W follows its I", (s, w)))
    if f is not None:
        fwd = actions[f]
        for _, slot in present:
            bwd = actions[slot]
            if slot < f:
                msg = f"{_where(schedule, s, slot, bwd)}: backward runs before its forward {fwd} (slot {f})"
                out.append(_Problem(f"{msg}; move it after the forward", (s, slot)))
            if fwd.version != bwd.version:
                msg = (
                    f"{_where(schedule, s, slot, bwd)}: runs with weight version {bwd.version} but its "
                    f"forward {fwd} used {fwd.version}"
                )
                out.append(_Problem(f"{msg}; a backward must use its forward's version", (s, slot)))
    return out


def _offload_placement(schedule: Schedule, s: int, i: int, a: Action) -> _Problem | None:
    """An offload action on a stage that cannot run it: the middle stage (its own partner),
    EVICT/LOAD on the later stage of a pair, RETURN on the earlier one, or any in a
    forward-only schedule."""
    p, q = schedule.num_stages, partner(s, schedule.num_stages)
    where = _where(schedule, s, i, a)
    if schedule.placement is not None:
        msg = f"{where}: activation offload pairs stage s with stage p - 1 - s, one stage per rank"
        return _Problem(f"{msg}; it does not run with virtual stages, remove it", (s, i))
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
            msg = f"{_where(schedule, s, e, evict)}: must come after {actions[f]} (slot {f})"
            out.append(_Problem(f"{msg}; move it", (s, e)))
        if load is None:
            need = Action(s, _LOAD, mb, evict.version)
            msg = f"{_where(schedule, s, e, evict)}: no {need} brings the activations back"
            fix = "insert one before the backward's RECV_B (or use add_offload)"
            out.append(_Problem(f"{msg}; {fix}", (s, e)))
    if load is not None:
        loaded = actions[load]
        if e is None:
            need = Action(s, _EVICT, mb, loaded.version)
            msg = f"{_where(schedule, s, load, loaded)}: no {need} sent these activations away"
            out.append(_Problem(f"{msg}; insert one after the forward or remove this", (s, load)))
        elif load < e:
            msg = f"{_where(schedule, s, load, loaded)}: must come after {actions[e]} (slot {e})"
            out.append(_Problem(f"{msg}; move it", (s, load)))
        if b is not None and load > b:
            msg = f"{_where(schedule, s, load, loaded)}: must come before {actions[b]} (slot {b})"
            out.append(_Problem(f"{msg}; move it", (s, load)))
    return out


def _check_comm_order(
    schedule: Schedule, s: int, mb: int, first: dict[tuple[ActionKind, int], int], v: int
) -> list[_Problem]:
    """Each F and each backward (its B or I) on a stage with a peer needs its receive before and
    its send after it."""
    actions, out = schedule.stages[s], []
    for comm_kind, compute_kind, before in _RULES:
        x = first.get((_F, mb)) if compute_kind is _F else _backward_slot(first, mb)
        if x is None or not schedule.crosses(v, v + _PEER[comm_kind]):
            continue
        compute, c = actions[x], first.get((comm_kind, mb))
        side = "before" if before else "after"
        if c is None:
            need = Action(v, comm_kind, mb, compute.version)
            msg = f"{_where(schedule, s, x, compute)}: no {need} {side} it"
            out.append(_Problem(f"{msg}; insert one (or use add_communication)", (s, x)))
        elif (c > x) if before else (c < x):
            msg = f"{_where(schedule, s, c, actions[c])}: must come {side} {compute} (slot {x})"
            out.append(_Problem(f"{msg}; move it", (s, c)))
    return out


# what a point-to-point action carries: (send kind, receive kind) and, for a send, the offset of
# the stage it goes to; for a receive, the offset of the stage it comes from
_LINKS = {
    ActionKind.SEND_F: (ActionKind.SEND_F, ActionKind.RECV_F, 1),
    ActionKind.RECV_F: (ActionKind.SEND_F, ActionKind.RECV_F, -1),
    ActionKind.SEND_B: (ActionKind.SEND_B, ActionKind.RECV_B, -1),
    ActionKind.RECV_B: (ActionKind.SEND_B, ActionKind.RECV_B, 1),
}

# one message end: (slot, action, the stage the data is for, micro-batch)
_End = tuple[int, Action, int, int]


def _ends(schedule: Schedule) -> dict[tuple[int, int, ActionKind], tuple[list[_End], list[_End]]]:
    """Every channel (source list, destination list, send kind): its sends and its receives in
    list order, each with the (stage, micro-batch) the data is for; the first of each only."""
    channels: dict[tuple[int, int, ActionKind], tuple[list[_End], list[_End]]] = {}
    seen: set[tuple[int, ActionKind, int, int]] = set()
    p, m = schedule.num_stages, schedule.num_microbatches
    for r, actions in enumerate(schedule.stages):
        for i, a in enumerate(actions):
            if a.kind not in _LINKS or not 0 <= a.microbatch < m:
                continue
            send_kind, _, offset = _LINKS[a.kind]
            other = a.stage + offset
            if (
                not 0 <= a.stage < p
                or not 0 <= other < p
                or (r, a.kind, a.stage, a.microbatch) in seen
            ):
                continue
            seen.add((r, a.kind, a.stage, a.microbatch))
            peer = schedule.rank_of(other)
            if a.kind is send_kind:
                channels.setdefault((r, peer, send_kind), ([], []))[0].append(
                    (i, a, other, a.microbatch)
                )
            else:
                channels.setdefault((peer, r, send_kind), ([], []))[1].append(
                    (i, a, a.stage, a.microbatch)
                )
    return channels


def _check_channel(
    schedule: Schedule,
    src: int,
    dst: int,
    send_kind: ActionKind,
    sends: list[_End],
    recvs: list[_End],
) -> list[_Problem]:
    """The sends of list ``src`` to list ``dst`` and the receives there pair up, in the same
    (FIFO) order."""
    out: list[_Problem] = []
    recv_kind = _LINKS[send_kind][1]
    sent = {(v, mb) for _, _, v, mb in sends}
    got = {(v, mb) for _, _, v, mb in recvs}
    for i, a, v, mb in sends:
        if (v, mb) not in got:
            need = f"{v}{recv_kind.value}{mb}"
            msg = f"{_where(schedule, src, i, a)}: no matching {need} on {_lane(schedule, dst)}"
            out.append(_Problem(f"{msg}; add one there", (src, i)))
    for i, a, v, mb in recvs:
        if (v, mb) not in sent:
            need = f"{v - _LINKS[send_kind][2]}{send_kind.value}{mb}"
            msg = f"{_where(schedule, dst, i, a)}: no matching {need} on {_lane(schedule, src)}"
            out.append(_Problem(f"{msg}; add one there or remove this receive", (dst, i)))
    paired_sends = [end for end in sends if end[2:] in got]
    paired_recvs = [end for end in recvs if end[2:] in sent]
    # Channels are FIFO: the k-th receive gets the k-th send's data, whatever its id.
    for (si, sa, *sent_for), (ri, ra, *got_for) in zip(paired_sends, paired_recvs, strict=False):
        if sent_for != got_for:
            msg = (
                f"{_where(schedule, dst, ri, ra)}: the FIFO channel {src}->{dst} delivers {sa} "
                f"({_lane(schedule, src)}, slot {si}) here"
            )
            fix = f"receive in the order {_lane(schedule, src)} sends"
            out.append(_Problem(f"{msg}; {fix}", (dst, ri)))
            break  # later mismatches on this channel follow from the first
    return out


def _firsts(schedule: Schedule, stage: int, kind: ActionKind) -> list[_End]:
    """The first ``kind`` action per in-range micro-batch on ``stage``, in slot order."""
    seen: set[int] = set()
    out: list[_End] = []
    for i, a in enumerate(schedule.stages[stage]):
        if a.kind is kind and 0 <= a.microbatch < schedule.num_microbatches:
            if a.microbatch not in seen:
                seen.add(a.microbatch)
                out.append((i, a, 0, a.microbatch))
    return out


def _check_channels(schedule: Schedule) -> list[_Problem]:
    """Sends and receives pair up across neighbours, and offload actions across partners
    (EVICT on s with RETURN on p - 1 - s, RETURN with LOAD back on s), in FIFO order."""
    out: list[_Problem] = []
    channels = _ends(schedule)
    order = {ActionKind.SEND_F: 0, ActionKind.SEND_B: 1}
    for (src, dst, kind), (sends, recvs) in sorted(
        channels.items(), key=lambda item: (min(item[0][:2]), order[item[0][2]])
    ):
        out += _check_channel(schedule, src, dst, kind, sends, recvs)
    if schedule.placement is not None:
        return out
    p = schedule.num_stages
    for s in range(p):
        q = partner(s, p)
        if s < q:  # the evicting side of a pair; misplaced offload actions are per-stage problems
            for kind, (a, b) in ((_EVICT, (s, q)), (_RETURN, (q, s))):
                recv = _RETURN if kind is _EVICT else _LOAD
                out += _check_offload_channel(schedule, kind, recv, a, b)
    return out


def _check_offload_channel(
    schedule: Schedule, send_kind: ActionKind, recv_kind: ActionKind, src: int, dst: int
) -> list[_Problem]:
    """``send_kind`` on ``src`` and ``recv_kind`` on ``dst`` pair up, in the same (FIFO) order."""
    out: list[_Problem] = []
    sends, recvs = _firsts(schedule, src, send_kind), _firsts(schedule, dst, recv_kind)
    sent = {mb for *_, mb in sends}
    got = {mb for *_, mb in recvs}
    for i, a, _, mb in sends:
        if mb not in got:
            msg = f"{_where(schedule, src, i, a)}: no matching {dst}{recv_kind.value}{mb} on stage {dst}"
            out.append(_Problem(f"{msg}; add one there", (src, i)))
    for i, a, _, mb in recvs:
        if mb not in sent:
            msg = f"{_where(schedule, dst, i, a)}: no matching {src}{send_kind.value}{mb} on stage {src}"
            out.append(_Problem(f"{msg}; add one there or remove this receive", (dst, i)))
    paired_sends = [end for end in sends if end[3] in got]
    paired_recvs = [end for end in recvs if end[3] in sent]
    for (si, sa, _, smb), (ri, ra, _, rmb) in zip(paired_sends, paired_recvs, strict=False):
        if smb != rmb:
            msg = (
                f"{_where(schedule, dst, ri, ra)}: the FIFO channel {src}->{dst} delivers {sa} "
                f"(stage {src}, slot {si}) here"
            )
            out.append(_Problem(f"{msg}; receive in the order stage {src} sends", (dst, ri)))
            break
    return out


def _collect(schedule: Schedule) -> list[_Problem]:
    has_comm = schedule.has_comm
    problems = [p for s in range(schedule.num_ranks) for p in _check_stage(schedule, s, has_comm)]
    if has_comm:
        problems += _check_channels(schedule)
    return problems


def _message(schedule: Schedule, problems: list[_Problem], note: str) -> str:
    s = schedule
    lines = [
        f"invalid schedule {s.name!r} ({s.num_stages} stages"
        f"{'' if s.placement is None else f' on {s.num_ranks} ranks'}, {s.num_microbatches} "
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
