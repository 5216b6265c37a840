"""Values logged in the hooks every stage runs on its own share of the model (the gradient
hooks: ``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``), merged over
the stages of the pipeline and logged alike on every rank, as one device logs them.

The usual idiom is Lightning's own::

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))

On a stage, ``self`` holds that stage's parameters, so each stage computes the norms of its own
gradients and a total over them. :class:`StageLogs` records every rank's ``self.log`` calls in
those hooks, gathers them along the pipeline once per step and logs on every rank:

* a name that one stage logged (a parameter's norm) with that stage's value;
* a name several stages logged alike (a learning rate) once;
* ``grad_<p>_norm_total`` (Lightning's ``grad_norm``) as the p-norm of every stage's per-parameter
  norms, computed as ``grad_norm`` computes it: the whole model's total;
* a parameter shared by blocks on several stages (a tie) under its one-device name only (each
  stage's copy holds the same summed gradient);
* any other name the stages logged with different values (a statistic over "all" parameters
  that is the stage's own) with the last stage's value, after a warning that names it.
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


class StageLogs:
    """Records ``module.log`` between :meth:`start` and :meth:`finish` on every rank, and
    :meth:`finish` logs the merged values (see the module notes).

    ``gather(calls)`` is collective along the pipeline and returns every stage's
    :data:`StageCalls` in stage order; ``tied`` maps this stage's copies of shared parameters to
    the primary's name; ``device``: where the values are logged."""

    def __init__(
        self,
        module: LightningModule,
        stage: int,
        tied: Mapping[str, str],
        gather: Callable[[StageCalls], list[StageCalls]],
        device: torch.device,
    ) -> None:
        self.module = module
        self.stage = stage
        self.tied = dict(tied)
        self.gather = gather
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
    def window(self) -> Iterator[None]:
        """Around an optimizer step: on exit :meth:`finish`, or, when the step raised, stop
        recording without gathering (the other ranks may never get there)."""
        try:
            yield
        except BaseException:
            if self._calls is not None:
                self._calls = None
                del self.module.log
            raise
        self.finish()

    def finish(self) -> None:
        """Stop recording, gather every stage's calls (collective along the pipeline) and log
        the merged values on this rank. A no-op when :meth:`start` was not called."""
        calls, self._calls = self._calls, None
        if calls is None:
            return
        del self.module.log
        merged, differing = merge_stage_logs(self.gather((self.stage, self.tied, calls)))
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
        for call in merged:
            value = call.value.to(self.device) if isinstance(call.value, Tensor) else call.value
            with compat.running_hook(self.module, call.hook):
                self.module.log(call.name, value, **call.arguments)


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
    return StageLogs(
        module, topology.stage, tied, lambda calls: gather_stages(calls, topology, groups), device
    )
