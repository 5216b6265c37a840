"""Schedule container, compute-only schedule generators and the schedule registry."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace

from .action import Action, ActionKind
from .stream import OneFOneBStream

__all__ = [
    "Schedule",
    "check_sizes",
    "format_grid",
    "forward_only",
    "gpipe",
    "one_f_one_b",
    "pipedream",
    "two_bw",
    "two_bw_version",
]


def check_sizes(num_stages: int, num_microbatches: int) -> None:
    """Raise ValueError unless both sizes are integers >= 1."""
    for label, value, fix in (
        ("num_stages", num_stages, "use at least one pipeline stage"),
        ("num_microbatches", num_microbatches, "split the batch into at least one micro-batch"),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{label} must be an int, got {value!r}; {fix}")
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}; {fix}")


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists: ``stages[r]`` is what rank ``r`` executes, in order.

    With one stage per rank (``placement`` None) rank s runs stage s. With virtual stages,
    ``placement[v]`` is the rank that holds stage v (looped: v % p; a V: v and 2p - 1 - v on
    rank v), and a rank's list interleaves the actions of its stages (``action.stage`` is the
    stage). ``num_stages`` counts stages, :attr:`num_ranks` lists.

    ``training`` schedules run one F and one backward (B, or I then W) per micro-batch on every
    stage; ``training=False`` marks a forward-only (evaluation/prediction) schedule.
    """

    name: str
    num_stages: int
    num_microbatches: int
    stages: tuple[tuple[Action, ...], ...]
    training: bool = True
    placement: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_sizes(self.num_stages, self.num_microbatches)
        # Normalise lists to tuples so schedules stay hashable and immutable.
        object.__setattr__(self, "stages", tuple(tuple(actions) for actions in self.stages))
        if self.placement is None:
            if len(self.stages) != self.num_stages:
                raise ValueError(
                    f"schedule {self.name!r} has {len(self.stages)} action lists but "
                    f"num_stages={self.num_stages}; give exactly one action list per stage"
                )
            return
        placement = tuple(self.placement)
        object.__setattr__(self, "placement", placement)
        ranks = len(self.stages)
        if len(placement) != self.num_stages or sorted(set(placement)) != list(range(ranks)):
            raise ValueError(
                f"schedule {self.name!r}: placement {list(placement)} must give a rank in "
                f"0..{ranks - 1} to each of its {self.num_stages} stages, every rank (action "
                "list) holding at least one"
            )

    @property
    def num_ranks(self) -> int:
        """How many ranks (action lists) run the schedule."""
        return len(self.stages)

    def rank_of(self, stage: int) -> int:
        """The rank (action list) that holds ``stage`` (a stage out of range stays itself: no
        rank holds it)."""
        if self.placement is None or not 0 <= stage < self.num_stages:
            return stage
        return self.placement[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, in order."""
        if self.placement is None:
            return (rank,)
        return tuple(v for v, r in enumerate(self.placement) if r == rank)

    def crosses(self, stage: int, other: int) -> bool:
        """Whether data from ``stage`` to ``other`` (a neighbour) travels between ranks: False
        when ``other`` does not exist or sits on the same rank (a local hand-over)."""
        if not 0 <= other < self.num_stages:
            return False
        return self.rank_of(stage) != self.rank_of(other)

    @property
    def has_comm(self) -> bool:
        """True if any stage contains a send or receive action."""
        return any(action.is_comm for actions in self.stages for action in actions)

    def find(self, predicate: Callable[[Action], bool]) -> tuple[int, int, Action] | None:
        """``(stage, slot, action)`` of the first action (stage by stage) that ``predicate``
        accepts, or None."""
        for s, actions in enumerate(self.stages):
            for slot, action in enumerate(actions):
                if predicate(action):
                    return s, slot, action
        return None

    def with_stages(self, stages: Iterable[Iterable[Action]]) -> Schedule:
        """A copy of this schedule with the action lists replaced."""
        return replace(self, stages=tuple(tuple(actions) for actions in stages))

    def __str__(self) -> str:
        ranks = "" if self.placement is None else f" on {self.num_ranks} ranks"
        header = (
            f"schedule {self.name!r}: {self.num_stages} stages{ranks}, "
            f"{self.num_microbatches} micro-batches{'' if self.training else ', forward-only'}"
        )
        return f"{header}\n{format_grid(self)}"


def format_grid(schedule: Schedule, mark: Collection[tuple[int, int]] | None = None) -> str:
    """Stage-by-slot (rank-by-slot with virtual stages) table of compact actions; cells
    ``(stage, slot)`` in ``mark`` get [brackets].

    Columns are action slots (the position in the stage's list), not wall-clock time.
    """
    marked = set(mark or ())
    cells = [
        [f"[{action}]" if (s, i) in marked else f" {action} " for i, action in enumerate(row)]
        for s, row in enumerate(schedule.stages)
    ]
    num_slots = max((len(row) for row in cells), default=0)
    width = max((len(cell) for row in cells for cell in row), default=1)
    lane = "stage" if schedule.placement is None else "rank"
    labels = [f"{lane} {s}" for s in range(schedule.num_ranks)]
    label_width = 1 + max(len(label) for label in [*labels, "slot"])  # room for a "[" mark
    header = "slot".ljust(label_width) + "".join(f" {i}".ljust(width) for i in range(num_slots))
    lines = [header.rstrip()]
    for label, row in zip(labels, cells, strict=True):
        lines.append((label.ljust(label_width) + "".join(c.ljust(width) for c in row)).rstrip())
    return "\n".join(lines)


def _forward(stage: int, microbatch: int) -> Action:
    return Action(stage, ActionKind.FORWARD, microbatch)


def _backward(stage: int, microbatch: int) -> Action:
    return Action(stage, ActionKind.BACKWARD, microbatch)


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards F0..F(m-1), then all backwards B0..B(m-1).

    Backwards run in forward order (not reversed): gradients then flow through the pipeline in
    the same order the activations did, which keeps every channel FIFO-consistent and gives the
    textbook makespan (m + p - 1) * (F + B).
    """
    check_sizes(num_stages, num_microbatches)
    stages = tuple(
        tuple(_forward(s, i) for i in range(num_microbatches))
        + tuple(_backward(s, i) for i in range(num_microbatches))
        for s in range(num_stages)
    )
    return Schedule("gpipe", num_stages, num_microbatches, stages)


def _one_f_one_b_stage(stage: int, num_stages: int, num_microbatches: int) -> tuple[Action, ...]:
    # the stream's warm-up is cut at m when m < p - s - 1, exactly min(p - s - 1, m) forwards
    stream = OneFOneBStream(stage, num_stages)
    return (*stream.window(num_microbatches), *stream.drain())


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream-Flush (1F1B): min(p - s - 1, m) warm-up forwards, then F/B pairs, then drain.

    At most min(p - s, m) micro-batches are in flight on stage s, versus m for GPipe, with the
    same makespan.
    """
    check_sizes(num_stages, num_microbatches)
    stages = tuple(_one_f_one_b_stage(s, num_stages, num_microbatches) for s in range(num_stages))
    return Schedule("1f1b", num_stages, num_microbatches, stages)


def forward_only(
    num_stages: int, num_microbatches: int, placement: tuple[int, ...] | None = None
) -> Schedule:
    """Evaluation/prediction schedule: every stage runs F0..F(m-1) and no backward.

    With virtual stages (``placement``, see :class:`Schedule`), each rank runs its stages one
    after the other, every micro-batch through the first, then through the next: in stage
    order, the order of the whole pipeline, so no rank waits for one that waits for it.

    Not in the registry (``schedule.registry``, training schedules); the result has ``training=False``.
    """
    check_sizes(num_stages, num_microbatches)
    if placement is not None:
        ranks = max(placement, default=-1) + 1
        lanes = tuple(
            tuple(
                _forward(v, i)
                for v in range(num_stages)
                if placement[v] == r
                for i in range(num_microbatches)
            )
            for r in range(ranks)
        )
        return Schedule(
            "forward", num_stages, num_microbatches, lanes, training=False, placement=placement
        )
    stages = tuple(
        tuple(_forward(s, i) for i in range(num_microbatches)) for s in range(num_stages)
    )
    return Schedule("forward", num_stages, num_microbatches, stages, training=False)


def two_bw_version(microbatch: int, num_microbatches: int) -> int:
    """PipeDream-2BW's rule: batch t = microbatch // m runs with weight version max(t - 1, 0)
    (the weights after t - 1 updates) for its forward and its backward."""
    return max(microbatch // num_microbatches - 1, 0)


def two_bw(num_stages: int, num_microbatches: int, num_batches: int = 2) -> Schedule:
    """PipeDream-2BW over ``num_batches`` batches of m micro-batches, flushed only at the end.

    1F1B without a flush between batches: the warm-up happens once, then forward/backward
    pairs run straight across batch boundaries, so the bubble after warm-up is zero. Actions
    carry the weight version of their batch (:func:`two_bw_version`); a stage never needs more
    than two versions. Needs m >= p so that one batch covers a stage's warm-up.
    """
    check_sizes(num_stages, num_microbatches)
    if num_microbatches < num_stages:
        raise ValueError(
            f"2BW needs at least as many micro-batches as stages (m >= p), got m={num_microbatches} "
            f"for p={num_stages}; use microbatches={num_stages} or more"
        )
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
        raise ValueError(f"num_batches must be a positive int, got {num_batches!r}")
    n = num_batches * num_microbatches
    stages = []
    for s in range(num_stages):
        stream = OneFOneBStream(s, num_stages, lambda k: two_bw_version(k, num_microbatches))
        stages.append((*stream.window(n), *stream.drain()))
    return Schedule("2bw", num_stages, n, tuple(stages))


def pipedream(num_stages: int, num_microbatches: int, num_batches: int = 2) -> Schedule:
    """PipeDream (weight stashing) over ``num_batches`` batches, flushed only at the end: the
    same 1F1B stream as 2BW; the versions are decided at run time (a forward takes the newest
    weights of its stage, its backward the same), so actions carry none."""
    check_sizes(num_stages, num_microbatches)
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
        raise ValueError(f"num_batches must be a positive int, got {num_batches!r}")
    n = num_batches * num_microbatches
    stages = []
    for s in range(num_stages):
        stream = OneFOneBStream(s, num_stages)
        stages.append((*stream.window(n), *stream.drain()))
    return Schedule("pipedream", num_stages, n, tuple(stages))
