"""Shared fixtures (a seed, and process pools started once per test session) and a marker per
kind of test, from the folder it is in (the helpers package is on the path by pytest's
``pythonpath`` setting, in pyproject.toml):

- ``tests/unit``: one process, no pool of ranks, nothing launched (``-m unit``);
- ``tests/ranks``: ranks of the session's pool, or ranks a ``Trainer`` spawns (``-m ranks``);
- ``tests/launch``: real processes launched as a user launches them (``-m launch``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.pool import Pools

torch.set_num_threads(1)

# what balance="auto" measures once per machine (lightning_pipe2bw/planner/loopcost.py) is kept with the tests'
# cache, not in the user's: a clean checkout measures it once, in its first auto plan
os.environ.setdefault(
    "PIPE2BW_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "pipe2bw")
)

TESTS = Path(__file__).resolve().parent
KINDS = ("unit", "ranks", "launch")  # registered in pyproject.toml's [tool.pytest.ini_options]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its kind, the name of the folder it is in under ``tests/``."""
    for item in items:
        path = Path(item.path).resolve()
        if path.is_relative_to(TESTS) and (kind := path.relative_to(TESTS).parts[0]) in KINDS:
            item.add_marker(kind)


@pytest.fixture(scope="session")
def pools() -> Iterator[Pools]:
    """``pools(n)`` is a pool of n gloo ranks, shared by every test of the session."""
    p = Pools()
    yield p
    p.close()


@pytest.fixture(autouse=True)
def seed() -> None:
    torch.manual_seed(0)
