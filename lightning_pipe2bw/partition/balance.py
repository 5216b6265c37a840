"""Contiguous block partitions that even out a per-block weight (parameters, time, bytes)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from torch import nn

__all__ = ["balance_by_params"]


def balance_by_weights(weights: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Blocks per stage minimising the heaviest stage (the sum of its blocks' weights), every
    stage getting at least one block.

    Exact, by dynamic programming over (stage, first block): ``O(p n^2)``, instant for the block
    counts of real bodies. Among equally heavy splits it prefers the most even one (the least sum
    of squared stage weights), then the one whose earlier stages are lighter (under 1F1B the
    first stages stash the most activations), as the even split does.
    """
    n = len(weights)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if num_stages > n:
        raise ValueError(
            f"the body has {n} blocks but the pipeline has {num_stages} stages; use at most {n} "
            "stages or split the body into more blocks"
        )
    if any(w < 0 for w in weights):
        raise ValueError(f"block weights must be >= 0, got {list(weights)}")
    prefix = [0.0, *accumulate(float(w) for w in weights)]
    inf = float("inf")
    # best[s][j]: the least possible heaviest stage when stages s..p-1 take blocks j..n-1;
    # filled from the last stage backwards so that ties go to lighter early stages
    best = [[(inf, inf)] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[num_stages][n] = (0.0, 0.0)
    for s in range(num_stages - 1, -1, -1):
        left = num_stages - s - 1  # stages after s, one block each at least
        for j in range(s, n - left):
            for k in range(j + 1, n - left + 1):  # stage s takes blocks j..k-1
                weight = prefix[k] - prefix[j]
                heaviest, squares = best[s + 1][k]
                value = (max(weight, heaviest), squares + weight * weight)
                if value < best[s][j]:  # strict: the first (smallest) k wins a tie
                    best[s][j], cut[s][j] = value, k
    balance, j = [], 0
    for s in range(num_stages):
        k = cut[s][j]
        balance.append(k - j)
        j = k
    return tuple(balance)


def balance_by_params(blocks: Sequence[nn.Module], num_stages: int) -> tuple[int, ...]:
    """Blocks per stage evening out the parameter count (works on the meta device too)."""
    counts = [sum(p.numel() for p in block.parameters()) for block in blocks]
    return balance_by_weights(counts, num_stages)
