"""PipeDream-2BW's double-buffered weights, and the optimizer wrapper that applies delayed updates."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pipe2bw.optim.delay import DelayCorrection
from lightning_pipe2bw.optim.shard import ParameterShards
from lightning_pipe2bw.optim.wrapper import WrappedOptimizer

__all__ = ["TwoBWOptimizer", "WeightVersions"]

VIEW = -1  # the version key of a batch's leaves when it computes with its predicted weights


class WeightVersions:
    """A stage's weight versions, each in its own buffer, and the tensors autograd sees.

    Version v is the stage's weights after v updates. The module's parameters (the ones the
    user's optimizer holds) always alias the *newest* version's buffer; in-flight micro-batches
    never see the parameters themselves but leaf tensors that alias their version's buffer, so:

    * an update is applied in place to the parameters only after they are re-pointed to a
      buffer that no in-flight micro-batch uses (copy newest -> free buffer, then step it), and
      the graphs of in-flight micro-batches keep reading the buffer they started with;
    * every batch accumulates its gradient into its own leaves (one set per version it ran
      with), even when two batches share a version;
    * once a batch has run its last backward on the stage (:meth:`finish`) its leaves hold its
      gradient and are read no more, so its version no longer needs a buffer of its own: on one
      stage, and on the last stage of a pipeline, where a batch ends in the call that admits it,
      each update between flushes is applied in place, without a copy.

    ``max_versions`` bounds the buffers: 2 for PipeDream-2BW, p - s for weight stashing on
    stage s; :meth:`advance` raises rather than exceed it.

    With ``predict`` (a delay correction that evaluates batches at predicted weights, see
    ``lightning_pipe2bw.optim.delay``), batch t computes not with version t - 1 but with a
    *view*: a buffer of its own that ``predict(t, newest, out)`` fills from version t - 1 (then
    the newest) when the batch first asks for weights. No batch then reads a version itself, so
    every update is applied in place; the views of in-flight batches keep their buffers.
    """

    def __init__(
        self,
        named_parameters: list[tuple[str, nn.Parameter]],
        max_versions: int = 2,
        reserved: Callable[[], set[int]] = set,
        predict: Callable[[int, list[Tensor], list[Tensor]], None] | None = None,
        upcoming: Callable[[], set[int]] = set,
    ) -> None:
        self.names = [name for name, _ in named_parameters]
        self.params = [param for _, param in named_parameters]
        self.max_versions = max_versions
        self._buffers: list[list[Tensor]] = [[p.data for p in self.params]]
        self._buffer_of: dict[int, int] = {0: 0}  # version -> buffer index
        self.newest = 0
        # (batch, version) -> leaves; (batch, VIEW) for a batch computing with its view
        self._leaves: dict[tuple[int, int], dict[str, Tensor]] = {}
        self._finished: set[int] = set()  # batches with leaves whose backwards have all run
        # versions that batches not admitted yet will need (2BW: the next batch's)
        self.reserved = reserved
        self.predict = predict
        self.upcoming = upcoming  # batches not admitted yet (2BW: the next one)
        self._view_of: dict[int, int] = {}  # batch -> the buffer of its predicted weights

    @staticmethod
    def version_for(batch: int) -> int:
        """PipeDream-2BW's rule: batch t runs with version max(t - 1, 0)."""
        return max(batch - 1, 0)

    def weights_for(self, batch: int, version: int | None = None) -> dict[str, Tensor]:
        """The leaf tensors batch ``batch`` computes with under ``version`` (default: the 2BW
        rule, or the batch's view under ``predict``), created on first use."""
        if version is None and self.predict is not None:
            return self._view_leaves(batch)
        version = self.version_for(batch) if version is None else version
        leaves = self._leaves.get((batch, version))
        if leaves is None:
            if version not in self._buffer_of:
                raise RuntimeError(
                    f"batch {batch} needs weight version {version}, but this stage holds versions "
                    f"{sorted(self._buffer_of)}: updates were applied out of order"
                )
            leaves = self._leaves_of(self._buffers[self._buffer_of[version]])
            self._leaves[(batch, version)] = leaves
        return leaves

    def _leaves_of(self, buffer: list[Tensor]) -> dict[str, Tensor]:
        return {
            name: t.detach().requires_grad_(p.requires_grad)
            for name, t, p in zip(self.names, buffer, self.params, strict=True)
        }

    def _view_leaves(self, batch: int) -> dict[str, Tensor]:
        leaves = self._leaves.get((batch, VIEW))
        if leaves is None:
            if batch not in self._view_of:
                self.make_view(batch)
            leaves = self._leaves_of(self._buffers[self._view_of[batch]])
            self._leaves[(batch, VIEW)] = leaves
        return leaves

    def make_view(self, batch: int) -> None:
        """Fill batch ``batch``'s view from the newest weights (which must be its 2BW version:
        the prediction reads the weights and the optimizer state the batch would have run
        with)."""
        assert self.predict is not None
        version = self.version_for(batch)
        if version != self.newest:
            raise RuntimeError(
                f"batch {batch} predicts its weights from version {version}, but this stage's "
                f"newest is {self.newest}: its view had to be made before the update"
            )
        free = self._free_buffer(self._busy())
        self.predict(batch, self._buffers[self._buffer_of[self.newest]], self._buffers[free])
        self._view_of[batch] = free

    def has_view(self, batch: int) -> bool:
        return batch in self._view_of

    def view_tensors(self, batch: int) -> list[Tensor] | None:
        """Batch ``batch``'s predicted weights (in ``params`` order), if it has a view."""
        index = self._view_of.get(batch)
        return None if index is None else self._buffers[index]

    def _busy(self) -> set[int]:
        """The buffers something still reads: live versions' and the views of batches with
        backwards to run (a finished batch's leaves keep its gradient, but nothing reads their
        values: its buffer may take the next view, as an update in place reuses a version's)."""
        views = {i for b, i in self._view_of.items() if b not in self._finished}
        return {self._buffer_of[v] for v in self.live_versions() if isinstance(v, int)} | views

    def _free_buffer(self, busy: set[int]) -> int:
        free = next((i for i in range(len(self._buffers)) if i not in busy), None)
        if free is None:
            if len(self._buffers) >= self.max_versions:
                raise RuntimeError(
                    f"this stage would need {len(self._buffers) + 1} weight buffers (live: "
                    f"{sorted(map(str, self.live_versions()))}), more than its bound of "
                    f"{self.max_versions}"
                )
            self._buffers.append([torch.empty_like(t) for t in self._buffers[0]])
            free = len(self._buffers) - 1
        return free

    def grads_of(self, batch: int) -> list[Tensor | None]:
        """Batch ``batch``'s gradient: the sum over the versions its micro-batches ran with."""
        sets = [leaves for (b, _), leaves in self._leaves.items() if b == batch]
        out: list[Tensor | None] = []
        for name in self.names:
            grads = [g for leaves in sets if (g := leaves[name].grad) is not None]
            if not grads:
                out.append(None)
            else:
                out.append(grads[0] if len(grads) == 1 else torch.stack(grads).sum(0))
        return out

    def finish(self, batch: int) -> None:
        """Batch ``batch`` has run its last backward on this stage: its leaves keep its gradient
        until :meth:`release`, but no computation reads their values any more."""
        if any(b == batch for b, _ in self._leaves):
            self._finished.add(batch)

    def release(self, batch: int) -> None:
        """Batch ``batch``'s gradient has been taken: drop its leaves (and its view)."""
        for key in [k for k in self._leaves if k[0] == batch]:
            del self._leaves[key]
        self._finished.discard(batch)
        self._view_of.pop(batch, None)

    def _reading(self) -> set[int]:
        """Versions that micro-batches still compute with (forwards or backwards to come)."""
        return {v for b, v in self._leaves if b not in self._finished and v != VIEW}

    def live_versions(self) -> set[int | tuple[str, int]]:
        """Versions some in-flight micro-batch, or a batch not admitted yet (``reserved``),
        still needs, plus the newest; and under ``predict`` the views still held, as
        ``("view", batch)``."""
        views = {("view", b) for b in self._view_of if b not in self._finished}
        return self._reading() | self._reserved() | {self.newest} | views

    def _reserved(self) -> set[int]:
        # a reserved version may not exist yet (it is the one the coming update creates)
        return {v for v in self.reserved() if v in self._buffer_of}

    def advance(self) -> None:
        """Make room for version ``newest + 1``: copy the newest weights into a buffer no live
        version uses and point the parameters at it, so the optimizer's in-place step leaves
        every version an in-flight micro-batch uses untouched. Under ``predict`` a batch not
        admitted yet that would predict from the newest weights (the next batch, after a flush
        applied its predecessor's update early) gets its view now, and the update is applied in
        place: no batch reads a version itself."""
        if self.predict is not None:
            for batch in self.upcoming():
                if batch not in self._view_of and self.version_for(batch) == self.newest:
                    self.make_view(batch)
            buffer = self._buffer_of[self.newest]
            self.newest += 1
            self._buffer_of = {self.newest: buffer}
            return
        in_use = self._reading() | self._reserved()
        if self.newest not in in_use:
            # no in-flight micro-batch reads the newest weights: update them in place
            buffer = self._buffer_of[self.newest]
            self._buffer_of = {v: self._buffer_of[v] for v in in_use}
            self.newest += 1
            self._buffer_of[self.newest] = buffer
            return
        live = self._reading() | self._reserved() | {self.newest}
        free = self._free_buffer({self._buffer_of[v] for v in live})
        current = self._buffer_of[self.newest]
        with torch.no_grad():
            for dst, src in zip(self._buffers[free], self._buffers[current], strict=True):
                dst.copy_(src)
        for param, t in zip(self.params, self._buffers[free], strict=True):
            param.data = t
        self._buffer_of = {v: self._buffer_of[v] for v in live}
        self.newest += 1
        self._buffer_of[self.newest] = free

    @property
    def num_buffers(self) -> int:
        return len(self._buffers)

    def tensors_of(self, version: int) -> list[Tensor] | None:
        """The buffer of ``version`` (in ``params`` order), or None if this stage no longer
        holds it."""
        index = self._buffer_of.get(version)
        return None if index is None else self._buffers[index]

    def restore(self, newest: int, previous: list[Tensor] | None) -> None:
        """Start from a checkpoint: the parameters hold version ``newest`` and ``previous``, if
        given, is what batch ``newest`` computes with (copied into a buffer of its own): version
        ``newest - 1``, or under ``predict`` that batch's view."""
        self._leaves.clear()
        self._finished.clear()
        self._view_of.clear()
        self._buffers = [[p.data for p in self.params]]
        self._buffer_of = {newest: 0}
        self.newest = newest
        if previous is not None:
            if newest < 1:
                raise ValueError(f"version {newest} has no previous version to restore")
            copies = [
                t.detach().to(device=p.device, dtype=p.dtype).clone()
                for t, p in zip(previous, self.params, strict=True)
            ]
            self._buffers.append(copies)
            if self.predict is not None:
                self._view_of[newest] = 1
            else:
                self._buffer_of[newest - 1] = 1


class TwoBWOptimizer(WrappedOptimizer):
    """Wraps the user's optimizer for the schedules without flushes (``2bw``, ``pipedream``);
    Lightning steps it once per batch, and it owns when and with which hyper-parameters each
    delayed update lands.

    With 2BW, in the step for batch t the gradient in the parameters' ``.grad`` is batch t-1's
    (the strategy puts it there: it is complete on every stage at the end of call t); with
    PipeDream the driver calls :meth:`apply` inside the pipeline. Either way an update is
    applied with the hyper-parameters (learning rate, weight decay, ...) the param groups had
    when Lightning stepped for batch t-1, so a scheduler gives every update the value a
    single-device run uses for it although the update lands one step later.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        versions: WeightVersions,
        correction: DelayCorrection | None = None,
        corrected_from: int = 0,
        shards: ParameterShards | None = None,
    ) -> None:
        super().__init__(optimizer)
        self.versions = versions
        # with shard_optimizer: this replica steps (and corrects) its own parameters, then the
        # replicas gather each other's (lightning_pipe2bw.optim.shard)
        self.shards = shards
        # the delay correction (lightning_pipe2bw.optim.delay); None: the plain rule
        self.correction = correction
        # the first batch whose update is corrected (the ones before are synchronous)
        self.corrected_from = corrected_from
        self.due: int | None = None  # batch whose gradient the next step applies
        self._hyper: dict[int, list[dict[str, Any]]] = {}

    def _snapshot(self) -> list[dict[str, Any]]:
        return [
            {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            for group in self.param_groups
        ]

    def record_hyperparameters(self, batch: int) -> None:
        """Remember the param groups' values (lr, weight decay, ...) for batch ``batch``'s update;
        called when Lightning runs that batch, before its scheduler steps."""
        self._hyper[batch] = self._snapshot()

    def hyperparameters_of(self, batch: int) -> list[dict[str, Any]] | None:
        """The param groups' values batch ``batch``'s update will use (None: not recorded, or
        applied already)."""
        return self._hyper.get(batch)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        if self.due is not None:
            self.apply(self.due)
        else:
            # the first step of a segment applies nothing yet, but it is this step's update,
            # deferred with the hyper-parameters recorded for it: tell torch's LR schedulers
            # (which would warn that their first value is skipped; it is not)
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return loss

    def apply(self, batch: int) -> None:
        """Apply batch ``batch``'s gradient (in ``.grad``) to the newest weights, through the
        delay correction if there is one."""
        self.versions.advance()
        hyper = self._hyper.pop(batch)
        current = self._snapshot()
        for group, values in zip(self.param_groups, hyper, strict=True):
            group.update(values)
        correction = self.correction if batch >= self.corrected_from else None
        shards = self.shards
        with (
            shards.updating_own(self.optimizer, correction)
            if shards is not None
            else contextlib.nullcontext()
        ):
            if correction is not None:
                correction.before_step()
            self.optimizer.step()
            if correction is not None:
                correction.after_step()
        if shards is not None:
            shards.gather()
        for group, values in zip(self.param_groups, current, strict=True):
            group.update(values)
        self.due = None

    def finish_step(self) -> None:
        """Close the step: if the update that was due did not run (the loss scaler skipped it for
        inf/NaN, on every stage alike), the next version is the current weights unchanged, so
        that version numbers keep meaning "after t updates"."""
        if self.due is None:
            return
        self.versions.advance()
        self._hyper.pop(self.due, None)
        if self.correction is not None:
            self.correction.skipped()
        self.due = None


