"""BPipe activation balancing's share of evicted activations follows the pair model, and bad
memory options fail at construction. The balancing and the memory plan in training runs:
``tests/ranks/test_balancer.py``."""

from __future__ import annotations

import pytest

from lightning_pipe2bw import Pipe2BWStrategy
from lightning_pipe2bw.callbacks.balancer import ActivationBudget
from lightning_pipe2bw.schedule.offload import evict_share


def test_balanced_share_matches_the_pair_model() -> None:
    # p = 4: stage 0 stashes 4, its partner 1; stage 1 stashes 3, its partner 2
    assert evict_share(ActivationBudget(), 4, 1) == pytest.approx(3 / 7)
    assert evict_share(ActivationBudget(), 3, 2) == pytest.approx(1 / 5)
    assert evict_share(ActivationBudget(microbatches=2.5), 4, 1) == pytest.approx(0.5)
    assert evict_share(ActivationBudget(bytes=250), 4, 1, saved_bytes=100) == pytest.approx(0.5)
    assert evict_share(ActivationBudget(microbatches=8), 4, 1) == 0.0
    assert evict_share(ActivationBudget(microbatches=1), 4, 1) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_plan": {0: "spill"}}, "memory_plan[0] = 'spill' is not a policy"),
        ({"memory_plan": {"first": "swap"}}, "memory_plan key 'first' is not a block index"),
        ({"balance_activations": 0.5}, "budget in micro-batches must be a number >= 1"),
    ],
)
def test_bad_memory_options_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Pipe2BWStrategy(**kwargs)
