"""Activation offload (BPipe) as schedule data: placement, validation and simulation."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from lightning_pipe2bw.schedule import (
    SCHEDULES,
    Action,
    ActionKind,
    Costs,
    DeadlockError,
    OneFOneBStream,
    Schedule,
    ScheduleError,
    add_communication,
    add_offload,
    add_offload_schedule,
    format_actions,
    forward_only,
    get_schedule,
    gpipe,
    offload_stages,
    one_f_one_b,
    parse_action,
    parse_actions,
    parse_stages,
    partner,
    simulate,
    two_bw,
    two_bw_version,
    validate,
    with_communication,
)

EVICT, RETURN, LOAD = ActionKind.EVICT, ActionKind.RETURN, ActionKind.LOAD
FAST = settings(max_examples=30, deadline=None, database=None)


def stages(*rows: str) -> tuple[tuple[Action, ...], ...]:
    """One string per stage (written over several source lines) through ``parse_stages``."""
    return parse_stages("\n".join(rows))


def make(name: str, rows: Sequence[str], m: int) -> Schedule:
    parsed = stages(*rows)
    return Schedule(name, len(parsed), m, parsed)


def edit(rows: Sequence[str], stage: int, old: str, new: str) -> list[str]:
    """``rows`` with the action sequence ``old`` replaced by ``new`` on ``stage`` (must occur)."""
    tokens = f" {' '.join(rows[stage].split())} "
    assert f" {old} " in tokens, f"{old!r} not on stage {stage}"
    out = list(rows)
    out[stage] = tokens.replace(f" {old} ", f" {new} ", 1).strip()
    return out


# ----------------------------------------------------------------------------- golden placement

ONE_F_ONE_B_2_2 = (
    "0F0 0SEND_F0 0EVICT0  0F1 0SEND_F1 0EVICT1  0LOAD0 0RECV_B0 0B0  0LOAD1 0RECV_B1 0B1",
    "1RECV_F0 1F0 1RETURN0 1B0 1SEND_B0  1RECV_F1 1F1 1RETURN1 1B1 1SEND_B1",
)
ONE_F_ONE_B_4_4 = (
    "0F0 0SEND_F0 0EVICT0  0F1 0SEND_F1 0EVICT1  0F2 0SEND_F2 0EVICT2  0F3 0SEND_F3 0EVICT3 "
    "0LOAD0 0RECV_B0 0B0  0LOAD1 0RECV_B1 0B1  0LOAD2 0RECV_B2 0B2  0LOAD3 0RECV_B3 0B3",
    "1RECV_F0 1F0 1SEND_F0 1EVICT0  1RECV_F1 1F1 1SEND_F1 1EVICT1 "
    "1RECV_F2 1F2 1SEND_F2 1EVICT2  1LOAD0 1RECV_B0 1B0 1SEND_B0 "
    "1RECV_F3 1F3 1SEND_F3 1EVICT3  1LOAD1 1RECV_B1 1B1 1SEND_B1 "
    "1LOAD2 1RECV_B2 1B2 1SEND_B2  1LOAD3 1RECV_B3 1B3 1SEND_B3",
    "2RECV_F0 2F0 2SEND_F0  2RECV_F1 2F1 2SEND_F1  2RETURN0 2RECV_B0 2B0 2SEND_B0 "
    "2RECV_F2 2F2 2SEND_F2  2RETURN1 2RECV_B1 2B1 2SEND_B1 "
    "2RECV_F3 2F3 2SEND_F3  2RETURN2 2RECV_B2 2B2 2SEND_B2  2RETURN3 2RECV_B3 2B3 2SEND_B3",
    "3RECV_F0 3F0 3RETURN0 3B0 3SEND_B0  3RECV_F1 3F1 3RETURN1 3B1 3SEND_B1 "
    "3RECV_F2 3F2 3RETURN2 3B2 3SEND_B2  3RECV_F3 3F3 3RETURN3 3B3 3SEND_B3",
)


@pytest.mark.parametrize(("p", "m", "golden"), [(2, 2, ONE_F_ONE_B_2_2), (4, 4, ONE_F_ONE_B_4_4)])
def test_golden_offload_1f1b(p: int, m: int, golden: tuple[str, ...]) -> None:
    schedule = add_offload_schedule(one_f_one_b(p, m))
    assert schedule.stages == stages(*golden)
    assert (schedule.name, schedule.num_stages, schedule.num_microbatches) == ("1f1b+offload", p, m)
    # the same from a schedule that already has its communication
    assert add_offload_schedule(add_communication(one_f_one_b(p, m))).stages == schedule.stages
    validate(schedule)


def test_offload_copies_versions_and_subsets() -> None:
    versioned = make("versioned", ["0F0v3 0B0v3", "1F0v3 1B0v3"], m=1)
    expected = stages(
        "0F0v3 0SEND_F0v3 0EVICT0v3 0LOAD0v3 0RECV_B0v3 0B0v3",
        "1RECV_F0v3 1F0v3 1RETURN0v3 1B0v3 1SEND_B0v3",
    )
    assert add_offload_schedule(versioned).stages == expected
    # only stage 1 of p = 4 evicts: stage 2 returns, stages 0 and 3 keep their communication
    schedule = one_f_one_b(4, 4)
    only_1 = add_offload_schedule(schedule, evicting=[1])
    full = stages(*ONE_F_ONE_B_4_4)
    plain = add_communication(schedule).stages
    assert only_1.stages == (plain[0], full[1], full[2], plain[3])
    validate(only_1)
    assert add_offload_schedule(schedule, evicting=()).stages == plain


@pytest.mark.parametrize(
    ("p", "expected"), [(1, ()), (2, (0,)), (3, (0,)), (4, (0, 1)), (5, (0, 1)), (8, (0, 1, 2, 3))]
)
def test_offload_stages_and_partner(p: int, expected: tuple[int, ...]) -> None:
    assert offload_stages(p) == expected
    assert [partner(s, p) for s in range(p)] == list(reversed(range(p)))
    assert all(s < partner(s, p) for s in expected)
    assert all(s >= partner(s, p) for s in range(p) if s not in expected)


# ----------------------------------------------------------------------------- compact forms


def test_offload_compact_forms() -> None:
    cases = {
        "0EVICT3": Action(0, EVICT, 3),
        "3RETURN3": Action(3, RETURN, 3),
        "0LOAD3": Action(0, LOAD, 3),
        "12LOAD15v2": Action(12, LOAD, 15, 2),
        "1EVICT0v0": Action(1, EVICT, 0, 0),
    }
    for text, action in cases.items():
        assert parse_action(text) == action
        assert str(action) == text
    items = list(cases.values())
    assert parse_actions(format_actions(items)) == items
    for kind in (EVICT, RETURN, LOAD):
        action = Action(0, kind, 0)
        assert action.is_comm and action.is_offload and not action.is_compute
    for kind in (ActionKind.FORWARD, ActionKind.SEND_F, ActionKind.RECV_B):
        assert not Action(0, kind, 0).is_offload
    assert Action(0, "LOAD", 1) == Action(0, LOAD, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["0LOAD", "LOAD3", "0LOADS3", "0EVICTv3", "0RETURN_F3", "0LOD3"])
def test_malformed_offload_forms(text: str) -> None:
    with pytest.raises(ValueError, match="malformed action"):
        parse_action(text)


@FAST
@given(
    stage=st.integers(-3, 1000),
    kind=st.sampled_from([EVICT, RETURN, LOAD]),
    microbatch=st.integers(-3, 1000),
    version=st.none() | st.integers(-3, 1000),
)
def test_offload_round_trip(
    stage: int, kind: ActionKind, microbatch: int, version: int | None
) -> None:
    action = Action(stage, kind, microbatch, version)
    assert parse_action(str(action)) == action


# ----------------------------------------------------------------------------- properties


def accepts(name: str, p: int, m: int) -> bool:
    return name != "2bw" or m >= p


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@FAST
@example(p=1, m=1)
@example(p=2, m=1)
@example(p=5, m=5)
@example(p=6, m=12)
@given(p=st.integers(1, 6), m=st.integers(1, 12))
def test_offload_schedules_are_valid(name: str, p: int, m: int) -> None:
    assume(accepts(name, p, m))
    base = get_schedule(name, p, m)
    schedule = add_offload_schedule(base)
    assert schedule.name == f"{name}+offload"
    validate(schedule)  # includes a deadlock-free simulation
    n = base.num_microbatches
    plain = add_communication(base)
    evicting = offload_stages(p)
    for s, actions in enumerate(schedule.stages):
        extra = [a for a in actions if a.is_offload]
        # removing the offload actions gives back the schedule with communication
        assert tuple(a for a in actions if not a.is_offload) == plain.stages[s]
        kinds = sorted({a.kind.value for a in extra})
        if s in evicting:
            assert kinds == ["EVICT", "LOAD"] and len(extra) == 2 * n
        elif partner(s, p) in evicting:
            assert kinds == ["RETURN"] and len(extra) == n
        else:
            assert extra == []


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@FAST
@given(
    p=st.integers(1, 6),
    m=st.integers(1, 12),
    data=st.data(),
)
def test_offload_adds_no_time(name: str, p: int, m: int, data: st.DataObject) -> None:
    """EVICT is sent before the partner can run F(i), so RETURN never waits, and RETURN(i) runs
    before the partner's B(i), so LOAD(i) is done by the time RECV_B(i) would be: every other
    action ends when it would without offload."""
    assume(accepts(name, p, m))
    cost = st.floats(0.0, 5.0, allow_nan=False)
    costs = Costs(
        forward=data.draw(st.lists(cost, min_size=p, max_size=p)),
        backward=data.draw(st.lists(cost, min_size=p, max_size=p)),
        comm=data.draw(cost),
    )
    evicting = data.draw(st.sets(st.sampled_from(offload_stages(p))) if p > 1 else st.just(set()))
    base = get_schedule(name, p, m)
    offloaded = add_offload_schedule(base, evicting)
    validate(offloaded)
    with_offload, without = simulate(offloaded, costs), simulate(base, costs)
    assert with_offload.step_time == without.step_time
    assert with_offload.busy == without.busy
    assert with_offload.peak_activations == without.peak_activations
    for row, plain in zip(with_offload.timeline, without.timeline, strict=True):
        # a receive may start later (after a LOAD that waited) but ends at the same time
        ends = [(a, end) for a, _, end in row if not a.is_offload]
        assert ends == [(a, end) for a, _, end in plain]
        assert all(start == end for a, start, end in row if a.kind is RETURN)  # never waits


def test_simulator_timeline_has_offload_actions() -> None:
    schedule = add_offload_schedule(one_f_one_b(2, 2))
    result = simulate(schedule, Costs(forward=1.0, backward=2.0, comm=0.0))
    assert result.step_time == simulate(one_f_one_b(2, 2)).step_time == 9.0
    for s, row in enumerate(result.timeline):
        assert tuple(a for a, _, _ in row) == schedule.stages[s]
    times = {str(a): (start, end) for row in result.timeline for a, start, end in row}
    assert times["0EVICT0"] == (1.0, 1.0)  # right after 0F0
    assert times["1RETURN0"] == (2.0, 2.0)  # after 1F0, before 1B0
    assert times["0LOAD0"] == (2.0, 2.0)  # returned at 2, ready before 0RECV_B0 waits
    assert times["0RECV_B0"] == (2.0, 4.0)
    assert result.peak_activations == (2, 1)  # still micro-batches between F and B
    # With latency, LOAD still never waits: RETURN(i) left the partner before its B(i).
    slow = simulate(schedule, Costs(forward=1.0, backward=2.0, comm=0.5))
    times = {str(a): (start, end) for row in slow.timeline for a, start, end in row}
    assert times["1RETURN0"] == (2.5, 2.5)  # 0EVICT0 arrived at 1.5, 1F0 ran 1.5..2.5
    assert times["0LOAD0"] == (2.0, 3.0)  # 1RETURN0 arrives at 3.0 ...
    assert times["0RECV_B0"] == (3.0, 5.0)  # ... before 1SEND_B0 (4.5) arrives at 5.0


def test_return_sends_back_when_its_wait_ends() -> None:
    # RETURN hoisted to the start of stage 1: it waits for 0EVICT0 (sent at 1, arriving at
    # 1.5) and only then sends the activations back (arriving at 2.0).
    rows = (
        "0F0 0SEND_F0 0EVICT0 0LOAD0 0RECV_B0 0B0",
        "1RETURN0 1RECV_F0 1F0 1B0 1SEND_B0",
    )
    schedule = make("early-return", rows, 1)
    validate(schedule)
    result = simulate(schedule, Costs(forward=1.0, backward=2.0, comm=0.5))
    times = {str(a): (start, end) for row in result.timeline for a, start, end in row}
    assert times["1RETURN0"] == (0.0, 1.5)
    assert times["0LOAD0"] == (1.0, 2.0)
    assert result.step_time == 1 + 0.5 + 1 + 2 + 0.5 + 2


# ----------------------------------------------------------------------------- validator


def check_problem(
    rows: Sequence[str], m: int, fragments: Sequence[str], cells: Sequence[str]
) -> None:
    with pytest.raises(ScheduleError) as info:
        validate(make("broken", rows, m))
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    for cell in cells:
        assert f"[{cell}]" in message, message


def test_golden_rows_are_valid() -> None:
    validate(make("ok", ONE_F_ONE_B_2_2, m=2))
    validate(make("ok", ONE_F_ONE_B_4_4, m=4))


def test_load_before_evict_is_caught() -> None:
    rows = edit(
        ONE_F_ONE_B_2_2, 0, "0F1 0SEND_F1 0EVICT1 0LOAD0", "0F1 0SEND_F1 0LOAD1 0EVICT1 0LOAD0"
    )
    rows = edit(rows, 0, "0LOAD1 0RECV_B1", "0RECV_B1")
    check_problem(
        rows, 2, ["stage 0, slot 5 (0LOAD1): must come after 0EVICT1 (slot 6); move it"], ["0LOAD1"]
    )


def test_evict_before_forward_and_load_after_backward_are_caught() -> None:
    rows = edit(ONE_F_ONE_B_2_2, 0, "0F0 0SEND_F0 0EVICT0", "0EVICT0 0F0 0SEND_F0")
    rows = edit(rows, 0, "0LOAD1 0RECV_B1 0B1", "0RECV_B1 0B1 0LOAD1")
    check_problem(
        rows,
        2,
        ["0EVICT0): must come after 0F0 (slot 1)", "0LOAD1): must come before 0B1 (slot 10)"],
        ["0EVICT0", "0LOAD1"],
    )


def test_evict_without_load_and_duplicates_are_caught() -> None:
    rows = edit(ONE_F_ONE_B_2_2, 0, "0LOAD1 0RECV_B1", "0RECV_B1")
    check_problem(rows, 2, ["no 0LOAD1 brings the activations back"], ["0EVICT1"])
    rows = edit(ONE_F_ONE_B_2_2, 0, "0LOAD1 0RECV_B1", "0LOAD1 0LOAD1 0RECV_B1")
    check_problem(rows, 2, ["duplicate LOAD of micro-batch 1 (first at slot 9)"], ["0LOAD1"])
    rows = edit(ONE_F_ONE_B_2_2, 0, "0EVICT1", "")
    rows = edit(rows, 1, "1RETURN1", "")
    check_problem(rows, 2, ["no 0EVICT1 sent these activations away"], ["0LOAD1"])


def test_missing_return_is_caught() -> None:
    rows = edit(ONE_F_ONE_B_4_4, 3, "3RETURN2", "")
    check_problem(
        rows,
        4,
        [
            "0EVICT2): no matching 3RETURN2 on stage 3; add one there",
            "0LOAD2): no matching 3RETURN2 on stage 3; add one there or remove this receive",
        ],
        ["0EVICT2", "0LOAD2"],
    )


def test_swapped_returns_violate_fifo() -> None:
    rows = edit(ONE_F_ONE_B_4_4, 2, "2RETURN1", "2RETURNX")
    rows = edit(rows, 2, "2RETURN2", "2RETURN1")
    rows = edit(rows, 2, "2RETURNX", "2RETURN2")
    check_problem(
        rows,
        4,
        [
            "2RETURN2): the FIFO channel 1->2 delivers 1EVICT1 (stage 1, slot 7) here",
            "1LOAD1): the FIFO channel 2->1 delivers 2RETURN2",
        ],
        ["2RETURN2", "1LOAD1"],
    )
    broken = make("broken", rows, 4)
    with pytest.raises(ValueError, match=r"2RETURN2 would receive the data of 1EVICT1 .* FIFO"):
        simulate(broken)


def test_offload_on_the_wrong_stage_is_caught() -> None:
    # p = 3: stage 1 is the middle stage, its own partner
    schedule = add_offload_schedule(one_f_one_b(3, 2))
    rows = [format_actions(actions) for actions in schedule.stages]
    middle = edit(rows, 1, "1F0 1SEND_F0", "1F0 1SEND_F0 1EVICT0")
    check_problem(
        middle,
        2,
        ["stage 1 is the middle stage of p=3, its own partner (p - 1 - s)", "remove it"],
        ["1EVICT0"],
    )
    with pytest.raises(ValueError, match="middle stage of p=3"):
        simulate(make("broken", middle, 2))
    later = edit(rows, 2, "2RETURN0", "2LOAD0 2RETURN0")
    check_problem(
        later,
        2,
        ["2LOAD0): LOAD runs on the evicting stage of a pair", "move it to stage 0"],
        ["2LOAD0"],
    )
    earlier = edit(rows, 0, "0EVICT0", "0EVICT0 0RETURN0")
    check_problem(earlier, 2, ["RETURN runs on the later stage of a pair"], ["0RETURN0"])
    evaluation = forward_only(2, 1).with_stages(
        [[parse_action("0F0"), parse_action("0EVICT0")], []]
    )
    with pytest.raises(ScheduleError, match="offload in a forward-only"):
        validate(evaluation)


def test_stuck_offload_is_reported_as_deadlock() -> None:
    # LOAD0 right after EVICT0 (valid order on stage 0), but the partner returns micro-batch 0
    # only after F1, which needs stage 0's SEND_F1 behind that LOAD: a deadlock.
    rows = (
        "0F0 0SEND_F0 0EVICT0 0LOAD0 0F1 0SEND_F1 0EVICT1 0RECV_B0 0B0 0LOAD1 0RECV_B1 0B1",
        "1RECV_F0 1F0 1RECV_F1 1F1 1RETURN0 1B0 1SEND_B0 1RETURN1 1B1 1SEND_B1",
    )
    schedule = make("stuck", rows, 2)
    with pytest.raises(DeadlockError) as dead:
        simulate(schedule)
    assert dead.value.stuck == ((0, 3), (1, 2))
    reasons = "\n".join(dead.value.reasons)
    assert (
        "stage 0 is stuck at slot 3 on 0LOAD0: waits for 1RETURN0 (send #1 from stage 1" in reasons
    )
    assert "stage 1 is stuck at slot 2 on 1RECV_F1" in reasons
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(schedule)
    assert "[0LOAD0]" in str(info.value)
    # a RETURN waiting for an EVICT that comes too late
    rows = (
        "0F0 0SEND_F0 0RECV_B0 0EVICT0 0LOAD0 0B0",
        "1RECV_F0 1F0 1RETURN0 1B0 1SEND_B0",
    )
    with pytest.raises(DeadlockError) as dead:
        simulate(make("late-evict", rows, 1))
    reasons = "\n".join(dead.value.reasons)
    assert (
        "on 1RETURN0: waits for 0EVICT0 (send #1 from stage 0 to stage 1); stage 0 is stuck at slot 2 on 0RECV_B0"
        in reasons
    )


# ----------------------------------------------------------------------------- windows (2BW)


def windowed(stage: int, p: int, m: int, limits: Sequence[int]) -> list[list[Action]]:
    """Stage ``stage``'s 2BW stream cut at ``limits`` (then drained), with communication."""
    stream = OneFOneBStream(stage, p, lambda k: two_bw_version(k, m))
    windows = [stream.window(limit) for limit in limits] + [stream.drain()]
    return [[c for a in window for c in with_communication(a, p)] for window in windows]


