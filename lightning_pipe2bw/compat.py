"""Lightning's (and torch's) private API, in one place.

The strategy needs a few things Lightning keeps private: its process-group helpers, its
launchers, the hook-calling functions of its training loop, the training DataLoader before fit
starts. Every such use goes through this module, under a public name, so that a Lightning
minor release that renames one breaks this file only; ``tests/unit/test_compat.py`` imports each
name and checks each attribute on real objects, and says which one is gone.

Nothing else in the package imports a private name from ``lightning`` (a layering test checks).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning.fabric.strategies.launchers.multiprocessing import (
    _disable_module_memory_sharing as unshare_module_memory,
)
from lightning.fabric.strategies.registry import _StrategyRegistry as StrategyRegistryType
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_process_group_backend,
)
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning.fabric.utilities.distributed import (
    _set_num_threads_if_needed as set_num_threads_if_needed,
)
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import (
    LightningOptimizer,
    _init_optimizers_and_lr_schedulers,
)
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.launcher import _Launcher as Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _GlobalStateSnapshot as GlobalStateSnapshot,
)
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher as MultiProcessingLauncher,
)
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput as WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import _update_dataloader as update_dataloader
from torch import Tensor
from torch.optim import Optimizer

from lightning_pipe2bw.optim.wrapper import unwrap_optimizer

__all__ = [
    "GlobalStateSnapshot",
    "Launcher",
    "MultiProcessingLauncher",
    "StrategyRegistryType",
    "SubprocessScriptLauncher",
    "WorkerOutput",
    "averaged_model",
    "call_backward_hooks",
    "current_hook",
    "default_process_group_backend",
    "ends_epoch",
    "found_inf_state",
    "init_dist_connection",
    "last_batch_of_epoch",
    "launched_processes",
    "metric_batch_value",
    "optimizer_factory",
    "optimizers_to_device",
    "override_clipping",
    "running_hook",
    "set_averaged_model",
    "set_metric_batch_value",
    "set_metric_state",
    "set_num_threads_if_needed",
    "skip_sigterm_broadcast",
    "skips_backward",
    "start_worker_scripts",
    "summary_depth",
    "summary_options",
    "sync_ddp_if_available",
    "torch_optimizer",
    "training_dataloader",
    "unshare_module_memory",
    "update_dataloader",
]

# every private name this module uses: (module, attribute), checked by tests/unit/test_compat.py
REQUIRED: tuple[tuple[str, str], ...] = (
    ("lightning.fabric.strategies.launchers.multiprocessing", "_disable_module_memory_sharing"),
    ("lightning.fabric.strategies.registry", "_StrategyRegistry"),
    ("lightning.fabric.utilities.distributed", "_get_default_process_group_backend_for_device"),
    ("lightning.fabric.utilities.distributed", "_init_dist_connection"),
    ("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed"),
    ("lightning.fabric.utilities.distributed", "_sync_ddp_if_available"),
    ("lightning.fabric.utilities.optimizer", "_optimizers_to_device"),
    ("lightning.pytorch.core.optimizer", "_init_optimizers_and_lr_schedulers"),
    ("lightning.pytorch.strategies.launchers.launcher", "_Launcher"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_GlobalStateSnapshot"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_WorkerOutput"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    ("lightning.pytorch.trainer.call", "_call_callback_hooks"),
    ("lightning.pytorch.trainer.call", "_call_lightning_module_hook"),
    ("lightning.pytorch.utilities.data", "_update_dataloader"),
)


def call_backward_hooks(trainer: Trainer, loss: Tensor) -> None:
    """Lightning's ``on_before_backward`` and ``on_after_backward`` hooks, callbacks first, as
    its own backward call runs them (the engine has already run the backward)."""
    call._call_callback_hooks(trainer, "on_before_backward", loss)
    call._call_lightning_module_hook(trainer, "on_before_backward", loss)
    call._call_callback_hooks(trainer, "on_after_backward")
    call._call_lightning_module_hook(trainer, "on_after_backward")


def training_dataloader(trainer: Trainer) -> Any:
    """The training DataLoader ``fit`` was given, before the fit loop has set it up (the
    ``_data_source`` of the fit loop)."""
    return trainer.fit_loop._data_source.dataloader()


def current_dataloader(trainer: Trainer) -> tuple[Any, str] | None:
    """The DataLoader the running Trainer call reads first, before its loop has set it up, and
    the step hook that takes its batches (``training_step`` for ``fit``); None when there is
    none (a loader given as a dict or an empty list takes its first)."""
    fn = trainer.state.fn
    loops: dict[TrainerFn, tuple[Any, str]] = {
        TrainerFn.FITTING: (trainer.fit_loop, "training_step"),
        TrainerFn.VALIDATING: (trainer.validate_loop, "validation_step"),
        TrainerFn.TESTING: (trainer.test_loop, "test_step"),
        TrainerFn.PREDICTING: (trainer.predict_loop, "predict_step"),
    }
    if fn not in loops:
        return None
    loop, hook = loops[fn]
    try:
        loader = loop._data_source.dataloader()
    except Exception:  # a datamodule that needs its setup first: the guard does without
        return None
    if isinstance(loader, dict):
        loader = next(iter(loader.values()), None)
    elif isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    return None if loader is None else (loader, hook)


def skip_sigterm_broadcast(trainer: Trainer) -> None:
    """Turn off the broadcast of a SIGTERM flag from rank 0 that Lightning's training loop
    runs at the start of every step (``_broadcast_sigterm_tensor``): a collective of every rank
    once per step, which ties the pipeline's stages together at every step boundary, and which a
    rank stopping on a signal never joins. ``failures.signals.SignalGuard`` does its job."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _no_broadcast  # type: ignore[method-assign]


