"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

A backward is two actions: ``I`` computes the gradient of the stage's inputs, which the previous
stage waits for, and ``W`` the gradients of the stage's weights, which nobody waits for. 1F1B
runs them together as ``B``; its bubble, (p - 1)(F + B) per step, is the time the stages spend
waiting for each other's forwards and backwards at the start and the end of a step. Deferring
``W`` lets a stage fill the end of that wait with work it owes anyway.

ZB-H1 keeps 1F1B's peak activation memory, ``min(p, m)`` micro-batches (1F1B's on its first
stage), on every stage. Stage s runs 1F1B's order with each ``B`` cut into ``I`` then ``W``, and
holds back ``s`` of its ``W``s: in the steady state the ``W`` that follows a pair ``F, I`` is the
one of ``s`` micro-batches before, and the ``s`` it still owes run after its last ``I``. The
later stages, which 1F1B leaves idle at the end of a step (waiting for the earlier stages to
finish), defer the most, and their ``I``s reach the earlier stages without waiting behind
``W``s. With F = I = W the step takes ``3m + p - 1`` units against 1F1B's ``3m + 3(p - 1)``:
a third of the bubble, (p - 1)(F + I - W) against (p - 1)(F + I + W).

Every action list runs its ``F``, ``I`` and ``W`` in micro-batch order, so the weights'
gradients add up in the order of single-device gradient accumulation.
"""

from __future__ import annotations

from .action import Action, ActionKind
from .generators import Schedule, check_sizes

__all__ = ["zb_h1"]


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 for ``num_stages`` x ``num_microbatches`` (see the module notes)."""
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    return Schedule("zb-h1", p, m, tuple(tuple(_zb_h1_stage(s, p, m)) for s in range(p)))


def _zb_h1_stage(s: int, p: int, m: int) -> list[Action]:
    warmup = min(p - s - 1, m)
    out = [Action(s, ActionKind.FORWARD, i) for i in range(warmup)]
    owed: list[int] = []  # I done, W not, oldest first

    def input_grad(i: int) -> None:
        out.append(Action(s, ActionKind.INPUT_GRAD, i))
        owed.append(i)
        if len(owed) > s:  # hold back s of them
            out.append(Action(s, ActionKind.WEIGHT_GRAD, owed.pop(0)))

    for k in range(m - warmup):  # the steady state: F, I (and the W of s micro-batches ago)
        out.append(Action(s, ActionKind.FORWARD, warmup + k))
        input_grad(k)
    for i in range(m - warmup, m):  # the cool-down: the I still owed
        input_grad(i)
    out += [Action(s, ActionKind.WEIGHT_GRAD, i) for i in owed]
    return out
