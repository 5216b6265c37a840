"""The planner for the schedules with two stages per rank (``planner.virtualplan``) and
``plan(schedule="all")``: 2d-stage splits, per-rank figures, step times by simulation."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from lightning_pipe2bw.planner.costmodel import Cluster, CostModel
from lightning_pipe2bw.planner.planner import ALL_SCHEDULES, plan, predict
from lightning_pipe2bw.planner.profile import Profile
from lightning_pipe2bw.planner.target import step_multiplier
from lightning_pipe2bw.planner.virtualplan import VIRTUAL_PLANNER_SCHEDULES, virtual_problem
from lightning_pipe2bw.schedule import (
    Costs,
    cut_overhead,
    schedule_spec,
    simulate,
    training_schedule,
)
from unit.test_planner import cluster, profile

UNIFORM = profile([1.0] * 8, b=4, output=0, saved=0, params=1000, input_bytes=0)


@pytest.mark.parametrize("schedule", VIRTUAL_PLANNER_SCHEDULES)
def test_a_virtual_plan_splits_into_2d_stages_and_reports_per_rank(schedule: str) -> None:
    result = plan(UNIFORM, cluster(2), 32, schedule, microbatch_sizes=[4], data_parallel=1)
    best = result.best
    assert (best.depth, best.num_microbatches, best.stages_per_rank) == (2, 8, 2)
    assert best.balance == (2, 2, 2, 2)  # uniform blocks: every stage alike
    assert len(best.compute_s) == len(best.memory_bytes) == len(best.recompute) == 2
    # a rank computes its two stages, 2 blocks each: 4 x (1 + 2) seconds per micro-batch
    assert best.compute_s == (12.0, 12.0) and best.time_per_microbatch == 12.0
    # no rank can finish faster than its own work, and these schedules waste little of it
    work = best.num_microbatches * best.time_per_microbatch
    assert work <= best.step_time <= 1.3 * work
    versions = 2 if schedule == "2bw-v" else 1  # weights per version + gradient + Adam's two
    assert best.memory_bytes == (4000 * (versions + 3),) * 2


def test_the_flush_prediction_is_the_simulated_makespan() -> None:
    """Without transfers, all-reduce or overheads the predicted step is exactly the simulated
    makespan of the schedule the engine runs (on the profile's device, the CPU: zero bubble's
    cuts where they pay there), at the planned per-stage costs: a backward cut in halves (the
    profile has no measured cut), but the first stage's, whole in its W."""
    best = predict(UNIFORM, cluster(2), 32, schedule="zb-v", depth=2, microbatch_size=4)
    costs = Costs(2.0, 4.0, input_grad=(0.0, 2.0, 2.0, 2.0), weight_grad=(4.0, 2.0, 2.0, 2.0))
    runs = training_schedule("zb-v", 2, 8, cut_overhead=cut_overhead("cpu"))
    made = simulate(runs, costs)
    assert best.step_time == pytest.approx(made.step_time)
    assert best.balance == (2, 2, 2, 2)


def test_zb_v_beats_1f1b_and_interleaved_beats_it_too_on_uniform_blocks() -> None:
    """At m = 2d the fill and drain of 1F1B cost (d - 1)/(m + d - 1) of its step; interleaving
    halves it and ZB-V nearly removes it: plan(schedule="all") ranks them so."""
    result = plan(UNIFORM, cluster(4), 32, "all", microbatch_sizes=[4], data_parallel=1, keep=1000)
    best_of: dict[str, float] = {}
    for p in result.ranked:
        best_of.setdefault(p.schedule, p.step_time)
    assert set(best_of) == set(ALL_SCHEDULES)
    assert best_of["zb-v"] < best_of["interleaved-1f1b"] < best_of["1f1b"]
    # DualPipeV runs its pairs one after the other here: ZB-V's time, give or take a unit
    assert best_of["dualpipe-v"] <= best_of["zb-v"] + 1.0
    # ranked by time to the target: throughput over the step multiplier
    rates = [p.throughput / step_multiplier(p.schedule) for p in result.ranked]
    assert rates == sorted(rates, reverse=True)
    assert result.best.target_rate == max(rates)
    assert "| schedule" in result.explain()  # several schedules: the table names each
    assert set(ALL_SCHEDULES) >= set(best_of)


def test_plan_all_ranks_by_time_to_the_target_loss() -> None:
    """A schedule that delays its gradients is ranked by its throughput over the steps it
    needs to reach the flushed schedules' loss: where it needs as many, the fastest plan wins
    (2BW, no bubble); where it needs far more, a flushed schedule does. The table says so."""
    delayed = [name for name in ALL_SCHEDULES if schedule_spec(name).takes_corrections]
    kwargs: dict[str, Any] = dict(microbatch_sizes=[4], data_parallel=1, keep=1000)
    free = plan(UNIFORM, cluster(4), 32, "all", step_multipliers=dict.fromkeys(delayed, 1.0), **kwargs)
    assert schedule_spec(free.best.schedule).takes_corrections
    assert free.best.throughput == max(p.throughput for p in free.ranked)
    costly = plan(UNIFORM, cluster(4), 32, "all", step_multipliers=dict.fromkeys(delayed, 100.0), **kwargs)
    assert schedule_spec(costly.best.schedule).flushes
    assert costly.best.throughput < max(p.throughput for p in costly.ranked)
    table = costly.explain()
    assert "x-steps" in table and "to-target" in table and "100.00" in table
    with pytest.raises(ValueError, match=r"step_multipliers\['2bw'\]=0: give the steps"):
        plan(UNIFORM, cluster(4), 32, "all", step_multipliers={"2bw": 0}, **kwargs)


