"""The PipeDream-2BW cost model: time and memory of one pipeline stage in one configuration."""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Any

from lightning_pipe2bw.optim.delay import CORRECTIONS, DEFAULT_CORRECTION, parse_correction
from lightning_pipe2bw.planner.profile import Profile
from lightning_pipe2bw.schedule.registry import names_where, schedule_spec

__all__ = [
    "FLUSH_SCHEDULES",
    "PLANNER_SCHEDULES",
    "Cluster",
    "CostModel",
    "StageCost",
    "check_schedule",
]

_Terms = tuple[float, float, float, float, float, float]
# the schedules this cost model prices: one stage per rank (those with several:
# ``planner.virtualplan``, by simulation)
PLANNER_SCHEDULES = names_where(lambda s: not s.virtual)
# pay the pipeline fill and drain every step
FLUSH_SCHEDULES = frozenset(names_where(lambda s: not s.virtual and s.flushes))


def check_schedule(schedule: object) -> str:
    """``schedule`` if the cost model knows it, else a ValueError listing the known names."""
    if not isinstance(schedule, str) or schedule not in PLANNER_SCHEDULES:
        valid = ", ".join(repr(name) for name in PLANNER_SCHEDULES)
        raise ValueError(f"unknown schedule {schedule!r}; the planner models {valid}")
    return schedule


