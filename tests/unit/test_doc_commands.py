"""Every documented command that cannot run here (a GPU, several machines) builds a valid
configuration, and every documented ``make`` target exists. The commands that run here run in
``tests/launch/test_doc_commands.py``; both read them with ``helpers.doc_commands``."""

from __future__ import annotations

import subprocess

import pytest
from helpers import ROOT
from helpers.doc_commands import DocCommand, doc_commands, overrides_with
from hydra import compose

from lightning_pipe2bw.recipes.gpt.config import (
    build_strategy,
    check_config,
    to_train_config,
)

COMMANDS = doc_commands()
ELSEWHERE = [c for c in COMMANDS if not c.is_make and c.needs_hardware]
MAKE = [c for c in COMMANDS if c.is_make]
# what tells the reader a command is checked, not run (within a few lines of it)
MARK = "not run by the tests"


def test_the_documented_commands_are_found() -> None:
    # the pages' known commands, so that a change to the reader cannot quietly find none
    pages = {c.where.split(":")[0] for c in COMMANDS}
    assert {"README.md", "docs/configuration.md", "docs/gpus.md", "docs/launching.md"} <= pages
    assert any(c.argv == ("make", "train") for c in COMMANDS)
    assert any(c.launcher == "srun" for c in COMMANDS)
    assert any(c.is_sweep for c in COMMANDS)


@pytest.mark.parametrize("command", ELSEWHERE, ids=str)
def test_a_command_for_other_hardware_builds_a_valid_config(
    hydra_init: None, command: DocCommand
) -> None:
    """What such a command's processes would build before they meet: the composed config, its
    consistency (stages against blocks, micro-batches) and the strategy."""
    cfg = to_train_config(compose(config_name="train", overrides=command.overrides))
    check_config(cfg)
    strategy = build_strategy(cfg.strategy)
    assert strategy.schedule_name == cfg.strategy.schedule
    if command.launcher is not None:  # the launcher's ranks are the Trainer's
        flags = dict(a.lstrip("-").split("=", 1) for a in command.argv if a.startswith("--n"))
        if "nnodes" in flags:
            assert int(flags["nnodes"]) == cfg.trainer.num_nodes, command
            assert int(flags["nproc_per_node"]) == cfg.trainer.devices, command
    page, line = command.where.split(":")
    near = (ROOT / page).read_text().splitlines()[max(int(line) - 10, 0) : int(line) + 8]
    assert any(MARK in text for text in near), f"{command}: say it is {MARK!r} in the docs"


def test_the_config_check_catches_a_command_gone_wrong(hydra_init: None) -> None:
    # the check above can fail: the GPU command with the blocks of the default model
    gpu = next(c for c in ELSEWHERE if c.needs_hardware == "a GPU")
    wrong = overrides_with(gpu.overrides, {"model.n_layer": "4"})
    with pytest.raises(ValueError, match="model has only 6 blocks"):
        check_config(to_train_config(compose(config_name="train", overrides=wrong)))


@pytest.mark.parametrize("command", MAKE, ids=str)
def test_a_documented_make_target_exists(command: DocCommand) -> None:
    # make test is what CI runs (.ci/run), make train the bare main job that
    # tests/launch/test_doc_commands.py runs; here: that the target is there (a dry run)
    proc = subprocess.run(
        ["make", "-n", *command.overrides], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, f"{command}: {proc.stderr}"


def test_make_train_is_the_main_job() -> None:
    proc = subprocess.run(["make", "-n", "train"], cwd=ROOT, capture_output=True, text=True)
    assert "-m lightning_pipe2bw.train" in proc.stdout, proc.stdout
