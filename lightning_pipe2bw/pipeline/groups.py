"""The process groups of a :class:`~lightning_pipe2bw.pipeline.topology.Topology`, and the
collectives the pipeline runs in them.

Creating a group is collective: every rank creates every group, in the same order, even the
groups it is not in. A group lives as long as the process and serves every Trainer call that
needs it (:func:`process_group`: one per purpose, ranks and backend). torch assumes as much: two
device meshes of the same ranks are equal in its DTensor caches, so a mesh FSDP built in an
earlier call may serve a later one; and a gloo group keeps threads that wake every few
milliseconds, so a process that made new groups for each call (a notebook, a sweep, a test pool
of ranks) would pile them up until they took a core. The groups:

* one per pipeline replica (its stages talk, clip and agree on inf checks in it) and one per
  stage (its replicas average gradients in it), at set-up, when ``data_parallel > 1``;
* a gloo group per replica for the step values the last stage delivers (with one replica: the
  default group when it is gloo, else a group made on first use);
* two two-rank groups per BPipe pair, one per direction (made on first use);
* one per replica for each set of stages that hold copies of a shared (tied) parameter (made on
  first use).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe2bw.pipeline.fsdp import is_sharded
from lightning_pipe2bw.pipeline.topology import Topology

__all__ = [
    "ProcessGroups",
    "average_over_replicas",
    "broadcast_from_last",
    "choose_backend",
    "forget_process_groups",
    "gather_stages",
    "process_group",
]

# (purpose, ranks, backend) -> the group, for the default group in _MADE_FOR (every rank makes
# the same keys in the same order, so the table is the same on every rank)
_MADE: dict[tuple[str, tuple[int, ...] | None, str | None], Any] = {}
_MADE_FOR: list[Any] = [None]


def process_group(
    purpose: str, ranks: Sequence[int] | None = None, backend: str | None = None
) -> Any:
    """The group of ``ranks`` (None: every rank) for ``purpose``, made on first use (collective:
    every rank asks for every group, in the same order, even those it is not in) and kept for
    the process's later calls. ``purpose`` keeps apart groups of the same ranks whose
    collectives must not interleave (a pipeline's, its step values', 2BW's clipping norms')."""
    world = dist.group.WORLD
    if _MADE_FOR[0] is not world:  # a new default group: the old one took its subgroups along
        _MADE.clear()
        _MADE_FOR[0] = world
    key = (purpose, None if ranks is None else tuple(ranks), backend)
    if key not in _MADE:
        _MADE[key] = dist.new_group(None if ranks is None else list(ranks), backend=backend)
    return _MADE[key]


def forget_process_groups() -> None:
    """Make every group anew from the next call on: after a call that failed, a group may hold
    a collective that never finished (the failed call's groups are left to it, not destroyed:
    a failure notice may still travel in them). Every rank of a failed call forgets."""
    _MADE.clear()


def choose_backend(devices: Sequence[torch.device], asked: str | None, default: str) -> str:
    """The process group's backend for stages on ``devices`` (this node's, one per process):
    ``asked`` if given, else ``default`` (NCCL on CUDA, gloo on CPU), except where several
    stage processes share one GPU. NCCL refuses two ranks on one device, so they run on gloo
    and exchange activations and gradients through host memory; asking for NCCL there is an
    error that says so."""
    shared = sorted(
        {str(d) for d in devices if d.type != "cpu" and sum(1 for e in devices if e == d) > 1}
    )
    if not shared:
        return asked or default
    if asked is None:
        return "gloo"
    if "nccl" in asked.lower():
        counts = ", ".join(f"{d} {sum(1 for e in devices if str(e) == d)}" for d in shared)
        raise ValueError(
            f"process_group_backend={asked!r}, but several stage processes share a GPU "
            f"({counts}) and NCCL refuses two ranks on one device; leave process_group_backend "
            "unset or set it to 'gloo' (the stages then exchange through host memory), or give "
            "every stage a GPU of its own"
        )
    return asked


class ProcessGroups:
    """This rank's groups (``None``: the default group, or none needed)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.pipeline: Any = None  # this replica's pipeline (None: the whole world is one)
        self.stage: Any = None  # this stage's replicas (None: no data parallelism)
        self._values: Any = None  # gloo: the step values of asynchronous schedules
        self._metrics: Any = None  # the last stage of every replica: where metrics live
        self._offload: dict[tuple[int, int], Any] = {}  # (src rank, dst rank) -> two-rank group
        self._ties: dict[tuple[int, ...], Any] = {}  # stages -> this replica's group of them
        self._norms: Any = None  # 2BW's clipping norms, posted ahead (one pipeline only)
        self._has_norms = False

    @classmethod
    def create(cls, topology: Topology) -> ProcessGroups:
        """The groups of the 2D mesh (collective)."""
        groups = cls(topology)
        w, d = topology.data_parallel, topology.num_stages
        if w == 1:  # one pipeline: the default group; the value group is made on first use
            return groups
        for replica in range(w):
            ranks = sorted(topology.pipeline_ranks(replica))
            group = process_group("pipeline", ranks)
            values = process_group("values", ranks, backend="gloo") if d > 1 else None
            if replica == topology.replica:
                groups.pipeline, groups._values = group, values
        for stage in range(d):
            group = process_group("stage", topology.stage_ranks(stage))
            if stage == topology.stage:
                groups.stage = group
        return groups

    def values(self) -> Any:
        """The gloo group this pipeline's step values travel in: the default group when it is
        gloo and holds one pipeline (None), else a group made on first use (collective: every
        rank sets up the same schedule, so every rank asks at the same point)."""
        if self._values is None and dist.get_backend() != "gloo":
            self._values = process_group("values", backend="gloo")
        return self._values

    def norms(self) -> Any:
        """A group of the one pipeline's ranks that carries nothing but 2BW's clipping norms,
        each posted as soon as a stage's gradient is complete (``seam.agreement.NormsAhead``):
        collectives of their own, so that no other collective can come between them in another
        order on another rank (collective on first use: every rank asks at the same point of
        set-up)."""
        if self.topology.data_parallel != 1:
            raise RuntimeError("the clipping norms' group serves one pipeline (data_parallel=1)")
        if not self._has_norms:
            self._norms, self._has_norms = process_group("norms"), True
        return self._norms

    def metrics(self) -> Any:
        """The group of the last stage of every replica, in which torchmetrics sync (collective
        on first use: every rank asks at the same point of set-up)."""
        if self._metrics is None:
            t = self.topology
            last = t.place_of(t.num_virtual - 1)
            ranks = sorted(t.rank_of_stage(last, r) for r in range(t.data_parallel))
            self._metrics = process_group("metrics", ranks)
        return self._metrics

    def offload(self, evicting: Iterable[int]) -> None:
        """Make the two-rank groups of every BPipe pair whose earlier stage is in ``evicting``,
        in every replica (collective; once per pair and direction)."""
        t = self.topology
        for replica in range(t.data_parallel):
            for s in sorted(evicting):
                a, b = t.rank_of_stage(s, replica), t.rank_of_stage(t.partner(s), replica)
                for pair in ((a, b), (b, a)):
                    if pair not in self._offload:  # collective: all ranks, same order
                        self._offload[pair] = process_group(f"offload {pair}", sorted(pair))

    def tie(self, stages: tuple[int, ...]) -> Any:
        """The group of ``stages`` of this rank's replica, which hold copies of one parameter
        (collective on first use: every rank finds the same ties at the same point, and makes
        the group of every replica, in order)."""
        if stages not in self._ties:
            t = self.topology
            for replica in range(t.data_parallel):
                group = process_group("tie", sorted(t.rank_of_stage(s, replica) for s in stages))
                if replica == t.replica:
                    self._ties[stages] = group
        return self._ties[stages]

    def offload_pair(self, src: int, dst: int) -> Any:
        """The group that carries activations from rank ``src`` to rank ``dst``."""
        return self._offload[(src, dst)]


