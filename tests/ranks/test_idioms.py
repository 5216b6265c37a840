"""Lightning idioms work as on one device, on every rank of a pipeline: the step outputs a step
appends to a list and an epoch-end hook stacks, and torchmetrics ``Metric`` objects passed to
``self.log`` (step and epoch values, reset at epoch end); ``Trainer.validate`` and
``Trainer.test`` report one device's metrics.

A real 2-stage fit (1F1B: the weights equal one device's) on the session's gloo pool, against
Lightning on one device in this process. Before, the stages other than the last never ran the
step past the body, so their lists stayed empty (``torch.stack`` of an empty list crashed
``on_validation_epoch_end``), and ``self.log(name, metric)`` was refused.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torchmetrics
from helpers.models import RegressionModel, loader, quiet_trainer
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe2bw import Pipe2BWStrategy

TIMEOUT = 120


class Classifier(LightningModule):
    """Appends validation losses and predictions (to a list, and to a dict of lists), logs their
    epoch mean in ``on_validation_epoch_end``, and logs two Metrics: an accuracy updated with
    ``forward`` (step and epoch values) and an AUROC (list states) updated with ``update``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 3))
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        self.auroc = torchmetrics.classification.MulticlassAUROC(num_classes=3)
        self.val_losses: list[Tensor] = []
        self.val_preds: dict[str, list[Tensor]] = {"argmax": []}
        self.epoch_ends: list[tuple[int, int, float]] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        self.acc(logits, y)
        self.log("train_acc", self.acc, on_step=True, on_epoch=True)
        return nn.functional.cross_entropy(logits, y)

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.val_losses.append(loss)
        self.val_preds["argmax"].append(logits.argmax(-1))
        self.auroc.update(logits.softmax(-1), y)
        self.log("val_auroc", self.auroc)
        return loss

    def on_validation_epoch_end(self) -> None:
        mean = torch.stack(self.val_losses).mean()
        preds = torch.cat(self.val_preds["argmax"])
        self.log("val_mean", mean)
        self.epoch_ends.append((len(self.val_losses), int(preds.numel()), float(mean)))
        self.val_losses.clear()
        self.val_preds["argmax"].clear()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 4, generator=g), torch.randint(0, 3, (48,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _fit(strategy: Any, devices: int) -> dict[str, Any]:
    model = Classifier()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, _data(), _data())
    return {
        "epoch_ends": model.epoch_ends,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }


def _on_rank(schedule: str) -> dict[str, Any]:
    out = _fit(Pipe2BWStrategy(schedule=schedule, microbatches=2), dist.get_world_size())
    out["rank"] = dist.get_rank()
    return out


@pytest.fixture(scope="module")
def one_device() -> dict[str, Any]:
    return _fit("auto", 1)


def test_every_rank_sees_the_step_outputs_and_metrics_of_one_device(
    pools: Any, one_device: dict[str, Any]
) -> None:
    results = pools(2).run(_on_rank, "1f1b", timeout=TIMEOUT)
    reference = one_device
    # one device: 6 validation batches of 8, one item per batch (the micro-batches' items merged)
    assert [(n, k) for n, k, _ in reference["epoch_ends"]] == [(6, 48), (6, 48)]
    expected = set(reference["metrics"])
    assert {"train_acc_step", "train_acc_epoch", "val_auroc", "val_mean"} <= expected
    for r in results:
        print(f"IDIOMS rank {r['rank']}: epoch ends {r['epoch_ends']}, metrics {r['metrics']}")
        assert [(n, k) for n, k, _ in r["epoch_ends"]] == [(6, 48), (6, 48)], r
        for (_, _, got), (_, _, want) in zip(r["epoch_ends"], reference["epoch_ends"], strict=True):
            assert math.isclose(got, want, rel_tol=1e-5), (got, want)
        assert set(r["metrics"]) == expected, (set(r["metrics"]), expected)
        for name, want in reference["metrics"].items():
            # the Metrics' epoch values are their exact compute() over every sample, not a mean
            assert math.isclose(r["metrics"][name], want, rel_tol=1e-5, abs_tol=1e-6), name


def test_under_2bw_the_other_ranks_log_the_last_stages_values(pools: Any) -> None:
    """2BW's weights differ from one device's (the delayed update), and the other ranks get a
    training step's values one step late; at the end of an epoch they wait for the last one, so
    every rank ends the epoch with the last stage's values, Metrics' epoch values included."""
    first, second = pools(2).run(_on_rank, "2bw", timeout=TIMEOUT)
    assert first["epoch_ends"] == second["epoch_ends"]
    assert first["metrics"] == second["metrics"]


def _validate_and_test() -> dict[str, float]:
    torch.set_num_threads(1)
    model = RegressionModel()
    trainer = quiet_trainer(
        devices=2, strategy=Pipe2BWStrategy(microbatches=4), limit_val_batches=None
    )
    val = trainer.validate(model, loader(8, n=32), verbose=False)[0]["val_loss"]
    test = trainer.test(model, loader(8, n=32), verbose=False)[0]["test_loss"]
    return {"val": val, "test": test}


def test_validate_and_test_metrics_equal_single_device(pools: Any) -> None:
    """``Trainer.validate`` and ``Trainer.test`` outside fit: the loss each logs (the mean
    over 4 batches, each merged from 4 micro-batches) is one device's, on every rank."""
    model = RegressionModel()
    single = quiet_trainer(devices=1, limit_val_batches=None)
    want_val = single.validate(model, loader(8, n=32), verbose=False)[0]["val_loss"]
    want_test = single.test(model, loader(8, n=32), verbose=False)[0]["test_loss"]
    for r in pools(2).run(_validate_and_test, timeout=TIMEOUT):
        assert r["val"] == pytest.approx(want_val, rel=1e-6), r
        assert r["test"] == pytest.approx(want_test, rel=1e-6), r
