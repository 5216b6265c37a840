"""Functions run on every rank of a test pool (module level, so they pickle by name)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from models import RegressionModel, loader, quiet_trainer

from lightning_pipe2bw import Pipe2BWStrategy


class RecordLoss(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def fit(
    schedule: str,
    microbatches: int,
    steps: int,
    optimizer: str = "adamw",
    batch_size: int = 8,
    **strategy_kwargs: Any,
) -> dict[str, Any]:
    world = dist.get_world_size()
    model = RegressionModel(optimizer=optimizer)
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=microbatches, **strategy_kwargs)
    record = RecordLoss()
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=steps, callbacks=[record])
    trainer.fit(model, loader(batch_size))
    state = strategy.full_state_dict()
    opt = trainer.optimizers[0]
    return {
        "state": state if dist.get_rank() == 0 else None,
        "losses": record.losses,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "opt_params": sum(p.numel() for g in opt.param_groups for p in g["params"]),
        "opt_state_bytes": sum(
            t.numel() * t.element_size()
            for s in opt.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        ),
        "blocks": list(model.body.indices),
    }
