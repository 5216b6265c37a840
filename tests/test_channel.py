"""The last stage's step values reach the other ranks without a barrier, in order; decisions
taken from logged metrics follow global rank 0 (the last stage)."""

from __future__ import annotations

from typing import Any

import pytest


def _post_before_anyone_listens(n: int) -> list[Any]:
    import torch.distributed as dist

    from lightning_pipe2bw.runtime.channel import ObjectChannel

    channel = ObjectChannel(source=0, group=dist.new_group(backend="gloo"))
    received: list[Any] = []
    if channel.is_source:
        for i in range(n):
            channel.post({"step": i, "logs": [("loss", float(i))]})
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
        assert received == [{"step": i, "logs": [("loss", float(i))]} for i in range(n - 1)]


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
    from lightning.pytorch import Callback
    from models import RegressionModel, loader, quiet_trainer

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
