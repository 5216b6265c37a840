"""``plan_memory``: the per-block keep / recompute / swap / evict plan under a byte budget.

Pure arithmetic on a synthetic profile: 8 equal blocks, each saving 1000 bytes per micro-batch
and taking 100 bytes of input, on 4 stages of 2 blocks with 1F1B and m = 4 (so stage s stashes
4 - s micro-batches: 8000, 6000, 4000 and 2000 bytes without a plan).
"""

from __future__ import annotations

import pytest

from lightning_pipe2bw.planner.memoryplan import plan_memory
from lightning_pipe2bw.planner.profile import BlockProfile, Profile


def profile(forward_s: float = 1e-3) -> Profile:
    blocks = tuple(BlockProfile(str(i), forward_s, 2 * forward_s, 100, 1000, 10) for i in range(8))
    return Profile(4, 100, blocks)


def test_a_generous_budget_keeps_everything() -> None:
    plan = plan_memory(profile(), [2, 2, 2, 2], "1f1b", 4, budget_bytes=8000)
    assert plan.policy == {}
    assert plan.stage_bytes == (8000, 6000, 4000, 2000)
    assert plan.added_s == (0.0, 0.0, 0.0, 0.0)


def test_the_plan_fits_the_budget_at_the_least_added_time() -> None:
    # swapping 1000 bytes costs 2 * 4 * 1000 / 1e9 = 8 us per step, recomputing 4 ms: swap wins
    plan = plan_memory(profile(), [2, 2, 2, 2], "1f1b", 4, budget_bytes=5000, host_bandwidth=1e9)
    assert max(plan.stage_bytes) <= 5000
    assert set(plan.policy.values()) <= {"swap", "evict"}
    assert all(b < 4 for b in plan.policy)  # only the early stages are over budget
    print(plan.explain())


def test_recompute_when_it_is_the_only_lever() -> None:
    plan = plan_memory(profile(), [2, 2, 2, 2], "1f1b", 4, budget_bytes=5000, levers=("recompute",))
    assert max(plan.stage_bytes) <= 5000
    assert set(plan.policy.values()) == {"recompute"}
    # a recomputed block on stage 0 holds 4 * 100 + 1000 = 1400 bytes instead of 4000: one is
    # not enough there (5400), both are; stage 1 needs one (3 * 100 + 1000 = 1300 for 3000)
    assert plan.stage_bytes[:2] == (2 * 1400, 3000 + 1300)
    assert plan.added_s[0] == pytest.approx(4 * 1e-3 * sum(1 for b in plan.policy if b < 2))


def test_evict_only_where_the_partner_has_room() -> None:
    plan = plan_memory(profile(), [2, 2, 2, 2], "1f1b", 4, budget_bytes=6000, levers=("evict",))
    # stage 0 evicts one block: 4000 -> 1000 on it, +4000 on stage 3 (2000 -> 6000)
    assert plan.policy == {1: "evict"} or plan.policy == {0: "evict"}
    assert plan.stage_bytes == (5000, 6000, 4000, 6000)


def test_no_plan_fits_names_the_stage() -> None:
    with pytest.raises(ValueError, match="no memory plan fits stage 0 into 1000 bytes"):
        plan_memory(profile(), [2, 2, 2, 2], "1f1b", 4, budget_bytes=1000, levers=("recompute",))
    with pytest.raises(ValueError, match="unknown lever 'spill'"):
        plan_memory(profile(), [2, 2, 2, 2], "1f1b", 4, budget_bytes=1000, levers=("spill",))
