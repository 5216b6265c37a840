"""Recording ``self.log`` calls made per micro-batch and replaying them once per batch on every rank."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from lightning.pytorch import LightningModule

__all__ = ["LogRecord", "LogRecorder", "replay"]


@dataclass
class LogRecord:
    """One logged name over a batch: the size-weighted mean of its micro-batch values."""

    name: str
    value: float
    arguments: dict[str, Any]  # the other arguments of LightningModule.log, as the user gave them
    samples: int = 0
    _weighted: float = field(default=0.0, repr=False)


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
        self._signature = inspect.signature(type(module).log)

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
        bound = self._signature.bind(self.module, name, value, *args, **kwargs)
        arguments = dict(bound.arguments)
        for key in ("self", "name", "value"):
            arguments.pop(key, None)
        arguments.update(arguments.pop("kwargs", {}))
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"self.log({name!r}, ...) needs a scalar; got a tensor of shape {tuple(value.shape)}"
                )
            number = float(value.detach().float().cpu())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        else:
            raise TypeError(
                f"with pipe2bw, self.log({name!r}, value) takes a number or a scalar tensor, got "
                f"{type(value).__name__}: a torchmetrics Metric object lives on the last stage only, "
                "so log the tensor it returns (self.log(name, metric(preds, target)))"
            )
        samples = int(arguments.get("batch_size") or self._samples or 1)
        record = self.records.get(name)
        if record is None:
            record = self.records[name] = LogRecord(name, 0.0, arguments)
        record.arguments = arguments
        record.samples += samples
        record._weighted += number * samples
        record.value = record._weighted / record.samples

    def summary(self) -> list[tuple[str, float, dict[str, Any]]]:
        """Plain data to broadcast: (name, value, arguments) with batch_size set to the batch's."""
        out = []
        for rec in self.records.values():
            arguments = dict(rec.arguments)
            arguments["batch_size"] = rec.samples
            out.append((rec.name, rec.value, arguments))
        return out


def replay(
    log: Callable[..., None], summary: list[tuple[str, float, dict[str, Any]]], device: torch.device
) -> None:
    """Log every recorded value with the module's real ``log`` method."""
    for name, value, arguments in summary:
        log(name, torch.tensor(value, device=device), **arguments)
