"""The main job's Lightning CLI (``python -m lightning_pipe2bw.recipes.gpt.cli``, the library's
CLI with the GPT as defaults), in this process: strategy options in each form and a config file.
Real two-process fits from the command line: ``tests/launch/test_cli.py``."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from helpers import ROOT

from lightning_pipe2bw.cli import expand_strategy_names
from lightning_pipe2bw.pipeline.options import DEFAULT_SCHEDULE
from lightning_pipe2bw.recipes.gpt.cli import main

TINY_MODEL = {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32}
TINY_DATA = {"block_size": 32, "batch_size": 8, "max_bytes": 200_000, "train_samples": 64}
SPAWN = "--trainer.strategy.start_method=spawn"  # main(args=...) cannot re-run its command line
QUIET_TRAINER = [
    "--trainer.accelerator=cpu",
    "--trainer.devices=2",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.limit_val_batches=0",
]


def _options(prefix: str, values: dict[str, Any]) -> list[str]:
    return [f"--{prefix}.{key}={value}" for key, value in values.items()]


TINY = _options("model", TINY_MODEL) + _options("data", TINY_DATA)


def _print_config(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    config: dict[str, Any] = yaml.safe_load(capsys.readouterr().out)
    return config


@pytest.mark.parametrize(
    ("args", "schedule", "start_method"),
    [
        ("--trainer.strategy=Pipe2BWStrategy --trainer.strategy.schedule=1f1b", "1f1b", "popen"),
        ("--trainer.strategy.schedule=1f1b", "1f1b", "popen"),  # the default strategy class
        ("--trainer.strategy=pipe2bw --trainer.strategy.schedule=1f1b", "1f1b", "popen"),
        ("--trainer.strategy pipe2bw_gpipe", "gpipe", "popen"),
        ("--trainer.strategy=pipe2bw_spawn", DEFAULT_SCHEDULE, "spawn"),
    ],
)
def test_print_config_lists_the_strategy_options(
    args: str, schedule: str, start_method: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _print_config([*args.split(), "--trainer.strategy.microbatches=4"], capsys)
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_pipe2bw.Pipe2BWStrategy"
    init = strategy["init_args"]
    for key in ("schedule", "microbatches", "flush_every", "balance", "body", "start_method"):
        assert key in init, key
    assert init["schedule"] == schedule
    assert init["start_method"] == start_method
    assert init["microbatches"] == 4
    # the defaults: the package's GPT on its standard-library text
    assert config["model"]["class_path"] == "lightning_pipe2bw.recipes.gpt.GPT"
    assert config["model"]["init_args"]["n_layer"] == 4
    assert config["data"]["class_path"] == "lightning_pipe2bw.recipes.gpt.StdlibTextDataModule"


def test_other_strategy_names_stay_strings(capsys: pytest.CaptureFixture[str]) -> None:
    assert _print_config(["--trainer.strategy=ddp"], capsys)["trainer"]["strategy"] == "ddp"
    argv = ["fit", "--trainer.strategy", "ddp", "--trainer.strategy=pipe2bw_1f1b", "--model.lr=1"]
    expanded = expand_strategy_names(argv)
    assert expanded[:3] + expanded[4:] == argv[:3] + argv[4:]
    name, form = expanded[3].split("=", 1)
    assert name == "--trainer.strategy"
    assert json.loads(form) == {
        "class_path": "lightning_pipe2bw.Pipe2BWStrategy",
        "init_args": {"schedule": "1f1b"},
    }


def test_main_with_args_refuses_a_popen_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # set by the CLI's seed_everything
    args = ["fit", *QUIET_TRAINER, "--trainer.strategy=pipe2bw", *TINY]
    with pytest.raises(ValueError, match="start_method=spawn"):
        main(args)


def test_example_config_trains_the_main_job(capsys: pytest.CaptureFixture[str]) -> None:
    """examples/cli_gpt.yaml parses, and trains the GPT the Hydra main job trains (its
    composed configs/train.yaml): the same schedule, micro-batches, model, optimizer, rates,
    data, length and validation."""
    from hydra import compose, initialize_config_dir

    from lightning_pipe2bw.recipes.gpt.config import register_configs, to_train_config

    example = ROOT / "examples" / "cli_gpt.yaml"
    config = _print_config(["--config", str(example), "--trainer.max_steps=7"], capsys)
    assert config["trainer"]["max_steps"] == 7
    config = _print_config(["--config", str(example)], capsys)
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        main_job = to_train_config(compose(config_name="train"))
    trainer, strategy = config["trainer"], config["trainer"]["strategy"]["init_args"]
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    assert (strategy["schedule"], strategy["microbatches"]) == (
        main_job.strategy.schedule, main_job.strategy.microbatches,
    )  # fmt: skip
    assert (trainer["devices"], trainer["max_steps"], trainer["val_check_interval"]) == (
        main_job.trainer.devices, main_job.trainer.max_steps, main_job.trainer.val_check_interval,
    )  # fmt: skip
    assert config["seed_everything"] == main_job.seed
    for key in ("block_size", "n_layer", "n_head", "n_embd", "lr", "weight_decay",
                "warmup_steps", "optimizer", "adamw_lr", "min_lr_ratio"):  # fmt: skip
        assert model[key] == getattr(main_job.model, key), key
    assert model["max_steps"] == main_job.trainer.max_steps
    for key in ("block_size", "batch_size", "max_bytes", "train_samples", "val_samples", "seed"):
        assert data[key] == getattr(main_job.data, key), key


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("--trainer.strategy.compile_blocks=true", {}),
        (
            "--trainer.strategy.compile_blocks={backend: aot_eager, dynamic: true}",
            {"backend": "aot_eager", "dynamic": True},
        ),
    ],
)
def test_the_cli_takes_compile_blocks(arg: str, expected: dict[str, Any]) -> None:
    """``compile_blocks`` from the command line, as a flag and as torch.compile's keyword
    arguments, reaches the strategy of the Trainer the CLI builds."""
    from lightning_pipe2bw.cli import import_path
    from lightning_pipe2bw.recipes.gpt.cli import GPTCLI
    from lightning_pipe2bw.strategy import Pipe2BWStrategy

    cli = GPTCLI(
        model_class=None,
        datamodule_class=None,
        trainer_defaults={"strategy": {"class_path": import_path(Pipe2BWStrategy)}},
        args=[*QUIET_TRAINER, *TINY, "--trainer.strategy.schedule=1f1b", arg, SPAWN],
        run=False,
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, Pipe2BWStrategy)
    assert strategy.options.compile_blocks == expected
