"""``Ring``: one direction of a shared-memory channel, a byte ring in a file mapping that the
writing and the reading process share (``SharedMemoryTransport``'s storage, ``runtime/shm.py``)."""

from __future__ import annotations

import mmap
import os

import torch

from lightning_pipe2bw.runtime.wire import ALIGN

__all__ = ["CONTROL", "LARGE", "MESSAGE", "NOTICE", "RECORD", "Ring"]

CONTROL = 128  # the ring's head (bytes written, at 0) and tail (bytes read, at 64)
RECORD = 64  # a record's own head: eight int64 (size, kind, header length, large size)
MESSAGE, LARGE, NOTICE, WRAP = 1, 2, 3, 4  # record kinds


class Ring:
    """One direction of a channel: a byte ring in a file mapping both processes share. The
    writer owns the head (bytes written), the reader the tail (bytes read); a record never
    wraps (a wrap record sends the reader back to the start)."""

    def __init__(self, path: str, create: bool, capacity: int) -> None:
        fd = os.open(path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDWR, 0o600)
        try:
            if create:
                # take the pages now: a full /dev/shm (64 MiB in a default Docker container)
                # fails here, not with SIGBUS when the ring first reaches them
                try:
                    os.posix_fallocate(fd, 0, CONTROL + capacity)
                except OSError:
                    os.close(fd)
                    fd = -1
                    os.unlink(path)
                    raise
            self.map = mmap.mmap(fd, CONTROL + capacity)
        finally:
            if fd >= 0:
                os.close(fd)
        self.capacity = capacity
        self.words = memoryview(self.map).cast("q")  # the control and every record's head
        self.data = torch.frombuffer(self.map, dtype=torch.uint8)[CONTROL:]

    @property
    def head(self) -> int:
        return self.words[0]

    @property
    def tail(self) -> int:
        return self.words[ALIGN // 8]

    def record(self, pos: int) -> memoryview:
        """The head of the record at ring position ``pos``: eight int64."""
        start = (CONTROL + pos) // 8
        return self.words[start : start + RECORD // 8]

    def reserve(self, size: int, keep: int = 0) -> tuple[int, int] | None:
        """Where a record of ``size`` bytes goes and the bytes skipped to get there (a wrap), or
        None when the reader has not freed enough yet to leave ``keep`` bytes free after it."""
        head, cap = self.head, self.capacity
        pos = head % cap
        skip = cap - pos if pos + size > cap else 0
        if head - self.tail + skip + size > cap - keep:
            return None
        if skip:
            self.record(pos)[1] = WRAP
        return (0 if skip else pos), skip

    def commit(self, skip: int, size: int) -> None:
        """Publish a written record (after its bytes: x86-64 keeps the stores in order)."""
        self.words[0] = self.head + skip + size

    def next(self) -> int | None:
        """The position of the next unread record, or None."""
        tail, head, cap = self.tail, self.head, self.capacity
        while tail < head:
            pos = tail % cap
            if self.record(pos)[1] != WRAP:
                return pos
            tail += cap - pos
            self.words[ALIGN // 8] = tail
        return None

    def release(self, size: int) -> None:
        """The record at the tail has been read."""
        self.words[ALIGN // 8] = self.tail + size
