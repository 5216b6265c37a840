"""Assembling a rank's stage: partition the user's module (:func:`place_stage`), then build the
runtime that trains it (:func:`build_runtime`).

The two steps bracket what Lightning does in between: the precision plugin converts the module
that now holds only this stage's blocks, the module moves to the device, and
``configure_optimizers`` builds optimizers over the stage's parameters. Both steps raise the
same error on every rank for a bad setting (the checks depend only on values every rank
shares), before the first collective, so no rank is left waiting.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_pipe2bw.failures.record import wait_limits
from lightning_pipe2bw.optim.shard import (
    ParameterShards,
    ShardedOptimizer,
    by_elements,
    shard_problem,
)
from lightning_pipe2bw.optim.wrapper import unwrap_optimizer
from lightning_pipe2bw.partition import BodyRef, Partition, build_stage, make_partition
from lightning_pipe2bw.partition.balance import (
    Split,
    balance_by_weights,
    parameter_counts,
    stage_loads,
)
from lightning_pipe2bw.partition.build import (
    Init,
    Uninitialized,
    UninitializedError,
    check_callable_blocks,
)
from lightning_pipe2bw.partition.cost import block_flops, multiplied_parameters
from lightning_pipe2bw.pipeline.checks import memory_plan_problems, runtime_problems
from lightning_pipe2bw.pipeline.fsdp import (
    GradientSync,
    dtype_problems,
    optimizer_problems,
    shard_blocks,
    sharded_blocks,
    tie_problems,
)
from lightning_pipe2bw.pipeline.groups import ProcessGroups, average_over_replicas
from lightning_pipe2bw.pipeline.options import PipeOptions
from lightning_pipe2bw.pipeline.problems import raise_problems
from lightning_pipe2bw.pipeline.stage_runtime import StageRuntime
from lightning_pipe2bw.pipeline.ties import TiedCopies
from lightning_pipe2bw.pipeline.topology import Topology
from lightning_pipe2bw.planner.plans import PlanResult
from lightning_pipe2bw.runtime import P2PTransport, PipelineEngine, StageBody
from lightning_pipe2bw.runtime.call import BodyInput
from lightning_pipe2bw.runtime.channel import ObjectChannel
from lightning_pipe2bw.runtime.driver import Driver, FlushDriver
from lightning_pipe2bw.runtime.engine import VirtualStages
from lightning_pipe2bw.runtime.peer import PeerLink
from lightning_pipe2bw.runtime.shm import create_transport
from lightning_pipe2bw.runtime.twobw import PipeDreamDriver, TwoBWDriver
from lightning_pipe2bw.schedule import (
    evict_share,
    offload_stages,
    stashed_microbatches,
)

__all__ = ["build_runtime", "place_stage", "resolve_split"]

log = logging.getLogger(__name__)


T = TypeVar("T")

def resolve_split(
    options: PipeOptions,
    ref: BodyRef,
    topology: Topology,
    plan: PlanResult | None,
    call_of: Callable[[nn.Module], BodyInput | None] | None,
) -> Split:
    """The blocks per stage, the same on every rank, and the rule that chose them:

    - the user's list, always;
    - ``"uniform"``: even block counts;
    - ``"auto"``: the planner's (once ``plan`` exists; outside fit, as ``"params"``);
    - ``"params"``: the blocks' parameter counts evened out;
    - ``"flops"``: their forward FLOPs on the first micro-batch evened out (``call_of`` runs
      the step up to the body for it, on global rank 0, which tells the others);
    - by default (``None``), the forward FLOPs where finding the body already ran the step
      up to it (``ref.call``: a model whose structure is learnt from its forward), else the
      parameters each block multiplies (``partition.cost``): neither runs anything of the
      user's.

    Where a rank holds several stages, what it runs in all is evened out
    (``partition.balance``). A body an earlier Trainer call partitioned keeps its split."""
    body, n, placement = ref.module, topology.num_virtual, topology.placement
    mode = options.balance_mode
    if isinstance(body, StageBody):
        return Split(tuple(body.balance), "kept from the earlier Trainer call")
    if mode is None and options.balance is not None:
        return Split(tuple(options.balance), "given (balance)")
    blocks = list(body.children())
    check_callable_blocks(blocks, ref.path)
    if mode == "uniform":
        return Split(make_partition(len(blocks), n, None).balance, "even block counts (uniform)")
    if mode == "auto" and plan is not None:
        return Split(tuple(plan.best.balance), "the planner's (auto)")
    if mode in ("params", "auto"):
        weights = [float(c) for c in parameter_counts(blocks)]
        rule = f"parameter counts ({mode})"
    else:
        weights, rule = _cost_weights(body, ref.call, call_of if mode == "flops" else None)
    balance = balance_by_weights(weights, n, placement)
    return Split(balance, rule, tuple(stage_loads(weights, balance, placement)))


def _cost_weights(
    body: nn.Module,
    call: BodyInput | None,
    call_of: Callable[[nn.Module], BodyInput | None] | None,
) -> tuple[list[float], str]:
    """The block weights of the cost rules and the rule in words: the forward FLOPs on
    ``call``, or on what ``call_of`` gives (``balance="flops"``), counted on global rank 0 and
    told to every rank; else the multiplied parameters (the same on every rank)."""
    asked = call_of is not None
    if call is None and not asked:
        blocks = list(body.children())
        return [float(c) for c in multiplied_parameters(blocks)], "parameters that multiply"
    flops: list[float] | None = None
    why = ""
    if not dist.is_initialized() or dist.get_rank() == 0:
        if call is None and call_of is not None:
            call = call_of(body)
        if call is None:
            why = "the step did not reach the body on the first micro-batch at set-up"
        else:
            flops = block_flops(body, call)
            why = "" if flops is not None else "its forward could not be counted"
    if dist.is_initialized() and dist.get_world_size() > 1:
        told: list[Any] = [flops, why]
        dist.broadcast_object_list(told, src=0)
        flops, why = told
    if flops is not None:
        return flops, "forward FLOPs on the first micro-batch" + (" (flops)" if asked else "")
    if asked:
        warnings.warn(
            f"pipe2bw: balance='flops' could not count the blocks' FLOPs ({why}); the body is "
            "split by the parameters each block multiplies instead",
            stacklevel=2,
        )
    blocks = list(body.children())
    return (
        [float(c) for c in multiplied_parameters(blocks)],
        f"parameters that multiply (no FLOPs: {why})",
    )


def resolve_init(module: nn.Module) -> Init | None:
    """The user's ``pipeline_init(self, module)``, if ``module`` defines it: the initialiser of
    blocks built in ``configure_model``, called for every submodule like ``nn.Module.apply``."""
    fn = getattr(module, "pipeline_init", None)
    if fn is None:
        return None
    if not callable(fn):
        raise TypeError(
            f"{type(module).__name__}.pipeline_init must be a method "
            f"pipeline_init(self, module: nn.Module) -> None, got {type(fn).__name__}"
        )
    return fn  # type: ignore[no-any-return]


def place_stage(
    module: nn.Module,
    ref: BodyRef,
    options: PipeOptions,
    topology: Topology,
    balance: Sequence[int] | None,
    device: torch.device,
    recompute: bool | tuple[bool, ...] | None,
    replicas: Any = None,
) -> tuple[StageBody, Partition]:
    """Replace ``module``'s body by this rank's stage (see ``partition.build_stage``), running
    ``balance`` blocks per stage; ``recompute`` is one flag for every stage or one per stage
    (the planner's choice or the option). Checks the memory plan against the partition. With
    ``fsdp``, every block is then sharded over ``replicas`` (the stage's replica group).

    Blocks built in ``configure_model`` are initialised with the module's ``pipeline_init``
    when it has one (see ``partition.build_stage``); a tensor that no initialiser wrote, on any
    rank, raises the same :class:`UninitializedError` on every rank, naming them all."""
    stage = topology.stage
    flag = recompute[stage] if isinstance(recompute, tuple) else bool(recompute)
    on_meta = any(t.is_meta for t in (*module.parameters(), *module.buffers()))
    entries: tuple[Uninitialized, ...] = ()
    try:
        body, partition = build_stage(
            module,
            ref,
            stage,
            topology.num_virtual,
            balance,
            device,
            recompute=flag,
            memory_plan=options.memory_plan,
            init=resolve_init(module),
            stages=topology.stages_here,
        )
    except UninitializedError as err:
        entries = err.entries
    # every rank built the same module in configure_model, so all of them take part
    if on_meta:
        entries = tuple(_from_every_rank(list(entries)))
    if entries:
        raise UninitializedError(entries)
    raise_problems(memory_plan_problems(options, partition, flag))
    if options.fsdp:
        # a block only its stage holds may be the problem: every rank stops with every one
        found = _from_every_rank([*tie_problems(body), *dtype_problems(body)])
        raise_problems(list({p.message: p for p in found}.values()))  # each once
        shard_blocks([body.block(i) for i in body.indices], replicas, device)
    if options.compile_blocks is not None:
        body.compile_blocks(options.compile_blocks)
    log.info(
        "pipe2bw: rank %d runs stages %s/%d with blocks %s of %r",
        topology.rank, list(topology.stages_here), topology.num_virtual, body.indices, ref.path,
    )  # fmt: skip
    return body, partition


def build_runtime(
    *,
    root: nn.Module,
    body: StageBody,
    partition: Partition,
    options: PipeOptions,
    topology: Topology,
    groups: ProcessGroups,
    device: torch.device,
    num_microbatches: int,
    training: bool,
    optimizers: list[Any],
    clips_gradients: bool = False,
    scales_loss: bool = False,
    version_log: list[int] | None = None,
    total_steps: int = 0,
) -> StageRuntime:
    """The runtime of this rank's stage, ready to run (collective: the process groups a
    training run needs are made here, on every rank alike).

    With ``training``: the driver the schedule needs (a flush driver; or, for ``2bw`` and
    ``pipedream``, the asynchronous driver, which wraps the one optimizer in ``optimizers`` to
    keep the weight versions; ``total_steps``: the fit's optimizer steps, for a synchronous start
    given as a share) and BPipe's link to the partner stage. Otherwise a forward-only
    runtime (validate, test, predict): no offload, and the flush driver, which never runs."""
    across = [t for t in body.ties if len(t.stages(partition)) > 1]
    raise_problems(
        runtime_problems(
            options,
            training=training,
            num_optimizers=len(optimizers),
            clips_gradients=clips_gradients,
            scales_loss=scales_loss,
            shared_across=across[0].describe() if across else None,
            shared_with_last=next(
                (t.describe() for t in across if partition.num_stages - 1 in t.stages(partition)),
                None,
            ),
        )
    )
    evicting = frozenset(_evicting_stages(options, partition, training))
    # collectives from here on: every rank makes the same groups in the same order
    tied = TiedCopies(body, partition, topology, groups)
    tied.sync_weights()  # the copies start from the primary's value
    if tied and topology.rank == topology.rank_of_stage(0):
        log.info("pipe2bw: parameters shared across stages: %s", tied.describe())
    channel = None  # the last stage's values of each training step, to the other stages
    if training and topology.num_stages > 1:
        members = topology.pipeline_ranks()
        channel = ObjectChannel(topology.last_rank, groups.values(), members)
    if evicting:
        groups.offload(evicting)
    stage, p = topology.stage, topology.num_stages
    timeout_s = options.timeout.total_seconds() if options.timeout is not None else None
    virtual = None
    if topology.placement is not None:
        virtual = VirtualStages(
            topology.stages_here,
            topology.num_virtual,
            topology.neighbour_ranks(),
            topology.placement,
        )
    engine = PipelineEngine(
        body,
        stage=stage,
        num_stages=p,
        transport=_transport(topology, device, timeout_s),
        prev_rank=topology.prev_rank,
        next_rank=topology.next_rank,
        wait_limits=wait_limits(stage, p, timeout_s) if timeout_s is not None else (None, None),
        link=_link(topology, groups, evicting, device, timeout_s),
        evict_share=_evict_share(options, topology, evicting, num_microbatches),
        virtual=virtual,
    )
    if engine.link is not None:
        log.info(
            "pipe2bw: rank %d (stage %d) offloads activations with stage %d (rank %d)",
            topology.rank, stage, engine.link.partner_stage, engine.link.partner,
        )  # fmt: skip
    if options.fsdp and training:
        raise_problems(optimizer_problems(optimizers, scales_loss))
        engine.gradient_sync = GradientSync(
            {
                v: sharded_blocks(body.block(i) for i in body.segment(v))
                for v in topology.stages_here
            }
        )
    runtime_optimizers = list(optimizers)
    # with shard_optimizer: which replica updates each parameter of each optimizer
    shards = [
        _shards(unwrap_optimizer(o), topology, groups) if training and options.shard_optimizer
        else None
        for o in optimizers
    ]  # fmt: skip
    driver: Driver
    if training and options.is_async:
        driver_cls = PipeDreamDriver if options.spec.updates_per_stage else TwoBWDriver
        driver = driver_cls(
            engine,
            unwrap_optimizer(optimizers[0]),
            num_microbatches,
            channel=channel,
            flush_every=options.flush_every,
            evicting=evicting,
            version_log=version_log,
            delay_correction=options.correction,
            sync_steps=options.synchronous_steps(total_steps),
            fresh_last_stage=options.fresh_last_stage,
            shards=shards[0],
            average=_replica_average(topology, groups),
        )
        runtime_optimizers = [driver.optimizer]
        if tied and _sums_ties_ahead(options, topology):
            tied.ahead = True
            params = driver.versions.params
            driver.on_complete.append(lambda batch, grads: tied.post(batch, grads, params))
    else:
        driver = FlushDriver(
            engine, options.schedule, channel, evicting, early_input_grad=options.early_input_grad
        )
        runtime_optimizers = [
            o if shard is None else ShardedOptimizer(o, shard)
            for o, shard in zip(optimizers, shards, strict=True)
        ]
    return StageRuntime(
        topology=topology,
        groups=groups,
        options=options,
        root=root,
        body=body,
        partition=partition,
        engine=engine,
        driver=driver,
        num_microbatches=num_microbatches,
        optimizers=runtime_optimizers,
        evicting=evicting,
        tied=tied,
        shards={
            id(unwrap_optimizer(o)): shard
            for o, shard in zip(optimizers, shards, strict=True)
            if shard is not None
        },
    )


def _from_every_rank(items: list[T]) -> list[T]:
    """What every rank found, in rank order (collective when distributed: each rank takes part,
    with or without any)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return items
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [item for found in gathered for item in found]


def _replica_average(
    topology: Topology, groups: ProcessGroups
) -> Callable[[list[torch.Tensor]], None] | None:
    """What averages a stage's gradients with its replicas where the driver applies an update
    itself (PipeDream), or None with one replica."""
    if topology.data_parallel == 1:
        return None
    return lambda params: average_over_replicas(params, groups.stage, topology.data_parallel)


def _shards(optimizer: Optimizer, topology: Topology, groups: ProcessGroups) -> ParameterShards:
    """Which of this stage's replicas updates each trainable parameter ``optimizer`` holds
    (``shard_optimizer``), and the problem with an optimizer that cannot be sharded."""
    problem = shard_problem(optimizer)
    if problem is not None:
        raise TypeError(f"shard_optimizer=True: {problem}")
    params, whole = [], []
    for group in optimizer.param_groups:
        cut = by_elements(optimizer, group)  # else each parameter stays whole
        for p in group["params"]:
            if p.requires_grad:
                params.append(p)
                whole.append(not cut)
    return ParameterShards(params, groups.stage, topology.data_parallel, topology.replica, whole)


def _sums_ties_ahead(options: PipeOptions, topology: Topology) -> bool:
    """Whether the gradients of parameters tied across stages are summed as each batch's
    gradient completes, ahead of the step (``pipeline.ties``): 2BW (PipeDream updates inside the
    pipeline) with one pipeline (replicas average at the step first), every stage's update
    pairing the same batch (not ``fresh_last_stage``) and no blocks moving (repartitioning)."""
    return (
        not options.spec.updates_per_stage
        and topology.data_parallel == 1
        and not options.fresh_last_stage
        and options.repartition_every is None
    )


def _evicting_stages(options: PipeOptions, partition: Partition, training: bool) -> set[int]:
    """The stages that evict activations to their partner in this run (the same on every
    rank): every stage that can under the activation balancer, those with ``"evict"`` blocks
    under a memory plan, none outside training."""
    if not training:
        return set()
    if options.activation_budget is not None:  # (not under GPipe: see runtime_problems)
        return set(offload_stages(partition.num_stages))
    plan = options.memory_plan or {}
    return {partition.stage_of(i) for i, policy in plan.items() if policy == "evict"}


def _transport(topology: Topology, device: torch.device, timeout_s: float | None) -> Any:
    """The transport to the neighbour stages: shared memory between CPU processes of one host,
    else the process group (see :func:`~lightning_pipe2bw.runtime.shm.create_transport`; the
    whole world is one pipeline group). Collective when there is more than one stage."""
    peers = topology.peers
    if topology.num_stages == 1 or not (dist.is_available() and dist.is_initialized()):
        return P2PTransport(None, device)
    return create_transport(device, peers, timeout_s)


def _link(
    topology: Topology,
    groups: ProcessGroups,
    evicting: frozenset[int],
    device: torch.device,
    timeout_s: float | None,
) -> PeerLink | None:
    """This rank's link to its BPipe partner, when either of the pair evicts."""
    stage, partner = topology.stage, topology.partner()
    if stage not in evicting and partner not in evicting:
        return None
    me, other = topology.rank, topology.rank_of_stage(partner)
    return PeerLink(
        other,
        partner,
        groups.offload_pair(me, other),
        groups.offload_pair(other, me),
        device,
        holder=stage not in evicting,
        timeout_s=timeout_s if timeout_s is not None else 1800.0,
    )


def _evict_share(
    options: PipeOptions, topology: Topology, evicting: frozenset[int], num_microbatches: int
) -> Callable[[int], float | None] | None:
    """How much of each micro-batch's saved bytes this stage evicts under the activation
    balancer (None: the balancer is off here; the memory plan's ``"evict"`` blocks move)."""
    budget = options.activation_budget
    stage = topology.stage
    if budget is None or stage not in evicting:
        return None
    p, m, name = topology.num_stages, num_microbatches, options.schedule
    mine = stashed_microbatches(name, stage, p, m)
    theirs = stashed_microbatches(name, topology.partner(), p, m)
    return lambda saved_bytes: evict_share(budget, mine, theirs, saved_bytes)
