"""Point-to-point transport of stage inputs and outputs (pytrees of tensors) over torch.distributed."""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_pipe2bw.failures.record import FailureRecord, StageFailure, new_run
from lightning_pipe2bw.runtime.wire import (
    Channel,
    encode,
    views,
    wire_device,
)

__all__ = ["TAG_BASE", "HeldSends", "P2PTransport", "Transport", "wire_device"]

_NOTICE = -1  # a message length that announces a failure notice instead of a payload
TAG_BASE = (
    1 << 20
)  # a transport's tag is this plus its run number (earlier runs' messages wait apart)
_UNREAD_NOTICES: list[tuple[dist.Work, torch.Tensor]] = []


def _taken_within(works: list[tuple[dist.Work, torch.Tensor]], timeout_s: float) -> bool:
    """Whether every send in ``works`` completed within ``timeout_s``.

    Waited for on a thread of its own: gloo reports a send completed only once it is waited
    for (polling ``is_completed`` would always take the whole timeout), and a wait cannot be
    given up. A send whose receiver never takes it keeps that daemon thread blocked, which
    holds nothing else and does not keep the process from exiting."""
    taken = threading.Event()

    def wait() -> None:
        with contextlib.suppress(RuntimeError):  # a broken channel: not taken
            for work, _ in works:
                work.wait()
            taken.set()

    threading.Thread(target=wait, name="pipe2bw-notice", daemon=True).start()
    return taken.wait(timeout_s)


class Transport(Protocol):
    """What the engine, the drivers and the runtime use of a transport: :class:`P2PTransport`
    (the process group) or :class:`~lightning_pipe2bw.runtime.shm.SharedMemoryTransport`."""

    device: torch.device
    bytes_sent: int
    bytes_received: int

    def send(self, obj: Any, dst: int) -> None: ...

    def recv(self, src: int, timeout_s: float | None = None) -> Any: ...

    def post(self, src: int) -> None: ...

    def notify(self, record: FailureRecord, dsts: list[int], timeout_s: float = 5.0) -> None: ...

    def reap(self) -> None: ...

    def settle(self) -> None: ...

    def wait_sends(self) -> None: ...

    def close(self) -> None: ...

    @property
    def pending_bytes(self) -> int: ...


@dataclass
class _Posted:
    """The receives of one message, posted together: its control (a packed message's head) and
    the tensors it is expected to carry (views of a packed message, or receives of their own)."""

    control: torch.Tensor  # three int64
    control_work: dist.Work
    tensors: list[torch.Tensor]
    works: list[dist.Work]  # the tensors' own receives (none when packed)


