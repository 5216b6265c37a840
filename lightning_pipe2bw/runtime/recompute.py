"""Activation recomputation of a stage's blocks (``recompute``, the memory plan's
``"recompute"``): ``torch.utils.checkpoint`` with what a pipeline stage needs around it, an
input modified in place and buffers a forward updates."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from lightning_pipe2bw.runtime.inplace import copy_tensors, tensor_versions

__all__ = ["Recomputation"]


class Recomputation:
    """What a stage learns about each recomputed region (by its blocks' indices) from its
    first forward, and the checkpointed call."""

    def __init__(self) -> None:
        # regions whose first forward modified the region's input in place: they run on a copy
        # of it, so the recomputation sees the input the first forward saw
        self.modifies_input: dict[tuple[int, ...], bool] = {}
        # regions' buffers that a forward updates (batch norm's running statistics): the
        # region's blocks and the (owner, name) of each such buffer
        self.updated_buffers: dict[
            tuple[int, ...], tuple[list[nn.Module], list[tuple[nn.Module, str]]]
        ] = {}

    def checkpoint(
        self,
        region: tuple[int, ...],
        modules: list[nn.Module],
        fn: Callable[..., Any],
        x: Any,
        *args: Any,
    ) -> Any:
        """``fn(x, *args)`` under ``torch.utils.checkpoint`` (non-reentrant), for the blocks
        ``region`` (their indices; ``modules``: the blocks themselves).

        The recomputation runs ``fn`` again on ``x``: if the first forward modified ``x`` in
        place (an in-place first block), it would see the modified input. So the region's first
        forward runs on a copy of ``x`` and records whether the copy was modified; from then on
        only a region that modifies its input gets a copy (a clone per forward and per
        recomputation), one that does not runs on ``x`` itself at no cost, and raises if it ever
        does modify it.

        The recomputation must not update the blocks' buffers a second time (batch norm's
        running statistics and ``num_batches_tracked``; in train mode it normalises with the
        batch's statistics, so its output does not depend on them): the buffers a forward
        updates are saved before the recomputation and put back after it. Which buffers those
        are is learnt from the region's first forward, by value (batch norm's kernel updates the
        running statistics without bumping their version counters), and from version counters
        and identities in every forward; static buffers (masks, caches) are never copied.
        """
        modifies = self.modifies_input.get(region)
        first_run = [True]
        changed: list[tuple[nn.Module, str]] = []  # the buffers the first forward changed

        def run(inp: Any, *rest: Any) -> Any:
            own = copy_tensors(inp) if modifies is not False else inp
            if not first_run[0]:  # the recomputation
                with _buffers_kept(changed):
                    return fn(own, *rest)
            first_run[0] = False
            before = tensor_versions(own)
            buffers = _buffer_versions(modules)
            known = self.updated_buffers.get(region)
            if known is not None and not _same_modules(known[0], modules):
                known = None  # blocks moved since
            values = None if known is not None else [b.clone() for _, _, b, _ in buffers]
            out = fn(own, *rest)
            updated = {
                (id(m), n): (m, n)
                for m, n, b, v in buffers
                if m._buffers.get(n) is not b or b._version != v
            }
            if known is not None:
                updated.update(((id(m), n), (m, n)) for m, n in known[1])
            else:
                assert values is not None
                for (m, n, b, _), value in zip(buffers, values, strict=True):
                    if not torch.equal(b, value):
                        updated[(id(m), n)] = (m, n)
                self.updated_buffers[region] = (modules, list(updated.values()))
            changed.extend(updated.values())
            modified = tensor_versions(own) != before
            if modifies is None:
                self.modifies_input[region] = modified
            elif modified and not modifies:
                raise RuntimeError(
                    f"blocks {list(region)} of the pipeline body modified their input in "
                    "place, which they did not do in their first recomputed forward: the "
                    "recomputation would see the modified input. Keep in-place operations "
                    "on a block's input unconditional, or do not recompute these blocks"
                )
            return out

        return torch_checkpoint(run, x, *args, use_reentrant=False)


def _buffer_versions(blocks: Iterable[nn.Module]) -> list[tuple[nn.Module, str, Tensor, int]]:
    """Every buffer of ``blocks``: its owner, name, tensor and version counter."""
    owners = dict.fromkeys(m for block in blocks for m in block.modules())
    return [(m, n, b, b._version) for m in owners for n, b in m._buffers.items() if b is not None]


def _same_modules(a: list[nn.Module], b: list[nn.Module]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


@contextmanager
def _buffers_kept(buffers: list[tuple[nn.Module, str]]) -> Iterator[None]:
    """Put ``buffers`` (owner, name) back as they were on entry, tensor and values, on exit."""
    saved = [(m, n, m._buffers[n]) for m, n in buffers]
    values = [b.clone() if b is not None else None for _, _, b in saved]
    try:
        yield
    finally:
        with torch.no_grad():
            for (m, n, b), value in zip(saved, values, strict=True):
                m._buffers[n] = b
                if b is not None and value is not None:
                    b.copy_(value)
