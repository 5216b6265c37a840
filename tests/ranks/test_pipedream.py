"""PipeDream weight stashing equals its single-process stage-by-stage reference, and stage s
keeps at most p - s weight versions. Tolerance: max abs difference <= 1e-5 (fp32, CPU)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import workers
from helpers.models import max_abs_diff, reference_2bw, reference_pipedream

STEPS = 6
CASES = [(p, m, opt) for p in (2, 4) for m in (1, p) for opt in ("sgd", "adamw")]


@pytest.mark.parametrize(
    ("p", "m", "optimizer"), CASES, ids=[f"p{p}-m{m}-{o}" for p, m, o in CASES]
)
def test_pipedream_equals_stashing_reference(pools: Any, p: int, m: int, optimizer: str) -> None:
    results = pools(p).run(workers.fit, "pipedream", m, STEPS, optimizer)
    balance = [8 // p] * p
    ref = reference_pipedream(STEPS, m, balance, optimizer)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS pipedream p={p} m={m} {optimizer}: max|dW| = {diff:.3e}")
    assert diff <= 1e-5
    # a different rule from 2BW's
    assert max_abs_diff(results[0]["state"], reference_2bw(STEPS, m, optimizer=optimizer)) > 1e-4
    for r in results:
        stage = r["stage"]
        peak = max(r["versions"])
        print(f"VERSIONS pipedream p={p} m={m} stage {stage}: at most {peak} (bound {p - stage})")
        assert peak <= p - stage
        assert r["engine_versions"] <= p - stage
        if m == 1:  # one micro-batch per update: every in-flight micro-batch has its own version
            assert peak == p - stage
