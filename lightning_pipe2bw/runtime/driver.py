"""How batches follow one another on a stage: with a flush after each (GPipe, 1F1B), or as one
stream (PipeDream-2BW, PipeDream). One protocol, :class:`Driver`, for both.

Lightning steps once per batch: it runs the training step, then ``zero_grad``, then the
backward hook, then the optimizer. The engine has run every micro-batch's backward by the end of
the step, so a driver hands the strategy the gradient the coming optimizer step applies as a
:class:`DueGradient`, held out of ``.grad`` while ``zero_grad`` runs and put back in the
backward hook. For a flush schedule it is this batch's gradient; for 2BW it is the previous
batch's (see :mod:`lightning_pipe2bw.runtime.twobw`); for PipeDream there is none (each stage
updates inside the pipeline).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from lightning_pipe2bw.runtime.channel import ObjectChannel
from lightning_pipe2bw.runtime.engine import PipelineEngine, StepFn
from lightning_pipe2bw.schedule import (
    Action,
    Schedule,
    add_offload_schedule,
    cut_overhead,
    one_channel_per_pair,
    training_schedule,
)
from lightning_pipe2bw.steps.values import StepValues

__all__ = ["Driver", "DueGradient", "FlushDriver"]


@dataclass
class DueGradient:
    """The gradient the next optimizer step applies: ``(parameter, gradient)`` pairs, out of
    ``.grad`` until :meth:`install`."""

    pairs: list[tuple[Tensor, Tensor | None]] = field(default_factory=list)

    @classmethod
    def take(cls, params: Sequence[Tensor]) -> DueGradient:
        """The gradients in ``params``' ``.grad``, which are cleared."""
        due = cls([(p, p.grad) for p in params])
        for p in params:
            p.grad = None
        return due

    @property
    def params(self) -> list[Tensor]:
        return [p for p, _ in self.pairs]

    def install(self) -> list[Tensor]:
        """Put the gradients into ``.grad``; return the parameters that have one."""
        for p, grad in self.pairs:
            p.grad = grad
        return [p for p, grad in self.pairs if grad is not None]

    def clear(self) -> None:
        for p, _ in self.pairs:
            p.grad = None


class Driver(Protocol):
    """What the strategy asks of a stage's training, whatever the schedule."""

    def train_batch(
        self,
        microbatches: list[Any],
        loss_weights: list[float],
        step: StepFn,
        backward: Callable[[Tensor], None],
        loss_root: Callable[[Tensor], Tensor] | None = None,
    ) -> list[Any]:
        """Run the stage's part of the next batch; the last stage's step outputs (one per
        micro-batch of this batch), an empty list on the other stages. ``loss_root(weighted
        loss)``: the tensor ``backward`` differentiates, where the strategy knows it (see
        ``PipelineEngine.execute``)."""
        ...

    def take_due(self) -> DueGradient:
        """The gradient the optimizer step after this batch applies (empty: none)."""
        ...

    def observe(self, action: Action) -> None:
        """Called by the engine after every action, evaluation included."""
        ...

    def finish_update(self) -> None:
        """Called after every optimizer step (a skipped one included)."""
        ...

    def flush_due(self) -> bool:
        """Whether the pipeline should be drained now (``flush_every``)."""
        ...

    def flush(self, backward: Callable[[Tensor], None]) -> DueGradient | None:
        """Drain the pipeline (collective along it); the gradient of the last batch, now
        complete and due, or None when no update is left."""
        ...

    def deliver_values(self, values: StepValues, settle: bool = False) -> list[StepValues]:
        """Deliver a training step's values from the last stage: the steps' values this rank
        logs now, oldest first (none yet, under 2BW's first step). With ``settle`` (the epoch's
        or the fit's last step) every step's values owed so far are delivered, this step's
        included."""
        ...

    def close(self) -> None:
        """End of fit: settle what is owed to other ranks."""
        ...

    @property
    def preview(self) -> StepValues | None:
        """A step's values this rank received before they are due (2BW's first step: what the
        steps return, before the first step's values are delivered); None if none."""
        ...

    @property
    def values_lag(self) -> int:
        """How many calls after its own every rank has a step's values (0: in the same call;
        2BW: 1, the last stage's own aside)."""
        ...

    @property
    def weight_buffers(self) -> int:
        """How many copies of the stage's weights exist (2BW: up to 2)."""
        ...

    @property
    def at_flush_point(self) -> bool:
        """Nothing is in flight: blocks may move, a checkpoint is exact."""
        ...

    def state(self, names: Sequence[str]) -> dict[str, Any]:
        """What a checkpoint needs to continue exactly (``names``: the parameters' names)."""
        ...

    def resume(self, state: dict[str, Any], names: Sequence[str]) -> None:
        """Continue from :meth:`state` (possibly written by another layout)."""
        ...

    def rebind(self, optimizers: list[Any]) -> list[Any]:
        """The stage's blocks changed (live repartitioning, at a flush point): drive the
        stage's parameters now, stepped by ``optimizers`` (built over them); returns what
        Lightning steps. Call :meth:`resume` next."""
        ...


