"""What the planner returns: a :class:`Plan` per configuration and a ranked :class:`PlanResult`."""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from lightning_pipe2bw.planner.costmodel import Cluster
from lightning_pipe2bw.planner.target import step_multiplier
from lightning_pipe2bw.schedule.registry import schedule_spec

__all__ = ["Plan", "PlanResult"]

_GIB = float(2**30)
_TUPLES = ("balance", "recompute", "compute_s", "comm_s", "allreduce_s", "memory_bytes")


@dataclass(frozen=True)
class Plan:
    """One pipeline configuration and its predicted cost.

    ``data_parallel`` replicas of a ``depth``-stage pipeline; each replica splits its share of
    the batch into ``num_microbatches`` micro-batches of ``microbatch_size``. ``balance[s]``
    blocks (contiguous, in order) run on stage s, with activation recomputation where
    ``recompute[s]``. Per-stage ``compute_s`` (forward + backward, including the recomputed
    forward) and ``comm_s`` (incoming activation and gradient) are per micro-batch,
    ``allreduce_s`` per optimizer step, ``memory_bytes`` the stage's peak.
    ``time_per_microbatch`` is the slowest stage, ``step_time`` one optimizer step (with the
    fill and drain for the flush schedules) and ``throughput`` samples/s over all replicas.
    ``fits`` is False only for a :func:`~lightning_pipe2bw.planner.planner.predict` whose
    memory exceeds the device.
    """

    schedule: str
    data_parallel: int
    depth: int
    microbatch_size: int
    num_microbatches: int
    balance: tuple[int, ...]
    recompute: tuple[bool, ...]
    compute_s: tuple[float, ...]
    comm_s: tuple[float, ...]
    allreduce_s: tuple[float, ...]
    memory_bytes: tuple[float, ...]
    time_per_microbatch: float
    step_time: float
    throughput: float
    fits: bool = True
    # the steps its update rule needs to reach the flushed schedules' loss, over theirs; None:
    # the measured one of its rule (``planner.target``)
    step_multiplier: float | None = None

    def __post_init__(self) -> None:
        for name in _TUPLES:
            value = tuple(getattr(self, name))
            expected = self.depth * (self.stages_per_rank if name == "balance" else 1)
            if len(value) != expected:
                raise ValueError(
                    f"Plan.{name} has {len(value)} entries for depth={self.depth}; give one per stage"
                )
            object.__setattr__(self, name, value)

    @property
    def multiplier(self) -> float:
        """Its step multiplier: the given one, else the measured one of its update rule."""
        given = self.step_multiplier
        return step_multiplier(self.schedule) if given is None else given

    @property
    def target_rate(self) -> float:
        """Samples per second toward the target loss: throughput over the step multiplier (a
        plan with twice this reaches the flushed schedules' loss in half the time)."""
        return self.throughput / self.multiplier

    @property
    def stages_per_rank(self) -> int:
        """Stages each rank holds: 2 for the virtual-stage schedules (``balance`` then gives
        2d block counts, the other per-stage figures one per rank), else 1."""
        return schedule_spec(self.schedule).stages_per_rank

    @property
    def global_batch_size(self) -> int:
        return self.data_parallel * self.microbatch_size * self.num_microbatches

    @property
    def num_devices(self) -> int:
        return self.data_parallel * self.depth

    @property
    def bubble_fraction(self) -> float:
        """Idle share of a step from the fill and drain: (d - 1) / (m + d - 1) for 1F1B, 0 for
        2BW (``ScheduleSpec.bubble_fraction``)."""
        return schedule_spec(self.schedule).bubble_fraction(self.depth, self.num_microbatches)

    @property
    def recompute_label(self) -> str:
        """ "off", "on", or "k/d" stages when only some stages recompute."""
        k = sum(self.recompute)
        return "off" if k == 0 else "on" if k == self.depth else f"{k}/{self.depth}"

    def summary(self) -> str:
        """One line: the configuration and its predicted throughput."""
        return (
            f"{self.schedule} w={self.data_parallel} d={self.depth} b={self.microbatch_size} "
            f"m={self.num_microbatches} recompute={self.recompute_label} "
            f"balance={format_balance(self.balance)}: {self.throughput:.1f} samples/s"
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in _TUPLES:
            out[name] = list(out[name])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown Plan fields {unknown}; valid fields: {sorted(known)}")
        values = dict(data)
        for name in _TUPLES:
            values[name] = tuple(values[name])
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class PlanResult:
    """The best plan and the runners-up, ranked by predicted throughput toward the target loss
    (best first: ``Plan.target_rate``, throughput alone among plans of one schedule).

    ``alternatives`` excludes ``best``; :attr:`ranked` is both. ``configurations`` counts the
    (w, d, b, m, recompute) candidates the search considered, ``infeasible`` those it proved do
    not fit in memory (candidates pruned by the throughput bound count in neither).
    """

    best: Plan
    alternatives: tuple[Plan, ...]
    cluster: Cluster
    global_batch_size: int
    configurations: int = 0
    infeasible: int = 0
    search_time_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "alternatives", tuple(self.alternatives))

    @property
    def ranked(self) -> tuple[Plan, ...]:
        return (self.best, *self.alternatives)

    def to_dict(self) -> dict[str, Any]:
        return {
            "best": self.best.to_dict(),
            "alternatives": [p.to_dict() for p in self.alternatives],
            "cluster": self.cluster.to_dict(),
            "global_batch_size": self.global_batch_size,
            "configurations": self.configurations,
            "infeasible": self.infeasible,
            "search_time_s": self.search_time_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanResult:
        return cls(
            best=Plan.from_dict(data["best"]),
            alternatives=tuple(Plan.from_dict(p) for p in data["alternatives"]),
            cluster=Cluster.from_dict(data["cluster"]),
            global_batch_size=int(data["global_batch_size"]),
            configurations=int(data.get("configurations", 0)),
            infeasible=int(data.get("infeasible", 0)),
            search_time_s=float(data.get("search_time_s", 0.0)),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> PlanResult:
        return cls.from_dict(json.loads(text))

    def explain(self, width: int | None = None) -> str:
        """The ranked plans and the best plan's stages as text tables, ``width`` characters
        wide (by default 120, and 150 for the plans of several schedules, whose table has
        three more columns)."""
        c = self.cluster
        header = (
            f"{self.best.schedule} on {c.num_devices} devices ({c.num_nodes} node(s) of "
            f"{c.devices_per_node}, {c.memory_bytes / _GIB:.1f} GiB each), global batch "
            f"{self.global_batch_size}\n{self.configurations} configurations, "
            f"{self.infeasible} out of memory, searched in {self.search_time_s:.3f} s"
        )
        ranked = Table(box=box.MARKDOWN)
        mixed = len({p.schedule for p in self.ranked}) > 1  # plan(schedule="all")
        width = width if width is not None else 150 if mixed else 120
        columns = ("#", *(("schedule",) if mixed else ()), "w", "d", "b", "m", "recompute")
        for name in (*columns, "balance", "t/mb ms", "step s"):
            ranked.add_column(name, justify="left" if name in ("balance", "schedule") else "right")
        for name in ("samples/s", *(("x-steps", "to-target") if mixed else ()), "bubble",
                     "max mem GiB"):  # fmt: skip
            ranked.add_column(name, justify="right")
        for i, p in enumerate(self.ranked):
            ranked.add_row(
                str(i + 1),
                *((p.schedule,) if mixed else ()),
                str(p.data_parallel),
                str(p.depth),
                str(p.microbatch_size),
                str(p.num_microbatches),
                p.recompute_label,
                format_balance(p.balance),
                f"{p.time_per_microbatch * 1e3:.3f}",
                f"{p.step_time:.4f}",
                f"{p.throughput:.1f}",
                *(_target_cells(p, self.best) if mixed else ()),
                f"{p.bubble_fraction:.0%}",
                f"{max(p.memory_bytes) / _GIB:.2f}",
            )
        best = self.best
        stages = Table(box=box.MARKDOWN)
        for name in ("stage", "blocks", "compute ms", "comm ms", "all-reduce ms", "memory GiB"):
            stages.add_column(name, justify="right")
        stages.add_column("recompute")
        start = 0
        for s in range(best.depth):
            stop = start + best.balance[s]
            stages.add_row(
                str(s),
                f"{start}-{stop - 1}",
                f"{best.compute_s[s] * 1e3:.3f}",
                f"{best.comm_s[s] * 1e3:.3f}",
                f"{best.allreduce_s[s] * 1e3:.3f}",
                f"{best.memory_bytes[s] / _GIB:.2f}",
                "yes" if best.recompute[s] else "no",
            )
            start = stop
        return "\n".join(
            [
                _render(header, width),
                "",
                "plans, best first:",
                _render(ranked, width),
                "",
                f"best plan per stage: {best.summary()}",
                _render(stages, width),
                "",
            ]
        )


def _render(item: Table | str, width: int) -> str:
    """``item`` as plain text, without rich's blank padding lines and trailing spaces."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False)
    console.print(item)
    lines = (line.rstrip() for line in buffer.getvalue().splitlines())
    return "\n".join(line for line in lines if line)


def _target_cells(p: Plan, best: Plan) -> tuple[str, str]:
    """The step multiplier of ``p`` and its time to the target relative to ``best``'s ("-":
    its multiplier is not measured, weight stashing's)."""
    if p.target_rate <= 0:
        return "-", "-"
    return f"{p.multiplier:.2f}", f"{best.target_rate / p.target_rate:.2f}x"


def format_balance(balance: tuple[int, ...] | list[int]) -> str:
    """Run-length form of a balance: (3, 4, 4, 4, 3) -> "3 4x3 3"."""
    parts: list[str] = []
    i = 0
    while i < len(balance):
        j = i
        while j < len(balance) and balance[j] == balance[i]:
            j += 1
        parts.append(str(balance[i]) if j - i == 1 else f"{balance[i]}x{j - i}")
        i = j
    return " ".join(parts)