def test_offload_on_a_2bw_window() -> None:
    p, m = 2, 2
    evicting = offload_stages(p)
    window = windowed(0, p, m, [2, 4, 6])[2]  # F4 B3 F5 B4: B3's forward ran a window earlier
    expected = (
        "0F4v1 0SEND_F4v1 0EVICT4v1  0LOAD3v0 0RECV_B3v0 0B3v0 "
        "0F5v1 0SEND_F5v1 0EVICT5v1  0LOAD4v1 0RECV_B4v1 0B4v1"
    )
    assert add_offload(window, 0, p, evicting) == parse_actions(expected)
    last = windowed(1, p, m, [2, 4, 6])[2]  # F4 B4 F5 B5 on the last stage: no RECV_B
    expected = (
        "1RECV_F4v1 1F4v1 1RETURN4v1 1B4v1 1SEND_B4v1 1RECV_F5v1 1F5v1 1RETURN5v1 1B5v1 1SEND_B5v1"
    )
    assert add_offload(last, 1, p, evicting) == parse_actions(expected)
    drain = windowed(0, p, m, [2, 4, 6])[3]  # only B5 is left: its LOAD, no EVICT
    assert add_offload(drain, 0, p, evicting) == parse_actions("0LOAD5v1 0RECV_B5v1 0B5v1")
    # a stage that is neither evicting nor a partner is left alone (p = 3, middle stage)
    middle = windowed(1, 3, 3, [3])[0]
    assert add_offload(middle, 1, 3, offload_stages(3)) == middle


