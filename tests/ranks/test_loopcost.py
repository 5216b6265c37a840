"""The training loop's cost per step (on one rank and in a pipeline) and the engine's per action,
measured for balance="auto" by tiny runs in child processes, once per machine
(``lightning_pipe2bw/planner/loopcost.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_pipe2bw.planner.loopcost import (
    _key,
    _read_cache,
    _write_cache,
    cache_path,
    loop_costs,
)


def test_the_loop_costs_are_measured_once_kept_and_measured_again_when_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One real measurement (three child processes): an entry of this machine without one of
    the figures (written by an older version) is measured again; the figures are kept beside
    other machines' entries, read back without measuring, and an unreadable file reads as empty."""
    monkeypatch.setenv("PIPE2BW_CACHE_DIR", str(tmp_path))
    path = cache_path()
    assert path == tmp_path / "loop_costs.json"
    key = _key()
    # an entry of this machine from before the pipeline's figure was measured: stale
    stale = {"loop_s": 1.0, "action_s": 1.0, "measured": "2025-01-01T00:00:00"}
    path.write_text(json.dumps({"another machine": {"loop_s": 1.0, "action_s": 1.0}, key: stale}))
    first = loop_costs()  # real runs of Lightning and the strategy in child processes
    # a Lightning step costs a millisecond or a few on a CPU, an engine action tens of us; a
    # pipeline's step more than one rank's (the step's values cross ranks)
    assert 1e-5 < first.loop_s < 0.5 and 0.0 <= first.action_s < 0.05, first
    assert 1e-5 < first.pipeline_loop_s < 0.5, first
    kept = json.loads(path.read_text())
    assert kept["another machine"] == {"loop_s": 1.0, "action_s": 1.0}  # other entries stay
    assert set(kept) == {"another machine", key}
    assert kept[key]["pipeline_loop_s"] == first.pipeline_loop_s
    assert kept[key]["measured"] != stale["measured"]
    # read back, not measured again (a second run would not give these floats to the last bit)
    assert loop_costs() == first
    # an unreadable file reads as empty (so the figures are measured again, as above) and is
    # written anew whole
    path.write_text("{not json")
    assert _read_cache(path) == {}
    _write_cache(path, {key: {**first._asdict()}})
    assert loop_costs() == first
