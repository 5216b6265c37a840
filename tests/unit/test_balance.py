"""Balance modes: the exact partitioner they rest on finds the best contiguous split, and bad
modes are refused. ``balance="params"`` and ``"uniform"`` on real ranks:
``tests/ranks/test_balance.py``."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_pipe2bw.partition.balance import balance_by_weights


def _brute_force(weights: list[float], stages: int) -> float:
    n, best = len(weights), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_partition_is_optimal_on_random_weights() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        weights = [rng.choice([0, 1, 2, 5, 13]) * rng.random() for _ in range(n)]
        balance = balance_by_weights(weights, stages)
        assert len(balance) == stages and sum(balance) == n and min(balance) >= 1
        bounds = [0, *itertools.accumulate(balance)]
        heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        assert heaviest == pytest.approx(_brute_force(weights, stages)), (weights, stages, balance)


def test_partition_examples() -> None:
    assert balance_by_weights([1] * 8, 2) == (4, 4)
    assert balance_by_weights([1] * 7, 2) == (3, 4)  # the extra block goes to a later stage
    assert balance_by_weights([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == (1, 8)


def test_partition_errors() -> None:
    with pytest.raises(ValueError, match="the body has 2 blocks but the pipeline has 3 stages"):
        balance_by_weights([1, 1], 3)
    with pytest.raises(ValueError, match="block weights must be >= 0"):
        balance_by_weights([1, -1], 2)


def test_unknown_balance_mode_is_refused() -> None:
    from lightning_pipe2bw import Pipe2BWStrategy

    with pytest.raises(ValueError, match="balance='time' is not a balance mode"):
        Pipe2BWStrategy(balance="time")  # type: ignore[arg-type]
