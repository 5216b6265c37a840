"""Rank functions for the live-repartitioning tests (module level, so they pickle by name)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch._dynamo.utils import counters

from helpers.models import RegressionModel, loader, quiet_trainer
from lightning_pipe2bw import Pipe2BWStrategy


class SlowBlock(nn.Module):
    """A residual block that sleeps in its training forwards: a block that became slow (the
    same math, so runs with and without it moving compare exactly)."""

    def __init__(self, width: int, delay_s: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.delay_s = delay_s

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            time.sleep(self.delay_s)
        return x + torch.tanh(self.fc(x))


def _identity(x: Tensor) -> Tensor:
    return x


class SlowModel(RegressionModel):
    """Blocks ``slow`` sleep ``delay_s`` in every training forward."""

    def __init__(self, slow: tuple[int, ...], delay_s: float, unpicklable: bool = False) -> None:
        super().__init__()
        torch.manual_seed(99)
        for index in slow:
            self.body[index] = SlowBlock(self.body[index].fc.in_features, delay_s)
        if unpicklable:  # a block holding a lambda cannot travel
            self.body[3].hook = lambda x: _identity(x)


def fit_slow(
    schedule: str,
    steps: int,
    slow: tuple[int, ...] = (2, 3),
    delay_s: float = 0.01,
    ckpt_dir: str | None = None,
    resume: str | None = None,
    unpicklable: bool = False,
    **strategy_kwargs: Any,
) -> dict[str, Any]:
    """Fit ``SlowModel`` for ``steps`` steps, 2 per epoch; with ``ckpt_dir``, save a full
    checkpoint every 2 steps (at the last batch of each epoch, as ``tests/helpers/jobs/node_job.py``
    does); with ``resume``, continue from that checkpoint."""
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=4, **strategy_kwargs)
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, filename="{step}"
            )
        )
    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        enable_checkpointing=ckpt_dir is not None,
    )
    model = SlowModel(slow, delay_s, unpicklable)
    frames = int(counters["frames"]["total"])
    trainer.fit(model, loader(16, n=32), ckpt_path=resume)
    frames = int(counters["frames"]["total"]) - frames
    state = strategy.full_state_dict()
    return {
        "state": state if dist.get_rank() == 0 else None,
        "stage": strategy.stage,
        "balance": list(strategy.partition.balance) if strategy.partition else None,
        "blocks": list(strategy.engine.body.indices),
        "repartitions": [r.describe() for r in strategy.repartitions],
        "frames": frames,  # that torch.compile converted (compiled or skipped) in the fit
        # each block the stage ended with runs compiled (``compile_blocks``: those that arrived too)
        "compiled": [
            getattr(strategy.engine.body.block(i), "_compiled_call_impl", None) is not None
            for i in strategy.engine.body.indices
        ],
    }


def fit_slow_error(**kwargs: Any) -> str:
    """The message of the ValueError a repartitioning fit raises ("no error" if none)."""
    try:
        fit_slow("1f1b", 4, **kwargs)
    except ValueError as err:
        return str(err)
    return "no error"
