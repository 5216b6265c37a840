"""PlanCheck: the throughput a run measures against the plan's prediction (pure: fed times)."""

from __future__ import annotations

import time

from lightning_pipe2bw.planner.autoplan import PlanCheck


def test_the_measured_rate_is_samples_over_the_measured_steps() -> None:
    check = PlanCheck(predicted=100.0, skip=2, span=4)
    lines = []
    start = time.perf_counter()
    for step in range(8):
        lines.append(check.step(step, 10))
        time.sleep(0.02)
    reported = [line for line in lines if line is not None]
    assert len(reported) == 1  # once, after span steps
    assert check.result is not None
    elapsed = time.perf_counter() - start
    # 4 steps of 10 samples, each about 20 ms: about 500 samples/s, certainly under 40 / 0.08
    assert 0 < check.result["measured"] <= 40 / 0.08 * 1.01
    assert check.result["measured"] >= 40 / elapsed  # never more time than the whole loop
    assert check.result["ratio"] == check.result["measured"] / 100.0
    assert "predicted 100.0 samples/s for its plan; measured" in reported[0]
    assert check.finish() is None  # reported already


def test_a_short_fit_reports_at_its_end_and_a_too_short_one_not_at_all() -> None:
    check = PlanCheck(predicted=50.0, skip=0, span=20)
    for step in range(5):
        assert check.step(step, 4) is None
        time.sleep(0.01)
    line = check.finish()
    assert line is not None and "over 5 steps" in line
    tiny = PlanCheck(predicted=50.0, skip=0, span=20)
    tiny.step(0, 4)
    tiny.step(1, 4)
    assert tiny.finish() is None and tiny.result is None
