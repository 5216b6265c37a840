"""``StepValues``: what the last stage of a pipeline knows at the end of a step, delivered to
every rank of it (the loss, the step's other returned values, the outputs, what it logged)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["StepValues"]


@dataclass
class StepValues:
    """The last stage's values of one step (training, validation, test or predict), which the
    other ranks of its pipeline receive (``Driver.deliver_values``, ``ObjectChannel``) and use as
    their own: one device would have them all. Empty on a stage other than the last until they
    arrive. The last stage fills the fields in three places: the stage's runtime (``loss``,
    ``extra``, ``output``), the step's recording (``logs``, ``appended``, ``metrics``,
    ``lightning_pipe2bw.steps.log``) and the strategy (``batch``, ``requeue``).

    A pytree node (``torch.utils._pytree``): the channel moves every tensor in it to the host.
    """

    # a training step's loss: the micro-batch losses weighted by size, a 0-d float64 tensor on
    # the loss's device until the values leave the rank
    loss: Tensor | None = None
    # what a training step returned besides the loss (a dict with more keys), merged over the
    # micro-batches and detached; None when it returned a loss only
    extra: dict[str, Any] | None = None
    # an evaluation step's outputs, merged over the micro-batches, on the CPU
    output: Any = None
    # what ``self.log`` recorded, per logged name (``steps.log.LogRecorder.summary``)
    logs: list[Any] | None = None
    # the items the step appended to the module's lists (``steps.log.StepOutputs``)
    appended: dict[tuple[str, Any], list[Any]] | None = None
    # the logged torchmetrics Metrics' states (``steps.log.MetricStates``)
    metrics: dict[str, Any] | None = None
    # the batch's fingerprint (``loaders.batch_fingerprint``), compared by the other stages
    batch: str | None = None
    # a SLURM requeue request: the training batch at whose start every rank answers it
    requeue: int | None = None


pytree.register_dataclass(StepValues)
