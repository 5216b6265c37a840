"""PipeDream-2BW's driver: one 1F1B stream across batches, flushed only at flush points."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from lightning_pipe2bw.runtime.engine import PipelineEngine, StepFn
from lightning_pipe2bw.runtime.versions import TwoBWOptimizer, WeightVersions
from lightning_pipe2bw.schedule import (
    Action,
    ActionKind,
    OneFOneBStream,
    add_offload,
    with_communication,
)

__all__ = ["PipeDreamDriver", "TwoBWDriver"]


class TwoBWDriver:
    """Feeds the engine one batch per Lightning step and decides which gradient is due.

    Call t admits batch t: the stage runs its 1F1B stream up to the first forward of batch t+1
    (the warm-up happens only after a flush). At the end of call t batch t-1 has finished every
    backward on every stage (m >= p), so its gradient is *due*: the strategy moves it into the
    parameters' ``.grad``, Lightning's closure clips it (over all stages) and the
    :class:`TwoBWOptimizer` applies it. A flush drains the stream and makes the last batch due
    at once, so at a flush point the weights are exactly those of the delayed-update rule after
    as many updates as Lightning has counted steps.
    """

    def __init__(
        self,
        engine: PipelineEngine,
        versions: WeightVersions,
        optimizer: TwoBWOptimizer,
        num_microbatches: int,
    ) -> None:
        self.engine = engine
        self.versions = versions
        self.optimizer = optimizer
        self.m = num_microbatches
        self.admitted = 0  # batches admitted since fit started (= the next batch index)
        self.segment_start = 0  # first batch since the last flush
        self.next_update = 0  # the oldest batch whose update has not been applied
        self.stream = self._new_stream()
        self.version_log: list[int] | None = None  # versions alive after every action, if set
        self.offload: frozenset[int] = frozenset()  # stages that evict activations (BPipe)
        engine.observer = self.observe
        versions.reserved = self.reserved_versions

    def reserved_versions(self) -> set[int]:
        """The version the next batch will run with must survive the updates before it."""
        return {WeightVersions.version_for(self.admitted)}

    def observe(self, action: Action) -> None:
        """Called by the engine after every action."""
        if self.version_log is not None:
            self.version_log.append(len(self.versions.live_versions()))

    def _new_stream(self) -> OneFOneBStream:
        seg, m = self.segment_start, self.m
        return OneFOneBStream(
            self.engine.stage,
            self.engine.num_stages,
            lambda k: WeightVersions.version_for(seg + k // m),
        )

    def _weights_for(self, microbatch: int) -> Mapping[str, Tensor]:
        return self.versions.weights_for(self.batch_of(microbatch))

    def batch_of(self, microbatch: int) -> int:
        """The global batch index of a micro-batch id of the current segment."""
        return self.segment_start + microbatch // self.m

    def _run(
        self,
        actions: list[Action],
        data: Mapping[int, Any],
        step: StepFn,
        weights: Mapping[int, float],
        backward: Callable[[Tensor], None],
    ) -> dict[int, Any]:
        p, stage = self.engine.num_stages, self.engine.stage
        comm = [c for a in actions for c in with_communication(a, p)]
        if self.offload:
            comm = add_offload(comm, stage, p, self.offload)
        return self.engine.execute(
            comm,
            data,
            step,
            train=True,
            loss_weights=weights,
            backward=backward,
            weights_for=self._weights_for,
        )

    def train_batch(
        self,
        microbatches: list[Any],
        loss_weights: list[float],
        step: StepFn,
        backward: Callable[[Tensor], None],
    ) -> list[Any]:
        """Admit the next batch and run this stage's window; return the last stage's step
        outputs for that batch (every forward of a batch runs in its own call)."""
        # the update of this batch uses the param groups' values of this step (lr, ...), even
        # when a stage applies it during a later call
        self.optimizer.record_hyperparameters(self.admitted)
        local = self.admitted - self.segment_start
        first = local * self.m
        ids = range(first, first + len(microbatches))
        window = self.stream.window(first + self.m)
        results = self._run(
            window,
            dict(zip(ids, microbatches, strict=True)),
            step,
            dict(zip(ids, loss_weights, strict=True)),
            backward,
        )
        self.admitted += 1
        return [results[k] for k in ids] if self.engine.is_last else []

    def due_batch(self) -> int | None:
        """The batch whose gradient the step at the end of this call applies, if any."""
        batch = self.admitted - 2
        if batch >= self.next_update:
            return batch
        return None

    def take_gradient(self, batch: int) -> list[Tensor | None]:
        """Batch ``batch``'s accumulated gradient, in ``versions.params`` order; the batch's
        leaves are released (its version may be overwritten by the coming update)."""
        if batch != self.next_update:
            raise RuntimeError(
                f"2BW updates must be applied in order: batch {batch} before {self.next_update}"
            )
        grads = self.versions.grads_of(batch)
        self.versions.release(batch)
        self.next_update = batch + 1
        return grads

    def flush(self, backward: Callable[[Tensor], None]) -> int | None:
        """Drain the pipeline; return the last admitted batch, whose gradient is now complete and
        due (None if there is nothing in flight)."""
        if self.admitted == self.segment_start:
            return None
        self._run(self.stream.drain(), {}, _no_step, {}, backward)
        self.engine.transport.wait_sends()  # every send of the segment has been received now
        if self.engine.link is not None:
            self.engine.link.settle()
        self.segment_start = self.admitted
        self.stream = self._new_stream()
        last = self.admitted - 1
        return last if last >= self.next_update else None

    def previous_version(self) -> list[Tensor] | None:
        """At a flush point: the weight version the next batch runs with when it is not the
        newest (2BW: version t-1 for batch t), which a checkpoint must keep for an exact resume."""
        version = WeightVersions.version_for(self.admitted)
        if self.admitted == 0 or version == self.versions.newest:
            return None
        return self.versions.tensors_of(version)

    def resume(self, batches: int, previous: list[Tensor] | None) -> None:
        """Continue after ``batches`` batches, from a checkpoint written at a flush point: the
        parameters hold the newest weights and ``previous`` the version batch ``batches`` uses."""
        if self.admitted != self.segment_start:
            raise RuntimeError("a 2BW pipeline can only resume when nothing is in flight")
        self.admitted = self.segment_start = self.next_update = batches
        self.stream = self._new_stream()
        self.versions.restore(batches, previous)


def _no_step(_: Any) -> Any:  # pragma: no cover - a drain runs backwards only
    raise RuntimeError("a pipeline drain ran a forward")


class PipeDreamDriver(TwoBWDriver):
    """PipeDream with weight stashing: asynchronous 1F1B across batches.

    A micro-batch's forward on a stage uses the newest weights that stage has, and its backward
    uses the same (stashed) version. A stage applies a batch's update as soon as it has run the
    batch's last backward, without waiting for the other stages: stage s is therefore at most
    ``ceil((p - s - 1) / m)`` updates behind the last stage (which is never behind), and keeps
    at most p - s weight versions.
    """

    def _weights_for(self, microbatch: int) -> Mapping[str, Tensor]:
        return self.versions.weights_for(self.batch_of(microbatch), self.versions.newest)

    def reserved_versions(self) -> set[int]:
        return set()  # a forward always takes the newest weights

    def _new_stream(self) -> OneFOneBStream:
        return OneFOneBStream(self.engine.stage, self.engine.num_stages)

    def observe(self, action: Action) -> None:
        if action.kind is ActionKind.BACKWARD and (action.microbatch + 1) % self.m == 0:
            batch = self.batch_of(action.microbatch)
            grads = self.take_gradient(batch)
            for param, grad in zip(self.versions.params, grads, strict=True):
                param.grad = grad
            self.optimizer.apply(batch)
            for param in self.versions.params:
                param.grad = None
        super().observe(action)

    def due_batch(self) -> int | None:
        return None  # every update is applied inside the pipeline, as soon as it is complete

    def flush(self, backward: Callable[[Tensor], None]) -> int | None:
        super().flush(backward)  # the drained backwards apply the last updates
        return None

    def previous_version(self) -> list[Tensor] | None:
        return None  # after a flush every forward takes the newest weights

    def resume(self, batches: int, previous: list[Tensor] | None) -> None:
        super().resume(batches, None)
