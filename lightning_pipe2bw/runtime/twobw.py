"""PipeDream-2BW's driver: one 1F1B stream across batches, flushed only at flush points."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from lightning_pipe2bw.runtime.engine import PipelineEngine, StepFn
from lightning_pipe2bw.runtime.versions import TwoBWOptimizer, WeightVersions
from lightning_pipe2bw.schedule import Action, OneFOneBStream, with_communication

__all__ = ["TwoBWDriver"]


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
        p = self.engine.num_stages
        return self.engine.execute(
            [c for a in actions for c in with_communication(a, p)],
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
        self.segment_start = self.admitted
        self.stream = self._new_stream()
        last = self.admitted - 1
        return last if last >= self.next_update else None

    @property
    def active(self) -> bool:
        return self.admitted > self.segment_start


def _no_step(_: Any) -> Any:  # pragma: no cover - a drain runs backwards only
    raise RuntimeError("a pipeline drain ran a forward")