def average_over_replicas(params: Iterable[Tensor], group: Any, replicas: int) -> None:
    """Average the gradients of ``params`` (those that have one) with the stage's replicas: one
    all-reduce per dtype over ``group``, on a flat buffer. Every replica holds the same
    parameters with gradients, so the buffers line up. A no-op without data parallelism.
    Gradients FSDP shards (``fsdp=True``) were averaged by its reduce-scatter and are left out."""
    if group is None:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in params:
        if p.grad is not None and not is_sharded(p.grad):
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= replicas
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def broadcast_from_last(obj: Any, topology: Topology, groups: ProcessGroups) -> Any:
    """``obj`` from the last stage of this rank's pipeline on every stage of it (collective
    along the pipeline; ``obj`` itself with one stage)."""
    if topology.num_stages == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=topology.last_rank, group=groups.pipeline)
    return box[0]


def gather_stages(obj: Any, topology: Topology, groups: ProcessGroups) -> list[Any]:
    """Every stage's ``obj`` of this rank's pipeline, on every stage of it, in stage order
    (collective along the pipeline)."""
    if topology.num_stages == 1:
        return [obj]
    box: list[Any] = [None] * topology.num_stages
    dist.all_gather_object(box, (topology.stage, obj), group=groups.pipeline)
    return [value for _, value in sorted(box, key=lambda item: item[0])]
