"""Values logged in the hooks every stage runs on its own share of the model (the gradient
hooks: ``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``), merged over
the stages of the pipeline and logged alike on every rank, as one device logs them.

The usual idiom is Lightning's own::

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))

On a stage, ``self`` holds that stage's parameters, so each stage computes the norms of its own
gradients and a total over them. :class:`StageLogs` records every rank's ``self.log`` calls in
those hooks, brings them together once per step and logs on every rank:

* a name that one stage logged (a parameter's norm) with that stage's value;
* a name several stages logged alike (a learning rate) once;
* ``grad_<p>_norm_total`` (Lightning's ``grad_norm``) as the p-norm of every stage's per-parameter
  norms, computed as ``grad_norm`` computes it: the whole model's total;
* a parameter shared by blocks on several stages (a tie) under its one-device name only (each
  stage's copy holds the same summed gradient);
* any other name the stages logged with different values (a statistic over "all" parameters
  that is the stage's own) with the last stage's value, after a warning that names it.

How the calls come together depends on the schedule. A flush schedule gathers them along the
pipeline at each step (:class:`GatheredLogs`): its stages end a step together anyway. Without a
flush (2BW, PipeDream) the stages end their steps at different times, and a gather would make
every stage wait for the slowest at every step: the bubble 2BW exists to remove. There
(:class:`RelayedLogs`) each stage posts its calls to the last stage without waiting; the last
stage (global rank 0: the loggers) merges and logs them in the same step, and posts the merged
calls back, which the other stages log one step late, as they log the step's own values
(``TwoBWDriver.deliver_values``); at the last step of an epoch, or of fit, they wait for them.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torchmetrics import Metric

from lightning_pipe2bw import compat
from lightning_pipe2bw.pipeline.groups import gather_stages
from lightning_pipe2bw.pipeline.stage_runtime import StageRuntime
from lightning_pipe2bw.runtime.channel import CHANNEL_TAGS, DEFAULT_TAG, ObjectChannel
from lightning_pipe2bw.steps.log import log_arguments

__all__ = ["StageLogs", "stage_logs"]

GRADIENT_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")

_TOTAL = re.compile(r"^grad_(?P<p>.+)_norm_total$")


@dataclass
class LogCall:
    """One ``self.log`` call: the hook it ran in, the name, the value (a number or a CPU
    tensor) and the call's other arguments."""

    hook: str | None
    name: str
    value: float | Tensor
    arguments: dict[str, Any]


# (stage, {a tied copy's name on that stage: the primary's name}, the stage's calls)
StageCalls = tuple[int, dict[str, str], list[LogCall]]


def logs_in_gradient_hooks(trainer: Trainer, module: LightningModule) -> bool:
    """Whether the module or a callback overrides one of the gradient hooks (and may log there)."""
    if any(is_overridden(h, module, LightningModule) for h in GRADIENT_HOOKS):
        return True
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    return any(is_overridden(h, cb, Callback) for cb in callbacks for h in GRADIENT_HOOKS)


class GatheredLogs:
    """Every stage's calls gathered at each step (``gather``: collective along the pipeline,
    every stage's :data:`StageCalls` in stage order) and merged on every rank."""

    def __init__(self, gather: Callable[[StageCalls], list[StageCalls]]) -> None:
        self.gather = gather

    def exchange(self, mine: StageCalls, settle: bool) -> tuple[list[list[LogCall]], list[str]]:
        """This step's merged calls (to log now) and the names the stages logged differently."""
        merged, differing = merge_stage_logs(self.gather(mine))
        return [merged], differing

    def close(self) -> None:
        """Nothing is ever owed."""


