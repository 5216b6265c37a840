"""Blocks the user compiled (``torch.compile(block)``, an ``OptimizedModule`` in the body) train
under every schedule exactly as on one device with the same compiled blocks.

The blocks compile with the ``aot_eager`` backend (``helpers.models.CompiledModel``): AOTAutograd's
compiled forward and backward, the part that meets the pipeline (one autograd node per block,
whose backward computes all the block's gradients in one call), without generating kernels, which
takes tens of seconds a block on this machine. Each rank compiles its own blocks, as the one-device
reference compiles all of them; same kernels on the same shapes, so the tolerance is 0.
"""

from __future__ import annotations

import pytest
from helpers import workers
from helpers.models import (
    CompiledModel,
    make_loader,
    max_abs_diff,
    reference_2bw,
    reference_pipedream,
    reference_train,
)

STEPS, M = 4, 4
# zero bubble's schedules cut a backward in two, 1f1b takes an inputs' gradient early
SPLITTING = ("zb-h1", "zb-v", "dualpipe-v")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved-1f1b", *SPLITTING])
def test_compiled_blocks_train_as_on_one_device(pools, schedule: str) -> None:
    results = pools(2).run(workers.fit, schedule, M, STEPS, model="compiled")
    ref, _ = reference_train(STEPS, M, model_name="compiled")
    state = results[0]["state"]
    diff = max_abs_diff(state, ref)  # the same keys too: the user's, "_orig_mod" included
    print(f"EXACTNESS compiled blocks {schedule}: max|dW| = {diff:.3e}")
    assert diff == 0.0
    assert "body.1._orig_mod.fc.weight" in state
    CompiledModel().load_state_dict(state)  # a checkpoint's weights load on one device
    if schedule in SPLITTING:
        # a stage whose compiled backward would have been cut ran it whole, and said so once
        # (the first stage, which sends no gradient, never cuts)
        notes = [r["whole_backward_note"] for r in results]
        assert any("torch.compile'd blocks" in n for n in notes), notes
        assert all(r["split_backwards"] == 0 for r in results)


@pytest.mark.parametrize("schedule", ["2bw", "2bw-v"])
def test_compiled_blocks_under_2bw_equal_the_delayed_reference(pools, schedule: str) -> None:
    batch = 16  # one epoch of 4 batches (2bw-v: 4 virtual stages of 2 blocks)
    results = pools(2).run(
        workers.fit, schedule, M, STEPS, batch_size=batch, samples=batch * STEPS, model="compiled"
    )
    data = make_loader("compiled", batch, n=batch * STEPS)
    ref = reference_2bw(STEPS, M, batch_size=batch, data=data, model_name="compiled")
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS compiled blocks {schedule}: max|dW| = {diff:.3e}")
    assert diff == 0.0
    assert all(1 <= r["engine_versions"] <= 2 for r in results)


def test_compiled_blocks_under_pipedream_equal_weight_stashing(pools) -> None:
    results = pools(2).run(workers.fit, "pipedream", M, STEPS, model="compiled")
    ref = reference_pipedream(STEPS, M, [4, 4], model_name="compiled")
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS compiled blocks pipedream: max|dW| = {diff:.3e}")
    assert diff <= 1e-6
