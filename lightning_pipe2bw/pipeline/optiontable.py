"""Every option of the strategy, declared once: its name, default, parser (which checks its
value alone and normalises it) and what the Hydra config and the docs say of it. ``PipeOptions``
(``pipeline/options.py``) is built from this table, ``lightning_pipe2bw.config`` derives the
Hydra schema from it, and tests hold the strategy's signature, the YAMLs and
``docs/configuration.md`` to it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, get_args

from lightning_pipe2bw.optim.delay import CORRECTIONS, canonical_correction
from lightning_pipe2bw.pipeline.problems import Problem
from lightning_pipe2bw.runtime.stash import check_memory_plan
from lightning_pipe2bw.schedule import REGISTRY, ActivationBudget

__all__ = [
    "BALANCE_MODES",
    "DEFAULT_SCHEDULE",
    "DEFAULT_TIMEOUT",
    "OPTIONS",
    "OPTION_NAMES",
    "BadOption",
    "BalanceMode",
    "LossNormalization",
    "StartMethod",
    "StateDictType",
]

BalanceMode = Literal["uniform", "params", "flops", "auto"]
BALANCE_MODES: tuple[str, ...] = get_args(BalanceMode)
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS: tuple[str, ...] = get_args(StartMethod)
StateDictType = Literal["full", "sharded"]
STATE_DICT_TYPES: tuple[str, ...] = get_args(StateDictType)
LossNormalization = Literal["batch", "microbatch"]
LOSS_NORMALIZATIONS: tuple[str, ...] = get_args(LossNormalization)

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
    name and default when they differ, ``from_config``: the config's value as the keyword's);
    then its text, written here only: ``doc`` (Markdown: what it does), ``shown_default`` (the
    default in words, where the value does not say it) and ``config_note`` (what differs in a
    config). ``pipeline/optiondocs.py`` renders them."""

    name: str
    default: Any
    parse: Callable[[Any], dict[str, Any]]
    config_type: Any
    config_name: str = ""  # "": the option's name
    config_default: Any = _SAME
    from_config: Callable[[Any], Any] | None = None
    doc: str = ""
    shown_default: str = ""
    config_note: str = ""

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


# the schedule Pipe2BWStrategy() trains with: exact, and it runs any body of at least p blocks
# at any m; the reason and when another reaches a loss sooner (a V, or 2BW at depth):
# docs/pipedream-2bw.md, "Which schedule at which depth"
DEFAULT_SCHEDULE = "1f1b"


class BadOption(Exception):
    """An option's value its parser refuses: the :class:`Problem` it makes."""

    def __init__(self, option: str, value: Any, message: str, **kwargs: Any) -> None:
        super().__init__(message)
        self.problem = Problem(option, value, message, **kwargs)


def _schedule(value: Any) -> dict[str, Any]:
    names = tuple(REGISTRY)
    if value not in names:
        valid = ", ".join(repr(name) for name in names)
        raise BadOption(
            "schedule",
            value,
            f"unknown schedule {value!r}; valid schedules: {valid}",
            choices=names,
        )
    return {"schedule": value}


def _microbatches(value: Any) -> dict[str, Any]:
    if value is not None and not _positive_int(value):
        raise BadOption(
            "microbatches", value, f"microbatches must be a positive int, got {value!r}"
        )
    return {"microbatches": value}


def _flush_every(value: Any) -> dict[str, Any]:
    if value is not None and not _positive_int(value):
        raise BadOption(
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
            raise BadOption(
                "balance",
                value,
                f"balance={value!r} is not a balance mode ({modes}) nor a list of block counts "
                "per stage such as [3, 5]",
                choices=BALANCE_MODES,
            )
        return {"balance": None, "balance_mode": value}
    wrong_type = f"balance must be a list of block counts per stage, got {value!r}"
    if isinstance(value, bytes) or not isinstance(value, Iterable):
        raise BadOption("balance", value, wrong_type, kind=TypeError)
    counts = list(value)
    if not counts:
        raise BadOption(
            "balance",
            value,
            "balance=[] lists no stage; give one block count per stage, or None for an even split",
        )
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in counts):
        raise BadOption("balance", value, wrong_type, kind=TypeError)
    if any(b <= 0 for b in counts):
        raise BadOption(
            "balance", value, f"every stage needs at least one block, but balance={counts}"
        )
    return {"balance": tuple(counts), "balance_mode": None}


