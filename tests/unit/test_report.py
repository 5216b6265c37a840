"""PipelineReport's arithmetic on hand-built timelines: idle shares, the Chrome trace, the
windowed timeline picture, the loss curve and the steady window. The report of real 2-stage fits:
``tests/ranks/test_report.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_pipe2bw.callbacks.timeline import (
    Lane,
    chrome_trace,
    loss_curve_png,
    timeline_png,
    timeline_shares,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# stage 1, seconds from an arbitrary base: recv 1 s, forward 2 s, send 0.5 s, a 1.5 s gap,
# backward 1 s. Wall 6 s, compute 3 s, receives 1 s.
STAGE1 = [
    ("RECV_F", 0, 100.0, 101.0),
    ("F", 0, 101.0, 103.0),
    ("SEND_F", 0, 103.0, 103.5),
    ("B", 0, 105.0, 106.0),
]
# stage 0 starts earlier: the trace's time origin
STAGE0 = [("F", 0, 99.5, 100.0), ("RECV_B", 0, 100.0, 105.0), ("B", 0, 106.0, 106.25)]


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_SIGNATURE


def test_timeline_shares_of_a_known_timeline() -> None:
    shares = timeline_shares(STAGE1)
    assert shares.wall_s == pytest.approx(6.0)
    assert shares.compute_s == pytest.approx(3.0)
    assert shares.recv_s == pytest.approx(1.0)
    assert shares.idle == pytest.approx(0.5)
    assert shares.recv == pytest.approx(1 / 6)
    # stage 0: wall 6.75 s, compute 0.75 s, 5 s blocked waiting for gradients
    shares0 = timeline_shares(STAGE0)
    assert shares0.idle == pytest.approx(1 - 0.75 / 6.75)
    assert shares0.recv == pytest.approx(5 / 6.75)
    # nothing recorded: no wall time, and no division by it
    empty = timeline_shares([])
    assert (empty.wall_s, empty.idle, empty.recv) == (0.0, 0.0, 0.0)


def test_chrome_trace_of_a_known_timeline() -> None:
    trace = chrome_trace([Lane(1, 0, STAGE1), Lane(0, 1, STAGE0)])
    events = trace["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "stage 1 (rank 0)"), (1, "stage 0 (rank 1)")}
    sort = {e["pid"]: e["args"]["sort_index"] for e in events if e["name"] == "process_sort_index"}
    assert sort == {0: 1, 1: 0}
    spans = [(e["pid"], e["name"], e["cat"], e["ts"], e["dur"]) for e in events if e["ph"] == "X"]
    # microseconds from the earliest start of any lane (99.5 s, on stage 0)
    assert spans == [
        (0, "recv activations", "comm", 500_000.0, 1_000_000.0),
        (0, "forward", "compute", 1_500_000.0, 2_000_000.0),
        (0, "send activations", "comm", 3_500_000.0, 500_000.0),
        (0, "backward", "compute", 5_500_000.0, 1_000_000.0),
        (1, "forward", "compute", 0.0, 500_000.0),
        (1, "recv gradients", "comm", 500_000.0, 5_000_000.0),
        (1, "backward", "compute", 6_500_000.0, 250_000.0),
    ]
    assert all(e["args"]["microbatch"] == 0 for e in events if e["ph"] == "X")
    json.dumps(trace)  # plain JSON


def test_timeline_png_windows_long_runs(tmp_path: Path) -> None:
    # 10,000 forwards of 1 ms each per lane: only a window is drawn, and it still renders
    lanes = [
        Lane(
            s,
            1 - s,
            [("F", i, s * 5e-4 + i * 1e-3, s * 5e-4 + i * 1e-3 + 9e-4) for i in range(10_000)],
        )
        for s in range(2)
    ]
    out = timeline_png(lanes, tmp_path / "t.png", window_s=0.5, max_actions=50)
    assert _is_png(out)
    assert _is_png(timeline_png([Lane(0, 0, [])], tmp_path / "empty.png"))


def test_loss_curve_from_sparse_csv(tmp_path: Path) -> None:
    csv = tmp_path / "metrics.csv"
    csv.write_text(
        "epoch,step,train_loss,val_loss\n0,0,1.5,\n0,1,1.25,\n0,1,,1.3\n0,2,1.0,\n0,3,0.75,1.1\n"
    )
    assert _is_png(loss_curve_png(csv, tmp_path / "loss.png"))
    csv.write_text("epoch,step,lr\n0,0,0.1\n")
    with pytest.raises(ValueError, match="no values"):
        loss_curve_png(csv, tmp_path / "none.png")


def test_report_without_a_pipeline_writes_the_loss_curve_only(tmp_path: Path) -> None:
    from helpers.models import RegressionModel, loader, quiet_trainer
    from lightning.pytorch.loggers import CSVLogger

    from lightning_pipe2bw.callbacks.report import PipelineReport

    report = PipelineReport(tmp_path / "report", verbose=False)
    trainer = quiet_trainer(
        devices=1,
        max_steps=3,
        callbacks=[report],
        logger=CSVLogger(tmp_path / "logs", version=0),
        log_every_n_steps=1,
    )
    with pytest.warns(UserWarning, match="no pipeline engine"):
        trainer.fit(RegressionModel(), loader(8))
    assert report.reports is None
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["loss.png"]
    assert _is_png(tmp_path / "report" / "loss.png")


def test_the_steady_window_skips_fills_and_validations() -> None:
    from lightning_pipe2bw.callbacks.timeline import steady_window

    # steps 1..12 of 1 s each, a validation after steps 4 and 8
    steps = [(i, float(i), i + 0.9) for i in range(1, 13)]
    validations = [(4.95, 4.99), (8.95, 8.99)]
    window = steady_window(steps, validations, 3)
    assert window is not None and window.label() == "training steps 10-12"
    assert (window.start, window.end) == (10.0, 12.9)
    # the last run has only the fill step and two more: too short for 3, the one before serves
    assert steady_window(steps[:10], validations, 3) is not None
    assert steady_window(steps[:10], validations, 3).label() == "training steps 6-8"  # type: ignore[union-attr]
    assert steady_window(steps[:3], [], 3) is None  # the first two steps are start-up