def _positive_int(label: str, value: object, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{label} must be an int >= 1, got {value!r}; {fix}")
    return value


def _positive_number(label: str, value: object, fix: str, allow_zero: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{label} must be a finite number {bound}, got {value!r}; {fix}")
    return float(value)


@dataclass(frozen=True)
class Cluster:
    """The machine: ``num_devices`` devices in nodes of ``devices_per_node``.

    ``memory_bytes`` is what one device may use for the stage (weights, gradients, optimizer
    state, activations); bandwidths are bytes/s of one point-to-point link, inside a node and
    across nodes; ``latency_s`` is added once per message, on its receiver; ``send_s`` is what
    the sender of a message spends on it (the transport's framing and bookkeeping, measured at
    set-up like the latency; 0 where sends are asynchronous); ``action_s`` is what the engine
    adds to every compute action (a forward, a backward, each half of a backward cut in two)
    beyond its blocks' profiled compute. ``step_overhead_s`` is what every
    rank spends once per optimizer step outside the schedule and the update: the training loop's
    hooks, logging and the strategy's bookkeeping (measure it on the machine; see
    ``docs/planner.md``).
    """

    num_devices: int
    devices_per_node: int
    memory_bytes: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    latency_s: float = 0.0
    step_overhead_s: float = 0.0
    send_s: float = 0.0
    action_s: float = 0.0

    def __post_init__(self) -> None:
        n = _positive_int("Cluster.num_devices", self.num_devices, "count the devices to use")
        k = _positive_int(
            "Cluster.devices_per_node", self.devices_per_node, "give the devices in one node"
        )
        if n > k and n % k:
            raise ValueError(
                f"Cluster.num_devices={n} is not a whole number of nodes of devices_per_node={k}; "
                f"use num_devices={n - n % k} or {n - n % k + k}"
            )
        _positive_number("Cluster.memory_bytes", self.memory_bytes, "give bytes, e.g. 16 * 2**30")
        for label in ("intra_node_bandwidth", "inter_node_bandwidth"):
            _positive_number(f"Cluster.{label}", getattr(self, label), "give bytes/s, e.g. 3.125e9")
        _positive_number("Cluster.latency_s", self.latency_s, "give seconds, e.g. 1e-5", True)
        _positive_number(
            "Cluster.step_overhead_s", self.step_overhead_s, "give seconds, e.g. 2e-3", True
        )
        _positive_number("Cluster.send_s", self.send_s, "give seconds, e.g. 5e-5", True)
        _positive_number("Cluster.action_s", self.action_s, "give seconds, e.g. 1e-4", True)

    @property
    def num_nodes(self) -> int:
        return -(-self.num_devices // self.devices_per_node)

    def node_of(self, device: int) -> int:
        """The node that ``device`` sits on."""
        return device // self.devices_per_node

    def bandwidth(self, a: int, b: int) -> float:
        """Bytes/s between devices ``a`` and ``b``."""
        same = self.node_of(a) == self.node_of(b)
        return self.intra_node_bandwidth if same else self.inter_node_bandwidth

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        return cls(**data)


def correction_bytes(spec: str | None) -> tuple[float, int]:
    """(buffers per parameter byte, weight buffers) a one-step delay's correction ``spec`` keeps
    (None: the default one): each term's optimizer-state entries, and one weight buffer more for
    a term that evaluates batches at predicted weights."""
    terms = [CORRECTIONS[name] for name, _ in parse_correction(spec or DEFAULT_CORRECTION)]
    return float(sum(len(t.state_keys) for t in terms)), int(any(t.predicts for t in terms))


@dataclass(frozen=True)
class StageCost:
    """One stage of one configuration, per micro-batch (``allreduce_s`` per optimizer step)."""

    # the stage's forward, and its send of the activation (the cluster's ``send_s``; not on
    # the last stage)
    forward_s: float
    # its backward (with the recomputed forward when ``recompute``), and its send of the
    # inputs' gradient (not on the first stage)
    backward_s: float
    recv_activation_s: float  # the activation from stage s - 1 (0 on the first stage)
    recv_gradient_s: float  # the gradient from stage s + 1 (0 on the last stage)
    allreduce_s: float  # ring all-reduce of the stage's gradients over its replicas
    memory_bytes: float
    recompute: bool

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def comm_s(self) -> float:
        return self.recv_activation_s + self.recv_gradient_s

    def time_s(self, num_microbatches: int) -> float:
        """max(compute + comm, all-reduce / m): the all-reduce overlaps the next batch's work."""
        return max(self.compute_s + self.comm_s, self.allreduce_s / num_microbatches)


class CostModel:
    """Stage costs for one (schedule, w, d, b, m) on ``cluster``, for any contiguous segment.

    Implements the planner's model of Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
    Training" (PipeDream-2BW, ICML 2021, section 3.3), extended with per-stage boundary
    transfers, node-aware bandwidths and the flush of GPipe and PipeDream-Flush.

    Device placement (the runtime follows it): replica ``r``'s stage ``s`` runs on device
    ``r * depth + s``, and device ``k`` sits on node ``k // devices_per_node``. A pipeline fills
    consecutive devices; the data-parallel replicas of a stage are ``depth`` devices apart.

    Blocks ``lo .. hi - 1`` of ``profile`` (measured or scaled at micro-batch size b) on stage
    ``s`` cost, per micro-batch (PipeDream-2BW section 3.3, with the terms split per stage):

    * compute: sum of forward + backward; with recompute the forward runs twice,
      forward + (forward + backward), which is the paper's 4/3 x compute when backward = 2 x
      forward; flush schedules add the stage's update / m (see :meth:`step_time` for the
      others); ZB-H1, which cuts every backward in two, pays the measured cost of the cut
      (``BlockProfile.split_times`` less ``backward_s``) on every stage but the first, where
      nothing is recomputed; each message costs its sender the cluster's ``send_s`` (the
      activation in the forward, the gradient in the backward), and each compute action the
      cluster's ``action_s`` (two for a backward cut in two);
    * comm: activation bytes entering the stage (output of block lo - 1) plus gradient bytes
      entering it (same size as the output of block hi - 1), each over its link's bandwidth
      (inter-node if the two devices are on different nodes for any replica), plus latency;
    * all-reduce: 2 (w - 1) / w * param bytes / bandwidth (ring; inter-node if the stage's
      replicas span nodes), plus 2 (w - 1) latencies; amortised over the m micro-batches;
    * memory: versions x params + gradients (1 x params) + optimizer state
      (``optimizer_bytes_per_param_byte`` x params; divided by w with ``shard_optimizer``, each
      replica keeping its share) + stashed activations + receive buffers. With
      ``shard_optimizer`` a step also all-gathers the updated weights: (w - 1) / w x param
      bytes more over the replicas' link. With ``fsdp`` (FSDP2 on each block over the w
      replicas) the weights and the optimizer state are held at 1/w, the gradients whole (the
      micro-batches' gradients add up unsharded until the step's reduce-scatter), and two of the
      model's largest blocks are gathered at a time (the one running and the one fetched
      next); each micro-batch then all-gathers the stage's weights twice, for its forward and
      its backward ((w - 1) / w x param bytes each, per micro-batch, in the stage's
      communication), and the step reduce-scatters the gradients (half an all-reduce).
      A stage's peak is the larger of its backward's (the stash, the receive buffers, one
      block's ``backward_bytes`` at a time, and the ``cut_bytes`` of its blocks for each
      backward cut in two and not finished: one where a flush schedule cuts the backward its
      predecessor waits for, up to one per micro-batch in flight under zero bubble, none under
      FSDP or on a stage that recomputes) and its update's (the gradients averaged over the replicas in one flat buffer,
      or ZeRO-1's gathered weights, 1 + 1/w x params; and, without a flush, the stash). A
      one-step delay's correction adds its buffers to the optimizer state (``delay_correction``,
      default :data:`~lightning_pipe2bw.optim.delay.DEFAULT_CORRECTION`), and a predicting one
      a weight version. Versions: 2bw 2, gpipe and 1f1b 1, pipedream d - s. In-flight micro-batches: gpipe m,
      1f1b min(m, d - s), 2bw and pipedream d - s (no flush, so the stream stays full across
      batches). Stash without recompute: saved bytes x in-flight; with recompute: input bytes x
      in-flight + saved bytes of one micro-batch (live while it is recomputed). Receive buffers:
      one incoming activation and one incoming gradient.
    """

    def __init__(
        self,
        profile: Profile,
        cluster: Cluster,
        schedule: str,
        data_parallel: int,
        depth: int,
        num_microbatches: int,
        optimizer_bytes_per_param_byte: float = 2.0,
        shard_optimizer: bool = False,
        fsdp: bool = False,
        early_input_grad: bool = True,
        delay_correction: str | None = None,
    ) -> None:
        self.schedule = check_schedule(schedule)
        spec = self.spec = schedule_spec(self.schedule)
        if fsdp and shard_optimizer:
            raise ValueError(
                "fsdp=True shards the optimizer state already: plan with shard_optimizer=False"
            )
        self.profile, self.cluster = profile, cluster
        self.optimizer_ratio, self.shard_optimizer, self.fsdp = (
            optimizer_bytes_per_param_byte, shard_optimizer, fsdp
        )
        w, d, m = data_parallel, depth, num_microbatches
        self.w, self.d, self.m, self.n = w, d, m, profile.num_blocks
        blocks = profile.blocks
        flush = spec.flushes
        # the optimizer update runs once per step. After a flush every stage updates at once:
        # spread over the m micro-batches it is what a stage spends per micro-batch (a little
        # over). Without a flush (2BW, PipeDream) each stage's update sits between two calls of
        # its 1F1B stream, on the critical path of every other stage: the stream is tight, so a
        # stage that pauses holds up its neighbours' next micro-batch, and a step pays every
        # stage's update and loop overhead one after the other (see ``serial_s``)
        self.fwd, self.fb, self.par, self.sav = _prefix(
            [
                (
                    b.forward_s,
                    b.forward_s + b.backward_s + (b.update_s / m if flush else 0.0),
                    b.param_bytes,
                    b.saved_bytes,
                )
                for b in blocks
            ]
        )
        # what cutting each block's backward in two (``I`` and ``W``) costs beyond one backward,
        # paid by the schedules that cut every backward (the first stage leaves its backward
        # whole: it sends no gradient), where the stage's activations are not recomputed
        self.cut = spec.cut_backward
        self.cut_extra = list(
            itertools.accumulate((sum(b.split_times) - b.backward_s for b in blocks), initial=0.0)
        )
        updates = sum(b.update_s for b in blocks)
        # seconds per step outside the micro-batches' time: once after a flush (the stages pay
        # it side by side), else every stage's update and overhead in turn
        self.serial_s = cluster.step_overhead_s if flush else updates + d * cluster.step_overhead_s
        # bytes entering block i (its input) and leaving it
        self.in_bytes = [float(profile.input_bytes)] + [float(b.output_bytes) for b in blocks[:-1]]
        self.out_bytes = [float(b.output_bytes) for b in blocks]
        lat = cluster.latency_s
        self.in_inv = [0.0] * d  # seconds per byte into stage s from s - 1 (0: no such link)
        self.out_inv = [0.0] * d  # seconds per byte into stage s from s + 1
        self.lat_in = [0.0] * d
        self.lat_out = [0.0] * d
        for s in range(d - 1):
            inv = max(1.0 / cluster.bandwidth(r * d + s, r * d + s + 1) for r in range(w))
            self.out_inv[s], self.in_inv[s + 1] = inv, inv
            self.lat_out[s], self.lat_in[s + 1] = lat, lat
        # a step's ring passes over a stage's replicas, each (w - 1) / w of its param bytes over
        # their link: the gradients' all-reduce (two), and the sharded state's all-gather; under
        # FSDP one reduce-scatter a step, and two all-gathers a micro-batch (gather_inv)
        passes = 3 if shard_optimizer else 1 if fsdp else 2
        self.ar_inv = [0.0] * d  # seconds per param byte of stage s, a step
        self.gather_inv = [0.0] * d  # seconds per param byte of stage s, a micro-batch
        self.ar_lat = 2 * (w - 1) * lat if w > 1 else 0.0
        for s in range(d):
            if w > 1:
                nodes = {cluster.node_of(r * d + s) for r in range(w)}
                bw = (
                    cluster.intra_node_bandwidth
                    if len(nodes) == 1
                    else cluster.inter_node_bandwidth
                )
                self.ar_inv[s] = passes * (w - 1) / w / bw
                self.gather_inv[s] = 2 * (w - 1) / w / bw if fsdp else 0.0
        # a one-step delay's correction keeps its own buffers per parameter (the optimizer's
        # state, sharded with it), and a predicting one a weight buffer of each batch's own
        correction = correction_bytes(delay_correction) if spec.one_step_delay else (0.0, 0)
        opt = (optimizer_bytes_per_param_byte + correction[0]) / (w if shard_optimizer or fsdp else 1)
        versions = [spec.weight_versions(s, d) + correction[1] for s in range(d)]
        shard = 1 / w if fsdp else 1.0  # of the weights a replica holds
        self.param_factor = [v * shard + 1 + opt for v in versions]  # weights, gradient, state
        largest = max((b.param_bytes for b in blocks), default=0)
        self.gathered = 2 * largest * (1 - shard)  # FSDP's gathered blocks, beyond the shards
        self.in_flight = [spec.stashed_microbatches(s, d, m) for s in range(d)]
        # what a backward allocates beyond its start, one block at a time, and what a backward
        # cut in two keeps between its passes (every block of the stage): the zero-bubble
        # schedules cut every stage's but the first, at most one per micro-batch in flight; the
        # flush schedules' early inputs' gradient the backward the previous stage waits for
        self.backward_bytes = [float(b.backward_bytes) for b in blocks]
        self.cut_bytes = list(itertools.accumulate((b.cut_bytes for b in blocks), initial=0))
        cuts = self.in_flight if self.cut else [1] * d if flush and early_input_grad else [0] * d
        # under FSDP every backward runs whole (its hooks leave nothing to cut)
        self.cuts = [0 if s == 0 or fsdp else c for s, c in enumerate(cuts)]
        # the update's own buffers beside what the stage holds, one after the other: the
        # replicas' gradients averaged in one flat buffer (FSDP reduce-scatters a block's at a
        # time in its backward), then ZeRO-1's updated weights gathered (every replica's share,
        # and its own to send); the stashed micro-batches stay only without a flush
        averaged = 0.0 if w == 1 or fsdp else 1.0
        self.step_buffers = max(averaged, 1.0 + 1.0 / w if shard_optimizer and w > 1 else 0.0)

    @property
    def flush(self) -> bool:
        return self.spec.flushes

    @property
    def slots(self) -> float:
        """Micro-batch times per step: flush schedules pay the fill and drain, m + d - 1 (ZB-H1
        a third of it, m + (d - 1) / 3, with the weights' passes in the bubble); 2BW and
        PipeDream m (``ScheduleSpec.step_slots``)."""
        return self.spec.step_slots(self.d, self.m)

    def step_time(self, time_per_microbatch: float) -> float:
        """(m + d - 1) t + overhead for flush schedules; m t + the stages' updates and
        overheads, one after the other, for 2BW and PipeDream (``serial_s``)."""
        return self.slots * time_per_microbatch + self.serial_s

    def throughput(self, time_per_microbatch: float) -> float:
        """Samples per second of all replicas: w b m / step time."""
        b = self.profile.microbatch_size
        step = self.step_time(time_per_microbatch)
        return self.w * b * self.m / step if step > 0 else math.inf

    def terms(self, s: int, lo: int, hi: int, recompute: bool) -> _Terms:
        """The fields of :meth:`stage` as a plain tuple (the partition search's fast path):
        forward, backward, activation in, gradient in, all-reduce, memory."""
        fwd = self.fwd[hi] - self.fwd[lo]
        fb = self.fb[hi] - self.fb[lo]
        par = self.par[hi] - self.par[lo]
        sav = self.sav[hi] - self.sav[lo]
        first, last = s == 0, s == self.d - 1
        x_in, x_out = self.in_bytes[lo], self.out_bytes[hi - 1]
        stash = x_in * self.in_flight[s] + sav if recompute else sav * self.in_flight[s]
        buffers = (0.0 if first else x_in) + (0.0 if last else x_out)
        action = self.cluster.action_s
        bwd = fb - fwd + (fwd if recompute else 0.0) + action
        if self.cut:  # I and W: two actions (the first stage's I has nothing to do)
            bwd += action
            if not first and not recompute:
                bwd += self.cut_extra[hi] - self.cut_extra[lo]
        send = self.cluster.send_s
        held = par * self.param_factor[s] + self.gathered
        # the peak: in a backward (the stash, the backward's own buffers, what cut backwards
        # keep), or in the update (its buffers; the stash too where no flush empties it)
        backward = max(self.backward_bytes[lo:hi], default=0.0)
        # a stage that recomputes runs its backwards whole (the engine cuts none of them)
        cut = 0.0 if recompute else (self.cut_bytes[hi] - self.cut_bytes[lo]) * self.cuts[s]
        update = par * self.step_buffers + (0.0 if self.flush else stash + buffers)
        return (
            fwd + action + (0.0 if last else send),
            bwd + (0.0 if first else send),
            (0.0 if first else x_in * self.in_inv[s] + self.lat_in[s])
            + par * self.gather_inv[s],
            0.0 if last else x_out * self.out_inv[s] + self.lat_out[s],
            par * self.ar_inv[s] + self.ar_lat if self.w > 1 else 0.0,
            held + max(stash + buffers + backward + cut, update),
        )

    def time_for_throughput(self, samples_per_s: float) -> float:
        """The time per micro-batch at which this configuration delivers ``samples_per_s``."""
        b = self.profile.microbatch_size
        return (self.w * b * self.m / samples_per_s - self.serial_s) / self.slots

    def stage(self, s: int, lo: int, hi: int, recompute: bool) -> StageCost:
        """The cost of blocks ``lo .. hi - 1`` placed as stage ``s``."""
        return StageCost(*self.terms(s, lo, hi, recompute), recompute=recompute)

    def time_lower_bound(self, lo: int, hi: int, recompute: bool = False) -> float:
        """A lower bound on any stage time of blocks ``lo .. hi - 1``; grows with the segment."""
        extra = self.fwd[hi] - self.fwd[lo] if recompute else 0.0
        return self.fb[hi] - self.fb[lo] + extra

    def memory_lower_bound(self, s: int, lo: int, hi: int, recompute: bool) -> float:
        """A lower bound on the stage's memory that grows with the segment (params, saved bytes)."""
        sav = self.sav[hi] - self.sav[lo]
        return (self.par[hi] - self.par[lo]) * self.param_factor[s] + (
            sav if recompute else sav * self.in_flight[s]
        )

    def bounds(self, recompute: bool) -> tuple[float, float]:
        """Lower bounds over every partition: (time per micro-batch, largest stage memory)."""
        extra = 1.0 if recompute else 0.0
        total = self.fb[self.n] + extra * self.fwd[self.n]
        widest = max(
            self.fb[i + 1] - self.fb[i] + extra * (self.fwd[i + 1] - self.fwd[i])
            for i in range(self.n)
        )
        # the stages' parameter memory sums to at least params x the smallest factor
        memory = self.par[self.n] * min(self.param_factor) / self.d
        return max(total / self.d, widest), memory


def _prefix(rows: list[tuple[float, float, int, int]]) -> tuple[list[float], ...]:
    """Prefix sums of every column: ``out[k][i]`` is the sum of column k over rows < i."""
    columns: list[list[float]] = [[0.0] for _ in range(4)]
    for row in rows:
        for column, value in zip(columns, row, strict=True):
            column.append(column[-1] + value)
    return tuple(columns)
