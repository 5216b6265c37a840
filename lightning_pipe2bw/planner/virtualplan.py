"""Plans for the schedules with two stages per rank: a partition into 2d stages, timed by
simulating the schedule the engine runs.

The closed forms of :class:`~lightning_pipe2bw.planner.costmodel.CostModel` (fill and drain
as ``m + d - 1`` slots of the slowest stage) do not hold when a rank runs two stages in an
order of its own (interleaved 1F1B, ZB-V, 2BW on a V). So a candidate (w, d, b, m, recompute)
is planned in three steps:

1. the body is split into 2d contiguous stages minimising the slowest stage (the partition
   search of the one-stage schedules, over 2d stages of a 1F1B cost model for the per-stage
   terms: forward, backward, boundary transfers, all-reduce);
2. the schedule the engine would run (``schedule.training_schedule``: the compute order, its
   messages and the ``early_input_grad`` pass; or the V's 2BW stream) is simulated with those
   per-stage costs (:func:`~lightning_pipe2bw.planner.simcosts.simulation_costs`: each
   stage's incoming transfers and its sends folded into its actions, a hand-over between two
   stages of one rank free, a backward cut in two at the measured cost of its two passes);
   its step time is the prediction (a flush schedule: the makespan, then each rank's
   all-reduce, plus ``step_overhead_s``; 2BW on a V: the steady-state time of a batch, with
   each rank's update and ``step_overhead_s`` before its first forward of every batch);
3. a rank's memory is its stages' weights (two versions under 2BW), gradients and optimizer
   state, plus its simulated peak of in-flight (stage, micro-batch) pairs times the larger of
   its stages' stashed bytes per micro-batch, plus its receive buffers.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from lightning_pipe2bw.planner.costmodel import Cluster, CostModel, StageCost
from lightning_pipe2bw.planner.partitioner import best_partition
from lightning_pipe2bw.planner.planargs import (
    ProfilesLike,
    check_int,
    check_ratio,
    check_search,
    divisors,
    ranked_result,
)
from lightning_pipe2bw.planner.plans import Plan, PlanResult
from lightning_pipe2bw.planner.profile import Profile, ProfileSet
from lightning_pipe2bw.planner.simcosts import flush_step, simulation_costs
from lightning_pipe2bw.schedule import (
    ActionKind,
    Costs,
    Schedule,
    placement_of,
    schedule_spec,
    simulate,
)
from lightning_pipe2bw.schedule.registry import names_where

__all__ = ["VIRTUAL_PLANNER_SCHEDULES"]

# the schedules with several stages per rank, planned by simulation
VIRTUAL_PLANNER_SCHEDULES = names_where(lambda s: s.virtual)
STAGES_PER_RANK = 2
_GIB = float(2**30)


def virtual_problem(
    schedule: str, depth: int, num_microbatches: int, num_blocks: int
) -> str | None:
    """Why ``schedule`` cannot run ``num_microbatches`` on ``depth`` ranks of a body of
    ``num_blocks`` blocks (None: it can)."""
    d, m = depth, num_microbatches
    if STAGES_PER_RANK * d > num_blocks:
        return f"{schedule} needs 2d = {2 * d} stages, the body has {num_blocks} blocks"
    return schedule_spec(schedule).microbatch_problem(m, d)


def virtual_plan(
    profile: Profile,
    cluster: Cluster,
    schedule: str,
    data_parallel: int,
    depth: int,
    num_microbatches: int,
    recompute: bool,
    memory_limit: float,
    optimizer_bytes_per_param_byte: float = 2.0,
    balance: Sequence[int] | None = None,
    shard_optimizer: bool = False,
    fsdp: bool = False,
) -> Plan:
    """The plan of ``schedule`` for one configuration (see the module notes); ``balance`` (2d
    block counts) instead of the search's split."""
    w, d, m = data_parallel, depth, num_microbatches
    n = STAGES_PER_RANK * d
    model = CostModel(
        profile, cluster, "1f1b", w, n, m, optimizer_bytes_per_param_byte, shard_optimizer, fsdp
    )
    if balance is None:
        found = best_partition(model, "on" if recompute else "off")
        assert found is not None  # no memory limit: every split of >= n blocks is valid
        balance = found[0]
    bounds = [0, *itertools.accumulate(balance)]  # stage v: blocks bounds[v] .. bounds[v + 1]
    stages: list[StageCost] = [
        model.stage(v, bounds[v], bounds[v + 1], recompute) for v in range(len(balance))
    ]
    placement = placement_of(schedule, d)
    assert placement is not None
    held = [[v for v in range(n) if placement[v] == r] for r in range(d)]
    costs = simulation_costs(model, bounds, stages, placement, (recompute,) * n)
    allreduce = [sum(stages[v].allreduce_s for v in mine) for mine in held]
    step, peaks = _simulated_step(schedule, profile, cluster, bounds, d, m, costs, allreduce, held)
    memory = _rank_memory(model, bounds, held, peaks, recompute, schedule)
    per_rank = [sum(stages[v].compute_s + stages[v].comm_s for v in mine) for mine in held]
    return Plan(
        schedule=schedule,
        data_parallel=w,
        depth=d,
        microbatch_size=profile.microbatch_size,
        num_microbatches=m,
        balance=tuple(balance),
        recompute=(recompute,) * d,
        compute_s=tuple(sum(stages[v].compute_s for v in mine) for mine in held),
        comm_s=tuple(sum(stages[v].comm_s for v in mine) for mine in held),
        allreduce_s=tuple(allreduce),
        memory_bytes=tuple(memory),
        time_per_microbatch=max(per_rank),
        step_time=step,
        throughput=w * profile.microbatch_size * m / step if step > 0 else float("inf"),
        fits=all(mem <= memory_limit for mem in memory),
    )


