"""Real ``Trainer``s that start their own processes (``pipe2bw_spawn``): the launching process
gets the trained weights and the predictions back, and checkpoints load on one device.
(``Trainer.validate`` and ``Trainer.test`` against one device run on the session's pool:
``test_idioms.py``; a spawn costs two fresh interpreters, and the launcher hands results back
alike for every Trainer call.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from helpers.models import RegressionModel, loader, max_abs_diff, quiet_trainer, reference_train
from lightning.pytorch import Callback
from torch import nn


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
