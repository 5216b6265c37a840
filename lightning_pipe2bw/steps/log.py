"""What a step leaves behind, made the same on every rank as on one device: the values it logs
(``self.log``, torchmetrics ``Metric`` objects included) and the lists it appends its outputs to.

The user's step runs once per micro-batch, and past the body call only on the last stage. So:

* :class:`LogRecorder` records the ``self.log`` calls of a batch's micro-batch steps on the last
  stage, and :func:`replay` logs each name once per step on every rank, with the user's own
  arguments and the size-weighted mean of the micro-batch values (the full batch's value for
  per-sample means such as a loss or an accuracy). A torchmetrics ``Metric`` is logged as the
  object itself on the last stage (Lightning computes and resets it at epoch end, exactly as on
  one device); :class:`MetricStates` sends its state with the logged values, so that the other
  ranks log their own copy of it with the same state (the same step and epoch values, and the
  same reset at epoch end).
* :class:`StepOutputs` watches the module's lists during a batch on the last stage (the
  documented idiom: ``self.validation_step_outputs.append(...)`` in the step, then
  ``torch.stack`` in ``on_validation_epoch_end``). The items a batch appended, merged into the
  batch's item when there is one per micro-batch (as the step's return value is), are delivered
  with the logged values, and appended to the same lists on the other ranks, so that every
  rank's epoch-end hook sees what one device would.
"""

from __future__ import annotations

import inspect
import math
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch import LightningModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torchmetrics import Metric

from lightning_pipe2bw.compat import metric_batch_value, set_metric_batch_value, set_metric_state
from lightning_pipe2bw.runtime.microbatch import batch_size_of, merge_outputs
from lightning_pipe2bw.steps.values import StepValues

__all__ = [
    "StepRecording",
    "log_arguments",
    "quiet_epoch_sync_advice",
    "scalar_on",
    "share_metrics",
]

# (name, value, arguments of self.log, whether it is a Metric's step value). The value is a
# number, or a 0-d float64 tensor where the user logged tensors: on the device they were logged
# on until the values leave the rank (ObjectChannel.post moves them to the CPU)
Logged = tuple[str, "float | Tensor", dict[str, Any], bool]


@dataclass
class LogRecord:
    """One logged name over a batch: the size-weighted mean of its micro-batch values.

    The sum is kept where the values are: a logged tensor stays on its device (in float64, the
    same arithmetic as on Python numbers), so recording never waits for the device; the values
    reach the host once per step, and only when another rank needs them."""

    name: str
    arguments: dict[str, Any]  # the other arguments of LightningModule.log, as the user gave them
    samples: int = 0
    _weighted: float | Tensor = field(default=0.0, repr=False)
    metric: Metric | None = field(default=None, repr=False)  # a logged torchmetrics Metric

    @property
    def value(self) -> float | Tensor:
        return self._weighted / self.samples


class LogRecorder:
    """Context manager that swaps ``module.log`` for a recorder while the pipeline runs a batch.

    The user's step runs once per micro-batch and only the last stage computes the loss, so a
    plain ``self.log`` would log the last micro-batch's value on the last rank only. The recorder
    keeps, per name, the mean over micro-batches weighted by micro-batch size (equal to the full
    batch's value for per-sample means such as a loss or an accuracy). :func:`replay` then logs
    that value once, on every rank, with the user's own arguments, so the progress bar and the
    loggers on global rank 0 see what a single-device run would log.
    """

    def __init__(self, module: LightningModule, active: bool) -> None:
        self.module = module
        self.active = active
        self.records: dict[str, LogRecord] = {}
        self._samples = 0

    def begin_microbatch(self, samples: int) -> None:
        self._samples = samples

    def __enter__(self) -> LogRecorder:
        self.module.log = self._record  # type: ignore[method-assign]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        del self.module.log

    def _record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if not self.active:
            return
        arguments = log_arguments(self.module, name, value, args, kwargs)
        metric = value if isinstance(value, Metric) else None
        if metric is not None:
            # its value on this micro-batch (the forward's); None after update() alone
            value = metric_batch_value(metric)
            if value is None:
                value = math.nan
        number: float | Tensor
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"self.log({name!r}, ...) needs a scalar; got a tensor of shape {tuple(value.shape)}"
                )
            # float32 first, as Lightning logs it, then float64 for the weighted sum; on the
            # tensor's device, so that the step does not wait here for the device to catch up
            number = value.detach().reshape(()).float().double()
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        else:
            raise TypeError(
                f"with pipe2bw, self.log({name!r}, value) takes a number, a scalar tensor or a "
                f"torchmetrics Metric, got {type(value).__name__}"
            )
        samples = int(arguments.get("batch_size") or self._samples or 1)
        record = self.records.get(name)
        if record is None:
            record = self.records[name] = LogRecord(name, arguments)
        record.arguments = arguments
        record.metric = metric
        record.samples += samples
        record._weighted = record._weighted + number * samples

    def summary(self) -> list[Logged]:
        """Plain data to deliver: (name, value, arguments, is a Metric's) with batch_size set to
        the batch's."""
        out = []
        for rec in self.records.values():
            arguments = dict(rec.arguments)
            arguments["batch_size"] = rec.samples
            out.append((rec.name, rec.value, arguments, rec.metric is not None))
        return out

    def metrics(self) -> dict[str, Metric]:
        """The Metric objects logged this batch, by name (the last stage logs them as objects)."""
        return {r.name: r.metric for r in self.records.values() if r.metric is not None}


