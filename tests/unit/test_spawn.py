"""The strategy's registered names. ``Trainer``s that start their own processes
(``pipe2bw_spawn``): ``tests/ranks/test_spawn.py``."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

import lightning_pipe2bw  # noqa: F401  (importing the package registers the names)


def test_names_are_registered() -> None:
    for name in ("pipe2bw", "pipe2bw_spawn", "pipe_gpipe", "pipe_1f1b"):
        assert name in StrategyRegistry, name
    assert StrategyRegistry["pipe_gpipe"]["init_params"] == {"schedule": "gpipe"}
