"""The strategy's options as one frozen value, checked once: every problem is collected, then raised.

:meth:`PipeOptions.create` takes the options as a user writes them (``Pipe2BWStrategy``'s
keyword arguments, a Hydra config), normalises them (a list becomes a tuple, a budget becomes an
:class:`ActivationBudget`) and either returns the value or raises one error listing every
problem. Each problem names the option, its value and the fix (:class:`Problem`); a front end
that words its messages for its own surface (the Hydra config names ``strategy.<option>``) reads
the problems from :meth:`PipeOptions.problems` instead.

Each option's declaration (default, parser, config and docs text) is one entry of the table in
:mod:`lightning_pipe2bw.pipeline.optiontable`; this module adds the checks between options. The
checks that need more than the options (the layout, the Trainer call, the optimizers, the
partition) are pure functions of plain values in :mod:`lightning_pipe2bw.pipeline.checks`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from lightning_pipe2bw.optim.delay import CORRECTIONS, DEFAULT_CORRECTION, correction_predicts
from lightning_pipe2bw.pipeline.optiontable import (
    BALANCE_MODES,
    DEFAULT_SCHEDULE,
    DEFAULT_TIMEOUT,
    OPTION_NAMES,
    OPTIONS,
    BadOption,
    BalanceMode,
    LossNormalization,
    StartMethod,
    StateDictType,
)
from lightning_pipe2bw.pipeline.problems import Problem, raise_problems
from lightning_pipe2bw.schedule import REGISTRY, ActivationBudget, ScheduleSpec, schedule_spec
from lightning_pipe2bw.schedule.registry import names_where

__all__ = [
    "BALANCE_MODES",
    "DEFAULT_SCHEDULE",
    "DEFAULT_TIMEOUT",
    "OPTIONS",
    "OPTION_NAMES",
    "BalanceMode",
    "PipeOptions",
    "Problem",
    "StartMethod",
    "raise_problems",
]


@dataclass(frozen=True)
class PipeOptions:
    """``Pipe2BWStrategy``'s options, normalised and checked (see the strategy for each one's
    meaning). Build it with :meth:`create`; the fields are read-only."""

    schedule: str = DEFAULT_SCHEDULE
    microbatches: int | None = None
    flush_every: int | None = None
    balance: tuple[int, ...] | None = None  # blocks per stage, when given as a list
    balance_mode: BalanceMode | None = None  # "uniform", "params" or "auto", when given as a name
    body: str | None = None
    start_method: StartMethod = "popen"
    process_group_backend: str | None = None
    timeout: timedelta | None = DEFAULT_TIMEOUT
    state_dict_type: StateDictType = "full"
    loss_normalization: LossNormalization = "batch"  # by the whole batch's items, or per micro-batch
    data_parallel: int = 1
    shard_optimizer: bool = False  # ZeRO-1 over each stage's replicas
    fsdp: bool = False  # FSDP2 on each block over each stage's replicas
    recompute: bool | tuple[bool, ...] | None = None
    # {block index: policy}; not hashed (a dict), never changed after creation
    memory_plan: dict[int, str] | None = field(default=None, hash=False)
    activation_budget: ActivationBudget | None = None  # BPipe (None: off)
    repartition_every: int | None = None
    repartition_threshold: float = 0.15
    early_input_grad: bool = True
    delay_correction: str = "auto"  # "auto": the schedule's default (see ``correction``)
    # 2BW's synchronous start: the first this many batches flushed, or this share of the fit's
    sync_steps: int | float = 0
    fresh_last_stage: bool = False  # 2BW's last stage without delay
    # torch.compile's keyword arguments for each block of the stage ({}: its defaults; None: off)
    compile_blocks: dict[str, Any] | None = field(default=None, hash=False)
    check_split: bool = True  # the guard against a split that computes something else

    @classmethod
    def create(cls, **options: Any) -> PipeOptions:
        """The options, normalised; one error naming every problem if any (see
        :func:`raise_problems`)."""
        value, problems = cls._parse(options)
        raise_problems(problems)
        assert value is not None
        return value

    @classmethod
    def problems(cls, **options: Any) -> list[Problem]:
        """What :meth:`create` would complain about, without raising."""
        return cls._parse(options)[1]

    def with_activation_budget(self, budget: ActivationBudget | None) -> PipeOptions:
        """These options with BPipe's budget replaced (the ``ActivationBalancer`` callback)."""
        if budget is not None and not isinstance(budget, ActivationBudget):
            raise TypeError(f"the activation budget must be an ActivationBudget, got {budget!r}")
        return replace(self, activation_budget=budget)

    @property
    def spec(self) -> ScheduleSpec:
        """The schedule's entry in the registry (``schedule.registry``)."""
        return REGISTRY[self.schedule]

    @property
    def is_async(self) -> bool:
        """Whether batches follow one another without a flush (2BW, PipeDream)."""
        return self.spec.asynchronous

    @property
    def correction(self) -> str:
        """The delay correction this run applies: the one asked for, or with ``"auto"`` the
        schedule's default (``2bw``: ``DEFAULT_CORRECTION``; the others: ``"none"``)."""
        if self.delay_correction != "auto":
            return self.delay_correction
        return DEFAULT_CORRECTION if self.spec.one_step_delay else "none"

    def synchronous_steps(self, total_steps: int) -> int:
        """The batches of a fit of ``total_steps`` optimizer steps that 2BW runs synchronously
        (``sync_steps``, a count or a share of the fit)."""
        if isinstance(self.sync_steps, float):
            return round(self.sync_steps * total_steps)
        return self.sync_steps

    def num_microbatches(self, num_stages: int) -> int:
        """Micro-batches per batch: the option, or one per stage."""
        return self.microbatches if self.microbatches is not None else num_stages

    def settings(self, num_microbatches: int) -> dict[str, object]:
        """What every rank of a run must agree on, as plain values (see
        ``agreement.check_same_setup``)."""
        return {
            "schedule": self.schedule,
            "microbatches": num_microbatches,
            "flush_every": self.flush_every,
            "balance": self.balance if self.balance_mode is None else self.balance_mode,
            "recompute": self.recompute,
            "memory_plan": self.memory_plan,
            "activation_budget": self.activation_budget,
            "repartition": (self.repartition_every, self.repartition_threshold),
            "data_parallel": self.data_parallel,
            "fsdp": self.fsdp,
            "body": self.body,
            "state_dict_type": self.state_dict_type,
            "loss_normalization": self.loss_normalization,
            "delay_correction": self.correction,
            "sync_steps": self.sync_steps,
            "fresh_last_stage": self.fresh_last_stage,
        }

    # ------------------------------------------------------------------ parsing
    @classmethod
    def _parse(cls, raw: Mapping[str, Any]) -> tuple[PipeOptions | None, list[Problem]]:
        unknown = sorted(set(raw) - OPTION_NAMES)
        if unknown:
            valid = ", ".join(sorted(OPTION_NAMES))
            raise TypeError(f"unknown pipe2bw options {unknown}; valid options: {valid}")
        problems: list[Problem] = []
        values: dict[str, Any] = {}
        for option in OPTIONS:
            try:
                values.update(option.parse(raw.get(option.name, option.default)))
            except BadOption as bad:
                problems.append(bad.problem)
        if problems:
            return None, problems
        problems = _correction_problems(values["schedule"], values["delay_correction"])
        problems += _sync_problems(values["schedule"], values["sync_steps"])
        problems += _fresh_problems(values["schedule"], values["fresh_last_stage"])
        problems += _shard_problems(values)
        problems += _fsdp_problems(values)
        if problems:
            return None, problems
        return cls(**values), []


