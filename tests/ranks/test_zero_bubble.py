"""ZB-H1's runs on the pool equal single-device gradient accumulation bitwise (tolerance 0: its
``F``, ``I`` and ``W`` run in micro-batch order on every stage). The schedule itself:
``tests/unit/test_zero_bubble.py``."""

from __future__ import annotations

import pytest
from helpers import workers
from helpers.models import isclose, make_loader, max_abs_diff, reference_train

from lightning_pipe2bw.schedule import ActionKind, cut_overhead, training_schedule

STEPS = 6


CASES = [(p, m) for p in (2, 4) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize(("p", "m"), CASES, ids=[f"p{p}-m{m}" for p, m in CASES])
def test_zb_h1_equals_single_device_bitwise(pools, p: int, m: int) -> None:
    """6 AdamW steps, batch 16: max|dW| = 0 against one device accumulating the same
    micro-batches, and the backwards were really cut (SplitBackward) where the schedule cuts
    them, on every stage but the first, which sends no gradient and leaves each whole backward
    to its W."""
    samples = 16 * STEPS  # one epoch
    results = pools(p).run(workers.fit, "zb-h1", m, STEPS, batch_size=16, samples=samples)
    data = make_loader("regression", 16, n=samples)
    ref_state, ref_losses = reference_train(STEPS, m, batch_size=16, data=data)
    diff = max_abs_diff(results[0]["state"], ref_state)
    print(f"EXACTNESS zb-h1 p={p} m={m}: max|dW| = {diff:.3e}")
    assert diff == 0.0
    for result in results:  # the logged loss (summed over micro-batches in another order)
        assert all(isclose(a, b) for a, b in zip(result["losses"], ref_losses, strict=True))
    # every I the schedule holds was cut, but the first stage's; the schedule keeps the cuts
    # that pay on this device (schedule.cuts_that_pay)
    sched = training_schedule("zb-h1", p, m, cut_overhead=cut_overhead("cpu"))
    for result in results:
        r = result["stage"]
        cut = 0 if r == 0 else STEPS * sum(a.kind is ActionKind.INPUT_GRAD for a in sched.stages[r])
        assert result["split_backwards"] == cut, r
    if p == 4:  # where zero bubble's cuts fill the cool-down's waits, they stay
        assert any(r["split_backwards"] > STEPS for r in results)
