"""``PipelinedSteps``: one Trainer call's steps on this rank's stage, under Lightning's loop.

Lightning's closure runs ``training_step``, then ``zero_grad``, then ``backward``; the engine runs
every micro-batch's backward inside the step (through the precision plugin, with the loss
scaled for mixed precision), so the gradient the step applies is held out of ``.grad`` as a
``DueGradient`` until the ``backward`` hook, and ``zero_grad`` (with its hooks) acts on nothing
in between. A step's values reach every rank through ``steps.delivery``; a 2BW flush applies the
pipeline's last gradient by Lightning's own step path; the first update checks that every
trainable parameter got a gradient (``check_split``'s second half).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor

from lightning_pipe2bw import compat
from lightning_pipe2bw.pipeline.intake import check_every_parameter_used, whole_call
from lightning_pipe2bw.pipeline.stage_runtime import StageRuntime
from lightning_pipe2bw.runtime.driver import DueGradient
from lightning_pipe2bw.seam.hooklogs import StageLogs
from lightning_pipe2bw.seam.requeue import RequeueRelay
from lightning_pipe2bw.steps.delivery import StepDelivery
from lightning_pipe2bw.steps.log import StepRecording

__all__ = ["PipelinedSteps", "scaler_of"]

# the strategy's logger, as before the step's code moved here
log = logging.getLogger("lightning_pipe2bw.strategy")


def scaler_of(plugin: Precision) -> Any:
    """The mixed-precision plugin's loss scaler, or None."""
    return plugin.scaler if isinstance(plugin, MixedPrecision) else None


def _same(loss: Tensor) -> Tensor:
    return loss


