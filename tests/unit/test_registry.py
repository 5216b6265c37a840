"""The schedule registry (``lightning_pipe2bw.schedule.registry``): every entry's answers agree
with what its generator builds, and no module outside ``schedule/`` decides anything by
comparing a schedule's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import ROOT

from lightning_pipe2bw import Pipe2BWStrategy
from lightning_pipe2bw.schedule import (
    REGISTRY,
    SCHEDULES,
    VIRTUAL_SCHEDULES,
    add_communication,
    schedule_spec,
    simulate,
    validate,
)
from lightning_pipe2bw.schedule.registry import names_where

PACKAGE = ROOT / "lightning_pipe2bw"
NAMES = frozenset(REGISTRY)


def _names_in(node: ast.AST) -> set[str]:
    """The schedule names a comparison's operand spells out: a string, or a tuple, list or set
    of them."""
    if isinstance(node, ast.Constant) and node.value in NAMES:
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names_in(e) for e in node.elts)) if node.elts else set()
    return set()


def _name_comparisons(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line compares with [names]`` for each comparison with schedule names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            names = set().union(*(_names_in(n) for n in (node.left, *node.comparators)))
            if names:
                where = f"{path.relative_to(root)}:{node.lineno}"
                found.append(f"{where} compares with {sorted(names)}")
    return found


def test_no_module_outside_schedule_compares_a_schedule_name() -> None:
    """Every other layer asks the schedule's entry (``ScheduleSpec``) instead."""
    outside = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "schedule"]
    assert len(outside) > 50  # the scan sees the package
    found = [hit for path in sorted(outside) for hit in _name_comparisons(path)]
    assert found == []


def test_the_scan_finds_a_comparison(tmp_path: Path) -> None:
    """The check above can fail: it sees each form a comparison takes."""
    source = tmp_path / "module.py"
    source.write_text(
        "def f(options, name):\n"
        "    a = options.schedule == '2bw'\n"
        "    b = name in ('gpipe', '1f1b')\n"
        "    c = 'zb-v' != name\n"
        "    d = name == 'not-a-schedule'\n"
    )
    assert _name_comparisons(source, tmp_path) == [
        "module.py:2 compares with ['2bw']",
        "module.py:3 compares with ['1f1b', 'gpipe']",
        "module.py:4 compares with ['zb-v']",
    ]


def test_every_schedule_is_one_entry() -> None:
    assert set(SCHEDULES) | set(VIRTUAL_SCHEDULES) == NAMES
    assert not set(SCHEDULES) & set(VIRTUAL_SCHEDULES)
    for name, spec in REGISTRY.items():
        assert spec.name == name
        assert (name in VIRTUAL_SCHEDULES) == spec.virtual
    # the strategy's docstring names every schedule (it once listed 5 of 9)
    doc = Pipe2BWStrategy.__init__.__doc__ or Pipe2BWStrategy.__doc__ or ""
    assert [n for n in REGISTRY if f'``"{n}"``' not in doc] == []
    with pytest.raises(ValueError, match="unknown schedule 'gpip'; valid schedules: 'gpipe', "):
        schedule_spec("gpip")


@pytest.mark.parametrize("name", sorted(NAMES))
def test_an_entry_takes_the_microbatches_its_generator_builds(name: str) -> None:
    """Where the entry says a micro-batch count runs, the generator builds a valid schedule;
    where it says not, the generator refuses too; the planner's reason and the strategy's
    error agree."""
    spec = REGISTRY[name]
    for p in (2, 3, 4):
        for m in range(1, 2 * p + 2):
            problem = spec.microbatch_problem(m, p)
            assert (problem is None) == (spec.microbatch_message(m, p) is None), (p, m)
            if problem is None:
                built = spec.build(p, m)  # 2BW on a V comes with its messages
                validate(built if built.find(lambda a: a.is_comm) else add_communication(built))
            else:
                assert problem.startswith(f"{name} needs m ")
                with pytest.raises(ValueError):
                    spec.build(p, m)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_an_entry_stashes_what_its_schedule_simulates(name: str) -> None:
    """``stashed_microbatches`` (BPipe's shares, the planner's memory) is each stage's
    simulated peak of micro-batches between forward and backward; the schedules without a
    flush over enough batches to reach their steady state."""
    spec = REGISTRY[name]
    for p in (2, 3, 4):
        for m in range(spec.min_microbatches(p), 2 * p + 1):
            built = spec.build(p, m, 2 * p) if spec.asynchronous else spec.build(p, m)
            peaks = simulate(add_communication(built)).peak_activations
            assert peaks == tuple(spec.stashed_microbatches(s, p, m) for s in range(p)), (p, m)


def test_what_each_kind_of_schedule_answers() -> None:
    two_bw, pipedream, gpipe, zb_v = (REGISTRY[n] for n in ("2bw", "pipedream", "gpipe", "zb-v"))
    assert [two_bw.weight_versions(s, 4) for s in range(4)] == [2, 2, 2, 2]
    assert [pipedream.weight_versions(s, 4) for s in range(4)] == [4, 3, 2, 1]
    assert [gpipe.weight_versions(s, 4) for s in range(4)] == [1, 1, 1, 1]
    assert two_bw.one_step_delay and two_bw.takes_predictions and two_bw.asynchronous
    assert pipedream.updates_per_stage and pipedream.takes_corrections
    assert not pipedream.takes_predictions
    assert not gpipe.takes_corrections and gpipe.stashes_everything
    assert two_bw.fresh_last_stage_problem is None
    assert "on a V" in (REGISTRY["2bw-v"].fresh_last_stage_problem or "")
    assert zb_v.placement_for(3) == (0, 1, 2, 2, 1, 0)
    assert REGISTRY["interleaved-1f1b"].placement_for(2) == (0, 1, 0, 1)
    assert REGISTRY["1f1b"].bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert REGISTRY["zb-h1"].bubble_fraction(4, 8) == pytest.approx(1 / 9)
    assert two_bw.bubble_fraction(4, 8) == 0.0
    assert names_where(lambda s: s.one_step_delay) == ("2bw", "2bw-v")
    assert names_where(lambda s: s.updates_per_stage, "or") == "'pipedream'"
    assert names_where(lambda s: s.takes_corrections, "and") == "'2bw', 'pipedream' and '2bw-v'"
