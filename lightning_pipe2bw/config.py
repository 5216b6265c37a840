"""Typed Hydra structured configs for the strategy and the Trainer, and their builders.

:class:`StrategyConfig` mirrors ``Pipe2BWStrategy``'s options in types Hydra can hold (a timeout
in seconds, a start method that may be ``"auto"``). It is checked by the same code as the
strategy: :func:`strategy_problems` builds :class:`~lightning_pipe2bw.pipeline.options.PipeOptions`
and the process layout from it and words their problems for a config (``strategy.<option>``);
:func:`build_strategy` builds the strategy from the same options. A recipe composes these with
its own model and data configs (see ``lightning_pipe2bw.recipes.gpt.config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from lightning_pipe2bw.pipeline.options import BALANCE_MODES, DEFAULT_TIMEOUT, PipeOptions, Problem
from lightning_pipe2bw.pipeline.topology import Topology
from lightning_pipe2bw.strategy import Pipe2BWStrategy

__all__ = [
    "START_METHODS",
    "StrategyConfig",
    "TrainerConfig",
    "build_options",
    "build_strategy",
    "resolve_start_method",
    "strategy_problems",
    "trainer_kwargs",
]

# "auto" is the config's own choice (see resolve_start_method); the rest are the strategy's
START_METHODS = ("auto", "popen", "spawn", "fork", "forkserver")


@dataclass
class StrategyConfig:
    """``Pipe2BWStrategy``'s options (``configs/strategy/<schedule>.yaml``)."""

    schedule: str = "2bw"
    microbatches: int | None = 4
    flush_every: int | None = None
    # blocks per stage, e.g. [3, 3], or a mode: "uniform", "params", "auto" (profile and plan)
    balance: Any = None
    body: str | None = None
    # "auto": "popen" for a single run, "spawn" under --multirun (see resolve_start_method)
    start_method: str = "auto"
    process_group_backend: str | None = None  # None: gloo on CPU, nccl on CUDA
    timeout_s: float | None = None  # process-group timeout; None: the strategy default (3 min)
    state_dict_type: str = "full"  # "full": one consolidated file; "sharded": DCP directory
    data_parallel: int = 1  # pipeline replicas (devices must be a multiple)
    # recompute activations in the backward: a bool, or one per stage; null: off, or the
    # planner's choice with balance=auto
    recompute: Any = None
    # per block index: "keep", "recompute", "swap" (to host) or "evict" (to the partner stage)
    memory_plan: Any = None
    # BPipe: true (the balanced share), or a budget in micro-batches per evicting stage
    balance_activations: Any = None
    # vPipe: check the stages' measured times every this many steps and move blocks (null: off)
    repartition_every: int | None = None
    repartition_threshold: float = 0.15  # move when the slowest stage is this much over the best
    # flush schedules: send the last (GPipe: and the first) micro-batch's input gradient before
    # the weights' gradients
    early_input_grad: bool = True
    # 2bw/pipedream: auto (the schedule's default), none, predict, error_feedback or nesterov
    delay_correction: str = "auto"
    # models that are not an nn.Sequential: check the split's output against the whole model's
    # at set-up, and that every parameter gets a gradient at the first update
    check_split: bool = True


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
    """``"auto"``: ``"popen"`` for a single run, ``"spawn"`` under ``--multirun``.

    ``popen`` re-runs the command line for ranks 1..n-1; Lightning pins their Hydra run dir to the
    parent's (``_hydra_subprocess_cmd``), which is right for a single run. Under ``-m`` the same
    command line would start a whole sweep in every child, and the parent's second job would see
    the ``LOCAL_RANK`` the first job left in ``os.environ`` and start no children at all; spawned
    workers inherit no command line and leave no such variables behind.
    """
    if method != "auto":
        return method
    return "spawn" if multirun else "popen"


def _options(cfg: StrategyConfig, multirun: bool) -> dict[str, Any]:
    """``cfg`` as the strategy's keyword arguments (Hydra's containers made plain)."""
    balance = cfg.balance
    if balance is not None and not isinstance(balance, str):
        balance = list(balance)
    recompute = cfg.recompute
    if recompute is not None and not isinstance(recompute, bool):
        recompute = list(recompute)
    return {
        "schedule": cfg.schedule,
        "microbatches": cfg.microbatches,
        "flush_every": cfg.flush_every,
        "balance": balance,
        "body": cfg.body,
        "start_method": resolve_start_method(cfg.start_method, multirun),
        "process_group_backend": cfg.process_group_backend,
        "timeout": timedelta(seconds=cfg.timeout_s) if cfg.timeout_s is not None else DEFAULT_TIMEOUT,
        "state_dict_type": cfg.state_dict_type,
        "data_parallel": cfg.data_parallel,
        "recompute": recompute,
        "memory_plan": None if cfg.memory_plan is None else dict(cfg.memory_plan.items()),
        "balance_activations": cfg.balance_activations,
        "repartition_every": cfg.repartition_every,
        "repartition_threshold": cfg.repartition_threshold,
        "early_input_grad": cfg.early_input_grad,
        "delay_correction": cfg.delay_correction,
        "check_split": cfg.check_split,
    }


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
