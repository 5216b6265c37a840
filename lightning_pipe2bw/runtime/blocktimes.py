"""Each block's forward time on a stage (live repartitioning measures the stages with it)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["BlockTimer"]


class BlockTimer:
    """Sums each block's training-forward seconds while :attr:`on`; on CUDA the events are
    recorded around the block and read (synchronised) only when :meth:`take` is called."""

    def __init__(self) -> None:
        self.on = False
        self._seconds: dict[int, float] = {}
        self._events: list[tuple[int, Any, Any]] = []

    def start(self) -> None:
        """Time every block from now on, from zero."""
        self.on = True
        self._events, self._seconds = [], {}

    @staticmethod
    def clock(device_type: str) -> Any:
        """A start mark: a recorded CUDA event, or the CPU's clock."""
        if device_type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def record(self, index: int, start: Any, device_type: str) -> None:
        """Block ``index`` ran from ``start`` (:meth:`clock`) until now."""
        if device_type == "cuda":
            self._events.append((index, start, self.clock(device_type)))
        else:
            self._seconds[index] = self._seconds.get(index, 0.0) + time.perf_counter() - start

    def take(self, indices: Iterable[int]) -> dict[int, float]:
        """Each block of ``indices``'s summed seconds since the previous call, and reset."""
        for index, start, end in self._events:
            end.synchronize()
            self._seconds[index] = self._seconds.get(index, 0.0) + start.elapsed_time(end) / 1e3
        self._events = []
        out = {i: self._seconds.get(i, 0.0) for i in indices}
        self._seconds = {}
        return out
