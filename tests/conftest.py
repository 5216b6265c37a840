"""Shared fixtures: a seed, and process pools started once per test session."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers.pool import Pools

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def pools() -> Iterator[Pools]:
    """``pools(n)`` is a pool of n gloo ranks, shared by every test of the session."""
    p = Pools()
    yield p
    p.close()


@pytest.fixture(autouse=True)
def seed() -> None:
    torch.manual_seed(0)
