"""Contiguous block partitions that even out a per-block weight (parameters, time, bytes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

from torch import nn

__all__ = ["Split", "balance_by_weights", "parameter_counts", "stage_loads"]


def balance_by_weights(
    weights: Sequence[float], num_stages: int, placement: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Blocks per stage minimising the heaviest stage (the sum of its blocks' weights), every
    stage getting at least one block.

    With ``placement`` (the rank of each stage, where a rank holds several: interleaved, a V),
    what a rank runs is the sum of its stages, and the heaviest rank sets the pace: from the
    split above, boundaries move (a run of them by one block at a time) while that makes the
    heaviest rank lighter, or leaves it and makes the heaviest stage lighter (see
    :func:`_even_ranks`).

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
            "devices/stages or split the body into more blocks"
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
    if placement is None or len(set(placement)) == num_stages:
        return tuple(balance)
    return _even_ranks(prefix, tuple(balance), placement)


def stage_loads(
    weights: Sequence[float], balance: Sequence[int], placement: Sequence[int] | None = None
) -> list[float]:
    """The summed weights of each stage of ``balance``; with ``placement``, of each rank."""
    bounds = [0, *accumulate(balance)]
    loads = [float(sum(weights[a:b])) for a, b in pairwise(bounds)]
    if placement is None:
        return loads
    ranks = [0.0] * (max(placement) + 1)
    for stage, load in enumerate(loads):
        ranks[placement[stage]] += load
    return ranks


def _even_ranks(
    prefix: Sequence[float], balance: tuple[int, ...], placement: Sequence[int]
) -> tuple[int, ...]:
    """``balance`` improved for ranks that hold several stages: the best of the moves of a run
    of consecutive boundaries by one block, left or right, as long as one makes (the heaviest
    rank, the heaviest stage, the sum of squared stage loads) smaller. Moving a run shifts
    blocks between two stages that need not be neighbours (on a V, a rank's stages lie far
    apart) while the stages between keep their size. A local search: exact where the blocks
    weigh alike but for the ends, which is what it is for."""
    n_stages = len(balance)

    def key(bounds: Sequence[int]) -> tuple[float, float, float]:
        loads = [prefix[b] - prefix[a] for a, b in pairwise(bounds)]
        ranks: dict[int, float] = {}
        for stage, load in enumerate(loads):
            ranks[placement[stage]] = ranks.get(placement[stage], 0.0) + load
        return max(ranks.values()), max(loads), sum(x * x for x in loads)

    bounds = [0, *accumulate(balance)]
    best = key(bounds)
    while True:
        found = None
        for first in range(1, n_stages):
            for last in range(first, n_stages):
                for step in (-1, 1):
                    moved = bounds[:first] + [b + step for b in bounds[first : last + 1]]
                    moved += bounds[last + 1 :]
                    if any(b <= a for a, b in pairwise(moved)):
                        continue  # a stage left without a block
                    value = key(moved)
                    if value < best:
                        best, found = value, moved
        if found is None:
            return tuple(b - a for a, b in pairwise(bounds))
        bounds = found


def parameter_counts(blocks: Sequence[nn.Module]) -> list[int]:
    """Each block's parameter count (works on the meta device too)."""
    return [sum(p.numel() for p in block.parameters()) for block in blocks]


@dataclass(frozen=True)
class Split:
    """How the body is cut: ``balance`` blocks per stage, chosen by ``rule`` (in words, for the
    stage table), with the modelled cost of each stage, the rank's whole where it holds several
    (``loads``: the summed block weights the rule evened out; empty where the rule has none,
    such as a given list)."""

    balance: tuple[int, ...]
    rule: str
    loads: tuple[float, ...] = ()

    def describe(self) -> str:
        """One line: the rule, and how far apart the ranks are in modelled cost."""
        if not self.loads or min(self.loads) <= 0:
            return f"split: {self.rule}"
        shares = ", ".join(f"{load / max(self.loads):.2f}" for load in self.loads)
        return (
            f"split: {self.rule}; modelled cost of each stage {shares} of the heaviest "
            f"(max/min {max(self.loads) / min(self.loads):.2f})"
        )