def _simulated_step(
    schedule: str,
    profile: Profile,
    cluster: Cluster,
    bounds: Sequence[int],
    d: int,
    m: int,
    costs: Costs,
    allreduce: list[float],
    held: list[list[int]],
) -> tuple[float, tuple[int, ...]]:
    """The predicted step time and each rank's simulated peak of in-flight (stage,
    micro-batch) pairs."""
    overhead = cluster.step_overhead_s
    spec = schedule_spec(schedule)
    if spec.flushes:
        device_type = profile.device.partition(":")[0]
        step, result = flush_step(schedule, d, m, costs, allreduce, overhead, device_type)
        return step, result.peak_activations
    # 2BW: each rank's update (and the loop's overhead) before its first forward of a batch
    updates = [
        sum(b.update_s for v in mine for b in profile.blocks[bounds[v] : bounds[v + 1]])
        for mine in held
    ]

    def run(batches: int) -> tuple[float, tuple[int, ...]]:
        built: Schedule = spec.build(d, m, batches)
        delays = {}
        for r, row in enumerate(built.stages):
            first = min(held[r])
            for i, action in enumerate(row):
                if (
                    action.kind is ActionKind.FORWARD
                    and action.stage == first
                    and action.microbatch % m == 0
                    and action.microbatch
                ):
                    delays[(r, i)] = updates[r] + overhead
        result = simulate(built, costs, delays)
        return result.step_time, result.peak_activations

    longer, peaks = run(4)
    shorter, _ = run(3)
    return max(longer - shorter, max(allreduce)), peaks


def _rank_memory(
    model: CostModel,
    bounds: Sequence[int],
    held: list[list[int]],
    peaks: tuple[int, ...],
    recompute: bool,
    schedule: str,
) -> list[float]:
    """Each rank's peak bytes (see the module notes)."""
    versions = schedule_spec(schedule).weight_versions(0, len(held))
    factor = versions + 1 + (model.param_factor[0] - 2)  # weights, gradient, optimizer state
    last = len(bounds) - 2  # the pipeline's last stage
    out = []
    for r, mine in enumerate(held):
        params = sum(model.par[bounds[v + 1]] - model.par[bounds[v]] for v in mine)
        per_mb = []
        once = 0.0
        for v in mine:
            lo, hi = bounds[v], bounds[v + 1]
            saved = model.sav[hi] - model.sav[lo]
            if recompute:
                per_mb.append(model.in_bytes[lo])
                once = max(once, saved)
            else:
                per_mb.append(saved)
        buffers = sum(
            (model.in_bytes[bounds[v]] if v > 0 else 0.0)
            + (model.out_bytes[bounds[v + 1] - 1] if v < last else 0.0)
            for v in mine
        )
        out.append(params * factor + peaks[r] * max(per_mb) + once + buffers)
    return out


