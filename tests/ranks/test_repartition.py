"""vPipe live repartitioning: blocks move between stages while training runs, the math does not.

Blocks 2 and 3 of the 8-block regression model sleep 10 ms in each training forward, so the
even split [4, 4] leaves stage 0 many times slower than stage 1; [3, 5] puts one on each. With ``repartition_every=2`` the
strategy measures every block, finds the better split and moves blocks at a flush point with
their weights, 2BW weight versions and optimizer state. Tolerance: max |dW| <= 1e-6 (fp32, CPU)
against the same run without repartitioning; moving a block changes no operation, so it is 0
here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import repartition_workers as rw
from helpers.models import max_abs_diff

STEPS = 6


@pytest.mark.parametrize(("schedule", "replicas"), [("1f1b", 1), ("2bw", 1), ("1f1b", 2)])
def test_repartitioning_moves_blocks_and_changes_no_weight(
    pools, schedule: str, replicas: int
) -> None:
    # 2BW moves blocks at flush points: the reference flushes at the same steps. With two
    # pipeline replicas (4 ranks) both move the same blocks, from their averaged timings
    kwargs: dict = {"data_parallel": replicas}
    if schedule == "2bw":
        kwargs["flush_every"] = 2
    world = 2 * replicas
    moved = pools(world).run(rw.fit_slow, schedule, STEPS, repartition_every=2, **kwargs)
    fixed = pools(world).run(rw.fit_slow, schedule, STEPS, **kwargs)
    rank0 = moved[0]
    label = f"{schedule} x{replicas}"
    print(f"REPARTITION {label}: {rank0['repartitions']}; final balance {rank0['balance']}")
    assert rank0["repartitions"], "the slow stage was not noticed"
    assert all(r["balance"] == [3, 5] for r in moved)  # one slow block on each stage
    assert fixed[0]["balance"] == [4, 4]
    diff = max_abs_diff(rank0["state"], fixed[0]["state"])
    print(f"REPARTITION {label}: max|dW| against no repartitioning {diff:.3e}")
    assert diff <= 1e-6


@pytest.mark.parametrize(
    ("schedule", "state_dict_type"), [("1f1b", "full"), ("2bw", "full"), ("1f1b", "sharded")]
)
def test_a_checkpoint_after_a_repartition_resumes_exactly(
    pools, tmp_path: Path, schedule: str, state_dict_type: str
) -> None:
    kwargs = {"state_dict_type": state_dict_type}
    if schedule == "2bw":
        kwargs["flush_every"] = 2
    full = pools(2).run(
        rw.fit_slow, schedule, STEPS, ckpt_dir=str(tmp_path), repartition_every=2, **kwargs
    )
    assert full[0]["repartitions"]
    ckpt = tmp_path / "step=4.ckpt"  # written after the repartition at step 2
    # a fresh strategy without repartitioning starts from [4, 4] and adopts the saved layout
    resumed = pools(2).run(rw.fit_slow, schedule, STEPS, resume=str(ckpt), **kwargs)
    assert resumed[0]["balance"] == full[0]["balance"] == [3, 5]
    diff = max_abs_diff(resumed[0]["state"], full[0]["state"])
    print(f"REPARTITION resume {schedule} {state_dict_type} from {ckpt.name}: max|dW| {diff:.3e}")
    assert diff <= 1e-6


def test_a_block_that_cannot_travel_stops_every_rank_before_anything_moves(pools) -> None:
    messages = pools(2).run(rw.fit_slow_error, repartition_every=2, unpicklable=True)
    for message in messages:
        assert "cannot move blocks between stages" in message, message
        assert "block 3:" in message
