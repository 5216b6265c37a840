"""Every main-job command of README.md and docs/ that can run on this machine runs as written,
with a few steps (``helpers.doc_commands.FAST``: its own overrides kept, the length and the
data slice set, the output under a temporary folder). The GPU and multi-node ones, and the
``make`` targets: ``tests/unit/test_doc_commands.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.doc_commands import DocCommand, doc_commands, fast_overrides
from helpers.launching import run_main_job

from lightning_pipe2bw.train import RESULT_FILE, SUMMARY_FILE

# one run per distinct command (the bare main job is on three pages), every place it is written
BY_ARGV: dict[tuple[str, ...], list[DocCommand]] = {}
for _command in doc_commands():
    if not _command.is_make and _command.needs_hardware is None:
        BY_ARGV.setdefault(_command.argv, []).append(_command)
RUNNABLE = [places[0] for places in BY_ARGV.values()]


def _sweep_values(command: DocCommand) -> list[list[str]]:
    """Each swept key's values, as Hydra's basic sweeper splits them (commas, quotes kept out)."""
    swept = [o.split("=", 1)[1] for o in command.overrides if "," in o.split("=", 1)[-1]]
    return [value.split(",") for value in swept]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "command", RUNNABLE, ids=[" | ".join(c.where for c in BY_ARGV[c.argv]) for c in RUNNABLE]
)
def test_a_documented_command_runs_as_written(command: DocCommand, tmp_path: Path) -> None:
    args = fast_overrides(command, tmp_path)
    proc = run_main_job(args, tmp_path, timeout=580)
    where = ", ".join(c.where for c in BY_ARGV[command.argv])
    assert proc.returncode == 0, f"{where}: {' '.join(args)}\n{proc.stderr[-4000:]}"
    if "--cfg" in command.overrides:
        assert "strategy:" in proc.stdout and "trainer:" in proc.stdout, proc.stdout
        return
    if command.is_sweep:
        jobs = 1
        for values in _sweep_values(command):
            jobs *= len(values)
        sweep = tmp_path / "multirun"
        results = [json.loads((sweep / str(j) / RESULT_FILE).read_text()) for j in range(jobs)]
        summary = (sweep / SUMMARY_FILE).read_text()
        assert f"Sweep summary ({jobs} runs" in proc.stdout, proc.stdout[-2000:]
        assert summary.count("\n| ") - 1 == jobs, summary  # a row per job under its header
        # a sweep's jobs start their workers from one fork server
        assert all(r["start_method"] == "forkserver" for r in results)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["multirun"]  # and no other folder
    else:
        results = [json.loads((tmp_path / "run" / RESULT_FILE).read_text())]
    for result in results:
        assert result["steps"] == 3, result
        assert result["train_loss"] > 0 and result["val_loss"] > 0, result
