"""BPipe activation balancing and the per-block memory plan: the same weights, less memory.

Every lever moves or recomputes saved activations without changing a single operation of the
training math, so the tolerance is 0: the trained weights must be bitwise equal to the same run
without the lever (fp32, CPU). The memory figures are the engine's exact counts of saved bytes
(``saved_tensors_hooks``, storages de-duplicated, weights excluded).
"""

from __future__ import annotations

import pytest
from helpers import workers
from helpers.models import max_abs_diff

from lightning_pipe2bw import ActivationBalancer

STEPS = 3


def _by_stage(results: list[dict], key: str = "peak_activation_bytes") -> list[int]:
    return [r[key] for r in sorted(results, key=lambda r: r["stage"])]


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_balancing_is_bitwise_exact_and_evens_out_the_peaks(pools, schedule: str) -> None:
    plain = pools(4).run(workers.fit, schedule, 4, STEPS, batch_size=16)
    balanced = pools(4).run(
        workers.fit, schedule, 4, STEPS, batch_size=16, balance_activations=True
    )
    before, after = _by_stage(plain), _by_stage(balanced)
    print(f"BPIPE {schedule}: peak saved bytes per stage {before} -> {after}")
    assert max_abs_diff(balanced[0]["state"], plain[0]["state"]) == 0.0
    assert balanced[0]["losses"] == plain[0]["losses"]
    # stage 0 stashes 4 micro-batches and hands about 3/7 of each to stage 3; stage 1 hands 1/5
    # of its 3 to stage 2: the early stages' peaks drop, the late stages' rise
    assert after[0] < 0.8 * before[0]
    assert after[1] < before[1]
    assert after[3] > before[3]
    assert max(after) / min(after) < max(before) / min(before)


def test_a_budget_in_microbatches_bounds_the_evicting_stages(pools) -> None:
    plain = pools(2).run(workers.fit, "1f1b", 4, STEPS, batch_size=16)
    capped = pools(2).run(workers.fit, "1f1b", 4, STEPS, batch_size=16, balance_activations=1.0)
    before, after = _by_stage(plain), _by_stage(capped)
    print(f"BPIPE budget 1 micro-batch, p=2: {before} -> {after}")
    assert max_abs_diff(capped[0]["state"], plain[0]["state"]) == 0.0
    # a budget of 1 micro-batch on stage 0 (which stashes 2): everything of the older one goes,
    # except what the stage holds anyway (its input and output)
    assert after[0] < 0.75 * before[0]


def test_the_callback_takes_a_budget_in_bytes(pools) -> None:
    plain = pools(2).run(workers.fit, "1f1b", 4, STEPS, batch_size=16)
    budget = _by_stage(plain)[0] // 2  # half of what stage 0 stashes now
    capped = pools(2).run(
        workers.fit,
        "1f1b",
        4,
        STEPS,
        batch_size=16,
        callbacks=[ActivationBalancer(budget_bytes=budget)],
    )
    before, after = _by_stage(plain), _by_stage(capped)
    print(f"BPIPE ActivationBalancer(budget_bytes={budget}), p=2: {before} -> {after}")
    assert max_abs_diff(capped[0]["state"], plain[0]["state"]) == 0.0
    assert after[0] < before[0]


@pytest.mark.parametrize(
    ("schedule", "policy"),
    [
        ("1f1b", "swap"),
        ("1f1b", "recompute"),
        ("1f1b", "evict"),
        ("2bw", "swap"),
        ("2bw", "recompute"),
    ],
)
def test_each_memory_plan_lever_is_exact_and_frees_stage_memory(
    pools, schedule: str, policy: str
) -> None:
    # 2BW: recomputing a block must run it with the micro-batch's own weight version again
    plan = {1: policy, 2: policy, 3: policy}  # the blocks of stage 0 of 2 (8 blocks)
    plain = pools(2).run(workers.fit, schedule, 4, STEPS, batch_size=16)
    moved = pools(2).run(workers.fit, schedule, 4, STEPS, batch_size=16, memory_plan=plan)
    before, after = _by_stage(plain), _by_stage(moved)
    print(f"MEMORY PLAN {schedule} {policy}: peak saved bytes per stage {before} -> {after}")
    assert max_abs_diff(moved[0]["state"], plain[0]["state"]) == 0.0
    assert after[0] < 0.7 * before[0]
    if policy == "evict":
        assert after[1] > before[1]  # the partner holds them
    else:
        assert after[1] == before[1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_plan": {9: "swap"}}, "memory_plan names block 9, but the body has 8 blocks"),
        ({"memory_plan": {6: "evict"}}, "block 6 runs on stage 1 of 2, which has no partner"),
        ({"schedule": "gpipe", "balance_activations": True}, "the balanced share moves nothing"),
        (
            {"memory_plan": {1: "swap"}, "recompute": True},
            "give either recompute or a memory_plan",
        ),
    ],
)
def test_bad_memory_plans_fail_on_every_rank(pools, kwargs: dict, message: str) -> None:
    schedule = kwargs.pop("schedule", "1f1b")
    for text in pools(2).run(workers.fit_error, schedule, **kwargs):
        assert message in text, text


@pytest.mark.parametrize(
    ("schedule", "policy"), [("zb-v", "swap"), ("zb-v", "recompute"), ("2bw-v", "swap")]
)
def test_memory_plan_with_two_stages_per_rank(pools, schedule: str, policy: str) -> None:
    """Blocks 1, 6 and 7 sit on the V's first and last stage, both on the rank at place 0: the
    plan frees memory there only, bitwise exactly (the stash counts per stage and micro-batch)."""
    plan = {1: policy, 6: policy, 7: policy}
    plain = pools(2).run(workers.fit, schedule, 4, STEPS, batch_size=16)
    moved = pools(2).run(workers.fit, schedule, 4, STEPS, batch_size=16, memory_plan=plan)
    before, after = _by_stage(plain), _by_stage(moved)
    print(f"MEMORY PLAN {schedule} {policy}: peak saved bytes per rank {before} -> {after}")
    assert max_abs_diff(moved[0]["state"], plain[0]["state"]) == 0.0
    assert after[0] < before[0]
    assert after[1] == before[1]
