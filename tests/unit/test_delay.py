"""PipeDream-2BW's delay corrections (``delay_correction``, ``lightning_pipe2bw.optim.delay``):
bad ones are refused with the fix, and a spec has one spelling. Each correction against its
single-process reference: ``tests/ranks/test_delay.py``."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_pipe2bw import Pipe2BWStrategy
from lightning_pipe2bw.optim.delay import canonical_correction


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"schedule": "1f1b", "delay_correction": "error_feedback"},
            "schedule='1f1b' flushes the pipeline after every batch, so its gradients are not "
            "delayed and delay_correction='error_feedback' has nothing to correct",
        ),
        (
            {"schedule": "pipedream", "delay_correction": "predict"},
            "needs 2BW's delay of exactly one update",
        ),
        ({"delay_correction": "ef"}, "unknown delay_correction 'ef'; valid: 'auto', 'none'"),
        (
            {"delay_correction": "predict=2"},
            "delay_correction 'predict=2': 'predict' takes no coefficient; only "
            "'error_feedback', 'nesterov' do",
        ),
        (
            {"delay_correction": "error_feedback=-1"},
            "'error_feedback''s coefficient must be a finite number >= 0, got -1.0",
        ),
        (
            {"delay_correction": "error_feedback+error_feedback"},
            "names 'error_feedback' twice",
        ),
        ({"delay_correction": "none+predict"}, "'none' cannot be combined with others"),
    ],
)
def test_bad_corrections_are_refused_with_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Pipe2BWStrategy(**kwargs)


def test_a_spec_has_one_spelling() -> None:
    assert canonical_correction(" error_feedback=0.50 + predict") == "predict+error_feedback=0.5"
    assert Pipe2BWStrategy(delay_correction="error_feedback=1").options.correction == (
        "error_feedback=1.0"
    )
