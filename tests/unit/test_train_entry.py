"""The main job's Hydra entry point (``python -m lightning_pipe2bw.train``) as a command line, in
this process: what fails before anything is launched. Its configs: ``test_hydra.py``; real runs
and sweeps: ``tests/launch/test_hydra.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra

from lightning_pipe2bw.train import main


@pytest.fixture
def no_hydra() -> Iterator[None]:
    """Hydra's main keeps its global state after a failure (it exits from inside): cleared."""
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def test_the_command_line_rejects_a_typo(
    no_hydra: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``python -m lightning_pipe2bw.train strategy.scheduel=1f1b``: it exits non-zero naming the
    key, and writes no results."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr("sys.argv", ["lightning_pipe2bw.train", "strategy.scheduel=1f1b"])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "Key 'scheduel' not in 'StrategyConfig'" in err, err[-2000:]
    assert not any(tmp_path.rglob("*.csv")) and not any(tmp_path.rglob("*.json"))
