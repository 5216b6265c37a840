"""Schedules with several stages per rank (virtual stages).

A model cut into ``k p`` stages over p ranks: each rank holds k of them, so a micro-batch visits
every rank k times and the pipeline's fill and drain, counted in stage times, shrink k-fold.

* **Looped placement** (Megatron's interleaving): stage v on rank v % p.
  :func:`interleaved_1f1b` runs 1F1B over the rank's chunks: micro-batches in groups of p, each
  group through chunk 0, then chunk 1, ...; backwards in the same groups, chunks in reverse.
* **V placement** (k = 2): rank r holds stages r and 2p - 1 - r, so the first and the last stage
  share rank 0 and a micro-batch's forward goes down the ranks and comes back up.
  :func:`zb_v` is the zero-bubble schedule on it (Qi et al., ICLR 2024, "ZB-V"): backwards cut
  into ``I`` and ``W`` (see :mod:`.zerobubble`), ordered by list scheduling on unit costs.

Actions carry their stage (``action.stage``); ``Schedule.placement`` says which rank holds
it, and ``Schedule.stages[r]`` is rank r's list.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from .action import Action, ActionKind
from .generators import Schedule, check_sizes

__all__ = [
    "VIRTUAL_SCHEDULES",
    "interleaved_1f1b",
    "looped_placement",
    "placement_of",
    "v_placement",
    "virtual_schedule",
    "zb_v",
]


def looped_placement(num_ranks: int, stages_per_rank: int) -> tuple[int, ...]:
    """Stage v on rank v % p."""
    return tuple(v % num_ranks for v in range(num_ranks * stages_per_rank))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """Stages r and 2p - 1 - r on rank r."""
    return tuple(v if v < num_ranks else 2 * num_ranks - 1 - v for v in range(2 * num_ranks))


def _check_chunks(stages_per_rank: int) -> None:
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int):
        raise ValueError(f"stages_per_rank must be an int, got {stages_per_rank!r}")
    if stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be >= 1, got {stages_per_rank}")


def interleaved_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Interleaved 1F1B on p ranks with k stages each (looped placement).

    Rank r's forwards run micro-batches in groups of p: group g through its chunk 0 (stage r),
    then chunk 1 (stage p + r), ...; its backwards run the same groups with the chunks in
    reverse. It runs (p - r - 1) * 2 + (k - 1) * p warm-up forwards (k = 1: 1F1B's p - r - 1),
    then alternates one forward and one backward, then drains. Needs m to be a multiple of p
    (whole groups). The bubble, in stage times, shrinks k-fold: (p - 1)(F + B) / k at stage
    costs F / k and B / k.
    """
    check_sizes(num_ranks, num_microbatches)
    _check_chunks(stages_per_rank)
    p, m, k = num_ranks, num_microbatches, stages_per_rank
    if m % p:
        raise ValueError(
            f"interleaved 1F1B runs micro-batches in groups of p={p}, got m={m}; use a multiple "
            f"of {p} (e.g. microbatches={p * max(1, round(m / p))})"
        )
    lanes = []
    for r in range(p):
        units = k * m

        def unit(u: int, backward: bool, r: int = r) -> tuple[int, int]:
            group, within = divmod(u, p * k)
            chunk = within // p
            if backward:
                chunk = k - 1 - chunk
            return chunk * p + r, group * p + within % p

        def forward(u: int) -> Action:
            stage, mb = unit(u, False)
            return Action(stage, ActionKind.FORWARD, mb)

        def backward(u: int) -> Action:
            stage, mb = unit(u, True)
            return Action(stage, ActionKind.BACKWARD, mb)

        # one chunk: 1F1B's warm-up; more: Megatron's, which keeps every rank busy while the
        # first group of p micro-batches goes through its chunks
        warmup = min(p - r - 1 if k == 1 else (p - r - 1) * 2 + (k - 1) * p, units)
        lane = [forward(u) for u in range(warmup)]
        for j in range(units - warmup):
            lane += [forward(warmup + j), backward(j)]
        lane += [backward(j) for j in range(units - warmup, units)]
        lanes.append(tuple(lane))
    return Schedule("interleaved-1f1b", p * k, m, tuple(lanes), placement=looped_placement(p, k))


def zb_v(
    num_ranks: int, num_microbatches: int, costs: tuple[float, float, float] = (1.0, 1.0, 1.0)
) -> Schedule:
    """ZB-V: the zero-bubble schedule on the V placement (rank r holds stages r and 2p - 1 - r).

    List scheduling on the costs of a stage's F, I and W (``costs``; the zero-bubble paper's
    F = I = W by default: the order depends on them, so give measured ones where they differ
    much): whenever a rank is free it runs the first of
    the ``I`` whose gradient has arrived (the later stage's first, then the oldest
    micro-batch), the ``F`` whose input has arrived (the later stage first) if the rank holds
    fewer than 2p stage-micro-batches between their F and their W (1F1B's peak, p whole-stage
    micro-batches, in half-stage units), and else its oldest owed ``W``. Each stage runs its
    F, I and W in micro-batch order, so the weights' gradients add up as single-device
    gradient accumulation adds them.
    """
    check_sizes(num_ranks, num_microbatches)
    if len(costs) != 3 or not all(isinstance(c, (int, float)) and c > 0 for c in costs):
        raise ValueError(f"costs must be three positive numbers (F, I, W), got {costs!r}")
    p, m = num_ranks, num_microbatches
    placement = v_placement(p)
    stages = 2 * p
    lanes = _list_schedule(placement, p, stages, m, limit=2 * p, costs=costs)
    return Schedule("zb-v", stages, m, lanes, placement=placement)


