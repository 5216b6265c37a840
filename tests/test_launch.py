"""The strategy starts its own processes (``popen``, like ``ddp``) and also runs under torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_popen_launch_trains_and_writes_consolidated_checkpoint(tmp_path: Path) -> None:
    ckpt, weights = tmp_path / "final.ckpt", tmp_path / "weights.pt"
    cmd = [sys.executable, str(EXAMPLE), "--steps", "6", "--ckpt", str(ckpt), "--weights", str(weights)]
    proc = _run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final metrics" in proc.stdout
    # each rank runs one stage with cores // local ranks intra-op threads (at least one)
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert f"rank 1: stage 0 of 2, blocks [0, 1, 2, 3], threads {threads}" in proc.stdout
    assert f"rank 0: stage 1 of 2, blocks [4, 5, 6, 7, 8], threads {threads}" in proc.stdout
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from train import Classifier  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    model = Classifier.load_from_checkpoint(str(ckpt), map_location="cpu")
    fresh = Classifier()
    assert model.state_dict().keys() == fresh.state_dict().keys()
    # six optimizer steps moved every block's weights (every stage's part was gathered)
    for name, value in model.state_dict().items():
        if name.endswith("weight"):
            assert not torch.equal(value, fresh.state_dict()[name]), name
    # and the launching process's own model.state_dict() after fit is the whole trained model
    saved = torch.load(weights, weights_only=True)
    assert saved.keys() == fresh.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(saved[name], value), name


def test_torchrun_launch(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={_free_port()}", str(EXAMPLE), "--steps", "4",
    ]  # fmt: skip
    proc = _run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final metrics" in proc.stdout
