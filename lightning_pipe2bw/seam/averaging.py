"""Lightning's ``StochasticWeightAveraging`` over a pipeline: each stage averages its own share,
and the whole averaged model is what ``fit`` leaves, as on one device.

The callback copies the whole module in its ``setup`` (before the strategy partitions it), then
zips that copy's ``parameters()`` with the module's to average and, at the end, to copy the
average back. Under pipe2bw the module holds one stage's parameters by then, so the strategy
gives the callback a :class:`StageAverage` instead: a copy of the stage's parameters, in the
module's ``parameters()`` order, and of its buffers, under the user's module's names. The
callback's own arithmetic then runs unchanged on every stage; at the end it copies each stage's
average into the stage, and the strategy's hand-back gathers every stage's blocks, so every
rank's module holds the whole averaged model, as after a single-device fit.

The callback decides from ``pl_module.modules()`` whether the model has batch norm (then it
adds an epoch that recomputes the statistics with the averaged weights): the strategy makes it
decide for the whole model, so every stage runs the same epochs. A checkpoint holds the whole
average (gathered from every stage, loadable on one device); a stage loads its share of it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import Tensor, nn

from lightning_pipe2bw import compat
from lightning_pipe2bw.checkpoint.storage import gather_named
from lightning_pipe2bw.pipeline.options import PipeOptions
from lightning_pipe2bw.pipeline.stage_runtime import StageRuntime

__all__ = ["average_stage", "check_averaging", "whole_averages"]


class StageAverage(nn.Module):
    """A copy of one stage's parameters and buffers for ``StochasticWeightAveraging`` (see the
    module notes): ``parameters()`` yields the copies of ``params`` in order, ``state_dict()``
    is keyed by ``names`` (the user's module's), ``load_state_dict`` takes the stage's keys
    from a state of the whole model."""

    def __init__(
        self, params: Sequence[Tensor], names: Sequence[str], buffers: Mapping[str, Tensor]
    ) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            [nn.Parameter(p.detach().clone(), requires_grad=False) for p in params]
        )
        self.names = list(names)
        self.buffer_names = list(buffers)
        for i, value in enumerate(buffers.values()):
            self.register_buffer(f"buffer{i}", value.detach().clone())

    def _tensors(self) -> list[tuple[str, Tensor]]:
        buffers = [getattr(self, f"buffer{i}") for i in range(len(self.buffer_names))]
        return [
            *zip(self.names, self.weights, strict=True),
            *zip(self.buffer_names, buffers, strict=True),
        ]

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The stage's averaged tensors under the user's module's names."""
        return OrderedDict((name, t.detach()) for name, t in self._tensors())

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Take this stage's tensors from ``state_dict`` (a whole model's: other stages' keys
        are skipped); with ``strict``, every one of them must be there."""
        missing = [name for name, _ in self._tensors() if name not in state_dict]
        if missing and strict:
            raise KeyError(
                f"the averaged model's state lacks {len(missing)} tensors of this stage, e.g. "
                f"{missing[:5]}: was the checkpoint written for another model?"
            )
        with torch.no_grad():
            for name, tensor in self._tensors():
                if name in state_dict:
                    tensor.copy_(state_dict[name])
        return None


def averaging_callbacks(trainer: Trainer) -> list[StochasticWeightAveraging]:
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    return [cb for cb in callbacks if isinstance(cb, StochasticWeightAveraging)]


def average_stages(
    trainer: Trainer,
    params: Sequence[Tensor],
    names: Sequence[str],
    buffers: Mapping[str, Tensor],
    has_batch_norm: bool,
) -> None:
    """Make every ``StochasticWeightAveraging`` callback of ``trainer`` average this stage
    (``params`` in the module's ``parameters()`` order, with their ``names``, and the stage's
    ``buffers``), and decide about batch norm for the whole model (``has_batch_norm``)."""

    def contains_batch_norm(pl_module: LightningModule) -> bool:
        return has_batch_norm

    for callback in averaging_callbacks(trainer):
        compat.set_averaged_model(callback, StageAverage(params, names, buffers))
        callback.pl_module_contains_batch_norm = contains_batch_norm  # type: ignore[method-assign]


def check_averaging(trainer: Trainer, options: PipeOptions) -> bool:
    """Whether ``trainer`` averages weights (a ``StochasticWeightAveraging`` callback); an
    error if blocks may move between stages."""
    averaging = bool(averaging_callbacks(trainer))
    if averaging and options.repartition_every is not None:
        raise ValueError(
            "StochasticWeightAveraging keeps an average of each stage's parameters, which "
            "cannot follow blocks that move between stages: use repartition_every=None with it"
        )
    return averaging


def average_stage(
    trainer: Trainer, module: LightningModule, runtime: StageRuntime, has_batch_norm: bool
) -> None:
    """:func:`average_stages` over ``runtime``'s stage of ``module`` (set-up, once the stage is
    built): its parameters and the buffers of its state."""
    params = list(module.parameters())
    names = runtime.parameter_names(params)
    state = runtime.stage_state_dict()
    buffers = {k: v for k, v in state.items() if k not in set(names)}
    average_stages(trainer, params, names, buffers, has_batch_norm)


def whole_averages(
    checkpoint: dict[str, Any], trainer: Trainer, rank: int, world_size: int
) -> None:
    """Put the whole averaged model, gathered from every stage, into the callbacks' states of
    ``checkpoint`` on rank 0 (collective: every rank saves the same checkpoint)."""
    states = checkpoint.get("callbacks", {})
    for callback in averaging_callbacks(trainer):
        average = compat.averaged_model(callback)
        if not isinstance(average, StageAverage):
            continue
        state = states.get(callback.state_key)
        whole = gather_named(average.state_dict(), rank, world_size)
        if state is not None and state.get("average_model_state") is not None:
            state["average_model_state"] = whole
