"""The main job's Lightning CLI (``python -m lightning_pipe2bw.recipes.gpt.cli``, the library's CLI with the GPT as defaults): strategy options in each form, a
config file, and real two-process fits (popen re-runs the command line; spawn from a config)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import ROOT
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_pipe2bw.recipes.gpt.cli import expand_strategy_names, main
from lightning_pipe2bw.recipes.gpt.model import GPT

TESTS = ROOT / "tests"
TINY_MODEL = {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32}
TINY_DATA = {"block_size": 32, "batch_size": 8, "max_bytes": 200_000, "train_samples": 64}
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


class StageProbe(Callback):
    """Prints what each rank trained: its stage and blocks, the strategy's schedule, the steps."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        body: Any = pl_module.body
        strategy: Any = trainer.strategy
        print(
            f"probe rank {trainer.global_rank}: stage {body.stage} of {body.num_stages}, "
            f"blocks {body.indices}, schedule {strategy.schedule_name}, "
            f"microbatches {strategy.num_microbatches}",
            flush=True,
        )

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        print(f"probe rank {trainer.global_rank}: {trainer.global_step} steps", flush=True)


def _run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # rank 1 re-runs this command line (popen) or unpickles StageProbe (spawn): both import
    # this module, so the tests directory goes on its path
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "lightning_pipe2bw.recipes.gpt.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


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
        ("--trainer.strategy pipe_gpipe", "gpipe", "popen"),
        ("--trainer.strategy=pipe2bw_spawn", "2bw", "spawn"),
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
    argv = ["fit", "--trainer.strategy", "ddp", "--trainer.strategy=pipe_1f1b", "--model.lr=1"]
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


@pytest.mark.timeout(300)
def test_fit_two_stages_from_the_command_line(tmp_path: Path) -> None:
    args = [
        "fit", *QUIET_TRAINER, *TINY,
        "--trainer.strategy=pipe2bw",  # a registered name, with options; popen re-runs argv
        "--trainer.strategy.schedule=1f1b",
        "--trainer.strategy.microbatches=4",
        "--trainer.max_steps=3",
        "--trainer.enable_checkpointing=false",
        "--trainer.callbacks+=unit.test_cli.StageProbe",
    ]  # fmt: skip
    proc = _run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # global rank 0 runs the last stage; the body is Embeddings, Block, Block, LMHead
    out = proc.stdout
    assert "probe rank 0: stage 1 of 2, blocks [2, 3], schedule 1f1b, microbatches 4" in out
    assert "probe rank 1: stage 0 of 2, blocks [0, 1], schedule 1f1b, microbatches 4" in out
    assert "probe rank 0: 3 steps" in out and "probe rank 1: 3 steps" in out


@pytest.mark.timeout(300)
def test_fit_from_a_yaml_config(tmp_path: Path) -> None:
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": {
                "class_path": "Pipe2BWStrategy",
                "init_args": {"schedule": "gpipe", "microbatches": 2, "start_method": "spawn"},
            },
            "max_steps": 100,  # overridden on the command line
            "logger": False,
            "enable_progress_bar": False,
            "limit_val_batches": 0,
            "default_root_dir": str(tmp_path),
            "callbacks": [{"class_path": "unit.test_cli.StageProbe"}],
        },
        "model": {"class_path": "GPT", "init_args": TINY_MODEL},
        "data": {"init_args": TINY_DATA},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = _run_cli(["fit", "--config", str(path), "--trainer.max_steps=2"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "probe rank 0: stage 1 of 2, blocks [2, 3], schedule gpipe, microbatches 2" in out
    assert "probe rank 1: stage 0 of 2, blocks [0, 1], schedule gpipe, microbatches 2" in out
    assert "probe rank 0: 2 steps" in out

    # the config LightningCLI saved is the one that ran
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["trainer"]["strategy"]["init_args"]["schedule"] == "gpipe"
    assert saved["trainer"]["max_steps"] == 2

    # the checkpoint holds the whole model, gathered from both stages, and loads on one device
    (ckpt,) = (tmp_path / "checkpoints").glob("*.ckpt")
    loaded = GPT.load_from_checkpoint(ckpt, map_location="cpu")
    torch.manual_seed(0)  # the run's seed: the weights it started from
    initial = GPT(**TINY_MODEL).state_dict()
    trained = loaded.state_dict()
    assert trained.keys() == initial.keys()
    for name, value in trained.items():  # the steps moved the matrices of both stages
        if value.dim() >= 2:
            assert not torch.equal(value, initial[name]), name


def test_example_config_parses(capsys: pytest.CaptureFixture[str]) -> None:
    example = ROOT / "examples" / "cli_gpt.yaml"
    config = _print_config(["--config", str(example), "--trainer.max_steps=7"], capsys)
    assert config["trainer"]["max_steps"] == 7
    assert config["trainer"]["strategy"]["init_args"]["schedule"] == "2bw"
    assert config["model"]["init_args"]["n_layer"] == 4