class RelayedLogs:
    """The calls brought together without a barrier (see the module notes): each stage posts
    its calls to the last stage (``to_last``; ``from_stages`` on the last stage, one channel per
    other stage, in stage order), which merges them with its own in the same step and posts the
    merged calls to the other stages (``merged``), where they are logged one step late (at the
    same step when ``settle``)."""

    def __init__(
        self,
        is_last: bool,
        merged: ObjectChannel,
        to_last: ObjectChannel | None,
        from_stages: Sequence[ObjectChannel],
    ) -> None:
        self.is_last = is_last
        self.merged = merged
        self.to_last = to_last
        self.from_stages = list(from_stages)

    def exchange(self, mine: StageCalls, settle: bool) -> tuple[list[list[LogCall]], list[str]]:
        """The merged calls to log now, oldest first: on the last stage this step's; elsewhere
        the previous step's, if owed, and this step's too when ``settle``. And the names the
        stages logged differently (known on the last stage)."""
        if self.is_last:
            stages = [mine]
            for channel in self.from_stages:
                channel.expect()
                stages.append(channel.receive())  # posted when that stage ended its step
            merged, differing = merge_stage_logs(sorted(stages, key=lambda s: s[0]))
            self.merged.post(merged)
            return [merged], differing
        assert self.to_last is not None
        self.to_last.post(mine)
        now: list[list[LogCall]] = []
        if self.merged.backlog:
            now.append(self.merged.receive())  # the previous step's, there long ago
        self.merged.expect()
        if settle:
            now.append(self.merged.receive())
        return now, []

    def close(self) -> None:
        """End of fit: take what is still owed (a fit that stopped early) and finish the
        sends."""
        for channel in (self.merged, self.to_last, *self.from_stages):
            if channel is not None:
                channel.drain()


class StageLogs:
    """Records ``module.log`` between :meth:`start` and :meth:`finish` on every rank, and
    :meth:`finish` logs the merged values (see the module notes).

    ``exchange``: a :class:`GatheredLogs` or a :class:`RelayedLogs`; ``tied`` maps this stage's
    copies of shared parameters to the primary's name; ``device``: where the values are
    logged."""

    def __init__(
        self,
        module: LightningModule,
        stage: int,
        tied: Mapping[str, str],
        exchange: GatheredLogs | RelayedLogs,
        device: torch.device,
    ) -> None:
        self.module = module
        self.stage = stage
        self.tied = dict(tied)
        self.exchange = exchange
        self.device = device
        self._calls: list[LogCall] | None = None
        self._warned: set[str] = set()

    @property
    def recording(self) -> bool:
        return self._calls is not None

    def start(self) -> None:
        """Record the module's ``self.log`` calls from now on (again: nothing)."""
        if self._calls is None:
            self._calls = []
            self.module.log = self._record  # type: ignore[method-assign]

    def _record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        assert self._calls is not None
        arguments = log_arguments(self.module, name, value, args, kwargs)
        if isinstance(value, Metric):  # a Metric's state lives on its rank: log it there
            type(self.module).log(self.module, name, value, **arguments)
            return
        if isinstance(value, Tensor):
            value = value.detach().cpu()
        self._calls.append(LogCall(compat.current_hook(self.module), name, value, arguments))

    @contextmanager
    def window(self, settle: bool) -> Iterator[None]:
        """Around an optimizer step: on exit :meth:`finish`, or, when the step raised, stop
        recording without exchanging (the other ranks may never get there)."""
        try:
            yield
        except BaseException:
            if self._calls is not None:
                self._calls = None
                del self.module.log
            raise
        self.finish(settle)

    def finish(self, settle: bool) -> None:
        """Stop recording, bring every stage's calls together and log the merged values on this
        rank (``settle``: the last step of an epoch or of fit, after which every rank has
        logged every step's values). A no-op when :meth:`start` was not called."""
        calls, self._calls = self._calls, None
        if calls is None:
            return
        del self.module.log
        ready, differing = self.exchange.exchange((self.stage, self.tied, calls), settle)
        for name in differing:
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(
                    f"pipe2bw: the stages logged {name!r} with different values in a gradient "
                    "hook: each stage computed it over its own parameters, so it is not the "
                    "whole model's value; the last stage's is logged. Lightning's grad_norm total "
                    "is merged over every stage; compute other whole-model values from values "
                    "logged per parameter",
                    stacklevel=2,
                )
        for merged in ready:
            for call in merged:
                value = call.value.to(self.device) if isinstance(call.value, Tensor) else call.value
                with compat.running_hook(self.module, call.hook):
                    self.module.log(call.name, value, **call.arguments)

    def close(self) -> None:
        """End of fit: settle what the exchange still owes (see :meth:`RelayedLogs.close`)."""
        self.exchange.close()


