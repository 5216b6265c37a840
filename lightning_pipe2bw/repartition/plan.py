"""vPipe's live repartitioning: measure each block while training runs, and move whole blocks
between stages when the slowest stage is clearly slower than the best split would be.

Every ``repartition_every`` steps each rank reports what its stage measured since the previous
check (:class:`StageTiming`): every owned block's forward time, timed around the block call,
and the stage's total forward and backward time from the engine's actions. A block's cost is
its forward time scaled by the stage's backward-to-forward ratio (a block's backward is not
timed on its own); what the stage spends outside its blocks (the user's step around the body,
the loss) stays with the stage. From these costs :func:`plan_repartition` finds the contiguous
split with the smallest slowest stage (the planner's exact min-max programme) and proposes it
when the current slowest stage is more than ``threshold`` slower.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_pipe2bw.partition.split import Partition, make_partition
from lightning_pipe2bw.planner.partitioner import minmax_partition
from lightning_pipe2bw.runtime.engine import PipelineEngine

log = logging.getLogger(__name__)

__all__ = [
    "Repartition",
    "Repartitioner",
    "load_optimizer_state_by_name",
    "optimizer_state_by_name",
]


@dataclass(frozen=True)
class StageTiming:
    """What one stage measured since the previous check (seconds, summed over micro-batches)."""

    stage: int
    block_forward_s: Mapping[int, float]  # owned block index -> its forward time
    forward_s: float  # the stage's forward actions (blocks and the user's code around them)
    backward_s: float  # the stage's backward actions


@dataclass(frozen=True)
class Repartition:
    """What :func:`plan_repartition` found: the stages' times under the current split and under
    the best one, and whether the gap is over the threshold."""

    current: tuple[int, ...]
    best: tuple[int, ...]
    current_s: tuple[float, ...]
    best_s: tuple[float, ...]
    threshold: float

    @property
    def slowdown(self) -> float:
        """How much slower the current slowest stage is than the best split's (0.2: 20%)."""
        best = max(self.best_s)
        return max(self.current_s) / best - 1.0 if best > 0 else 0.0

    @property
    def needed(self) -> bool:
        return self.best != self.current and self.slowdown > self.threshold

    def moves(self) -> list[tuple[int, int, int]]:
        """(block, from stage, to stage) for every block that changes stage."""
        return Partition(self.current).moves_to(Partition(self.best))

    def describe(self) -> str:
        moved = ", ".join(f"block {b} stage {a} -> {c}" for b, a, c in self.moves()) or "nothing"

        def ms(xs: Sequence[float]) -> str:
            return "[" + ", ".join(f"{x * 1e3:.1f}" for x in xs) + "]"

        return (
            f"stage times {ms(self.current_s)} ms with balance {list(self.current)}: the slowest "
            f"is {self.slowdown:.0%} over the best split {list(self.best)} "
            f"({ms(self.best_s)} ms; threshold {self.threshold:.0%}); moves: {moved}"
        )


def block_costs(
    timings: Sequence[StageTiming], num_blocks: int
) -> tuple[list[float], dict[int, float]]:
    """Per-block cost (forward and backward) and per-stage fixed cost from the stages' reports.
    Several reports of one stage (pipeline replicas) are averaged."""
    by_stage: dict[int, list[StageTiming]] = {}
    for t in timings:
        by_stage.setdefault(t.stage, []).append(t)
    cost = [0.0] * num_blocks
    fixed: dict[int, float] = {}
    for stage, reports in by_stage.items():
        n = len(reports)
        fwd = sum(r.forward_s for r in reports) / n
        bwd = sum(r.backward_s for r in reports) / n
        blocks = {
            b: sum(r.block_forward_s.get(b, 0.0) for r in reports) / n
            for b in reports[0].block_forward_s
        }
        in_blocks = sum(blocks.values())
        scale = (fwd + bwd) / fwd if fwd > 0 else 1.0
        for b, seconds in blocks.items():
            cost[b] = seconds * scale
        fixed[stage] = max(fwd + bwd - in_blocks * scale, 0.0)
    return cost, fixed


