"""Timing a body's blocks as a pipeline stage runs them: every forward in order, then every
backward in reverse (whole, or cut into the inputs' and the weights' pass), on fresh copies of
their inputs, repeated until the medians hold (:class:`Runs`). Used by
:func:`~lightning_pipe2bw.planner.measure.profile_blocks`."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from lightning_pipe2bw.runtime.inplace import writable
from lightning_pipe2bw.runtime.payload import grad_leaves
from lightning_pipe2bw.runtime.splitgrad import SplitBackward

__all__ = ["Runs", "call_block", "fresh", "sync", "time_in_sequence", "time_split", "tree_map"]


class Runs:
    """The runs of a timing loop: ``warmup`` untimed, then ``repeats`` timed ones, and more
    while the timed runs have taken less than ``min_time_s`` (the loop adds each timed run's
    seconds to ``spent``), up to 10 x ``repeats``."""

    def __init__(self, warmup: int, repeats: int, min_time_s: float) -> None:
        self.warmup, self.repeats, self.min_time_s = warmup, repeats, min_time_s
        self.spent = 0.0

    def __iter__(self) -> Iterator[int]:
        run, least, most = 0, self.warmup + self.repeats, self.warmup + 10 * self.repeats
        while run < least or (self.spent < self.min_time_s and run < most):
            yield run
            run += 1


def time_in_sequence(
    blocks: list[nn.Module],
    names: list[str],
    inputs: list[Any],
    dev: torch.device,
    runs: Runs,
) -> tuple[list[float], list[float]]:
    """Median forward and backward seconds of every block, timed as a stage runs them: all
    forwards in order, then all backwards in reverse (``inputs[i]`` is block i's input)."""
    n, warmup = len(blocks), runs.warmup
    forward: list[list[float]] = [[] for _ in range(n)]
    backward: list[list[float]] = [[] for _ in range(n)]
    for run in runs:
        began = time.perf_counter()
        ins = [fresh(x) for x in inputs]
        outs = []
        for i, block in enumerate(blocks):
            sync(dev)
            start = time.perf_counter()
            outs.append(call_block(block, ins[i], i, names[i]))
            sync(dev)
            if run >= warmup:
                forward[i].append(time.perf_counter() - start)
        for i in reversed(range(n)):
            roots = grad_leaves(outs[i])
            ones = [torch.ones_like(t) for t in roots]
            sync(dev)
            start = time.perf_counter()
            if roots:
                try:
                    torch.autograd.backward(roots, ones)
                except RuntimeError as err:
                    raise ValueError(
                        f"the backward of block {i} ({names[i]!r}) failed: {err}"
                    ) from err
            sync(dev)
            if run >= warmup:
                backward[i].append(time.perf_counter() - start if roots else 0.0)
            outs[i] = None  # its graph is freed, as a stage frees it after the backward
            del roots, ones
        del ins, outs
        if run >= warmup:
            runs.spent += time.perf_counter() - began
    return [statistics.median(f) for f in forward], [statistics.median(b) for b in backward]


def time_split(
    blocks: list[nn.Module],
    names: list[str],
    inputs: list[Any],
    dev: torch.device,
    runs: Runs,
    backward: list[float],
) -> list[tuple[float, float]]:
    """Median (inputs' pass, weights' pass) seconds of every block's backward cut in two by
    :class:`SplitBackward`, timed as a zero-bubble stage runs them: all forwards, every block's
    inputs' pass in reverse order, then every block's weights' pass. A block whose input needs
    no gradient (the body's first, on token ids) has only a weights' pass, its whole backward
    (``backward[i]``); a block the split refuses runs whole in its inputs' pass (the engine does
    the same)."""
    n, warmup = len(blocks), runs.warmup
    passes: list[tuple[list[float], list[float]]] = [([], []) for _ in range(n)]
    for run in runs:
        began = time.perf_counter()
        ins = [fresh(x) for x in inputs]
        outs = [call_block(block, ins[i], i, names[i]) for i, block in enumerate(blocks)]
        cuts: list[SplitBackward | None] = [None] * n
        for i in reversed(range(n)):
            roots, leaves = grad_leaves(outs[i]), grad_leaves(ins[i])
            ones: list[Tensor | None] = [torch.ones_like(t) for t in roots]
            sync(dev)
            start = time.perf_counter()
            cut = SplitBackward.plan(roots, ones, leaves) if roots and leaves else None
            if cut is not None:
                cut.inputs_pass()
            elif roots and leaves:  # refused: the whole backward in the inputs' pass
                torch.autograd.backward(roots, ones)
            sync(dev)
            if run >= warmup and leaves:
                passes[i][0].append(time.perf_counter() - start)
            cuts[i] = cut
            del roots, leaves, ones
        for i in reversed(range(n)):
            cut = cuts[i]
            if cut is None:
                continue
            sync(dev)
            start = time.perf_counter()
            cut.weights_pass()
            sync(dev)
            if run >= warmup:
                passes[i][1].append(time.perf_counter() - start)
        del ins, outs, cuts
        if run >= warmup:
            runs.spent += time.perf_counter() - began
    out = []
    for i, (first, second) in enumerate(passes):
        if not first:  # no input to differentiate: the backward is all weights
            out.append((0.0, backward[i]))
        else:
            out.append((statistics.median(first), statistics.median(second) if second else 0.0))
    return out


def call_block(block: nn.Module, inp: Any, index: int, name: str) -> Any:
    """``block`` on ``inp`` (a fresh copy, see :func:`fresh`), made writable as a stage makes
    what it receives: an in-place block modifies the copy, never the sample or the recorded
    input of the next block."""
    try:
        return block(writable(inp))
    except Exception as err:
        raise ValueError(
            f"block {index} ({name!r}) failed on its input (the sample for block 0, else the "
            f"previous block's output): {type(err).__name__}: {err}. Check that the blocks chain "
            "(each takes exactly the previous one's output) and that the sample is one micro-batch "
            "of the body's input."
        ) from err


def fresh(x: Any) -> Any:
    """A detached copy of ``x`` whose floating leaves require grad, as a stage receives it."""

    def copy(t: Tensor) -> Tensor:
        c = t.detach().clone()
        return c.requires_grad_() if c.is_floating_point() or c.is_complex() else c

    return tree_map(copy, x)


def tree_map(fn: Callable[[Tensor], Tensor], tree: Any) -> Any:
    return pytree.tree_map(lambda v: fn(v) if isinstance(v, Tensor) else v, tree)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
