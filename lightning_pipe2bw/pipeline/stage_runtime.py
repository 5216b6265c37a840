"""``StageRuntime``: everything one rank runs for its stage during one Trainer call, ready to use.

It is built by :func:`lightning_pipe2bw.pipeline.assembly.build_runtime` and holds the stage
body, the engine (with its transport, stash and BPipe link), the driver (flush or asynchronous),
the layout and the process groups. The strategy hands it a batch and the user's step; it knows
nothing of Lightning: logging, precision and the optimizer step stay with the strategy.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from typing import Any, cast

import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_pipe2bw.failures.record import (
    FailureRecord,
    SignalStop,
    StageFailure,
    action_of,
    say,
)
from lightning_pipe2bw.optim.shard import ParameterShards
from lightning_pipe2bw.partition.split import Partition
from lightning_pipe2bw.pipeline.groups import (
    ProcessGroups,
    average_over_replicas,
    broadcast_from_last,
)
from lightning_pipe2bw.pipeline.options import PipeOptions
from lightning_pipe2bw.pipeline.ties import TiedCopies
from lightning_pipe2bw.pipeline.topology import Topology
from lightning_pipe2bw.runtime.driver import Driver, DueGradient
from lightning_pipe2bw.runtime.engine import PipelineEngine, StepFn, step_loss
from lightning_pipe2bw.runtime.items import batch_items
from lightning_pipe2bw.runtime.microbatch import batch_size_of, merge_outputs, split_batch
from lightning_pipe2bw.runtime.stage import StageBody
from lightning_pipe2bw.schedule import Schedule, add_communication, forward_only
from lightning_pipe2bw.steps.values import StepValues

__all__ = ["StageRuntime"]

log = logging.getLogger(__name__)


class StageRuntime:
    """One rank's stage, assembled: run batches through it, flush it, report a failure.

    Attributes: ``topology``, ``groups``, ``options``, ``root`` (the user's module, holding the
    body), ``body``, ``partition`` (the whole pipeline's blocks per stage), ``engine``,
    ``driver``, ``num_microbatches`` and ``optimizers`` (what Lightning steps: the user's, or
    the 2BW wrapper). Live repartitioning replaces ``partition`` and ``driver``.
    """

    def __init__(
        self,
        *,
        topology: Topology,
        groups: ProcessGroups,
        options: PipeOptions,
        root: nn.Module,
        body: StageBody,
        partition: Partition,
        engine: PipelineEngine,
        driver: Driver,
        num_microbatches: int,
        optimizers: list[Any],
        evicting: frozenset[int] = frozenset(),
        tied: TiedCopies | None = None,
        shards: Mapping[int, ParameterShards] | None = None,
    ) -> None:
        self.topology = topology
        self.groups = groups
        self.options = options
        self.root = root
        self.body = body
        self.partition = partition
        self.engine = engine
        self.driver = driver
        self.num_microbatches = num_microbatches
        self.optimizers = optimizers
        self.evicting = evicting  # the stages that evict activations this fit (BPipe)
        self.tied = tied  # this stage's copies of parameters shared with other stages
        # shard_optimizer: which replica updates each parameter, by id of the user's optimizer
        self.shards = dict(shards or {})
        # the body's dotted name in the user's module (it stays known once the whole body is
        # handed back at the end of the Trainer call)
        self.body_path = next(str(name) for name, m in root.named_modules() if m is body)
        self._forward_schedules: dict[int, Schedule] = {}

    @property
    def is_last(self) -> bool:
        return self.topology.is_last

    # ------------------------------------------------------------------ steps
    def run_batch(
        self,
        batch: Any,
        step: StepFn,
        backward: Callable[[Tensor], None],
        *,
        train: bool,
        loss_root: Callable[[Tensor], Tensor] | None = None,
        counts: Mapping[str, Tensor] | None = None,
    ) -> StepValues:
        """Run one batch through the stage: split into micro-batches, the driver (training) or
        a forward-only schedule. On the last stage: the batch's values, ``loss`` (a 0-d float64
        tensor on the loss's device: the micro-batch losses weighted by size) and ``extra``, or
        ``output`` (merged outputs on the CPU); empty values on the other stages. ``loss_root``:
        see ``PipelineEngine.execute``. With ``loss_normalization="batch"`` the micro-batches
        normalise by the whole batch's items (``runtime.items``): ``counts`` are the whole
        batch's counts the model's call on the last stage takes (``{"num_items_in_batch":
        N}``), and ``items_in_batch`` counts for the user's own loss."""
        size = batch_size_of(batch)
        m = self.num_microbatches if train else min(self.num_microbatches, size)
        microbatches, sizes = split_batch(batch, m)
        weights = [k / size for k in sizes]
        by_batch = self.options.loss_normalization == "batch"
        with batch_items(batch, microbatches, weights, counts) if by_batch else nullcontext():
            if train:
                results = self.driver.train_batch(microbatches, weights, step, backward, loss_root)
            else:
                results = self.engine.run(
                    self._forward_schedule(m),
                    microbatches,
                    step,
                    train=False,
                    loss_weights=weights,
                    backward=backward,
                    observer=self.driver.observe,
                )
        if not self.is_last:
            return StepValues()
        if train:
            # on the loss's device, in float64, so that the step does not wait for the device
            # here (the value reaches the host when another rank needs it)
            losses = [step_loss(r, i).detach().double() for i, r in enumerate(results)]
            loss = cast(Tensor, sum(w * x for w, x in zip(weights, losses, strict=True)))
            return StepValues(loss=loss, extra=_extra_values(results, sizes))
        merged = merge_outputs(results, sizes)
        return StepValues(output=apply_to_collection(merged, Tensor, lambda t: t.detach().cpu()))

    def _forward_schedule(self, num_microbatches: int) -> Schedule:
        m = num_microbatches
        if m not in self._forward_schedules:
            t = self.topology
            self._forward_schedules[m] = add_communication(
                forward_only(t.num_virtual, m, t.placement)
            )
        return self._forward_schedules[m]

    def deliver_values(
        self, values: StepValues, *, train: bool, settle: bool = False
    ) -> list[StepValues]:
        """The last stage's values of a step, on every rank of the pipeline, oldest first: a
        training step's through the driver's channel (posted ahead, so they are there when a
        rank needs them; 2BW's one step late, without a barrier, unless ``settle``), others
        broadcast."""
        if train:
            return self.driver.deliver_values(values, settle)
        return [broadcast_from_last(values, self.topology, self.groups)]

    def shards_of(self, optimizer: Any) -> ParameterShards | None:
        """The shards of the user's ``optimizer`` (``shard_optimizer``), or None."""
        return self.shards.get(id(optimizer))

    def average_gradients(self, params: Iterable[Tensor]) -> None:
        """Average the stage's due gradients with its replicas (data parallel x pipeline), and
        sum the gradients of parameters shared across stages over their copies (collective
        when any is due: every stage has a due gradient at the same steps)."""
        params = list(params)
        average_over_replicas(params, self.groups.stage, self.topology.data_parallel)
        if self.tied and params:
            self.tied.sum_gradients()

    def flush(self, backward: Callable[[Tensor], None]) -> DueGradient | None:
        """Drain the pipeline (2BW); the gradient now due, if any."""
        return self.driver.flush(backward)

    def release_transport(self) -> None:
        """End of a Trainer call that ended well (every rank is past its last action): wait
        for this rank's sends, then release the transport. Shared memory gives its rings back
        (8 MiB a channel) and closes its socket; each Trainer call builds a new transport, so a
        process that runs many calls (a notebook, a sweep) would otherwise hold every call's."""
        transport = self.engine.transport
        transport.wait_sends()
        transport.close()

    def close(self) -> None:
        """End of fit: settle the step values owed to other ranks, close the BPipe link."""
        self.driver.close()
        if self.engine.link is not None:
            self.engine.link.close()
            self.engine.link = None

    def start_block_timing(self) -> None:
        """Time every block's training forward, and the stage's, from zero (repartitioning)."""
        self.body.time_blocks()
        self.engine.stats.forward_s = self.engine.stats.backward_s = 0.0

    # ------------------------------------------------------------------ names
    def parameter_names(self, params: Iterable[Tensor]) -> list[str]:
        """The user's module's names of ``params`` (the body's by :meth:`weight_names`)."""
        name_of = {id(p): name for name, p in self.root.named_parameters()}
        prefix = self.body_path + "."
        name_of.update((id(p), prefix + name) for name, p in self.body.named_weights())
        return [name_of[id(p)] for p in params]

    def stage_state_dict(self) -> dict[str, Any]:
        """The user's module's state of this stage: its own blocks and everything outside the
        body, under the original names (whether the body is partitioned or handed back)."""
        prefix = self.body_path + "."
        body = self.body
        owned = set(body.indices)

        def mine(local: str) -> bool:
            if body.owner is not None:  # a model's keys: the block that holds each
                return body.owner.get(local, -1) in owned
            head = local.split(".", 1)[0]
            return head.isdigit() and int(head) in owned

        return {
            k: v
            for k, v in self.root.state_dict().items()
            if not k.startswith(prefix) or mine(k[len(prefix) :])
        }

    def weight_names(self) -> list[str]:
        """The names of the parameters whose versions the driver keeps (the stage's), as the
        body's state dict names them (stable across splits and the hand-back)."""
        prefix = self.body_path + "."
        return [prefix + name for name, _ in self.body.named_weights()]

    # ------------------------------------------------------------------ failures
    def report_failure(self, exception: BaseException) -> bool:
        """Tell the neighbour stages (and the BPipe partner) that this rank stops, so that they
        stop now with an error naming the failure instead of waiting for a message until the
        process-group timeout (see ``lightning_pipe2bw.failures.record``). False when there is
        no one to tell (one stage, no process group)."""
        engine, t = self.engine, self.topology
        if t.num_stages == 1 or not (dist.is_available() and dist.is_initialized()):
            return False
        if isinstance(exception, StageFailure):  # pass the first failure on, away from its source
            record, source = exception.record, exception.source
            say(f"pipe2bw: rank {t.rank} (stage {t.stage}) stops: {exception}")
        else:
            where = action_of(exception) or "code outside the pipeline schedule"
            error = f"{type(exception).__name__}: {exception}"
            record, source = FailureRecord(t.rank, t.stage, where, error), None
            # print it now: once the neighbours stop, a launcher may kill this process (the
            # popen launcher's observer kills rank 0 when a worker exits with an error)
            if isinstance(exception, (SignalStop, KeyboardInterrupt)):
                say(f"pipe2bw: {record.describe()}")  # a signal: the traceback says nothing
            else:
                say(
                    f"pipe2bw: {record.describe()}\n"
                    + "".join(traceback.format_exception(exception))
                )
        peers = [r for r in engine.neighbours if r != source and r != t.rank]
        if engine.link is not None and engine.link.partner != source:
            engine.link.fail(record)  # the partner may be waiting for activations
        try:
            engine.transport.notify(record, peers)
        except Exception as err:  # a neighbour that is gone already; the failure stands
            log.debug("pipe2bw: could not send the failure notice: %s", err)
        return True


def _extra_values(results: list[Any], sizes: list[int]) -> dict[str, Any] | None:
    """The values a training step returned besides the loss (a dict with more keys), merged over
    the micro-batches as one device computes them on the batch, detached; None without any."""
    extras = [
        {k: v for k, v in r.items() if k != "loss"} for r in results if isinstance(r, Mapping)
    ]
    if len(extras) != len(results) or not any(extras):
        return None
    merged = merge_outputs(extras, sizes)
    return apply_to_collection(merged, Tensor, lambda t: t.detach())  # type: ignore[no-any-return]