_SIGNATURES: dict[type, tuple[inspect.Signature, frozenset[str]]] = {}


def log_arguments(
    module: LightningModule, name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The arguments of a ``module.log(name, value, *args, **kwargs)`` call besides the name and
    the value, by parameter name."""
    signature, keywords = _log_signature(type(module))
    if not args and keywords.issuperset(kwargs):
        return dict(kwargs)  # what binding gives, without its cost on every call
    arguments = dict(signature.bind(module, name, value, *args, **kwargs).arguments)
    for key in ("self", "name", "value"):
        arguments.pop(key, None)
    arguments.update(arguments.pop("kwargs", {}))
    return arguments


def _log_signature(cls: type) -> tuple[inspect.Signature, frozenset[str]]:
    """The signature of ``cls.log`` and the names it takes by keyword (besides name, value),
    worked out once per class."""
    found = _SIGNATURES.get(cls)
    if found is None:
        signature = inspect.signature(cls.log)  # type: ignore[attr-defined]
        keywords = frozenset(
            n
            for n, p in signature.parameters.items()
            if n not in ("self", "name", "value")
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        )
        found = _SIGNATURES[cls] = (signature, keywords)
    return found


def replay(
    log: Callable[..., None],
    summary: Sequence[Logged],
    device: torch.device,
    metrics: dict[str, Metric] | None = None,
) -> None:
    """Log every recorded value with the module's real ``log`` method. ``metrics``: the Metric
    objects logged by name, logged as objects (their step value set to the batch's)."""
    for name, value, arguments, _ in summary:
        metric = (metrics or {}).get(name)
        if metric is not None:
            # a NaN number: only update() ran, there is no step value
            if not (isinstance(value, float) and math.isnan(value)):
                set_metric_batch_value(metric, scalar_on(device, value))
            log(name, metric, **arguments)
        else:
            arguments = {k: v for k, v in arguments.items() if k != "metric_attribute"}
            log(name, scalar_on(device, value), **arguments)


def scalar_on(device: torch.device, value: float | Tensor) -> Tensor:
    """``value`` as a 0-d tensor of the default dtype on ``device`` (what ``torch.tensor(value,
    device=device)`` makes) without waiting for the device: a tensor already there is converted
    there, a number is filled in by a kernel instead of copied from the host (a copy from
    pageable host memory waits for the device's queue to drain)."""
    dtype = torch.get_default_dtype()
    if isinstance(value, Tensor) and value.device == device:
        return value.to(dtype)
    return torch.full((), float(value), dtype=dtype, device=device)


class MetricStates:
    """The states of the torchmetrics Metrics a batch logged, from the last stage to the others.

    On the last stage, :meth:`take` (after the batch) gives each logged Metric's state by its
    name in the module: tensor states whole (they are small: counts, sums), list states
    (``"cat"`` reductions: predictions, targets) only the items added since the batch started.
    On the other ranks, :meth:`apply` sets the module's own copy of each Metric to the same
    state; the logged names map to those copies."""

    def __init__(self, module: torch.nn.Module, active: bool) -> None:
        self.module = module
        self._lengths: dict[int, dict[str, int]] = {}
        if active:
            self._lengths = {
                id(m): {k: len(v) for k, v in m.metric_state.items() if isinstance(v, list)}
                for m in _metrics_of(module)
            }

    def take(self, metrics: dict[str, Metric]) -> dict[str, Any]:
        """``{logged name: (module path, states, update count)}`` for the batch's Metrics."""
        if not metrics:
            return {}
        paths = {id(m): path for path, m in self.module.named_modules() if isinstance(m, Metric)}
        out: dict[str, Any] = {}
        for name, metric in metrics.items():
            start = self._lengths.get(id(metric), {})
            states: dict[str, Any] = {}
            for key, value in metric.metric_state.items():
                if isinstance(value, list):
                    before = start.get(key, 0)
                    # reset during the batch: everything; else what the batch added
                    states[key] = ("extend", value[before:] if len(value) >= before else value)
                else:
                    states[key] = ("set", value)
            out[name] = (paths[id(metric)], states, metric.update_count)
        return apply_to_collection(out, Tensor, lambda t: t.detach().cpu())  # type: ignore[no-any-return]

    @staticmethod
    def apply(
        module: torch.nn.Module, taken: dict[str, Any], device: torch.device
    ) -> dict[str, Metric]:
        """Set this rank's copies to the last stage's states; the copies by logged name."""
        copies: dict[str, Metric] = {}
        for name, (path, states, count) in taken.items():
            metric = module.get_submodule(path)
            assert isinstance(metric, Metric)
            values: dict[str, Any] = {}
            for key, (how, value) in states.items():
                value = apply_to_collection(value, Tensor, lambda t: t.to(device))
                values[key] = [*getattr(metric, key), *value] if how == "extend" else value
            set_metric_state(metric, values, count)
            copies[name] = metric
        return copies


_METRICS: weakref.WeakKeyDictionary[torch.nn.Module, list[Metric]] = weakref.WeakKeyDictionary()


def _metrics_of(module: torch.nn.Module) -> list[Metric]:
    """The module's torchmetrics Metrics, found once per module (as Lightning finds the Metric
    attributes that ``self.log`` accepts once, at the first log)."""
    found = _METRICS.get(module)
    if found is None:
        found = _METRICS[module] = [m for m in module.modules() if isinstance(m, Metric)]
    return found


def share_metrics(module: torch.nn.Module, last_stage: bool, group: Any | None) -> None:
    """Make the module's torchmetrics Metrics safe in a pipeline: only the last stage updates
    them (the others hold copies of their state, see :class:`MetricStates`), so their
    synchronisation (``compute()``, ``dist_sync_on_step``) must not wait for the other stages.
    With ``group`` (the last stage of every replica: the data-parallel shards of one metric) the
    last stage syncs in it; otherwise nothing syncs."""
    for metric in module.modules():
        if isinstance(metric, Metric):
            if last_stage and group is not None:
                metric.process_group = group
            else:
                metric.distributed_available_fn = _not_distributed


def _not_distributed() -> bool:
    return False


def quiet_epoch_sync_advice() -> None:
    """Lightning advises ``sync_dist=True`` for every value logged on epoch level in a
    distributed run. Under pipe2bw every rank of a pipeline logs the last stage's values
    (:func:`replay`), so they agree already; the advice does not apply. Installed once per
    process (changing the filters makes Python show every once-per-place warning again)."""
    global _QUIET
    if _QUIET:
        return
    _QUIET = True
    warnings.filterwarnings(
        "ignore",
        message=r"It is recommended to use `self.log\(.*, sync_dist=True\)` when logging on epoch",
        category=PossibleUserWarning,
    )


_QUIET = False


class StepOutputs:
    """The lists of ``module`` (attributes that are lists, or dicts of lists) a batch's steps
    append to, watched on the last stage (``active``); see the module notes. On the other
    stages the step runs up to the body call only, so what it appends there (before the call)
    is dropped after the batch (:meth:`discard`): those lists get the last stage's items."""

    def __init__(self, module: torch.nn.Module, active: bool) -> None:
        self.module = module
        self.active = active
        self._before = {key: (lst, len(lst)) for key, lst in _lists(module)}

    def collect(self, sizes: Sequence[int]) -> dict[tuple[str, Any], list[Any]]:
        """The items each list got during the batch (on the last stage). A list that got one
        item per micro-batch gets the batch's item instead, merged as the step outputs are
        (tensors of micro-batch length concatenated, scalars averaged by micro-batch size)."""
        if not self.active:
            return {}
        appended: dict[tuple[str, Any], list[Any]] = {}
        for key, lst in _lists(self.module):
            before = self._before.get(key)
            if before is not None and before[0] is not lst:
                continue  # replaced by the step: not an append
            start = before[1] if before is not None else 0
            if len(lst) <= start:
                continue
            items = lst[start:]
            if len(items) == len(sizes) > 1:
                items = [merge_outputs(items, sizes)]
                lst[start:] = items
            appended[key] = items
        return appended

    def discard(self) -> None:
        """Drop what the batch's partial steps appended to the module's lists (on a stage other
        than the last: the step ran there up to the body call)."""
        for key, lst in _lists(self.module):
            before = self._before.get(key)
            if before is not None and before[0] is lst:
                del lst[before[1] :]

    @staticmethod
    def apply(
        module: torch.nn.Module, appended: dict[tuple[str, Any], list[Any]], device: torch.device
    ) -> None:
        """Append the last stage's items to this rank's lists (on the other ranks)."""
        for (attr, key), items in appended.items():
            target = getattr(module, attr, None)
            if key is not None and isinstance(target, dict):
                target = target[key] if key in target else target.setdefault(key, [])
            if isinstance(target, list):
                target.extend(apply_to_collection(items, Tensor, lambda t: t.to(device)))

    @staticmethod
    def to_cpu(appended: dict[tuple[str, Any], list[Any]]) -> dict[tuple[str, Any], list[Any]]:
        return apply_to_collection(appended, Tensor, lambda t: t.detach().cpu())  # type: ignore[no-any-return]


def _lists(module: torch.nn.Module) -> Iterator[tuple[tuple[str, Any], list[Any]]]:
    """The module's list attributes, and the lists inside its dict attributes."""
    for attr, value in vars(module).items():
        if attr.startswith("_"):
            continue
        if isinstance(value, list):
            yield (attr, None), value
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, list):
                    yield (attr, key), item


class StepRecording:
    """One pipelined step of the user's ``hook``, from the values it leaves behind on the last
    stage to the same values on every rank.

    :meth:`step` is the user's step for one micro-batch; while the ``with`` block runs (the
    pipeline runs the batch), ``self.log`` is recorded. :meth:`fill` (on the last stage) adds
    what to deliver to the step's values: the logged values, the items appended to the module's
    lists, the logged Metrics' states. :meth:`apply` takes delivered values on any rank: the
    lists and Metric copies are brought up to date (not on the last stage, where they are), and
    the values logged with Lightning's own ``self.log``."""

    def __init__(
        self, module: LightningModule, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any],
        last_stage: bool,
    ) -> None:  # fmt: skip
        self.module = module
        self.last_stage = last_stage
        self._fn = getattr(module, hook)
        self._rest, self._kwargs = args[1:], kwargs
        self.recorder = LogRecorder(module, active=last_stage)
        self.outputs = StepOutputs(module, active=last_stage)  # the lists the steps append to
        self.states = MetricStates(module, active=last_stage)  # the Metrics the steps update
        self.sizes: list[int] = []

    def step(self, microbatch: Any) -> Any:
        self.sizes.append(batch_size_of(microbatch))
        self.recorder.begin_microbatch(self.sizes[-1])
        return self._fn(microbatch, *self._rest, **self._kwargs)

    def __enter__(self) -> StepRecording:
        self.recorder.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.recorder.__exit__(*exc)

    def fill(self, values: StepValues) -> None:
        """Add what the last stage delivers besides the loss or the outputs to ``values`` (on
        another stage: nothing, and what its partial steps appended to the module's lists is
        dropped)."""
        if not self.last_stage:
            self.outputs.discard()
            return
        values.logs = self.recorder.summary()
        values.appended = StepOutputs.to_cpu(self.outputs.collect(self.sizes))
        values.metrics = self.states.take(self.recorder.metrics())

    def apply(self, values: StepValues, device: torch.device) -> None:
        """Bring this rank up to the last stage's ``values`` and log them (the recorder is gone
        now)."""
        assert values.logs is not None, "the last stage's values of a step carry its logs"
        if self.last_stage:
            metrics = self.recorder.metrics()
        else:
            assert values.appended is not None and values.metrics is not None
            StepOutputs.apply(self.module, values.appended, device)
            metrics = MetricStates.apply(self.module, values.metrics, device)
        replay(self.module.log, values.logs, device, metrics)
