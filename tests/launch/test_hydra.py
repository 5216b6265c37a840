"""The Hydra entry point run as a user runs it: a single run with popen writes its results in one
folder (the documented sweeps, with spawn: ``test_doc_commands.py``). The configs in one
process: ``tests/unit/test_hydra.py``; a typo on the command line:
``tests/unit/test_train_entry.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.launching import run_main_job

from lightning_pipe2bw.train import RESULT_FILE

# the smallest real job: 2 stages of a 4-block GPT, a few steps on a slice of the stdlib
TINY = [
    "model=tiny",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_checkpointing=false",
    "trainer.enable_progress_bar=false",
    "data.max_bytes=200000",
    "data.batch_size=8",
    "data.val_samples=8",
]


@pytest.mark.timeout(300)
def test_a_single_run_keeps_every_rank_in_one_output_dir(tmp_path: Path) -> None:
    """popen re-runs the command for rank 1; Lightning pins its Hydra run dir to rank 0's."""
    run_dir = tmp_path / "run"
    proc = run_main_job([*TINY, "report=false", f"hydra.run.dir={run_dir}"], tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((run_dir / RESULT_FILE).read_text())
    assert result["start_method"] == "popen"
    assert result["steps"] == 3 and result["val_loss"] is not None
    assert (run_dir / "metrics.csv").exists()
    assert (run_dir / "train_ddp_process_1.log").exists()  # rank 1 ran Hydra in the same dir
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # and created no other
    # as quiet as one device: none of the warnings that do not apply to the run
    output = proc.stdout + proc.stderr
    for noise in ("LeafSpec", "sync_dist=True", "exists and is not empty"):
        assert noise not in output, (noise, output[-3000:])
