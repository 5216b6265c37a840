"""``StageMemoryMonitor``: what every pipeline stage holds, logged per stage on rank 0."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lightning_pipe2bw.callbacks.view import pipeline_strategy, pipeline_view
from lightning_pipe2bw.planner.measure import storage_bytes

__all__ = ["StageMemoryMonitor", "optimizer_state_bytes", "stage_memory"]

log = logging.getLogger(__name__)

# the figures, in the order the table shows them
FIELDS = (
    "params",
    "weight_versions",
    "grads",
    "optimizer_state",
    "activations",
    "activations_peak",
    "activations_partner",
    "activations_host",
    "p2p_in_flight",
    "cuda_allocated_peak",
    "cuda_reserved",
)


def optimizer_state_bytes(trainer: Trainer) -> int:
    """The bytes of this rank's optimizer state: every tensor the trainer's optimizers keep per
    parameter (moments, a delay correction's buffers; this replica's share with
    ``shard_optimizer``)."""
    states = [t for opt in trainer.optimizers for s in opt.state.values() for t in s.values()]
    return storage_bytes(states)


def stage_memory(trainer: Trainer) -> dict[str, int]:
    """This rank's stage: parameter, weight-version, gradient and optimizer-state bytes, live and
    peak stashed activation bytes (counted by the engine through ``saved_tensors_hooks``,
    storages de-duplicated, weights excluded, including what the stage holds for its partner
    under BPipe; the peak since the previous call, which resets it), the partner's bytes held
    here and this stage's bytes swapped to host memory (memory plan ``"swap"``),
    bytes of sends not yet completed, and on CUDA the allocator's peak and reserved bytes."""
    view = pipeline_view(trainer)
    module = trainer.lightning_module
    engine = view.engine if view is not None else None
    params = list(module.parameters())
    driver = view.driver if view is not None else None
    buffers = driver.weight_buffers if driver is not None else 1
    param_bytes = storage_bytes(params)
    out = {
        "params": param_bytes,
        "weight_versions": buffers * param_bytes,
        "grads": storage_bytes(p.grad for p in params),
        "optimizer_state": optimizer_state_bytes(trainer),
        "activations": 0,
        "activations_peak": 0,
        "activations_partner": 0,
        "activations_host": 0,
        "p2p_in_flight": 0,
        "cuda_allocated_peak": 0,
        "cuda_reserved": 0,
    }
    if engine is not None:
        stats = engine.stats
        out["activations"] = stats.activation_bytes
        out["activations_peak"] = stats.peak_activation_bytes
        stats.peak_activation_bytes = stats.activation_bytes  # a peak per logging interval
        out["activations_partner"] = stats.partner_bytes
        out["activations_host"] = stats.host_bytes
        out["p2p_in_flight"] = engine.transport.pending_bytes
    device = view.root_device if view is not None else trainer.strategy.root_device
    if device.type == "cuda":
        out["cuda_allocated_peak"] = torch.cuda.max_memory_allocated(device)
        out["cuda_reserved"] = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
    return out


class StageMemoryMonitor(Callback):
    """Logs what every pipeline stage holds, every ``log_every_n_steps`` (the Trainer's unless
    given): one metric per stage and figure, ``memory/stage<s>/<figure>`` in bytes, to
    Lightning's loggers on rank 0; at the end of fit a table of each stage's largest values (on
    rank 0) and a plot of per-stage memory over the run, ``stage_memory.png`` in the run's log
    directory (or ``default_root_dir``).

    Figures (see :func:`stage_memory`): ``params``, ``weight_versions`` (every weight buffer:
    2 with 2BW), ``grads``, ``optimizer_state``, ``activations`` and ``activations_peak``
    (stashed for backward, exact), ``activations_partner`` (held for the partner stage, BPipe),
    ``activations_host`` (swapped to host memory), ``p2p_in_flight`` (send buffers), ``cuda_allocated_peak`` and
    ``cuda_reserved`` (0 off CUDA). It reads counters only: training is unchanged. Collecting the
    figures is one ``all_gather_object`` per logging step.
    """

    def __init__(self, log_every_n_steps: int | None = None, plot: bool = True) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1 or None, got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self.plot = plot
        self.history: list[tuple[int, list[dict[str, int]]]] = []  # (step, per stage) on rank 0
        self.plot_path: Path | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if pipeline_strategy(trainer) is None:
            raise ValueError(
                "StageMemoryMonitor reports pipeline stages; use it with strategy='pipe2bw' "
                f"(got {type(trainer.strategy).__name__})"
            )
        self.history = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        # the Trainer's setting is an attribute its logger connector sets
        every = self.log_every_n_steps or getattr(trainer, "log_every_n_steps", 50) or 50
        if trainer.global_step % every != 0:
            return
        self._collect(trainer)

    def _collect(self, trainer: Trainer) -> None:
        view = pipeline_view(trainer)
        assert view is not None, "on_fit_start checked the strategy"
        mine = (view.replica, view.stage, stage_memory(trainer))
        everyone: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)  # every rank logs at the same steps
        if not trainer.is_global_zero:
            return
        stages = sorted((stage, figures) for replica, stage, figures in everyone if replica == 0)
        per_stage = [figures for _, figures in stages]
        step = trainer.global_step
        self.history.append((step, per_stage))
        metrics = {
            f"memory/stage{s}/{name}": float(value)
            for s, figures in enumerate(per_stage)
            for name, value in figures.items()
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        folder = Path(trainer.log_dir or trainer.default_root_dir)  # collective: every rank asks
        if not trainer.is_global_zero or not self.history:
            return
        rank_zero_info(self.table())
        if self.plot:
            self.plot_path = self.save_plot(folder / "stage_memory.png")

    def peaks(self) -> list[dict[str, int]]:
        """Each stage's largest value of every figure over the logged steps (rank 0)."""
        out: list[dict[str, int]] = []
        for _, per_stage in self.history:
            for s, figures in enumerate(per_stage):
                if s == len(out):
                    out.append(dict(figures))
                else:
                    out[s] = {k: max(out[s][k], v) for k, v in figures.items()}
        return out

    def table(self) -> str:
        """The per-stage peaks as a text table, in MiB."""
        from rich.console import Console
        from rich.table import Table

        table = Table(title="pipe2bw: largest memory per stage (MiB)")
        table.add_column("stage", justify="right")
        for name in FIELDS:
            table.add_column(name.replace("_", " "), justify="right")
        for s, figures in enumerate(self.peaks()):
            table.add_row(str(s), *(f"{figures[name] / 2**20:.2f}" for name in FIELDS))
        console = Console(width=160, record=True, file=io.StringIO())
        console.print(table)
        return console.export_text()

    def save_plot(self, path: Path) -> Path:
        """Stashed activations and the total of the other figures per stage against step."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path.parent.mkdir(parents=True, exist_ok=True)
        steps = [step for step, _ in self.history]
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        for s in range(len(self.history[0][1])):
            peak = [per_stage[s]["activations_peak"] / 2**20 for _, per_stage in self.history]
            held = [
                (per_stage[s]["weight_versions"] + per_stage[s]["grads"]) / 2**20
                + per_stage[s]["optimizer_state"] / 2**20
                for _, per_stage in self.history
            ]
            top.plot(steps, peak, label=f"stage {s}")
            bottom.plot(steps, held, label=f"stage {s}")
        top.set_ylabel("activations, peak (MiB)")
        bottom.set_ylabel("weights + grads + optimizer (MiB)")
        bottom.set_xlabel("step")
        top.legend()
        top.set_title("pipe2bw: memory per stage")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