def plan_virtual(
    profiles: ProfilesLike,
    cluster: Cluster,
    global_batch_size: int,
    schedule: str,
    *,
    microbatch_sizes: Sequence[int] | None,
    recompute: str,
    optimizer_bytes_per_param_byte: float,
    keep: int,
    data_parallel: int | None,
    shard_optimizer: bool = False,
    fsdp: bool = False,
) -> PlanResult:
    """:func:`plan` for a schedule with two stages per rank: every (w, d, b, m, recompute) the
    schedule can run, each split and timed by :func:`virtual_plan` (no bound to prune with:
    the simulated step is the figure)."""
    started = time.perf_counter()
    pset, cluster, batch, ratio = check_search(
        profiles, cluster, global_batch_size, recompute, optimizer_bytes_per_param_byte, keep
    )
    modes = {"search": (False, True), "per_stage": (False, True), "off": (False,), "on": (True,)}
    n, total, limit = pset.num_blocks, cluster.num_devices, float(cluster.memory_bytes)
    found: list[Plan] = []
    skipped: list[str] = []
    configurations = infeasible = 0
    for d in range(1, total + 1):
        w = total // d
        if total % d or (data_parallel is not None and w != data_parallel) or batch % w:
            continue
        per = batch // w
        sizes = divisors(per) if microbatch_sizes is None else list(microbatch_sizes)
        for b in (b for b in sizes if per % b == 0):
            m = per // b
            problem = virtual_problem(schedule, d, m, n)
            if problem is not None:
                skipped.append(f"w={w} d={d} b={b}: {problem}")
                continue
            for flag in modes[recompute]:
                configurations += 1
                candidate = virtual_plan(
                    pset.at(b), cluster, schedule, w, d, m, flag, limit, ratio,
                    shard_optimizer=shard_optimizer, fsdp=fsdp,
                )  # fmt: skip
                if candidate.fits:
                    found.append(candidate)
                else:
                    infeasible += 1
    if not found:
        why = "; ".join(skipped[:6]) or f"no split fits in {limit / _GIB:.2f} GiB per device"
        raise ValueError(
            f"no configuration of {total} devices can run global batch {batch} with schedule "
            f"{schedule!r} ({why}); use more micro-batches, more memory or another schedule"
        )
    return ranked_result(found, keep, cluster, batch, configurations, infeasible, started)


def predict_virtual(
    pset: ProfileSet,
    cluster: Cluster,
    global_batch_size: int,
    schedule: str,
    depth: int,
    microbatch_size: int,
    balance: Sequence[int] | None,
    recompute: bool | Sequence[bool],
    ratio: float,
) -> Plan:
    total = cluster.num_devices
    d = check_int("depth", depth, "use at least one stage")
    b = check_int("microbatch_size", microbatch_size, "use micro-batches of >= 1 sample")
    batch = check_int("global_batch_size", global_batch_size, "give the samples per optimizer step")
    w = total // d if total % d == 0 else 0
    if not w or batch % (w * b):
        raise ValueError(
            f"depth={d} must divide num_devices={total}, and global_batch_size={batch} be a "
            f"multiple of data_parallel x microbatch_size"
        )
    m = batch // (w * b)
    problem = virtual_problem(schedule, d, m, pset.num_blocks)
    if problem is not None:
        raise ValueError(problem)
    flags = {bool(recompute)} if isinstance(recompute, bool) else set(recompute)
    if len(flags) != 1:
        raise ValueError(f"{schedule} plans one recompute flag for every rank, got {recompute!r}")
    if balance is not None and (
        len(balance) != 2 * d or any(k < 1 for k in balance) or sum(balance) != pset.num_blocks
    ):
        raise ValueError(
            f"balance {list(balance)} must have {2 * d} entries >= 1 (two stages per rank) "
            f"summing to the {pset.num_blocks} blocks"
        )
    return virtual_plan(
        pset.at(b), cluster, schedule, w, d, m, flags.pop(), cluster.memory_bytes,
        check_ratio(ratio), balance,
    )  # fmt: skip
