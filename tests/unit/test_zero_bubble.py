"""Backwards in two actions (``I``: the inputs' gradient, ``W``: the weights'): the IR, its
validator and simulator rules, the ``early_input_grad`` pass, and ZB-H1, whose order is a golden
literal here. Its runs, bitwise single-device gradient accumulation:
``tests/ranks/test_zero_bubble.py``."""

from __future__ import annotations

import pytest

from lightning_pipe2bw.schedule import (
    Costs,
    ScheduleError,
    add_communication,
    early_input_grads,
    gpipe,
    one_f_one_b,
    parse_actions,
    parse_stages,
    simulate,
    split_backward,
    validate,
    zb_h1,
)

ZB_H1_3x4 = parse_stages("""
    0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
    1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3
    2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3
""")


def test_zb_h1_golden() -> None:
    """Stage s runs 1F1B with each B cut in two and holds back s of its Ws."""
    assert zb_h1(3, 4).stages == ZB_H1_3x4


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 8), (8, 16), (8, 64), (16, 64)])
def test_zb_h1_has_a_third_of_1f1bs_bubble_at_its_memory(p: int, m: int) -> None:
    """At F = I = W (B = 2F) the step is 3m + p - 1 units against 1F1B's 3m + 3(p - 1): a
    bubble of (p - 1)(F + I - W), a third of 1F1B's; peak activations min(p, m) on every stage,
    1F1B's peak (on its first stage)."""
    costs = Costs(forward=1.0, backward=2.0)
    zb, flush = simulate(zb_h1(p, m), costs), simulate(one_f_one_b(p, m), costs)
    assert zb.step_time == 3 * m + p - 1
    assert flush.step_time == 3 * m + 3 * (p - 1)
    assert zb.step_time - 3 * m == pytest.approx((flush.step_time - 3 * m) / 3)
    assert zb.peak_activations == (min(p, m),) * p
    assert max(flush.peak_activations) == min(p, m)


def test_the_simulator_times_input_and_weight_gradients_apart() -> None:
    """I and W take their own costs (half of B each unless given); a W frees the activations."""
    sched = zb_h1(2, 2)
    result = simulate(sched, Costs(forward=1.0, backward=4.0, input_grad=3.0, weight_grad=1.0))
    durations = {str(a): end - start for row in result.timeline for a, start, end in row}
    assert (durations["1I0"], durations["1W0"], durations["0F0"]) == (3.0, 1.0, 1.0)
    halves = simulate(sched, Costs(forward=1.0, backward=4.0)).timeline
    assert {end - start for row in halves for a, start, end in row if a.kind.value in "IW"} == {2.0}


def test_the_early_input_grad_pass_cuts_the_backward_the_previous_stage_waits_for() -> None:
    """1F1B: each stage's last backward; GPipe: its first and its last; never on stage 0."""
    one = early_input_grads(add_communication(one_f_one_b(2, 3)))
    assert one.stages[0] == add_communication(one_f_one_b(2, 3)).stages[0]
    assert one.stages[1][-4:] == tuple(parse_actions("1RECV_F2 1F2 1I2 1SEND_B2 1W2")[1:])
    pipe = early_input_grads(add_communication(gpipe(2, 3)))
    assert pipe.stages[1][6:] == tuple(
        parse_actions("1I0 1SEND_B0 1W0 1B1 1SEND_B1 1I2 1SEND_B2 1W2")
    )
    validate(one)
    validate(pipe)
    with pytest.raises(ValueError, match="run add_communication first"):
        early_input_grads(one_f_one_b(2, 3))
    with pytest.raises(ValueError, match="not a backward"):
        split_backward(pipe.stages[1], 0)


@pytest.mark.parametrize(
    ("stage1", "message"),
    [
        ("1F0 1I0", "no 1W0 computes the weights' gradients; insert one after it"),
        ("1F0 1W0", "no 1I0 computes the inputs' gradient; insert one before it"),
        ("1F0 1W0 1I0", "runs before its 1I0 .*a W follows its I"),
        ("1F0 1B0 1I0 1W0", "also has a whole backward 1B0"),
        ("1I0 1W0 1F0", "backward runs before its forward 1F0"),
    ],
)
def test_the_validator_checks_input_and_weight_gradients(stage1: str, message: str) -> None:
    stages = [parse_actions("0F0 0B0"), parse_actions(stage1)]
    with pytest.raises(ScheduleError, match=message):
        validate(zb_h1(2, 1).with_stages(stages))