def _body(value: Any) -> dict[str, Any]:
    if value is not None and (not isinstance(value, str) or not value):
        raise BadOption(
            "body",
            value,
            f"body must be the dotted attribute name of the nn.Sequential body (e.g. "
            f"'encoder.layers') or None, got {value!r}",
            kind=TypeError,
        )
    return {"body": value}


# the parser of an option that takes one of `choices` (`meaning`: what each does)
def _one_of(option: str, choices: tuple[str, ...], meaning: str) -> Callable[[Any], dict[str, Any]]:
    def parse(value: Any) -> dict[str, Any]:
        if value not in choices:
            raise BadOption(
                option, value, f"{option} must be {meaning}, got {value!r}", choices=choices
            )
        return {option: value}

    return parse


_start_method = _one_of("start_method", START_METHODS, "'popen', 'spawn', 'fork' or 'forkserver'")


def _backend(value: Any) -> dict[str, Any]:
    if value is not None and (not isinstance(value, str) or not value):
        raise BadOption(
            "process_group_backend",
            value,
            f"process_group_backend must be a torch.distributed backend name such as 'gloo' or "
            f"'nccl', or None for the device's default, got {value!r}",
            kind=TypeError,
        )
    return {"process_group_backend": value}


def _timeout(value: Any) -> dict[str, Any]:
    if value is not None and not isinstance(value, timedelta):
        raise BadOption(
            "timeout",
            value,
            f"timeout must be a datetime.timedelta (e.g. timedelta(minutes=10)) or None, got "
            f"{value!r}",
            kind=TypeError,
        )
    if value is not None and value.total_seconds() <= 0:
        raise BadOption(
            "timeout",
            value,
            f"timeout must be positive, got {value!r} ({value.total_seconds():g} s): it is how "
            "long a rank waits for another before giving up; give e.g. timedelta(minutes=10), or "
            f"None for the default ({DEFAULT_TIMEOUT.total_seconds() / 60:g} minutes)",
        )
    return {"timeout": value}


_state_dict_type = _one_of(
    "state_dict_type", STATE_DICT_TYPES,
    "'full' (one consolidated file) or 'sharded' (a directory of per-stage files)",
)  # fmt: skip
_loss_normalization = _one_of(
    "loss_normalization", LOSS_NORMALIZATIONS,
    "'batch' (a loss over items, such as tokens, divided by the whole batch's count, as on one "
    "device) or 'microbatch' (by each micro-batch's own, as Lightning's gradient accumulation)",
)  # fmt: skip


