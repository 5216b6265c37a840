"""Golden and property tests for the pure-Python schedule subpackage."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lightning_pipe2bw.schedule import (
    SCHEDULES,
    Action,
    ActionKind,
    Costs,
    DeadlockError,
    Schedule,
    ScheduleError,
    add_communication,
    format_actions,
    format_grid,
    forward_only,
    get_schedule,
    gpipe,
    one_f_one_b,
    parse_action,
    parse_actions,
    parse_stages,
    simulate,
    validate,
)

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
FAST = settings(max_examples=50, deadline=None, database=None)
sizes = st.tuples(st.integers(1, 8), st.integers(1, 32))


def make(name: str, text: str, m: int) -> Schedule:
    stages = parse_stages(text)
    return Schedule(name, len(stages), m, stages)


# ----------------------------------------------------------------------------- golden schedules

GPIPE_2_2 = """
    0F0 0F1 0B0 0B1
    1F0 1F1 1B0 1B1
"""
GPIPE_3_4 = """
    0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
    1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3
    2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3
"""
ONE_F_ONE_B_2_2 = """
    0F0 0F1 0B0 0B1
    1F0 1B0 1F1 1B1
"""
ONE_F_ONE_B_3_4 = """
    0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
    1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3
    2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3
"""
ONE_F_ONE_B_4_2 = """
    0F0 0F1 0B0 0B1
    1F0 1F1 1B0 1B1
    2F0 2F1 2B0 2B1
    3F0 3B0 3F1 3B1
"""
ONE_F_ONE_B_2_2_COMM = """
    0F0      0SEND_F0 0F1      0SEND_F1 0RECV_B0 0B0      0RECV_B1 0B1
    1RECV_F0 1F0      1B0      1SEND_B0 1RECV_F1 1F1      1B1      1SEND_B1
