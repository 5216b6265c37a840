"""PipeDream-2BW's driver: one 1F1B stream across batches, flushed only at flush points."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_pipe2bw.optim.delay import make_correction
from lightning_pipe2bw.optim.shard import ParameterShards
from lightning_pipe2bw.optim.wrapper import unwrap_optimizer
from lightning_pipe2bw.runtime.channel import ObjectChannel
from lightning_pipe2bw.runtime.driver import DueGradient
from lightning_pipe2bw.runtime.engine import PipelineEngine, StepFn
from lightning_pipe2bw.runtime.versions import TwoBWOptimizer, WeightVersions
from lightning_pipe2bw.schedule import (
    Action,
    OneFOneBStream,
    VListStream,
    add_offload,
    with_communication,
)
from lightning_pipe2bw.steps.values import StepValues

__all__ = ["PipeDreamDriver", "TwoBWDriver"]


class TwoBWDriver:
    """Feeds the engine one batch per Lightning step and decides which gradient is due.

    Call t admits batch t: the stage runs its 1F1B stream up to the first forward of batch t+1
    (the warm-up happens only after a flush). At the end of call t batch t-1 has finished every
    backward on every stage (m >= p), so its gradient is *due*: :meth:`take_due` hands it to the
    strategy, which puts it into the parameters' ``.grad`` for Lightning's closure (clipping
    over all stages), and the :class:`TwoBWOptimizer` applies it. A flush drains the stream and
    makes the last batch due at once, so at a flush point the weights are exactly those of the
    delayed-update rule after as many updates as Lightning has counted steps.

    The driver owns the stage's weight versions and the optimizer wrapper that keeps them
    (:attr:`optimizer`, which Lightning steps instead of the user's), and the channel on which
    the last stage posts each step's values without a barrier (:meth:`deliver_values`).
    """

    def __init__(
        self,
        engine: PipelineEngine,
        optimizer: Optimizer,
        num_microbatches: int,
        *,
        channel: ObjectChannel | None = None,
        flush_every: int | None = None,
        evicting: frozenset[int] = frozenset(),
        version_log: list[int] | None = None,
        delay_correction: str = "none",
        sync_steps: int = 0,
        fresh_last_stage: bool = False,
        shards: ParameterShards | None = None,
        average: Callable[[list[Tensor]], None] | None = None,
    ) -> None:
        """``optimizer``: the user's (wrapped here); ``channel``: carries the last stage's step
        values to the other ranks (None with one stage); ``flush_every``: drain every this many
        batches; ``evicting``: the stages that evict activations (BPipe); ``version_log``: a
        list that gets the number of weight versions alive after every action (tests);
        ``delay_correction``: the name of a rule of ``lightning_pipe2bw.optim.delay``;
        ``sync_steps``: the first batches (of the fit) run synchronously: at the newest weights,
        drained in their own call, their updates uncorrected (see :meth:`synchronous`);
        ``fresh_last_stage``: on the last stage, every batch runs at the newest weights (see
        :attr:`fresh`); ``shards``: which replica updates each parameter, with
        ``shard_optimizer`` (``lightning_pipe2bw.optim.shard``); ``average(params)``: averages
        the gradients in ``params``' ``.grad`` with the stage's replicas, for the updates applied
        inside the pipeline (PipeDream; None: one replica)."""
        self.engine = engine
        self.m = num_microbatches
        self.channel = channel
        self.flush_every = flush_every
        self.evicting = evicting  # the stages that evict activations (BPipe)
        self.version_log = version_log
        self.delay_correction = delay_correction
        self.sync_steps = sync_steps
        self.fresh_last_stage = fresh_last_stage  # the option, as the checkpoint records it
        self.shards = shards
        self.average = average
        # the last stage of a plain 1F1B stream has run batch t's last backward before batch
        # t+1's first forward: with fresh_last_stage its update lands at once, no delay
        self.fresh = fresh_last_stage and engine.is_last and engine.virtual.placement is None
        self.admitted = 0  # batches admitted since fit started (= the next batch index)
        self.segment_start = 0  # first batch since the last flush
        self.next_update = 0  # the oldest batch whose update has not been applied
        self.versions, self.optimizer = self._wrap(optimizer)
        # a batch's weight version is free once its last backward ran on every stage here
        self._ended: dict[int, int] = {}
        self.stream = self._new_stream()
        self._due = DueGradient()
        # on a rank other than the last stage's: the first step's values of the fit, received in
        # their own step (once), and delivered in the next one like every other step's
        self._ahead: StepValues | None = None
        self._first: StepValues | None = None
        # told (batch, its gradient in ``versions.params`` order) as soon as a batch has run
        # its last backward on this stage, long before the step that applies it: what is summed
        # over the stages for that step starts there (the gradients of parameters tied across
        # stages, ``pipeline.ties``; the clipping norm, ``seam.agreement.NormsAhead``)
        self.on_complete: list[Callable[[int, list[Tensor | None]], None]] = []

    def _wrap(self, optimizer: Optimizer) -> tuple[WeightVersions, TwoBWOptimizer]:
        """Weight versions over the stage's parameters, and the wrapper that keeps them and
        applies the delay correction."""
        engine = self.engine
        named = list(engine.body.named_parameters())
        # a stage without delay has nothing to correct
        rule = "none" if self.fresh else self.delay_correction
        correction = make_correction(rule, optimizer, [p for _, p in named])
        bound = self.max_versions(engine.stage, engine.num_stages)
        versions = WeightVersions(
            named,
            max_versions=bound + 1 if correction.predicts else bound,
            reserved=self.reserved_versions,
        )
        shards = self.shards
        wrapper = TwoBWOptimizer(
            optimizer, versions, correction, corrected_from=self.sync_steps, shards=shards
        )
        if correction.predicts:
            # batch t's view predicts from version t-1 and the state the next update (batch
            # t-1's, with its learning rate) starts from; with sharded state each replica
            # predicts the parameters it owns (it alone has their moments), then they gather
            def predict(batch: int, newest: list[Tensor], out: list[Tensor]) -> None:
                hyper = wrapper.hyperparameters_of(batch - 1)
                if shards is None:
                    correction.predict(newest, out, hyper)
                    return
                params = versions.params
                with shards.predicting(optimizer, correction):
                    correction.predict(
                        shards.own(newest, params), shards.own(out, params), hyper
                    )
                shards.gather(out, params)

            versions.predict = predict
            # a synchronous batch runs at the newest weights: no view
            versions.upcoming = lambda: (
                set() if self.synchronous(self.admitted) else {self.admitted}
            )
        return versions, wrapper

    def rebind(self, optimizers: list[Any]) -> list[Any]:
        """New weight versions over the stage's parameters, kept by a wrapper of the one
        optimizer in ``optimizers``."""
        if not self.at_flush_point:
            raise RuntimeError("a 2BW stage can only change its blocks when nothing is in flight")
        self.versions, self.optimizer = self._wrap(unwrap_optimizer(optimizers[0]))
        return [self.optimizer]

    @staticmethod
    def max_versions(stage: int, num_stages: int) -> int:
        """The weight versions a stage may hold: two."""
        return 2

    def synchronous(self, batch: int) -> bool:
        """Whether batch ``batch`` belongs to the synchronous start (``sync_steps``): it runs at
        the newest weights and is drained in the call that admits it, so its update is the one
        a flush schedule makes, W(t+1) = W(t) - U(grad f_t(W(t))), without a correction. From
        batch K = ``sync_steps`` on the 2BW rule holds, W(t+1) = W(t) - U(grad f_t(W(t-1))) (so
        batches K-1 and K both run at W(K-1)), the correction starting then with no history, as
        at the start of training."""
        return batch < self.sync_steps

    def at_newest(self, batch: int) -> bool:
        """Whether batch ``batch`` runs at the newest weights: a batch of the synchronous start,
        or any batch on a fresh last stage (``fresh_last_stage``), where the update of batch t
        is applied at the end of the call that admits it, W(t+1) = W(t) - U(grad f_t(W(t))),
        while the stages before it keep the delayed rule."""
        return self.fresh or self.synchronous(batch)

    def reserved_versions(self) -> set[int]:
        """The version the next batch will run with must survive the updates before it (with a
        predicting correction, its view is made before they apply instead; a synchronous batch
        runs with the newest)."""
        if self.synchronous(self.admitted):
            return set()
        return {WeightVersions.version_for(self.admitted)}

    def observe(self, action: Action) -> None:
        """Called by the engine after every action: a batch's last backward on this stage
        frees its weight version for an update in place (1F1B runs a batch's backwards in
        micro-batch order)."""
        if action.ends_backward and (action.microbatch + 1) % self.m == 0:
            batch = self.batch_of(action.microbatch)
            ended = self._ended.pop(batch, 0) + 1
            if ended == len(self.engine.virtual.stages):
                self.versions.finish(batch)
                if self.on_complete:
                    grads = self.versions.grads_of(batch)
                    for listener in self.on_complete:
                        listener(batch, grads)
            else:
                self._ended[batch] = ended
        if self.version_log is not None:
            self.version_log.append(len(self.versions.live_versions()))

    def _new_stream(self) -> OneFOneBStream | VListStream:
        seg, m = self.segment_start, self.m

        def version(k: int) -> int:
            return WeightVersions.version_for(seg + k // m)

        placement = self.engine.virtual.placement
        if placement is not None:  # several stages per rank (2BW on a V)
            return VListStream(placement, self.engine.stage, m, version)
        return OneFOneBStream(self.engine.stage, self.engine.num_stages, version)

    def _weights_for(self, microbatch: int) -> Mapping[str, Tensor]:
        batch = self.batch_of(microbatch)
        if self.at_newest(batch):
            return self.versions.weights_for(batch, self.versions.newest)
        return self.versions.weights_for(batch)

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
        if isinstance(self.stream, VListStream):  # its actions include the messages
            comm = list(actions)
        else:
            comm = [c for a in actions for c in with_communication(a, p)]
        if self.evicting:
            comm = add_offload(comm, stage, p, self.evicting)
        return self.engine.execute(
            comm,
            data,
            step,
            train=True,
            loss_weights=weights,
            backward=backward,
            weights_for=self._weights_for,
            observer=self.observe,
        )

    def train_batch(
        self,
        microbatches: list[Any],
        loss_weights: list[float],
        step: StepFn,
        backward: Callable[[Tensor], None],
        loss_root: Callable[[Tensor], Tensor] | None = None,
    ) -> list[Any]:
        """Admit the next batch and run this stage's window; return the last stage's step
        outputs for that batch (every forward of a batch runs in its own call)."""
        for param in self.versions.params:  # micro-batches accumulate into their own leaves
            param.grad = None
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
        self._due = self._gradient_of(self.due_batch())
        return [results[k] for k in ids] if self.engine.is_last else []

    def due_batch(self) -> int | None:
        """The batch whose gradient the step at the end of this call applies, if any: the one
        before the batch just admitted, or on a fresh last stage that batch itself (unless it
        is synchronous: then, as on every stage, the flush that ends its call applies it)."""
        last = self.admitted - 1
        batch = last if self.fresh and not self.synchronous(last) else last - 1
        if batch >= self.next_update:
            return batch
        return None

    def _gradient_of(self, batch: int | None) -> DueGradient:
        """Batch ``batch``'s gradient, made the one the optimizer's next step applies."""
        self.optimizer.due = batch
        if batch is None:
            return DueGradient()
        return DueGradient(list(zip(self.versions.params, self.take_gradient(batch), strict=True)))

    def take_due(self) -> DueGradient:
        due, self._due = self._due, DueGradient()
        return due

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

    def finish_update(self) -> None:
        self.optimizer.finish_step()

    def flush_due(self) -> bool:
        if self.synchronous(self.admitted - 1):  # a synchronous batch ends in its own call
            return True
        every = self.flush_every
        return every is not None and self.admitted % every == 0

    def _drain(self, backward: Callable[[Tensor], None]) -> int | None:
        """Drain the pipeline; return the last admitted batch, whose gradient is now complete
        (None if there is nothing in flight)."""
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

    def flush(self, backward: Callable[[Tensor], None]) -> DueGradient | None:
        """Drain the pipeline; the last batch's gradient, now due (None if nothing was in
        flight). A fresh last stage applied it already, but takes part in the flush's step
        with nothing due (its clipping and loss-scaler checks are collective)."""
        in_flight = not self.at_flush_point
        batch = self._drain(backward)
        if batch is None:
            return DueGradient() if in_flight and self.fresh else None
        return self._gradient_of(batch)

    def deliver_values(self, values: StepValues, settle: bool = False) -> list[StepValues]:
        """The logged values of a step, without a barrier.

        Without a flush, the other stages finish call t before the last stage has batch t's loss
        (their call ends with the first forwards of batch t+1); waiting for it would put the
        pipeline bubble back into every step. So the last stage (global rank 0: the progress bar
        and the loggers) logs batch t's own values in call t, and posts them to the other ranks,
        which log them one call late, in call t+1, when they have long arrived. Returns what
        this rank logs now: nothing on a rank other than 0 before the first values are owed.

        With ``settle`` (the last step of an epoch, or of fit) the other ranks also wait for
        batch t's values, so that their epoch's values, metric states and step outputs are
        complete when the epoch ends (one wait per epoch). At the first step of a fit they wait
        for them too (once) and keep them for the next step (:attr:`preview`): what a step returns
        (a dict's keys) is then known on every rank from the first step on.
        """
        channel = self.channel
        if channel is None:  # one stage
            return [values]
        if channel.is_source:
            channel.post(values)
            return [values]
        delivered: list[StepValues] = []
        if self._ahead is not None:  # batch t-1's values, received in call t-1
            delivered.append(self._ahead)
            self._ahead = None
        elif channel.backlog:
            delivered.append(channel.receive())  # batch t-1's values
        channel.expect()  # batch t's, posted by the last stage during this call
        if settle:
            delivered.append(channel.receive())
        elif self._first is None and not delivered:
            self._ahead = self._first = channel.receive()
        return delivered

    @property
    def preview(self) -> StepValues | None:
        return self._first

    def close(self) -> None:
        if self.channel is not None:
            self.channel.drain()  # the last step's values, owed to the other ranks

    @property
    def values_lag(self) -> int:
        return 1  # the other ranks log batch t's values in call t+1 (call t when settling)

    @property
    def weight_buffers(self) -> int:
        return self.versions.num_buffers

    @property
    def at_flush_point(self) -> bool:
        return self.admitted == self.segment_start

    def previous_version(self) -> list[Tensor] | None:
        """At a flush point: the weight version the next batch runs with when it is not the
        newest (2BW: version t-1 for batch t), which a checkpoint must keep for an exact resume."""
        if self.synchronous(self.admitted):
            return None
        if self.versions.predict is not None:  # the next batch's view, if made already
            return self.versions.view_tensors(self.admitted)
        version = WeightVersions.version_for(self.admitted)
        if self.admitted == 0 or version == self.versions.newest:
            return None
        return self.versions.tensors_of(version)

    def state(self, names: Sequence[str]) -> dict[str, Any]:
        """The batch count and the second weight version by parameter name (``names``, in
        ``versions.params`` order; empty when the next batch runs with the newest weights)."""
        previous = self.previous_version()
        return {
            "batches": self.admitted,
            "previous_weights": (
                dict(zip(names, previous, strict=True)) if previous is not None else {}
            ),
            "delay_correction": self.delay_correction,
            "fresh_last_stage": self.fresh_last_stage,
        }

    def resume(self, state: dict[str, Any], names: Sequence[str]) -> None:
        """Continue where :meth:`state` left off: the parameters hold the newest weights and
        ``state["previous_weights"]`` (by name) the version the next batch uses. A state
        without a batch count (written by a flush schedule, or not by pipe2bw) restarts the
        rule at the loaded weights, as at the start of training: W(-1) = W(0)."""
        if "batches" not in state:
            return
        written = state.get("delay_correction", "none")
        if written != self.delay_correction:
            warnings.warn(
                f"resuming 2BW with delay_correction={self.delay_correction!r} from a checkpoint "
                f"written with {written!r}: the next batch is evaluated where the checkpoint's rule "
                "put it, and the correction starts from whatever state the optimizer holds for it",
                stacklevel=2,
            )
        written_fresh = bool(state.get("fresh_last_stage", False))
        if self.engine.is_last and written_fresh != self.fresh_last_stage:
            warnings.warn(
                f"resuming 2BW with fresh_last_stage={self.fresh_last_stage} from a checkpoint "
                f"written with fresh_last_stage={written_fresh}: from here the last stage "
                + (
                    "runs every batch at its newest weights, its update uncorrected"
                    if self.fresh_last_stage
                    else "runs every batch one step late again, with the delay correction"
                )
                + ", so the run does not go on as the checkpoint's would have",
                stacklevel=2,
            )
        previous: list[Tensor] | None = None
        saved = state.get("previous_weights") or {}
        if saved:
            missing = [n for n in names if n not in saved]
            if missing:
                raise KeyError(
                    f"the checkpoint's second 2BW weight version lacks {len(missing)} parameters "
                    f"this stage needs, e.g. {missing[:5]}; was it written for a different model?"
                )
            previous = [saved[n] for n in names]
        self.restart(int(state["batches"]), previous)

    def restart(self, batches: int, previous: list[Tensor] | None) -> None:
        """Continue after ``batches`` batches at a flush point: the parameters hold the newest
        weights and ``previous`` the version batch ``batches`` uses."""
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
    at most p - s weight versions. No gradient is ever due at Lightning's step.
    """

    @staticmethod
    def max_versions(stage: int, num_stages: int) -> int:
        """The weight versions stage s may hold: p - s."""
        return num_stages - stage

    def _weights_for(self, microbatch: int) -> Mapping[str, Tensor]:
        return self.versions.weights_for(self.batch_of(microbatch), self.versions.newest)

    def reserved_versions(self) -> set[int]:
        return set()  # a forward always takes the newest weights

    def _new_stream(self) -> OneFOneBStream:
        return OneFOneBStream(self.engine.stage, self.engine.num_stages)

    def observe(self, action: Action) -> None:
        if action.ends_backward and (action.microbatch + 1) % self.m == 0:
            batch = self.batch_of(action.microbatch)
            grads = self.take_gradient(batch)
            for param, grad in zip(self.versions.params, grads, strict=True):
                param.grad = grad
            if self.average is not None:
                # the stage's replicas reach this backward at the same point of their (equal)
                # action lists, so they meet here, each pipeline waiting on nothing of the other
                self.average([p for p in self.versions.params if p.grad is not None])
            self.optimizer.apply(batch)
            for param in self.versions.params:
                param.grad = None
        super().observe(action)

    def due_batch(self) -> int | None:
        return None  # every update is applied inside the pipeline, as soon as it is complete

    def flush(self, backward: Callable[[Tensor], None]) -> DueGradient | None:
        self._drain(backward)  # the drained backwards apply the last updates
        return None

    def previous_version(self) -> list[Tensor] | None:
        return None  # after a flush every forward takes the newest weights

    def restart(self, batches: int, previous: list[Tensor] | None) -> None:
        super().restart(batches, None)