class HeldSends:
    """The sends a transport has started and not seen complete, with the buffers they keep
    alive (a send must outlive its completion; gloo's channel breaks if a pending one is
    destroyed)."""

    def __init__(self) -> None:
        self._pending: list[tuple[dist.Work, list[torch.Tensor]]] = []
        self._settled = 0  # sends before this index are older than the previous settle()

    def reap(self) -> None:
        """Release the buffers of sends that have completed. (Gloo marks a send completed only
        once it is waited for, so on gloo this frees nothing: see :meth:`settle`.)"""
        self._pending = [(w, b) for w, b in self._pending if not w.is_completed()]

    def settle(self) -> None:
        """Wait for the sends started before the previous ``settle`` and release their buffers.

        Called once per engine call: a send from two calls ago has been received by then (a
        peer takes a call's messages in that call or the next), so the wait returns at once,
        and the held buffers stay bounded by two calls' messages however long a run goes
        without a flush. (Gloo reports a send completed only once it is waited for.)"""
        old, self._pending = self._pending[: self._settled], self._pending[self._settled :]
        for work, _ in old:
            work.wait()
        self._settled = len(self._pending)

    def wait_sends(self) -> None:
        """Block until every started send has completed, then release its buffers."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        self._settled = 0

    def close(self) -> None:
        """End of a Trainer call: nothing is held but the sends' buffers, released by
        :meth:`wait_sends` (the process group outlives the transport)."""

    @property
    def pending_bytes(self) -> int:
        """Bytes held in send buffers that have not completed yet."""
        self.reap()
        return sum(b.numel() * b.element_size() for _, bufs in self._pending for b in bufs)


class P2PTransport(HeldSends):
    """Sends and receives pytrees between pipeline ranks.

    A message on a channel (ordered pair of ranks) starts with a control: three int64, the
    length of the pickled header when it changed (0 when it is the previous message's, -1 for a
    failure notice), then the count and largest size of any fillers (below). The header, when
    it changed, and each tensor leaf follow. Sends are non-blocking (``isend``; buffers are kept
    alive until completed). Channels are FIFO, so the schedule's send order on a channel must
    equal the peer's receive order; the schedule validator checks this.

    A receive takes its whole message in one go. Gloo delivers a message at once only into a
    receive that is already posted; a message that has to wait for its receive is delivered
    later by the sender's background thread, which costs milliseconds when that rank is
    computing (and a receive posted only once a control has arrived would always wait like
    that). So when the last message on the channel kept its header (both ends know whether it
    did), the receiver expects the next one to keep it too and posts its tensors' receives with
    its control: as one buffer, when they take at most ``PACK_LIMIT`` bytes (the sender packs
    control and tensors into it; the receiver's tensors are views of it), else a receive per
    tensor. If the header changes after all, or a failure notice comes, the sender first sends
    fillers of the expected sizes into those receives, so that both ends stay in step, on NCCL
    too. The sender tells an unchanged header without pickling it when its non-tensor leaves
    are plain values (numbers, strings, dtypes...). :meth:`post` posts a message's receives
    before :meth:`recv` takes it.

    ``batch_isend_irecv`` is deliberately not used: with gloo it serialises per peer and has
    hung in mixed send/recv batches; plain ``isend``/``irecv`` pairs are safe on gloo and NCCL.

    A stage on a GPU whose group runs on gloo (stage processes sharing one GPU) sends from and
    receives into host memory (:func:`wire_device`): its tensors are copied to the host before
    they leave and to the GPU when they arrive.
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group
        super().__init__()
        self.device = device  # where received tensors go: the stage's device
        self.wire = wire_device(device, group)  # where messages travel from (gloo: the host)
        self._out: dict[int, Channel] = {}
        self._in: dict[int, Channel] = {}
        self._posted: dict[int, _Posted] = {}  # receives posted before recv() was called
        self.bytes_sent = 0
        self.bytes_received = 0
        self.run = new_run()
        # a tag of its own: messages an earlier transport left unread on a channel (its ranks
        # failed) are never taken for this one's (NCCL has no tags, nor survives a failure)
        self.tag = TAG_BASE + self.run
        # on gloo a receive may be posted before an unrelated send; NCCL runs a pair's transfers
        # in order on one stream, where that could hold back a send the peer waits for
        self.can_post_early = self.wire.type == "cpu"

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _isend(self, buffers: list[torch.Tensor], peer: int) -> None:
        for buf in buffers:
            work = dist.isend(buf, dst=peer, group=self.group, tag=self.tag)
            assert work is not None
            self._pending.append((work, [buf]))
            self.bytes_sent += buf.numel() * buf.element_size()

    def _irecv(self, buf: torch.Tensor, peer: int) -> dist.Work:
        work = dist.irecv(buf, src=peer, group=self.group, tag=self.tag)
        assert work is not None
        self.bytes_received += buf.numel() * buf.element_size()
        return work

    def _packed(
        self, channel: Channel, control: list[int], tensors: list[torch.Tensor]
    ) -> torch.Tensor:
        """One buffer: ``control``, then ``tensors`` (none: a filler for the receive)."""
        buffer = torch.zeros(channel.size, dtype=torch.uint8, device=self.wire)
        buffer[:24].view(torch.int64).copy_(torch.tensor(control, dtype=torch.int64))
        for view, t in zip(views(buffer, channel), tensors, strict=False):
            view.copy_(t.detach())
        return buffer

    def _lead(self, channel: Channel, length: int) -> list[torch.Tensor]:
        """What a message of header length ``length`` starts with: its control, and when the
        receiver expects tensors of the last header that do not come (``length`` is not 0),
        fillers in their place."""
        if length != 0 and channel.packed:
            return [self._packed(channel, [length, 0, 0], [])]
        fillers = []
        if length != 0 and channel.predicted:
            fillers = [torch.zeros(m.shape, dtype=m.dtype, device=self.wire) for m in channel.metas]
        largest = max((f.numel() * f.element_size() for f in fillers), default=0)
        control = torch.tensor([length, len(fillers), largest], dtype=torch.int64)
        return [control.to(self.wire), *fillers]

    def send(self, obj: Any, dst: int) -> None:
        """Start sending ``obj`` to group rank ``dst`` without waiting for it to arrive."""
        channel = self._out.setdefault(dst, Channel())
        tensors, _, header, same = encode(channel, obj)
        if same and channel.packed:
            buffers = [self._packed(channel, [0, 0, 0], tensors)]
        else:
            length = 0 if same or header is None else len(header)
            buffers = self._lead(channel, length)
            if length:
                assert header is not None
                raw = torch.frombuffer(bytearray(header), dtype=torch.uint8)
                buffers.append(raw.to(self.wire))
            buffers.extend(t.detach().to(self.wire).contiguous() for t in tensors)
        self._isend(buffers, self._global(dst))
        channel.advance(header, same)

    def post(self, src: int) -> None:
        """Post the receives of the next message from group rank ``src`` now, before
        :meth:`recv` takes it (gloo only; elsewhere a no-op)."""
        if self.can_post_early and src not in self._posted:
            self._posted[src] = self._post_receives(src)

    def _post_receives(self, src: int) -> _Posted:
        peer = self._global(src)
        channel = self._in.setdefault(src, Channel())
        if channel.packed:
            buffer = torch.empty(channel.size, dtype=torch.uint8, device=self.wire)
            work = self._irecv(buffer, peer)
            return _Posted(buffer[:24].view(torch.int64), work, views(buffer, channel), [])
        control = torch.empty(3, dtype=torch.int64, device=self.wire)
        control_work = self._irecv(control, peer)
        tensors = []
        if channel.predicted:
            tensors = [torch.empty(m.shape, dtype=m.dtype, device=self.wire) for m in channel.metas]
        return _Posted(control, control_work, tensors, [self._irecv(t, peer) for t in tensors])

    def recv(self, src: int, timeout_s: float | None = None) -> Any:
        """Receive the next message from group rank ``src`` (blocking). A failure notice from
        ``src`` (see :meth:`notify`) raises :class:`StageFailure`. ``timeout_s`` limits the wait
        for the message to start (default: the process group's timeout); its parts follow at once.
        """
        peer = self._global(src)
        posted = self._posted.pop(src, None) or self._post_receives(src)
        if timeout_s is None:
            posted.control_work.wait()
        else:
            posted.control_work.wait(timedelta(seconds=timeout_s))
        for work in posted.works:  # the expected tensors, or the fillers sent in their place
            work.wait()
        length, fillers, _ = posted.control.tolist()
        if posted.works and length != 0 and fillers != len(posted.works):
            raise RuntimeError(
                f"pipe2bw: the channel from rank {peer} is out of step: fillers for "
                f"{len(posted.works)} expected tensors were due and {fillers} came"
            )
        if length == _NOTICE:
            raise self._recv_notice(peer)
        channel = self._in[src]
        if length > 0:
            raw = torch.empty(length, dtype=torch.uint8, device=self.wire)
            self._irecv(raw, peer).wait()
            channel.advance(raw.cpu().numpy().tobytes(), same=False)
        if length == 0 and posted.tensors:
            tensors = posted.tensors
        else:  # not expected: the header changed, or it had just changed before
            tensors = [torch.empty(m.shape, dtype=m.dtype, device=self.wire) for m in channel.metas]
            for work in [self._irecv(t, peer) for t in tensors]:
                work.wait()
        channel.predicted = length == 0
        if self.wire != self.device:  # staged through the host: onto the stage's device
            tensors = [t.to(self.device) for t in tensors]
        for t, meta in zip(tensors, channel.metas, strict=True):
            if meta.requires_grad:
                t.requires_grad_(True)
        return channel.unflatten(tensors)

    def notify(self, record: FailureRecord, dsts: list[int], timeout_s: float = 5.0) -> None:
        """Send a failure notice to each group rank in ``dsts``, in place of their next message
        from this rank, and wait up to ``timeout_s`` for them to take it (a neighbour that is
        itself failing may never read it)."""
        data = json.dumps(replace(record, run=self.run).to_dict()).encode()
        works = []
        for dst in dsts:
            peer = self._global(dst)
            lead = self._lead(self._out.setdefault(dst, Channel()), _NOTICE)
            for buf in (
                *lead,
                torch.tensor([len(data)], dtype=torch.int64, device=self.wire),
                torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.wire),
            ):
                work = dist.isend(buf, dst=peer, group=self.group, tag=self.tag)
                assert work is not None
                works.append((work, buf))
        if not _taken_within(works, timeout_s):
            # a send must outlive its completion (gloo's channel breaks if a pending send is
            # destroyed); a notice nobody read stays on its run's tag, which no later run uses
            _UNREAD_NOTICES.extend(works)

    def _recv_notice(self, peer: int) -> StageFailure:
        size = torch.empty(1, dtype=torch.int64, device=self.wire)
        dist.recv(size, src=peer, group=self.group, tag=self.tag)
        raw = torch.empty(int(size.item()), dtype=torch.uint8, device=self.wire)
        dist.recv(raw, src=peer, group=self.group, tag=self.tag)
        record = FailureRecord.from_dict(json.loads(raw.cpu().numpy().tobytes()))
        return StageFailure(record.describe(), record, source=peer)
