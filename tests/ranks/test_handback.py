"""After a Trainer call the user's module holds the whole trained model again, on every rank, so
that ``model.state_dict()`` in the script is the whole model (before, after a ``popen`` fit it
silently held one stage: e.g. 4 of 6 keys). A body built in ``configure_model`` stays partial,
and then a partial ``state_dict()`` is impossible to miss: it raises, naming the ways to save
the whole model, which still work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from helpers.models import (
    RegressionModel,
    loader,
    max_abs_diff,
    quiet_trainer,
    reference_2bw,
    reference_train,
)
from helpers.workers import LateBuiltModel

from lightning_pipe2bw import Pipe2BWStrategy

TIMEOUT = 120


def _whole_after_fit() -> dict[str, Any]:
    model = RegressionModel(optimizer="sgd")
    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=2)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=3)
    trainer.fit(model, loader(8))
    after_fit = {k: v.clone() for k, v in model.state_dict().items()}
    gathered = strategy.full_state_dict()  # collective: still the whole model on rank 0
    x = torch.randn(5, 6)
    with torch.no_grad():
        out = model(x)  # the whole body runs on one device, outside any Trainer
    trainer.validate(model, loader(8, n=16), verbose=False)  # partitioned again, handed back
    return {
        "state": after_fit,
        "gathered": gathered,
        "forward_ok": bool(torch.isfinite(out).all()) and tuple(out.shape) == (5, 3),
        "body": type(model.body).__name__,
        "keys_after_validate": sorted(model.state_dict()),
    }


def test_every_rank_holds_the_whole_trained_model_after_fit(pools: Any) -> None:
    results = pools(2).run(_whole_after_fit, timeout=TIMEOUT)
    reference, _ = reference_train(3, microbatches=2, optimizer="sgd")
    for rank, r in enumerate(results):
        assert sorted(r["state"]) == sorted(reference), (rank, sorted(r["state"]))
        diff = max_abs_diff(r["state"], reference)
        print(
            f"HANDBACK rank {rank}: {len(r['state'])} of {len(reference)} keys, max |dW| {diff:.2e}"
        )
        assert diff < 1e-5, rank
        assert r["forward_ok"] and r["body"] == "Sequential"
        assert r["keys_after_validate"] == sorted(reference)
    assert max_abs_diff(results[0]["gathered"], results[0]["state"]) == 0.0


def _partial_after_fit(folder: str) -> dict[str, Any]:
    model = LateBuiltModel(width=8, num_blocks=4)
    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=2)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=2)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=4
    )
    trainer.fit(model, data)
    try:
        model.state_dict()
        error = "no error"
    except RuntimeError as err:
        error = str(err)
    path = str(Path(folder) / "whole.ckpt")
    trainer.save_checkpoint(path)  # collective: every stage's blocks, consolidated
    return {"error": error, "stage": strategy.stage, "path": path}


def test_a_body_built_in_configure_model_refuses_a_partial_state_dict(
    pools: Any, tmp_path: Path
) -> None:
    results = pools(2).run(_partial_after_fit, str(tmp_path), timeout=TIMEOUT)
    for r in results:
        blocks = "[2, 3]" if r["stage"] == 1 else "[0, 1]"
        assert r["error"].startswith(
            f"this module holds stage {r['stage']} of 2 of its pipeline body only (blocks "
            f"{blocks}; its blocks were built in configure_model)"
        ), r["error"]
        assert "trainer.save_checkpoint(path)" in r["error"]
        assert "strategy.full_state_dict()" in r["error"]
    saved = torch.load(results[0]["path"], weights_only=True)["state_dict"]
    assert sorted(saved) == [f"body.{i}.{p}" for i in range(4) for p in ("bias", "weight")]


def _two_fits(schedule: str) -> dict[int, Any] | None:
    """Two Trainers fit the same model one after the other (3 steps each)."""
    model = RegressionModel(optimizer="adamw")
    states = {}
    for fit in range(2):
        strategy = Pipe2BWStrategy(schedule=schedule, microbatches=2)
        trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=3)
        trainer.fit(model, loader(8))
        states[fit] = {k: v.clone() for k, v in model.state_dict().items()}
    return states if dist.get_rank() == 0 else None


def _reference_2bw_from(start: dict[str, Any] | None, steps: int) -> dict[str, Any]:
    """PipeDream-2BW on one device from ``start``, restarted as a new fit restarts it: a fresh
    optimizer, no delay-correction history and W(-1) = W(0), with the default correction."""
    return reference_2bw(steps, microbatches=2, start=start)


def test_a_second_fit_restarts_the_2bw_rule_exactly(pools: Any) -> None:
    """Each fit partitions the whole module afresh and starts the 2BW rule again from the
    weights it holds (W(-1) = W(0)) with the optimizer configure_optimizers builds, as a second
    fit does on one device."""
    states = pools(2).run(_two_fits, "2bw", timeout=TIMEOUT)[0]
    first = _reference_2bw_from(None, 3)
    second = _reference_2bw_from(first, 3)
    d1, d2 = max_abs_diff(states[0], first), max_abs_diff(states[1], second)
    print(f"HANDBACK two 2bw fits: max |dW| {d1:.1e} after the first, {d2:.1e} after the second")
    assert d1 < 1e-6 and d2 < 1e-6
