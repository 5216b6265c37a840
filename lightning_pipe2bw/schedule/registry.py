"""Every training schedule, one entry each: what the other layers ask about a schedule.

A schedule is an entry of :data:`REGISTRY` (a :class:`ScheduleSpec`), which answers for itself:
whether it flushes or delays (and by which rule), where its stages sit and how many a rank holds,
how many weight versions a stage keeps, which micro-batch counts it runs, how many
micro-batches a stage stashes at its peak, its bubble, which delay corrections and 2BW options
it takes, and its generator. No module outside ``schedule/``
compares a schedule's name; adding a schedule is one entry here plus its generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .generators import Schedule, check_sizes, gpipe, one_f_one_b, pipedream, two_bw
from .virtual import (
    dualpipe_v,
    interleaved_1f1b,
    looped_placement,
    two_bw_v,
    v_placement,
    zb_v,
    zb_v_pattern,
)
from .zerobubble import zb_h1

__all__ = [
    "REGISTRY",
    "SCHEDULES",
    "VIRTUAL_SCHEDULES",
    "ScheduleSpec",
    "get_schedule",
    "names_where",
    "placement_of",
    "schedule_spec",
    "virtual_schedule",
]

# how a schedule's weights move between batches: "none" flushes after every batch (one
# device's gradient accumulation); "step" is PipeDream-2BW's one-step delay, W(t+1) = W(t) -
# U(grad f(W(t-1))), two versions per stage; "stash" is PipeDream's weight stashing, each stage
# updating on its own as soon as it has a batch's gradient
Delay = Literal["none", "step", "stash"]
Placement = Literal["one", "looped", "v"]
# a stage's peak of stashed micro-batches: "all" m (every forward before the first backward),
# "depth" min(p, m) on every stage, "rank" stage s's 1F1B warm-up, min(p - s, m) (p - s without
# a flush, where batches overlap)
Stash = Literal["all", "depth", "rank"]
# the stages per rank of interleaved 1F1B when the strategy runs it
INTERLEAVED_CHUNKS = 2


@dataclass(frozen=True)
class ScheduleSpec:
    """One training schedule.

    ``build(ranks, m)`` makes its compute schedule. ``placement``: one stage per rank, stages
    looped over the ranks (rank r holds stages r, r + p, ...) or on a V (rank r holds stages r
    and 2p - 1 - r). ``cut_backward``: every backward is cut into an inputs' and a weights'
    pass (I and W). ``min_microbatches_per_rank`` and ``microbatches_multiple_of_ranks``: the
    micro-batch counts it runs on p ranks. ``stash``: a stage's peak of stashed micro-batches.
    ``fill_slots``: the fill and drain a step pays, in micro-batch times per rank beyond the
    first (d - 1 of them for 1F1B; ZB-H1 a third, its weights' passes in the bubble; 0 without a
    flush, or on a V).
    """

    name: str
    # (ranks, m) -> Schedule; 2BW's and PipeDream's also take the number of batches
    build: Callable[..., Schedule]
    delay: Delay = "none"
    placement: Placement = "one"
    cut_backward: bool = False
    min_microbatches_per_rank: int = 0
    microbatches_multiple_of_ranks: bool = False
    stash: Stash = "rank"
    fill_slots: float = 1.0

    # ------------------------------------------------------------------ how it updates
    @property
    def flushes(self) -> bool:
        """Whether every batch is drained before the next starts (its update equals one
        device's gradient accumulation)."""
        return self.delay == "none"

    @property
    def asynchronous(self) -> bool:
        """Whether batches follow one another without a flush (2BW, PipeDream)."""
        return not self.flushes

    @property
    def one_step_delay(self) -> bool:
        """PipeDream-2BW's rule: a default delay correction, a synchronous start."""
        return self.delay == "step"

    @property
    def updates_per_stage(self) -> bool:
        """Whether each stage applies its update on its own, mid-pipeline (weight stashing): no
        step at which replicas average, a norm is taken over every stage, or copies of a shared
        parameter are updated together."""
        return self.delay == "stash"

    @property
    def takes_corrections(self) -> bool:
        """Whether its gradients are delayed, so that a delay correction has something to do."""
        return self.delay != "none"

    @property
    def takes_predictions(self) -> bool:
        """Whether a correction that evaluates a batch at predicted weights applies: it needs a
        delay of exactly one update on every stage (2BW)."""
        return self.delay == "step"

    @property
    def fresh_last_stage_problem(self) -> str | None:
        """Why its last stage cannot run without the delay (``fresh_last_stage``), or None
        when it can."""
        if self.delay == "none":
            return "it flushes the pipeline after every batch, so no stage is behind"
        if self.delay == "stash":
            return "under weight stashing the last stage is never behind already"
        if self.placement != "one":
            return (
                "on a V the last stage shares its rank and its update with the first, which needs "
                "the delay"
            )
        return None

    def weight_versions(self, stage: int, num_stages: int) -> int:
        """The weight versions stage ``stage`` of ``num_stages`` keeps: one when flushed, two
        under 2BW, p - s under weight stashing."""
        if self.delay == "step":
            return 2
        if self.delay == "stash":
            return num_stages - stage
        return 1

    # ------------------------------------------------------------------ where its stages sit
    @property
    def stages_per_rank(self) -> int:
        return 1 if self.placement == "one" else 2

    @property
    def virtual(self) -> bool:
        """Whether a rank holds several stages."""
        return self.placement != "one"

    def placement_for(self, num_ranks: int) -> tuple[int, ...] | None:
        """The rank of each stage on ``num_ranks`` ranks, or None with one stage per rank."""
        if self.placement == "looped":
            return looped_placement(num_ranks, INTERLEAVED_CHUNKS)
        if self.placement == "v":
            return v_placement(num_ranks)
        return None

    # ------------------------------------------------------------------ micro-batches
    def min_microbatches(self, num_ranks: int) -> int:
        return max(1, self.min_microbatches_per_rank * num_ranks)

    def microbatch_problem(self, m: int, num_ranks: int) -> str | None:
        """Why it cannot run ``m`` micro-batches per batch on ``num_ranks`` ranks, as the
        planner says it (None: it can); :meth:`microbatch_message` is the strategy's error."""
        p = num_ranks
        if self.microbatches_multiple_of_ranks and m % p:
            return f"{self.name} needs m a multiple of d, got m={m}"
        if m < self.min_microbatches(p) and self.min_microbatches_per_rank > 0:
            need = (
                "d" if self.min_microbatches_per_rank == 1 else f"{self.min_microbatches_per_rank}d"
            )
            return f"{self.name} needs m >= {need}, got m={m}"
        return None

    def microbatch_message(self, m: int, num_ranks: int) -> str | None:
        """The strategy's error for ``microbatches=m`` on ``num_ranks`` ranks, with the way
        out (None: it runs)."""
        p, name = num_ranks, self.name
        if self.microbatches_multiple_of_ranks and m % p:
            return (
                f"schedule={name!r} runs micro-batches in groups of the pipeline's {p} ranks, got "
                f"microbatches={m}; use a multiple of {p} (e.g. "
                f"microbatches={p * max(1, round(m / p))})"
            )
        need = self.min_microbatches(p)
        if m >= need or self.min_microbatches_per_rank == 0:
            return None
        if self.virtual and self.stages_per_rank * p == need:
            return (
                f"schedule={name!r} needs at least as many micro-batches as its {need} stages "
                f"(two per rank), got microbatches={m}; use microbatches={need} or more"
            )
        return (
            f"schedule={name!r} needs at least as many micro-batches as stages, got "
            f"microbatches={m} for {p} stages; use microbatches={need} or more"
        )

    # ------------------------------------------------------------------ memory and time
    def stashed_microbatches(self, stage: int, num_stages: int, num_microbatches: int) -> int:
        """How many micro-batches' saved activations stage ``stage`` holds at its peak."""
        if self.stash == "all":
            return num_microbatches
        if self.stash == "depth":
            return min(num_stages, num_microbatches)
        if self.flushes:
            return min(num_stages - stage, num_microbatches)
        return num_stages - stage  # batches overlap: the warm-up's forwards are always in flight

    @property
    def stashes_everything(self) -> bool:
        """Whether every stage stashes all m micro-batches (BPipe's balanced share then has
        nothing to move)."""
        return self.stash == "all"

    def step_slots(self, depth: int, num_microbatches: int) -> float:
        """Micro-batch times a step takes on ``depth`` ranks: m plus the fill and drain."""
        return num_microbatches + self.fill_slots * (depth - 1)

    def bubble_fraction(self, depth: int, num_microbatches: int) -> float:
        """The idle share of a step from the fill and drain (0 without a flush; ZB-V's is near
        0 at m >= 2d, ``docs/schedules.md``)."""
        fill = self.fill_slots * (depth - 1)
        return fill / (num_microbatches + fill) if fill else 0.0


def _zb_v(num_ranks: int, num_microbatches: int) -> Schedule:
    # the fixed order, laid out for 2p - 1 micro-batches or more, leaves holes at m = p, where
    # the list order fills them (the simulator, at any F : I : W)
    if num_microbatches > num_ranks:
        return zb_v_pattern(num_ranks, num_microbatches)
    return zb_v(num_ranks, num_microbatches)


def _interleaved(num_ranks: int, num_microbatches: int) -> Schedule:
    return interleaved_1f1b(num_ranks, num_microbatches, INTERLEAVED_CHUNKS)


# Registering a new schedule is one entry here (and its generator).
REGISTRY: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", gpipe, stash="all"),
        ScheduleSpec("1f1b", one_f_one_b),
        ScheduleSpec("2bw", two_bw, delay="step", min_microbatches_per_rank=1, fill_slots=0.0),
        ScheduleSpec("pipedream", pipedream, delay="stash", fill_slots=0.0),
        # stage s holds back s weights' passes: 1F1B's peak on every stage
        ScheduleSpec("zb-h1", zb_h1, cut_backward=True, stash="depth", fill_slots=1 / 3),
        ScheduleSpec(
            "interleaved-1f1b", _interleaved, placement="looped",
            microbatches_multiple_of_ranks=True, fill_slots=0.5,
        ),
        ScheduleSpec("zb-v", _zb_v, placement="v", cut_backward=True, fill_slots=0.0),
        ScheduleSpec(
            "2bw-v", two_bw_v, delay="step", placement="v", min_microbatches_per_rank=1,
            fill_slots=0.0,
        ),
        ScheduleSpec(
            "dualpipe-v", dualpipe_v, placement="v", cut_backward=True,
            min_microbatches_per_rank=2, fill_slots=0.0,
        ),
    )
}  # fmt: skip

