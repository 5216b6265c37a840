"""PipelineReport of real 2-stage fits on the pool: per-stage rows, a timeline picture, a Chrome
trace and a loss curve, written on global rank 0 from what every stage ran. The arithmetic on
hand-built timelines: ``tests/unit/test_report.py``."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
from helpers.models import RegressionModel, default_balance
from unit.test_report import _is_png


def _fit_with_report(schedule: str, root: str, steps: int) -> dict[str, Any]:
    """Runs on every rank: fit with PipelineReport and a CSVLogger, validating every 2 steps."""
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer
    from lightning.pytorch.loggers import CSVLogger

    from lightning_pipe2bw import Pipe2BWStrategy
    from lightning_pipe2bw.callbacks.report import PipelineReport

    report = PipelineReport(Path(root) / "report", verbose=dist.get_rank() == 0)
    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule=schedule, microbatches=2),
        max_steps=steps,
        callbacks=[report],
        logger=CSVLogger(Path(root) / "logs", version=0),
        log_every_n_steps=1,
        limit_val_batches=1,
        val_check_interval=2,
    )
    trainer.fit(RegressionModel(), loader(8), loader(8, n=8))
    rows = None if report.reports is None else [r.row() for r in report.reports]
    return {"rank": dist.get_rank(), "rows": rows}


@pytest.mark.parametrize(("schedule", "versions"), [("2bw", 2), ("1f1b", 1)])
def test_report_of_a_two_stage_fit(
    pools: Any, tmp_path: Path, schedule: str, versions: int
) -> None:
    from helpers.models import RegressionModel

    results = pools(2).run(_fit_with_report, schedule, str(tmp_path), 4)
    assert results[1]["rows"] is None  # the report lives on global rank 0
    out = tmp_path / "report"
    rows = json.loads((out / "stages.json").read_text())
    assert rows == results[0]["rows"]
    assert [(r["stage"], r["rank"], r["num_stages"]) for r in rows] == [(0, 1, 2), (1, 0, 2)]
    # the stages' blocks partition the body, in order
    assert rows[0]["blocks"] + rows[1]["blocks"] == list(range(8))
    assert all(r["blocks"] for r in rows)
    assert sum(r["parameters"] for r in rows) == sum(
        p.numel() for p in RegressionModel().parameters()
    )
    assert [r["weight_versions"] for r in rows] == [versions, versions]
    for r in rows:
        assert r["peak_activation_bytes"] > 0
        assert 0.0 <= r["idle"] < 1.0
        assert 0.0 <= r["recv"] <= r["idle"]
        assert r["compute_s"] > 0 and r["wall_s"] >= r["compute_s"] + r["recv_s"]
        assert math.isclose(r["idle"], 1 - r["compute_s"] / r["wall_s"])

    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"]
    named = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert named == {0: "stage 1 (rank 0)", 1: "stage 0 (rank 1)"}
    for pid in (0, 1):
        names = {e["name"] for e in events if e["ph"] == "X" and e["pid"] == pid}
        assert {"forward", "backward"} <= names, (pid, names)
    comm = {e["name"] for e in events if e["ph"] == "X" and e["cat"] == "comm"}
    assert comm == {"send activations", "recv activations", "send gradients", "recv gradients"}
    assert min(e["ts"] for e in events if e["ph"] == "X") == 0.0

    assert _is_png(out / "timeline.png")
    assert _is_png(out / "loss.png")
    metrics = (tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "train_loss" in metrics and "val_loss" in metrics


def _fit_for_window(root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy
    from lightning_pipe2bw.callbacks.report import PipelineReport

    report = PipelineReport(Path(root) / "report", verbose=False, window_steps=3)
    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule="2bw", microbatches=2),
        max_steps=12,
        callbacks=[report],
        limit_val_batches=2,
        val_check_interval=4,
    )
    trainer.fit(RegressionModel(), loader(8, n=128), loader(8, n=16))
    return {"window": None if report.window is None else report.window.label()}


def test_the_timeline_shows_steady_training_not_the_final_validation(
    pools: Any, tmp_path: Path
) -> None:
    """The run ends with a validation (forwards only); the pictures show training steps."""
    results = pools(2).run(_fit_for_window, str(tmp_path))
    assert results[0]["window"] == "training steps 10-12"
    trace = json.loads((tmp_path / "report" / "trace.json").read_text())
    assert trace["metadata"] == {"shows": "training steps 10-12"}
    for pid in (0, 1):  # both stages run forwards and backwards in the window
        names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid}
        assert {"forward", "backward"} <= names, (pid, names)


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_report_and_memory_monitor_with_two_stages_per_rank(
    pools: Any, tmp_path: Path, schedule: str
) -> None:
    """With virtual stages the report has a row per rank (its place in the pipeline), holding
    the blocks of both its stages; the timeline is the one that ran (I and W under ZB-V)."""
    results = pools(2).run(_fit_with_report, schedule, str(tmp_path), 4)
    rows = json.loads((tmp_path / "report" / "stages.json").read_text())
    assert rows == results[0]["rows"]
    assert sorted(b for r in rows for b in r["blocks"]) == list(range(8))
    bounds = [0, *itertools.accumulate(default_balance(RegressionModel().body, schedule, 2))]
    mine = [0, 3] if schedule == "zb-v" else [0, 2]
    assert rows[0]["blocks"] == [b for v in mine for b in range(bounds[v], bounds[v + 1])]
    assert all(r["split"].startswith("split: parameters that multiply;") for r in rows)
    assert rows[0]["stages"] == mine
    assert rows[1]["stages"] == ([1, 2] if schedule == "zb-v" else [1, 3])
    for r in rows:  # per stage: each holds some, and together at least the rank's peak
        per_stage = r["stage_peak_activation_bytes"]
        assert len(per_stage) == 2 and all(b > 0 for b in per_stage)
        assert max(per_stage) <= r["peak_activation_bytes"] <= sum(per_stage)
    assert (tmp_path / "report" / "timeline.png").is_file()
