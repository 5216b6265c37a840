"""The main job's Lightning CLI (``python -m lightning_pipe2bw.recipes.gpt.cli``) run as a user
runs it: a real two-process fit from a config file and the command line (popen re-runs the
command line). Its options and config in one process: ``tests/unit/test_cli.py``; launching
by spawn: ``tests/launch/test_hydra.py``'s sweep and ``tests/ranks/test_spawn.py``."""

from __future__ import annotations

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
from unit.test_cli import TINY_DATA, TINY_MODEL

from lightning_pipe2bw.recipes.gpt.model import GPT

TESTS = ROOT / "tests"


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


@pytest.mark.timeout(300)
def test_fit_from_a_yaml_config_and_the_command_line(tmp_path: Path) -> None:
    """A config file with the strategy's class and options, options on the command line over
    it, and the strategy's own launch (popen): rank 1 re-runs the command line, so both ranks
    parse the same config and train the same pipeline."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": {
                "class_path": "Pipe2BWStrategy",
                "init_args": {"schedule": "1f1b", "microbatches": 2},  # popen, by default
            },
            "max_steps": 100,  # overridden on the command line
            "logger": False,
            "enable_progress_bar": False,
            "limit_val_batches": 0,
            "default_root_dir": str(tmp_path),
            "callbacks": [{"class_path": "launch.test_cli.StageProbe"}],
        },
        "model": {"class_path": "GPT", "init_args": TINY_MODEL},
        "data": {"init_args": TINY_DATA},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    overrides = ["--trainer.max_steps=2", "--trainer.strategy.schedule=gpipe"]
    proc = _run_cli(["fit", "--config", str(path), *overrides], tmp_path)
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
