"""A rank that cannot go on stops every rank of the pool, with an error that names it: ranks set
up differently are refused at set-up, and input one stage refuses stops the other; and
``PIPE2BW_DEBUG=1`` logs every action. Ranks that raise, are killed or hang in real launched
runs: ``tests/launch/test_faults.py``."""

from __future__ import annotations

from typing import Any

import pytest


def _fit_with_rank_dependent_options(option: str) -> str:
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    rank = dist.get_rank()
    kwargs: dict[str, object] = {"microbatches": 2}
    if option == "schedule":
        kwargs["schedule"] = ["2bw", "1f1b"][rank]
    elif option == "microbatches":
        kwargs["microbatches"] = [2, 4][rank]
    elif option == "balance":
        kwargs["balance"] = [[4, 4], [3, 5]][rank]
    trainer = quiet_trainer(
        devices=dist.get_world_size(), strategy=Pipe2BWStrategy(**kwargs), max_steps=2
    )
    try:
        trainer.fit(RegressionModel(), loader(8))
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    ("option", "listed"),
    [
        ("schedule", "schedule (rank 0: '2bw', rank 1: '1f1b')"),
        ("microbatches", "microbatches (rank 0: 2, rank 1: 4)"),
        ("balance", "balance (rank 0: (4, 4), rank 1: (3, 5))"),
    ],
)
def test_ranks_set_up_differently_are_refused(pools: Any, option: str, listed: str) -> None:
    """A mismatch that would deadlock the schedule is caught at set-up, on every rank."""
    for message in pools(2).run(_fit_with_rank_dependent_options, option, timeout=60):
        assert message.startswith("the ranks of this pipeline were set up differently"), message
        assert listed in message, message


def _fit_with_debug_log() -> list[str]:
    import logging
    import os

    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("lightning_pipe2bw.actions")
    handler = Collect()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    os.environ["PIPE2BW_DEBUG"] = "1"
    try:
        trainer = quiet_trainer(
            devices=dist.get_world_size(),
            strategy=Pipe2BWStrategy(schedule="1f1b", microbatches=2),
            max_steps=2,
        )
        trainer.fit(RegressionModel(), loader(8))
    finally:
        del os.environ["PIPE2BW_DEBUG"]
        logger.removeHandler(handler)
    return messages


def test_debug_mode_logs_every_action(pools: Any) -> None:
    """PIPE2BW_DEBUG=1: each action's start and end, with rank, stage, micro-batch and time."""
    for rank, messages in enumerate(pools(2).run(_fit_with_debug_log)):
        stage = 1 - rank
        starts = [m for m in messages if " start " in m]
        ends = [m for m in messages if " end " in m]
        # 1F1B with 2 micro-batches: 2 forwards, 2 backwards and 4 transfers per step, 2 steps;
        # on the last stage early_input_grad cuts each step's last backward into an I and a W
        actions = 16 if stage == 0 else 18
        assert len(starts) == len(ends) == actions, messages
        assert all(m.startswith(f"rank {rank} stage {stage} ") for m in messages)
        first = f"{stage}F0" if stage == 0 else f"{stage}RECV_F0"  # the last stage waits first
        assert f"rank {rank} stage {stage} start {first} (micro-batch 0) t=" in messages[0]
        assert messages[-1].startswith(f"rank {rank} stage {stage} end ")


def _fit_with_bad_input(case: str) -> None:
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    class DetachedLoss(RegressionModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return super().training_step(batch, batch_idx).detach()

    rank = dist.get_rank()
    model = DetachedLoss() if case == "detached_loss" else RegressionModel()
    batch_size = [8, 6][rank] if case == "different_batches" else 8
    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule="1f1b", microbatches=2),
        max_steps=2,
    )
    # the error leaves the task, as it leaves a real run: the pool then starts fresh ranks, since
    # the failed run left messages in flight on the process group it shared with later tests
    trainer.fit(model, loader(batch_size))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "different_batches",
            "ValueError: the ranks read different batches: stage 0 split micro-batch 0 into "
            "tensors of shapes [(3, 6), (3, 3)], this stage (1) into [(4, 6), (4, 3)]",
        ),
        ("detached_loss", "ValueError: the loss of micro-batch 0 does not require grad"),
    ],
)
def test_bad_input_fails_on_the_stage_that_sees_it(pools: Any, case: str, message: str) -> None:
    """The last stage (rank 0) raises the error; the first stage (rank 1) stops with a
    StageFailure that carries it, instead of waiting for gradients that never come."""
    from helpers.pool import TaskError

    with pytest.raises(TaskError) as info:
        pools(2).run(_fit_with_bad_input, case, timeout=60)
    text = str(info.value)
    assert info.value.reason.startswith("_fit_with_bad_input failed on ranks [0, 1]"), text
    rank0, rank1 = text.split("--- rank 1 ---")
    assert message in rank0, rank0[-2000:]
    assert "StageFailure: rank 0 (stage 1) failed in action 1" in rank1, rank1[-2000:]
    assert message.split(": ", 1)[1] in rank1, rank1[-2000:]
