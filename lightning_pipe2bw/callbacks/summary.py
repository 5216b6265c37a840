"""The model summary of a pipeline: the whole model, block by block, each labelled with its stage.

Lightning's ``ModelSummary`` describes the module in rank 0's process, which under pipe2bw holds
the last stage's blocks only (and a model with an ``example_input_array`` would run that partial
body outside a pipelined step). :class:`PipelineModelSummary` takes the place of the Trainer's
summary callback (``ModelSummary`` or ``RichModelSummary``, which still draws the table): every
rank describes its stage's blocks, rank 0 gathers them (one collective) and prints one table: each
block named with its stage (``body.3 (stage 1)``), the modules outside the body, and totals over
the whole model. No forward runs, so the FLOPs that Lightning measures with an example input are
not measured (``-``).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from torch import nn

from lightning_pipe2bw import compat
from lightning_pipe2bw.callbacks.view import pipeline_view
from lightning_pipe2bw.runtime.stage import StageBody

__all__ = ["PipelineModelSummary", "use_pipeline_summary"]

# (stage or None for outside the body, name, type, parameters, trainable, bytes, training,
# submodules in training mode, submodules in eval mode)
Row = tuple[int | None, str, str, int, int, int, bool, int, int]


class PipelineModelSummary(Callback):
    """Prints the whole pipelined model at the start of fit, in the style of ``inner`` (the
    summary callback it replaces)."""

    def __init__(self, inner: ModelSummary) -> None:
        self.inner = inner

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not compat.summary_depth(self.inner):
            return
        view = pipeline_view(trainer)
        assert view is not None and view.engine is not None, "set up by a pipeline strategy"
        rows = _stage_rows(pl_module, view.engine.body, view.stage, view.replica)
        everyone: list[Any] = [rows]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size() if trainer.is_global_zero else []
            dist.gather_object(rows, everyone if trainer.is_global_zero else None, dst=0)
        if not trainer.is_global_zero:
            return
        merged = sorted({r for part in everyone for r in part}, key=_order)
        trainable = sum(r[4] for r in merged)
        total = sum(r[3] for r in merged)
        size_mb = sum(r[5] for r in merged) / 1e6
        modes = {"train": sum(r[7] for r in merged), "eval": sum(r[8] for r in merged)}
        # Lightning's columns (its Rich table names them itself); the stage goes with the name
        data = [
            (" ", [str(i) for i in range(len(merged))]),
            ("Name", [_name(r) for r in merged]),
            ("Type", [r[2] for r in merged]),
            ("Params", [get_human_readable_count(r[3]) for r in merged]),
            ("Mode", ["train" if r[6] else "eval" for r in merged]),
            ("FLOPs", ["-" for _ in merged]),  # not measured: no forward runs
        ]
        self.inner.summarize(
            data,
            total,
            trainable,
            size_mb,
            modes,
            total_flops=0,
            **compat.summary_options(self.inner),
        )

    @property
    def state_key(self) -> str:
        return self.inner.state_key  # checkpoints know it by the callback it replaces

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


def _name(row: Row) -> str:
    where = "outside the body: every stage" if row[0] is None else f"stage {row[0]}"
    return f"{row[1]} ({where})"


def _order(row: Row) -> tuple[int, int, str]:
    stage, name = row[0], row[1]
    index = name.rsplit(".", 1)[-1]
    return (0 if stage is not None else 1, int(index) if index.isdigit() else 0, name)


def _stage_rows(module: nn.Module, body: StageBody, stage: int, replica: int) -> list[Row]:
    """This stage's blocks and the modules outside the body (the same on every rank, so
    duplicates merge), under their names in ``module``; nothing from the other replicas,
    which hold the same blocks."""
    path = next((n for n, m in module.named_modules() if m is body), None)
    rows: list[Row] = []
    if replica != 0:
        return rows  # the replicas hold the same blocks
    for index, block in zip(body.indices, body.children(), strict=True):
        rows.append((stage, f"{path}.{index}", type(block).__name__, *_counts(block)))
    for name, child in module.named_children():
        if child is not body and name:
            rows.append((None, name, type(child).__name__, *_counts(child)))
    return rows


def _counts(module: nn.Module) -> tuple[int, int, int, bool, int, int]:
    params = list(module.parameters())
    modes = [m.training for m in module.modules()]
    return (
        sum(p.numel() for p in params),
        sum(p.numel() for p in params if p.requires_grad),
        sum(p.numel() * p.element_size() for p in params),
        module.training,
        modes.count(True),
        modes.count(False),
    )


def use_pipeline_summary(trainer: Trainer) -> None:
    """Replace the Trainer's model summary callback by a :class:`PipelineModelSummary`."""
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    for i, callback in enumerate(callbacks):
        if isinstance(callback, ModelSummary):
            callbacks[i] = PipelineModelSummary(callback)
