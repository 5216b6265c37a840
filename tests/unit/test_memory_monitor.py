"""``StageMemoryMonitor`` refuses a run without the pipeline strategy. The monitor in training
runs: ``tests/ranks/test_memory_monitor.py``."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_monitor_needs_the_pipeline_strategy(tmp_path: Path) -> None:
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import StageMemoryMonitor

    trainer = quiet_trainer(devices=1, max_steps=1, callbacks=[StageMemoryMonitor()])
    with pytest.raises(ValueError, match="StageMemoryMonitor reports pipeline stages"):
        trainer.fit(RegressionModel(), loader(8))
