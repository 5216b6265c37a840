"""The model summary of a pipelined fit shows the whole model, every block labelled with its
stage (before: rank 0's stage only, e.g. 429 K of the GPT's 875 K parameters)."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from helpers.models import RegressionModel, loader, quiet_trainer
from lightning.pytorch.callbacks import ModelSummary

from lightning_pipe2bw import Pipe2BWStrategy


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fit_with_summary() -> str:
    capture = _Capture()
    logger = logging.getLogger("lightning.pytorch.callbacks.model_summary")
    logger.addHandler(capture)
    logger.setLevel(logging.INFO)
    try:
        trainer = quiet_trainer(
            devices=dist.get_world_size(),
            strategy=Pipe2BWStrategy(schedule="1f1b", microbatches=2),
            max_steps=1,
            enable_model_summary=True,
            callbacks=[ModelSummary(max_depth=1)],  # the plain one: it logs its table
        )
        trainer.fit(RegressionModel(), loader(8))
    finally:
        logger.removeHandler(capture)
    return "\n".join(capture.lines)


def test_the_summary_shows_every_stage(pools: Any) -> None:
    rank0, rank1 = pools(2).run(_fit_with_summary)
    assert rank1 == ""  # printed once, on global rank 0
    print(rank0)
    rows = [line.split("|") for line in rank0.splitlines() if line.count("|") >= 5]
    header, body = [c.strip() for c in rows[0]], rows[1:]
    assert header[:3] == ["", "Name", "Type"]
    names = [c[1].strip() for c in body]
    # the 8 blocks of RegressionModel's body, 4 per stage
    assert names == [f"body.{i} (stage {i // 4})" for i in range(8)], names
    total = sum(p.numel() for p in RegressionModel().parameters())
    assert f"{total / 1000:.1f} K" in rank0 and "Total params" in rank0
