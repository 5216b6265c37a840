"""Time to a target loss: how many steps a schedule's update rule needs to reach the loss that
one device's gradient accumulation reaches in a given number (its step multiplier), measured;
a plan's time to the target is its step time times that, so plans of different schedules are
ranked by their throughput over their multiplier.

Every flushed schedule trains one device's gradient accumulation (1.0 by definition). 2BW's
one-step delay and its remedies were measured on the main job's GPT with ``MuonAdamW``, the
optimizer that tolerates the delay best (``benchmarks/step_multiplier.py``: each best recipe
trained for 1.25, 1.5 and 2 times the flushed run's steps, each with its own learning-rate
schedule, with and without a short synchronous start; ``docs/pipedream-2bw.md``, "Which
schedule at which depth"). Weight stashing (PipeDream) was not measured: its gradients are up
to p - 1 steps late, so it ranks after every measured schedule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from lightning_pipe2bw.schedule import schedule_spec

__all__ = ["STEP_MULTIPLIERS", "step_multiplier"]

# by the schedule's delay rule (``ScheduleSpec.delay``): the steps to the flushed run's final
# loss over the flushed run's steps; "step": 2BW as it runs by default (error feedback, no
# synchronous start) with MuonAdamW at the 1200-step horizon
# (benchmarks/results/step_multiplier_1200.json: 1521 steps to the target of 1200 in the
# 1.5x run, 1.27; a 10% synchronous start makes it 1.15)
STEP_MULTIPLIERS: Mapping[str, float] = {"none": 1.0, "step": 1.27, "stash": math.inf}


def step_multiplier(schedule: str, given: Mapping[str, float] | None = None) -> float:
    """``schedule``'s step multiplier: ``given[schedule]`` where the caller measured its own
    (by schedule name), else the measured one of its delay rule (:data:`STEP_MULTIPLIERS`)."""
    if given is not None and schedule in given:
        value = float(given[schedule])
        if not value > 0.0:
            raise ValueError(
                f"step_multipliers[{schedule!r}]={given[schedule]!r}: give the steps the schedule "
                "needs to reach the flushed schedules' loss over theirs, a number > 0 (1.0: as "
                "many)"
            )
        return value
    return STEP_MULTIPLIERS[schedule_spec(schedule).delay]
