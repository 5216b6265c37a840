"""Stages exchange pytrees (tensors with and without grad, Python values) whose shapes change
from batch to batch, through a real Trainer, and the result still equals one device."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from helpers.models import max_abs_diff, quiet_trainer
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_pipe2bw import Pipe2BWStrategy

FEATURES = 5


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(FEATURES, FEATURES)

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        x = batch["x"]
        mask = x[..., 0] > 0  # bool, no grad
        return {"h": self.proj(x), "mask": mask, "scale": 0.5, "length": x.shape[1]}


class MaskedMix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(FEATURES, FEATURES)

    def forward(self, state: dict[str, Any]) -> dict[str, Any]:
        h, mask = state["h"], state["mask"]
        assert h.shape[1] == state["length"]
        h = h + state["scale"] * torch.tanh(self.fc(h)) * mask.unsqueeze(-1)
        return {**state, "h": h}


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(FEATURES, 1)

    def forward(self, state: dict[str, Any]) -> tuple[Tensor, Tensor]:
        pooled = state["h"].mean(dim=1)
        return self.out(pooled).squeeze(-1), state["mask"].float().mean(dim=1)


class SequenceModel(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.body = nn.Sequential(Embed(), MaskedMix(), MaskedMix(), MaskedMix(), Pool())

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        pred, coverage = self.body({"x": batch["x"]})
        loss = nn.functional.mse_loss(pred, batch["y"]) + 0.0 * coverage.sum()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def batches() -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for length in (4, 9, 6, 9, 3):
        out.append(
            {"x": torch.randn(6, length, FEATURES, generator=g), "y": torch.randn(6, generator=g)}
        )
    return out


def reference(microbatches: int) -> dict[str, Tensor]:
    model = SequenceModel()
    opt = model.configure_optimizers()
    for batch in batches():
        opt.zero_grad()
        for x, y in zip(
            torch.tensor_split(batch["x"], microbatches),
            torch.tensor_split(batch["y"], microbatches),
            strict=True,
        ):
            loss = nn.functional.mse_loss(model.body({"x": x})[0], y) * (x.shape[0] / 6)
            loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fit(microbatches: int, schedule: str) -> dict[str, Tensor] | None:
    model = SequenceModel()
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=microbatches, balance=[1, 2, 2])
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_epochs=1)
    trainer.fit(model, torch.utils.data.DataLoader(batches(), batch_size=None))
    state = strategy.full_state_dict()
    return state if dist.get_rank() == 0 else None


def test_pytree_payloads_with_changing_shapes(pools: Any) -> None:
    for schedule, m in (("1f1b", 3), ("gpipe", 2)):
        state = pools(3).run(_fit, m, schedule)[0]
        assert state is not None
        assert max_abs_diff(state, reference(m)) <= 1e-6, schedule
