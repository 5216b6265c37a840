"""Activation recomputation (``recompute=``): the same weights after training, less memory.

With recomputation a stage keeps only its input per in-flight micro-batch and runs its blocks
again in the backward (``torch.utils.checkpoint``, non-reentrant), with the micro-batch's own
weight version under 2BW. Tolerance: max abs parameter difference <= 1e-6 against the same run
without recomputation (fp32, CPU; recomputing repeats the same operations, so it is 0 here),
and <= 1e-5 against the single-device references.
"""

from __future__ import annotations

import pytest
from helpers import workers
from helpers.models import max_abs_diff, reference_2bw, reference_train

STEPS = 4


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_recompute_changes_nothing_but_memory(pools, schedule: str) -> None:
    plain = pools(2).run(workers.fit, schedule, 4, STEPS)
    again = pools(2).run(workers.fit, schedule, 4, STEPS, recompute=True)
    diff = max_abs_diff(again[0]["state"], plain[0]["state"])
    ref = reference_2bw(STEPS, 4) if schedule == "2bw" else reference_train(STEPS, 4)[0]
    print(
        f"RECOMPUTE {schedule}: max|dW| vs no recompute {diff:.3e}, vs reference "
        f"{max_abs_diff(again[0]['state'], ref):.3e}; peak saved bytes per stage "
        f"{[r['peak_activation_bytes'] for r in plain]} -> "
        f"{[r['peak_activation_bytes'] for r in again]}"
    )
    assert diff <= 1e-6
    assert max_abs_diff(again[0]["state"], ref) <= 1e-5
    for before, after in zip(plain, again, strict=True):
        assert after["peak_activation_bytes"] < before["peak_activation_bytes"] / 2, (before, after)


def test_recompute_per_stage(pools) -> None:
    """``recompute=[True, False]``: stage 0 (global rank 1) recomputes, stage 1 does not."""
    plain = pools(2).run(workers.fit, "1f1b", 4, 2)
    mixed = pools(2).run(workers.fit, "1f1b", 4, 2, recompute=[True, False])
    by_stage = {r["stage"]: r["peak_activation_bytes"] for r in plain}
    mixed_by_stage = {r["stage"]: r["peak_activation_bytes"] for r in mixed}
    assert mixed_by_stage[0] < by_stage[0] / 2
    assert mixed_by_stage[1] == by_stage[1]
    assert max_abs_diff(mixed[0]["state"], plain[0]["state"]) <= 1e-6


def test_recompute_list_must_match_the_stages(pools) -> None:
    for message in pools(2).run(workers.fit_error, "1f1b", recompute=[True, False, True]):
        assert "recompute=[True, False, True] has 3 entries but the pipeline has 2" in message


def test_recompute_protects_the_input_of_an_in_place_first_block(pools) -> None:
    """Stage 1 starts with ``x += shift`` (``balance=[5, 3]``), which is not idempotent: the
    recomputation must see the input the first forward saw, not the one it modified. (The
    weights; the buffers are the next test's.)"""
    kwargs = dict(model="conv", balance=[5, 3])
    plain = pools(2).run(workers.fit, "1f1b", 4, 3, **kwargs)
    again = pools(2).run(workers.fit, "1f1b", 4, 3, recompute=True, **kwargs)
    ref = reference_train(3, 4, model_name="conv")[0]
    weights = [k for k in ref if "running_" not in k and "num_batches" not in k]
    got = {k: again[0]["state"][k] for k in weights}
    assert max_abs_diff(got, {k: plain[0]["state"][k] for k in weights}) <= 1e-6
    assert max_abs_diff(got, {k: ref[k] for k in weights}) <= 1e-5


@pytest.mark.parametrize(
    ("schedule", "recompute", "plan"),
    [
        ("1f1b", True, None),
        ("2bw", True, None),
        ("gpipe", False, {1: "recompute", 3: "recompute"}),
        ("2bw", False, {2: "recompute", 3: "recompute", 6: "recompute"}),
    ],
)
def test_recompute_leaves_batch_norm_statistics_alone(
    pools, schedule: str, recompute: bool, plan: dict[int, str] | None
) -> None:
    """The recomputed forward normalises with batch statistics, as the first one did, but does
    not update the running statistics again: weights and buffers (running_mean, running_var,
    num_batches_tracked) equal the run without recomputation, and the references. Stage 1
    starts with ReLU(inplace=True) (``balance=[2, 6]``), so recomputation also runs an in-place
    first block."""
    steps, m = 5, 4
    kwargs = dict(model="conv", balance=[2, 6])
    plain = pools(2).run(workers.fit, schedule, m, steps, **kwargs)
    again = pools(2).run(
        workers.fit, schedule, m, steps, recompute=recompute, memory_plan=plan, **kwargs
    )
    ref = (
        reference_2bw(steps, m, model_name="conv")
        if schedule == "2bw"
        else reference_train(steps, m, model_name="conv")[0]
    )
    state = again[0]["state"]
    diff = max_abs_diff(state, plain[0]["state"])
    print(
        f"RECOMPUTE BN {schedule} {recompute} {plan}: max|d| weights and buffers vs no recompute "
        f"{diff:.3e}, vs reference {max_abs_diff(state, ref):.3e}"
    )
    for key in ("body.1.num_batches_tracked", "body.3.bn2.num_batches_tracked"):
        assert int(state[key]) == steps * m, (key, int(state[key]))
    assert diff <= 1e-6
    assert max_abs_diff(state, ref) <= 1e-5
