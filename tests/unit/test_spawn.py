"""The strategy's registered names. ``Trainer``s that start their own processes
(``pipe2bw_spawn``): ``tests/ranks/test_spawn.py``."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

import lightning_pipe2bw  # noqa: F401  (importing the package registers the names)


def test_names_are_registered() -> None:
    """One pattern: ``pipe2bw``, ``pipe2bw_spawn`` and ``pipe2bw_<schedule>`` for every
    schedule of the registry, named as it is registered."""
    from lightning_pipe2bw.schedule import REGISTRY

    ours = {name for name in StrategyRegistry if name.startswith("pipe")}
    assert ours == {"pipe2bw", "pipe2bw_spawn", *(f"pipe2bw_{name}" for name in REGISTRY)}
    for name in REGISTRY:
        assert StrategyRegistry[f"pipe2bw_{name}"]["init_params"] == {"schedule": name}
    assert StrategyRegistry["pipe2bw"]["init_params"] == {}
    assert StrategyRegistry["pipe2bw_spawn"]["init_params"] == {"start_method": "spawn"}
