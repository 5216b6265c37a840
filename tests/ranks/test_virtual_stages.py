"""Several stages per rank, run by the strategy: interleaved 1F1B (looped placement) and ZB-V
(V placement) equal single-device gradient accumulation bitwise (tolerance 0: every stage runs
its forwards and backwards in micro-batch order, so each weight's gradient adds up in the
order one device adds it). The schedules themselves: ``tests/unit/test_virtual_schedules.py``."""

from __future__ import annotations

import pytest
from helpers import workers
from helpers.models import isclose, make_loader, max_abs_diff, reference_train

STEPS = 6

CASES = [
    (name, p, m) for name in ("interleaved-1f1b", "zb-v") for p in (2, 4) for m in (p, 2 * p, 4 * p)
]


@pytest.mark.parametrize(("name", "p", "m"), CASES, ids=[f"{n}-p{p}-m{m}" for n, p, m in CASES])
def test_virtual_schedules_equal_single_device_bitwise(pools, name: str, p: int, m: int) -> None:
    """6 AdamW steps, batch 16, two stages per rank (8 blocks: one block per stage at p = 4):
    max|dW| = 0 against one device accumulating the same micro-batches; the logged losses
    agree; every rank held the blocks of its two stages."""
    samples = 16 * STEPS
    results = pools(p).run(workers.fit, name, m, STEPS, batch_size=16, samples=samples)
    data = make_loader("regression", 16, n=samples)
    ref_state, ref_losses = reference_train(STEPS, m, batch_size=16, data=data)
    diff = max_abs_diff(results[0]["state"], ref_state)
    print(f"EXACTNESS {name} p={p} m={m}: max|dW| = {diff:.3e}")
    assert diff == 0.0
    for result in results:
        assert all(isclose(a, b) for a, b in zip(result["losses"], ref_losses, strict=True))
    per_stage = 8 // (2 * p)
    for result in results:
        r = result["stage"]
        other = p + r if name == "interleaved-1f1b" else 2 * p - 1 - r
        first, second = sorted((r, other))
        expected = [
            *range(first * per_stage, (first + 1) * per_stage),
            *range(second * per_stage, (second + 1) * per_stage),
        ]
        assert result["blocks"] == expected
        if name == "zb-v":  # every I is cut, but stage 0's (it sends no gradient)
            cut = STEPS * m * (1 if r == 0 else 2)
            assert result["split_backwards"] == cut, r