@FAST
@given(
    p=st.integers(2, 6),
    data=st.data(),
)
def test_windows_together_equal_the_whole_stream(p: int, data: st.DataObject) -> None:
    """The rule is local: offloading each window gives what offloading the whole stream does,
    and the concatenated streams form a valid schedule."""
    m = data.draw(st.integers(p, 8), label="m")
    cuts = sorted(data.draw(st.lists(st.integers(1, 3 * m), max_size=4), label="cuts"))
    limits = [*cuts, 3 * m]
    evicting = offload_stages(p)
    rows = []
    for s in range(p):
        windows = windowed(s, p, m, limits)
        pieces = [a for w in windows for a in add_offload(w, s, p, evicting)]
        whole = add_offload([a for w in windows for a in w], s, p, evicting)
        assert pieces == whole
        rows.append(pieces)
    schedule = Schedule("2bw-windows", p, 3 * m, tuple(tuple(r) for r in rows))
    validate(schedule)
    assert schedule.stages == add_offload_schedule(two_bw(p, m, 3)).stages


# ----------------------------------------------------------------------------- user input


@pytest.mark.parametrize(
    ("p", "evicting", "pattern"),
    [
        (3, [1], r"stage 1 is the middle stage of num_stages=3: .* use stages from 0"),
        (4, [2], r"stage 2 cannot evict: .* evict from stage 1 instead \(use stages from 0, 1\)"),
        (4, [4], r"evicting stage 4 is out of range for num_stages=4; use stages from 0, 1"),
        (4, [-1], r"evicting stage -1 is out of range"),
        (1, [0], r"middle stage of num_stages=1: .*none: num_stages=1 has no pair of stages"),
        (4, ["0"], r"evicting stages must be ints, got '0'"),
    ],
)
def test_bad_evicting_stages(p: int, evicting: list[int], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        add_offload_schedule(gpipe(p, 2), evicting)
    with pytest.raises(ValueError, match=pattern):
        add_offload([], 0, p, evicting)


def test_bad_offload_input() -> None:
    with pytest.raises(ValueError, match=r"'forward' is forward-only .* nothing to offload"):
        add_offload_schedule(forward_only(2, 2))
    once = add_offload_schedule(gpipe(2, 1))
    with pytest.raises(
        ValueError, match=r"already has offload actions \(0EVICT0 at stage 0, slot 2\)"
    ):
        add_offload_schedule(once)
    with pytest.raises(ValueError, match=r"already have offload actions \(0EVICT0 at slot 2\)"):
        add_offload(once.stages[0], 0, 2, [0])
    with pytest.raises(ValueError, match=r"stage must be an int in 0\.\.1 \(num_stages=2\), got 2"):
        add_offload([], 2, 2, [0])
    with pytest.raises(ValueError, match="num_stages must be >= 1, got 0"):
        offload_stages(0)
