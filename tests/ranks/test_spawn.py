"""Real ``Trainer``s that start their own processes (``pipe2bw_spawn``): the launching process
gets the trained weights and the predictions back, and checkpoints load on one device.
(``Trainer.validate`` and ``Trainer.test`` against one device run on the session's pool:
``test_idioms.py``; a spawn costs two fresh interpreters, and the launcher hands results back
alike for every Trainer call.)"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import (
    RegressionModel,
    TiedModel,
    loader,
    max_abs_diff,
    quiet_trainer,
    reference_train,
)
from lightning.pytorch import Callback
from torch import nn

from lightning_pipe2bw import Pipe2BWStrategy

MARK = "PIPE2BW_TEST_LAUNCHING_MARK"


class SaveAtEnd(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        trainer.save_checkpoint(self.path)


def test_spawn_fit_predict_and_checkpoint(tmp_path: Path) -> None:
    steps, m = 4, 2
    ckpt = str(tmp_path / "pipe.ckpt")
    model = RegressionModel()
    trainer = quiet_trainer(
        devices=2, strategy="pipe2bw_spawn", max_steps=steps, callbacks=[SaveAtEnd(ckpt)]
    )
    trainer.fit(model, loader(8))
    # the default schedule is 1F1B (one device's gradient accumulation); microbatches default to
    # the number of stages
    ref_state, _ = reference_train(steps, m)

    # the module in this (launching) process holds the trained weights of every stage
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert max_abs_diff(trained, ref_state) <= 1e-5

    # a normal Lightning checkpoint with the full state_dict, loadable on one device
    raw = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert set(raw["state_dict"]) == set(ref_state)
    loaded = RegressionModel.load_from_checkpoint(ckpt)
    assert isinstance(loaded.body, nn.Sequential)
    assert max_abs_diff(dict(loaded.state_dict()), ref_state) <= 1e-5

    # predictions computed on the last stage come back to the launching process, in order
    predictor = quiet_trainer(devices=2, strategy="pipe2bw_spawn")
    preds = predictor.predict(loaded, loader(8, n=24))
    assert preds is not None and len(preds) == 3
    x = torch.cat([b[0] for b in loader(8, n=24)])
    with torch.no_grad():
        want = loaded.body(x)
    torch.testing.assert_close(torch.cat(preds), want, rtol=0, atol=1e-6)


class WhatTheWorkerFound(Callback):
    """Rank 0 writes, at set-up, what it started with: an environment variable and torch's seed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.global_rank == 0:
            found = {"mark": os.environ.get(MARK), "seed": torch.initial_seed()}
            self.path.write_text(json.dumps(found))


def _trained(model: RegressionModel, **trainer_options: Any) -> dict[str, torch.Tensor]:
    quiet_trainer(max_steps=4, **trainer_options).fit(model, loader(8))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_workers_started_from_this_process_train_exactly_and_start_as_spawned_ones(
    method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight tied across the two stages trains bitwise as on one device (one micro-batch, so
    the same operations in the same order): forkserver workers once shared the model's memory and
    both stages updated the one tied weight (0.17 away). Then a second fit's workers see the
    environment and the seed this process has when that fit starts, not those it had when the
    fork server started (the first fit)."""
    strategy = Pipe2BWStrategy(schedule="gpipe", microbatches=1, start_method=method)  # type: ignore[arg-type]
    got = _trained(TiedModel(), devices=2, strategy=strategy)
    want = _trained(TiedModel(), devices=1)
    assert max_abs_diff(got, want) == 0.0

    monkeypatch.setenv(MARK, f"set after the first fit, {method}")
    model = RegressionModel()  # seeds torch itself
    torch.manual_seed(4321)
    found = tmp_path / "found.json"
    quiet_trainer(
        devices=2,
        strategy=Pipe2BWStrategy(start_method=method),  # type: ignore[arg-type]
        max_steps=1,
        callbacks=[WhatTheWorkerFound(found)],
    ).fit(model, loader(8))
    assert json.loads(found.read_text()) == {
        "mark": f"set after the first fit, {method}",
        "seed": 4321,
    }
