"""``StepDelivery``: a pipelined step's values (``StepValues``), from the last stage to what every
rank of the pipeline checks, logs and returns to Lightning.

The last stage adds the batch's fingerprint and a SLURM requeue request to the values; every
rank then takes the values delivered to it (``StageRuntime.deliver_values``: in the same step, or
one step late under 2BW), compares the fingerprints of the batches it ran (``loaders``), logs
the values (``steps.log.StepRecording``), notes a requeue request (``requeue``) and returns the
step's output: a training step's loss (NaN while no values have arrived) and its other values,
or an evaluation step's outputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.utils import _pytree as pytree

from lightning_pipe2bw.pipeline.stage_runtime import StageRuntime
from lightning_pipe2bw.seam.loaders import FingerprintCheck, describe_loader
from lightning_pipe2bw.seam.requeue import RequeueRelay
from lightning_pipe2bw.steps.log import StepRecording, scalar_on
from lightning_pipe2bw.steps.values import StepValues

__all__ = ["StepDelivery"]

# the dataloader each pipelined hook reads, for errors
LOADERS = {
    "training_step": "training dataloader",
    "validation_step": "validation dataloader",
    "test_step": "test dataloader",
    "predict_step": "predict dataloader",
}


def hook_reading(trainer: Trainer) -> str | None:
    """The pipelined hook that reads the dataloaders Lightning sets up now."""
    if trainer.training:
        return "training_step"
    if trainer.validating or trainer.sanity_checking:
        return "validation_step"
    if trainer.testing:
        return "test_step"
    return "predict_step" if trainer.predicting else None


def missing_like(value: Any) -> Any:
    """``value``'s structure with NaN in place of every number and tensor value (None for
    anything else): what a rank returns for a step whose values have not reached it yet."""

    def blank(leaf: Any) -> Any:
        if isinstance(leaf, Tensor):
            dtype = leaf.dtype if leaf.dtype.is_floating_point else torch.get_default_dtype()
            return torch.full(leaf.shape, math.nan, dtype=dtype)
        if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
            return math.nan
        return None

    return pytree.tree_map(blank, value)


class StepDelivery:
    """One rank's side of the step values' delivery, kept across the steps of the strategy's
    Trainer calls: the fingerprint of the batch Lightning moved to the device last, those of the
    batches run and not yet compared with the last stage's (training, evaluation), the
    dataloaders' names for errors, and the extra values (besides the loss) of the latest
    training step this rank has seen."""

    def __init__(self) -> None:
        self.fingerprint: str | None = None
        self.fingerprints = {True: FingerprintCheck(), False: FingerprintCheck()}
        self.loader_names: dict[str, str] = {}  # by the hook that reads it
        self.step_extra: Any = None

    def restart(self) -> None:
        """At set-up: no batch waits for its comparison, no step's values are known."""
        self.fingerprints = {True: FingerprintCheck(), False: FingerprintCheck()}
        self.step_extra = None

    def name_loader(self, trainer: Trainer, dataloader: object) -> None:
        """Remember the name of the dataloader Lightning sets up now, for errors."""
        hook = hook_reading(trainer)
        if hook is not None:
            self.loader_names[hook] = f"{LOADERS[hook]} ({describe_loader(dataloader)})"

    def deliver(
        self,
        runtime: StageRuntime,
        recording: StepRecording,
        values: StepValues,
        *,
        hook: str,
        train: bool,
        settle: bool,
        device: torch.device,
        requeue: RequeueRelay,
        request: Callable[[int], int | None] | None,
    ) -> Any:
        """Deliver ``values`` (this step's, complete on the last stage) and return what the step
        returns to Lightning on this rank. ``request(values_lag)``: the last stage's decision on
        a SLURM requeue request (None: no request can come)."""
        fingerprint, self.fingerprint = self.fingerprint, None
        fingerprints = self.fingerprints[train]
        if runtime.is_last:
            values.batch = fingerprint
            if request is not None:
                values.requeue = request(runtime.driver.values_lag)
        else:
            fingerprints.ran(fingerprint)
        delivered = runtime.deliver_values(values, train=train, settle=settle)
        for step_values in delivered:
            if not runtime.is_last:
                loader = self.loader_names.get(hook, LOADERS.get(hook, hook))
                fingerprints.compare(step_values.batch, runtime.topology.stage, loader)
            recording.apply(step_values, device)
            requeue.note(step_values)
        if train:
            return self.training_output(delivered, runtime, device)
        return apply_to_collection(delivered[-1].output, Tensor, lambda t: t.to(device))

    def training_output(
        self, delivered: list[StepValues], runtime: StageRuntime, device: torch.device
    ) -> Any:
        """What the training step returns to Lightning on this rank: the loss of the newest
        step's values delivered, with the step's other values when it returned a dict (NaN where
        none have arrived yet: 2BW's first step of an epoch on a rank other than 0)."""
        if delivered:
            loss = delivered[-1].loss
            assert loss is not None, "a training step's values carry its loss"
            loss = scalar_on(device, loss)
            extra = self.step_extra = delivered[-1].extra
        else:
            loss = scalar_on(device, math.nan)
            if self.step_extra is None:
                ahead = runtime.driver.preview
                self.step_extra = ahead.extra if ahead is not None else None
            extra = missing_like(self.step_extra) if self.step_extra is not None else None
        if extra is None:
            return loss
        return {"loss": loss, **apply_to_collection(extra, Tensor, lambda t: t.to(device))}
