"""Shared fixtures: a seed, and process pools started once per test session."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from pool import RankPool

torch.set_num_threads(1)


class Pools:
    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def __call__(self, world_size: int) -> RankPool:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size)
        return self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def pools() -> Iterator[Pools]:
    """``pools(n)`` is a pool of n gloo ranks, shared by every test of the session."""
    p = Pools()
    yield p
    p.close()


@pytest.fixture(autouse=True)
def seed() -> None:
    torch.manual_seed(0)
