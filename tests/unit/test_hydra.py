"""The Hydra configs and entry point, in this process: every config composes and builds, and bad
overrides fail clearly. The command line in this process: ``test_train_entry.py``; real runs (a
single run with popen, a 2-run sweep with spawn): ``tests/launch/test_hydra.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT
from hydra import compose
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from lightning.pytorch import Trainer
from omegaconf import DictConfig

from lightning_pipe2bw.callbacks import PipelineReport
from lightning_pipe2bw.recipes.gpt.config import (
    TrainConfig,
    build_datamodule,
    build_model,
    build_strategy,
    check_config,
    resolve_start_method,
    to_train_config,
    trainer_kwargs,
)
from lightning_pipe2bw.recipes.gpt.data import StdlibTextDataModule
from lightning_pipe2bw.recipes.gpt.model import GPT, Block
from lightning_pipe2bw.schedule import REGISTRY
from lightning_pipe2bw.strategy import Pipe2BWStrategy
from lightning_pipe2bw.train import (
    RESULT_FILE,
    RunResult,
    SweepSummary,
    build_callbacks,
    format_table,
    summarize_sweep,
)

CONFIGS = ROOT / "configs"
MAIN_SCHEDULE = "dualpipe-v"  # train.yaml's strategy
GROUPS = ("strategy", "model", "data", "trainer")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def compose_train(overrides: list[str]) -> DictConfig:
    return compose(config_name="train", overrides=overrides)


def test_every_group_has_the_documented_options() -> None:
    # every registered schedule is a choice of the strategy group: strategy=NAME
    assert options("strategy") == sorted(REGISTRY)
    for name in REGISTRY:
        assert f"schedule: {name}\n" in (CONFIGS / "strategy" / f"{name}.yaml").read_text()
    assert options("trainer") == ["cpu", "gpu", "multinode"]
    assert {"tiny", "small"} <= set(options("model"))
    assert options("data") == ["stdlib"]


@pytest.mark.parametrize(
    "override", [f"{group}={name}" for group in GROUPS for name in options(group)]
)
def test_every_config_composes_and_builds(hydra_init: None, override: str, tmp_path: Path) -> None:
    cfg = to_train_config(compose_train([override]))
    assert isinstance(cfg, TrainConfig)
    check_config(cfg)
    group, name = override.split("=")

    strategy = build_strategy(cfg.strategy)
    assert isinstance(strategy, Pipe2BWStrategy)
    # train.yaml's strategy, but 1f1b on several nodes (4 processes, 6 blocks: no V)
    expected = {"strategy": name, "trainer": "1f1b" if name == "multinode" else MAIN_SCHEDULE}
    assert strategy.schedule_name == expected.get(group, MAIN_SCHEDULE)
    assert strategy.microbatches == cfg.strategy.microbatches

    model = build_model(cfg.model)
    assert isinstance(model, GPT)
    assert sum(isinstance(b, Block) for b in model.body) == cfg.model.n_layer
    assert model.max_steps == cfg.trainer.max_steps  # interpolated from the trainer group

    data = build_datamodule(cfg.data)
    assert isinstance(data, StdlibTextDataModule)
    assert data.block_size == cfg.model.block_size  # interpolated from the model group

    kwargs = trainer_kwargs(cfg.trainer)
    if group == "trainer":
        assert kwargs["accelerator"] == ("cpu" if name == "cpu" else "gpu")
        assert kwargs["num_nodes"] == (2 if name == "multinode" else 1)
    if kwargs["accelerator"] != "cpu" and not torch.cuda.is_available():
        kwargs["accelerator"] = "cpu"  # everything else of the GPU configs still gets built
    callbacks = build_callbacks(cfg, tmp_path, {"job": 0})
    assert {type(c) for c in callbacks} >= {RunResult, PipelineReport}
    trainer = Trainer(
        **kwargs, strategy=strategy, callbacks=callbacks, logger=False, default_root_dir=tmp_path
    )
    assert trainer.strategy is strategy
    assert trainer.max_steps == cfg.trainer.max_steps
    assert strategy.num_nodes == cfg.trainer.num_nodes
    assert strategy.num_processes == cfg.trainer.devices


def test_the_sweep_summary_callback_is_configured(hydra_init: None) -> None:
    cfg = compose(config_name="train", return_hydra_config=True)
    assert isinstance(instantiate(cfg.hydra.callbacks.sweep_summary), SweepSummary)
    assert str(cfg.hydra.run.dir).startswith("outputs/")


def test_start_method_auto_is_popen_for_one_run_and_forkserver_for_a_sweep() -> None:
    assert resolve_start_method("auto", multirun=False) == "popen"
    assert resolve_start_method("auto", multirun=True) == "forkserver"
    assert resolve_start_method("fork", multirun=True) == "fork"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("strategy.compile_blocks=true", {}),
        ("strategy.compile_blocks=false", None),
        ("strategy.compile_blocks={mode: max-autotune}", {"mode": "max-autotune"}),
    ],
)
def test_the_main_job_compiles_its_blocks_from_the_command_line(
    hydra_init: None, override: str, expected: Any
) -> None:
    strategy = build_strategy(to_train_config(compose_train([override])).strategy)
    assert strategy.options.compile_blocks == expected


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("strategy.scheduel=1f1b", "Key 'scheduel' not in 'StrategyConfig'"),
        ("strategy.microbatches=four", "could not be converted to Integer"),
        ("trainer.devices=2.5", "could not be converted to Integer"),
        ("strategy=2bx", "Could not find 'strategy/2bx'"),
    ],
)
def test_a_bad_override_fails_while_composing(
    hydra_init: None, override: str, expected: str
) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose_train([override])
    message = f"{info.value} {info.value.__cause__}"
    assert expected in message, message


def test_a_key_added_with_plus_is_refused(hydra_init: None) -> None:
    cfg = compose_train(["+model.n_layers=3", "+strategy.extra_option=1"])
    with pytest.raises(ValueError) as info:
        to_train_config(cfg)
    message = str(info.value)
    assert "model.n_layers (valid: vocab_size, block_size, n_layer," in message
    assert "strategy.extra_option (valid: schedule," in message
    # free-form Trainer arguments are the one place where new keys belong
    extra = to_train_config(compose_train(["+trainer.extra.deterministic=true"]))
    assert trainer_kwargs(extra.trainer)["deterministic"] is True
    clash = to_train_config(compose_train(["+trainer.extra.max_steps=3"]))
    with pytest.raises(ValueError, match=r"trainer.extra must not set \['max_steps'\]"):
        trainer_kwargs(clash.trainer)


def test_inconsistent_values_are_all_reported_at_once(hydra_init: None) -> None:
    cfg = to_train_config(
        compose_train(["strategy.schedule=2bx", "model.n_head=3", "strategy.microbatches=64"])
    )
    with pytest.raises(ValueError) as info:
        check_config(cfg)
    message = str(info.value)
    assert "strategy.schedule='2bx' is unknown; valid: gpipe, 1f1b, 2bw, pipedream" in message
    assert "model.n_embd=128 must be divisible by model.n_head=3" in message
    assert "strategy.microbatches=64 must be between 1 and data.batch_size=32" in message
    too_deep = to_train_config(compose_train(["model=tiny", "trainer.devices=5", "strategy=1f1b"]))
    with pytest.raises(ValueError, match=r"5 stages .* only 4 blocks"):
        check_config(too_deep)
    # the main job's V holds two stages per process: 4 GPUs need 8 blocks
    v = to_train_config(compose_train(["trainer=gpu", "trainer.devices=4", "strategy.microbatches=8"]))
    with pytest.raises(ValueError, match=r"8 stages .*\(4 processes of two stages each under "
                       r"dualpipe-v\) but the model has only 6 blocks .* at least 6"):  # fmt: skip
        check_config(v)
    check_config(to_train_config(compose_train(
        ["trainer=gpu", "trainer.devices=4", "strategy.microbatches=8", "model.n_layer=6"])))


def test_a_sweep_summary_lists_runs_without_a_result(tmp_path: Path) -> None:
    for job, schedule in ((0, "gpipe"), (1, None), (2, "2bw")):
        (tmp_path / str(job) / ".hydra").mkdir(parents=True)
        if schedule is not None:
            result = {"job": job, "schedule": schedule, "val_loss": 1.5, "overrides": []}
            (tmp_path / str(job) / RESULT_FILE).write_text(json.dumps(result))
    rows = summarize_sweep(tmp_path)
    assert [row["schedule"] for row in rows] == ["gpipe", "(no result.json)", "2bw"]
    table = format_table(rows, SweepSummary.columns).splitlines()
    assert len(table) == 2 + 3
    assert table[2].startswith("| 0   | gpipe ")