def merge_stage_logs(stages: Sequence[StageCalls]) -> tuple[list[LogCall], list[str]]:
    """Every stage's calls (in stage order) merged into what one device logs (see the module
    notes), in one device's order; and the names the stages logged with different values."""
    logged = {c.name for _, _, calls in stages for c in calls}
    by_name: dict[str, list[LogCall]] = {}
    place: dict[str, tuple[int, int]] = {}  # (last stage logging it, its position there)
    for stage, tied, calls in stages:
        for position, call in enumerate(calls):
            if _is_tied_copy(call.name, tied, logged):
                continue
            by_name.setdefault(call.name, []).append(call)
            place[call.name] = (stage, position)
    merged: list[LogCall] = []
    differing: list[str] = []
    for name in sorted(by_name, key=place.__getitem__):
        calls = by_name[name]
        total = _TOTAL.match(name)
        if total is not None and len(calls) > 1:
            merged.append(_whole_total(calls[-1], total.group("p"), by_name))
        elif all(_same(c.value, calls[0].value) for c in calls[1:]):
            merged.append(calls[0])
        else:
            merged.append(calls[-1])
            differing.append(name)
    return merged, differing


def _is_tied_copy(name: str, tied: Mapping[str, str], logged: set[str]) -> bool:
    """``name`` ends with a tied copy's parameter name and the same name with the primary's
    parameter name was logged too (by the primary's stage)."""
    for copy_name, primary in tied.items():
        if name.endswith(copy_name):
            head = name[: len(name) - len(copy_name)]
            if (not head or not head[-1].isalnum()) and head + primary in logged:
                return True
    return False


def _whole_total(call: LogCall, norm: str, by_name: Mapping[str, list[LogCall]]) -> LogCall:
    """``grad_<p>_norm_total`` over every stage's ``grad_<p>_norm<sep><parameter>`` values, as
    ``lightning.pytorch.utilities.grad_norm`` computes it (a tensor of the norms, its p-norm)."""
    prefix = f"grad_{norm}_norm"
    parts = [
        calls[0].value
        for name, calls in by_name.items()
        if name.startswith(prefix) and not _TOTAL.match(name)
    ]
    values = torch.tensor([float(v) if not isinstance(v, Tensor) else v for v in parts])
    return LogCall(call.hook, call.name, values.norm(float(norm)), call.arguments)


def _same(a: float | Tensor, b: float | Tensor) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a == b


def stage_logs(
    trainer: Trainer, module: LightningModule, runtime: StageRuntime, device: torch.device
) -> StageLogs | None:
    """What merges the values the gradient hooks log over the stages of ``runtime``'s pipeline,
    or None where there is one stage or nothing logs there."""
    topology, groups = runtime.topology, runtime.groups
    if topology.num_stages == 1 or not logs_in_gradient_hooks(trainer, module):
        return None
    tied: dict[str, str] = {}
    if runtime.tied:
        body, path = runtime.body, runtime.body_path
        for param, (block, name) in runtime.tied.copies_elsewhere():
            tied[runtime.parameter_names([param])[0]] = f"{path}.{body.key_of(block, name)}"
    exchange: GatheredLogs | RelayedLogs
    if runtime.options.is_async:
        exchange = relayed_logs(runtime)
    else:
        exchange = GatheredLogs(lambda calls: gather_stages(calls, topology, groups))
    return StageLogs(module, topology.stage, tied, exchange, device)


# the hook logs' channels: tags of their own beside the step values' channel in the same group
_MERGED_TAG = DEFAULT_TAG + CHANNEL_TAGS
_TO_LAST_TAG = DEFAULT_TAG + 2 * CHANNEL_TAGS


def relayed_logs(runtime: StageRuntime) -> RelayedLogs:
    """The channels of a :class:`RelayedLogs` for this rank's pipeline: from every other rank
    of the pipeline to the last stage's, and from it back to all of them (no collective)."""
    topology, group = runtime.topology, runtime.groups.values()
    members, last = topology.pipeline_ranks(), topology.last_rank
    merged = ObjectChannel(last, group, members, tag=_MERGED_TAG)
    if topology.rank == last:
        others = [r for r in members if r != last]
        channels = [ObjectChannel(r, group, [r, last], tag=_TO_LAST_TAG) for r in others]
        return RelayedLogs(True, merged, None, channels)
    to_last = ObjectChannel(topology.rank, group, [topology.rank, last], tag=_TO_LAST_TAG)
    return RelayedLogs(False, merged, to_last, [])
