"""Data parallel x pipeline: ``data_parallel=2`` on 4 processes makes two 2-stage pipelines; each
reads its own half of every global batch and every stage averages its gradients with its replica
before the update. As with Lightning's DDP, the training data are sharded by a seeded, shuffling
``DistributedSampler``; the reference trains on the union of both shards' k-th batches. The contract: the same as one device on the global batch (flush schedules) or
the single-process 2BW reference on it (2bw). Tolerance: max abs parameter difference <= 1e-5
(fp32, CPU) after 4 steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import workers
from helpers.models import (
    dataset,
    max_abs_diff,
    reference_2bw,
    reference_pipedream,
    reference_train,
)
from lightning.pytorch import Callback
from torch.utils.data import DistributedSampler

STEPS = 4  # the 64-sample data set holds 4 global batches of 16
TOL = 1e-5
LOCAL_BATCH = 8  # per replica; the global batch is 16


def _global_batches(replicas: int, local_batch: int) -> list[Any]:
    """The k-th global batch: the k-th batch of every replica's shard, as Lightning samples them
    (``DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED=0)``), concatenated."""
    data = dataset(64)
    shards = [
        list(DistributedSampler(data, num_replicas=replicas, rank=r, shuffle=True, seed=0))
        for r in range(replicas)
    ]
    batches = []
    for k in range(len(shards[0]) // local_batch):
        index = [i for shard in shards for i in shard[k * local_batch : (k + 1) * local_batch]]
        x, y = data[torch.tensor(index)]
        batches.append((x, y))
    return batches


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "2bw", "interleaved-1f1b", "zb-v", "2bw-v"])
def test_two_replicas_of_two_stages_equal_one_device(pools, schedule: str) -> None:
    results = pools(4).run(workers.fit, schedule, 2, STEPS, batch_size=LOCAL_BATCH, data_parallel=2)
    # ranks 0-1 are replica 0 (rank 0 runs the last place), ranks 2-3 replica 1
    assert [r["stage"] for r in results] == [1, 0, 1, 0]
    batches = _global_batches(2, LOCAL_BATCH)
    if schedule in ("2bw", "2bw-v"):
        ref = reference_2bw(STEPS, 4, data=batches)
    else:
        ref, _ = reference_train(STEPS, 4, data=batches)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS dp=2 x pp=2 {schedule}: max|dW| = {diff:.3e}")
    assert diff <= TOL
    # and it is not the result of training on one replica's half alone
    halves = [(x[:LOCAL_BATCH], y[:LOCAL_BATCH]) for x, y in batches]
    if schedule in ("2bw", "2bw-v"):
        half = reference_2bw(STEPS, 2, data=halves)
    else:
        half, _ = reference_train(STEPS, 2, data=halves)
    assert max_abs_diff(results[0]["state"], half) > 100 * TOL


def test_pipedream_with_two_replicas_equals_weight_stashing_on_the_global_batch(pools) -> None:
    """PipeDream updates each stage inside the pipeline, as soon as its last backward of a batch
    is done; the stage's replicas reach that backward at the same point and average their
    gradients there. Each micro-batch's weight version depends on its place in the batch, so the
    reference's micro-batch j is every replica's micro-batch j."""
    m = 2
    results = pools(4).run(
        workers.fit, "pipedream", m, STEPS, batch_size=LOCAL_BATCH, data_parallel=2
    )
    part = LOCAL_BATCH // m
    batches = []
    for x, y in _global_batches(2, LOCAL_BATCH):  # [replica 0's batch, replica 1's batch]
        order = [
            r * LOCAL_BATCH + j * part + i for j in range(m) for r in range(2) for i in range(part)
        ]
        batches.append((x[order], y[order]))
    ref = reference_pipedream(STEPS, m, [4, 4], data=batches)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS dp=2 x pp=2 pipedream: max|dW| = {diff:.3e}")
    assert diff <= TOL
    half = reference_pipedream(
        STEPS,
        m,
        [4, 4],
        data=[(x[:LOCAL_BATCH], y[:LOCAL_BATCH]) for x, y in _global_batches(2, LOCAL_BATCH)],
    )
    assert max_abs_diff(results[0]["state"], half) > 100 * TOL


def _predict_with_replicas() -> str:
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=2, data_parallel=2)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy)
    try:
        trainer.predict(RegressionModel(), loader(8))
    except ValueError as err:
        return str(err)
    return "no error"


def test_predict_with_replicas_is_refused(pools) -> None:
    """Predictions would be split over the replicas and only replica 0's returned: refused."""
    for message in pools(4).run(_predict_with_replicas):
        assert message.startswith("trainer.predict with data_parallel=2 would split the data")


class _FailAtSecondStep(Callback):
    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        if args[-1] == 1:  # batch_idx, on every rank
            raise RuntimeError("failing on purpose")


def _fit_after_a_failed_fit() -> dict[str, Any]:
    try:
        workers.fit(
            "2bw", 2, STEPS, batch_size=LOCAL_BATCH, data_parallel=2,
            trainer_kwargs={"gradient_clip_val": 1.0}, callbacks=[_FailAtSecondStep()],
        )  # fmt: skip
    except RuntimeError as err:
        failed = str(err)
    else:
        failed = ""
    return {
        "failed": failed,
        **workers.fit("2bw", 2, STEPS, batch_size=LOCAL_BATCH, data_parallel=2),
    }


def test_a_fit_after_a_failed_one_in_the_same_processes_trains_exactly(pools) -> None:
    """The process groups live as long as the processes and serve every call; after a call
    that failed (one of its collectives may never have finished) every rank forgets them, and
    the next call makes its own and trains as a first call would."""
    results = pools(4).run(_fit_after_a_failed_fit)
    assert all("failing on purpose" in r["failed"] for r in results), [r["failed"] for r in results]
    ref = reference_2bw(STEPS, 4, data=_global_batches(2, LOCAL_BATCH))
    assert max_abs_diff(results[0]["state"], ref) <= TOL
