"""``ActivationBalancer``: the callback that turns on BPipe activation balancing.

The arithmetic (how many micro-batches a stage stashes, the share it hands to its partner, the
budget) lives with the offload pass in ``lightning_pipe2bw.schedule.offload``; it is re-exported
here for the callback's users.
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_pipe2bw.callbacks.view import pipeline_strategy
from lightning_pipe2bw.schedule.offload import ActivationBudget

__all__ = ["ActivationBalancer", "ActivationBudget"]


class ActivationBalancer(Callback):
    """Turns on BPipe activation balancing for a ``pipe2bw`` fit (the same as the strategy's
    ``balance_activations`` option): each stage s with a partner p-1-s that stashes fewer
    micro-batches sends part of every micro-batch's saved activations to it after the forward
    and takes them back before the backward (see ``docs/memory.md``). Results are bitwise
    unchanged; the transfers run on threads of their own, overlapping compute.

    Args:
        budget_microbatches: what an evicting stage may keep at its peak, in micro-batches of
            its own saved activations (>= 1).
        budget_bytes: the same in bytes, decided for each micro-batch from its own size.

    With neither, every pair's peaks are made equal (the balanced share).
    """

    def __init__(
        self, budget_microbatches: float | None = None, budget_bytes: int | None = None
    ) -> None:
        self.budget = ActivationBudget(budget_microbatches, budget_bytes)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = pipeline_strategy(trainer)
        if strategy is None:
            raise ValueError(
                "ActivationBalancer moves activations between pipeline stages; use it with "
                f"strategy='pipe2bw' (got {type(trainer.strategy).__name__})"
            )
        strategy.activation_budget = self.budget
