"""vPipe live repartitioning's plan, in one process: it moves blocks off a slow stage, keeps a
split within the threshold, costs blocks by their measured forward and backward, and refuses bad
options. The runs that move blocks while training: ``tests/ranks/test_repartition.py``."""

from __future__ import annotations

import pytest

from lightning_pipe2bw import Pipe2BWStrategy
from lightning_pipe2bw.repartition.plan import StageTiming, block_costs, plan_repartition


def _timings(block_s: list[float], balance: list[int], extra: float = 0.0) -> list[StageTiming]:
    out, start = [], 0
    for s, n in enumerate(balance):
        blocks = {b: block_s[b] for b in range(start, start + n)}
        fwd = sum(blocks.values()) + extra
        out.append(StageTiming(s, blocks, fwd, 2 * fwd))
        start += n
    return out


def test_plan_moves_blocks_off_the_slow_stage() -> None:
    times = [1.0, 5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    decision = plan_repartition(_timings(times, [4, 4]), [4, 4], threshold=0.15)
    assert decision.needed
    assert decision.best == (2, 6)  # 6 + 6 units forward against 8 + 6 the other way
    assert decision.moves() == [(2, 0, 1), (3, 0, 1)]
    assert max(decision.best_s) < max(decision.current_s)
    print(decision.describe())


def test_plan_keeps_a_split_within_the_threshold() -> None:
    times = [1.0, 1.2, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    decision = plan_repartition(_timings(times, [4, 4]), [4, 4], threshold=0.15)
    assert not decision.needed
    assert decision.slowdown < 0.15


def test_block_costs_scale_by_the_backward_and_keep_the_stage_overhead() -> None:
    cost, fixed = block_costs(_timings([1.0] * 4, [2, 2], extra=0.5), 4)
    # a stage's forward is 2.5 (0.5 outside its blocks), its backward twice that: each block
    # costs 3x its forward and the 1.5 s outside the blocks stays with the stage
    assert cost == pytest.approx([3.0] * 4)
    assert fixed == {0: pytest.approx(1.5), 1: pytest.approx(1.5)}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"repartition_every": 0}, "repartition_every must be a positive int"),
        ({"repartition_threshold": -0.1}, "repartition_threshold must be a fraction >= 0"),
    ],
)
def test_bad_repartition_options(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Pipe2BWStrategy(**kwargs)
