"""The strategy's options as one frozen value, checked once: every problem is collected, then raised.

:meth:`PipeOptions.create` takes the options as a user writes them (``Pipe2BWStrategy``'s
keyword arguments, a Hydra config), normalises them (a list becomes a tuple, a budget becomes an
:class:`ActivationBudget`) and either returns the value or raises one error listing every
problem. Each problem names the option, its value and the fix (:class:`Problem`); a front end
that words its messages for its own surface (the Hydra config names ``strategy.<option>``) reads
the problems from :meth:`PipeOptions.problems` instead.

The checks that need more than the options (the layout, the Trainer call, the optimizers, the
partition) are pure functions of plain values in :mod:`lightning_pipe2bw.pipeline.checks`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Literal, get_args

from lightning_pipe2bw.optim.delay import (
    CORRECTIONS,
    DEFAULT_CORRECTION,
    canonical_correction,
    correction_predicts,
)
from lightning_pipe2bw.pipeline.problems import Problem, raise_problems
from lightning_pipe2bw.runtime.stash import check_memory_plan
from lightning_pipe2bw.schedule import REGISTRY, ActivationBudget, ScheduleSpec, schedule_spec
from lightning_pipe2bw.schedule.registry import names_where

__all__ = [
    "BALANCE_MODES",
    "DEFAULT_SCHEDULE",
    "DEFAULT_TIMEOUT",
    "OPTIONS",
    "OPTION_NAMES",
    "START_METHODS",
    "BalanceMode",
    "Option",
    "PipeOptions",
    "Problem",
    "StartMethod",
    "StateDictType",
    "raise_problems",
]

BalanceMode = Literal["uniform", "params", "auto"]
BALANCE_MODES: tuple[str, ...] = get_args(BalanceMode)
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS: tuple[str, ...] = get_args(StartMethod)
StateDictType = Literal["full", "sharded"]
STATE_DICT_TYPES: tuple[str, ...] = get_args(StateDictType)

# how long a rank waits for another before the run stops (torch's own default is 30 minutes)
DEFAULT_TIMEOUT = timedelta(minutes=3)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


_SAME: Any = object()  # a config field's default: the option's own


@dataclass(frozen=True)
class Option:
    """One option of the strategy, declared once (:data:`OPTIONS`): its keyword, its default,
    and its check, which normalises a value into :class:`PipeOptions` fields or raises the
    option's :class:`Problem`; then how a Hydra config holds it (``config_type``, the config's
    name and default when they differ, ``from_config``: the config's value as the keyword's)
    and what the config's reader needs to know (``note``)."""

    name: str
    default: Any
    parse: Callable[[Any], dict[str, Any]]
    config_type: Any
    config_name: str = ""  # "": the option's name
    config_default: Any = _SAME
    from_config: Callable[[Any], Any] | None = None
    note: str = ""

    @property
    def field_name(self) -> str:
        """The option's name in a config."""
        return self.config_name or self.name

    @property
    def field_default(self) -> Any:
        """The option's default in a config."""
        return self.default if self.config_default is _SAME else self.config_default

    def configured(self, value: Any) -> Any:
        """A config's value as the strategy's keyword value."""
        return self.from_config(value) if self.from_config is not None else value


# the schedule Pipe2BWStrategy() trains with: the one that reaches a given loss soonest on the
# main job, measured (benchmarks/convergence.py; docs/pipedream-2bw.md, "Time to accuracy"). A
# synchronous schedule: at every horizon measured, 2BW's delay costs more steps than its missing
# bubble saves, with every remedy (docs/pipedream-2bw.md, "Which schedule, which optimizer")
DEFAULT_SCHEDULE = "1f1b"


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
    data_parallel: int = 1
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
            "body": self.body,
            "state_dict_type": self.state_dict_type,
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
            except _Bad as bad:
                problems.append(bad.problem)
        if problems:
            return None, problems
        problems = _correction_problems(values["schedule"], values["delay_correction"])
        problems += _sync_problems(values["schedule"], values["sync_steps"])
        problems += _fresh_problems(values["schedule"], values["fresh_last_stage"])
        if problems:
            return None, problems
        return cls(**values), []


class _Bad(Exception):
    def __init__(self, option: str, value: Any, message: str, **kwargs: Any) -> None:
        super().__init__(message)
        self.problem = Problem(option, value, message, **kwargs)


