"""``data_parallel`` must be a positive int. Replicas of a pipeline in training runs:
``tests/ranks/test_data_parallel.py``."""

from __future__ import annotations

import pytest


def test_data_parallel_must_divide_the_devices() -> None:
    from lightning_pipe2bw import Pipe2BWStrategy

    with pytest.raises(ValueError, match="data_parallel must be a positive int"):
        Pipe2BWStrategy(data_parallel=0)
