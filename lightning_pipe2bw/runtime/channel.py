"""In-order delivery of small Python objects from one rank to the others, without a barrier."""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ObjectChannel"]

_LENGTH_TAG = 0
_DATA_TAG = 1


class ObjectChannel:
    """One rank posts reports (picklable objects); every other rank receives them in order.

    The source does not wait: each report goes out with non-blocking sends, whose buffers are kept
    until the sends are done; only when ``max_unread`` reports are still unread does it wait for
    the oldest (which bounds memory; in the strategy the receivers are one report behind). A receiver blocks only in :meth:`receive`. The channel runs on
    its own process group (gloo, so CPU objects never wait on a GPU stream), so its messages never
    interleave with the pipeline's activations and gradients.

    Receivers count what the source has posted with :meth:`expect` (the two sides post and expect
    at the same points of the training loop), so :attr:`backlog` tells whether a report is owed.
    """

    def __init__(
        self, source: int, group: dist.ProcessGroup, members: list[int] | None = None
    ) -> None:
        self.source = source
        self.group = group
        self.rank = dist.get_rank()
        # the global ranks of the pipeline (default: the whole world)
        self.members = list(range(dist.get_world_size())) if members is None else list(members)
        self.backlog = 0  # on a receiver: reports posted by the source and not yet received
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.max_unread = 8  # the source waits only when this many reports are still unread

    @property
    def is_source(self) -> bool:
        return self.rank == self.source

    def post(self, obj: Any) -> None:
        """Send ``obj`` to every other rank without waiting (on the source)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        length = torch.tensor([buffer.numel()], dtype=torch.int64)
        # keep the sends of the last `max_unread` reports; wait for older ones, which the
        # receivers (one step behind in the strategy) took long ago, so the wait returns at once
        # and the held buffers stay bounded (gloo marks a send complete only once waited for)
        per_report = 2 * (len(self.members) - 1)
        keep = per_report * (self.max_unread - 1)
        while len(self._sends) > keep:
            sent, _ = self._sends.pop(0)
            sent.wait()
        for rank in self.members:
            if rank == self.source:
                continue
            for tensor, tag in ((length, _LENGTH_TAG), (buffer, _DATA_TAG)):
                work = dist.isend(tensor, dst=rank, group=self.group, tag=tag)
                assert work is not None
                self._sends.append((work, tensor))

    def expect(self) -> None:
        """Note that the source has posted one more report (on a receiver)."""
        self.backlog += 1

    def receive(self) -> Any:
        """The oldest report not yet received (on a receiver; blocks until it arrives)."""
        if self.backlog <= 0:
            raise RuntimeError("no report is owed: receive() without a matching expect()")
        length = torch.empty(1, dtype=torch.int64)
        dist.recv(length, src=self.source, group=self.group, tag=_LENGTH_TAG)
        buffer = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(buffer, src=self.source, group=self.group, tag=_DATA_TAG)
        self.backlog -= 1
        return pickle.loads(buffer.numpy().tobytes())

    def drain(self) -> None:
        """Settle the channel: a receiver takes (and drops) every owed report, the source waits
        until all its sends are done. Both sides call it at the same point."""
        while self.backlog > 0:
            self.receive()
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
