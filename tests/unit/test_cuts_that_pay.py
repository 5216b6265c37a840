"""Zero bubble's cut backwards kept only where they pay (``schedule.cuts_that_pay``): a cut costs
something of its own (``CUT_OVERHEAD``), so a ``W`` deferred where no wait is filled makes the
step longer. Its runs (every ``I`` the list keeps is cut, bitwise single-device gradient
accumulation): ``tests/ranks/test_zero_bubble.py``, ``tests/ranks/test_virtual_stages.py``."""

from __future__ import annotations

import pytest

from lightning_pipe2bw.schedule import (
    ActionKind,
    Costs,
    cut_overhead,
    cuts_that_pay,
    merge_backward,
    simulate,
    split_backward,
    training_schedule,
    validate,
)

CPU = Costs(input_grad=1.2, weight_grad=1.2)  # CUT_OVERHEAD["cpu"]: I + W = 1.2 B


def _cuts(schedule: object) -> int:
    return sum(a.kind is ActionKind.INPUT_GRAD for st in schedule.stages for a in st)  # type: ignore[attr-defined]


def test_merge_undoes_a_split() -> None:
    actions = list(training_schedule("1f1b", 2, 4, early_input_grad=False).stages[1])
    slot = next(n for n, a in enumerate(actions) if a.kind is ActionKind.BACKWARD)
    assert merge_backward(split_backward(actions, slot), slot) == actions
    with pytest.raises(ValueError, match="not an inputs' gradient"):
        merge_backward(actions, 0)


@pytest.mark.parametrize("m", [2, 4, 8, 16])
def test_at_two_stages_zb_h1_keeps_one_cut_and_runs_as_1f1b(m: int) -> None:
    """At p = 2 ZB-H1's steady state keeps both stages busy as 1F1B's does: its deferred Ws fill
    no wait, so with a cut's price only the last backward's cut is left (at m = 2 the first's
    too), and the step is at most 1F1B's (which cuts the last one too: ``early_input_grads``),
    shorter than with every cut."""
    every = training_schedule("zb-h1", 2, m)
    paid = training_schedule("zb-h1", 2, m, cut_overhead=cut_overhead("cpu"))
    validate(paid)
    assert _cuts(paid) == (1 if m > 2 else 2) < _cuts(every)  # m = p: the first one pays too
    one_f_one_b = simulate(training_schedule("1f1b", 2, m), CPU).step_time
    assert simulate(paid, CPU).step_time <= one_f_one_b + 1e-9
    assert simulate(paid, CPU).step_time < simulate(every, CPU).step_time


@pytest.mark.parametrize("name", ["zb-h1", "zb-v", "dualpipe-v"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 8), (4, 16), (8, 32)])
def test_the_step_is_never_longer_than_with_every_cut(name: str, p: int, m: int) -> None:
    if name == "dualpipe-v" and m < 2 * p:
        pytest.skip("DualPipeV needs as many micro-batches as stages")
    every = training_schedule(name, p, m)
    paid = cuts_that_pay(every, CPU)
    validate(paid)
    assert simulate(paid, CPU).step_time <= simulate(every, CPU).step_time + 1e-9
    assert _cuts(paid) <= _cuts(every)


def test_where_the_cuts_fill_the_cool_down_they_stay() -> None:
    """At p = 4 ZB-H1's deferred Ws fill the cool-down's waits: most cuts stay, and the step
    stays shorter than 1F1B's at the same price per cut; a free cut (I + W = B) is never
    merged where it shortens the step."""
    paid = training_schedule("zb-h1", 4, 8, cut_overhead=cut_overhead("cpu"))
    assert _cuts(paid) > 8
    assert simulate(paid, CPU).step_time < simulate(training_schedule("1f1b", 4, 8), CPU).step_time
    free = Costs()
    every = training_schedule("zb-h1", 4, 8)
    kept = cuts_that_pay(every, free)
    assert simulate(kept, free).step_time == pytest.approx(simulate(every, free).step_time)


def test_a_schedule_without_cuts_is_left_as_it_is() -> None:
    sched = training_schedule("1f1b", 4, 8, cut_overhead=cut_overhead("cpu"))
    assert sched == training_schedule("1f1b", 4, 8)


@pytest.mark.parametrize("name", ["zb-h1", "zb-v", "dualpipe-v"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (4, 16), (8, 32)])
def test_every_stage_still_adds_its_weights_gradients_in_micro_batch_order(
    name: str, p: int, m: int
) -> None:
    """What keeps a zero-bubble run bitwise one device's: each stage's B and W come in
    micro-batch order, with every cut and after the pass."""
    if name == "dualpipe-v" and m < 2 * p:
        pytest.skip("DualPipeV needs as many micro-batches as stages")
    for sched in (training_schedule(name, p, m), training_schedule(name, p, m, cut_overhead=cut_overhead("cpu"))):
        for actions in sched.stages:
            order: dict[int, list[int]] = {}
            for a in actions:
                if a.kind in (ActionKind.BACKWARD, ActionKind.WEIGHT_GRAD):
                    order.setdefault(a.stage, []).append(a.microbatch)
            assert all(seq == sorted(seq) for seq in order.values()), order


def test_the_price_of_a_cut_can_be_given_or_every_cut_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cut_overhead("cpu") == 0.2 and cut_overhead("cuda") == 0.05
    monkeypatch.setenv("PIPE2BW_CUT_OVERHEAD", "0.5")
    assert cut_overhead("cuda") == 0.5
    monkeypatch.setenv("PIPE2BW_CUT_OVERHEAD", "keep")
    assert cut_overhead("cpu") is None
    every = training_schedule("zb-h1", 2, 8)
    assert training_schedule("zb-h1", 2, 8, cut_overhead=cut_overhead("cpu")) == every
    monkeypatch.setenv("PIPE2BW_CUT_OVERHEAD", "-1")
    with pytest.raises(ValueError, match=r"PIPE2BW_CUT_OVERHEAD='-1'.*a number >= 0"):
        cut_overhead("cpu")


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "dualpipe-v"])
def test_one_rank_builds_every_flushed_list(name: str) -> None:
    # devices=1: every stage on the one rank, so nothing is sent and the early pass has nothing
    # to move (it refused such a list, and a V on one process failed at its first batch)
    built = training_schedule(name, 1, 4, cut_overhead=cut_overhead("cpu"))
    assert len(built.stages) == 1 and not built.has_comm
    validate(built)
    forwards = [a for a in built.stages[0] if a.kind is ActionKind.FORWARD]
    assert len(forwards) == 4 * built.num_stages  # every micro-batch through every stage
