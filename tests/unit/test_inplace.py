"""A stage whose first block acts in place, recomputed: a region runs on a copy of its input only
if its first forward modified the input. The stages and profiles in training runs:
``tests/ranks/test_inplace.py``."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn


class _ModifiesOnSecondCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == 3:  # the second micro-batch's forward (the first one's recomputation is 2)
            x += 1.0
        return x * 2.0


def test_recompute_copies_only_regions_that_modify_their_input() -> None:
    """A recomputed region runs on a copy of its input only if its first forward modified the
    input in place; a region that did not, and later does, raises instead of recomputing from
    a modified input."""
    from lightning_pipe2bw.runtime.inplace import writable
    from lightning_pipe2bw.runtime.stage import StageBody

    body = StageBody([(2, nn.ReLU(inplace=True)), (3, nn.Linear(4, 4))], 1, 2, recompute=True)
    x = torch.randn(3, 4, requires_grad=True)
    same = x.detach().clone().requires_grad_()
    body.block(3)(torch.relu(same)).sum().backward()
    body.run_blocks(writable(x)).sum().backward()
    assert body.recomputation.modifies_input == {(2, 3): True}
    assert x.grad is not None and torch.equal(x.grad, same.grad)

    late = StageBody([(0, _ModifiesOnSecondCall()), (1, nn.Linear(4, 4))], 1, 2, recompute=True)
    y = torch.randn(3, 4, requires_grad=True)
    late.run_blocks(writable(y)).sum().backward()
    assert late.recomputation.modifies_input == {(0, 1): False}
    with pytest.raises(RuntimeError, match="which they did not do in their first recomputed"):
        late.run_blocks(writable(torch.randn(3, 4, requires_grad=True)))
