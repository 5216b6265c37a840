"""What every pipeline stage held and did during fit: a table, JSON rows, a timeline, a trace
(``PipelineReport``; the timeline's data and pictures are ``callbacks/timeline.py``'s, re-exported
here)."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_warn

from lightning_pipe2bw.callbacks.memory import optimizer_state_bytes
from lightning_pipe2bw.callbacks.timeline import (
    Lane,
    StepWindow,
    TimedAction,
    chrome_trace,
    in_window,
    loss_curve_png,
    steady_window,
    timed_actions,
    timeline_png,
    timeline_shares,
)
from lightning_pipe2bw.callbacks.view import pipeline_view
from lightning_pipe2bw.pipeline.fsdp import local_elements

__all__ = ["PipelineReport"]


@dataclass
class StageReport:
    """One rank's stage: what it owns and holds, and how busy it was. ``timeline`` (the last
    recorded actions) is shipped to rank 0 for the pictures; :meth:`row` leaves it out."""

    stage: int
    rank: int
    num_stages: int
    host: str
    blocks: list[int]
    parameters: int
    weight_versions: int
    optimizer_state_bytes: int
    peak_activation_bytes: int
    idle: float
    recv: float
    wall_s: float
    compute_s: float
    recv_s: float
    actions_recorded: int
    # the pipeline's stages this rank holds (several with virtual stages), and the peak of
    # each one's own saved bytes (one stage: the rank's peak)
    stages: list[int] = field(default_factory=list)
    stage_peak_activation_bytes: list[int] = field(default_factory=list)
    # how the body was cut (the same on every rank): the rule and the modelled costs
    split: str = ""
    timeline: list[TimedAction] = field(default_factory=list, repr=False)

    def row(self) -> dict[str, Any]:
        row = asdict(self)
        del row["timeline"]
        return row

    @property
    def lane(self) -> Lane:
        return Lane(self.stage, self.rank, self.timeline)


def stage_report(
    trainer: Trainer, pl_module: LightningModule, max_actions: int = 5000
) -> StageReport | None:
    """This rank's :class:`StageReport`, read from a pipeline strategy's view
    (:class:`~lightning_pipe2bw.callbacks.view.PipelineView`: the stage, and the engine's body and
    ``stats``). Returns None for a strategy without an engine (not a pipeline, or fit never built
    one). Local: no
    communication. Idle and receive shares cover the whole recorded timeline (the engine keeps
    the most recent 20,000 actions); ``timeline`` keeps the last ``max_actions`` of them."""
    view = pipeline_view(trainer)
    engine = view.engine if view is not None else None
    if view is None or engine is None:
        return None
    stats = engine.stats
    actions = timed_actions(stats.timeline)
    shares = timeline_shares(actions)
    body = engine.body
    return StageReport(
        stage=view.stage,
        rank=trainer.global_rank,
        num_stages=view.num_stages,
        host=socket.gethostname(),
        blocks=[int(i) for i in body.indices],
        # the stage's own (after fit the module holds the whole model again)
        # (with fsdp=True: the shard this rank holds)
        parameters=local_elements((body or pl_module).parameters()),
        weight_versions=stats.max_weight_versions,
        optimizer_state_bytes=optimizer_state_bytes(trainer),
        peak_activation_bytes=stats.peak_activation_bytes,
        idle=shares.idle,
        recv=shares.recv,
        wall_s=shares.wall_s,
        compute_s=shares.compute_s,
        recv_s=shares.recv_s,
        actions_recorded=len(actions),
        stages=list(engine.virtual.stages),
        stage_peak_activation_bytes=[
            stats.stage_peak_bytes.get(v, stats.peak_activation_bytes)
            for v in engine.virtual.stages
        ],
        split=view.split.describe() if view.split is not None else "",
        timeline=actions[max(len(actions) - max_actions, 0) :],
    )


def gather_reports(report: StageReport) -> list[StageReport] | None:
    """Every rank's report on global rank 0, sorted by stage then rank; None on other ranks.
    Collective when ``torch.distributed`` is initialised (every rank must call it); a plain
    single-process run returns ``[report]``."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [report]
    is_root = dist.get_rank() == 0
    gathered: list[Any] | None = [None] * dist.get_world_size() if is_root else None
    dist.gather_object(report, gathered, dst=0)
    if gathered is None:
        return None
    return sorted(gathered, key=lambda r: (r.stage, r.rank))


