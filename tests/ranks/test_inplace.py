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
from helpers import workers
from helpers.models import max_abs_diff, reference_2bw, reference_train

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
