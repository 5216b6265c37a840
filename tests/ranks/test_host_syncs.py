"""A training step reads no number back from its tensors where Lightning on one device does not.

On a GPU every such read (``.item()``, ``float(tensor)``) makes the host wait for the device's
queue to drain, so the launches of what follows no longer overlap the device's work: a logged
loss read back in the forward exposes the whole backward's launch time. These tests count the
reads (``aten._local_scalar_dense``, which ``item`` and ``float`` call) during real ``Trainer``
steps on the CPU, where the same calls happen, and compare with Lightning's own count.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.models import RegressionModel, loader, quiet_trainer
from lightning.pytorch import Callback
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_pipe2bw import Pipe2BWStrategy

READ = torch.ops.aten._local_scalar_dense.default


class CountReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is READ:
            self.reads += 1
        return func(*args, **(kwargs or {}))


class ReadsPerStep(Callback):
    """The number of reads of each step from the third on (the first steps build state)."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self._mode: CountReads | None = None

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx >= 2:
            self._mode = CountReads()
            self._mode.__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.counts.append(self._mode.reads)
            self._mode = None


class LogsSeveral(RegressionModel):
    """Logs a loss, a tensor of another dtype and a Python number, as users do."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        out = self(x)
        loss = nn.functional.mse_loss(out, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("big", (out.abs() > 1).sum())  # an integer tensor
        self.log("lr_seen", 0.5)
        return loss


def _reads_per_step(schedule: str | None, microbatches: int) -> dict[str, Any]:
    """On a rank of a one-rank pool (the strategy's process group stays in the pool's process):
    the reads per step and the logged values, of a plain Trainer (``schedule`` None) or of
    pipe2bw with one stage."""
    strategy: Any = "auto"
    if schedule is not None:
        strategy = Pipe2BWStrategy(schedule=schedule, microbatches=microbatches)
    watch = ReadsPerStep()
    trainer = quiet_trainer(max_steps=6, callbacks=[watch], strategy=strategy, devices=1)
    trainer.fit(LogsSeveral(), loader(batch_size=8, n=64))
    return {"counts": watch.counts, "metrics": dict(trainer.callback_metrics)}


@pytest.mark.parametrize(
    ("schedule", "microbatches"), [("1f1b", 1), ("gpipe", 4), ("2bw", 1), ("2bw", 2)]
)
def test_a_step_reads_back_no_more_than_lightnings(
    pools: Any, schedule: str, microbatches: int
) -> None:
    (plain,) = pools(1).run(_reads_per_step, None, 1)
    (ours,) = pools(1).run(_reads_per_step, schedule, microbatches)
    counts, metrics = ours["counts"], ours["metrics"]
    plain_counts, plain_metrics = plain["counts"], plain["metrics"]
    assert len(counts) == len(plain_counts) == 4
    assert counts == plain_counts, f"reads per step: pipe2bw {counts}, Lightning {plain_counts}"
    assert set(metrics) == set(plain_metrics)
    assert metrics["lr_seen"].item() == 0.5
    for name, value in metrics.items():
        assert (
            value.dtype == plain_metrics[name].dtype and value.device == plain_metrics[name].device
        )
    if schedule == "1f1b" and microbatches == 1:  # the same computation: the same values, bitwise
        for name, value in metrics.items():
            assert torch.equal(value, plain_metrics[name]), name
