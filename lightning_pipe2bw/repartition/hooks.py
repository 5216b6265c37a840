"""Moving blocks between stages under Lightning: vPipe's live repartitioning at a training batch's
start (``repartition.plan`` decides, ``repartition.migrate`` moves), and the layout a checkpoint
was written with, adopted before its state is loaded.

Blocks move at a flush point, collectively (every rank decides alike from the same measured
costs, or reads the same checkpoint), with the optimizers' and schedulers' state unless a
checkpoint's state is loaded next.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim import Optimizer

from lightning_pipe2bw import compat
from lightning_pipe2bw.checkpoint.format import layout_to_adopt
from lightning_pipe2bw.pipeline.stage_runtime import StageRuntime
from lightning_pipe2bw.repartition.migrate import relayout
from lightning_pipe2bw.repartition.plan import Repartitioner

__all__ = ["checkpoint_layout", "move_blocks", "repartition_at"]

# Lightning's optimizer set-up again, after the blocks moved: the optimizers and schedulers
Rebuild = Callable[[], tuple[list[Optimizer], list[Any]]]


def repartition_at(
    step: int,
    repartitioner: Repartitioner,
    runtime: StageRuntime,
    flush: Callable[[], None],
    move: Callable[[Sequence[int]], None],
    global_rank: int,
) -> None:
    """At the start of training step ``step``: when ``repartitioner`` decides for another split,
    ``flush`` (2BW: drain first; a no-op after a flush, and for flush schedules) and ``move``
    the blocks to it, and keep the decision in its history."""
    decision = repartitioner.poll(step, runtime.engine, runtime.partition.balance)
    if decision is None:
        return
    flush()
    if global_rank == 0:
        rank_zero_info(f"pipe2bw: repartition at step {step}: {decision.describe()}")
    move(decision.best)
    repartitioner.history.append(decision)


def move_blocks(
    runtime: StageRuntime,
    balance: Sequence[int],
    optimizers: Sequence[Any],
    schedulers: Sequence[LRSchedulerConfig],
    rebuild: Rebuild | None,
) -> list[Optimizer] | None:
    """Make the pipeline run ``balance`` (collective; at a flush point), carrying the state of
    ``optimizers`` (Lightning's, possibly wrapped) and of the ``schedulers`` (none: nothing to
    carry), then ``rebuild`` them (None: not fitting); see ``repartition.migrate``. The optimizers
    Lightning steps from then on, or None when they stay."""
    return relayout(
        runtime,
        balance,
        [compat.torch_optimizer(o) for o in optimizers],
        [c.scheduler for c in schedulers],
        rebuild,
    )


def checkpoint_layout(
    state: Mapping[str, Any] | None, runtime: StageRuntime | None, fixed: bool
) -> Sequence[int] | None:
    """The blocks-per-stage layout a checkpoint's ``state`` was written with, when the pipeline
    must move to it (``fixed``: the user gave a balance), told on rank 0; else None."""
    saved = layout_to_adopt(state, runtime, fixed) if runtime is not None else None
    if saved is None or runtime is None:
        return None
    rank_zero_info(
        f"pipe2bw: the checkpoint was written with balance={list(saved)}; moving blocks from "
        f"{list(runtime.partition.balance)} to it"
    )
    return saved
