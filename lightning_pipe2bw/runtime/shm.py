"""Point-to-point transport through shared memory, for pipeline ranks that are processes of one
host exchanging through host memory: CPU stages, and GPU stages on gloo (stage processes that
share one GPU).

Gloo moves every message through a socket, with a rendezvous (the receiver announces its
buffer, the sender's or the receiver's background thread moves the bytes) that wakes up to
three threads per message. On a CPU where every core already runs a rank, each wake-up takes
the core from a computing rank: one to two milliseconds of a rank's time per message exchanged
on the 2-core machine of ``benchmarks/`` (``benchmarks/transport.py``), however small the
message. Between processes on one
host the bytes need no socket at all: :class:`SharedMemoryTransport` copies each message into
a ring of shared memory that the receiver maps too, and wakes the receiver with one datagram.

It keeps :class:`~lightning_pipe2bw.runtime.transport.P2PTransport`'s contract: FIFO channels,
non-blocking sends, pytrees with a cached header, failure notices in place of a message, a
wait limit on every receive. A message too large for its ring's inline share travels on the
process group instead, announced by a record in the ring (so the order holds).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import select
import socket
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe2bw.failures.record import FailureRecord, StageFailure, new_run
from lightning_pipe2bw.runtime.ring import CONTROL, LARGE, MESSAGE, NOTICE, RECORD, Ring
from lightning_pipe2bw.runtime.transport import TAG_BASE, HeldSends
from lightning_pipe2bw.runtime.wire import (
    Channel,
    aligned,
    encode,
    layout,
    view,
    wire_device,
)

__all__ = ["create_transport"]

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "shm", "gloo")  # PIPE2BW_TRANSPORT's values
CAPACITY = 8 << 20  # bytes of one channel's ring (taken when it is made)
_POLL_S = 0.5  # a waiting receive checks this often that its peer still lives
_SHM_DIR = "/dev/shm"


def shared_memory_problem(device: torch.device) -> str | None:
    """Why this process cannot use the shared-memory transport, or None if it can: its stage
    must run on the CPU, or on a device whose messages travel through host memory anyway (a GPU
    on a gloo process group, as when stage processes share one GPU)."""
    if wire_device(device).type != "cpu":
        return (
            f"the stages run on {device.type}, not on the CPU, and their process group moves "
            f"{device.type} memory itself"
        )
    if platform.system() != "Linux":
        return f"it needs Linux (abstract sockets, {_SHM_DIR}), not {platform.system()}"
    # the rings rely on the stores of one process reaching the other in program order, which
    # x86-64 guarantees without barriers (Python has none to offer)
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"it needs an x86-64 CPU (ordered stores), not {platform.machine()}"
    if not os.path.isdir(_SHM_DIR) or not os.access(_SHM_DIR, os.W_OK):
        return f"{_SHM_DIR} is missing or not writable"
    return None


def _host() -> str:
    """This host and boot: processes that agree on it share ``/dev/shm``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def create_transport(device: torch.device, peers: list[int], timeout_s: float | None = None) -> Any:
    """The pipeline's transport to its neighbours ``peers`` (global ranks), chosen by the
    ``PIPE2BW_TRANSPORT`` environment variable: ``auto`` (the default) takes shared memory when
    every rank is a process on this host whose messages travel through host memory (a CPU
    stage, or a GPU stage on gloo: stage processes sharing one GPU) and the process group
    otherwise (NCCL between GPUs), ``shm`` insists on shared memory, ``gloo`` the process group.
    Collective on the default group when it may take shared memory."""
    from lightning_pipe2bw.runtime.transport import P2PTransport

    choice = os.environ.get("PIPE2BW_TRANSPORT", "auto").strip().lower() or "auto"
    if choice not in TRANSPORTS:
        raise ValueError(
            f"PIPE2BW_TRANSPORT={choice!r} is not a transport; use one of {', '.join(TRANSPORTS)}"
        )
    if choice == "gloo" or (choice == "auto" and wire_device(device).type != "cpu"):
        return P2PTransport(None, device)
    problem = shared_memory_problem(device)
    token = os.urandom(8).hex()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dist.get_rank(), _host(), problem, token))
    problems = [f"rank {r}: {p}" for r, _, p, _ in gathered if p is not None]
    if len({h for _, h, _, _ in gathered}) > 1:
        problems.append("the ranks run on more than one host")
    if problems:
        if choice == "shm":
            raise ValueError(
                "PIPE2BW_TRANSPORT=shm needs every rank on one host, exchanging through host "
                "memory (a CPU stage, or a GPU stage on gloo): "
                + "; ".join(problems)
                + ". Unset it (auto) or set it to gloo"
            )
        return P2PTransport(None, device)
    try:
        return SharedMemoryTransport(device, gathered[0][3], peers, timeout_s, CAPACITY)
    except SharedMemoryUnavailable as err:
        if choice == "shm":
            raise ValueError(
                f"PIPE2BW_TRANSPORT=shm: {err}. Unset it (auto) or set it to gloo"
            ) from err
        log.warning("pipe2bw: the stages talk over the process group: %s", err)
        return P2PTransport(None, device)


