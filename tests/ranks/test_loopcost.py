"""The training loop's cost per step (on one rank and in a pipeline) and the engine's per action,
measured for balance="auto" by tiny runs in child processes, once per machine
(``lightning_pipe2bw/planner/loopcost.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_pipe2bw.planner.loopcost import _read_cache, _write_cache, cache_path, loop_costs


def test_the_loop_costs_are_measured_once_kept_and_measured_again_when_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPE2BW_CACHE_DIR", str(tmp_path))
    path = cache_path()
    assert path == tmp_path / "loop_costs.json"
    path.write_text(json.dumps({"another machine": {"loop_s": 1.0, "action_s": 1.0}}))
    first = loop_costs()  # real runs of Lightning and the strategy in child processes
    # a Lightning step costs a millisecond or a few on a CPU, an engine action tens of us; a
    # pipeline's step more than one rank's (the step's values cross ranks)
    assert 1e-5 < first.loop_s < 0.5 and 0.0 <= first.action_s < 0.05, first
    assert 1e-5 < first.pipeline_loop_s < 0.5, first
    kept = json.loads(path.read_text())
    assert kept["another machine"] == {"loop_s": 1.0, "action_s": 1.0}  # other entries stay
    assert len(kept) == 2
    # read back, not measured again (a second run would not give these floats to the last bit)
    assert loop_costs() == first
    # an entry written before the pipeline's figure was measured: measured again
    key = next(k for k in kept if k != "another machine")
    del kept[key]["pipeline_loop_s"]
    path.write_text(json.dumps(kept))
    older = loop_costs()
    assert older != first and 1e-5 < older.pipeline_loop_s < 0.5
    assert json.loads(path.read_text())[key]["pipeline_loop_s"] == older.pipeline_loop_s
    # an unreadable file reads as empty (so the figures are measured again, as above) and is
    # written anew whole
    path.write_text("{not json")
    assert _read_cache(path) == {}
    _write_cache(path, {key: {**older._asdict()}})
    assert loop_costs() == older
