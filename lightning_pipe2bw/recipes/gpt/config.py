"""The main job's Hydra structured configs (``python -m lightning_pipe2bw.train``), and their
builders.

The strategy and Trainer groups are the library's (``lightning_pipe2bw.config``, re-exported
here); the model and data groups are this recipe's. The dataclasses are the schema:
``register_configs()`` stores ``TrainConfig`` in Hydra's ``ConfigStore`` as ``train_schema``, the
first entry of the defaults list of ``configs/train.yaml``. Every group option (``configs/strategy/1f1b.yaml`` ...) is merged onto it,
so an unknown key (``strategy.scheduel=1f1b``) or a value of the wrong type
(``strategy.microbatches=four``) fails while the config is composed, before any process starts.
``check_config`` then checks the values that depend on one another and raises once, listing every
problem: the strategy's options through the strategy's own checks
(``lightning_pipe2bw.config.strategy_problems``), then what depends on this model (its block
count) and data. The ``build_*`` functions turn the checked config into the objects it
describes; they hold no defaults of their own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import II, DictConfig, OmegaConf

from lightning_pipe2bw.config import (
    StrategyConfig,
    TrainerConfig,
    build_strategy,
    resolve_start_method,
    strategy_problems,
    trainer_kwargs,
)
from lightning_pipe2bw.recipes.gpt.data import StdlibTextDataModule
from lightning_pipe2bw.recipes.gpt.model import GPT, OPTIMIZERS
from lightning_pipe2bw.schedule import REGISTRY, schedule_spec

__all__ = [
    "TrainConfig",
    "build_datamodule",
    "build_model",
    "build_strategy",
    "check_config",
    "register_configs",
    "resolve_start_method",
    "to_train_config",
    "trainer_kwargs",
]


@dataclass
class ModelConfig:
    """``GPT``'s init arguments (``configs/model/<size>.yaml``)."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    # the main job: Muon at its best rate (about 8x AdamW's best, one rate for both parts)
    # (benchmarks/convergence.py, docs/pipedream-2bw.md)
    lr: float = 1.6e-2
    weight_decay: float = 0.1
    warmup_steps: int = 30
    # the learning-rate decay ends with training unless set explicitly
    max_steps: int | None = II("trainer.max_steps")
    min_lr_ratio: float = 0.1
    optimizer: str = "muon"  # Muon on the blocks' matrices, AdamW on the rest; or "adamw"
    adamw_lr: float | None = None  # "muon": its AdamW part's peak rate, if not lr


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
class TrainConfig:
    """The whole job: ``configs/train.yaml`` composes one option of every group onto this."""

    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    seed: int = 0
    report: bool = True  # add lightning_pipe2bw.callbacks.PipelineReport (tables and plots)


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
    s, m, d, t = cfg.strategy, cfg.model, cfg.data, cfg.trainer
    world = t.devices * t.num_nodes
    problems = strategy_problems(s, world)
    if s.microbatches is not None and not 1 <= s.microbatches <= d.batch_size:
        problems.append(
            f"strategy.microbatches={s.microbatches} must be between 1 and "
            f"data.batch_size={d.batch_size} (each micro-batch needs at least one sample)"
        )
    stages = world // max(s.data_parallel, 1)
    blocks = m.n_layer + 2  # embeddings, the transformer blocks, the head
    if t.devices < 1 or t.num_nodes < 1:
        problems.append(
            f"trainer.devices={t.devices} and trainer.num_nodes={t.num_nodes} must be positive "
            "(one pipeline stage per device)"
        )
    elif isinstance(s.balance, str) or s.balance is None:
        per_rank = schedule_spec(s.schedule).stages_per_rank if s.schedule in REGISTRY else 1
        need = stages * per_rank
        if need > blocks and s.data_parallel >= 1 and world % s.data_parallel == 0:
            two = f" ({stages} processes of two stages each under {s.schedule})" if per_rank > 1 else ""
            problems.append(
                f"{need} stages (trainer.devices * trainer.num_nodes){two} but the model has only "
                f"{blocks} blocks (model.n_layer={m.n_layer} + embeddings + head); "
                f"raise model.n_layer to at least {need - 2} or use fewer devices"
            )
    elif sum(int(b) for b in s.balance) != blocks:
        problems.append(
            f"strategy.balance={list(s.balance)} must sum to the model's {blocks} blocks "
            "(model.n_layer + 2)"
        )
    if m.optimizer not in OPTIMIZERS:
        problems.append(f"model.optimizer={m.optimizer!r} must be one of {', '.join(OPTIMIZERS)}")
    if m.adamw_lr is not None and (m.optimizer != "muon" or m.adamw_lr < 0):
        problems.append(
            f"model.adamw_lr={m.adamw_lr} is the rate of Muon's AdamW part: a number >= 0 with "
            f"model.optimizer=muon (model.optimizer={m.optimizer!r}: set model.lr instead)"
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


def build_model(cfg: ModelConfig) -> GPT:
    """The ``GPT`` that ``cfg`` describes (the fields are its init arguments)."""
    return GPT(**asdict(cfg))


def build_datamodule(cfg: DataConfig) -> StdlibTextDataModule:
    """The ``StdlibTextDataModule`` that ``cfg`` describes (the fields are its init arguments;
    no data is read until ``setup``)."""
    return StdlibTextDataModule(**asdict(cfg))