# the generators of the schedules with one stage per rank, and of those with several
SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    name: spec.build for name, spec in REGISTRY.items() if not spec.virtual
}
VIRTUAL_SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    name: spec.build for name, spec in REGISTRY.items() if spec.virtual
}


def schedule_spec(name: str) -> ScheduleSpec:
    """The entry of schedule ``name``; a ValueError listing the valid names if none."""
    spec = REGISTRY.get(name)
    if spec is None:
        valid = ", ".join(repr(key) for key in REGISTRY)
        raise ValueError(f"unknown schedule {name!r}; valid schedules: {valid}")
    return spec


def names_where(predicate: Callable[[ScheduleSpec], bool], joined: str | None = None) -> Any:
    """The names of the schedules whose entry satisfies ``predicate``, in the registry's order;
    with ``joined`` (``"or"``, ``"and"``) as text for a message: ``'2bw' or '2bw-v'``."""
    names = tuple(name for name, spec in REGISTRY.items() if predicate(spec))
    if joined is None:
        return names
    quoted = [repr(name) for name in names]
    if len(quoted) < 2:
        return "".join(quoted)
    return f"{', '.join(quoted[:-1])} {joined} {quoted[-1]}"


def get_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Build the registered schedule ``name`` (one stage per rank) for ``num_stages`` x
    ``num_microbatches``."""
    generator = SCHEDULES.get(name)
    if generator is None:
        valid = ", ".join(repr(key) for key in SCHEDULES)
        raise ValueError(f"unknown schedule {name!r}; valid schedules: {valid}")
    check_sizes(num_stages, num_microbatches)
    return generator(num_stages, num_microbatches)


def placement_of(name: str, num_ranks: int) -> tuple[int, ...] | None:
    """Where schedule ``name`` puts the stages on ``num_ranks`` ranks: the rank of each stage,
    or None for a schedule with one stage per rank."""
    return schedule_spec(name).placement_for(num_ranks)


def virtual_schedule(name: str, num_ranks: int, num_microbatches: int) -> Schedule:
    """The compute schedule the strategy runs for virtual-stage schedule ``name``."""
    spec = REGISTRY.get(name)
    if spec is None or not spec.virtual or spec.asynchronous:
        raise ValueError(f"{name!r} is not a schedule with several stages per rank")
    return spec.build(num_ranks, num_microbatches)
