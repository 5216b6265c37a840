"""Typed Hydra structured configs for ``python -m lightning_pipe2bw.train``, and their builders.

The dataclasses are the schema: ``register_configs()`` stores ``TrainConfig`` in Hydra's
``ConfigStore`` as ``train_schema``, the first entry of the defaults list of
``configs/train.yaml``. Every group option (``configs/strategy/1f1b.yaml`` ...) is merged onto it,
so an unknown key (``strategy.scheduel=1f1b``) or a value of the wrong type
(``strategy.microbatches=four``) fails while the config is composed, before any process starts.
``check_config`` then checks the values that depend on one another and raises once, listing every
problem. The ``build_*`` functions turn the checked config into the objects it describes; they
hold no defaults of their own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass
from datetime import timedelta
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import II, DictConfig, OmegaConf

from lightning_pipe2bw.gpt import GPT, StdlibTextDataModule
from lightning_pipe2bw.schedule import SCHEDULES
from lightning_pipe2bw.strategy import BALANCE_MODES, Pipe2BWStrategy

__all__ = [
    "START_METHODS",
    "DataConfig",
    "ModelConfig",
    "StrategyConfig",
    "TrainConfig",
    "TrainerConfig",
    "build_datamodule",
    "build_model",
    "build_strategy",
    "check_config",
    "register_configs",
    "resolve_start_method",
    "to_train_config",
    "trainer_kwargs",
]

# "auto" is this entry point's own choice (see resolve_start_method); the rest are the strategy's
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


@dataclass
class ModelConfig:
    """``GPT``'s init arguments (``configs/model/<size>.yaml``)."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    lr: float = 5e-4  # PipeDream-2BW's one-step delay hurts at higher rates (docs/pipedream-2bw.md)
    weight_decay: float = 0.1
    warmup_steps: int = 30
    # the learning-rate decay ends with training unless set explicitly
    max_steps: int | None = II("trainer.max_steps")
    min_lr_ratio: float = 0.1


@dataclass
class DataConfig:
    """``StdlibTextDataModule``'s init arguments (``configs/data/stdlib.yaml``)."""

    block_size: int = II("model.block_size")  # samples as long as the model's context
    batch_size: int = 32
    max_bytes: int = 6_000_000
    val_every: int = 10
    train_samples: int = 16_000
    val_samples: int | None = 256
    seed: int = 0
    root: str | None = None  # None: the standard library of the running Python
    num_workers: int = 0


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


@dataclass
class TrainConfig:
    """The whole job: ``configs/train.yaml`` composes one option of every group onto this."""

    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    seed: int = 0
    report: bool = True  # add lightning_pipe2bw.report.PipelineReport (tables and plots)


