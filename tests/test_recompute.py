"""Activation recomputation (``recompute=``): the same weights after training, less memory.

With recomputation a stage keeps only its input per in-flight micro-batch and runs its blocks
again in the backward (``torch.utils.checkpoint``, non-reentrant), with the micro-batch's own
weight version under 2BW. Tolerance: max abs parameter difference <= 1e-6 against the same run
without recomputation (fp32, CPU; recomputing repeats the same operations, so it is 0 here),
and <= 1e-5 against the single-device references.
"""

from __future__ import annotations

import pytest
import workers
from models import max_abs_diff, reference_2bw, reference_train

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
