"""The main job's Hydra entry point: train the byte-level GPT pipelined over 2 CPU processes.

    python -m lightning_pipe2bw.train                                   # 1F1B with Muon, ~80 s on 2 cores
    python -m lightning_pipe2bw.train strategy=1f1b strategy.microbatches=8 \\
        trainer.max_steps=50 model=tiny
    python -m lightning_pipe2bw.train -m strategy=gpipe,1f1b,2bw         # a sweep, one row each

``python -m lightning_pipe2bw.recipes.gpt.train`` is the same command (``lightning_pipe2bw.train``
only runs this module's ``main``).

Configs: ``configs/`` at the root of the repository, found from this file's location
(:data:`CONFIGS`, an absolute path), so the package must be installed in editable mode
(``pip install -e .``) or run from a checkout; with any other install pass the folder as
``--config-path /abs/path/to/configs``. The configs are recipes, not library code, so they are
not packaged.

Outputs: each run writes into Hydra's run directory (``outputs/<date>/<time>`` under the current
directory; sweeps into ``outputs/multirun/<date>/<time>/<job number>``): ``metrics.csv`` (the
``CSVLogger``), ``checkpoints/``, what ``PipelineReport`` writes (``stages.json``,
``timeline.png``, ``trace.json``, ``loss.png``) and ``result.json`` (final losses and
throughput). At the end of a sweep ``SweepSummary`` prints one row per run and writes the table
to ``summary.md`` (and ``summary.json``) in the sweep directory.

Launching: ``strategy.start_method=auto`` (the default) uses ``popen`` for a single run and
``spawn`` under ``-m``; see ``lightning_pipe2bw.config.resolve_start_method`` for why.
"""

from __future__ import annotations

import json
import logging
import math
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback as HydraCallback
from hydra.types import RunMode
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig

from lightning_pipe2bw.callbacks import PipelineReport
from lightning_pipe2bw.recipes.gpt.config import (
    TrainConfig,
    build_datamodule,
    build_model,
    build_strategy,
    check_config,
    register_configs,
    resolve_start_method,
    to_train_config,
    trainer_kwargs,
)

__all__ = [
    "RESULT_FILE",
    "SUMMARY_FILE",
    "RunResult",
    "StepProgressBar",
    "SweepSummary",
    "build_callbacks",
    "format_table",
    "main",
    "run",
    "summarize_sweep",
]

# the repository's configs/ (three levels above lightning_pipe2bw/recipes/gpt/)
CONFIGS = Path(__file__).resolve().parents[3] / "configs"
RESULT_FILE = "result.json"
SUMMARY_FILE = "summary.md"

log = logging.getLogger(__name__)

register_configs()

# What a newcomer would otherwise read on every rank, and can do nothing about: torch's
# deprecation notice raised inside Lightning's own pytree helper (as on one device), and the
# CSVLogger's note that it writes into Hydra's run directory, which Hydra made (on purpose).
warnings.filterwarnings(
    "ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning
)
warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")


