"""What the callbacks read of a pipeline strategy: ``PipelineView``, a typed read-only view, and
``PipelineStrategy``, the protocol of a strategy that gives one (``Pipe2BWStrategy``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from lightning.pytorch import Trainer

from lightning_pipe2bw.partition.balance import Split
from lightning_pipe2bw.runtime.driver import Driver
from lightning_pipe2bw.runtime.engine import PipelineEngine
from lightning_pipe2bw.schedule.offload import ActivationBudget

__all__ = ["PipelineStrategy", "PipelineView", "pipeline_strategy", "pipeline_view"]


@dataclass(frozen=True)
class PipelineView:
    """This rank's place in the pipeline and what runs its stage, as the strategy has them now
    (``engine``, ``driver`` and ``split``: None before set-up; live repartitioning replaces the
    driver and the split, so take a new view rather than keeping one)."""

    stage: int
    num_stages: int
    replica: int
    root_device: torch.device
    engine: PipelineEngine | None
    driver: Driver | None
    split: Split | None = None  # the blocks per stage and the rule that chose them


@runtime_checkable
class PipelineStrategy(Protocol):
    """A strategy that runs a pipeline stage on each rank."""

    # BPipe's budget (None: off); the ``ActivationBalancer`` callback sets it
    activation_budget: ActivationBudget | None

    def pipeline_view(self) -> PipelineView:
        """This rank's :class:`PipelineView`."""
        ...


def pipeline_strategy(trainer: Trainer) -> PipelineStrategy | None:
    """The trainer's strategy if it runs a pipeline, else None."""
    strategy = trainer.strategy
    return strategy if isinstance(strategy, PipelineStrategy) else None


def pipeline_view(trainer: Trainer) -> PipelineView | None:
    """The trainer's pipeline as its strategy has it now; None for a strategy that runs none."""
    strategy = pipeline_strategy(trainer)
    return strategy.pipeline_view() if strategy is not None else None