"""


@pytest.mark.parametrize(
    ("name", "p", "m", "golden"),
    [
        ("gpipe", 2, 2, GPIPE_2_2),
        ("gpipe", 3, 4, GPIPE_3_4),
        ("1f1b", 2, 2, ONE_F_ONE_B_2_2),
        ("1f1b", 3, 4, ONE_F_ONE_B_3_4),
        ("1f1b", 4, 2, ONE_F_ONE_B_4_2),  # m < p: warm-up capped at m
    ],
)
def test_golden_schedules(name: str, p: int, m: int, golden: str) -> None:
    schedule = get_schedule(name, p, m)
    assert schedule.stages == parse_stages(golden)
    assert (schedule.name, schedule.num_stages, schedule.num_microbatches) == (name, p, m)


def test_golden_communication_1f1b() -> None:
    assert add_communication(one_f_one_b(2, 2)).stages == parse_stages(ONE_F_ONE_B_2_2_COMM)


def test_communication_copies_versions() -> None:
    versioned = make("versioned", "0F0v3 0B0v3\n1F0v3 1B0v3", m=1)
    expected = """
        0F0v3      0SEND_F0v3 0RECV_B0v3 0B0v3
        1RECV_F0v3 1F0v3      1B0v3      1SEND_B0v3
    """
    assert add_communication(versioned).stages == parse_stages(expected)
    validate(versioned)


def test_format_grid_golden() -> None:
    expected = "\n".join(
        [
            "slot     0    1    2    3",
            "stage 0  0F0  0F1  0B0  0B1",
            "stage 1  1F0 [1B0] 1F1  1B1",
        ]
    )
    assert format_grid(one_f_one_b(2, 2), {(1, 1)}) == expected
    assert str(one_f_one_b(2, 2)).endswith(format_grid(one_f_one_b(2, 2)))


# ----------------------------------------------------------------------------- actions

actions = st.builds(
    Action,
    stage=st.integers(-3, 10_000),
    kind=st.sampled_from(list(ActionKind)),
    microbatch=st.integers(-3, 10_000),
    version=st.none() | st.integers(-3, 10_000),
)


@FAST
@given(st.lists(actions, max_size=20))
def test_parse_format_round_trip(items: list[Action]) -> None:
    for action in items:
        assert parse_action(str(action)) == action
    assert parse_actions(format_actions(items)) == items


def test_action_compact_forms() -> None:
    assert str(Action(2, F, 0)) == "2F0"
    assert str(Action(0, ActionKind.SEND_F, 1)) == "0SEND_F1"
    assert str(Action(3, ActionKind.RECV_B, 0)) == "3RECV_B0"
    assert str(Action(1, F, 5, 2)) == "1F5v2"
    assert parse_action("10RECV_F12v3") == Action(10, ActionKind.RECV_F, 12, 3)
    assert Action(0, B, 0).is_compute and not Action(0, B, 0).is_comm
    assert Action(0, ActionKind.SEND_B, 0).is_comm
    assert Action(0, "F", 0) == Action(0, F, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'X'"):
        Action(0, "X", 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["", "F0", "0X0", "0F", "0F0v", "0F0x", "0 F0", "0SEND0", "a"])
def test_parse_action_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError, match="malformed action") as info:
        parse_action(text)
    assert repr(text) in str(info.value)


# ----------------------------------------------------------------------------- properties


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@FAST
@given(sizes)
def test_generated_schedules_are_valid(name: str, pm: tuple[int, int]) -> None:
    p, m = pm
    assume(name != "2bw" or m >= p)
    schedule = get_schedule(name, p, m)
    m = schedule.num_microbatches  # 2BW's and PipeDream's finite forms span two batches of m
    assert not schedule.has_comm
    for s, stage in enumerate(schedule.stages):
        assert all(a.stage == s for a in stage)
        assert sorted(a.microbatch for a in stage if a.kind is F) == list(range(m))
        # one backward per micro-batch: a B, or (zero bubble) an I then a W
        for kind in (
            (B,)
            if any(a.kind is B for a in stage)
            else (ActionKind.INPUT_GRAD, ActionKind.WEIGHT_GRAD)
        ):
            assert sorted(a.microbatch for a in stage if a.kind is kind) == list(range(m))
    validate(schedule)
    with_comm = add_communication(schedule)
    validate(with_comm)
    simulate(with_comm)  # no DeadlockError
    # One receive/send per forward and per backward (B or I) per neighbour; W needs none.
    for s, stage in enumerate(with_comm.stages):
        per_compute = (s > 0) + (s < p - 1)
        weights = sum(1 for a in stage if a.kind is ActionKind.WEIGHT_GRAD)
        assert len(stage) == 2 * m * (1 + per_compute) + weights
        assert all(a.stage == s for a in stage)


def flush_bubble(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


# Per registered schedule, for F=1, B=2, comm=0: (bubble fraction(p, m), peak(p, s, m)).
# A newly registered schedule must add its expectations here.
EXPECTED: dict[str, tuple[Callable[[int, int], float], Callable[[int, int, int], int]]] = {
    "gpipe": (flush_bubble, lambda p, s, m: m),
    "1f1b": (flush_bubble, lambda p, s, m: min(p - s, m)),
    # the finite 2BW schedule is 1F1B across two batches (2m micro-batches), flushed at the end
    "2bw": (lambda p, m: flush_bubble(p, 2 * m), lambda p, s, m: p - s),
    "pipedream": (lambda p, m: flush_bubble(p, 2 * m), lambda p, s, m: min(p - s, 2 * m)),
    # F = I = W = 1: 3m + p - 1 units at m >= p (a third of 1F1B's bubble); below, the last
    # micro-batch's forward and input-gradient chain (2m + 2p - 1); 1F1B's first-stage peak
    # on every stage
    "zb-h1": (lambda p, m: 1 - 3 * m / (3 * m + p - 1 + max(0, p - m)), lambda p, s, m: min(p, m)),
}


def test_every_registered_schedule_has_expectations() -> None:
    assert set(EXPECTED) == set(SCHEDULES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@FAST
@given(sizes)
def test_equal_costs_bubble_and_memory(name: str, pm: tuple[int, int]) -> None:
    p, m = pm
    assume(name != "2bw" or m >= p)
    bubble, peak = EXPECTED[name]
    schedule = get_schedule(name, p, m)
    n = schedule.num_microbatches
    result = simulate(schedule, Costs(forward=1.0, backward=2.0, comm=0.0))
    assert result.busy == (n * 3.0,) * p
    assert result.step_time == pytest.approx(n * 3.0 / (1 - bubble(p, m)), abs=1e-9)
    for fraction in (*result.bubble_fraction, result.mean_bubble_fraction):
        assert abs(fraction - bubble(p, m)) < 1e-9
    assert result.peak_activations == tuple(peak(p, s, m) for s in range(p))


def test_flush_step_time_formula() -> None:
    for name in ("gpipe", "1f1b"):
        for p, m in [(1, 1), (4, 8), (8, 32), (8, 3)]:
            assert simulate(get_schedule(name, p, m)).step_time == (m + p - 1) * 3.0


def test_forward_only() -> None:
    schedule = forward_only(3, 4)
    assert not schedule.training and "forward-only" in str(schedule)
    assert schedule.stages == parse_stages("0F0 0F1 0F2 0F3\n1F0 1F1 1F2 1F3\n2F0 2F1 2F2 2F3")
    validate(schedule)
    validate(add_communication(schedule))
    result = simulate(schedule)
    assert result.step_time == 4 + 3 - 1 and result.peak_activations == (0, 0, 0)
    with_backward = schedule.with_stages(
        [*schedule.stages[:2], (*schedule.stages[2], Action(2, B, 0))]
    )
    with pytest.raises(ScheduleError, match="backward in a forward-only") as info:
        validate(with_backward)
    assert "[2B0]" in str(info.value)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@FAST
@given(
    st.integers(1, 6),
    st.integers(1, 12),
    st.data(),
)
def test_timeline_consistent_for_random_costs(
    name: str, p: int, m: int, data: st.DataObject
) -> None:
    cost = st.floats(0.0, 5.0, allow_nan=False)
    costs = Costs(
        forward=data.draw(st.lists(cost, min_size=p, max_size=p)),
        backward=data.draw(st.lists(cost, min_size=p, max_size=p)),
        comm=data.draw(cost),
    )
    assume(name != "2bw" or m >= p)
    schedule = add_communication(get_schedule(name, p, m))
    result = simulate(schedule, costs)
    sends: dict[tuple[int, ActionKind, int], float] = {}
    for s, row in enumerate(result.timeline):
        assert tuple(a for a, _, _ in row) == schedule.stages[s]
        for (_, _, end), (_, start, _) in itertools.pairwise(row):
            assert start == end  # a stage never idles except inside a receive
        for a, start, end in row:
            assert 0.0 <= start <= end <= result.step_time
            if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                sends[(s, a.kind, a.microbatch)] = start
    for s, row in enumerate(result.timeline):
        for a, _, end in row:
            if a.kind is ActionKind.RECV_F:
                assert end >= sends[(s - 1, ActionKind.SEND_F, a.microbatch)] + costs.comm - 1e-9
            if a.kind is ActionKind.RECV_B:
                assert end >= sends[(s + 1, ActionKind.SEND_B, a.microbatch)] + costs.comm - 1e-9
    # One micro-batch must cross the whole pipeline forward and back (zero bubble: its
    # gradient travels back through the I, half of each B)
    split = any(a.kind is ActionKind.INPUT_GRAD for row in schedule.stages for a in row)
    fwd = costs.per_stage("forward", p)
    bwd = costs.per_stage("input_grad" if split else "backward", p)
    assert result.step_time >= sum(fwd) + sum(bwd) + 2 * (p - 1) * costs.comm - 1e-9


def test_simulate_hand_computed_costs() -> None:
    # F: 1 on stage 0, 3 on stage 1; B: 2; comm 0.5 -> 1 + .5 + 3 + 2 + .5 + 2
    result = simulate(gpipe(2, 1), Costs(forward=[1.0, 3.0], backward=2.0, comm=0.5))
    assert result.step_time == pytest.approx(9.0)
    assert result.busy == (3.0, 5.0)
    assert result.bubble_fraction == pytest.approx((1 - 3 / 9, 1 - 5 / 9))


def test_simulate_is_fast() -> None:
    schedule = one_f_one_b(8, 32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        simulate(schedule)
        best = min(best, time.perf_counter() - start)
    assert best < 0.05


# ----------------------------------------------------------------------------- validator errors


def test_backward_before_forward_is_marked() -> None:
    broken = make("broken", "0F0 0F1 0B0 0B1\n1B0 1F0 1F1 1B1", m=2)
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    message = str(info.value)
    assert "[1B0]" in message and "backward runs before its forward 1F0" in message
    assert "stage 1 [1B0]" in message  # the grid row with the marked cell


def test_missing_recv_is_marked() -> None:
    text = ONE_F_ONE_B_2_2_COMM.replace("1RECV_F1", "")
    with pytest.raises(ScheduleError) as info:
        validate(make("no-recv", text, m=2))
    message = str(info.value)
    assert "[0SEND_F1]" in message and "no matching 1RECV_F1 on stage 1" in message
    assert "[1F1]" in message and "no 1RECV_F1 before it" in message
    assert len(info.value.problems) == 2


def test_swapped_recv_order_violates_fifo() -> None:
    text = """
        0F0      0SEND_F0 0F1      0SEND_F1 0RECV_B0 0B0      0RECV_B1 0B1
        1RECV_F1 1F1      1RECV_F0 1F0      1B0      1SEND_B0 1B1      1SEND_B1
    """
    schedule = make("swapped", text, m=2)
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    assert "[1RECV_F1]" in str(info.value) and "FIFO" in str(info.value)
    with pytest.raises(ValueError, match="FIFO"):
        simulate(schedule)


def test_recv_before_send_deadlocks() -> None:
    text = """
        0F0      0RECV_B0 0SEND_F0 0B0
        1RECV_F0 1F0      1B0      1SEND_B0
    """
    schedule = make("deadlock", text, m=1)
    with pytest.raises(DeadlockError) as dead:
        simulate(schedule)
    assert dead.value.stuck == ((0, 1), (1, 0))
    assert "[0RECV_B0]" in str(dead.value) and "[1RECV_F0]" in str(dead.value)
    assert "stage 0 is stuck at slot 1 on 0RECV_B0: waits for 1SEND_B0" in str(dead.value)
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    assert "deadlock" in str(info.value) and "[0RECV_B0]" in str(info.value)


def test_compute_only_deadlock_is_found_after_add_communication() -> None:
    schedule = make("crossed", "0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1", m=2)
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    message = str(info.value)
    assert "after add_communication" in message and "deadlock" in message
    assert "[0RECV_B0]" in message and "[1RECV_F1]" in message


def test_validator_collects_all_problems() -> None:
    text = """
        0F0 0F0 0B0 0F1 0SEND_F1 0B1v1 0F5 1B9
        1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1B1 1SEND_B1
    """
    with pytest.raises(ScheduleError) as info:
        validate(make("messy", text, m=2))
    problems = "\n".join(info.value.problems)
    for fragment in (
        "duplicate F of micro-batch 0",
        "micro-batch 5 is out of range",
        "its stage field is 1 but it is listed under stage 0",
        "runs with weight version 1 but its forward 0F1 used None",
        "no 0SEND_F0 after it",
        "1SEND_F0): SEND_F needs stage 2, which does not exist",
        "stage 1: micro-batch 0 has no 1B0",
        "no matching 0RECV_B1 on stage 0",
    ):
        assert fragment in problems
    assert len(info.value.problems) >= 8


def test_misplaced_send_is_marked() -> None:
    text = ONE_F_ONE_B_2_2_COMM.replace("0F0      0SEND_F0", "0SEND_F0 0F0")
    with pytest.raises(ScheduleError, match=r"must come after 0F0") as info:
        validate(make("early-send", text, m=2))
    assert "[0SEND_F0]" in str(info.value)


# ----------------------------------------------------------------------------- user input


def test_unknown_schedule_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'gpip'") as info:
        get_schedule("gpip", 2, 2)
    assert "valid schedules: 'gpipe', '1f1b'" in str(info.value)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_registry_names_match(name: str) -> None:
    assert get_schedule(name, 2, 3).name == name


@pytest.mark.parametrize(
    ("p", "m", "pattern"),
    [
        (0, 4, "num_stages must be >= 1, got 0"),
        (2, 0, "num_microbatches must be >= 1, got 0"),
        (-1, 4, "num_stages must be >= 1, got -1"),
        (2.0, 4, "num_stages must be an int, got 2.0"),
    ],
)
def test_bad_sizes(p: int, m: int, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        get_schedule("1f1b", p, m)
    with pytest.raises(ValueError, match=pattern):
        gpipe(p, m)


def test_schedule_and_costs_input_errors() -> None:
    with pytest.raises(ValueError, match="has 1 action lists but num_stages=2"):
        Schedule("x", 2, 1, ((Action(0, F, 0),),))
    with pytest.raises(ValueError, match="already has communication actions"):
        add_communication(add_communication(gpipe(2, 1)))
    with pytest.raises(ValueError, match=r"cost backward\[1\] must be a finite number >= 0"):
        Costs(backward=[1.0, -2.0])
    with pytest.raises(ValueError, match=r"Costs\.forward has 3 entries but the schedule has 2"):
        simulate(gpipe(2, 1), Costs(forward=[1.0, 1.0, 1.0]))