class SharedMemoryUnavailable(RuntimeError):
    """A rank could not make its rings (``/dev/shm`` full or missing): every rank raises it."""


class SharedMemoryTransport(HeldSends):
    """Sends and receives pytrees between pipeline ranks of one host through shared memory.

    Each ordered pair of neighbour ranks has a ring of ``CAPACITY`` bytes, created by the sender
    and mapped by the receiver (whose file name is unlinked as soon as both have it: nothing is
    left in ``/dev/shm``, even if a process is killed). A message is one record: its head, the
    pickled header when it changed (the channel's header is cached at both ends as in
    :class:`~lightning_pipe2bw.runtime.transport.P2PTransport`), then each tensor at a
    64-byte boundary. The sender copies the tensors in, so a send is complete when it returns;
    the receiver copies them out and frees the record. A datagram on the receiver's abstract
    socket wakes it if it waits. A message whose tensors take more than a quarter of the ring,
    or that finds the ring seven-eighths full, goes on the process group (gloo) as one buffer
    behind a small record that announces it in the ring's last eighth, so messages keep their
    order and a sender does not wait for a reader that may be waiting for it (unless thousands of
    announcements are pending: then it waits, up to the wait limit).

    A waiting receive gives up after its wait limit (default: the process group's timeout)
    with an error that says it timed out, and as soon as the peer's process is gone (its socket
    closes with it), like a receive on a broken gloo connection.

    Construction is collective over the default process group: every sender creates its rings
    (taking their pages) before any receiver maps them, and if any rank cannot, every rank
    raises :class:`SharedMemoryUnavailable`.
    """

    def __init__(
        self,
        device: torch.device,
        token: str,
        peers: list[int],
        timeout_s: float | None = None,
        capacity: int = CAPACITY,
    ) -> None:
        super().__init__()  # the large messages' sends on the process group
        self.device = device
        self.group = None
        self.capacity = capacity
        self.inline_limit = capacity // 4
        self.run = new_run()
        self.tag = TAG_BASE + self.run  # the process group's tag for large messages
        self.timeout_s = timeout_s if timeout_s is not None else _group_timeout_s()
        self.rank = dist.get_rank()
        self.bytes_sent = 0
        self.bytes_received = 0
        self._token = token
        self._out_channel: dict[int, Channel] = {}
        self._in_channel: dict[int, Channel] = {}
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(self._address(self.rank))
        self._socket.setblocking(False)
        # poll, not select: select refuses a descriptor numbered 1024 or more, which a process
        # that has run many fits (each with its process groups' sockets) reaches
        self._poller = select.poll()
        self._poller.register(self._socket, select.POLLIN)
        peers = sorted(set(peers))
        self._out: dict[int, Ring] = {}
        self._in: dict[int, Ring] = {}
        problem = None
        try:
            for p in peers:
                self._out[p] = Ring(self._path(self.rank, p), True, capacity)
        except OSError as err:
            problem = (
                f"rank {self.rank} could not make a ring of {capacity} bytes in {_SHM_DIR}: {err}"
            )
        # every rank's rings exist before any is mapped, or every rank learns why not
        problems: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        if any(problems):
            self.close()
            for path in self._out_paths(peers):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise SharedMemoryUnavailable("; ".join(x for x in problems if x))
        for p in peers:
            path = self._path(p, self.rank)
            self._in[p] = Ring(path, False, capacity)
            os.unlink(path)  # both ends have it mapped; nothing to clean up later

    def _out_paths(self, peers: list[int]) -> list[str]:
        return [self._path(self.rank, p) for p in peers]

    def _address(self, rank: int) -> bytes:
        return f"\0pipe2bw-{self._token}-{rank}".encode()

    def _path(self, src: int, dst: int) -> str:
        return os.path.join(_SHM_DIR, f"pipe2bw-{self._token}-{src}-{dst}")

    # ------------------------------------------------------------------ sending
    def send(self, obj: Any, dst: int) -> None:
        """Copy ``obj`` into the channel to rank ``dst`` (complete when it returns, except a
        large message, which the process group carries: see :meth:`wait_sends`)."""
        channel = self._out_channel.setdefault(dst, Channel())
        tensors, metas, header, same = encode(channel, obj)
        length = 0 if same or header is None else len(header)
        start = aligned(RECORD + length)
        if start > self.capacity // 8:  # even its announcement would not fit the ring's reserve
            raise ValueError(
                f"a pipeline stage output's non-tensor part pickles to {length} bytes, more than "
                f"the shared-memory transport carries ({self.capacity // 8 - RECORD} bytes): "
                "pass large values as tensors, or set PIPE2BW_TRANSPORT=gloo"
            )
        offsets, end = layout(metas, start)
        ring = self._out[dst]
        data = end - start
        # a message leaves an eighth of the ring free for the small records that announce the
        # process group's messages (and for notices): however far the reader is behind, they
        # find room, and a sender never waits for a reader that may be waiting for it
        spot = (
            ring.reserve(aligned(end), keep=self.capacity // 8)
            if data <= self.inline_limit
            else None
        )
        if spot is not None:
            pos, skip = spot
            self._write_head(ring, pos, aligned(end), MESSAGE, header if length else None, 0)
            base = ring.data[pos:]
            for offset, meta, t in zip(offsets, metas, tensors, strict=True):
                view(base, offset, meta).copy_(t.detach())
            ring.commit(skip, aligned(end))
        else:  # the tensors in one buffer on the process group, announced in the ring
            buffer = torch.empty(max(end - start, 1), dtype=torch.uint8)
            for offset, meta, t in zip(offsets, metas, tensors, strict=True):
                view(buffer, offset - start, meta).copy_(t.detach())
            size = aligned(start)
            pos, skip = self._reserve_waiting(ring, size, dst)
            self._write_head(ring, pos, size, LARGE, header if length else None, buffer.numel())
            work = dist.isend(buffer, dst=dst, tag=self.tag)
            assert work is not None
            self._pending.append((work, [buffer]))
            ring.commit(skip, size)
        self.bytes_sent += data
        channel.advance(header, same)
        self._wake(dst)

    def _write_head(
        self, ring: Ring, pos: int, size: int, kind: int, header: bytes | None, large: int
    ) -> None:
        head = ring.record(pos)
        head[0], head[1], head[3] = size, kind, large
        head[2] = len(header) if header is not None else 0
        if header is not None:
            at = CONTROL + pos + RECORD
            ring.map[at : at + len(header)] = header

    def _reserve_waiting(
        self, ring: Ring, size: int, dst: int, timeout_s: float | None = None
    ) -> tuple[int, int]:
        """Room for a small record, waiting for the reader if the ring is full."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        while (spot := ring.reserve(size)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"pipe2bw: timed out waiting for rank {dst} to read its messages (its "
                    f"ring of {self.capacity} bytes stayed full)"
                )
            if not self._alive(dst):
                raise ConnectionError(f"pipe2bw: rank {dst}'s process is gone")
            time.sleep(0.001)
        return spot

    def _wake(self, dst: int) -> None:
        try:
            self._socket.sendto(b"\1", self._address(dst))
        except BlockingIOError:
            pass  # its queue is full of wake-ups already
        except OSError:
            pass  # gone: its neighbours learn it when they wait for it

    def _alive(self, rank: int) -> bool:
        """Whether rank ``rank``'s transport (so its process) still exists."""
        try:
            self._socket.sendto(b"", self._address(rank))
        except BlockingIOError:
            return True
        except OSError:  # refused or no such address: its socket closed with its process
            return False
        return True

    def post(self, src: int) -> None:
        """Nothing to post: a message lands in the ring whenever it is sent."""

    # ------------------------------------------------------------------ receiving
    def recv(self, src: int, timeout_s: float | None = None) -> Any:
        """Receive the next message from rank ``src`` (blocking). A failure notice from ``src``
        raises :class:`StageFailure`; ``timeout_s`` limits the wait (default: the process
        group's timeout)."""
        ring = self._in[src]
        pos = ring.next()
        if pos is None:
            pos = self._wait(ring, src, timeout_s if timeout_s is not None else self.timeout_s)
        head = ring.record(pos)
        size, kind, length, large = head[0], head[1], head[2], head[3]
        at = CONTROL + pos + RECORD
        if kind == NOTICE:
            data = bytes(ring.map[at : at + length])
            ring.release(size)
            record = FailureRecord.from_dict(json.loads(data))
            raise StageFailure(record.describe(), record, source=src)
        channel = self._in_channel.setdefault(src, Channel())
        if length:
            channel.advance(bytes(ring.map[at : at + length]), same=False)
        else:
            channel.advance(None, same=True)
        start = aligned(RECORD + length)
        offsets, end = layout(channel.metas, start)
        if kind == MESSAGE:
            base = ring.data[pos:]
            # copied out of the ring (onto the stage's device: a GPU stage's bytes come through
            # host memory) before the record is freed
            tensors = [
                view(base, o, m).to(self.device, copy=True)
                for o, m in zip(offsets, channel.metas, strict=True)
            ]
            ring.release(size)
        elif kind == LARGE:
            ring.release(size)
            buffer = torch.empty(large, dtype=torch.uint8)
            work = dist.irecv(buffer, src=src, tag=self.tag)
            assert work is not None
            work.wait()
            tensors = [
                view(buffer, o - start, m).to(self.device)
                for o, m in zip(offsets, channel.metas, strict=True)
            ]
        else:
            raise RuntimeError(
                f"pipe2bw: the channel from rank {src} holds a record of kind {kind}"
            )
        self.bytes_received += end - start
        for t, meta in zip(tensors, channel.metas, strict=True):
            if meta.requires_grad:
                t.requires_grad_(True)
        return channel.unflatten(tensors)

    def _wait(self, ring: Ring, src: int, timeout_s: float) -> int:
        """Sleep until a record from ``src`` comes; raise if it does not within ``timeout_s``
        or if ``src``'s process is gone."""
        deadline = time.monotonic() + timeout_s
        sock = self._socket
        while True:
            try:
                while sock.recv(64) is not None:  # the wake-ups so far; a new one comes after
                    pass  # every record written from now on
            except BlockingIOError:
                pass
            pos = ring.next()
            if pos is not None:
                return pos
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"pipe2bw: timed out after {timeout_s:.1f} s waiting for a message from "
                    f"rank {src}"
                )
            ready = self._poller.poll(1000 * min(left, _POLL_S))
            if not ready and not self._alive(src):
                if ring.next() is not None:  # its last message came before it went
                    continue
                raise ConnectionError(
                    f"pipe2bw: rank {src}'s process is gone (its transport socket closed)"
                )

    # ------------------------------------------------------------------ failures
    def notify(self, record: FailureRecord, dsts: list[int], timeout_s: float = 5.0) -> None:
        """Put a failure notice in place of the next message to each rank in ``dsts`` (waiting up
        to ``timeout_s`` for room in a full ring)."""
        data = json.dumps(replace(record, run=self.run).to_dict()).encode()
        size = aligned(RECORD + len(data))
        for dst in dsts:
            ring = self._out[dst]
            pos, skip = self._reserve_waiting(ring, size, dst, timeout_s)
            head = ring.record(pos)
            head[0], head[1], head[2], head[3] = size, NOTICE, len(data), 0
            at = CONTROL + pos + RECORD
            ring.map[at : at + len(data)] = data
            ring.commit(skip, size)
            self._wake(dst)

    def close(self) -> None:
        """Close the wake-up socket (peers then see this transport gone) and unmap the rings."""
        self._socket.close()
        for ring in [*self._out.values(), *self._in.values()]:
            ring.words.release()
            del ring.data
            try:
                ring.map.close()
            except BufferError:  # a received tensor still views it: unmapped when it goes
                pass
        self._out.clear()
        self._in.clear()


def _group_timeout_s() -> float:
    """The default process group's timeout, in seconds (30 minutes if it cannot be read)."""
    try:
        group = dist.distributed_c10d._get_default_group()
        timeout = group._get_backend(torch.device("cpu")).options._timeout
        if isinstance(timeout, timedelta):
            return timeout.total_seconds()
    except Exception:  # a private API: fall back to torch's default
        pass
    return dist.default_pg_timeout.total_seconds()
