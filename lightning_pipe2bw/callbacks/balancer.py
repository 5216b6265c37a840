"""BPipe activation balancing: early stages hand saved activations to their partner stage.

Under a 1F1B stream (``"1f1b"``, ``"2bw"``, ``"pipedream"``) stage s of p keeps
``n_s = min(p - s, m)`` micro-batches of saved activations at its peak, the last stage one: the
first stage runs out of memory long before the others. BPipe pairs stage s with its partner
``q = p - 1 - s``, which keeps ``n_q = min(s + 1, m)``: right after each forward, stage s sends a
share ``e`` of that micro-batch's saved bytes to q (EVICT), q holds them and sends them back
(RETURN) before its own backward of that micro-batch, and s takes them back (LOAD) just before
it needs them. With every micro-batch's saved bytes ``A`` equal, stage s's peak is then
``A (n_s - (n_s - 1) e)`` (the newest micro-batch is whole until it has been evicted; the
others keep ``1 - e``), and q's is at most ``A (n_q + n_s e)`` (its own, and the shares of the
micro-batches s has in flight). The *balanced share* makes the two equal:

    e = (n_s - n_q) / (2 n_s - 1),

e.g. for p = 4: 3/7 for stage 0 (peaks 4 -> 2.71 micro-batches, stage 3's 1 -> 2.71) and 1/5
for stage 1 (3 -> 2.6, stage 2's 2 -> 2.6). A budget in micro-batches ``b`` asks for
``n_s - (n_s - 1) e <= b``; a budget in bytes ``B`` is the same with ``b = B / A``, decided for
each micro-batch from its own saved bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["ActivationBalancer", "ActivationBudget", "evict_share", "stashed_microbatches"]


def stashed_microbatches(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> int:
    """How many micro-batches' saved activations stage ``stage`` holds at its peak."""
    if schedule == "gpipe":
        return num_microbatches
    return min(num_stages - stage, num_microbatches)


@dataclass(frozen=True)
class ActivationBudget:
    """What an evicting stage may keep: ``microbatches`` of its own saved activations, or
    ``bytes`` of them; neither: the balanced share (the pair's peaks equal)."""

    microbatches: float | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        if self.microbatches is not None and self.bytes is not None:
            raise ValueError(
                "give the activation budget in micro-batches or in bytes, not both "
                f"(got microbatches={self.microbatches}, bytes={self.bytes})"
            )
        mb = self.microbatches
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, (int, float)) or mb < 1):
            raise ValueError(
                f"the activation budget in micro-batches must be a number >= 1, got {mb!r}: a "
                "stage always holds the micro-batch it is computing"
            )
        nb = self.bytes
        if nb is not None and (isinstance(nb, bool) or not isinstance(nb, int) or nb <= 0):
            raise ValueError(f"the activation budget in bytes must be a positive int, got {nb!r}")


def evict_share(
    budget: ActivationBudget, stashed: int, partner_stashed: int, saved_bytes: int = 0
) -> float:
    """The share of each micro-batch's saved bytes an evicting stage sends to its partner, for
    a stage that stashes ``stashed`` micro-batches and a partner that stashes
    ``partner_stashed`` (see the module docstring); ``saved_bytes`` is the micro-batch's own
    saved bytes, needed for a budget in bytes. Between 0 and 1."""
    n = stashed
    if n <= 1:
        return 0.0
    if budget.bytes is not None:
        if saved_bytes <= 0:
            return 0.0
        share = (n - budget.bytes / saved_bytes) / (n - 1)
    elif budget.microbatches is not None:
        share = (n - budget.microbatches) / (n - 1)
    else:
        share = (n - partner_stashed) / (2 * n - 1)
    return min(max(share, 0.0), 1.0)


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
        strategy: Any = trainer.strategy
        if not hasattr(strategy, "activation_budget"):
            raise ValueError(
                "ActivationBalancer moves activations between pipeline stages; use it with "
                f"strategy='pipe2bw' (got {type(strategy).__name__})"
            )
        strategy.activation_budget = self.budget
