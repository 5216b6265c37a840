"""The documentation's option tables agree with the code they describe."""

from __future__ import annotations

import inspect
import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import ROOT

from lightning_pipe2bw import Pipe2BWStrategy
from lightning_pipe2bw.config import StrategyConfig, TrainerConfig
from lightning_pipe2bw.pipeline.optiondocs import BLOCKS, as_rst, rendered
from lightning_pipe2bw.pipeline.optiontable import OPTIONS
from lightning_pipe2bw.recipes.gpt.config import DataConfig, ModelConfig


def _tables(text: str) -> dict[str, dict[str, str]]:
    """``{section heading: {key: default cell}}`` for every ``| key | default | ...`` table."""
    out: dict[str, dict[str, str]] = {}
    section = ""
    for line in text.splitlines():
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        match = re.match(r"\| `([^`]+)` \| ([^|]*) \|", line)
        if match:
            out.setdefault(section, {})[match.group(1)] = match.group(2).strip()
    return out


def _default(field: Any) -> Any:
    return field.default if field.default is not MISSING else field.default_factory()


@pytest.mark.parametrize(
    ("prefix", "schema"),
    [
        ("strategy", StrategyConfig),
        ("model", ModelConfig),
        ("data", DataConfig),
        ("trainer", TrainerConfig),
    ],
)
def test_configuration_reference_matches_the_dataclasses(prefix: str, schema: type) -> None:
    tables = _tables((ROOT / "docs" / "configuration.md").read_text())
    section = next(name for name in tables if name.startswith(prefix + " "))
    documented = tables[section]
    assert list(documented) == [f.name for f in fields(schema)], section
    for f in fields(schema):
        cell = documented[f.name].strip("`")
        assert yaml.safe_load(cell) == _default(f), (section, f.name, cell, _default(f))


def test_the_user_guide_lists_every_strategy_option() -> None:
    tables = _tables((ROOT / "docs" / "user-guide.md").read_text())
    documented = next(t for t in tables.values() if "schedule" in t and "balance" in t)
    params = [
        name
        for name, p in inspect.signature(Pipe2BWStrategy.__init__).parameters.items()
        if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    assert list(documented) == params


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_the_options_tables_are_made_from_the_option_table(name: str) -> None:
    text = (ROOT / name).read_text()
    assert rendered(text, BLOCKS[name](), name) == text, (
        f"{name}'s options table is not what pipeline/optiontable.py says: run `make docs`"
    )


def test_the_strategys_docstring_has_every_options_text() -> None:
    doc = " ".join((Pipe2BWStrategy.__doc__ or "").split())
    for option in OPTIONS:
        assert option.doc, f"option {option.name} has no doc in pipeline/optiontable.py"
        assert f"{option.name}: {' '.join(as_rst(option.doc).split())}." in doc, option.name


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "strategy").glob("*.yaml")))
def test_a_strategy_yaml_carries_only_what_differs_from_the_defaults(path: Path) -> None:
    values = yaml.safe_load(path.read_text())
    defaults = {f.name: _default(f) for f in fields(StrategyConfig)}
    assert values.get("schedule") == path.stem, "the group's option names its schedule"
    unknown = set(values) - set(defaults)
    assert not unknown, f"{path.name}: not options: {sorted(unknown)}"
    same = [k for k, v in values.items() if k != "schedule" and v == defaults[k]]
    assert not same, f"{path.name} restates defaults (drop them): {same}"


def test_the_configuration_reference_names_every_schedule_and_the_main_jobs_default() -> None:
    """docs/configuration.md's groups line lists the strategy group's options as the registry
    has them, in its order, and the default train.yaml composes."""
    from lightning_pipe2bw.schedule import REGISTRY

    text = (ROOT / "docs" / "configuration.md").read_text()
    line = next(line for line in text.splitlines() if line.startswith("Groups: `strategy/`"))
    listed = re.findall(r"`([^`]+)`", line.partition("named as the schedule:")[2].partition("(")[0])
    assert listed == list(REGISTRY)
    defaults = yaml.safe_load((ROOT / "configs" / "train.yaml").read_text())["defaults"]
    main = next(d["strategy"] for d in defaults if isinstance(d, dict) and "strategy" in d)
    assert f"(the main job's default: `{main}`)" in line