def _shard_problems(values: Mapping[str, Any]) -> list[Problem]:
    """Sharding the optimizer state without replicas to shard it over, or with blocks that move
    between stages (their optimizer state would have to follow them from several replicas)."""
    if not values["shard_optimizer"]:
        return []
    w = values["data_parallel"]
    if w == 1:
        return [
            Problem(
                "shard_optimizer",
                True,
                "shard_optimizer=True splits each stage's optimizer state over the stage's "
                "data-parallel replicas, but data_parallel=1 gives each stage one; use "
                "data_parallel=2 or more (devices * num_nodes a multiple of it), or leave "
                "shard_optimizer False",
            )
        ]
    if values["repartition_every"] is not None:
        return [
            Problem(
                "shard_optimizer",
                True,
                f"shard_optimizer=True with repartition_every={values['repartition_every']}: "
                "a block that moves to another stage carries its optimizer state, which the "
                "replicas hold in shards; use one or the other",
            )
        ]
    return []


def _fsdp_problems(values: Mapping[str, Any]) -> list[Problem]:
    """FSDP2 inside a stage without replicas to shard over, or with what keeps or moves whole
    copies of a stage's weights (see ``pipeline/fsdp.py``)."""
    if not values["fsdp"]:
        return []
    w, schedule = values["data_parallel"], values["schedule"]
    if w == 1:
        return [
            Problem(
                "fsdp",
                True,
                "fsdp=True shards each block over the stage's data-parallel replicas, but "
                "data_parallel=1 gives each stage one; use data_parallel=2 or more (devices * "
                "num_nodes a multiple of it), or leave fsdp False",
            )
        ]
    flushed = names_where(lambda s: s.flushes, "or")
    why = {
        "schedule": (
            None
            if schedule_spec(schedule).flushes
            else f"schedule={schedule!r} keeps a second version of every weight (2BW's double "
            "buffer, PipeDream's stash), whole, which FSDP keeps in shards only; use a flushed "
            f"schedule ({flushed})"
        ),
        "shard_optimizer": (
            "shard_optimizer=True shards only the optimizer state, which fsdp=True shards "
            "already (with the weights and gradients); use one of them"
            if values["shard_optimizer"]
            else None
        ),
        "repartition_every": (
            f"repartition_every={values['repartition_every']} moves blocks between stages, "
            "whose weights the replicas hold in shards; use repartition_every=None with it"
            if values["repartition_every"] is not None
            else None
        ),
        "compile_blocks": (
            "compile_blocks with fsdp=True is not built yet (a compiled block would be sharded "
            "after it was compiled); use one of them"
            if values["compile_blocks"] is not None
            else None
        ),
    }
    return [
        Problem("fsdp", True, f"fsdp=True with {message}")
        for message in why.values()
        if message is not None
    ]


