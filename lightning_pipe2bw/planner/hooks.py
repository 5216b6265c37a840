"""``balance="auto"`` under Lightning: the plan made at set-up from the training dataloader
(``planner.autoplan``), and the plan's predicted throughput compared with the run's.

Every rank gets rank 0's profile, so every rank applies the same plan; it is logged on rank 0
(on the ``lightning_pipe2bw.strategy`` logger) and saved in checkpoints (``strategy.plan``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info

from lightning_pipe2bw import compat
from lightning_pipe2bw.partition import BodyRef
from lightning_pipe2bw.pipeline.options import PipeOptions
from lightning_pipe2bw.planner.autoplan import (
    TRUST_NOTE,
    AutoPlanInputs,
    PlanCheck,
    plan_from_loader,
)
from lightning_pipe2bw.planner.loopcost import loop_costs
from lightning_pipe2bw.planner.plans import PlanResult
from lightning_pipe2bw.runtime.microbatch import batch_size_of

__all__ = ["check_plan", "finish_plan_check", "plan_auto"]

# the logger docs/user-guide.md names for the plan
log = logging.getLogger("lightning_pipe2bw.strategy")


def plan_auto(
    module: LightningModule,
    ref: BodyRef,
    options: PipeOptions,
    device: torch.device,
    world_size: int,
    num_processes: int,
    global_rank: int,
) -> tuple[PlanResult, PlanCheck]:
    """``balance="auto"``: profile and plan (partition, micro-batches and recomputation unless
    given) the body ``ref`` of ``module``; the plan, and the check of its throughput."""
    o = options
    inputs = AutoPlanInputs(
        o.schedule, o.data_parallel, o.microbatches, o.recompute, device, world_size,
        num_processes, loop_costs=loop_costs, shard_optimizer=o.shard_optimizer, fsdp=o.fsdp,
    )  # fmt: skip
    loader = compat.training_dataloader(module.trainer)
    plan = plan_from_loader(
        module, ref, loader, inputs, compat.optimizer_factory(module), tell=rank_zero_info
    )
    if global_rank == 0:
        log.info("pipe2bw: balance='auto' planned\n%s", plan.explain())
        rank_zero_info(f"pipe2bw: balance='auto' chose {plan.best.summary()} ({TRUST_NOTE})")
    return plan, PlanCheck(plan.best.throughput)


def check_plan(
    plan_check: PlanCheck | None, step: int, batch: Any, data_parallel: int, global_rank: int
) -> None:
    """At a training batch's start: time the run against the plan until it is measured (the
    comparison is told on rank 0)."""
    if plan_check is None or plan_check.result is not None:
        return
    line = plan_check.step(step, batch_size_of(batch) * data_parallel)
    if line is not None and global_rank == 0:
        rank_zero_info(line)


def finish_plan_check(plan_check: PlanCheck | None, global_rank: int) -> None:
    """At the end of fit: the comparison, unless told already (at least three steps measured)."""
    if plan_check is None:
        return
    line = plan_check.finish()
    if line is not None and global_rank == 0:
        rank_zero_info(line)