class PipelinedSteps:
    """This rank's steps for one Trainer call (made at set-up, once the stage's runtime is
    built): running a pipelined hook, the gradient a step applies, the flush.

    ``hook_logs``: what the gradient hooks log,
    merged over the stages (None: nothing logs there); ``check_use``: the first update's check
    is to come."""

    def __init__(
        self,
        module: LightningModule,
        runtime: StageRuntime,
        plugin: Precision,
        device: torch.device,
        delivery: StepDelivery,
        requeue: RequeueRelay,
        *,
        hook_logs: StageLogs | None,
        check_use: bool,
    ) -> None:
        self.module = module
        self.runtime = runtime
        self.plugin = plugin
        self.device = device
        self.delivery = delivery
        self.requeue = requeue
        self.hook_logs = hook_logs
        self.check_use = check_use
        self.due = DueGradient()  # the gradient Lightning's coming optimizer step applies
        # the training step running now ends its epoch: 2BW drains after its update
        self.ends_epoch = False
        # ... or its epoch or fit: every rank logs what is owed to it before the step ends
        self.settle = False

    def run(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any], train: bool) -> Any:
        """Run ``hook`` (the user's step) over the batch ``args[0]``'s micro-batches, and return
        what it returns on this rank (``steps.delivery``)."""
        module, runtime = self.module, self.runtime
        counts = self._item_counts(hook, args, kwargs)
        with StepRecording(module, hook, args, kwargs, runtime.is_last) as recording:
            values = runtime.run_batch(
                args[0], recording.step, self.backward_microbatch, train=train,
                loss_root=self._loss_root(), counts=counts,
            )  # fmt: skip
        recording.fill(values)
        settle = train and compat.ends_epoch(module.trainer)
        self.ends_epoch = train and compat.last_batch_of_epoch(module.trainer)
        if train:
            self.settle = settle
        return self.delivery.deliver(
            runtime, recording, values, hook=hook, train=train, settle=settle,
            device=self.device, requeue=self.requeue,
            request=self._requeue_request if train and self.requeue.active else None,
        )  # fmt: skip

    def _item_counts(
        self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Tensor] | None:
        """On the last stage of a model whose loss divides by ``num_items_in_batch`` (a
        Hugging Face model: ``partition.hf.item_count``), under ``loss_normalization="batch"``:
        the whole batch's count, from the labels the step passes to the model on the whole
        batch (``pipeline.intake.whole_call``); else None."""
        runtime = self.runtime
        if not runtime.is_last or runtime.options.loss_normalization != "batch":
            return None
        body = runtime.body
        count = next(
            (c for i in body.indices if (c := getattr(body.block(i), "pipe_count", None))), None
        )
        if count is None:
            return None
        call = whole_call(self.module, hook, args, kwargs, body)
        n = count(call) if call is not None else None
        return None if n is None else {"num_items_in_batch": n}

    def take_due(self) -> None:
        """After a training step: hold the gradient it applies until the ``backward`` hook."""
        self.due = self.runtime.driver.take_due()

    def _requeue_request(self, lag: int) -> int | None:
        """On the last stage: the batch at whose start every rank answers SLURM's requeue
        warning, or None (``RequeueRelay.decide``; ``lag``: the driver's ``values_lag``)."""
        runtime = self.runtime  # the last stages of the replicas agree on it
        return self.requeue.decide(
            runtime.groups.stage, runtime.topology.data_parallel, self.device, lag
        )

    def _loss_root(self) -> Callable[[Tensor], Tensor] | None:
        """What :meth:`backward_microbatch` differentiates, as a function of the weighted loss
        (the loss scaled for mixed precision), or None where the module's or the precision
        plugin's own ``backward`` decides (then the last stage always runs the whole backward
        at once)."""
        if (
            type(self.module).backward is not LightningModule.backward
            or type(self.plugin).backward is not Precision.backward
        ):
            return None
        scaler = scaler_of(self.plugin)
        return scaler.scale if scaler is not None else _same

    def backward_microbatch(self, loss: Tensor) -> None:
        scaler = scaler_of(self.plugin)
        if scaler is not None:
            loss = scaler.scale(loss)
        self.plugin.backward(loss, self.module, None)

    def backward(self, closure_loss: Tensor) -> None:
        """Lightning's ``backward`` hook: the engine already ran every micro-batch's backward;
        the held gradient goes back into ``.grad`` (averaged over the replicas), and only the
        hooks are left to call."""
        due, self.due = self.due, DueGradient()
        self._check_use(due)
        self.runtime.average_gradients(due.install())
        if self.hook_logs is not None:
            self.hook_logs.start()  # what the gradient hooks log, merged over the stages
        compat.call_backward_hooks(self.module.trainer, closure_loss)

    def optimizer_step(
        self, step: Callable[[Callable[[], Any]], Any], closure: Callable[[], Any]
    ) -> Any:
        """Lightning's optimizer step ``step(closure)``, with what the gradient hooks log
        recorded after the closure (the step and backward) and merged over the stages."""
        logs = self.hook_logs
        if logs is None:
            return step(closure)
        with logs.window(self.settle):
            return step(_logging_after(closure, logs))

    def finish_update(self) -> bool:
        """After an update: whether to flush now. 2BW drains at the end of every epoch: the
        epoch's hooks (weight averaging, epoch-level schedulers, checkpoints) see the weights
        after every update of the epoch."""
        driver = self.runtime.driver
        driver.finish_update()
        return driver.flush_due() or self.ends_epoch

    def flush(self) -> None:
        """Drain a 2BW pipeline and apply the last batch's update (collective); nothing to do
        for flush schedules or an empty pipeline."""
        runtime = self.runtime
        due = runtime.flush(self.backward_microbatch)
        if due is None:
            return
        self._check_use(due)
        runtime.average_gradients(due.install())
        # Lightning's own step path: loss-scaler unscale and (agreed) inf check, the
        # on_before_optimizer_step hooks, clipping over all stages, then the update
        done = torch.zeros((), device=self.device)
        logs = self.hook_logs
        with logs.window(settle=True) if logs is not None else nullcontext():
            if logs is not None:
                logs.start()
            self.plugin.optimizer_step(
                runtime.optimizers[0], model=self.module, closure=lambda: done
            )
        runtime.driver.finish_update()
        due.clear()
        log.debug("pipe2bw: flushed the pipeline")

    def close(self) -> None:
        """End of fit: settle what the gradient hooks' logs still owe between the ranks."""
        if self.hook_logs is not None:
            self.hook_logs.close()

    def _check_use(self, due: DueGradient) -> None:
        """At the first update that applies a gradient: every trainable parameter of this stage
        got one (``pipeline.intake``); copies of a weight tied to another stage are left out (the
        copy in use may be the other's)."""
        if not self.check_use or not due.pairs:
            return
        self.check_use = False
        runtime = self.runtime
        shared = {id(c.param) for c in runtime.tied.copies} if runtime.tied else set()
        # a model's parameters its whole forward never ran get no gradient on one device either
        idle = runtime.body.unused_by_model
        skip = {id(p) for key, p in runtime.body.named_weights() if key in idle} if idle else set()
        unused = [
            p
            for p, grad in due.pairs
            if p.requires_grad and grad is None and id(p) not in shared and id(p) not in skip
        ]
        check_every_parameter_used(runtime.parameter_names(unused), runtime.topology.stage)


def _logging_after(closure: Callable[[], Any], logs: StageLogs) -> Callable[[], Any]:
    """``closure`` (the step and backward), after which ``logs`` records what the gradient
    hooks log (they run next, inside the optimizer's step)."""

    def run() -> Any:
        out = closure()
        logs.start()
        return out

    return run
