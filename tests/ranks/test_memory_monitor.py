"""``StageMemoryMonitor``: per-stage memory reaches rank 0's loggers, a table and a plot, and
training is unchanged."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
from helpers.models import max_abs_diff


def _fit(schedule: str, folder: str | None) -> dict[str, Any]:
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer
    from lightning.pytorch.loggers import CSVLogger

    from lightning_pipe2bw import Pipe2BWStrategy, StageMemoryMonitor

    monitor = StageMemoryMonitor(log_every_n_steps=2) if folder else None
    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule=schedule, microbatches=4),
        max_steps=6,
        callbacks=[monitor] if monitor else [],
        logger=CSVLogger(folder, name="run") if folder else False,
        default_root_dir=folder,
    )
    model = RegressionModel()
    trainer.fit(model, loader(8))
    strategy: Any = trainer.strategy
    state = strategy.full_state_dict()  # collective
    return {
        "state": state if dist.get_rank() == 0 else None,
        "stage": strategy.stage,
        "param_bytes": sum(p.numel() * p.element_size() for p in strategy.engine.body.parameters()),
        "peaks": monitor.peaks() if monitor and dist.get_rank() == 0 else None,
        "table": monitor.table() if monitor and dist.get_rank() == 0 else None,
        "plot": str(monitor.plot_path) if monitor and monitor.plot_path else None,
        "log_dir": trainer.log_dir,
    }


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_monitor_logs_every_stage_and_changes_nothing(
    pools: Any, tmp_path: Path, schedule: str
) -> None:
    plain = pools(2).run(_fit, schedule, None)
    watched = pools(2).run(_fit, schedule, str(tmp_path))
    assert max_abs_diff(watched[0]["state"], plain[0]["state"]) == 0.0

    rank0 = watched[0]
    peaks = rank0["peaks"]
    assert len(peaks) == 2
    by_stage = {r["stage"]: r for r in watched}
    for s in (0, 1):
        # 2BW: two weight buffers on the first stage; the last one, with no flush in this fit,
        # updates in place (a batch has run its last backward there when its update comes)
        versions = 2 if schedule == "2bw" and s == 0 else 1
        assert peaks[s]["params"] == by_stage[s]["param_bytes"]
        assert peaks[s]["weight_versions"] == versions * by_stage[s]["param_bytes"]
        assert peaks[s]["optimizer_state"] > 2 * by_stage[s]["param_bytes"]  # AdamW: 2 moments
        assert peaks[s]["cuda_reserved"] == 0
    # under 1F1B the first stage stashes p = 2 micro-batches, the last one (equal blocks of the
    # same width, except the projections at both ends)
    assert peaks[0]["activations_peak"] > peaks[1]["activations_peak"] > 0
    assert "largest memory per stage" in rank0["table"]
    assert Path(rank0["plot"]).is_file() and Path(rank0["plot"]).stat().st_size > 0

    rows = list(csv.DictReader(open(Path(rank0["log_dir"]) / "metrics.csv")))
    logged = [r for r in rows if r.get("memory/stage0/activations_peak")]
    assert [int(r["step"]) for r in logged] == [2, 4, 6]
    assert all(float(r["memory/stage1/params"]) == peaks[1]["params"] for r in logged)
