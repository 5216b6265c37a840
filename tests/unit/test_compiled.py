"""A LightningModule compiled whole is refused with the way out, before any process starts.
Compiled blocks training under every schedule: ``tests/ranks/test_compiled.py``."""

from __future__ import annotations

import pytest
import torch
from helpers.models import RegressionModel, loader, quiet_trainer

from lightning_pipe2bw import Pipe2BWStrategy


def test_a_lightning_module_compiled_whole_is_refused_with_the_way_out() -> None:
    trainer = quiet_trainer(devices=2, strategy=Pipe2BWStrategy(), max_steps=1)
    compiled = torch.compile(RegressionModel(), backend="aot_eager")
    with pytest.raises(RuntimeError) as info:
        trainer.fit(compiled, loader(8))
    message = str(info.value)
    assert "the LightningModule was compiled whole (torch.compile(model))" in message
    assert "Pipe2BWStrategy(compile_blocks=True)" in message
    assert "torch.compile(block) for each block of the body" in message
