"""The planner: pick data parallelism, depth, micro-batch size, recompute and the partition."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_pipe2bw.planner.costmodel import (
    FLUSH_SCHEDULES,
    PLANNER_SCHEDULES,
    Cluster,
    CostModel,
    StageCost,
    check_schedule,
)
from lightning_pipe2bw.planner.partitioner import best_partition, smallest_peak_memory
from lightning_pipe2bw.planner.planargs import (
    ProfilesLike,
    as_profiles,
    check_int,
    check_ratio,
    check_search,
    divisors,
    even,
    rank,
    ranked_result,
)
from lightning_pipe2bw.planner.plans import Plan, PlanResult
from lightning_pipe2bw.planner.profile import Profile, ProfileSet
from lightning_pipe2bw.planner.simcosts import flush_step, simulation_costs
from lightning_pipe2bw.planner.target import step_multiplier
from lightning_pipe2bw.planner.virtualplan import (
    VIRTUAL_PLANNER_SCHEDULES,
    plan_virtual,
    predict_virtual,
)
from lightning_pipe2bw.schedule import (
    ActionKind,
    Costs,
    add_communication,
    schedule_spec,
    simulate,
)

__all__ = ["Cluster", "plan", "predict", "simulate_plan"]

# what ``plan(schedule="all")`` compares
ALL_SCHEDULES = (*PLANNER_SCHEDULES, *VIRTUAL_PLANNER_SCHEDULES)
_INF = math.inf
_GIB = float(2**30)


def _make_plan(
    model: CostModel,
    balance: Sequence[int],
    flags: Sequence[bool],
    limit: float,
    simulated: bool = True,
) -> Plan:
    """The plan of one split; a flush schedule's step simulated (:func:`_flush_step`) unless
    ``simulated`` is False (the search's closed form)."""
    stages: list[StageCost] = []
    lo = 0
    for s, (k, rc) in enumerate(zip(balance, flags, strict=True)):
        stages.append(model.stage(s, lo, lo + k, rc))
        lo += k
    t = max(st.time_s(model.m) for st in stages)
    step = model.step_time(t)
    if model.flush and simulated:
        step = _flush_step(model, balance, flags, stages)
    b = model.profile.microbatch_size
    return Plan(
        schedule=model.schedule,
        data_parallel=model.w,
        depth=model.d,
        microbatch_size=model.profile.microbatch_size,
        num_microbatches=model.m,
        balance=tuple(balance),
        recompute=tuple(flags),
        compute_s=tuple(st.compute_s for st in stages),
        comm_s=tuple(st.comm_s for st in stages),
        allreduce_s=tuple(st.allreduce_s for st in stages),
        memory_bytes=tuple(st.memory_bytes for st in stages),
        time_per_microbatch=t,
        step_time=step,
        throughput=model.w * b * model.m / step if step > 0 else _INF,
        fits=all(st.memory_bytes <= limit for st in stages),
    )


def _flush_step(
    model: CostModel,
    balance: Sequence[int],
    flags: Sequence[bool],
    stages: Sequence[StageCost],
) -> float:
    """A flush schedule's step simulated on the list the engine runs (its ``I``, ``W`` and the
    ``early_input_grad`` pass included), where the closed form ``(m + d - 1) t`` knows neither
    the backwards cut in two nor a stage slower than another in the fill and drain."""
    bounds = [0, *itertools.accumulate(balance)]
    costs = simulation_costs(model, bounds, stages, range(model.d), flags)
    step, _ = flush_step(
        model.schedule,
        model.d,
        model.m,
        costs,
        [st.allreduce_s for st in stages],
        model.cluster.step_overhead_s,
        device_type=model.profile.device.partition(":")[0],
    )
    return step


# ----------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class _Candidate:
    model: CostModel
    recompute: str
    upper: float  # throughput bound: no split of this configuration can beat it
    memory_floor: float  # no split of it needs less on its largest stage


def plan(
    profiles: ProfilesLike,
    cluster: Cluster,
    global_batch_size: int,
    schedule: str = "2bw",
    *,
    microbatch_sizes: Sequence[int] | None = None,
    recompute: str = "search",
    optimizer_bytes_per_param_byte: float = 2.0,
    keep: int = 10,
    data_parallel: int | None = None,
    shard_optimizer: bool = False,
    step_multipliers: Mapping[str, float] | None = None,
    fsdp: bool = False,
) -> PlanResult:
    """Search every (w, d) with w d = N and d <= blocks, every micro-batch size b dividing the
    per-replica batch B / w (or those in ``microbatch_sizes``), m = B / (w b), and recompute
    ("search": off and on; "off"; "on"; "per_stage": only the stages that need it to fit),
    with the best partition of each; keep the ``keep`` fastest that fit in memory.

    Exact: candidates are visited by a throughput upper bound (compute / d) and the search
    stops once no remaining one can enter the top ``keep``. 2BW needs m >= d; others are not
    limited. Raises ValueError when nothing fits, with the smallest memory any split needed.
    ``data_parallel`` fixes w (the strategy's ``balance="auto"`` plans for the width it was given).
    ``shard_optimizer``: each of a stage's w replicas keeps 1/w of its optimizer state, and
    gathers the updated weights after each step (``Pipe2BWStrategy(shard_optimizer=True)``).
    ``fsdp``: FSDP2 on each block over a stage's w replicas (``Pipe2BWStrategy(fsdp=True)``):
    weights and optimizer state at 1/w, each block gathered for its forward and its backward;
    the schedules that keep a second version of each weight are refused with it, as the strategy
    refuses them (memory and time: :class:`~lightning_pipe2bw.planner.costmodel.CostModel`).

    The schedules with two stages per rank (``interleaved-1f1b``, ``zb-v``, ``2bw-v``) are
    planned by :mod:`~lightning_pipe2bw.planner.virtualplan`: 2d stages, step time by
    simulating the schedule. ``schedule="all"`` plans every schedule of :data:`ALL_SCHEDULES`
    and ranks all their plans together by predicted time to the target loss: throughput over
    each schedule's step multiplier (the steps its update rule needs to reach the flushed
    schedules' loss, over theirs: ``planner.target``, measured; ``step_multipliers`` by
    schedule name for your own).
    """
    if schedule == "all":
        return _plan_all(
            profiles, cluster, global_batch_size, microbatch_sizes=microbatch_sizes,
            recompute=recompute, optimizer_bytes_per_param_byte=optimizer_bytes_per_param_byte,
            keep=keep, data_parallel=data_parallel, shard_optimizer=shard_optimizer,
            step_multipliers=step_multipliers, fsdp=fsdp,
        )  # fmt: skip
    if fsdp and not schedule_spec(check_schedule(schedule)).flushes:
        raise ValueError(
            f"fsdp=True: schedule {schedule!r} keeps a second version of every weight, whole, "
            "which FSDP keeps in shards only (the strategy refuses it too); plan a flushed "
            "schedule with it"
        )
    if schedule in VIRTUAL_PLANNER_SCHEDULES:  # several stages per rank
        return plan_virtual(
            profiles, cluster, global_batch_size, schedule, microbatch_sizes=microbatch_sizes,
            recompute=recompute, optimizer_bytes_per_param_byte=optimizer_bytes_per_param_byte,
            keep=keep, data_parallel=data_parallel, shard_optimizer=shard_optimizer, fsdp=fsdp,
        )  # fmt: skip
    started = time.perf_counter()
    check_schedule(schedule)
    pset, cluster, batch, ratio = check_search(
        profiles, cluster, global_batch_size, recompute, optimizer_bytes_per_param_byte, keep
    )
    if microbatch_sizes is not None:
        microbatch_sizes = [
            check_int("micro-batch size", b, "use sizes >= 1") for b in microbatch_sizes
        ]
    modes = ("off", "on") if recompute == "search" else (recompute,)
    candidates, skipped = _candidates(
        pset, cluster, schedule, batch, microbatch_sizes, modes, ratio, data_parallel,
        shard_optimizer, fsdp,
    )  # fmt: skip
    found, infeasible = _search(candidates, keep, float(cluster.memory_bytes))
    if not found:
        raise ValueError(_nothing_fits(candidates, skipped, cluster, batch, schedule, recompute))
    return PlanResult(
        best=found[0],
        alternatives=tuple(found[1:]),
        cluster=cluster,
        global_batch_size=batch,
        configurations=len(candidates),
        infeasible=infeasible,
        search_time_s=time.perf_counter() - started,
    )


def _candidates(
    pset: ProfileSet,
    cluster: Cluster,
    schedule: str,
    batch: int,
    microbatch_sizes: Sequence[int] | None,
    modes: Sequence[str],
    ratio: float,
    data_parallel: int | None,
    shard_optimizer: bool = False,
    fsdp: bool = False,
) -> tuple[list[_Candidate], list[str]]:
    """Every configuration (w, d, b, recompute) the schedule's micro-batch rule allows, best
    throughput bound first, and why the others were skipped."""
    spec = schedule_spec(schedule)
    n, total = pset.num_blocks, cluster.num_devices
    candidates: list[_Candidate] = []
    skipped: list[str] = []
    profiles_at: dict[int, Profile] = {}
    for d in range(1, min(total, n) + 1):
        if total % d:
            continue
        w = total // d
        if data_parallel is not None and w != data_parallel:
            continue
        if batch % w:
            skipped.append(f"w={w} (d={d}): {batch} samples do not split over {w} replicas")
            continue
        per = batch // w
        sizes = (
            divisors(per)
            if microbatch_sizes is None
            else [b for b in microbatch_sizes if per % b == 0]
        )
        for b in sizes:
            m = per // b
            why = spec.microbatch_problem(m, d)
            if why is not None:
                skipped.append(f"w={w} d={d} b={b}: {why}")
                continue
            if b not in profiles_at:
                profiles_at[b] = pset.at(b)
            model = CostModel(
                profiles_at[b], cluster, schedule, w, d, m, ratio, shard_optimizer, fsdp
            )
            for mode in modes:
                t_floor, mem_floor = model.bounds(mode == "on")
                candidates.append(_Candidate(model, mode, model.throughput(t_floor), mem_floor))
    candidates.sort(key=lambda c: -c.upper)
    return candidates, skipped


def _search(candidates: list[_Candidate], keep: int, limit: float) -> tuple[list[Plan], int]:
    """The ``keep`` fastest plans that fit in ``limit`` bytes per device, best first, and how
    many configurations nothing fitted.

    Exact under the closed form: candidates come by their throughput bound, and the search stops
    once none left can enter the top ``keep``. The plans kept are then timed by simulating the
    list the engine runs, and ranked by that."""
    kept: list[tuple[Plan, CostModel]] = []
    infeasible = 0
    for cand in candidates:
        floor = kept[-1][0].throughput if len(kept) >= keep else 0.0
        if cand.upper <= floor:
            break  # sorted by bound: nothing after this one can enter the top `keep`
        if cand.memory_floor > limit:
            infeasible += 1
            continue
        model = cand.model
        cutoff = model.time_for_throughput(floor) if floor > 0 else _INF
        result = best_partition(model, cand.recompute, limit, cutoff)
        if result is None:
            infeasible += cutoff == _INF
            continue
        kept.append((_make_plan(model, *result, limit, simulated=False), model))
        kept.sort(key=lambda pair: rank(pair[0]))
        del kept[keep:]
    found = [_make_plan(model, p.balance, p.recompute, limit) for p, model in kept]
    return sorted(found, key=rank), infeasible


def _plan_all(
    profiles: ProfilesLike,
    cluster: Cluster,
    global_batch_size: int,
    *,
    keep: int,
    step_multipliers: Mapping[str, float] | None = None,
    **options: Any,
) -> PlanResult:
    """Every schedule's plans, ranked together by time to the target (see :func:`plan`)."""
    started = time.perf_counter()
    found: list[Plan] = []
    reasons: list[str] = []
    configurations = infeasible = 0
    for name in ALL_SCHEDULES:
        try:
            result = plan(profiles, cluster, global_batch_size, name, keep=keep, **options)
        except ValueError as err:
            reasons.append(f"{name}: {err}")
            continue
        multiplier = step_multiplier(name, step_multipliers)
        found.extend(replace(p, step_multiplier=multiplier) for p in result.ranked)
        configurations += result.configurations
        infeasible += result.infeasible
    if not found:
        raise ValueError("no schedule has a plan: " + "; ".join(reasons))
    return ranked_result(
        found, keep, cluster, global_batch_size, configurations, infeasible, started
    )


def _nothing_fits(
    candidates: list[_Candidate],
    skipped: list[str],
    cluster: Cluster,
    batch: int,
    schedule: str,
    recompute: str,
) -> str:
    if not candidates:
        why = "; ".join(skipped[:6]) + ("; ..." if len(skipped) > 6 else "")
        return (
            f"no configuration of {cluster.num_devices} devices can run global batch {batch} "
            f"with schedule {schedule!r} ({why or 'no micro-batch size divides the batch'}); "
            "use a global batch divisible by the data-parallel widths, more micro-batches "
            "(a larger batch or smaller micro-batch sizes) or schedule='1f1b'"
        )
    need, where = _INF, ""
    for cand in candidates:
        peak = smallest_peak_memory(cand.model, cand.recompute)
        if peak < need:
            mdl = cand.model
            need = peak
            where = (
                f"w={mdl.w} d={mdl.d} b={mdl.profile.microbatch_size} m={mdl.m} "
                f"recompute={cand.recompute}"
            )
    hints = [*_sharding_hints(candidates, float(cluster.memory_bytes))]
    hints += ["devices with more memory", "more devices (deeper pipelines)", "smaller micro-batches"]
    if recompute in ("off",):
        hints.append("recompute='search'")
    if schedule_spec(schedule).asynchronous:
        hints.append("schedule='1f1b' (one weight version)")
    return (
        f"no plan fits in {cluster.memory_bytes / _GIB:.2f} GiB per device: the smallest "
        f"largest-stage memory over {len(candidates)} configurations is {need / _GIB:.2f} GiB "
        f"({where}); use {', '.join(hints)}"
    )


def _sharding_hints(candidates: list[_Candidate], limit: float) -> list[str]:
    """The sharding options under which some configuration with replicas would fit in ``limit``
    bytes, with the smallest largest-stage memory each gives (the planner's proposal when
    nothing fits as asked): ``shard_optimizer=True``, and ``fsdp=True`` for a flushed schedule."""
    hints = []
    options = [{"shard_optimizer": True}] + (
        [{"fsdp": True}] if all(c.model.flush for c in candidates) else []
    )
    for flags in options:
        need = _INF
        for cand in candidates:
            mdl = cand.model
            if mdl.w == 1 or mdl.shard_optimizer or mdl.fsdp:
                continue
            sharded = CostModel(
                mdl.profile, mdl.cluster, mdl.schedule, mdl.w, mdl.d, mdl.m, mdl.optimizer_ratio,
                shard_optimizer=flags.get("shard_optimizer", False), fsdp=flags.get("fsdp", False),
            )  # fmt: skip
            need = min(need, smallest_peak_memory(sharded, cand.recompute))
        if need <= limit:
            name = next(iter(flags))
            hints.append(f"{name}=True (it fits: {need / _GIB:.2f} GiB at most per device)")
    return hints


# ----------------------------------------------------------------------------- fixed configurations


def predict(
    profiles: ProfilesLike,
    cluster: Cluster,
    global_batch_size: int,
    *,
    schedule: str = "2bw",
    depth: int,
    microbatch_size: int,
    balance: Sequence[int] | None = None,
    recompute: bool | Sequence[bool] = False,
    optimizer_bytes_per_param_byte: float = 2.0,
) -> Plan:
    """The cost model's prediction for one configuration (to compare with a measured run).

    w = N / depth; m = B / (w b). Without ``balance`` the best split is searched (under the
    memory limit if one fits, else the fastest). The plan's ``fits`` says if it fits memory.
    A schedule with two stages per rank takes 2d block counts and one ``recompute`` flag, and
    is timed by simulation (:func:`~lightning_pipe2bw.planner.virtualplan.virtual_plan`).
    """
    pset = as_profiles(profiles)
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    if schedule in VIRTUAL_PLANNER_SCHEDULES:
        return predict_virtual(
            pset, cluster, global_batch_size, schedule, depth, microbatch_size, balance,
            recompute, optimizer_bytes_per_param_byte,
        )  # fmt: skip
    check_schedule(schedule)
    total = cluster.num_devices
    d = check_int("depth", depth, "use at least one stage")
    b = check_int("microbatch_size", microbatch_size, "use micro-batches of >= 1 sample")
    batch = check_int("global_batch_size", global_batch_size, "give the samples per optimizer step")
    if total % d or d > pset.num_blocks:
        raise ValueError(
            f"depth={d} must divide num_devices={total} and be <= the {pset.num_blocks} blocks; "
            f"use one of {[k for k in divisors(total) if k <= pset.num_blocks]}"
        )
    w = total // d
    if batch % (w * b):
        raise ValueError(
            f"global_batch_size={batch} is not a multiple of data_parallel x microbatch_size = "
            f"{w} x {b}; use a batch of {w * b * max(1, batch // (w * b))}"
        )
    m = batch // (w * b)
    why = schedule_spec(schedule).microbatch_problem(m, d)
    if why is not None:
        raise ValueError(f"{why} for d={d}; use a larger batch or smaller b")
    model = CostModel(
        pset.at(b), cluster, schedule, w, d, m, check_ratio(optimizer_bytes_per_param_byte)
    )
    flags = (bool(recompute),) * d if isinstance(recompute, bool) else tuple(recompute)
    if len(flags) != d:
        raise ValueError(f"recompute has {len(flags)} flags for depth={d}; give one per stage")
    if balance is None:
        # without a memory limit every split of n >= d blocks is valid, so this finds one
        found = best_partition(model, flags, cluster.memory_bytes) or best_partition(model, flags)
        balance = found[0] if found else even(pset.num_blocks, d)
    balance = tuple(balance)
    if len(balance) != d or any(k < 1 for k in balance) or sum(balance) != pset.num_blocks:
        raise ValueError(
            f"balance {list(balance)} must have {d} entries >= 1 summing to the "
            f"{pset.num_blocks} blocks (it sums to {sum(balance)})"
        )
    return _make_plan(model, balance, flags, cluster.memory_bytes)


def simulate_plan(
    plan: Plan, profiles: ProfilesLike, cluster: Cluster, *, batches: int = 3
) -> float:
    """The step time of ``plan`` simulated on the schedule the engine runs.

    Each stage's incoming transfers are folded into its compute: the activation from s - 1
    into its forward, the gradient from s + 1 into its backward (a receive blocks the stage for
    its transfer time, as in the formula; ``Costs.comm`` stays 0). Flush schedules: their
    plans' own ``step_time``, the simulated makespan of ``training_schedule(name, d, m)`` (with
    the backwards the ``early_input_grad`` pass cuts in two), then each stage's all-reduce after
    its last action, plus the cluster's ``step_overhead_s``. 2BW and PipeDream: the steady-state
    time of one batch, the makespan over ``batches + 1`` batches minus that over ``batches``
    (fill and drain cancel), or the slowest all-reduce if longer (it overlaps the next batch).
    There, each stage's optimizer update and ``step_overhead_s`` are work between two calls of
    its stream, just before the first forward of every batch after the first. (The engine
    pauses just before that forward's receive; simulated there, the pauses overlap with the
    wait for the input and a step pays less than their sum. The runs measured in
    ``benchmarks/planner_accuracy.py`` pay the sum: the receive waits are the neighbour's pause;
    why the engine overlaps less than this simulation says is not pinned down yet.)
    """
    pset = as_profiles(profiles)
    if plan.num_devices != cluster.num_devices or sum(plan.balance) != pset.num_blocks:
        raise ValueError(
            f"the plan uses {plan.num_devices} devices and {sum(plan.balance)} blocks, the cluster "
            f"has {cluster.num_devices} and the profile {pset.num_blocks}; simulate a plan with "
            "the cluster and profile it was made for"
        )
    d, m = plan.depth, plan.num_microbatches
    profile = pset.at(plan.microbatch_size)
    model = CostModel(profile, cluster, plan.schedule, plan.data_parallel, d, m)
    stages, updates, lo = [], [], 0
    for s, (k, rc) in enumerate(zip(plan.balance, plan.recompute, strict=True)):
        stages.append(model.stage(s, lo, lo + k, rc))
        updates.append(sum(b.update_s for b in profile.blocks[lo : lo + k]))
        lo += k
    if plan.schedule in FLUSH_SCHEDULES:
        return _flush_step(model, plan.balance, plan.recompute, stages)
    costs = Costs(
        forward=[st.forward_s + st.recv_activation_s for st in stages],
        backward=[st.backward_s + st.recv_gradient_s for st in stages],
    )
    overhead = cluster.step_overhead_s
    build = schedule_spec(plan.schedule).build

    def makespan(k: int) -> float:
        schedule = add_communication(build(d, m, k))
        delays = {
            (s, i): updates[s] + overhead
            for s, row in enumerate(schedule.stages)
            for i, action in enumerate(row)
            if action.kind is ActionKind.FORWARD
            and action.microbatch % m == 0
            and action.microbatch
        }
        return simulate(schedule, costs, delays).step_time

    return max(makespan(batches + 1) - makespan(batches), max(st.allreduce_s for st in stages))
