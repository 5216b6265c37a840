"""Blocks the user compiled (``torch.compile(block)``, an ``OptimizedModule`` in the body) train
under every schedule exactly as on one device with the same compiled blocks.

The blocks compile with the ``aot_eager`` backend (``helpers.models.CompiledModel``): AOTAutograd's
compiled forward and backward, the part that meets the pipeline (one autograd node per block,
whose backward computes all the block's gradients in one call), without generating kernels, which
takes tens of seconds a block on this machine. Each rank compiles its own blocks, as the one-device
reference compiles all of them; same kernels on the same shapes, so the tolerance is 0.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import repartition_workers as rw
from helpers import workers
from helpers.models import (
    CompiledModel,
    dataset,
    make_loader,
    max_abs_diff,
    reference_2bw,
    reference_pipedream,
    reference_train,
)
from lightning.pytorch import Callback
from torch._dynamo.utils import counters
from torch.utils.data import DistributedSampler

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


class GraphCounts(Callback):
    """The graphs torch.compile has made on this rank since the fit began, at the end of each
    training epoch (a rank of the pool may have compiled before, in another test)."""

    def __init__(self) -> None:
        self.start = 0
        self.per_epoch: list[int] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.start = int(counters["stats"]["unique_graphs"])

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.per_epoch.append(int(counters["stats"]["unique_graphs"]) - self.start)


def _fit_counting_graphs() -> list[int]:
    counts = GraphCounts()
    # 60 samples in batches of 8: each epoch ends on a batch of 4 (micro-batches of 1 row, not
    # 2), and a validation pass (no autograd) runs after each epoch
    workers.fit(
        "1f1b", M, 3 * 8, model="compiled", samples=60, val_batches=2, callbacks=[counts],
        trainer_kwargs={"max_epochs": 3, "limit_val_batches": 2},
    )  # fmt: skip
    return counts.per_epoch


def test_a_short_last_batch_and_validation_do_not_recompile_every_epoch(pools) -> None:
    """A short last batch and validation give a compiled block new shapes and a forward without
    autograd: torch.compile makes at most a graph for each (the step's shapes, the short
    batch's, validation's), in the first epoch, and none after it (a graph per step would stop
    only at torch.compile's cache limit, 8, and fall back to eager)."""
    results = pools(2).run(_fit_counting_graphs)
    for rank, per_epoch in enumerate(results):
        print(f"COMPILE rank {rank}: graphs made by the end of each epoch {per_epoch}")
        assert len(per_epoch) == 3, per_epoch
        assert per_epoch[0] <= 3 and per_epoch[-1] == per_epoch[0], (rank, per_epoch)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "2bw"])
def test_the_compile_blocks_option_compiles_each_stage_in_place(pools, schedule: str) -> None:
    """``compile_blocks``: each rank compiles its stage's blocks after the split, in place, so the
    weights are those of one device whose blocks are compiled alike, under the model's own keys."""
    options = {"backend": "aot_eager"}
    results = pools(2).run(workers.fit, schedule, M, STEPS, compile_blocks=options)
    if schedule == "2bw":
        ref = reference_2bw(STEPS, M, model_name="compiled-in-place")
    else:
        ref, _ = reference_train(STEPS, M, model_name="compiled-in-place")
    state = results[0]["state"]
    diff = max_abs_diff(state, ref)
    print(f"EXACTNESS compile_blocks {schedule}: max|dW| = {diff:.3e}")
    assert diff == 0.0
    assert "body.1.fc.weight" in state  # the keys of the model as written
    if schedule == "zb-h1":  # the blocks ran compiled: their backward could not be cut
        assert "torch.compile'd blocks" in results[0]["whole_backward_note"]


def test_blocks_that_move_between_stages_arrive_compiled(pools) -> None:
    """Live repartitioning pickles a moving block, which leaves its compiled call behind: the
    stage it arrives at compiles it as its own, and no weight changes."""
    options = {"compile_blocks": {"backend": "aot_eager"}}
    moved = pools(2).run(rw.fit_slow, "1f1b", 6, repartition_every=2, **options)
    fixed = pools(2).run(rw.fit_slow, "1f1b", 6, **options)
    # the slow blocks break their graph (they sleep): the rest of such a block's frame runs
    # under torch.compile's frame hook, and the engine's saved-tensor hooks must not be compiled
    # there (they were, once per storage address guarded on, up to the recompile limit: 18-22
    # frames a rank here instead of 3)
    frames = [r["frames"] for r in moved]
    print(f"COMPILE frames converted per rank, moving: {frames}")
    assert all(f <= 8 for f in frames), frames
    assert moved[0]["repartitions"], "the slow stage was not noticed"
    assert all(r["balance"] == [3, 5] for r in moved)
    for r in moved:
        assert r["compiled"] and all(r["compiled"]), r
    diff = max_abs_diff(moved[0]["state"], fixed[0]["state"])
    print(f"REPARTITION compiled blocks: max|dW| against no repartitioning {diff:.3e}")
    assert diff <= 1e-6


def test_compiled_blocks_with_recompute_ties_and_replicas(pools) -> None:
    """What users combine with compiled blocks: recomputation (the compiled forward runs again
    in the backward), weights tied across stages (each stage's copy compiled in place, their
    gradients summed), and two pipeline replicas (data parallel): each as one device."""
    options = {"compile_blocks": {"backend": "aot_eager"}}
    results = pools(2).run(workers.fit, "1f1b", M, STEPS, recompute=True, model="compiled")
    ref, _ = reference_train(STEPS, M, model_name="compiled")
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS compiled blocks, recompute: max|dW| = {diff:.3e}")
    assert diff == 0.0

    results = pools(2).run(workers.fit, "1f1b", M, STEPS, model="tied", **options)
    assert all(r["tied_copies"] == 1 for r in results)  # a copy on each stage
    ref, _ = reference_train(STEPS, M, model_name="tied")  # eager: aot_eager runs the same ops
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS compile_blocks, tied across stages: max|dW| = {diff:.3e}")
    assert diff <= 1e-6

    local = 4  # two replicas' batches of 4 make the one-device batch of 8
    data = dataset(64)
    shards = [list(DistributedSampler(data, num_replicas=2, rank=r, seed=0)) for r in range(2)]
    batches = []
    for k in range(len(shards[0]) // local):
        x, y = data[torch.tensor([i for s in shards for i in s[k * local : (k + 1) * local]])]
        batches.append((x, y))
    results = pools(4).run(
        workers.fit, "1f1b", 2, STEPS, batch_size=local, data_parallel=2, model="compiled"
    )
    ref, _ = reference_train(STEPS, 4, data=batches, model_name="compiled")
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS compiled blocks, 2 replicas x 2 stages: max|dW| = {diff:.3e}")
    assert diff <= 1e-5  # the replicas' gradients are averaged: another order of sums