def _schedule(value: Any) -> dict[str, Any]:
    names = tuple(REGISTRY)
    if value not in names:
        valid = ", ".join(repr(name) for name in names)
        raise _Bad(
            "schedule",
            value,
            f"unknown schedule {value!r}; valid schedules: {valid}",
            choices=names,
        )
    return {"schedule": value}


def _microbatches(value: Any) -> dict[str, Any]:
    if value is not None and not _positive_int(value):
        raise _Bad("microbatches", value, f"microbatches must be a positive int, got {value!r}")
    return {"microbatches": value}


def _flush_every(value: Any) -> dict[str, Any]:
    if value is not None and not _positive_int(value):
        raise _Bad(
            "flush_every",
            value,
            f"flush_every must be a positive int (batches) or None, got {value!r}",
        )
    return {"flush_every": value}


def _balance(value: Any) -> dict[str, Any]:
    if value is None:
        return {"balance": None, "balance_mode": None}
    if isinstance(value, str):
        if value not in BALANCE_MODES:
            modes = ", ".join(repr(m) for m in BALANCE_MODES)
            raise _Bad(
                "balance",
                value,
                f"balance={value!r} is not a balance mode ({modes}) nor a list of block counts "
                "per stage such as [3, 5]",
                choices=BALANCE_MODES,
            )
        return {"balance": None, "balance_mode": value}
    wrong_type = f"balance must be a list of block counts per stage, got {value!r}"
    if isinstance(value, bytes) or not isinstance(value, Iterable):
        raise _Bad("balance", value, wrong_type, kind=TypeError)
    counts = list(value)
    if not counts:
        raise _Bad(
            "balance",
            value,
            "balance=[] lists no stage; give one block count per stage, or None for an even split",
        )
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in counts):
        raise _Bad("balance", value, wrong_type, kind=TypeError)
    if any(b <= 0 for b in counts):
        raise _Bad("balance", value, f"every stage needs at least one block, but balance={counts}")
    return {"balance": tuple(counts), "balance_mode": None}


def _body(value: Any) -> dict[str, Any]:
    if value is not None and (not isinstance(value, str) or not value):
        raise _Bad(
            "body",
            value,
            f"body must be the dotted attribute name of the nn.Sequential body (e.g. "
            f"'encoder.layers') or None, got {value!r}",
            kind=TypeError,
        )
    return {"body": value}


def _start_method(value: Any) -> dict[str, Any]:
    if value not in START_METHODS:
        raise _Bad(
            "start_method",
            value,
            f"start_method must be 'popen', 'spawn', 'fork' or 'forkserver', got {value!r}",
            choices=START_METHODS,
        )
    return {"start_method": value}


def _backend(value: Any) -> dict[str, Any]:
    if value is not None and (not isinstance(value, str) or not value):
        raise _Bad(
            "process_group_backend",
            value,
            f"process_group_backend must be a torch.distributed backend name such as 'gloo' or "
            f"'nccl', or None for the device's default, got {value!r}",
            kind=TypeError,
        )
    return {"process_group_backend": value}


def _timeout(value: Any) -> dict[str, Any]:
    if value is not None and not isinstance(value, timedelta):
        raise _Bad(
            "timeout",
            value,
            f"timeout must be a datetime.timedelta (e.g. timedelta(minutes=10)) or None, got "
            f"{value!r}",
            kind=TypeError,
        )
    if value is not None and value.total_seconds() <= 0:
        raise _Bad(
            "timeout",
            value,
            f"timeout must be positive, got {value!r} ({value.total_seconds():g} s): it is how "
            "long a rank waits for another before giving up; give e.g. timedelta(minutes=10), or "
            f"None for the default ({DEFAULT_TIMEOUT.total_seconds() / 60:g} minutes)",
        )
    return {"timeout": value}


def _state_dict_type(value: Any) -> dict[str, Any]:
    if value not in STATE_DICT_TYPES:
        raise _Bad(
            "state_dict_type",
            value,
            f"state_dict_type must be 'full' (one consolidated file) or 'sharded' (a directory "
            f"of per-stage files), got {value!r}",
            choices=STATE_DICT_TYPES,
        )
    return {"state_dict_type": value}


