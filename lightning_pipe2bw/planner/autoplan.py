"""``balance="auto"``: profile the body on rank 0, measure the link, plan, and agree on the plan."""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from lightning_pipe2bw.partition.split import BodyRef
from lightning_pipe2bw.planner.costmodel import Cluster
from lightning_pipe2bw.planner.measure import MakeOptimizer, profile_sizes
from lightning_pipe2bw.planner.planner import plan
from lightning_pipe2bw.planner.plans import Plan, PlanResult
from lightning_pipe2bw.planner.profile import ProfileSet
from lightning_pipe2bw.runtime.call import BodyInput
from lightning_pipe2bw.runtime.microbatch import batch_size_of, split_batch
from lightning_pipe2bw.runtime.shm import create_transport
from lightning_pipe2bw.runtime.transport import wire_device
from lightning_pipe2bw.schedule import schedule_spec

__all__ = ["AutoPlanInputs", "plan_from_loader"]

log = logging.getLogger(__name__)

# each timing loop of the profile runs for at least this long (small blocks: more repeats, so
# that their medians hold on a machine the ranks share)
PROFILE_MIN_TIME_S = 0.25


class _Captured(Exception):
    def __init__(self, value: Any) -> None:
        super().__init__("body input captured")
        self.value = value


def body_input(module: nn.Module, ref: BodyRef, batch: Any, size: int) -> Any:
    """What the user's ``training_step`` passes to the body for a micro-batch of ``size``
    samples of ``batch``: the step runs up to the body call, which is stopped there."""
    whole = batch_size_of(batch)
    parts, _ = split_batch(batch, max(whole // size, 1))
    sample = parts[0]

    takes_any_call = getattr(ref.module, "takes_any_call", False)

    def capture(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if takes_any_call:  # a model's body: its first block takes the call's arguments
            raise _Captured(BodyInput(args, kwargs))
        raise _Captured(args[0] if len(args) == 1 else args)

    handle = ref.module.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            module.training_step(sample, 0)  # type: ignore[operator]
    except _Captured as got:
        return got.value
    finally:
        handle.remove()
    raise ValueError(
        f"balance='auto' ran training_step on one micro-batch to find the input of the body "
        f"{ref.path!r}, but the step never called it; call self.{ref.path}(x) (or self(x)) in "
        "training_step, or give balance as a list"
    )


def _median_round_trip(
    device: torch.device,
    peer: int,
    exchange: Callable[[bool], None],
    rounds: int,
    skip: int,
    after: Callable[[], None] | None = None,
) -> float:
    """Median seconds of ``exchange`` (one round trip: ``exchange(True)`` on global rank 0,
    ``exchange(False)`` on ``peer``) over ``rounds`` rounds, the first ``skip`` not counted;
    ``after`` runs untimed after each round. Collective over the default group: every rank
    gets rank 0's figure."""
    rank = dist.get_rank()
    result = 0.0
    if rank in (0, peer):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            exchange(rank == 0)
            times.append(time.perf_counter() - start)
            if after is not None:
                after()
        result = statistics.median(times[skip:])
    return _from_rank_0([result], device)[0]


def _from_rank_0(values: Sequence[float], device: torch.device) -> list[float]:
    """Global rank 0's ``values`` on every rank (collective over the default group; as given
    where there is no process group)."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    box = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.broadcast(box, src=0)
    return [float(v) for v in box.tolist()]


def measure_bandwidth(device: torch.device, peer: int, nbytes: int = 8 << 20) -> float:
    """Bytes per second from global rank 0 to ``peer`` (median of 3 round trips of ``nbytes``
    out and a byte back); collective over the default group: every rank gets the figure."""
    wire = wire_device(device)  # gloo carries a GPU stage's bytes through host memory
    payload = torch.zeros(nbytes // 4, dtype=torch.float32, device=wire)
    ack = torch.zeros(1, device=wire)

    def exchange(first: bool) -> None:
        if first:
            dist.send(payload, dst=peer)
            dist.recv(ack, src=peer)
        else:
            dist.recv(payload, src=0)
            dist.send(ack, dst=0)

    # the first round trip sets up the connection: not counted
    return nbytes / _median_round_trip(device, peer, exchange, rounds=4, skip=1)


class MessageTimes(NamedTuple):
    """What one small message costs through the pipeline's own transport."""

    latency_s: float  # from the sender's call until the receiver has it unpacked
    send_s: float  # the sender's own call (framing, the copy into the channel)


def measure_latency(device: torch.device, peer: int, rounds: int = 50) -> MessageTimes:
    """Seconds one small message takes from global rank 0 to ``peer`` and is unpacked, through
    the pipeline's own transport (its framing and Python overhead included): half the median
    round trip; and the median of rank 0's send calls. Collective over the default group:
    every rank gets the figures."""
    # the transport a run would use (shared memory between CPU ranks of one host), made on
    # every rank: transports are numbered in creation order, and failure notices match by that
    # number, so every rank must create the same transports (failure.new_run)
    rank = dist.get_rank()
    transport = create_transport(device, [peer] if rank == 0 else [0] if rank == peer else [])
    message = torch.zeros(16, device=device)
    sends: list[float] = []

    def exchange(first: bool) -> None:
        if first:
            start = time.perf_counter()
            transport.send(message, peer)
            sends.append(time.perf_counter() - start)
            transport.recv(peer)
        else:
            transport.recv(0)
            transport.send(message, 0)

    skip = rounds // 5
    seconds = _median_round_trip(
        device, peer, exchange, rounds=rounds, skip=skip, after=transport.settle
    )
    if rank in (0, peer):
        transport.wait_sends()
    transport.close()
    send = statistics.median(sends[skip:]) if sends else 0.0
    return MessageTimes(seconds / 2, *_from_rank_0([send], device))


# measures, on global rank 0, the training loop's seconds per step on one rank, the engine's
# per compute action and the loop's per step in a pipeline (the seam's ``loopcost.loop_costs``:
# it runs Lightning)
LoopCostsFn = Callable[[], tuple[float, float, float]]


def local_cluster(
    device: torch.device,
    world_size: int,
    processes_per_node: int,
    memory_fraction: float = 0.9,
    loop_costs: LoopCostsFn | None = None,
) -> Cluster:
    """The cluster the run is on: device memory (a CUDA device's, or this machine's RAM shared
    by its processes), the measured bandwidth inside a node and across nodes, a message's
    latency and its sender's cost, and the training loop's cost per step and the engine's per
    compute action (``loop_costs``, called on global rank 0: see :mod:`lightning_pipe2bw.planner.loopcost`;
    None: both 0; on a GPU the actions' host cost overlaps the device's work and is left out).
    Collective."""
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // processes_per_node
    intra = inter = 1e12  # one process: nothing crosses a link
    latency = send = 0.0
    if world_size > 1:
        latency, send = measure_latency(device, 1)
        intra = measure_bandwidth(device, 1 if processes_per_node > 1 else 0)
        inter = (
            measure_bandwidth(device, processes_per_node)
            if world_size > processes_per_node
            else intra
        )
    loop, action = _loop_costs(device, loop_costs, world_size)
    return Cluster(
        num_devices=world_size,
        devices_per_node=min(processes_per_node, world_size),
        memory_bytes=memory * memory_fraction,
        intra_node_bandwidth=intra,
        inter_node_bandwidth=inter,
        latency_s=latency,
        send_s=send,
        step_overhead_s=loop,
        action_s=action,
    )


def _loop_costs(
    device: torch.device, measure: LoopCostsFn | None, world_size: int
) -> tuple[float, float]:
    """Global rank 0's measured loop cost per step (a pipeline's where the run has more than
    one rank) and engine cost per action (0 on a GPU), on every rank; zeros, with a warning,
    where the measuring run fails."""
    loop = action = 0.0
    if measure is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        try:
            one_rank, action, pipeline = measure()
            loop = pipeline if world_size > 1 else one_rank
            action = action if device.type == "cpu" else 0.0
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            log.warning(
                "pipe2bw: balance='auto' plans without the training loop's cost per step, "
                "which could not be measured: %s", err,
            )  # fmt: skip
    loop, action = _from_rank_0([loop, action], device)
    return loop, action


@dataclass(frozen=True)
class AutoPlanInputs:
    """What the strategy knows when it plans: its options and its topology."""

    schedule: str
    data_parallel: int
    microbatches: int | None
    recompute: bool | Sequence[bool] | None
    device: torch.device
    world_size: int
    processes_per_node: int
    loop_costs: LoopCostsFn | None = None  # see local_cluster
    shard_optimizer: bool = False  # each replica keeps its share of the optimizer state
    fsdp: bool = False  # FSDP2 on each block over the stage's replicas

    @property
    def depth(self) -> int:
        return self.world_size // self.data_parallel


def _candidate_sizes(inputs: AutoPlanInputs, local_batch: int) -> list[int]:
    m = inputs.microbatches
    if m is not None:
        if local_batch % m:
            raise ValueError(
                f"balance='auto' with microbatches={m} needs a batch size divisible by {m}, got "
                f"{local_batch}; leave microbatches unset to let the planner choose"
            )
        return [local_batch // m]
    sizes = [b for b in range(1, local_batch + 1) if local_batch % b == 0]
    spec = schedule_spec(inputs.schedule)
    sizes = [b for b in sizes if spec.microbatch_problem(local_batch // b, inputs.depth) is None]
    if not sizes:
        raise ValueError(
            f"balance='auto': a batch of {local_batch} samples cannot give the {inputs.depth} "
            f"micro-batches schedule={inputs.schedule!r} needs; use a larger batch"
        )
    return sizes


def auto_plan(
    module: nn.Module,
    ref: BodyRef,
    batch: Any,
    inputs: AutoPlanInputs,
    optimizer: MakeOptimizer | None = None,
    tell: Callable[[str], None] | None = None,
) -> PlanResult:
    """Profile the body at the smallest and the largest candidate micro-batch size, with the
    run's optimizer (``optimizer`` builds it over given parameters; None: no update times) for
    the update times, broadcast global rank 0's profile, measure the links, and plan for the
    strategy's schedule and data-parallel width. Collective; every rank returns the same plan.

    ``module`` is the user's LightningModule: its ``training_step`` runs on one micro-batch up
    to the body call, to find the body's input.

    Every rank profiles at the same time, on its own device (moving one block there at a time),
    so that the figures include what ranks sharing a machine cost each other (cores, memory
    bandwidth); only rank 0's are used. Rank 0 then tells (``tell``, else the log) every
    schedule's time to the target loss against the chosen one's (:func:`compare_schedules`)."""
    local_batch = batch_size_of(batch)
    sizes = _candidate_sizes(inputs, local_batch)
    box: list[Any] = [None]
    blocks = list(ref.module.children())
    if any(p.is_meta for b in blocks for p in b.parameters()):
        box[0] = ValueError(
            "balance='auto' profiles the whole body, but it was built on the meta device "
            "(configure_model); build it in __init__, or give balance as a list or 'params'"
        )
    else:
        try:
            box[0] = profile_sizes(
                blocks,
                lambda b: body_input(module, ref, batch, b),
                sorted({sizes[0], sizes[-1]}),
                device=inputs.device,
                optimizer=optimizer,
                min_time_s=PROFILE_MIN_TIME_S,
            )
        except (ValueError, TypeError) as err:
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    profiles: ProfileSet = box[0]
    cluster = local_cluster(
        inputs.device, inputs.world_size, inputs.processes_per_node, loop_costs=inputs.loop_costs
    )
    if inputs.recompute is None:
        mode = "search"
    elif isinstance(inputs.recompute, bool):
        mode = "on" if inputs.recompute else "off"
    else:
        raise ValueError(
            "balance='auto' chooses recomputation itself (or takes recompute=True/False for "
            f"every stage); got a per-stage list {list(inputs.recompute)}"
        )
    result = plan(
        profiles,
        cluster,
        local_batch * inputs.data_parallel,
        inputs.schedule,
        microbatch_sizes=sizes,
        recompute=mode,
        data_parallel=inputs.data_parallel,
        shard_optimizer=inputs.shard_optimizer,
        fsdp=inputs.fsdp,
    )
    if dist.get_rank() == 0:
        (tell or log.info)("pipe2bw: " + compare_schedules(result, profiles, cluster, sizes, mode))
    return result


def compare_schedules(
    result: PlanResult,
    profiles: ProfileSet,
    cluster: Cluster,
    sizes: list[int],
    recompute: str,
) -> str:
    """One line: the best plan of every schedule the planner knows at the same width and
    micro-batch sizes, soonest to the target loss first (predicted throughput over the step
    multiplier, ``planner.target``), each as how much sooner than the chosen schedule it gets
    there, with its throughput alone (the planner's way of saying that another schedule would
    reach the loss sooner here)."""
    every = plan(
        profiles, cluster, result.global_batch_size, "all", microbatch_sizes=sizes,
        recompute=recompute, data_parallel=result.best.data_parallel, keep=10_000,
    )  # fmt: skip
    best: dict[str, Plan] = {}
    for p in every.ranked:
        best.setdefault(p.schedule, p)
    chosen = result.best.target_rate

    def told(name: str, p: Plan) -> str:
        faster = f"throughput {p.throughput / result.best.throughput:.2f}x"
        if p.target_rate <= 0:  # its step multiplier is not measured (weight stashing)
            return f"{name} unmeasured ({faster}, its steps to the target not measured)"
        return f"{name} {p.target_rate / chosen:.2f}x ({faster}, {p.multiplier:g}x the steps)"

    ranked = ", ".join(told(name, p) for name, p in best.items())
    return (
        f"time to the target loss of each schedule, how much sooner than "
        f"{result.best.schedule!r}: {ranked}"
    )


def plan_from_loader(
    module: nn.Module,
    ref: BodyRef,
    loader: Any,
    inputs: AutoPlanInputs,
    optimizer: MakeOptimizer | None = None,
    tell: Callable[[str], None] | None = None,
) -> PlanResult:
    """:func:`auto_plan` with the first batch of the training ``loader`` (collective)."""
    if not isinstance(loader, DataLoader):
        raise ValueError(
            "balance='auto' profiles the body with the first batch of the training "
            f"DataLoader, but train_dataloader() returned a {type(loader).__name__}; give "
            "balance as a list of block counts or 'params'"
        )
    return auto_plan(module, ref, next(iter(loader)), inputs, optimizer, tell)


# how the figure a plan predicts compares with what the run achieves: printed with the plan
TRUST_NOTE = (
    "the predicted samples/s count the blocks' measured compute and the transfers only, not the "
    "per-step overhead (the optimizer step and Lightning's loop in series across stages, Python "
    "per action), which dominates small steps: use it to rank configurations; the run reports "
    "the measured rate after its first steps"
)


class PlanCheck:
    """The training throughput measured against the plan's prediction: from the start of step
    ``skip`` (after the warm-up) over ``span`` steps, or until fit ends if it is shorter."""

    def __init__(self, predicted: float, skip: int = 5, span: int = 20) -> None:
        self.predicted = predicted
        self.skip, self.span = skip, span
        self.marks: list[tuple[float, int]] = []  # (start time, samples) of each measured step
        self.result: dict[str, float] | None = None

    def step(self, step: int, samples: int) -> str | None:
        """Called at the start of every training step with the samples it trains (over all
        replicas); the report line once ``span`` steps are measured."""
        if self.result is not None or step < self.skip:
            return None
        now = time.perf_counter()
        if len(self.marks) == self.span:
            return self.finish(now)
        self.marks.append((now, samples))
        return None

    def finish(self, now: float | None = None) -> str | None:
        """The report line (once; ``now``: when the last measured step ended), if at least
        three steps were measured."""
        if self.result is not None or len(self.marks) < 3:
            return None
        end = time.perf_counter() if now is None else now
        samples = sum(n for _, n in self.marks)
        measured = samples / (end - self.marks[0][0])
        ratio = measured / self.predicted
        self.result = {
            "predicted": self.predicted,
            "measured": measured,
            "ratio": ratio,
            "steps": float(len(self.marks)),
        }
        return (
            f"pipe2bw: balance='auto' predicted {self.predicted:.1f} samples/s for its plan; "
            f"measured {measured:.1f} samples/s over {len(self.marks)} steps ({ratio:.2f}x the "
            "prediction)"
        )
