"""``balance="auto"``: rank 0 profiles the body, every rank gets the same plan and applies it
(partition, micro-batches, recomputation), and the plan is saved in the checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from helpers import workers

from lightning_pipe2bw.planner.plans import format_balance


def _fit_auto(tmp: str, **strategy_kwargs: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    strategy_kwargs.setdefault("schedule", "2bw")
    strategy = Pipe2BWStrategy(balance="auto", **strategy_kwargs)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=2)
    told: list[str] = []  # what rank 0 tells the user (Lightning's rank_zero_info)
    handler = logging.Handler()
    handler.emit = lambda record: told.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        trainer.fit(RegressionModel(), loader(8))
    finally:
        logger.removeHandler(handler)
    path = Path(tmp) / "auto.ckpt"
    trainer.save_checkpoint(path)
    assert strategy.plan is not None and strategy.partition is not None
    saved = torch.load(path, weights_only=True)["pipe2bw"] if dist.get_rank() == 0 else None
    return {
        "plan": strategy.plan.best.to_dict(),
        "balance": strategy.partition.balance,
        "microbatches": strategy.num_microbatches,
        "recompute": strategy.engine.body.recompute if strategy.engine else None,
        "stage": strategy.stage,
        "saved": saved,
        "explain": strategy.plan.explain(),
        "told": told,
    }


def test_auto_plans_once_and_every_rank_applies_it(pools, tmp_path: Path) -> None:
    results = pools(2).run(_fit_auto, str(tmp_path))
    plans = [r["plan"] for r in results]
    assert plans[0] == plans[1]  # rank 0's profile, broadcast: the same plan everywhere
    plan = plans[0]
    assert plan["depth"] == 2 and plan["data_parallel"] == 1
    for r in results:
        assert tuple(r["balance"]) == tuple(plan["balance"])
        assert r["microbatches"] == plan["num_microbatches"]
        assert r["recompute"] == plan["recompute"][r["stage"]]
    assert results[0]["saved"]["plan"] == plan
    print(results[0]["explain"])
    assert format_balance(plan["balance"]) in results[0]["explain"]
    # every schedule's time to the target loss against the chosen one's, on rank 0 only
    lines = [line for line in results[0]["told"] if "time to the target loss" in line]
    assert len(lines) == 1 and "how much sooner than '2bw'" in lines[0], results[0]["told"]
    assert "1f1b " in lines[0] and "x the steps" in lines[0]
    assert not any("time to the target loss" in line for line in results[1]["told"])


def test_auto_keeps_the_given_microbatches_and_recompute(pools, tmp_path: Path) -> None:
    results = pools(2).run(_fit_auto, str(tmp_path), microbatches=4, recompute=True)
    for r in results:
        assert r["microbatches"] == 4 and r["recompute"] is True
        assert r["plan"]["num_microbatches"] == 4


def test_auto_with_indivisible_microbatches_is_refused(pools) -> None:
    for message in pools(2).run(workers.fit_error, "1f1b", balance="auto", microbatches=3):
        assert "balance='auto' with microbatches=3 needs a batch size divisible by 3" in message


@pytest.mark.parametrize("schedule", ["1f1b", "2bw", "interleaved-1f1b", "zb-v", "2bw-v"])
def test_auto_trains_like_the_reference(pools, schedule: str) -> None:
    """Whatever the plan, the contract holds: the same weights as the single-device reference
    (2BW: the delayed-gradient reference) with the micro-batch count it chose; with two stages
    per rank the plan splits the body into four stages, two on each rank."""
    from helpers.models import max_abs_diff, reference_2bw, reference_train

    results = pools(2).run(workers.fit, schedule, None, 4, balance="auto")
    m = results[0]["microbatches"] if "microbatches" in results[0] else None
    assert m is not None
    delayed = schedule in ("2bw", "2bw-v")
    ref = reference_2bw(4, m) if delayed else reference_train(4, m)[0]
    assert max_abs_diff(results[0]["state"], ref) <= 1e-5
    if schedule in ("interleaved-1f1b", "zb-v", "2bw-v"):
        blocks = sorted(b for r in results for b in r["blocks"])
        assert blocks == list(range(8))
        first = next(r["blocks"] for r in results if 0 in r["blocks"])
        # the V puts the last stage with the first; the looped placement on the last rank
        assert (7 in first) == (schedule != "interleaved-1f1b"), first


def _transport_run() -> int:
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    strategy = Pipe2BWStrategy(schedule="1f1b", balance="auto")
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=1)
    trainer.fit(RegressionModel(), loader(8))
    assert strategy.engine is not None
    return strategy.engine.transport.run


def test_planning_keeps_the_transports_numbered_alike(pools) -> None:
    """Failure notices match by transport number; measuring the link (ranks 0 and 1 only) must
    not leave the ranks with different numbers, or a notice between ranks 1 and 2 is dropped."""
    runs = pools(3).run(_transport_run)
    assert len(set(runs)) == 1, runs