def _list_schedule(
    placement: Sequence[int],
    p: int,
    stages: int,
    m: int,
    limit: int,
    costs: tuple[float, float, float],
) -> tuple[tuple[Action, ...], ...]:
    """Rank lanes for F, I, W of every (stage, micro-batch) by list scheduling (see
    :func:`zb_v`)."""
    took = {
        ActionKind.FORWARD: float(costs[0]),
        ActionKind.INPUT_GRAD: float(costs[1]),
        ActionKind.WEIGHT_GRAD: float(costs[2]),
    }
    held_by = [[v for v in range(stages) if placement[v] == r] for r in range(p)]
    next_f = [0] * stages  # per stage: the next micro-batch to forward
    next_i = [0] * stages
    owed: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (stage, mb) with I done, W not
    held = [0] * p
    f_done: dict[tuple[int, int], float] = {}  # (stage, mb) -> time its F ended
    i_done: dict[tuple[int, int], float] = {}
    lanes: list[list[Action]] = [[] for _ in range(p)]
    free_at = [0.0] * p
    events = [(0.0, r) for r in range(p)]
    remaining = 3 * stages * m

    def ready(key: tuple[int, int], done: dict[tuple[int, int], float], t: float) -> bool:
        end = done.get(key)
        return end is not None and end <= t + 1e-9

    while remaining:
        t, r = heapq.heappop(events)
        if free_at[r] > t + 1e-9:
            continue
        action = None
        for v in sorted(held_by[r], reverse=True):  # I: the later stage first
            i = next_i[v]
            if i < next_f[v] and (
                ready((v, i), f_done, t) if v == stages - 1 else ready((v + 1, i), i_done, t)
            ):
                action = Action(v, ActionKind.INPUT_GRAD, i)
                next_i[v] += 1
                owed[r].append((v, i))
                i_done[(v, i)] = t + took[ActionKind.INPUT_GRAD]
                break
        if action is None and held[r] < limit:
            for v in sorted(held_by[r], reverse=True):  # F: the later stage first
                f = next_f[v]
                if f < m and (v == 0 or ready((v - 1, f), f_done, t)):
                    action = Action(v, ActionKind.FORWARD, f)
                    next_f[v] += 1
                    held[r] += 1
                    f_done[(v, f)] = t + took[ActionKind.FORWARD]
                    break
        if action is None and owed[r]:
            v, i = owed[r].pop(0)
            action = Action(v, ActionKind.WEIGHT_GRAD, i)
            held[r] -= 1
        if action is None:
            continue  # woken again when an input or a gradient arrives
        lanes[r].append(action)
        remaining -= 1
        end = t + took[action.kind]
        free_at[r] = end
        heapq.heappush(events, (end, r))
        # what it finished may let the rank of the next stage (F) or of the previous one (I) go on
        v = action.stage
        if action.kind is ActionKind.FORWARD and v + 1 < stages:
            heapq.heappush(events, (end, placement[v + 1]))
        elif action.kind is ActionKind.INPUT_GRAD and v > 0:
            heapq.heappush(events, (end, placement[v - 1]))
    return tuple(tuple(lane) for lane in lanes)


# Schedules with several stages per rank, by name (ranks, micro-batches) -> Schedule. The
# engine runs one stage per rank today, so these are not in ``SCHEDULES`` (what the strategy
# accepts) yet: the simulator, the validator and the planner's tables use them.
VIRTUAL_SCHEDULES = {
    "interleaved-1f1b": interleaved_1f1b,
    "zb-v": zb_v,
}

# the stages per rank of interleaved 1F1B when the strategy runs it
INTERLEAVED_CHUNKS = 2


def placement_of(name: str, num_ranks: int) -> tuple[int, ...] | None:
    """Where schedule ``name`` puts the stages on ``num_ranks`` ranks: the rank of each stage,
    or None for a schedule with one stage per rank."""
    if name == "interleaved-1f1b":
        return looped_placement(num_ranks, INTERLEAVED_CHUNKS)
    if name == "zb-v":
        return v_placement(num_ranks)
    return None


def virtual_schedule(name: str, num_ranks: int, num_microbatches: int) -> Schedule:
    """The compute schedule the strategy runs for virtual-stage schedule ``name``."""
    if name == "interleaved-1f1b":
        return interleaved_1f1b(num_ranks, num_microbatches, INTERLEAVED_CHUNKS)
    if name == "zb-v":
        return zb_v(num_ranks, num_microbatches)
    raise ValueError(f"{name!r} is not a schedule with several stages per rank")
