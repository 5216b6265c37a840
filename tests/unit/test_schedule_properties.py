"""Property-based tests of the schedule generators: validity, simulation, order, memory, versions.

Every check is a plain function that raises ``AssertionError``; the property tests run them on
generated schedules and the mutation tests at the bottom feed them deliberately broken ones, so
each property is shown to fail when a generator drops a backward, reorders work or mislabels a
weight version.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from lightning_pipe2bw.schedule import (
    SCHEDULES,
    Action,
    ActionKind,
    Costs,
    OneFOneBStream,
    Schedule,
    ScheduleError,
    SimResult,
    add_communication,
    forward_only,
    get_schedule,
    pipedream,
    simulate,
    two_bw,
    two_bw_version,
    validate,
)

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
IG, W = ActionKind.INPUT_GRAD, ActionKind.WEIGHT_GRAD
PROPS = settings(max_examples=60, deadline=None, database=None)
MUTANTS = settings(max_examples=20, deadline=None, database=None)

# Every registered training schedule, plus the evaluation schedule (not in SCHEDULES).
NAMES = [*sorted(SCHEDULES), "forward"]
BATCHED: dict[str, Callable[[int, int, int], Schedule]] = {"2bw": two_bw, "pipedream": pipedream}

stages_st = st.integers(1, 8)
microbatches_st = st.integers(1, 32)
batches_st = st.integers(1, 4)
cost_st = st.floats(0.01, 10.0, allow_nan=False, allow_infinity=False)
comm_st = st.floats(0.0, 5.0, allow_nan=False, allow_infinity=False)
per_stage_st = st.lists(cost_st, min_size=8, max_size=8)  # stage s uses entry s (p <= 8)


EDGES = [(1, 1, 1), (8, 32, 4), (8, 32, 1), (5, 5, 3), (8, 8, 2), (8, 1, 4)]


def edge_cases(**extra: object) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """p=1, m=1; p=8, m=32; m=p; and m < p (skipped by 2BW's precondition)."""

    def decorate(test: Callable[..., None]) -> Callable[..., None]:
        for p, m, batches in EDGES:
            test = example(p=p, m=m, batches=batches, **extra)(test)
        return test

    return decorate


def accepts(name: str, p: int, m: int) -> bool:
    """The generator's precondition (2BW needs m >= p); see the precondition tests below."""
    return name != "2bw" or m >= p


def build(name: str, p: int, m: int, batches: int) -> Schedule:
    """The finite schedule ``name``; 2BW and PipeDream span ``batches`` batches of m."""
    if name == "forward":
        return forward_only(p, m)
    if name in BATCHED:
        return BATCHED[name](p, m, batches)
    return get_schedule(name, p, m)


# ----------------------------------------------------------------------------- checks


def split(schedule: Schedule) -> bool:
    """Whether the schedule runs its backwards as I then W (zero-bubble) rather than B."""
    return any(a.kind is IG for actions in schedule.stages for a in actions)


def check_counts(schedule: Schedule) -> None:
    """Exactly one F (and, if training, one B, or one I and one W) per micro-batch on every
    stage, F before B (F before I before W)."""
    n = schedule.num_microbatches
    backward = (IG, W) if split(schedule) else (B,)
    for s, actions in enumerate(schedule.stages):
        assert all(a.stage == s and a.is_compute for a in actions), f"stage {s}: {actions}"
        counts = Counter((a.kind, a.microbatch) for a in actions)
        expected = Counter({(F, k): 1 for k in range(n)})
        if schedule.training:
            expected.update({(kind, k): 1 for k in range(n) for kind in backward})
        lost = sorted(f"{s}{kind.value}{k}" for kind, k in expected - counts)
        extra = sorted(f"{s}{kind.value}{k}" for kind, k in counts - expected)
        assert not lost and not extra, f"stage {s}: lost {lost}, extra {extra}"
        slot = {(a.kind, a.microbatch): i for i, a in enumerate(actions)}
        for k in range(n if schedule.training else 0):
            order = [slot[(F, k)]] + [slot[(kind, k)] for kind in backward]
            assert order == sorted(order), f"stage {s}: {backward[0].value}{k} before F{k}"


def check_timeline(schedule: Schedule, result: SimResult, costs: Costs) -> None:
    """Simulated times: durations match the costs, F before B on a stage, F on s after F on
    s - 1 (plus latency), B on s after B on s + 1 (plus latency), and the makespan is at least
    every stage's compute plus the pipeline fill before it and the drain after it."""
    p, n = schedule.num_stages, schedule.num_microbatches
    fwd, bwd = costs.per_stage("forward", p), costs.per_stage("backward", p)
    cost_of = {
        F: fwd,
        B: bwd,
        IG: costs.per_stage("input_grad", p),
        W: costs.per_stage("weight_grad", p),
    }
    # the backward that sends the gradient on: B, or I in a zero-bubble schedule
    B_ = IG if split(schedule) else B
    tol = 1e-9 * (1.0 + result.step_time)
    span: dict[tuple[int, ActionKind, int], tuple[float, float]] = {}
    for s, row in enumerate(result.timeline):
        for action, start, end in row:
            if action.is_compute:
                assert (s, action.kind, action.microbatch) not in span, f"{action} ran twice"
                span[(s, action.kind, action.microbatch)] = (start, end)
                cost = cost_of[action.kind][s]
                assert end - start == pytest.approx(cost), f"{action} took {end - start}"
    if not schedule.training:
        kinds: tuple[ActionKind, ...] = (F,)
    else:
        kinds = (F, IG, W) if split(schedule) else (F, B)
    assert set(span) == {(s, kind, k) for s in range(p) for kind in kinds for k in range(n)}
    for s in range(p):
        for k in range(n):
            start, _ = span[(s, F, k)]
            if s > 0:
                _, upstream = span[(s - 1, F, k)]
                assert start >= upstream + costs.comm - tol, f"{s}F{k} before {s - 1}F{k} arrived"
            if not schedule.training:
                continue
            _, forward_end = span[(s, F, k)]
            start, _ = span[(s, B_, k)]
            assert start >= forward_end - tol, f"{s}{B_.value}{k} starts before {s}F{k} ends"
            if s < p - 1:
                _, downstream = span[(s + 1, B_, k)]
                assert start >= downstream + costs.comm - tol, (
                    f"{s}{B_.value}{k} before {s + 1}{B_.value}{k}"
                )
            if B_ is IG:
                _, input_end = span[(s, IG, k)]
                assert span[(s, W, k)][0] >= input_end - tol, f"{s}W{k} before {s}I{k} ends"
    train = schedule.training
    busy = [n * (fwd[s] + (bwd[s] if train else 0.0)) for s in range(p)]
    assert result.busy == pytest.approx(busy)
    assert result.step_time >= max(busy) - tol
    for s in range(p):
        fill = sum(fwd[:s]) + s * costs.comm
        if train and B_ is IG:  # the last I on s must still travel back to stage 0; the Ws
            last_input = max(span[(s, IG, k)][1] for k in range(n))  # need not come last
            drain = sum(cost_of[IG][:s]) + s * costs.comm
            assert result.step_time >= last_input + drain - tol, f"stage {s}"
            drain = 0.0
        elif train:  # the last B on s must still travel back to stage 0
            drain = sum(bwd[:s]) + s * costs.comm
        else:  # the last F on s must still reach the last stage
            drain = sum(fwd[s + 1 :]) + (p - 1 - s) * costs.comm
        assert result.step_time >= fill + busy[s] + drain - tol, f"stage {s}"


def expected_peak(name: str, p: int, s: int, n: int) -> int:
    """Documented in-flight micro-batches on stage s of a finite schedule over n micro-batches:
    GPipe keeps all n; the 1F1B family min(p - s, n) (min(p - s - 1, n) warm-up forwards + one);
    2BW's m >= p makes that p - s. ZB-H1 holds back s Ws on stage s: min(p, n) on every stage
    (1F1B's peak, on its first stage). Forward-only keeps none."""
    if name == "forward":
        return 0
    if name == "zb-h1":
        return min(p, n)
    return n if name == "gpipe" else min(p - s, n)


def check_peaks(name: str, schedule: Schedule, result: SimResult) -> None:
    """The simulator's peak activations equal the documented bound and the count from the lists."""
    p, n = schedule.num_stages, schedule.num_microbatches
    for s, actions in enumerate(schedule.stages):
        held = peak = 0
        for a in actions:
            if schedule.training:
                held += {F: 1, B: -1, W: -1}.get(a.kind, 0)
            peak = max(peak, held)
        assert peak == result.peak_activations[s], f"stage {s}: simulator disagrees ({peak})"
    expected = tuple(expected_peak(name, p, s, n) for s in range(p))
    got = result.peak_activations
    assert got == expected, f"peak activations {got}, documented {expected}"


# ----------------------------------------------------------------------------- weight versions
#
# Version v is a stage's weights after v updates; a stage applies batch t's update once it has
# run all m backwards of batch t (PipeDream and, at the earliest, 2BW), so "newest" at a point
# is the number of batches completed on that stage. A version is live from the first forward
# that uses it until the last backward that uses it; the newest weights are always live.


def stashed_versions(actions: tuple[Action, ...], m: int) -> list[int | None]:
    """PipeDream weight stashing: a forward takes the stage's newest weights, its backward the
    same (stashed) version."""
    newest, done, of = 0, Counter[int](), {}
    out: list[int | None] = []
    for a in actions:
        if a.kind is F:
            of[a.microbatch] = newest
        out.append(of.get(a.microbatch))
        if a.kind is B:
            done[a.microbatch // m] += 1
            newest += done[a.microbatch // m] == m
    return out


def version_trace(
    actions: tuple[Action, ...], versions: list[int | None], m: int
) -> list[tuple[int, set[int]]]:
    """Per action: (the newest version before it, the versions live during or right after it).

    During an action the version it uses and the newest before it are live; right after a
    batch's last backward that batch's version is released and the update's result is newest.
    """
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, (a, v) in enumerate(zip(actions, versions, strict=True)):
        if v is not None and a.kind is F:
            first.setdefault(v, i)
        if v is not None and a.kind is B:
            last[v] = i
    newest, done = 0, Counter[int]()
    out: list[tuple[int, set[int]]] = []
    for i, a in enumerate(actions):
        during = {v for v, f in first.items() if f <= i <= last.get(v, f)} | {newest}
        before = newest
        if a.kind is B:
            done[a.microbatch // m] += 1
            newest += done[a.microbatch // m] == m
        after = {v for v, f in first.items() if f <= i < last.get(v, f)} | {newest}
        out.append((before, max(during, after, key=len)))
    return out


def check_versions(name: str, schedule: Schedule, m: int) -> None:
    """2BW: actions carry two_bw_version, which exists on the stage when a forward needs it, is
    at most one update stale, and at most 2 versions are live. PipeDream: stage s never needs
    more than p - s versions. Flush schedules carry no version (one set of weights)."""
    p = schedule.num_stages
    if name not in BATCHED:
        assert all(a.version is None for row in schedule.stages for a in row)
        return
    for s, actions in enumerate(schedule.stages):
        if name == "2bw":
            versions = [a.version for a in actions]
            bound = 2
        else:
            assert all(a.version is None for a in actions), "PipeDream decides versions at run time"
            versions = stashed_versions(actions, m)
            # p - s as documented, and tighter for m > 1: past the warm-up, F(k) runs with
            # version (k - w) // m (w = p - s - 1), and the in-flight ids span at most w + 1.
            bound = min(p - s, 1 + math.ceil((p - s - 1) / m))
        trace = version_trace(actions, versions, m)
        for i, ((newest, live), a, v) in enumerate(zip(trace, actions, versions, strict=True)):
            where = f"stage {s}, slot {i} ({a}, version {v}, newest {newest})"
            assert v is not None
            if a.kind is F:
                assert v <= newest, f"{where}: forward uses weights not produced yet"
                if name == "2bw":
                    assert newest - v <= 1, f"{where}: more than one update stale"
            assert len(live) <= bound, (
                f"{where}: {len(live)} live versions {sorted(live)} > {bound}"
            )
        if name == "2bw":  # the exact rule, after the structural checks above
            assert versions == [two_bw_version(a.microbatch, m) for a in actions], f"stage {s}"


# ----------------------------------------------------------------------------- properties


@pytest.mark.parametrize("name", NAMES)
@PROPS
@edge_cases()
@given(p=stages_st, m=microbatches_st, batches=batches_st)
def test_validator_passes(name: str, p: int, m: int, batches: int) -> None:
    assume(accepts(name, p, m))
    schedule = build(name, p, m, batches)
    assert (schedule.name, schedule.num_stages) == (name, p)
    assert schedule.num_microbatches == (batches * m if name in BATCHED else m)
    assert schedule.training == (name != "forward")
    assert not schedule.has_comm
    validate(schedule)
    with_comm = add_communication(schedule)
    assert with_comm.has_comm or p == 1
    validate(with_comm)
    if name in SCHEDULES:  # the registry builds what the generator builds (default batches: 2)
        assert get_schedule(name, p, m) == (BATCHED[name](p, m, 2) if name in BATCHED else schedule)


@pytest.mark.parametrize("name", NAMES)
@PROPS
@edge_cases(fwd=[1.0] * 8, bwd=[2.0] * 8, comm=0.0)
@edge_cases(fwd=[0.01, 10.0] * 4, bwd=[10.0, 0.01] * 4, comm=5.0)
@given(
    p=stages_st,
    m=microbatches_st,
    batches=batches_st,
    fwd=per_stage_st,
    bwd=per_stage_st,
    comm=comm_st,
)
def test_simulation_with_random_costs(
    name: str, p: int, m: int, batches: int, fwd: list[float], bwd: list[float], comm: float
) -> None:
    """No deadlock, the dependency order holds in time, the makespan is at least the busiest
    stage's compute, and peak activations match the documented bound."""
    assume(accepts(name, p, m))
    schedule = build(name, p, m, batches)
    costs = Costs(forward=fwd[:p], backward=bwd[:p], comm=comm)
    result = simulate(schedule, costs)  # raises DeadlockError on a deadlock
    assert result == simulate(add_communication(schedule), costs)
    check_counts(schedule)
    check_timeline(schedule, result, costs)
    check_peaks(name, schedule, result)


@pytest.mark.parametrize("name", NAMES)
@PROPS
@edge_cases()
@given(p=stages_st, m=microbatches_st, batches=st.integers(1, 6))
def test_weight_versions(name: str, p: int, m: int, batches: int) -> None:
    assume(accepts(name, p, m))
    check_versions(name, build(name, p, m, batches), m)


@PROPS
@example(p=8, batches=14)
@given(p=stages_st, batches=st.integers(1, 16))
def test_stashing_with_one_microbatch_reaches_the_bound(p: int, batches: int) -> None:
    """With m = 1 (an update after every micro-batch) the bound p - s is reached on stage s once
    the w = p - s - 1 warm-up forwards (all on version 0) are followed by w more, each on its own
    version: from 2w micro-batches on. So the bound is tight, not only an upper bound."""
    schedule = pipedream(p, 1, batches)
    for s, actions in enumerate(schedule.stages):
        trace = version_trace(actions, stashed_versions(actions, 1), 1)
        most = max(len(live) for _, live in trace)
        assert most == p - s if batches >= 2 * (p - s - 1) else most <= p - s, f"stage {s}"


@PROPS
@given(p=stages_st, m=microbatches_st, batches=st.integers(3, 6))
def test_two_bw_uses_two_versions(p: int, m: int, batches: int) -> None:
    """From the third batch on, 2BW really holds two versions on every stage (bound is tight)."""
    assume(m >= p)
    schedule = two_bw(p, m, batches)
    for actions in schedule.stages:
        trace = version_trace(actions, [a.version for a in actions], m)
        assert max(len(live) for _, live in trace) == 2


# ----------------------------------------------------------------------------- preconditions


def below(lowest: int, gap: int) -> st.SearchStrategy[tuple[int, int]]:
    """(p, m) with lowest <= p <= 8 and 1 <= m <= p - gap."""
    return st.integers(lowest, 8).flatmap(lambda p: st.tuples(st.just(p), st.integers(1, p - gap)))


@PROPS
@example(pm=(2, 1))
@example(pm=(8, 7))
@given(pm=below(2, 1))
def test_two_bw_rejects_fewer_microbatches_than_stages(pm: tuple[int, int]) -> None:
    p, m = pm
    message = rf"m >= p\), got m={m} for p={p}; use microbatches={p} or more"
    with pytest.raises(ValueError, match=message):
        two_bw(p, m)
    with pytest.raises(ValueError, match=message):
        get_schedule("2bw", p, m)


@pytest.mark.parametrize("name", NAMES)
@PROPS
@given(
    st.tuples(st.integers(-3, 0), st.integers(-3, 32)) | st.tuples(stages_st, st.integers(-3, 0))
)
def test_nonpositive_sizes_are_rejected(name: str, pm: tuple[int, int]) -> None:
    p, m = pm  # the sizes are checked first, so 2BW says this rather than "m >= p"
    label, value = ("num_stages", p) if p < 1 else ("num_microbatches", m)
    with pytest.raises(ValueError, match=f"{label} must be >= 1, got {value}; "):
        build(name, p, m, 2)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [2.0, True, "2", None])
def test_non_int_sizes_are_rejected(name: str, bad: object) -> None:
    for p, m in ((bad, 4), (4, bad)):
        with pytest.raises(ValueError, match=rf"must be an int, got {bad!r}"):
            build(name, p, m, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(BATCHED))
@pytest.mark.parametrize("bad", [0, -1, 1.0, True, None])
def test_bad_num_batches_is_rejected(name: str, bad: object) -> None:
    with pytest.raises(ValueError, match=rf"num_batches must be a positive int, got {bad!r}"):
        BATCHED[name](2, 2, bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- mutation tests
#
# Each property must fail on a broken generator. These build plausible bugs out of a correct
# schedule and show which check catches them.


def replace_stage(schedule: Schedule, s: int, actions: list[Action]) -> Schedule:
    return schedule.with_stages([*schedule.stages[:s], actions, *schedule.stages[s + 1 :]])


def drop_backward(schedule: Schedule, s: int, k: int) -> Schedule:
    """Drop B(k) on stage s (a zero-bubble schedule: its W(k), the weights' gradients)."""
    kind = W if split(schedule) else B
    actions = [a for a in schedule.stages[s] if (a.kind, a.microbatch) != (kind, k)]
    return replace_stage(schedule, s, actions)


def backward_first(schedule: Schedule, s: int) -> Schedule:
    """Move B0 (I0) on stage s right before F0 (the order of the Fs and of the Bs is kept)."""
    actions = list(schedule.stages[s])
    kind = IG if split(schedule) else B
    j = next(j for j, a in enumerate(actions) if (a.kind, a.microbatch) == (kind, 0))
    b0 = actions.pop(j)
    actions.insert(next(i for i, a in enumerate(actions) if (a.kind, a.microbatch) == (F, 0)), b0)
    return replace_stage(schedule, s, actions)


def early_forward(schedule: Schedule, s: int, last: bool = False) -> Schedule | None:
    """Swap the first (or last) backward-forward pair on stage s: one more micro-batch in
    flight, as if the warm-up had one forward too many."""
    actions = list(schedule.stages[s])
    pairs = [i for i in range(len(actions) - 1) if (actions[i].kind, actions[i + 1].kind) == (B, F)]
    if not pairs:
        return None
    i = pairs[-1 if last else 0]
    actions[i], actions[i + 1] = actions[i + 1], actions[i]
    return replace_stage(schedule, s, actions)


def reverse_stages(schedule: Schedule) -> Schedule:
    """Stage s runs what stage p - 1 - s should."""
    return schedule.with_stages(
        [Action(s, a.kind, a.microbatch, a.version) for a in actions]
        for s, actions in enumerate(reversed(schedule.stages))
    )


def relabel(schedule: Schedule, version: Callable[[int], int | None]) -> Schedule:
    return schedule.with_stages(
        [Action(a.stage, a.kind, a.microbatch, version(a.microbatch)) for a in actions]
        for actions in schedule.stages
    )


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@MUTANTS
@given(p=stages_st, m=microbatches_st, data=st.data())
def test_dropped_backward_is_caught(name: str, p: int, m: int, data: st.DataObject) -> None:
    assume(accepts(name, p, m))
    schedule = build(name, p, m, 2)
    s = data.draw(st.integers(0, p - 1), label="stage")
    k = data.draw(st.integers(0, schedule.num_microbatches - 1), label="microbatch")
    broken = drop_backward(schedule, s, k)
    kind = "W" if split(schedule) else "B"
    with pytest.raises(AssertionError, match=rf"lost \['{s}{kind}{k}'\], extra \[\]"):
        check_counts(broken)
    message = f"no {s}W{k} computes the weights'" if kind == "W" else f"{k} has no {s}B{k}"
    with pytest.raises(ScheduleError, match=message):
        validate(broken)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@MUTANTS
@given(p=stages_st, m=microbatches_st, costs=cost_st)
def test_backward_before_forward_is_caught(name: str, p: int, m: int, costs: float) -> None:
    assume(accepts(name, p, m))
    broken = backward_first(build(name, p, m, 2), p - 1)  # the last stage needs no gradient in
    kind = "I" if split(broken) else "B"
    with pytest.raises(AssertionError, match=f"{kind}0 before"):
        check_counts(broken)
    cost = Costs(forward=costs, backward=costs)
    with pytest.raises(AssertionError, match=f"{p - 1}{kind}0 starts before {p - 1}F0 ends"):
        check_timeline(broken, simulate(broken, cost), cost)
    with pytest.raises(ScheduleError, match="backward runs before its forward"):
        validate(broken)


@pytest.mark.parametrize("name", ["1f1b", "2bw", "pipedream"])
@MUTANTS
@given(p=st.integers(2, 8), m=microbatches_st, data=st.data())
def test_extra_warmup_forward_is_caught(name: str, p: int, m: int, data: st.DataObject) -> None:
    assume(accepts(name, p, m))
    schedule = build(name, p, m, 2)
    s = data.draw(st.integers(0, p - 1), label="stage")
    broken = early_forward(schedule, s)
    assume(broken is not None)  # every B is followed by the drain: no steady state on stage s
    assert broken is not None
    result = simulate(broken)
    with pytest.raises(AssertionError, match="documented"):
        check_peaks(name, broken, result)
    assert result.peak_activations[s] == expected_peak(name, p, s, schedule.num_microbatches) + 1


@pytest.mark.parametrize("name", ["1f1b", "2bw", "pipedream"])
@MUTANTS
@given(p=st.integers(2, 8), m=st.integers(2, 32))
def test_reordered_stages_are_caught(name: str, p: int, m: int) -> None:
    assume(accepts(name, p, m))
    broken = reverse_stages(build(name, p, m, 2))
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(broken)


@MUTANTS
@given(p=st.integers(2, 8), m=microbatches_st, batches=st.integers(2, 6))
def test_two_bw_without_delay_is_caught(p: int, m: int, batches: int) -> None:
    """Batch t running with version t (no one-step delay) needs weights not produced yet."""
    assume(m >= p)
    broken = relabel(two_bw(p, m, batches), lambda k: k // m)
    validate(broken)  # per-stage F/B versions agree, so only the version check sees it
    with pytest.raises(AssertionError, match="forward uses weights not produced yet"):
        check_versions("2bw", broken, m)


@MUTANTS
@given(p=st.integers(2, 8), m=microbatches_st, batches=st.integers(4, 6))
def test_two_bw_with_two_step_delay_is_caught(p: int, m: int, batches: int) -> None:
    """Batch t on version t - 2 keeps three versions live on stage 0."""
    assume(m >= p)
    broken = relabel(two_bw(p, m, batches), lambda k: max(k // m - 2, 0))
    trace = version_trace(broken.stages[0], [a.version for a in broken.stages[0]], m)
    assert max(len(live) for _, live in trace) == 3
    with pytest.raises(AssertionError, match=r"more than one update stale|live versions"):
        check_versions("2bw", broken, m)


@MUTANTS
@given(pm=below(3, 2), batches=st.integers(3, 5))
def test_two_bw_stream_below_precondition_is_caught(pm: tuple[int, int], batches: int) -> None:
    """What 2BW's m >= p guards against: with m < p - 1 stage 0 would forward batch 2 before
    batch 0's update exists (m = p - 1 happens to work for the schedule alone)."""
    p, m = pm
    n = batches * m
    stages = []
    for s in range(p):
        stream = OneFOneBStream(s, p, lambda k: two_bw_version(k, m))
        stages.append((*stream.window(n), *stream.drain()))
    unchecked = Schedule("2bw", p, n, tuple(stages))  # what two_bw(p, m, batches) refuses
    with pytest.raises(AssertionError, match="forward uses weights not produced yet"):
        check_versions("2bw", unchecked, m)


@MUTANTS
@given(p=st.integers(2, 8), extra=st.integers(0, 4))
def test_stashing_with_extra_warmup_is_caught(p: int, extra: int) -> None:
    """Stage 0 with a warm-up of p forwards (one too many) and m = 1: once every in-flight
    micro-batch has its own version (see the tightness test above) it needs p + 1 versions."""
    n = 2 * p + extra
    stream = OneFOneBStream(-1, p)  # the stream of a stage "before" stage 0: warm-up p
    wide = [Action(0, a.kind, a.microbatch) for a in (*stream.window(n), *stream.drain())]
    broken = replace_stage(pipedream(p, 1, n), 0, wide)
    with pytest.raises(AssertionError, match=f"live versions .* > {p}"):
        check_versions("pipedream", broken, 1)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flush_schedule_with_versions_is_caught(name: str) -> None:
    broken = relabel(get_schedule(name, 3, 4), lambda k: k // 2)
    validate(broken)
    with pytest.raises(AssertionError):
        check_versions(name, broken, 4)
