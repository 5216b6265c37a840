"""Schedules with several stages per rank (virtual stages).

A model cut into ``k p`` stages over p ranks: each rank holds k of them, so a micro-batch visits
every rank k times and the pipeline's fill and drain, counted in stage times, shrink k-fold.

* **Looped placement** (Megatron's interleaving): stage v on rank v % p.
  :func:`interleaved_1f1b` runs 1F1B over the rank's chunks: micro-batches in groups of p, each
  group through chunk 0, then chunk 1, ...; backwards in the same groups, chunks in reverse.
* **V placement** (k = 2): rank r holds stages r and 2p - 1 - r, so the first and the last stage
  share rank 0 and a micro-batch's forward goes down the ranks and comes back up.
  :func:`zb_v_pattern` is the zero-bubble schedule on it (Qi et al., ICLR 2024, "ZB-V"):
  backwards cut into ``I`` and ``W`` (see :mod:`.zerobubble`) in the paper's fixed order, what
  the strategy runs; :func:`zb_v` orders the same actions by list scheduling for given costs;
  :func:`dualpipe_v` is DeepSeek's DualPipe folded onto it (DualPipeV), whole backwards in its
  steady state and cut ones at its ends.

Actions carry their stage (``action.stage``); ``Schedule.placement`` says which rank holds
it, and ``Schedule.stages[r]`` is rank r's list.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from .action import Action, ActionKind
from .generators import Schedule, check_sizes, two_bw_version
from .stream import VListStream

__all__ = [
    "dualpipe_v",
    "interleaved_1f1b",
    "looped_placement",
    "two_bw_v",
    "v_placement",
    "zb_v",
    "zb_v_pattern",
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
    if lanes is None:
        lanes = _list_schedule(placement, p, stages, m, limit=2 * p, costs=costs, reserve=True)
    assert lanes is not None, "the list order with a place kept for the later stage never stalls"
    return Schedule("zb-v", stages, m, lanes, placement=placement)


def zb_v_pattern(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V in the fixed order of the zero-bubble paper (Qi et al., ICLR 2024, its ZB-V figure;
    torch's ``ScheduleZBVZeroBubble`` runs the same order): what the strategy runs for
    ``schedule="zb-v"`` when m > p (at m = p the pattern's holes cost more than the list order
    of :func:`zb_v`, which it runs there). Rank r holds stage a = r (the way down) and b = 2p - 1 - r (the way
    back up):

    1. 2 (p - r) - 1 forwards of a;
    2. r pairs: a forward of b, a forward of a;
    3. p - r times: b's forward, its ``I``, its ``W``;
    4. the steady state, while forwards are left: a's forward (while any is left), a's ``I``
       and ``W``, b's forward, ``I`` and ``W``;
    5. r pairs: a's ``I``, b's ``I``; then p - r times: a's ``I`` and its oldest owed ``W``;
       then b's owed ``W``s, then a's.

    Each ``W`` follows its ``I`` at once in the steady state, so the order does not depend on
    how long I and W take, where :func:`zb_v`'s list scheduling makes an order for given
    costs: at F : I : W = 1 : 1.28 : 0.9 (a GPT block's backward on a CPU) this order's
    simulated step is 8-15% shorter than the one made for equal costs. The pattern is laid out
    for max(m, 2p - 1) micro-batches and the actions of micro-batches past m are left out.
    Every stage runs its F, I and W in micro-batch order.
    """
    check_sizes(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    lanes = tuple(_zb_v_pattern_lane(p, m, r) for r in range(p))
    return Schedule("zb-v", 2 * p, m, lanes, placement=v_placement(p))


def _zb_v_pattern_lane(p: int, m: int, r: int) -> tuple[Action, ...]:
    """Rank r's actions of :func:`zb_v_pattern`."""
    n = max(m, 2 * p - 1)  # the pattern's micro-batches (those past m are left out)
    a, b = r, 2 * p - 1 - r
    lane: list[Action] = []
    forwards, inputs, weights = {a: 0, b: 0}, {a: 0, b: 0}, {a: 0, b: 0}

    def run(v: int, kind: ActionKind) -> None:
        count = {
            ActionKind.FORWARD: forwards,
            ActionKind.INPUT_GRAD: inputs,
            ActionKind.WEIGHT_GRAD: weights,
        }[kind]
        lane.append(Action(v, kind, count[v]))
        count[v] += 1

    def whole(v: int) -> None:  # a forward, its I and its W
        for kind in (ActionKind.FORWARD, ActionKind.INPUT_GRAD, ActionKind.WEIGHT_GRAD):
            run(v, kind)

    for _ in range(2 * (p - r) - 1):
        run(a, ActionKind.FORWARD)
    for _ in range(r):
        run(b, ActionKind.FORWARD)
        run(a, ActionKind.FORWARD)
    for _ in range(p - r):
        whole(b)
    while forwards[b] < forwards[a] or forwards[a] < n:
        if forwards[a] < n:
            run(a, ActionKind.FORWARD)
        run(a, ActionKind.INPUT_GRAD)
        run(a, ActionKind.WEIGHT_GRAD)
        whole(b)
    for _ in range(r):
        run(a, ActionKind.INPUT_GRAD)
        run(b, ActionKind.INPUT_GRAD)
    for _ in range(p - r):
        run(a, ActionKind.INPUT_GRAD)
        run(a, ActionKind.WEIGHT_GRAD)
    while weights[b] < inputs[b]:
        run(b, ActionKind.WEIGHT_GRAD)
    while weights[a] < inputs[a]:
        run(a, ActionKind.WEIGHT_GRAD)
    return tuple(action for action in lane if action.microbatch < m)


def _list_schedule(
    placement: Sequence[int],
    p: int,
    stages: int,
    m: int,
    limit: int,
    costs: tuple[float, float, float],
    reserve: bool = False,
) -> tuple[tuple[Action, ...], ...] | None:
    """Rank lanes for F, I, W of every (stage, micro-batch) by list scheduling (see
    :func:`zb_v`); None if the greedy order stalls (every rank waits: at some cost ratios the
    earlier stage's forwards fill a rank's places before the later stage's can run), which
    ``reserve`` (the last place kept for the later stage) avoids."""
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
        if not events:
            return None
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
            later = max(held_by[r])
            for v in sorted(held_by[r], reverse=True):  # F: the later stage first
                f = next_f[v]
                # with ``reserve`` the last free place is the later stage's while it has
                # forwards to run: filled by the earlier stage's, it could wait for gradients
                # that need the later's
                if reserve and v != later and held[r] == limit - 1 and next_f[later] < m:
                    continue
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


def two_bw_v(num_ranks: int, num_microbatches: int, num_batches: int = 2) -> Schedule:
    """PipeDream-2BW on a V (rank r holds stages r and 2p - 1 - r) over ``num_batches``
    batches of m micro-batches, flushed only at the end: each rank's :class:`VListStream`
    (a list schedule of the 2p stages that a Lightning step per batch can run, messages
    included), cut at each batch as the driver cuts it. Actions carry the weight version of
    their batch (:func:`two_bw_version`). Needs m >= p, as 2BW does: a batch's backwards are
    then done on every rank within the window that admits the next batch without holding the
    pipeline back (the gradient the delayed update applies is complete). Every rank holds at
    most 2p + 1 stage micro-batches, half-size ones: about 1F1B's first-stage peak (p whole
    ones), on every rank alike."""
    check_sizes(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    if m < p:
        raise ValueError(f"2BW on a V needs at least p = {p} micro-batches per batch, got m={m}")
    placement = v_placement(p)
    lanes = []
    for r in range(p):
        stream = VListStream(placement, r, m, lambda k: two_bw_version(k, m))
        lane = [a for t in range(1, num_batches + 1) for a in stream.window(t * m)]
        lanes.append((*lane, *stream.drain()))
    return Schedule("2bw-v", 2 * p, m * num_batches, tuple(lanes), placement=placement)


def dualpipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto the V placement, as torch's
    ``ScheduleDualPipeV`` runs it): rank r holds stage a = r (the way down) and stage
    b = 2p - 1 - r (the way back up). Its phases, in micro-batch order on each stage:

    1. 2 (p - r - 1) forwards of a;
    2. r + 1 pairs: a forward of a, a forward of b;
    3. p - r - 1 times: b's inputs' gradient (``I``), the oldest owed weights' gradient
       (``W``), a forward of b;
    4. m - 2p + r + 1 times: a forward of a with a whole backward of b, then a forward of b with
       a whole backward of a (DualPipe overlaps each pair's communication with the other's
       compute; the engine runs the pair one after the other);
    5. p - r - 1 times: a backward of b, then a forward of b with a backward of a;
    6. r + 1 pairs: a backward of b, a backward of a; from the middle pair on (odd ranks
       before b's, even ranks before a's) cut in two, their ``W`` owed;
    7. p - r - 1 times: the oldest owed ``W``, a backward of a (cut if the cut began);
    8. the owed ``W``s.

    Owed ``W``s run oldest first, so every stage's weights' gradients add up in micro-batch
    order, as single-device gradient accumulation adds them. Needs m >= 2p (phase 4 runs at
    least once on every rank).
    """
    check_sizes(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    if m < 2 * p:
        raise ValueError(
            f"DualPipeV needs at least as many micro-batches as stages, 2p = {2 * p}, got "
            f"m={m}; use microbatches={2 * p} or more"
        )
    lanes = tuple(_dualpipe_v_lane(p, m, r) for r in range(p))
    return Schedule("dualpipe-v", 2 * p, m, lanes, placement=v_placement(p))


def _dualpipe_v_lane(p: int, m: int, r: int) -> tuple[Action, ...]:
    """Rank r's actions of :func:`dualpipe_v`, phase by phase."""
    a, b = r, 2 * p - 1 - r
    lane: list[Action] = []
    forwards = {a: 0, b: 0}  # the next micro-batch of each stage's forward and backward
    backwards = {a: 0, b: 0}
    owed: list[Action] = []  # weights' gradients, oldest first

    def forward(v: int) -> None:
        lane.append(Action(v, ActionKind.FORWARD, forwards[v]))
        forwards[v] += 1

    def backward(v: int, cut: bool) -> None:
        mb = backwards[v]
        backwards[v] += 1
        if cut:
            lane.append(Action(v, ActionKind.INPUT_GRAD, mb))
            owed.append(Action(v, ActionKind.WEIGHT_GRAD, mb))
        else:
            lane.append(Action(v, ActionKind.BACKWARD, mb))

    def settle_one() -> None:
        if owed:
            lane.append(owed.pop(0))

    for _ in range(2 * (p - r - 1)):
        forward(a)
    for _ in range(r + 1):
        forward(a)
        forward(b)
    for _ in range(p - r - 1):
        backward(b, cut=True)
        settle_one()
        forward(b)
    for _ in range(m - 2 * p + r + 1):
        forward(a)
        backward(b, cut=False)
        forward(b)
        backward(a, cut=False)
    for _ in range(p - r - 1):
        backward(b, cut=False)
        forward(b)
        backward(a, cut=False)
    cut = False
    for i in range(r + 1):
        cut = cut or (i == (r + 1) // 2 and r % 2 == 1)
        backward(b, cut)
        cut = cut or (i == (r + 1) // 2 and r % 2 == 0)
        backward(a, cut)
    for _ in range(p - r - 1):
        settle_one()
        backward(a, cut)
    while owed:
        settle_one()
    return tuple(lane)