class FlushDriver:
    """GPipe and 1F1B: every batch starts and ends in its own call, so the gradient in
    ``.grad`` at the end of the call is the batch's, due at once."""

    def __init__(
        self,
        engine: PipelineEngine,
        schedule: str,
        channel: ObjectChannel | None = None,
        evicting: frozenset[int] = frozenset(),
        early_input_grad: bool = True,
    ) -> None:
        """``channel``: carries the last stage's values of each step to the other ranks of the
        pipeline (None with one stage). ``early_input_grad``: the last backward of a batch (GPipe:
        also the first) sends its input gradient before it computes the weights' (the pass
        ``schedule.early_input_grads``)."""
        self.engine = engine
        self.early_input_grad = early_input_grad
        self.schedule_name = schedule
        self.evicting = evicting  # the stages that evict activations (BPipe)
        self.channel = channel
        self._schedules: dict[int, Schedule] = {}
        self._due = DueGradient()

    def schedule(self, num_microbatches: int) -> Schedule:
        """The training schedule for ``num_microbatches``, with communication and offload
        actions (built once per size)."""
        m = num_microbatches
        if m not in self._schedules:
            sched = training_schedule(
                self.schedule_name,
                self.engine.num_stages,
                m,
                early_input_grad=self.early_input_grad,
                # zero bubble's cuts where they pay on this device (schedule.cuts_that_pay)
                cut_overhead=cut_overhead(self.engine.transport.device.type),
            )
            if self.evicting:
                sched = add_offload_schedule(sched, self.evicting)
            # a transport keeps one queue per pair of ranks (virtual stages: see the pass)
            self._schedules[m] = one_channel_per_pair(sched)
        return self._schedules[m]

    def train_batch(
        self,
        microbatches: list[Any],
        loss_weights: list[float],
        step: StepFn,
        backward: Callable[[Tensor], None],
        loss_root: Callable[[Tensor], Tensor] | None = None,
    ) -> list[Any]:
        params = list(self.engine.body.parameters())
        for p in params:
            p.grad = None
        if self.channel is not None and not self.channel.is_source:
            self.channel.expect()  # the batch's values, received ahead of the last stage's post
        results = self.engine.run(
            self.schedule(len(microbatches)),
            microbatches,
            step,
            train=True,
            loss_weights=loss_weights,
            backward=backward,
            loss_root=loss_root,
        )
        self._due = DueGradient.take(params)
        return results

    def take_due(self) -> DueGradient:
        due, self._due = self._due, DueGradient()
        return due

    def observe(self, action: Action) -> None:
        pass

    def finish_update(self) -> None:
        pass

    def flush_due(self) -> bool:
        return False

    def flush(self, backward: Callable[[Tensor], None]) -> DueGradient | None:
        return None  # every batch is flushed when it ends

    def deliver_values(self, values: StepValues, settle: bool = False) -> list[StepValues]:
        """The batch's values, from the last stage to the others, which posted its receive
        before their engine ran: they arrived while those ranks finished their backwards."""
        channel = self.channel
        if channel is None:
            return [values]
        if channel.is_source:
            channel.post(values)
            return [values]
        return [channel.receive()]

    def close(self) -> None:
        if self.channel is not None:
            self.channel.drain()  # the source waits until its sends are done

    @property
    def preview(self) -> StepValues | None:
        return None  # every step's values arrive in their own step

    @property
    def values_lag(self) -> int:
        return 0

    @property
    def weight_buffers(self) -> int:
        return 1

    @property
    def at_flush_point(self) -> bool:
        return True

    def state(self, names: Sequence[str]) -> dict[str, Any]:
        return {}  # the weights and the optimizer are the whole state

    def resume(self, state: dict[str, Any], names: Sequence[str]) -> None:
        pass

    def rebind(self, optimizers: list[Any]) -> list[Any]:
        return list(optimizers)