def _no_broadcast() -> None:
    pass


def last_batch_of_epoch(trainer: Trainer) -> bool:
    """Whether the training step running now is the last of its epoch (``limit_train_batches``
    included; the last of a fit that ``max_steps`` ends within an epoch is not)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    limited = epoch_loop.batch_idx + 1 >= trainer.num_training_batches
    return bool(epoch_loop.batch_progress.is_last_batch) or limited


def ends_epoch(trainer: Trainer) -> bool:
    """Whether the training step running now is the last of its epoch, or of fit."""
    epoch_loop = trainer.fit_loop.epoch_loop
    last_step = trainer.max_steps > 0 and trainer.global_step + 1 >= trainer.max_steps
    limited = epoch_loop.batch_idx + 1 >= trainer.num_training_batches  # limit_train_batches
    return bool(epoch_loop.batch_progress.is_last_batch) or last_step or limited


def launched_processes(launcher: SubprocessScriptLauncher) -> list[Any]:
    """The worker processes a ``popen`` launcher started (``subprocess.Popen`` objects)."""
    return list(launcher.procs)


def start_worker_scripts(launcher: SubprocessScriptLauncher) -> None:
    """Start the ``popen`` workers (the script re-run once per rank, ``launcher.procs``), as
    Lightning's launcher does before it calls the trainer's function."""
    launcher._call_children_scripts()


def override_clipping(
    plugin: Precision,
    by_norm: Callable[[Optimizer, int | float], None],
    by_value: Callable[[Optimizer, int | float], None],
) -> None:
    """Make ``plugin`` clip with ``by_norm`` / ``by_value`` (Lightning's plugins offer no hook for
    how gradients are clipped, only these methods, which are replaced on the instance)."""
    plugin.clip_grad_by_norm = by_norm  # type: ignore[method-assign,assignment]
    plugin.clip_grad_by_value = by_value  # type: ignore[method-assign,assignment]


def found_inf_state(scaler: Any, optimizer: Optimizer) -> dict[str, Any]:
    """torch's ``GradScaler`` record of ``optimizer``'s last unscale (a live dict: its
    ``"found_inf_per_device"`` entry decides whether the step is skipped)."""
    state: dict[str, Any] = scaler._per_optimizer_states[id(optimizer)]
    return state


def metric_batch_value(metric: Any) -> Tensor | None:
    """A torchmetrics ``Metric``'s value on the batch of its last ``forward`` (what Lightning
    logs for it on step); None when only ``update`` ran."""
    value: Tensor | None = metric._forward_cache
    return value


def set_metric_batch_value(metric: Any, value: Tensor) -> None:
    """Set the value Lightning logs on step for ``metric`` (the whole batch's, when its forward
    ran once per micro-batch)."""
    metric._forward_cache = value


def set_metric_state(metric: Any, states: dict[str, Any], update_count: int) -> None:
    """Give a torchmetrics ``Metric`` these state values and update count (a copy of another
    rank's metric), dropping its cached result."""
    for name, value in states.items():
        setattr(metric, name, value)
    metric._update_count = update_count
    metric._computed = None


def torch_optimizer(optimizer: Any) -> Optimizer:
    """The user's optimizer inside Lightning's and the 2BW wrappers."""
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer.optimizer
    return unwrap_optimizer(optimizer)


def optimizer_factory(module: LightningModule) -> Callable[[list[Any]], Optimizer] | None:
    """A function building the run's (first) optimizer, with its settings, over given
    parameters; ``None`` when ``configure_optimizers`` gives none."""
    try:
        optimizers, _ = _init_optimizers_and_lr_schedulers(module)
    except Exception:  # e.g. it needs state that exists only once fit runs: plan without updates
        return None
    if not optimizers:
        return None
    first = optimizers[0]
    kind = type(first)
    accepted = inspect.signature(kind).parameters
    # the settings its constructor takes (``defaults`` may hold derived ones it does not)
    settings = {k: v for k, v in first.defaults.items() if k in accepted}
    return lambda params: kind(params, **settings)


def current_hook(module: LightningModule) -> str | None:
    """The hook of ``module`` Lightning runs now (what ``self.log`` logs under), or None."""
    name: str | None = module._current_fx_name
    return name


@contextmanager
def running_hook(module: LightningModule, name: str | None) -> Iterator[None]:
    """Let ``module.log`` log as if Lightning ran ``module``'s hook ``name`` now."""
    previous = module._current_fx_name
    module._current_fx_name = name
    try:
        yield
    finally:
        module._current_fx_name = previous


def skips_backward(trainer: Trainer) -> bool:
    """Whether the training loop runs its steps without backward and update now (the epoch in
    which ``StochasticWeightAveraging`` recomputes batch norm statistics)."""
    return bool(trainer.fit_loop._skip_backward)


def summary_depth(callback: Any) -> int:
    """How deep a ``ModelSummary`` callback describes the model (0: it prints nothing)."""
    return int(callback._max_depth)


def summary_options(callback: Any) -> dict[str, Any]:
    """The keyword arguments a ``ModelSummary`` (or ``RichModelSummary``) passes to its
    ``summarize``."""
    return dict(callback._summarize_kwargs)


def averaged_model(callback: Any) -> Any:
    """The copy of the model ``StochasticWeightAveraging`` averages into (None before setup)."""
    return callback._average_model


def set_averaged_model(callback: Any, model: Any) -> None:
    """Give ``StochasticWeightAveraging`` another module to average into."""
    callback._average_model = model
