"""A stage whose first block acts in place on the activation it received.

torchvision-style CNNs put ``nn.ReLU(inplace=True)`` (or ``x += residual``) right after a
possible cut. A received activation is a leaf that requires grad, which autograd forbids to
modify in place: the stage runs its blocks on an alias of it that autograd lets them modify,
and the gradient still reaches the received tensor (the one sent upstream). The profiler of
``balance="auto"`` runs every block on such an input too. Tolerance: max abs difference of
weights and buffers (batch norm's running statistics included) <= 1e-5 against the
single-device references (tests/helpers/models.py), fp32 CPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers import workers
from helpers.models import max_abs_diff, reference_2bw, reference_train
from torch import Tensor, nn

STEPS = 3


@pytest.mark.parametrize(
    ("schedule", "balance"),
    [
        ("1f1b", [2, 6]),  # stage 1 starts with nn.ReLU(inplace=True)
        ("2bw", [2, 6]),
        ("1f1b", [5, 3]),  # stage 1 starts with `x += shift`, which is not idempotent
    ],
)
def test_a_stage_may_start_with_an_in_place_block(pools, schedule: str, balance: list[int]) -> None:
    results = pools(2).run(workers.fit, schedule, 4, STEPS, model="conv", balance=balance)
    if schedule == "2bw":
        ref = reference_2bw(STEPS, 4, model_name="conv")
    else:
        ref = reference_train(STEPS, 4, model_name="conv")[0]
    state = results[0]["state"]
    print(
        f"IN PLACE {schedule} {balance}: max|dW| and buffers vs reference {max_abs_diff(state, ref):.3e}"
    )
    assert max_abs_diff(state, ref) <= 1e-5
    assert int(state["body.1.num_batches_tracked"]) == STEPS * 4


def test_auto_profiles_in_place_blocks(pools) -> None:
    """The profiler runs every block, the in-place ones included, on a received-like input; it
    leaves the model's buffers as they were (the run equals the reference, running statistics
    and ``num_batches_tracked`` included)."""
    results = pools(2).run(workers.fit, "1f1b", 4, STEPS, model="conv", balance="auto")
    ref = reference_train(STEPS, 4, model_name="conv")[0]
    state = results[0]["state"]
    assert max_abs_diff(state, ref) <= 1e-5
    assert int(state["body.1.num_batches_tracked"]) == STEPS * 4


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
    assert body._modifies_input == {(2, 3): True}
    assert x.grad is not None and torch.equal(x.grad, same.grad)

    late = StageBody([(0, _ModifiesOnSecondCall()), (1, nn.Linear(4, 4))], 1, 2, recompute=True)
    y = torch.randn(3, 4, requires_grad=True)
    late.run_blocks(writable(y)).sum().backward()
    assert late._modifies_input == {(0, 1): False}
    with pytest.raises(RuntimeError, match="which they did not do in their first recomputed"):
        late.run_blocks(writable(torch.randn(3, 4, requires_grad=True)))