def _format_blocks(blocks: Sequence[int]) -> str:
    """Contiguous runs as ranges: [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for b in blocks:
        if runs and b == runs[-1][1] + 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _mib(nbytes: int) -> str:
    mib = nbytes / 2**20
    return f"{mib:,.2f}" if mib >= 0.1 or mib == 0 else f"{mib:.2g}"


def print_stage_table(reports: Sequence[StageReport]) -> None:
    """Print one row per stage with ``rich``, and under it the rule that split the body."""
    from rich.console import Console
    from rich.table import Table

    split = next((r.split for r in reports if r.split), "")
    table = Table(title="pipeline stages", caption=split or None, caption_justify="left")
    table.add_column("stage", justify="right")
    table.add_column("rank", justify="right")
    table.add_column("blocks")
    columns = ("parameters", "weight\nversions", "optimizer\nstate\n(MiB)", "peak\nactivation\n(MiB)")
    for name in (*columns, "idle %", "recv %"):
        table.add_column(name, justify="right")
    for r in reports:
        table.add_row(
            str(r.stage),
            str(r.rank),
            _format_blocks(r.blocks),
            f"{r.parameters:,}",
            str(r.weight_versions),
            _mib(r.optimizer_state_bytes),
            _mib(r.peak_activation_bytes),
            f"{100 * r.idle:.1f}",
            f"{100 * r.recv:.1f}",
        )
    # a log or a pipe gets the whole table, not rich's 80 columns
    Console(width=None if sys.stdout.isatty() else 120).print(table)


class PipelineReport(Callback):
    """At the end of fit, report every pipeline stage and write pictures of the run.

    Every rank reads its stage from the strategy (:func:`stage_report`) and ships it to global
    rank 0 (a collective ``gather_object``), which prints a table (:func:`print_stage_table`)
    and writes into ``out_dir``: ``stages.json`` (the rows), ``timeline.png``
    (:func:`timeline_png`) and ``trace.json`` (:func:`chrome_trace`). If the trainer has a
    ``CSVLogger``, rank 0 also writes ``loss.png`` (:func:`loss_curve_png`).

    With a strategy that is not a pipeline (no ``engine``), the stage files are skipped with a
    warning; ``loss.png`` is still written. Idle and receive shares are defined in
    :class:`TimelineShares`. The pictures put every rank's ``time.perf_counter`` on one axis,
    which is right for ranks on one Linux host (one CLOCK_MONOTONIC); with several hosts the
    rows are offset by the hosts' clock difference (a warning says so).

    Args:
        out_dir: where the files go (created on rank 0).
        max_actions: how many of its most recent actions each rank ships for the pictures.
        window_steps: how many steady-state training steps ``timeline.png`` shows (the latest
            ones that no validation interrupts, see :func:`steady_window`).
        trace_steps: how many ``trace.json`` holds (the same choice, longer).
        window_s: without enough training steps (a short fit), seconds of the run (the end)
            that ``timeline.png`` shows instead.
        window_actions: then, at most this many actions per stage in ``timeline.png``.
        verbose: print the table.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        max_actions: int = 5000,
        window_steps: int = 3,
        trace_steps: int = 20,
        window_s: float = 2.0,
        window_actions: int = 200,
        verbose: bool = True,
    ) -> None:
        missing = [m for m in ("matplotlib", "rich") if importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(
                f"PipelineReport needs {' and '.join(missing)}: pip install {' '.join(missing)}"
            )
        self.out_dir = Path(out_dir)
        self.max_actions = max_actions
        self.window_steps = window_steps
        self.trace_steps = trace_steps
        self.window_s = window_s
        self.window_actions = window_actions
        self.verbose = verbose
        self.reports: list[StageReport] | None = None  # on global rank 0, after fit
        self.window: StepWindow | None = None  # what timeline.png shows (rank 0)
        self._steps: list[tuple[int, float, float]] = []  # (global step, start, end)
        self._validations: list[tuple[float, float]] = []
        self._started = self._started_validation = 0.0

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._steps.append((trainer.global_step, self._started, time.perf_counter()))

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started_validation = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._validations.append((self._started_validation, time.perf_counter()))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # after the strategy's on_train_end: the final flush of a 2BW pipeline is in the timeline
        report = stage_report(trainer, pl_module, self.max_actions)
        reports = gather_reports(report) if report is not None else None
        if trainer.global_rank != 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if report is None:
            rank_zero_warn(
                f"PipelineReport: {type(trainer.strategy).__name__} runs no pipeline engine; "
                "no stage report is written (use Pipe2BWStrategy)"
            )
        elif reports is not None:
            self.reports = reports
            self._write_stages(reports)
        self._write_loss(trainer)

    def _write_stages(self, reports: list[StageReport]) -> None:
        if self.verbose:
            print_stage_table(reports)
        if len({r.host for r in reports}) > 1:
            rank_zero_warn(
                "PipelineReport: stages ran on several hosts; their perf_counter clocks are not "
                "aligned, so timeline.png and trace.json offset the hosts' rows arbitrarily"
            )
        rows = [r.row() for r in reports]
        (self.out_dir / "stages.json").write_text(json.dumps(rows, indent=2) + "\n")
        lanes = [r.lane for r in reports]
        # steady-state training (rank 0's steps: the last stage's), not the final validation
        self.window = steady_window(self._steps, self._validations, self.window_steps)
        traced = steady_window(self._steps, self._validations, self.trace_steps) or self.window
        trace = chrome_trace(in_window(lanes, traced))
        if traced is not None:
            trace["metadata"] = {"shows": traced.label()}
        (self.out_dir / "trace.json").write_text(json.dumps(trace))
        timeline_png(
            lanes,
            self.out_dir / "timeline.png",
            window_s=self.window_s,
            max_actions=self.window_actions,
            window=self.window,
        )

    def _write_loss(self, trainer: Trainer) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                logger.save()
                metrics = Path(logger.log_dir) / "metrics.csv"
                if not metrics.is_file():
                    rank_zero_warn(f"PipelineReport: {metrics} does not exist; no loss.png")
                    return
                try:
                    loss_curve_png(metrics, self.out_dir / "loss.png")
                except ValueError as err:
                    rank_zero_warn(f"PipelineReport: no loss.png: {err}")
                return