def test_what_a_virtual_schedule_cannot_run_is_skipped_or_refused() -> None:
    assert virtual_problem("zb-v", 4, 8, 6) == "zb-v needs 2d = 8 stages, the body has 6 blocks"
    assert "multiple of d" in (virtual_problem("interleaved-1f1b", 4, 6, 8) or "")
    assert "m >= d" in (virtual_problem("2bw-v", 4, 2, 8) or "")
    with pytest.raises(ValueError, match="2bw-v needs m >= d"):
        predict(UNIFORM, cluster(4), 8, schedule="2bw-v", depth=4, microbatch_size=4)
    with pytest.raises(ValueError, match="must have 4 entries"):
        predict(
            UNIFORM, cluster(2), 32, schedule="zb-v", depth=2, microbatch_size=4, balance=[4, 4]
        )
    # a body of 3 blocks has no 2-rank plan with two stages per rank
    small = profile([1.0] * 3, b=4, output=0, saved=0)
    with pytest.raises(ValueError, match="needs 2d = 4 stages"):
        plan(small, cluster(2), 8, "zb-v", microbatch_sizes=[4], data_parallel=1)


def test_a_virtual_rank_s_memory_counts_its_in_flight_stage_microbatches() -> None:
    """Saved bytes only: a rank holds its simulated peak of (stage, micro-batch) pairs times
    its larger stage's stash (ZB-V: at most 2p of them, 2BW on a V: 2p + 1)."""
    stash = profile([1.0] * 8, b=4, output=0, saved=1000, params=0, input_bytes=0)
    for schedule, peak in (("zb-v", 4), ("2bw-v", 5)):
        best = predict(stash, cluster(2), 32, schedule=schedule, depth=2, microbatch_size=4)
        assert best.memory_bytes == (peak * 2000,) * 2, schedule


def _with_cut(base: Profile, input_grad: float, weight_grad: float) -> Profile:
    """``base`` with every block's backward measured cut in two at these times."""
    blocks = tuple(
        dataclasses.replace(b, input_grad_s=input_grad, weight_grad_s=weight_grad)
        for b in base.blocks
    )
    return dataclasses.replace(base, blocks=blocks)


def test_zb_v_is_timed_with_the_measured_cut_and_sends_but_not_the_v_turn() -> None:
    """ZB-V's I and W cost what the profile measured for the backward cut in two (blocks of
    backward 2 s cut into 1.5 + 1.5 s); the first stage's backward stays whole in its W; each
    message costs its sender ``send_s`` and its receiver ``latency_s``, except the hand-over
    between the two stages of the V's turn, which is no message."""
    cut = _with_cut(UNIFORM, 1.5, 1.5)
    link = Cluster(2, 8, 2**40, 1e12, 1e11, latency_s=0.25, send_s=0.5)
    best = predict(cut, link, 32, schedule="zb-v", depth=2, microbatch_size=4)
    assert best.balance == (2, 2, 2, 2)
    # stage: forward 2 s, backward 4 s, cut 3 + 3 s. Rank 0 holds stages 0 and 3, rank 1
    # stages 1 and 2 (the turn). Messages: 0 -> 1 and 2 -> 3 forward, 3 -> 2 and 1 -> 0 back.
    send, lat = 0.5, 0.25
    costs = Costs(
        forward=(2 + send, 2 + lat, 2 + send, 2 + lat),
        backward=(4 + lat, 4 + send, 4 + lat, 4 + send),
        input_grad=(lat, 3 + send, 3 + lat, 3 + send),
        weight_grad=(4, 3, 3, 3),
    )
    made = simulate(training_schedule("zb-v", 2, 8, cut_overhead=cut_overhead("cpu")), costs)
    assert best.step_time == pytest.approx(made.step_time)
    # the cut's cost and the messages' make the step longer than without them
    plain = predict(UNIFORM, cluster(2), 32, schedule="zb-v", depth=2, microbatch_size=4)
    assert best.step_time > plain.step_time


def test_zb_h1_pays_the_cut_on_every_stage_but_the_first_and_sends_cost_the_sender() -> None:
    cut = _with_cut(UNIFORM, 1.5, 1.5)  # blocks: forward 1, backward 2, cut 1.5 + 1.5
    link = Cluster(2, 8, 2**40, 1e12, 1e11, send_s=0.5)
    zb = CostModel(cut, link, "zb-h1", 1, 2, 8)
    first, last = zb.stage(0, 0, 4, False), zb.stage(1, 4, 8, False)
    assert (first.forward_s, first.backward_s) == (4 + 0.5, 8)  # sends the activation
    assert (last.forward_s, last.backward_s) == (4, 12 + 0.5)  # the cut; sends the gradient
    # 1F1B does not cut; a stage that recomputes runs its backward whole
    plain = CostModel(cut, link, "1f1b", 1, 2, 8).stage(1, 4, 8, False)
    assert plain.backward_s == 8 + 0.5
    assert zb.stage(1, 4, 8, True).backward_s == 4 + 8 + 0.5
