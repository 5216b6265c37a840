"""Typed Hydra structured configs for the strategy and the Trainer, and their builders.

:class:`StrategyConfig` holds ``Pipe2BWStrategy``'s options in types Hydra can hold (a timeout
in seconds, a start method that may be ``"auto"``); it is made from the options' table
(``pipeline.optiontable.OPTIONS``), so a new option needs no line here. It is checked by the same
code as the strategy: :func:`strategy_problems` builds :class:`~lightning_pipe2bw.pipeline.options.PipeOptions`
and the process layout from it and words their problems for a config (``strategy.<option>``);
:func:`build_strategy` builds the strategy from the same options. A recipe composes these with
its own model and data configs (see ``lightning_pipe2bw.recipes.gpt.config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import TYPE_CHECKING, Any

from lightning_pipe2bw.pipeline.options import BALANCE_MODES, OPTIONS, PipeOptions, Problem
from lightning_pipe2bw.pipeline.topology import Topology
from lightning_pipe2bw.strategy import Pipe2BWStrategy

__all__ = [
    "START_METHODS",
    "StrategyConfig",
    "TrainerConfig",
    "build_strategy",
    "resolve_start_method",
    "strategy_problems",
    "trainer_kwargs",
]

# "auto" is the config's own choice (see resolve_start_method); the rest are the strategy's
START_METHODS = ("auto", "popen", "spawn", "fork", "forkserver")


def _strategy_config() -> type:
    """``StrategyConfig``, made from the options' table (``pipeline.optiontable.OPTIONS``)."""
    cls = make_dataclass(
        "StrategyConfig",
        [(o.field_name, o.config_type, field(default=o.field_default)) for o in OPTIONS],
    )
    cls.__module__ = __name__
    cls.__doc__ = (
        "``Pipe2BWStrategy``'s options (``configs/strategy/<schedule>.yaml``), one field per "
        "option of ``lightning_pipe2bw.pipeline.optiontable.OPTIONS``, named and typed as the "
        "keyword is unless said here (what each does: the strategy's docstring, "
        "``docs/configuration.md``):\n\n"
        + "\n".join(f"- ``{o.field_name}``: {o.config_note}" for o in OPTIONS if o.config_note)
    )
    return cls


if TYPE_CHECKING:

    class StrategyConfig:
        """(For the type checker: the dataclass below, whose fields the options' table makes.)"""

        def __init__(self, **fields: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...

else:
    StrategyConfig = _strategy_config()


@dataclass
class TrainerConfig:
    """``lightning.pytorch.Trainer`` arguments (``configs/trainer/<where>.yaml``).

    ``devices * num_nodes`` is the number of pipeline stages. ``extra`` passes any other Trainer
    argument through unchecked, e.g. ``+trainer.extra.accumulate_grad_batches=2``.
    """

    accelerator: str = "cpu"
    devices: int = 2
    num_nodes: int = 1
    max_steps: int = 200
    val_check_interval: int = 50  # in optimizer steps, counted across epochs
    num_sanity_val_steps: int = 2
    log_every_n_steps: int = 10
    precision: str = "32-true"
    gradient_clip_val: float | None = None
    enable_checkpointing: bool = True
    enable_progress_bar: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def resolve_start_method(method: str, multirun: bool) -> str:
    """``"auto"``: ``"popen"`` for a single run, ``"forkserver"`` under ``--multirun``.

    ``popen`` re-runs the command line for ranks 1..n-1; Lightning pins their Hydra run dir to the
    parent's (``_hydra_subprocess_cmd``), which is right for a single run. Under ``-m`` the same
    command line would start a whole sweep in every child, and the parent's second job would see
    the ``LOCAL_RANK`` the first job left in ``os.environ`` and start no children at all; workers
    started from the sweep's process inherit no command line and leave no such variables behind.
    Of those start methods, ``forkserver`` starts every job's workers from one server that
    imported torch, Lightning and the job's module once (``seam.launcher.preload_fork_server``),
    where ``spawn`` imports them again in every worker of every job; its workers start with the
    environment, random state and model copy a spawned worker gets.
    """
    if method != "auto":
        return method
    return "forkserver" if multirun else "popen"


def _options(cfg: StrategyConfig, multirun: bool) -> dict[str, Any]:
    """``cfg`` as the strategy's keyword arguments (Hydra's containers made plain)."""
    options = {o.name: o.configured(getattr(cfg, o.field_name)) for o in OPTIONS}
    options["start_method"] = resolve_start_method(options["start_method"], multirun)
    return options


def _worded(problem: Problem) -> str:
    """A problem of the strategy's options, worded for the config."""
    value = problem.value
    if problem.choices:
        valid = START_METHODS if problem.option == "start_method" else problem.choices
        if problem.option == "balance":
            valid = ("a list of block counts", *BALANCE_MODES)
        return f"strategy.{problem.option}={value!r} is unknown; valid: {', '.join(valid)}"
    if problem.option == "timeout":
        return f"strategy.timeout_s={value!r}: {problem.message}"
    return f"strategy.{problem.option}: {problem.message}"


def strategy_problems(cfg: StrategyConfig, world_size: int) -> list[str]:
    """What is wrong with ``cfg`` for ``world_size`` processes, one message per problem (the
    strategy's own checks, in the config's words)."""
    problems = PipeOptions.problems(**_options(cfg, multirun=False))
    if not problems and world_size >= 1:
        problems = Topology.problems(world_size, cfg.data_parallel) or Topology.for_schedule(
            world_size, cfg.data_parallel, 0, cfg.schedule
        ).option_problems(build_options(cfg))
    return [_worded(p) for p in problems]


def build_options(cfg: StrategyConfig, *, multirun: bool = False) -> PipeOptions:
    """The strategy's options that ``cfg`` describes (one error listing every problem)."""
    return PipeOptions.create(**_options(cfg, multirun))


def build_strategy(cfg: StrategyConfig, *, multirun: bool = False) -> Pipe2BWStrategy:
    """The ``Pipe2BWStrategy`` that ``cfg`` describes."""
    return Pipe2BWStrategy.from_options(build_options(cfg, multirun=multirun))


def trainer_kwargs(cfg: TrainerConfig) -> dict[str, Any]:
    """``Trainer`` keyword arguments, without the strategy, logger and callbacks."""
    kwargs: dict[str, Any] = {
        "accelerator": cfg.accelerator,
        "devices": cfg.devices,
        "num_nodes": cfg.num_nodes,
        "max_steps": cfg.max_steps,
        "val_check_interval": cfg.val_check_interval,
        "check_val_every_n_epoch": None,  # val_check_interval counts steps across epochs
        "num_sanity_val_steps": cfg.num_sanity_val_steps,
        "log_every_n_steps": cfg.log_every_n_steps,
        "precision": cfg.precision,
        "gradient_clip_val": cfg.gradient_clip_val,
        "enable_checkpointing": cfg.enable_checkpointing,
        "enable_progress_bar": cfg.enable_progress_bar,
    }
    clash = sorted(set(cfg.extra) & (set(kwargs) | {"strategy", "logger", "callbacks"}))
    if clash:
        raise ValueError(
            f"trainer.extra must not set {clash}: set trainer.<key> for Trainer arguments with a "
            "key of their own; the strategy, logger and callbacks come from the strategy group "
            "and the entry point"
        )
    kwargs.update(cfg.extra)
    return kwargs
