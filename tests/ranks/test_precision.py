"""Precision plugins through the pipeline: fp16 loss scaling agrees across stages (a step
skipped for inf/NaN is skipped everywhere) and bf16-mixed trains."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.models import RegressionModel, loader, quiet_trainer
from lightning.pytorch import Callback
from lightning.pytorch.plugins import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe2bw import Pipe2BWStrategy

POISON = 1e4  # an input this large makes the first block's gradient inf


class _InfGradIfHuge(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.huge = bool((x.abs() >= POISON).any())
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad * float("inf") if ctx.huge else grad


class PoisonedFirstBlock(nn.Module):
    """Lives on stage 0: its weight's gradient is inf for batches holding a POISON input."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(_InfGradIfHuge.apply(x)).clamp(-10, 10)


class PoisonModel(RegressionModel):
    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.body[0] = PoisonedFirstBlock(self.body[0])


class Watch(Callback):
    """Per step: this stage's parameter fingerprint and the loss scale."""

    def __init__(self) -> None:
        self.fingerprints: list[float] = []
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.fingerprints.append(sum(float(p.double().sum()) for p in pl_module.parameters()))
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))


def poisoned_loader(poisoned_batch: int) -> DataLoader[Any]:
    x, y = loader(8).dataset.tensors  # type: ignore[attr-defined]
    x = x.clone()
    x[poisoned_batch * 8, 0] = POISON
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _fit_fp16(schedule: str, poisoned_batch: int, steps: int) -> dict[str, Any]:
    watch = Watch()
    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule=schedule, microbatches=2),
        # Lightning turns precision="16-mixed" into bf16 on CPU; the plugin given explicitly runs
        # fp16 autocast with a CPU GradScaler, the same logic as on GPU
        plugins=[MixedPrecision(precision="16-mixed", device="cpu")],
        max_steps=steps,
        callbacks=[watch],
    )
    trainer.fit(PoisonModel(), poisoned_loader(poisoned_batch))
    return {"fingerprints": watch.fingerprints, "scales": watch.scales}


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_fp16_inf_on_one_stage_skips_the_step_on_every_stage(pools: Any, schedule: str) -> None:
    poisoned, steps = 2, 5
    results = pools(2).run(_fit_fp16, schedule, poisoned, steps)
    # with 2BW the update of batch t is applied at the end of step t + 1
    skipped = poisoned if schedule == "1f1b" else poisoned + 1
    for rank, r in enumerate(results):
        f = r["fingerprints"]
        # the skipped update leaves this stage's weights exactly as they were...
        assert f[skipped] == f[skipped - 1], (rank, f)
        # ...while the updates around it change them
        assert f[skipped + 1] != f[skipped], (rank, f)
        # the scale was halved at the skipped step, identically on every stage
        s = r["scales"]
        assert s[skipped] == s[skipped - 1] / 2, (rank, s)
    assert results[0]["scales"] == results[1]["scales"]


def _fit_losses(precision: str) -> list[float]:
    losses: list[float] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            # rank 0 (the last stage) logs every step's loss; the others get it a step late
            losses.append(float(trainer.callback_metrics.get("train_loss", math.nan)))

    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule="2bw", microbatches=2),
        precision=precision,
        max_steps=4,
        callbacks=[Record()],
    )
    trainer.fit(RegressionModel(optimizer="adamw"), loader(8))
    return losses


def test_bf16_mixed_goes_through_autocast_on_every_stage(pools: Any) -> None:
    bf16 = pools(2).run(_fit_losses, "bf16-mixed")[0]
    fp32 = pools(2).run(_fit_losses, "32-true")[0]
    # bf16 rounding is visible in the losses (autocast ran), but they track fp32 closely
    assert bf16 != fp32
    for a, b in zip(bf16, fp32, strict=True):
        assert a == pytest.approx(b, rel=3e-2), (bf16, fp32)


def _fit_bf16_true() -> dict[str, Any]:
    model = RegressionModel(optimizer="adamw")
    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule="2bw", microbatches=2),
        precision="bf16-true",
        max_steps=3,
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.fit(model, loader(8))
    return {
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "changed": all(not torch.equal(before[k], v) for k, v in model.state_dict().items()),
        "loss": float(trainer.callback_metrics["train_loss"]) if dist.get_rank() == 0 else None,
    }


def test_bf16_true_trains_in_bf16_on_every_stage(pools: Any) -> None:
    """precision="bf16-true": Lightning's plugin casts each stage's weights; activations and
    gradients cross between stages in bf16."""
    results = pools(2).run(_fit_bf16_true)
    for rank, r in enumerate(results):
        assert r["dtypes"] == ["torch.bfloat16"], (rank, r)
        assert r["changed"], rank
    assert math.isfinite(results[0]["loss"])
