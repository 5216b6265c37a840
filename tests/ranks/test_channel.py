"""The last stage's step values reach the other ranks without a barrier, in order; decisions
taken from logged metrics follow global rank 0 (the last stage)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest


def report(i: int) -> dict[str, Any]:
    """Report ``i``: from a few bytes to more than one first message holds (FIRST_BYTES)."""
    return {"step": i, "logs": [("loss", float(i))], "blob": "x" * (2500 * i)}


def _post_before_anyone_listens(n: int) -> list[Any]:
    import torch.distributed as dist

    from lightning_pipe2bw.runtime.channel import ObjectChannel

    channel = ObjectChannel(source=0, group=dist.new_group(backend="gloo"))
    received: list[Any] = []
    if channel.is_source:
        for i in range(n):
            channel.post(report(i))
        # the receivers reach this barrier before they post a single receive: had a post waited
        # for its receiver, the source would never get here and the run would time out
        dist.barrier()
    else:
        dist.barrier()
        for _ in range(n):
            channel.expect()
        received = [channel.receive() for _ in range(n - 1)]  # the last one stays owed
    channel.drain()  # settles the owed report on the receivers and the sends on the source
    return [channel.backlog, received]


@pytest.mark.parametrize("world", [2, 3])
def test_reports_arrive_in_order_and_never_block_the_source(pools: Any, world: int) -> None:
    n = 5
    results = pools(world).run(_post_before_anyone_listens, n)
    assert results[0] == [0, []]
    for backlog, received in results[1:]:
        assert backlog == 0
        assert received == [report(i) for i in range(n - 1)]


def _expect_before_the_source_posts(n: int) -> list[Any]:
    """The receivers post every report's receive before the source sends a single one (as the
    flush schedules' ranks do at the start of a step); one report is received per step."""
    import torch.distributed as dist

    from lightning_pipe2bw.runtime.channel import FIRST_BYTES, ObjectChannel

    channel = ObjectChannel(source=0, group=dist.new_group(backend="gloo"))
    received: list[Any] = []
    for i in range(n):
        if not channel.is_source:
            channel.expect()
        dist.barrier()  # every receive of report i is posted before it is sent
        if channel.is_source:
            channel.post(report(i))
        else:
            received.append(channel.receive())
    channel.drain()
    return [FIRST_BYTES, received]


@pytest.mark.parametrize("world", [2, 3])
def test_reports_expected_before_they_are_posted(pools: Any, world: int) -> None:
    n = 4
    results = pools(world).run(_expect_before_the_source_posts, n)
    first_bytes = results[0][0]
    sizes = [len(pickle.dumps(report(i), protocol=pickle.HIGHEST_PROTOCOL)) for i in range(n)]
    assert min(sizes) < first_bytes - 8 < max(sizes)  # whole in the first message, and not
    for _, received in results[1:]:
        assert received == [report(i) for i in range(n)]


def _tensors() -> dict[str, Any]:
    """Tensors of every kind a report carries: dtypes numpy lacks, views, empty, 0-d, NaN."""
    import torch

    g = torch.Generator().manual_seed(3)
    return {
        "loss": torch.tensor(0.1234567890123, dtype=torch.float64),
        "nan": torch.tensor(float("nan")),
        "flag": torch.tensor(True),
        "half": torch.randn(3, 5, generator=g).bfloat16(),
        "view": torch.randn(4, 6, generator=g).t()[1:, ::2],  # not contiguous, with an offset
        "empty": torch.empty(0, 3, dtype=torch.int32),
        "states": [
            torch.arange(5, dtype=torch.int64),
            torch.randn(2, generator=g).to(torch.complex64),
        ],
        "param": torch.nn.Parameter(torch.ones(2)),  # arrives detached
    }


def _tensors_round_trip() -> list[Any]:
    import torch.distributed as dist

    from lightning_pipe2bw.runtime.channel import ObjectChannel

    channel = ObjectChannel(source=0, group=dist.new_group(backend="gloo"))
    if channel.is_source:
        channel.post(_tensors())
        channel.drain()
        return []
    channel.expect()
    got = channel.receive()
    channel.drain()
    return [got]


def test_tensors_arrive_bitwise_with_their_dtype_and_shape(pools: Any) -> None:
    import torch
    from torch.utils import _pytree as pytree

    sent = pytree.tree_leaves(_tensors())
    (got,) = pools(2).run(_tensors_round_trip)[1]
    received = pytree.tree_leaves(got)
    assert len(received) == len(sent)
    for a, b in zip(sent, received, strict=True):
        assert type(b) is torch.Tensor and not b.requires_grad
        assert (b.dtype, b.shape) == (a.dtype, a.shape)
        # the same bytes (NaN included, where equal() would fail)
        raw = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(raw[0], raw[1])


def _receive_unannounced() -> str:
    import torch.distributed as dist

    from lightning_pipe2bw.runtime.channel import ObjectChannel

    channel = ObjectChannel(source=0, group=dist.new_group(backend="gloo"))
    try:
        channel.receive()
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_receive_without_expect_is_an_error(pools: Any) -> None:
    for message in pools(2).run(_receive_unannounced):
        assert "no report is owed" in message


def _decisions(schedule: str) -> list[bool]:
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer
    from lightning.pytorch import Callback

    from lightning_pipe2bw import Pipe2BWStrategy

    decisions: list[bool] = []

    class Decide(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            # every rank proposes something different; all must end with rank 0's proposal
            mine = (trainer.global_rank + trainer.global_step) % 2 == 0
            decisions.append(trainer.strategy.reduce_boolean_decision(mine))

    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule=schedule, microbatches=2),
        max_steps=4,
        callbacks=[Decide()],
    )
    trainer.fit(RegressionModel(), loader(8))
    return decisions


def test_decisions_follow_global_rank_zero(pools: Any) -> None:
    rank0, rank1 = pools(2).run(_decisions, "2bw")
    # rank 0 proposes True at even steps (global_step 1..4 at batch end), rank 1 the opposite
    assert rank0 == rank1 == [False, True, False, True]