class RunResult(Callback):
    """Writes ``result.json`` on global rank 0 (the last stage, which holds the losses) at the
    end of fit: final metrics, steps, and training throughput with validation time left out."""

    def __init__(self, out_dir: str | Path, batch_size: int, meta: dict[str, Any]) -> None:
        self.out_dir = Path(out_dir)
        self.batch_size = batch_size
        self.meta = dict(meta)
        self._train_start = 0.0
        self._train_s = 0.0
        self._val_start = 0.0
        self._val_s = 0.0
        self._start_step = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._train_start = time.perf_counter()
        self._val_s = 0.0
        self._start_step = trainer.global_step

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_s += time.perf_counter() - self._val_start

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._train_s = time.perf_counter() - self._train_start - self._val_s

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        steps = trainer.global_step - self._start_step
        metrics = {k: _number(v) for k, v in trainer.callback_metrics.items()}
        result = {
            **self.meta,
            "steps": trainer.global_step,
            "train_loss": metrics.get("train_loss"),
            "val_loss": metrics.get("val_loss"),
            "val_ppl": metrics.get("val_ppl"),
            "train_s": round(self._train_s, 3),
            "samples_per_s": (
                round(steps * self.batch_size / self._train_s, 2) if self._train_s > 0 else None
            ),
            "out_dir": str(self.out_dir),
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


class StepProgressBar(RichProgressBar):
    """``RichProgressBar`` that reads ``Epoch 0`` rather than ``Epoch 0/-2`` when training is
    bounded by ``max_steps`` (``max_epochs=-1``)."""

    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        if trainer.max_epochs is not None and trainer.max_epochs < 0:
            description = f"Epoch {current_epoch}"
            return f"{description:{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)


def build_callbacks(cfg: TrainConfig, out_dir: Path, meta: dict[str, Any]) -> list[Callback]:
    """``RunResult``, the progress bar and, with ``cfg.report``, ``PipelineReport``."""
    callbacks: list[Callback] = [RunResult(out_dir, cfg.data.batch_size, meta)]
    if cfg.trainer.enable_progress_bar:
        callbacks.append(StepProgressBar())
    if cfg.report:
        callbacks.append(PipelineReport(out_dir))
    return callbacks


def run(
    cfg: TrainConfig, out_dir: Path, *, multirun: bool = False, meta: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """Train as ``cfg`` says, writing into ``out_dir``; global rank 0 returns the result."""
    check_config(cfg)
    if multirun and cfg.strategy.start_method == "popen":
        log.warning(
            "strategy.start_method=popen under -m: every re-run rank runs the whole sweep in step "
            "with this process (and writes a sweep folder of its own); use auto or spawn"
        )
    seed_everything(cfg.seed, workers=True)
    strategy = build_strategy(cfg.strategy, multirun=multirun)
    meta = {
        **(meta or {}),
        "schedule": cfg.strategy.schedule,
        "microbatches": strategy.microbatches,
        "stages": cfg.trainer.devices * cfg.trainer.num_nodes,
        "start_method": resolve_start_method(cfg.strategy.start_method, multirun),
        "batch_size": cfg.data.batch_size,
    }
    trainer = Trainer(
        **trainer_kwargs(cfg.trainer),
        strategy=strategy,
        logger=CSVLogger(save_dir=out_dir, name="", version=""),  # out_dir/metrics.csv
        callbacks=build_callbacks(cfg, out_dir, meta),
        default_root_dir=out_dir,
    )
    start = time.perf_counter()
    trainer.fit(build_model(cfg.model), datamodule=build_datamodule(cfg.data))
    wall_s = time.perf_counter() - start
    if not trainer.is_global_zero:
        return None
    # written by RunResult on rank 0, here or (spawn) in the rank-0 worker; the wall time
    # includes starting the workers and reading the data
    path = out_dir / RESULT_FILE
    result: dict[str, Any] = json.loads(path.read_text()) if path.exists() else dict(meta)
    result["wall_s"] = round(wall_s, 2)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="train")
def main(dcfg: DictConfig) -> float | None:
    """Hydra's task function; returns the final validation loss (for sweepers that optimise)."""
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    meta = {
        "job": hydra_cfg.job.num if multirun else 0,
        "overrides": list(hydra_cfg.overrides.task),
    }
    result = run(
        to_train_config(dcfg), Path(hydra_cfg.runtime.output_dir), multirun=multirun, meta=meta
    )
    if result is None:
        return None
    val_loss = result.get("val_loss")
    return float(val_loss) if val_loss is not None else None


class SweepSummary(HydraCallback):
    """At the end of a ``-m`` sweep: one row per run from its ``result.json``, printed and written
    to ``summary.md`` and ``summary.json`` in the sweep directory. Runs that wrote no result
    (failed or killed) are listed as such."""

    columns = (
        ("job", "job"),
        ("schedule", "schedule"),
        ("microbatches", "m"),
        ("steps", "steps"),
        ("train_loss", "train loss"),
        ("val_loss", "val loss"),
        ("val_ppl", "val ppl"),
        ("samples_per_s", "samples/s"),
        ("wall_s", "wall s"),
        ("overrides", "overrides"),
    )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        rows = summarize_sweep(sweep_dir)
        common = _common_overrides(rows)
        shown = [
            {**row, "overrides": [o for o in row.get("overrides", []) if o not in common]}
            for row in rows
        ]
        table = format_table(shown, self.columns)
        every = f"overrides of every run: {' '.join(common) or '(none)'}"
        (sweep_dir / SUMMARY_FILE).write_text(f"# Sweep {sweep_dir}\n\n{every}\n\n{table}\n")
        (sweep_dir / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
        print(f"\nSweep summary ({len(rows)} runs, {sweep_dir / SUMMARY_FILE}; {every}):\n{table}")


def summarize_sweep(sweep_dir: Path) -> list[dict[str, Any]]:
    """One dict per job directory of ``sweep_dir`` (a folder holding Hydra's ``.hydra``), in job
    order; a job without ``result.json`` gets ``{"job": <dir>, "status": "no result"}``."""
    rows: list[dict[str, Any]] = []
    for job_dir in sorted({p.parent for p in sweep_dir.rglob(".hydra")}, key=_job_order):
        result = job_dir / RESULT_FILE
        if result.exists():
            rows.append(json.loads(result.read_text()))
        else:
            rows.append({"job": job_dir.name, "schedule": "(no result.json)"})
    return rows


def _common_overrides(rows: list[dict[str, Any]]) -> list[str]:
    """The overrides that every run with a result shares, in the first run's order."""
    lists = [row["overrides"] for row in rows if isinstance(row.get("overrides"), list)]
    if len(lists) < 2:
        return []
    return [o for o in lists[0] if all(o in other for other in lists[1:])]


def _job_order(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (1 << 30, str(path))


def format_table(rows: list[dict[str, Any]], columns: tuple[tuple[str, str], ...]) -> str:
    """A Markdown table, aligned so it also reads as plain text."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4g}"
        if isinstance(value, list):
            return " ".join(str(v) for v in value)
        return str(value)

    header = [title for _, title in columns]
    body = [[cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in body
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