def _sync_problems(schedule: str, sync_steps: int | float) -> list[Problem]:
    """A synchronous start for a schedule without 2BW's delay."""
    if not sync_steps or schedule_spec(schedule).one_step_delay:
        return []
    two_bw = names_where(lambda s: s.one_step_delay, "or")
    return [
        Problem(
            "sync_steps",
            sync_steps,
            f"sync_steps={sync_steps} starts 2BW synchronously, but schedule={schedule!r} is not "
            f"2BW; use schedule={two_bw}, or leave sync_steps at 0",
        )
    ]


def _fresh_problems(schedule: str, fresh: bool) -> list[Problem]:
    """A fresh last stage where the schedule has no 2BW delay, or no stage free of it."""
    why = schedule_spec(schedule).fresh_last_stage_problem
    if not fresh or why is None:
        return []
    fits = names_where(lambda s: s.fresh_last_stage_problem is None, "or")
    return [
        Problem(
            "fresh_last_stage",
            fresh,
            f"fresh_last_stage=True runs 2BW's last stage without its delay, but "
            f"schedule={schedule!r}: {why}; use schedule={fits}, or leave fresh_last_stage False",
        )
    ]


def _correction_problems(schedule: str, correction: str) -> list[Problem]:
    """A correction the schedule has no use for, or cannot apply."""
    if correction in ("auto", "none"):
        return []
    spec = schedule_spec(schedule)
    if not spec.takes_corrections:
        delayed = names_where(lambda s: s.takes_corrections, "and")
        return [
            Problem(
                "delay_correction",
                correction,
                f"schedule={schedule!r} flushes the pipeline after every batch, so its gradients "
                f"are not delayed and delay_correction={correction!r} has nothing to correct; it "
                f"applies to {delayed} (leave it 'auto')",
            )
        ]
    if not spec.takes_predictions and correction_predicts(correction):
        predicting = names_where(lambda s: s.takes_predictions, "or")
        return [
            Problem(
                "delay_correction",
                correction,
                f"delay_correction={correction!r} evaluates each batch at a prediction of the "
                "next update's weights, which needs 2BW's delay of exactly one update; under "
                f"{schedule!r} each stage and micro-batch is behind by a different number of "
                f"updates. Use it with schedule={predicting}, or a gradient correction with "
                f"{schedule!r} "
                f"({', '.join(repr(n) for n, c in CORRECTIONS.items() if not c.predicts)})",
            )
        ]
    return []