def _data_parallel(value: Any) -> dict[str, Any]:
    if not _positive_int(value):
        raise _Bad(
            "data_parallel",
            value,
            f"data_parallel must be a positive int (pipeline replicas), got {value!r}",
        )
    return {"data_parallel": value}


def _recompute(value: Any) -> dict[str, Any]:
    if value is None or isinstance(value, bool):
        return {"recompute": value}
    wrong = f"recompute must be a bool or a list of one bool per stage, got {value!r}"
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _Bad("recompute", value, wrong, kind=TypeError)
    flags = tuple(value)
    if not flags or not all(isinstance(f, bool) for f in flags):
        raise _Bad("recompute", value, wrong, kind=TypeError)
    return {"recompute": flags}


def _memory_plan(value: Any) -> dict[str, Any]:
    if value is None:
        return {"memory_plan": None}
    if not isinstance(value, Mapping):
        raise _Bad(
            "memory_plan",
            value,
            f"memory_plan must map block indices to policies, e.g. {{0: 'recompute', 5: 'swap'}}, "
            f"got {value!r}",
            kind=TypeError,
        )
    try:
        return {"memory_plan": check_memory_plan(value)}
    except ValueError as err:
        raise _Bad("memory_plan", value, str(err)) from None


def _balance_activations(value: Any) -> dict[str, Any]:
    if value is None or isinstance(value, bool):
        return {"activation_budget": ActivationBudget() if value else None}
    try:
        return {"activation_budget": ActivationBudget(microbatches=value)}
    except ValueError as err:
        raise _Bad("balance_activations", value, str(err)) from None


def _repartition_every(value: Any) -> dict[str, Any]:
    if value is not None and not _positive_int(value):
        raise _Bad(
            "repartition_every",
            value,
            f"repartition_every must be a positive int (steps) or None, got {value!r}",
        )
    return {"repartition_every": value}


def _repartition_threshold(value: Any) -> dict[str, Any]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 10:
        raise _Bad(
            "repartition_threshold",
            value,
            "repartition_threshold must be a fraction >= 0 such as 0.15 (15% slower), got "
            f"{value!r}",
        )
    return {"repartition_threshold": float(value)}


def _early_input_grad(value: Any) -> dict[str, Any]:
    if not isinstance(value, bool):
        raise _Bad(
            "early_input_grad",
            value,
            f"early_input_grad must be True or False, got {value!r}",
            kind=TypeError,
        )
    return {"early_input_grad": value}


def _sync_steps(value: Any) -> dict[str, Any]:
    whole = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    share = isinstance(value, float) and 0 < value < 1
    if not (whole or share):
        raise _Bad(
            "sync_steps",
            value,
            f"sync_steps must be an int >= 0 (the batches 2BW runs synchronously before its "
            f"delayed rule starts; 0: none) or a float between 0 and 1 (that share of the fit's "
            f"optimizer steps, e.g. 0.8), got {value!r}",
        )
    return {"sync_steps": value}


def _fresh_last_stage(value: Any) -> dict[str, Any]:
    if not isinstance(value, bool):
        raise _Bad(
            "fresh_last_stage",
            value,
            f"fresh_last_stage must be True or False, got {value!r}",
            kind=TypeError,
        )
    return {"fresh_last_stage": value}


def _check_split(value: Any) -> dict[str, Any]:
    if not isinstance(value, bool):
        raise _Bad(
            "check_split",
            value,
            f"check_split must be True or False, got {value!r}",
            kind=TypeError,
        )
    return {"check_split": value}


def _delay_correction(value: Any) -> dict[str, Any]:
    if value == "auto":
        return {"delay_correction": value}
    try:
        return {"delay_correction": canonical_correction(value)}
    except ValueError as err:
        message = str(err)
        if isinstance(value, str) and "+" not in value and "=" not in value:
            valid = ", ".join(repr(n) for n in ("auto", *CORRECTIONS))
            message = (
                f"unknown delay_correction {value!r}; valid: {valid}, or several joined by '+' "
                "(e.g. 'predict+error_feedback=0.5')"
            )
        raise _Bad("delay_correction", value, message) from None


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


def _listed_unless(kind: type) -> Callable[[Any], Any]:
    """A config's sequence (Hydra's ``ListConfig``) as a list; None or a ``kind`` as is."""
    return lambda value: value if value is None or isinstance(value, kind) else list(value)


