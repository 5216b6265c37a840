"""What each block of a body costs, for the default split: its forward's floating-point
operations on one micro-batch, or, with no micro-batch at hand, the parameters it multiplies.

A forward's FLOPs are what a block's time grows with once it is large enough to matter in a
pipeline, and they tell the blocks of a language model apart the way their times do: an
embedding looks up one row per token (no FLOPs, whatever the size of its table), a block does
its matrix products and attention, and the head multiplies by the whole vocabulary. A
parameter count (``balance="params"``) weighs an embedding's table as if it were multiplied.

The count is ``torch.utils.flop_counter.FlopCounterMode``'s: matrix products, convolutions and
attention, each block's under its own name. It runs the body on the meta device (shapes only:
nothing computed, no memory), and on the parameters' own device, without gradient and in eval
mode, where a forward reads a tensor's values (a mask checked with ``.item()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import FlopCounterMode

from lightning_pipe2bw.partition.observe import evaluating
from lightning_pipe2bw.runtime.call import BodyInput

__all__ = ["block_flops", "multiplied_parameters"]

# the modules whose weight is read a row at a time, not multiplied
_LOOKUPS = (nn.Embedding, nn.EmbeddingBag)


def multiplied_parameters(blocks: Sequence[nn.Module]) -> list[int]:
    """Each block's parameters that its forward multiplies: all but embedding tables (a weight
    tied to one, such as a language model's head, counts where it multiplies)."""
    counts = []
    for block in blocks:
        multiplied = {id(p): p.numel() for m in block.modules() if not isinstance(m, _LOOKUPS)
                      for p in m.parameters(recurse=False)}  # fmt: skip
        counts.append(sum(multiplied.values()))
    return counts


def block_flops(body: nn.Module, call: BodyInput) -> list[float] | None:
    """The forward FLOPs of each of ``body``'s blocks (its children, in order) on ``call``
    (the arguments of the body's call on one micro-batch); None where the forward runs on
    neither the meta device nor the parameters' own, or counts nothing at all."""
    blocks = list(body.children())
    real = all(not t.is_meta for t in (*body.parameters(), *body.buffers()))
    for device in ("meta", "own") if real else ("meta",):
        try:
            counts = _counted(body, call, device)
        except Exception:  # the forward needs values (meta) or fails outside the loop
            continue
        flops = [float(sum(counts.get(f"{type(body).__name__}.{name}", {}).values()))
                 for name, _ in body.named_children()]  # fmt: skip
        if len(flops) == len(blocks) and sum(flops) > 0:
            return flops
    return None


def _counted(body: nn.Module, call: BodyInput, device: str) -> dict[str, dict[Any, int]]:
    """FlopCounterMode's counts by module for one forward of ``body`` on ``call``: on the meta
    device through stand-ins of its tensors, or on its own."""
    args, kwargs = call.args, call.kwargs
    with evaluating(body), FlopCounterMode(display=False) as counter:
        if device == "meta":
            meta = {id(t): torch.empty_like(t, device="meta") for t in
                    (*body.parameters(), *body.buffers())}  # fmt: skip
            tensors = {name: meta[id(t)] for name, t in
                       (*body.named_parameters(), *body.named_buffers())}  # fmt: skip
            args, kwargs = tree_map_only(Tensor, lambda t: t.to("meta"), (args, kwargs))
            functional_call(body, tensors, tuple(args), dict(kwargs), strict=False)
        else:
            body(*args, **kwargs)
    counts: dict[str, dict[Any, int]] = counter.get_flop_counts()
    return counts
