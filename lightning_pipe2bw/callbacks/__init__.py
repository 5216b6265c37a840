"""Callbacks that observe or steer the pipeline."""

from lightning_pipe2bw.callbacks.balancer import ActivationBalancer, ActivationBudget
from lightning_pipe2bw.callbacks.memory import StageMemoryMonitor, stage_memory

__all__ = ["ActivationBalancer", "ActivationBudget", "StageMemoryMonitor", "stage_memory"]
