"""``early_input_grad`` takes a bool. What it does in training runs:
``tests/ranks/test_early_input_grad.py``."""

from __future__ import annotations

import pytest


def test_the_option_takes_a_bool() -> None:
    from lightning_pipe2bw import Pipe2BWStrategy

    with pytest.raises(TypeError, match="early_input_grad must be True or False, got 'yes'"):
        Pipe2BWStrategy(schedule="1f1b", early_input_grad="yes")  # type: ignore[arg-type]