def _data_parallel(value: Any) -> dict[str, Any]:
    if not _positive_int(value):
        raise BadOption(
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
        raise BadOption("recompute", value, wrong, kind=TypeError)
    flags = tuple(value)
    if not flags or not all(isinstance(f, bool) for f in flags):
        raise BadOption("recompute", value, wrong, kind=TypeError)
    return {"recompute": flags}


def _memory_plan(value: Any) -> dict[str, Any]:
    if value is None:
        return {"memory_plan": None}
    if not isinstance(value, Mapping):
        raise BadOption(
            "memory_plan",
            value,
            f"memory_plan must map block indices to policies, e.g. {{0: 'recompute', 5: 'swap'}}, "
            f"got {value!r}",
            kind=TypeError,
        )
    try:
        return {"memory_plan": check_memory_plan(value)}
    except ValueError as err:
        raise BadOption("memory_plan", value, str(err)) from None


def _balance_activations(value: Any) -> dict[str, Any]:
    if value is None or isinstance(value, bool):
        return {"activation_budget": ActivationBudget() if value else None}
    try:
        return {"activation_budget": ActivationBudget(microbatches=value)}
    except ValueError as err:
        raise BadOption("balance_activations", value, str(err)) from None


def _repartition_every(value: Any) -> dict[str, Any]:
    if value is not None and not _positive_int(value):
        raise BadOption(
            "repartition_every",
            value,
            f"repartition_every must be a positive int (steps) or None, got {value!r}",
        )
    return {"repartition_every": value}


def _repartition_threshold(value: Any) -> dict[str, Any]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 10:
        raise BadOption(
            "repartition_threshold",
            value,
            "repartition_threshold must be a fraction >= 0 such as 0.15 (15% slower), got "
            f"{value!r}",
        )
    return {"repartition_threshold": float(value)}


def _flag(name: str) -> Callable[[Any], dict[str, Any]]:
    """The parser of a True/False option ``name``."""

    def parse(value: Any) -> dict[str, Any]:
        if not isinstance(value, bool):
            raise BadOption(
                name, value, f"{name} must be True or False, got {value!r}", kind=TypeError
            )
        return {name: value}

    return parse


def _sync_steps(value: Any) -> dict[str, Any]:
    whole = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    share = isinstance(value, float) and 0 < value < 1
    if not (whole or share):
        raise BadOption(
            "sync_steps",
            value,
            f"sync_steps must be an int >= 0 (the batches 2BW runs synchronously before its "
            f"delayed rule starts; 0: none) or a float between 0 and 1 (that share of the fit's "
            f"optimizer steps, e.g. 0.8), got {value!r}",
        )
    return {"sync_steps": value}


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
        raise BadOption("delay_correction", value, message) from None


def _compile_blocks(value: Any) -> dict[str, Any]:
    if value is None or value is False:
        return {"compile_blocks": None}
    if value is True:
        return {"compile_blocks": {}}
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {"compile_blocks": dict(value)}
    raise BadOption(
        "compile_blocks",
        value,
        "compile_blocks must be True, False or a dict of torch.compile keyword arguments "
        f"(e.g. {{'mode': 'max-autotune', 'dynamic': False}}), got {value!r}",
        kind=TypeError,
    )


def _listed_unless(kind: type) -> Callable[[Any], Any]:
    """A config's sequence (Hydra's ``ListConfig``) as a list; None or a ``kind`` as is."""
    return lambda value: value if value is None or isinstance(value, kind) else list(value)


def _mapped(value: Any) -> Any:
    """A config's mapping (Hydra's ``DictConfig``) as a dict."""
    return None if value is None else dict(value.items())


def _mapped_or_flag(value: Any) -> Any:
    """A config's True/False, or its mapping (Hydra's ``DictConfig``) as a dict."""
    return value if value is None or isinstance(value, bool) else dict(value.items())


def _seconds(value: Any) -> Any:
    return timedelta(seconds=value) if value is not None else DEFAULT_TIMEOUT


# Every option, declared once, in the order of the strategy's signature and of the problems
# listed. ``PipeOptions.create`` reads the defaults and checks; ``lightning_pipe2bw.config``
# derives the Hydra schema (``StrategyConfig``) from the ``config_*`` fields; ``doc`` is the one
# text the strategy's docstring, docs/user-guide.md and docs/configuration.md show (``make docs`` writes
# the two files, ``pipeline/optiondocs.py``); a unit test holds ``Pipe2BWStrategy.__init__``'s
# keywords and defaults to this table.
OPTIONS: tuple[Option, ...] = (
    Option(
        "schedule", DEFAULT_SCHEDULE, _schedule, str,
        doc="the pipeline schedule, one of `lightning_pipe2bw.schedule.REGISTRY`: `\"1f1b\"` "
        "(PipeDream-Flush, the default: exact, and it runs any body of at least one block per "
        "stage at any number of micro-batches), `\"2bw\"` (PipeDream-2BW: double-buffered weights, no flush between "
        "batches, W(t+1) = W(t) - step(grad f(W(t-1)))), `\"gpipe\"` (fill-drain), "
        "`\"pipedream\"` (weight stashing) or `\"zb-h1\"` (zero bubble: each backward cut into "
        "the inputs' and the weights' gradients, the latter deferred); with several stages per "
        "rank `\"interleaved-1f1b\"`, `\"zb-v\"`, `\"dualpipe-v\"` and `\"2bw-v\"`. The flush "
        "schedules equal single-device training exactly. See [docs/schedules.md](docs/schedules.md) "
        "and [docs/pipedream-2bw.md](docs/pipedream-2bw.md#which-schedule-at-which-depth)",
    ),
    Option(
        "microbatches", None, _microbatches, int | None, config_default=4,
        shown_default="the number of stages",
        doc="micro-batches per batch (m); each batch is split along dim 0, unevenly if it must "
        "(sizes differ by at most one); `2bw` needs at least one per stage",
    ),
    Option(
        "flush_every", None, _flush_every, int | None, shown_default="`None` (off)",
        doc="with `2bw`, also drain the pipeline every this many batches (it is always drained "
        "before validation, before a checkpoint, at the end of every epoch and at the end of "
        "fit)",
    ),
    Option(
        "balance", None, _balance, Any, from_config=_listed_unless(str),
        shown_default="`None` (balanced by modelled cost)",
        doc="blocks per stage, e.g. `[3, 5]`, never overridden. `None` evens out each stage's "
        "modelled cost (what a rank runs in all, where it holds several stages): the blocks' "
        "forward FLOPs on the first micro-batch where finding the body ran one (a Hugging Face "
        "model), else the parameters each block multiplies (an embedding's table is looked "
        "up, not multiplied, so [embedding, N blocks, head] splits the N blocks evenly with "
        "the embedding on the first stage and the head on the last). `\"flops\"` counts the "
        "FLOPs for any body (your step runs once at set-up, up to the body), `\"params\"` "
        "evens out parameter counts, `\"uniform\"` block counts, and `\"auto\"` profiles the "
        "blocks and lets the planner choose the split, the micro-batches and recomputation "
        "([docs/planner.md](docs/planner.md)). The stage table says which rule split the body",
    ),
    Option(
        "body", None, _body, str | None, shown_default="found automatically",
        doc="the dotted attribute name of the `nn.Sequential` body (or of a Hugging Face "
        "model), if it cannot be found automatically ([docs/models.md](docs/models.md))",
    ),
    Option(
        "start_method", "popen", _start_method, str, config_default="auto",
        doc="`\"popen\"` re-runs the script per rank (like `ddp`); `\"spawn\"`, `\"fork\"` and "
        "`\"forkserver\"` start workers from this process (like `ddp_spawn`) and bring the "
        "trained weights and predictions back to it. Under `torchrun` or a cluster launcher "
        "nothing is started",
        config_note="`auto`: `popen` for a single run, `forkserver` under `--multirun`",
    ),
    Option(
        "process_group_backend", None, _backend, str | None,
        shown_default="gloo on CPU, NCCL on CUDA",
        doc="the `torch.distributed` backend; `None`: NCCL on CUDA, gloo on CPU",
    ),
    Option(
        "timeout", DEFAULT_TIMEOUT, _timeout, float | None, config_name="timeout_s",
        config_default=None, from_config=_seconds, shown_default="3 minutes",
        doc="the process-group timeout: the longest any rank waits for another. A rank that "
        "hangs without failing (a deadlock in user code) stops the run after this long, with "
        "an error naming it; raise it if one rank may legitimately keep the others waiting "
        "longer (a very slow step, writing a huge consolidated checkpoint)",
        config_note="in seconds; `null` keeps the strategy's default (180)",
    ),
    Option(
        "state_dict_type", "full", _state_dict_type, str,
        doc="`\"full\"` writes one consolidated Lightning checkpoint, loadable on one device "
        "(gathered on rank 0); `\"sharded\"` writes a directory in which every rank saves its "
        "own stage with `torch.distributed.checkpoint` under the original parameter names, so "
        "it reloads with any number of stages",
    ),
    Option(
        "loss_normalization", "batch", _loss_normalization, str,
        doc="how a loss that is a mean over items (the tokens whose label is not -100) is "
        "normalised over micro-batches holding different numbers of them. `\"batch\"` divides "
        "each micro-batch's summed loss by the whole batch's count: the loss, its gradient and "
        "the clipping are one device's on the whole batch. A Hugging Face model whose loss "
        "takes `num_items_in_batch` gets the batch's count in its call (counted as "
        "transformers' Trainer counts it); your own loss divides by "
        "`lightning_pipe2bw.items_in_batch(batch, count)`. `\"microbatch\"` takes each "
        "micro-batch's own mean, weighted by its size (Lightning's gradient accumulation). A "
        "per-sample mean is the same under both "
        "([docs/user-guide.md](docs/user-guide.md#losses-normalised-by-the-whole-batch))",
    ),
    Option(
        "data_parallel", 1, _data_parallel, int,
        doc="pipeline replicas (w): `devices * num_nodes` must be a multiple of it; each "
        "replica is a pipeline of world size / w stages that reads its own shard of the data, "
        "and every stage averages its gradients with its replicas before the update (`pipedream`: "
        "where the stage updates, inside the pipeline)",
    ),
    Option(
        "shard_optimizer", False, _flag("shard_optimizer"), bool,
        doc="with `data_parallel > 1`: shard each stage's optimizer state over its replicas "
        "(ZeRO-1): by elements for element-wise optimizers (AdamW, SGD, ...), Muon's matrices "
        "whole. A replica steps and keeps optimizer state (moments, a delay correction's "
        "buffer) for its own part only, then the replicas gather each other's updated weights. "
        "The same weights as without it; checkpoints are the same files "
        "([docs/memory.md](docs/memory.md#optimizer-state-sharded-over-the-replicas-zero-1))",
    ),
    Option(
        "fsdp", False, _flag("fsdp"), bool,
        doc="with `data_parallel > 1` and a flushed schedule: shard each block's weights, "
        "gradients and optimizer state over the stage's replicas with torch's FSDP2 "
        "(`fully_shard` on every block over the replica group, as torchtitan composes it). A "
        "rank keeps 1/d of its stage; each block's weights are gathered for its forward and "
        "backward, and its gradients reduce-scattered after the batch's last backward. "
        "Checkpoints are the same files "
        "([docs/memory.md](docs/memory.md#fsdp2-inside-a-stage))",
    ),
    Option(
        "recompute", None, _recompute, Any, from_config=_listed_unless(bool),
        shown_default="`None` (off; the planner's choice with `balance=\"auto\"`)",
        doc="recompute every block's activations in the backward (`torch.utils.checkpoint`): "
        "a stage then keeps only its input per micro-batch in flight; a bool, or one per stage",
    ),
    Option(
        "memory_plan", None, _memory_plan, Any, from_config=_mapped,
        shown_default="`None` (every block keeps its activations)",
        doc="what each block does with the activations it saves for the backward, "
        "`{block index: \"keep\" | \"recompute\" | \"swap\" | \"evict\"}` (blocks not named "
        "keep theirs): `\"swap\"` moves them to host memory until the backward, `\"evict\"` to "
        "the partner stage p-1-s (only stages with s < p-1-s have one); see "
        "[docs/memory.md](docs/memory.md)",
        config_note="e.g. `strategy.memory_plan='{0: swap, 1: swap}'`",
    ),
    Option(
        "balance_activations", None, _balance_activations, Any, shown_default="`None` (off)",
        doc="BPipe: `True` makes each early stage hand the balanced share of its saved "
        "activations to its partner p-1-s; a number is a budget in micro-batches of its own "
        "saved activations an evicting stage keeps at its peak (the `ActivationBalancer` "
        "callback also takes a budget in bytes)",
    ),
    Option(
        "repartition_every", None, _repartition_every, int | None, shown_default="`None` (off)",
        doc="vPipe: every this many steps, measure each block's time and move whole blocks "
        "between stages when the slowest stage is more than `repartition_threshold` slower "
        "than the best split of the measured times. Blocks move at a flush point (2BW drains "
        "the pipeline first, unless `flush_every` already did), with their weights, 2BW weight "
        "versions and optimizer state; the math is unchanged. See "
        "[docs/repartition.md](docs/repartition.md)",
    ),
    Option(
        "repartition_threshold", 0.15, _repartition_threshold, float,
        doc="how much slower (0.15: 15%) the slowest stage must be than the best split's "
        "before blocks move",
    ),
    Option(
        "early_input_grad", True, _flag("early_input_grad"), bool,
        doc="flush schedules (`gpipe`, `1f1b`): each stage after the first computes its last "
        "micro-batch's input gradient (GPipe: also its first's) on its own and sends it before "
        "the weights' gradients, so that the previous stage, which waits for it, starts that "
        "backward about half a backward sooner. The backward is cut into an inputs' pass and a "
        "weights' pass that do the work of one, bitwise exact; where the graph does not allow "
        "the cut, the last backward takes one more pass over the input-gradient path instead. "
        "Stages whose backward must run as one pass (hooks, recomputation) do not split; "
        "`False` turns it off everywhere "
        "([docs/schedules.md](docs/schedules.md#input-gradients-go-first-early_input_grad))",
    ),
    Option(
        "delay_correction", "auto", _delay_correction, str,
        doc="`2bw` (and `pipedream`, gradient corrections only): how each update corrects "
        "2BW's one-step gradient delay, by an exact rule of `lightning_pipe2bw.optim.delay`: "
        "`\"predict\"` evaluates each batch at the optimizer's own prediction of the weights "
        "its gradient is applied to, `\"error_feedback\"` adds the gradient's change since the "
        "previous step to the gradient, `\"nesterov\"` extends each update by its change since "
        "the previous one, `\"update_feedback\"` by all of it (arXiv 2606.30634's rule), "
        "`\"none\"` is the plain rule, and several join with `+`; `\"auto\"` takes the "
        "schedule's default. Rules, memory and measured convergence: "
        "[docs/pipedream-2bw.md](docs/pipedream-2bw.md#delay-corrections)",
    ),
    Option(
        "sync_steps", 0, _sync_steps, Any,
        doc="`2bw` and `2bw-v`: a synchronous start. The first `sync_steps` batches of a fit "
        "run as `1f1b` does (at the newest weights, drained in their own step, their updates "
        "uncorrected), then the delayed rule starts. A float between 0 and 1 is a share of the "
        "fit's optimizer steps (`max_steps`, else Lightning's estimate), e.g. `0.8`; `0` starts "
        "delayed ([docs/pipedream-2bw.md](docs/pipedream-2bw.md#a-synchronous-start))",
    ),
    Option(
        "fresh_last_stage", False, _flag("fresh_last_stage"), bool,
        doc="`2bw`: the last stage runs every batch at its newest weights. In 1F1B order it "
        "has run batch t's last backward before batch t+1's first forward, so its update can "
        "land in the same step, W(t+1) = W(t) - U(grad f_t(W(t))), without a correction; the "
        "stages before it keep the one-step delay. Not with weights tied between the last "
        "stage and another ([docs/pipedream-2bw.md](docs/pipedream-2bw.md#a-fresh-last-stage))",
    ),
    Option(
        "compile_blocks", False, _compile_blocks, Any, from_config=_mapped_or_flag,
        shown_default="`False` (blocks run as given)",
        doc="compile each of the stage's blocks after the split, in place (`nn.Module.compile`: "
        "the state dict keeps its keys): `True`, or a dict of `torch.compile` keyword "
        "arguments (`{\"backend\": \"aot_eager\"}`, `{\"mode\": \"max-autotune\"}`). Blocks "
        "the model compiled itself stay as they are. A compiled block's backward is not cut "
        "into zero bubble's B and W: it runs whole at B ([docs/user-guide.md]"
        "(docs/user-guide.md#compiled-blocks))",
        config_note="e.g. `strategy.compile_blocks=true` or `'strategy.compile_blocks={mode: max-autotune}'`",
    ),
    Option(
        "check_split", True, _flag("check_split"), bool,
        doc="the guard against a split that trains silently wrong: at set-up, a model that is "
        "not an `nn.Sequential` (a Hugging Face model, a `PipeModel`) is run whole and split "
        "on the first micro-batch and their outputs must agree; each micro-batch of new shapes "
        "is proved to split exactly on the stages before they train on it (once per shape); at "
        "the first update, every trainable parameter the model uses must have received a "
        "gradient (as DDP checks; each stage checks its own). `False` turns all three off "
        "([docs/models.md](docs/models.md#the-guard-against-silent-wrongness))",
    ),
)  # fmt: skip
OPTION_NAMES = frozenset(option.name for option in OPTIONS)
