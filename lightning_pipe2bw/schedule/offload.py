"""Activation offload (BPipe): pair stage s with p - 1 - s and move stashed activations across.

Under 1F1B stage s holds up to p - s micro-batches of activations and stage p - 1 - s only
s + 1. BPipe evens this out: after stage s runs F(i) it sends (``EVICT``) part of micro-batch
i's saved activations to its partner q = p - 1 - s, which holds them and sends them back
(``RETURN``) in time for s to receive them (``LOAD``) before B(i). Only the earlier stage of a
pair evicts (s < p - 1 - s); the middle stage of an odd p has no partner.

Placement, on stage lists that already carry point-to-point communication:

* evicting stage s: ``EVICT(i)`` right after F(i)'s ``SEND_F(i)`` (right after F(i) without
  one) and ``LOAD(i)`` right before ``RECV_B(i)`` (right before B(i) without one);
* partner q: ``RETURN(i)`` right before ``RECV_B(i)`` (right before B(i) on the last stage).

RETURN(i) on q then waits for an EVICT(i) that s sent right after F(i), before q could even
run F(i); and LOAD(i) on s waits for a RETURN(i) that q runs before B(i), which s's RECV_B(i)
waits for anyway. So offload adds no deadlock and, in the simulator (without ``delays``), no
wait: the makespan is that of the schedule without offload, whatever the costs.

How much moves (:func:`evict_share`). Under a 1F1B stream (``"1f1b"``, ``"2bw"``,
``"pipedream"``) stage s of p keeps ``n_s = min(p - s, m)`` micro-batches of saved activations at its peak, the last stage one: the
first stage runs out of memory long before the others. BPipe pairs stage s with its partner
``q = p - 1 - s``, which keeps ``n_q = min(s + 1, m)``: right after each forward, stage s sends a
share ``e`` of that micro-batch's saved bytes to q (EVICT), q holds them and sends them back
(RETURN) before its own backward of that micro-batch, and s takes them back (LOAD) just before
it needs them. With every micro-batch's saved bytes ``A`` equal, stage s's peak is then
``A (n_s - (n_s - 1) e)`` (the newest micro-batch is whole until it has been evicted; the
others keep ``1 - e``), and q's is at most ``A (n_q + n_s e)`` (its own, and the shares of the
micro-batches s has in flight). The *balanced share* makes the two equal:

    e = (n_s - n_q) / (2 n_s - 1),

e.g. for p = 4: 3/7 for stage 0 (peaks 4 -> 2.71 micro-batches, stage 3's 1 -> 2.71) and 1/5
for stage 1 (3 -> 2.6, stage 2's 2 -> 2.6). A budget in micro-batches ``b`` asks for
``n_s - (n_s - 1) e <= b``; a budget in bytes ``B`` is the same with ``b = B / A``, decided for
each micro-batch from its own saved bytes.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from .action import Action, ActionKind, partner
from .comm import add_communication
from .generators import Schedule, check_sizes
from .registry import schedule_spec

__all__ = [
    "ActivationBudget",
    "add_offload",
    "add_offload_schedule",
    "evict_share",
    "offload_stages",
    "stashed_microbatches",
]

_F, _B = ActionKind.FORWARD, ActionKind.BACKWARD


def stashed_microbatches(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> int:
    """How many micro-batches' saved activations stage ``stage`` holds at its peak (the
    schedule's entry, ``ScheduleSpec.stashed_microbatches``)."""
    return schedule_spec(schedule).stashed_microbatches(stage, num_stages, num_microbatches)


@dataclass(frozen=True)
class ActivationBudget:
    """What an evicting stage may keep: ``microbatches`` of its own saved activations, or
    ``bytes`` of them; neither: the balanced share (the pair's peaks equal)."""

    microbatches: float | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        if self.microbatches is not None and self.bytes is not None:
            raise ValueError(
                "give the activation budget in micro-batches or in bytes, not both "
                f"(got microbatches={self.microbatches}, bytes={self.bytes})"
            )
        mb = self.microbatches
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, (int, float)) or mb < 1):
            raise ValueError(
                f"the activation budget in micro-batches must be a number >= 1, got {mb!r}: a "
                "stage always holds the micro-batch it is computing"
            )
        nb = self.bytes
        if nb is not None and (isinstance(nb, bool) or not isinstance(nb, int) or nb <= 0):
            raise ValueError(f"the activation budget in bytes must be a positive int, got {nb!r}")


def evict_share(
    budget: ActivationBudget, stashed: int, partner_stashed: int, saved_bytes: int = 0
) -> float:
    """The share of each micro-batch's saved bytes an evicting stage sends to its partner, for
    a stage that stashes ``stashed`` micro-batches and a partner that stashes
    ``partner_stashed`` (see the module docstring); ``saved_bytes`` is the micro-batch's own
    saved bytes, needed for a budget in bytes. Between 0 and 1."""
    n = stashed
    if n <= 1:
        return 0.0
    if budget.bytes is not None:
        if saved_bytes <= 0:
            return 0.0
        share = (n - budget.bytes / saved_bytes) / (n - 1)
    elif budget.microbatches is not None:
        share = (n - budget.microbatches) / (n - 1)
    else:
        share = (n - partner_stashed) / (2 * n - 1)
    return min(max(share, 0.0), 1.0)


