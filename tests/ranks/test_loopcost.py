"""The training loop's cost per step and the engine's per action, measured for balance="auto"
by a tiny run in a child process, once per machine (``lightning_pipe2bw/loopcost.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_pipe2bw.loopcost import cache_path, loop_costs


def test_the_loop_costs_are_measured_once_kept_and_measured_again_when_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPE2BW_CACHE_DIR", str(tmp_path))
    path = cache_path()
    assert path == tmp_path / "loop_costs.json"
    path.write_text(json.dumps({"another machine": {"loop_s": 1.0, "action_s": 1.0}}))
    first = loop_costs()  # a real run of Lightning and the strategy in a child process
    # a Lightning step costs a millisecond or a few on a CPU, an engine action tens of us
    assert 1e-5 < first.loop_s < 0.5 and 0.0 <= first.action_s < 0.05, first
    kept = json.loads(path.read_text())
    assert kept["another machine"] == {"loop_s": 1.0, "action_s": 1.0}  # other entries stay
    assert len(kept) == 2
    # read back, not measured again (a second run would not give these floats to the last bit)
    assert loop_costs() == first
    path.write_text("{not json")  # unreadable: measured again and written anew
    again = loop_costs()
    assert again != first and 1e-5 < again.loop_s < 0.5
    (entry,) = json.loads(path.read_text()).values()
    assert entry["loop_s"] == again.loop_s
