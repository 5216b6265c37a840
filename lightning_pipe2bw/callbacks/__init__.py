"""Callbacks that observe or steer the pipeline."""

from lightning_pipe2bw.callbacks.balancer import ActivationBalancer, ActivationBudget
from lightning_pipe2bw.callbacks.memory import StageMemoryMonitor, stage_memory
from lightning_pipe2bw.callbacks.report import PipelineReport
from lightning_pipe2bw.callbacks.summary import PipelineModelSummary
from lightning_pipe2bw.callbacks.view import PipelineStrategy, PipelineView

__all__ = [
    "ActivationBalancer",
    "ActivationBudget",
    "PipelineModelSummary",
    "PipelineReport",
    "PipelineStrategy",
    "PipelineView",
    "StageMemoryMonitor",
    "stage_memory",
]
