"""Fixtures of the one-process tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import ROOT
from hydra import initialize_config_dir

from lightning_pipe2bw.recipes.gpt.config import register_configs


@pytest.fixture(scope="module")
def hydra_init() -> Iterator[None]:
    """Hydra set up on the project's ``configs/`` (compose the main job's configs in a test)."""
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        yield
