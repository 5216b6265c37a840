"""The contract: flush schedules equal single-device gradient accumulation over the same
micro-batches. Tolerance: max abs parameter difference <= 1e-5 (fp32, CPU) after 5 steps."""

from __future__ import annotations

import pytest
from helpers import workers
from helpers.models import isclose, max_abs_diff, reference_train

STEPS = 5
TOL = 1e-5

CASES = [(schedule, p, m) for schedule in ("gpipe", "1f1b") for p in (2, 4) for m in (1, p, 2 * p)]


@pytest.mark.parametrize(("schedule", "p", "m"), CASES, ids=[f"{s}-p{p}-m{m}" for s, p, m in CASES])
def test_flush_schedule_equals_single_device(pools, schedule: str, p: int, m: int) -> None:
    results = pools(p).run(workers.fit, schedule, m, STEPS)
    ref_state, ref_losses = reference_train(STEPS, m)
    diff = max_abs_diff(results[0]["state"], ref_state)
    print(f"EXACTNESS {schedule} p={p} m={m}: max|dW| = {diff:.3e}")
    assert diff <= TOL
    # the loss logged in training_step reaches every rank (rank 0's progress bar and loggers)
    # with the single-device value, although only the last stage computes it
    for rank, result in enumerate(results):
        assert len(result["losses"]) == STEPS, rank
        for got, want in zip(result["losses"], ref_losses, strict=True):
            assert isclose(got, want), (rank, result["losses"], ref_losses)


@pytest.mark.parametrize("optimizer", ["sgd"])
def test_sgd_momentum_1f1b(pools, optimizer: str) -> None:
    results = pools(2).run(workers.fit, "1f1b", 4, STEPS, optimizer)
    ref_state, _ = reference_train(STEPS, 4, optimizer=optimizer)
    assert max_abs_diff(results[0]["state"], ref_state) <= TOL


def test_each_rank_holds_only_its_stage(pools) -> None:
    """Parameter and optimizer-state bytes on each rank equal its stage's share."""
    from helpers.models import RegressionModel

    full = RegressionModel()
    blocks = list(full.body.children())
    results = pools(4).run(workers.fit, "1f1b", 4, 2, balance=[1, 3, 3, 1])
    # global rank 0 runs the last stage (where the loss and Lightning's loggers are)
    assert [r["stage"] for r in results] == [3, 2, 1, 0]
    results.sort(key=lambda r: r["stage"])
    start = 0
    for stage, (result, count) in enumerate(zip(results, [1, 3, 3, 1], strict=True)):
        owned = blocks[start : start + count]
        start += count
        share = sum(p.numel() * p.element_size() for b in owned for p in b.parameters())
        numel = sum(p.numel() for b in owned for p in b.parameters())
        assert result["blocks"] == list(range(start - count, start)), stage
        assert result["param_bytes"] == share, stage
        assert result["opt_params"] == numel, stage
        # AdamW keeps exp_avg and exp_avg_sq per parameter (+ a scalar step per tensor)
        n_tensors = sum(1 for b in owned for _ in b.parameters())
        assert result["opt_state_bytes"] == 2 * share + 4 * n_tensors, stage