def plan_repartition(
    timings: Sequence[StageTiming], balance: Sequence[int], threshold: float
) -> Repartition:
    """The best contiguous split for the measured costs, and how the current one compares."""
    num_stages, num_blocks = len(balance), sum(balance)
    cost, fixed = block_costs(timings, num_blocks)
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, lo: int, hi: int) -> float:
        return prefix[hi] - prefix[lo] + fixed.get(s, 0.0)

    def stage_times(split: Sequence[int]) -> tuple[float, ...]:
        partition = make_partition(num_blocks, num_stages, split)
        ranges = map(partition.blocks_of, range(num_stages))
        return tuple(stage_cost(s, r.start, r.stop) for s, r in enumerate(ranges))

    current_s = stage_times(balance)
    found = minmax_partition(num_blocks, num_stages, stage_cost, stage_cost)
    best = tuple(balance) if found is None else found[1]
    best_s = stage_times(best)
    if max(best_s) >= max(current_s) or not all(map(math.isfinite, best_s)):
        best, best_s = tuple(balance), current_s
    return Repartition(tuple(balance), best, current_s, best_s, threshold)


def optimizer_state_by_name(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer``'s state keyed by ``module``'s parameter names: ``state.<name>.<key>`` (e.g.
    Adam's ``exp_avg`` and ``step``) and ``param_groups.<name>.<key>`` (the values of the group
    the parameter is in), so that any set of stages can pick the entries of the blocks it owns."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    out: dict[str, Any] = {}
    for group in optimizer.param_groups:
        values = {k: v for k, v in group.items() if k != "params"}
        for param in group["params"]:
            name = name_of[id(param)]
            for key, value in optimizer.state.get(param, {}).items():
                out[f"state.{name}.{key}"] = value
            for key, value in values.items():
                out[f"param_groups.{name}.{key}"] = value
    return out


def load_optimizer_state_by_name(
    module: nn.Module, optimizer: Optimizer, flat: Mapping[str, Any]
) -> None:
    """Give ``optimizer`` the state :func:`optimizer_state_by_name` wrote, for the parameters
    it holds now (every parameter must have its entries; a group takes its first parameter's
    values)."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    state = optimizer.state_dict()
    index = 0
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        for position, param in enumerate(group["params"]):
            name = name_of[id(param)]
            head = f"param_groups.{name}."
            values = {k[len(head) :]: v for k, v in flat.items() if k.startswith(head)}
            if not values:
                raise KeyError(f"no optimizer state for parameter {name!r}")
            if position == 0:
                saved.update(values)
            head = f"state.{name}."
            entries = {k[len(head) :]: v for k, v in flat.items() if k.startswith(head)}
            if entries:
                state["state"][saved["params"][position]] = entries
            index += 1
    optimizer.load_state_dict(state)


class Repartitioner:
    """When to check the stages' balance, and the check: every ``every`` steps (``None``:
    never) each rank reports what its stage measured, and every rank decides alike."""

    def __init__(self, every: int | None, threshold: float) -> None:
        self.every = every
        self.threshold = threshold
        self.history: list[Repartition] = []  # the repartitions of this strategy, in order
        self._last_check = 0

    def due(self, step: int) -> bool:
        """Whether to check before the step ``step`` (once per step, never at step 0)."""
        every = self.every
        if every is None or step == 0 or step % every or step == self._last_check:
            return False
        self._last_check = step
        return True

    def poll(self, step: int, engine: PipelineEngine, balance: Sequence[int]) -> Repartition | None:
        """Before step ``step``: the decision to move blocks, if a check is due and finds the
        stages out of balance (collective when a check is due)."""
        if not self.due(step):
            return None
        decision = self.check(engine, balance)
        log.debug("pipe2bw: balance check at step %d: %s", step, decision.describe())
        return decision if decision.needed else None

    def check(self, engine: PipelineEngine, balance: Sequence[int]) -> Repartition:
        """Gather every stage's times since the previous check (collective) and compare
        ``balance`` with the best split of them; the timers restart."""
        stats = engine.stats
        stage = engine.stage
        mine = StageTiming(stage, engine.body.take_block_times(), stats.forward_s, stats.backward_s)
        stats.forward_s = stats.backward_s = 0.0
        everyone: list[Any] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        return plan_repartition(everyone, balance, self.threshold)
