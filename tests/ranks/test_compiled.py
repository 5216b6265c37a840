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


def _train_on_from(path: str, schedule: str) -> dict[str, Any]:
    """Load a checkpoint's weights into the compiled model (Lightning's ``load_from_checkpoint``)
    and train it on under ``schedule``; the weights, and the pipeline's own checkpoint."""
    import torch.distributed as dist
    from helpers.models import quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    torch.set_num_threads(1)
    model = CompiledModel.load_from_checkpoint(path, map_location="cpu", weights_only=True)
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=M)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=STEPS)
    trainer.fit(model, make_loader("compiled", 8))
    back = path.replace(".ckpt", f"-{schedule}.ckpt")
    trainer.save_checkpoint(back)  # collective: the consolidated file, written by rank 0
    state = strategy.full_state_dict()
    return {"state": state if dist.get_rank() == 0 else None, "path": back}


def _resume_from(path: str) -> str:
    """The error of resuming training (``fit(ckpt_path=path)``) from ``path`` under 1f1b."""
    import torch.distributed as dist
    from helpers.models import quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=STEPS)
    try:
        trainer.fit(CompiledModel(), make_loader("compiled", 8), ckpt_path=path)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_checkpoints_of_compiled_blocks_go_from_one_device_to_the_pipeline_and_back(
    pools, tmp_path, schedule: str
) -> None:
    """Lightning on one device trains the compiled model and saves it; its checkpoint's weights
    (under the user's ``_orig_mod`` keys) load into the model the pipeline then trains on, which
    ends where Lightning on one device ends from the same weights; the pipeline's own checkpoint
    loads back into the compiled model on one device."""
    from helpers.models import quiet_trainer

    torch.manual_seed(0)
    first = quiet_trainer(devices=1, max_steps=2)
    first.fit(CompiledModel(), make_loader("compiled", 8))
    path = tmp_path / "one-device.ckpt"
    first.save_checkpoint(path)
    assert "body.1._orig_mod.fc.weight" in torch.load(path, weights_only=True)["state_dict"]

    results = pools(2).run(_train_on_from, str(path), schedule)
    state = results[0]["state"]
    if schedule == "2bw":  # the delayed rule, from the loaded weights
        start = CompiledModel.load_from_checkpoint(path, map_location="cpu", weights_only=True)
        ref = reference_2bw(STEPS, M, model_name="compiled", start=start.state_dict())
    else:  # Lightning on one device, the whole batch at once
        again = CompiledModel.load_from_checkpoint(path, map_location="cpu", weights_only=True)
        quiet_trainer(devices=1, max_steps=STEPS).fit(again, make_loader("compiled", 8))
        ref = again.state_dict()
    diff = max_abs_diff(state, ref)
    print(f"CHECKPOINT compiled blocks, one device -> {schedule}: max|dW| = {diff:.3e}")
    assert diff <= 1e-5

    back = CompiledModel.load_from_checkpoint(results[0]["path"], weights_only=True)
    assert max_abs_diff(back.state_dict(), state) == 0.0
    if schedule == "1f1b":  # resuming the one-device run's optimizer: refused, with the way out
        for message in pools(2).run(_resume_from, str(path)):
            assert "not written by pipe2bw" in message and "load only the weights" in message