def offload_stages(num_stages: int) -> tuple[int, ...]:
    """The stages that can evict: every s with s < p - 1 - s, i.e. ``0 .. p // 2 - 1``.

    Empty for p = 1; for an odd p the middle stage (p - 1) / 2 is its own partner and left out.
    """
    check_sizes(num_stages, 1)
    return tuple(s for s in range(num_stages) if s < partner(s, num_stages))


def _valid(num_stages: int) -> str:
    stages = offload_stages(num_stages)
    if not stages:
        return f"none: num_stages={num_stages} has no pair of stages"
    return "use stages from " + ", ".join(str(s) for s in stages)


def _check_evicting(evicting: Collection[int], num_stages: int) -> frozenset[int]:
    """``evicting`` as a set, after checking every entry is the earlier stage of a pair."""
    p = num_stages
    out: set[int] = set()
    for s in evicting:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"evicting stages must be ints, got {s!r}; {_valid(p)}")
        if not 0 <= s < p:
            raise ValueError(f"evicting stage {s} is out of range for num_stages={p}; {_valid(p)}")
        q = partner(s, p)
        if q == s:
            raise ValueError(
                f"stage {s} is the middle stage of num_stages={p}: its partner p - 1 - s is "
                f"itself, so it cannot evict; {_valid(p)}"
            )
        if q < s:
            raise ValueError(
                f"stage {s} cannot evict: only the earlier stage of a pair (s < p - 1 - s) "
                f"evicts, and stage {s}'s partner is stage {q}; evict from stage {q} instead "
                f"({_valid(p)})"
            )
        out.add(s)
    return frozenset(out)


def add_offload(
    actions: Sequence[Action], stage: int, num_stages: int, evicting: Collection[int]
) -> list[Action]:
    """Insert stage ``stage``'s offload actions into its action list (with communication).

    ``evicting`` are the stages that evict (each must satisfy s < p - 1 - s). If ``stage`` is
    one of them: ``EVICT(i)`` right after F(i)'s ``SEND_F(i)`` (right after F(i) if the list has
    no SEND_F(i)) and ``LOAD(i)`` right before ``RECV_B(i)`` (right before B(i) if the list has
    no RECV_B(i)). If ``stage`` is the partner of an evicting stage: ``RETURN(i)`` right before
    ``RECV_B(i)``, or right before B(i) when the list has no RECV_B(i) (the last stage). Any
    other stage's list comes back unchanged. New actions copy the compute action's version.

    The rule is local: it only looks at ``actions``, which may be a window of a longer stream
    (:class:`~lightning_pipe2bw.schedule.OneFOneBStream` plus
    :func:`~lightning_pipe2bw.schedule.with_communication`). A micro-batch whose forward lies
    in an earlier window gets only its LOAD (or RETURN) here; the windows together get what
    the whole stream would. Do not apply it to forward-only lists (EVICTs without LOADs).
    """
    check_sizes(num_stages, 1)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(
            f"stage must be an int in 0..{num_stages - 1} (num_stages={num_stages}), got {stage!r}"
        )
    evictors = _check_evicting(evicting, num_stages)
    out = list(actions)
    for slot, action in enumerate(out):
        if action.is_offload:
            raise ValueError(
                f"stage {stage}'s actions already have offload actions ({action} at slot "
                f"{slot}); pass the list without them to add_offload"
            )
    if stage in evictors:
        evicts = True
    elif partner(stage, num_stages) in evictors:
        evicts = False
    else:
        return out
    version = {(a.kind, a.microbatch): a.version for a in out if a.is_compute}
    sent_f = {a.microbatch for a in out if a.kind is ActionKind.SEND_F}
    recv_b = {a.microbatch for a in out if a.kind is ActionKind.RECV_B}
    before_b = ActionKind.LOAD if evicts else ActionKind.RETURN
    placed: list[Action] = []
    for a in out:
        k = a.microbatch
        if a.kind is ActionKind.RECV_B or (a.starts_backward and k not in recv_b):
            placed.append(Action(stage, before_b, k, version.get((_B, k), a.version)))
        placed.append(a)
        if evicts and (a.kind is ActionKind.SEND_F or (a.kind is _F and k not in sent_f)):
            placed.append(Action(stage, ActionKind.EVICT, k, version.get((_F, k), a.version)))
    return placed


def add_offload_schedule(schedule: Schedule, evicting: Collection[int] | None = None) -> Schedule:
    """``schedule`` with activation offload: :func:`add_offload` applied to every stage.

    ``evicting`` defaults to every stage that can evict (:func:`offload_stages`). A
    compute-only schedule gets :func:`~lightning_pipe2bw.schedule.add_communication` first.
    The result is named ``"<name>+offload"``. Forward-only (``training=False``) schedules and
    schedules that already have offload actions are rejected.
    """
    if not schedule.training:
        raise ValueError(
            f"schedule {schedule.name!r} is forward-only (training=False): it keeps no "
            "activations for a backward, so there is nothing to offload; offload training "
            "schedules only"
        )
    p = schedule.num_stages
    evictors = offload_stages(p) if evicting is None else _check_evicting(evicting, p)
    found = schedule.find(lambda action: action.is_offload)
    if found is not None:
        s, slot, action = found
        raise ValueError(
            f"schedule {schedule.name!r} already has offload actions ({action} at "
            f"stage {s}, slot {slot}); pass the schedule without them to add_offload_schedule"
        )
    if not schedule.has_comm:
        schedule = add_communication(schedule)
    stages = [add_offload(actions, s, p, evictors) for s, actions in enumerate(schedule.stages)]
    return replace(schedule.with_stages(stages), name=f"{schedule.name}+offload")
