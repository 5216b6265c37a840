"""Contiguous block partitions: the exact min-max split of the blocks over the pipeline stages."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from lightning_pipe2bw.planner.costmodel import CostModel

__all__ = ["best_partition", "minmax_partition", "smallest_peak_memory"]

_INF = math.inf
Recompute = str | Sequence[bool]  # "off", "on", "per_stage", or one bool per stage


def recompute_options(model: CostModel, recompute: Recompute) -> Callable[[int], tuple[bool, ...]]:
    """The recompute settings stage s may use, fastest first."""
    if isinstance(recompute, str):
        table = {"off": (False,), "on": (True,), "per_stage": (False, True)}
        if recompute not in table:
            raise ValueError(f"recompute must be one of {sorted(table)}, got {recompute!r}")
        fixed = table[recompute]
        return lambda s: fixed
    flags = tuple(bool(r) for r in recompute)
    if len(flags) != model.d:
        raise ValueError(
            f"recompute has {len(flags)} flags for depth={model.d}; give one bool per stage"
        )
    return lambda s: (flags[s],)


def minmax_partition(
    n: int,
    d: int,
    cost: Callable[[int, int, int], float],
    lower: Callable[[int, int, int], float],
    cutoff: float = _INF,
) -> tuple[float, tuple[int, ...]] | None:
    """The contiguous split of n blocks into d non-empty stages with the smallest largest
    ``cost(s, lo, hi)`` below ``cutoff`` (exact dynamic programme), or None.

    ``lower(s, lo, hi)`` must bound ``cost`` from below and never shrink as the segment grows
    (it may be inf once a monotone memory floor is over the limit): the scan over ``lo``
    stops as soon as it reaches the best value found, which keeps the search near n^2 / d
    segment evaluations per stage in practice.

    The boundary transfers (activation in from block lo - 1, gradient in of block hi - 1's
    output) depend on both ends of a segment, so stage cost is not monotone in the segment and
    greedy maximal prefixes are not optimal in general; the programme evaluates each candidate
    segment's exact cost instead, so these terms are handled exactly, not bounded.
    """
    prev = [_INF] * (n + 1)
    for hi in range(1, n - d + 2):
        if lower(0, 0, hi) >= cutoff:
            break
        c = cost(0, 0, hi)
        if c < cutoff:
            prev[hi] = c
    back: list[list[int]] = [[0] * (n + 1)]
    for s in range(1, d):
        cur, arg = [_INF] * (n + 1), [-1] * (n + 1)
        for hi in range(s + 1, n - (d - 1 - s) + 1):
            best, where = cutoff, -1
            for lo in range(hi - 1, s - 1, -1):
                if lower(s, lo, hi) >= best:
                    break  # every longer segment is at least as slow (or out of memory)
                p = prev[lo]
                if p >= best:
                    continue
                c = cost(s, lo, hi)
                v = p if p > c else c
                if v < best:
                    best, where = v, lo
            if where >= 0:
                cur[hi], arg[hi] = best, where
        if all(v == _INF for v in cur):
            return None
        back.append(arg)
        prev = cur
    if prev[n] == _INF:
        return None
    cuts, hi = [n], n
    for s in range(d - 1, 0, -1):
        hi = back[s][hi]
        cuts.append(hi)
    cuts.append(0)
    cuts.reverse()
    return prev[n], tuple(b - a for a, b in itertools.pairwise(cuts))


def best_partition(
    model: CostModel,
    recompute: Recompute = "off",
    memory_limit: float = _INF,
    cutoff: float = _INF,
) -> tuple[tuple[int, ...], tuple[bool, ...]] | None:
    """The balance minimising the slowest stage's time under ``memory_limit``, and the
    recompute flag of each stage; None if no split fits (or none is faster than ``cutoff``).

    With ``recompute="per_stage"`` a stage recomputes only if it does not fit without: the
    cheaper choice is taken per candidate segment, which is optimal because a segment's cost
    does not depend on the choices of the other stages.
    """
    options = recompute_options(model, recompute)
    m = model.m

    def choose(s: int, lo: int, hi: int) -> tuple[float, bool]:
        for rc in options(s):
            f, b, ra, rg, ar, mem = model.terms(s, lo, hi, rc)
            if mem <= memory_limit:
                t = f + b + ra + rg
                return (t if t >= ar / m else ar / m), rc
        return _INF, False

    def lower(s: int, lo: int, hi: int) -> float:
        opts = options(s)
        if model.memory_lower_bound(s, lo, hi, opts[-1]) > memory_limit:
            return _INF
        return model.time_lower_bound(lo, hi, opts[0])

    found = minmax_partition(
        model.n, model.d, lambda s, lo, hi: choose(s, lo, hi)[0], lower, cutoff
    )
    if found is None:
        return None
    balance = found[1]
    starts = [sum(balance[:s]) for s in range(model.d)]
    flags = tuple(
        choose(s, lo, lo + k)[1] for s, (lo, k) in enumerate(zip(starts, balance, strict=True))
    )
    return balance, flags


def smallest_peak_memory(model: CostModel, recompute: Recompute) -> float:
    """The smallest largest-stage memory of any split (recompute where allowed)."""
    options = recompute_options(model, recompute)

    def cost(s: int, lo: int, hi: int) -> float:
        return min(model.terms(s, lo, hi, rc)[5] for rc in options(s))

    def lower(s: int, lo: int, hi: int) -> float:
        return model.memory_lower_bound(s, lo, hi, options(s)[-1])

    found = minmax_partition(model.n, model.d, cost, lower)
    return _INF if found is None else found[0]
