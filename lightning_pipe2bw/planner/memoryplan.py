"""A per-stage memory plan: which blocks keep, recompute, swap or evict their saved activations
so that every stage's stash fits a budget, at the least added time (vPipe's levers).

The model, per block b on stage s, with ``n_s`` micro-batches stashed at the stage's peak
(``schedule.offload.stashed_microbatches``) and the block's profile (``saved_bytes``,
``forward_s``, its input's bytes):

* ``keep``: ``n_s * saved`` bytes on the stage; no added time;
* ``recompute``: ``n_s * input + saved`` (checkpoint keeps the input of every micro-batch; one
  micro-batch's activations exist again during its backward); adds ``m * forward_s`` per step;
* ``swap``: ``saved`` (the micro-batch being computed, until its forward ends; the others are
  in host memory); adds ``2 m saved / host_bandwidth`` per step at most (on CUDA the copies run
  on a side stream and mostly overlap compute);
* ``evict``: ``saved`` on the stage and ``n_s * saved`` more on its partner p-1-s (only stages
  with s < p-1-s have one); adds ``2 m saved / peer_bandwidth`` at most.

:func:`plan_memory` starts from ``keep`` everywhere and, while a stage is over budget, applies
the change that frees the most bytes per second of added time (an evict only if the partner
stays within budget), so its figures are upper bounds, the same counting as the engine's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pipe2bw.partition.split import make_partition
from lightning_pipe2bw.planner.profile import Profile
from lightning_pipe2bw.schedule.offload import stashed_microbatches

__all__ = ["MemoryPlan", "plan_memory"]

LEVERS = ("recompute", "swap", "evict")


@dataclass(frozen=True)
class MemoryPlan:
    """What :func:`plan_memory` chose: ``policy`` (block index -> policy, ``keep`` left out; give
    it to ``Pipe2BWStrategy(memory_plan=...)``), each stage's predicted peak of saved bytes and
    the time the plan adds to a step on each stage."""

    policy: dict[int, str]
    stage_bytes: tuple[int, ...]
    added_s: tuple[float, ...]
    budget_bytes: int

    def explain(self) -> str:
        lines = [f"memory plan for a budget of {self.budget_bytes / 2**20:.2f} MiB per stage:"]
        for s, (nbytes, added) in enumerate(zip(self.stage_bytes, self.added_s, strict=True)):
            lines.append(
                f"  stage {s}: {nbytes / 2**20:.2f} MiB saved at the peak, +{added * 1e3:.2f} ms/step"
            )
        chosen = ", ".join(f"{b}: {p}" for b, p in sorted(self.policy.items())) or "keep all"
        lines.append(f"  blocks: {chosen}")
        return "\n".join(lines)


def plan_memory(
    profile: Profile,
    balance: Sequence[int],
    schedule: str,
    num_microbatches: int,
    budget_bytes: int,
    *,
    host_bandwidth: float = 10e9,
    peer_bandwidth: float = 10e9,
    levers: Sequence[str] = LEVERS,
) -> MemoryPlan:
    """The cheapest per-block plan (in added time) under which every stage's saved activations
    fit ``budget_bytes`` at its peak, for ``profile`` split by ``balance`` and run with
    ``schedule`` and ``num_microbatches``. ``levers`` limits the choices (e.g. ``("swap",)``).
    Raises ValueError naming the stage and the least it can reach when no plan fits."""
    partition = make_partition(len(profile.blocks), len(balance), balance)
    p, m = partition.num_stages, num_microbatches
    for lever in levers:
        if lever not in LEVERS:
            raise ValueError(f"unknown lever {lever!r}; use some of {', '.join(LEVERS)}")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    stage_of = {b: s for s in range(p) for b in partition.blocks_of(s)}
    stashed = [stashed_microbatches(schedule, s, p, m) for s in range(p)]
    inputs = [profile.input_bytes] + [blk.output_bytes for blk in profile.blocks[:-1]]
    policy = {b: "keep" for b in stage_of}

    def held(b: int, choice: str) -> tuple[int, int]:
        """(bytes on the block's stage, bytes on its partner) under ``choice``."""
        n, saved = stashed[stage_of[b]], profile.blocks[b].saved_bytes
        if choice == "keep":
            return n * saved, 0
        if choice == "recompute":
            return n * inputs[b] + saved, 0
        if choice == "swap":
            return saved, 0
        return saved, n * saved  # evict

    def cost(b: int, choice: str) -> float:
        saved = profile.blocks[b].saved_bytes
        if choice == "recompute":
            return m * profile.blocks[b].forward_s
        if choice == "swap":
            return 2 * m * saved / host_bandwidth
        if choice == "evict":
            return 2 * m * saved / peer_bandwidth
        return 0.0

    def totals() -> list[int]:
        out = [0] * p
        for b, choice in policy.items():
            own, partner = held(b, choice)
            out[stage_of[b]] += own
            out[p - 1 - stage_of[b]] += partner
        return out

    while True:
        usage = totals()
        over = [s for s in range(p) if usage[s] > budget_bytes]
        if not over:
            break
        s = max(over, key=lambda k: usage[k])
        best: tuple[float, int, str] | None = None
        for b in partition.blocks_of(s):
            for choice in levers:
                if choice == policy[b] or (choice == "evict" and not s < p - 1 - s):
                    continue
                own_before, partner_before = held(b, policy[b])
                own_after, partner_after = held(b, choice)
                freed = own_before - own_after
                if freed <= 0:
                    continue
                if choice == "evict" or policy[b] == "evict":
                    q = p - 1 - s
                    if usage[q] - partner_before + partner_after > budget_bytes:
                        continue
                added = cost(b, choice) - cost(b, policy[b])
                score = freed / max(added, 1e-12)
                if best is None or score > best[0]:
                    best = (score, b, choice)
        if best is None:
            least = sum(
                min(held(b, c)[0] for c in ("keep", *levers) if c != "evict" or s < p - 1 - s)
                for b in partition.blocks_of(s)
            )
            raise ValueError(
                f"no memory plan fits stage {s} into {budget_bytes} bytes of saved activations: "
                f"with levers {list(levers)} it needs at least {least} bytes (it stashes "
                f"{stashed[s]} micro-batches). Raise the budget, allow more levers, use more "
                "micro-batches of a smaller size, or move blocks off this stage"
            )
        _, b, choice = best
        policy[b] = choice
    per_stage = [0.0] * p
    for b, choice in policy.items():
        per_stage[stage_of[b]] += cost(b, choice)
    return MemoryPlan(
        policy={b: c for b, c in policy.items() if c != "keep"},
        stage_bytes=tuple(totals()),
        added_s=tuple(per_stage),
        budget_bytes=budget_bytes,
    )