def _mapped(value: Any) -> Any:
    """A config's mapping (Hydra's ``DictConfig``) as a dict."""
    return None if value is None else dict(value.items())


def _seconds(value: Any) -> Any:
    return timedelta(seconds=value) if value is not None else DEFAULT_TIMEOUT


# Every option, declared once, in the order of the strategy's signature and of the problems
# listed. ``PipeOptions.create`` reads the defaults and checks; ``lightning_pipe2bw.config``
# derives the Hydra schema (``StrategyConfig``) from the ``config_*`` fields; a unit test holds
# ``Pipe2BWStrategy.__init__``'s keywords and defaults to this table.
OPTIONS: tuple[Option, ...] = (
    Option("schedule", DEFAULT_SCHEDULE, _schedule, str),
    Option(
        "microbatches", None, _microbatches, int | None, config_default=4,
        note="per batch; at least the number of stages under 2bw",
    ),
    Option(
        "flush_every", None, _flush_every, int | None,
        note="also drain the pipeline every this many batches (2bw, pipedream)",
    ),
    Option(
        "balance", None, _balance, Any, from_config=_listed_unless(str),
        note='blocks per stage, e.g. [3, 3], or a mode: "uniform", "params", "auto" (profile and '
        "plan)",
    ),
    Option("body", None, _body, str | None, note="the dotted name of the nn.Sequential body"),
    Option(
        "start_method", "popen", _start_method, str, config_default="auto",
        note='"auto": "popen" for a single run, "spawn" under --multirun '
        "(config.resolve_start_method)",
    ),
    Option(
        "process_group_backend", None, _backend, str | None,
        note="None: gloo on CPU, nccl on CUDA",
    ),
    Option(
        "timeout", DEFAULT_TIMEOUT, _timeout, float | None, config_name="timeout_s",
        config_default=None, from_config=_seconds,
        note="process-group timeout in seconds; None: the strategy default (3 min)",
    ),
    Option(
        "state_dict_type", "full", _state_dict_type, str,
        note='"full": one consolidated file; "sharded": a torch.distributed.checkpoint directory',
    ),
    Option(
        "data_parallel", 1, _data_parallel, int,
        note="pipeline replicas (devices must be a multiple)",
    ),
    Option(
        "recompute", None, _recompute, Any, from_config=_listed_unless(bool),
        note="recompute activations in the backward: a bool, or one per stage; None: off, or "
        "the planner's choice with balance=auto",
    ),
    Option(
        "memory_plan", None, _memory_plan, Any, from_config=_mapped,
        note='per block index: "keep", "recompute", "swap" (to host) or "evict" (to the '
        "partner stage)",
    ),
    Option(
        "balance_activations", None, _balance_activations, Any,
        note="BPipe: true (the balanced share), or a budget in micro-batches per evicting stage",
    ),
    Option(
        "repartition_every", None, _repartition_every, int | None,
        note="vPipe: check the stages' measured times every this many steps and move blocks",
    ),
    Option(
        "repartition_threshold", 0.15, _repartition_threshold, float,
        note="move when the slowest stage is this much over the best split",
    ),
    Option(
        "early_input_grad", True, _early_input_grad, bool,
        note="flush schedules: send the last (GPipe: and the first) micro-batch's input "
        "gradient before the weights' gradients",
    ),
    Option(
        "delay_correction", "auto", _delay_correction, str,
        note="2bw/pipedream: auto (the schedule's default), none, predict, error_feedback, "
        "nesterov or update_feedback, or several joined by '+'",
    ),
    Option(
        "sync_steps", 0, _sync_steps, Any,
        note="2bw: the first this many batches run synchronously (flushed, at the newest "
        "weights), then the delayed rule; a float in (0, 1): that share of the fit's steps",
    ),
    Option(
        "fresh_last_stage", False, _fresh_last_stage, bool,
        note="2bw: the last stage runs each batch at its newest weights (its update lands in "
        "the same step, uncorrected); the stages before it keep the delay",
    ),
    Option(
        "check_split", True, _check_split, bool,
        note="models that are not an nn.Sequential: check the split's output against the whole "
        "model's at set-up, and that every parameter gets a gradient at the first update",
    ),
)  # fmt: skip
OPTION_NAMES = frozenset(option.name for option in OPTIONS)