def register_configs() -> None:
    """Store the schema in Hydra's ``ConfigStore`` (idempotent; call before composing)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def to_train_config(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """The composed ``DictConfig`` as a ``TrainConfig`` instance, interpolations resolved."""
    if isinstance(cfg, TrainConfig):
        return cfg
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, TrainConfig):
        raise TypeError(
            f"expected a config composed onto the 'train_schema' schema, got {type(obj).__name__}; "
            "compose configs/train.yaml after lightning_pipe2bw.config.register_configs()"
        )
    # keys added with '+' (e.g. +model.n_layers=3) pass Hydra and would be dropped silently here
    unknown = _unknown_keys(cfg, obj, "")
    if unknown:
        raise ValueError(
            "unknown config keys (added with '+'?): "
            + "; ".join(f"{key} (valid: {', '.join(valid)})" for key, valid in unknown)
        )
    return obj


def _unknown_keys(node: DictConfig, schema: Any, prefix: str) -> list[tuple[str, list[str]]]:
    """``(dotted key, valid names)`` for every key of ``node`` that ``schema`` has no field for."""
    names = [f.name for f in fields(schema)]
    found = [
        (f"{prefix}{key}", names)
        for key in map(str, node.keys())
        if key not in names and not (prefix == "" and key == "hydra")
    ]
    for name in names:
        value = getattr(schema, name)
        child = node.get(name)
        if is_dataclass(value) and isinstance(child, DictConfig):
            found += _unknown_keys(child, value, f"{prefix}{name}.")
    return found


def check_config(cfg: TrainConfig) -> None:
    """Raise one ``ValueError`` listing every inconsistent value (types are Hydra's job)."""
    problems: list[str] = []
    s, m, d, t = cfg.strategy, cfg.model, cfg.data, cfg.trainer
    if s.schedule not in SCHEDULES:
        problems.append(
            f"strategy.schedule={s.schedule!r} is unknown; valid: {', '.join(SCHEDULES)}"
        )
    if s.start_method not in START_METHODS:
        problems.append(
            f"strategy.start_method={s.start_method!r} is unknown; valid: {', '.join(START_METHODS)}"
        )
    if s.state_dict_type not in ("full", "sharded"):
        problems.append(
            f"strategy.state_dict_type={s.state_dict_type!r} is unknown; valid: full, sharded"
        )
    if s.microbatches is not None and not 1 <= s.microbatches <= d.batch_size:
        problems.append(
            f"strategy.microbatches={s.microbatches} must be between 1 and "
            f"data.batch_size={d.batch_size} (each micro-batch needs at least one sample)"
        )
    world = t.devices * t.num_nodes
    stages = world // max(s.data_parallel, 1)
    blocks = m.n_layer + 2  # embeddings, the transformer blocks, the head
    if t.devices < 1 or t.num_nodes < 1:
        problems.append(
            f"trainer.devices={t.devices} and trainer.num_nodes={t.num_nodes} must be positive "
            "(one pipeline stage per device)"
        )
    elif s.data_parallel < 1 or world % s.data_parallel != 0:
        problems.append(
            f"strategy.data_parallel={s.data_parallel} must divide the {world} devices "
            "(trainer.devices * trainer.num_nodes)"
        )
    elif isinstance(s.balance, str):
        if s.balance not in BALANCE_MODES:
            problems.append(
                f"strategy.balance={s.balance!r} is unknown; valid: a list of block counts, "
                f"{', '.join(BALANCE_MODES)}"
            )
    elif s.balance is not None:
        if len(s.balance) != stages or sum(s.balance) != blocks:
            problems.append(
                f"strategy.balance={s.balance} must list {stages} stages "
                f"(trainer.devices * trainer.num_nodes / strategy.data_parallel) summing to "
                f"{blocks} blocks (model.n_layer + 2)"
            )
    elif stages > blocks:
        problems.append(
            f"{stages} stages (trainer.devices * trainer.num_nodes) but the model has only "
            f"{blocks} blocks (model.n_layer={m.n_layer} + embeddings + head); "
            f"raise model.n_layer to at least {stages - 2} or use fewer devices"
        )
    if m.n_embd % m.n_head != 0:
        problems.append(f"model.n_embd={m.n_embd} must be divisible by model.n_head={m.n_head}")
    if d.block_size > m.block_size:
        problems.append(f"data.block_size={d.block_size} exceeds model.block_size={m.block_size}")
    if t.max_steps < 1:
        problems.append(f"trainer.max_steps={t.max_steps} must be positive")
    if t.val_check_interval < 1:
        problems.append(f"trainer.val_check_interval={t.val_check_interval} must be positive")
    if problems:
        raise ValueError("invalid training config:\n  - " + "\n  - ".join(problems))


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


def _balance(value: Any) -> Any:
    """A config's balance as the strategy takes it: a mode's name (checked there), or ints."""
    if value is None or isinstance(value, str):
        return value
    return [int(b) for b in value]


def build_strategy(cfg: StrategyConfig, *, multirun: bool = False) -> Pipe2BWStrategy:
    """The ``Pipe2BWStrategy`` that ``cfg`` describes."""
    kwargs: dict[str, Any] = {}
    if cfg.timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=cfg.timeout_s)
    return Pipe2BWStrategy(
        schedule=cfg.schedule,
        microbatches=cfg.microbatches,
        flush_every=cfg.flush_every,
        balance=_balance(cfg.balance),
        body=cfg.body,
        start_method=resolve_start_method(cfg.start_method, multirun),  # type: ignore[arg-type]
        process_group_backend=cfg.process_group_backend,
        state_dict_type=cfg.state_dict_type,  # type: ignore[arg-type]
        data_parallel=cfg.data_parallel,
        recompute=(
            cfg.recompute
            if cfg.recompute is None or isinstance(cfg.recompute, bool)
            else [bool(r) for r in cfg.recompute]
        ),
        # the strategy checks the keys and values and names a bad one
        memory_plan=None if cfg.memory_plan is None else dict(cfg.memory_plan.items()),
        balance_activations=cfg.balance_activations,
        repartition_every=cfg.repartition_every,
        repartition_threshold=cfg.repartition_threshold,
        **kwargs,
    )


def build_model(cfg: ModelConfig) -> GPT:
    """The ``GPT`` that ``cfg`` describes (the fields are its init arguments)."""
    return GPT(**asdict(cfg))


def build_datamodule(cfg: DataConfig) -> StdlibTextDataModule:
    """The ``StdlibTextDataModule`` that ``cfg`` describes (the fields are its init arguments;
    no data is read until ``setup``)."""
    return StdlibTextDataModule(**asdict(cfg))


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
