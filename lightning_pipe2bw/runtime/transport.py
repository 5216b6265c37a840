"""Point-to-point transport of stage inputs and outputs (pytrees of tensors) over torch.distributed."""

from __future__ import annotations

import json
import pickle
import time
import warnings
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from lightning_pipe2bw.runtime.failure import FailureRecord, StageFailure, new_run

__all__ = ["P2PTransport", "TensorMeta", "flatten_payload"]

_NOTICE = -1  # a message length that announces a failure notice instead of a payload
_UNREAD_NOTICES: list[tuple[dist.Work, torch.Tensor]] = []


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate one tensor leaf: shape, dtype and whether it carries grad."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


class _TensorSlot:
    """Placeholder for a tensor leaf inside a pickled header."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[type[_TensorSlot], tuple[int]]:
        return (_TensorSlot, (self.index,))


def flatten_payload(obj: Any) -> tuple[list[torch.Tensor], bytes]:
    """Split ``obj`` into its tensor leaves and a pickled header describing everything else.

    The header holds the tree structure, the non-tensor leaves (plain Python values) and a
    :class:`TensorMeta` per tensor, so shapes may change from one message to the next.
    """
    leaves, spec = pytree.tree_flatten(obj)
    tensors: list[torch.Tensor] = []
    header_leaves: list[Any] = []
    metas: list[TensorMeta] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            header_leaves.append(_TensorSlot(len(tensors)))
            metas.append(TensorMeta(tuple(leaf.shape), leaf.dtype, leaf.requires_grad))
            tensors.append(leaf)
        else:
            header_leaves.append(leaf)
    try:
        with warnings.catch_warnings():  # torch 2.13 warns when its own LeafSpec is pickled
            warnings.simplefilter("ignore", FutureWarning)
            header = pickle.dumps((spec, header_leaves, metas), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise TypeError(
            "a pipeline stage output must be a tensor or a tuple/list/dict of tensors and picklable "
            f"Python values; got {type(obj).__name__} with an unpicklable leaf ({err})"
        ) from err
    return tensors, header


def _load_header(header: bytes) -> tuple[Any, list[Any], list[TensorMeta]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return pickle.loads(header)  # type: ignore[no-any-return]


def _unflatten_payload(header: bytes, tensors: list[torch.Tensor]) -> Any:
    spec, header_leaves, _ = _load_header(header)
    leaves = [tensors[x.index] if isinstance(x, _TensorSlot) else x for x in header_leaves]
    return pytree.tree_unflatten(leaves, spec)


class P2PTransport:
    """Sends and receives pytrees between pipeline ranks.

    A message on a channel (ordered pair of ranks) is: one int64 length, the pickled header
    (only when it differs from the previous header on that channel, else length 0), then each
    tensor leaf. Sends are non-blocking (``isend``; buffers are kept alive until completed),
    receives block. Channels are FIFO, so the schedule's send order on a channel must equal the
    peer's receive order; the schedule validator checks this.

    ``batch_isend_irecv`` is deliberately not used: with gloo it serialises per peer and has
    hung in mixed send/recv batches; plain ``isend``/``irecv`` pairs are safe on gloo and NCCL.
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group
        self.device = device
        self._pending: list[tuple[dist.Work, list[torch.Tensor]]] = []
        self._sent_header: dict[int, bytes] = {}
        self._recv_header: dict[int, bytes] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.run = new_run()  # failure notices of earlier transports are skipped
        self._settled = 0  # sends before this index are older than the previous settle()

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def send(self, obj: Any, dst: int) -> None:
        """Start sending ``obj`` to group rank ``dst`` without waiting for it to arrive."""
        tensors, header = flatten_payload(obj)
        peer = self._global(dst)
        same = self._sent_header.get(dst) == header
        self._sent_header[dst] = header
        length = torch.tensor([0 if same else len(header)], dtype=torch.int64, device=self.device)
        buffers = [length]
        if not same:
            buffers.append(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device))
        for t in tensors:
            buffers.append(t.detach().to(self.device).contiguous())
        for buf in buffers:
            work = dist.isend(buf, dst=peer, group=self.group)
            assert work is not None
            self._pending.append((work, [buf]))
            self.bytes_sent += buf.numel() * buf.element_size()
        self.reap()

    def recv(self, src: int, timeout_s: float | None = None) -> Any:
        """Receive the next message from group rank ``src`` (blocking). A failure notice from
        ``src`` (see :meth:`notify`) raises :class:`StageFailure`. ``timeout_s`` limits the wait
        for the message to start (default: the process group's timeout); its parts follow at once.
        """
        peer = self._global(src)
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        work = dist.irecv(length, src=peer, group=self.group)
        assert work is not None
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timedelta(seconds=timeout_s))
        n = int(length.item())
        while n == _NOTICE:
            failure = self._recv_notice(peer)
            if failure.record.run == self.run:
                raise failure
            dist.recv(length, src=peer, group=self.group)  # an earlier run's: skip it
            n = int(length.item())
        self.bytes_received += length.element_size() + n
        if n > 0:
            raw = torch.empty(n, dtype=torch.uint8, device=self.device)
            dist.recv(raw, src=peer, group=self.group)
            self._recv_header[src] = raw.cpu().numpy().tobytes()
        header = self._recv_header[src]
        _, _, metas = _load_header(header)
        tensors: list[torch.Tensor] = []
        for meta in metas:
            t = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
            dist.recv(t, src=peer, group=self.group)
            self.bytes_received += t.numel() * t.element_size()
            if meta.requires_grad:
                t.requires_grad_(True)
            tensors.append(t)
        return _unflatten_payload(header, tensors)

    def notify(self, record: FailureRecord, dsts: list[int], timeout_s: float = 5.0) -> None:
        """Send a failure notice to each group rank in ``dsts``, in place of their next message
        from this rank, and wait up to ``timeout_s`` for them to take it (a neighbour that is
        itself failing may never read it)."""
        data = json.dumps(replace(record, run=self.run).to_dict()).encode()
        works = []
        for dst in dsts:
            peer = self._global(dst)
            for buf in (
                torch.tensor([_NOTICE], dtype=torch.int64, device=self.device),
                torch.tensor([len(data)], dtype=torch.int64, device=self.device),
                torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device),
            ):
                work = dist.isend(buf, dst=peer, group=self.group)
                assert work is not None
                works.append((work, buf))
        deadline = time.monotonic() + timeout_s
        while not all(w.is_completed() for w, _ in works) and time.monotonic() < deadline:
            time.sleep(0.01)
        # a send must outlive its completion (gloo's channel breaks if a pending send is
        # destroyed), and a notice nobody read may still be read, and skipped, by a later run
        _UNREAD_NOTICES.extend((w, b) for w, b in works if not w.is_completed())

    def _recv_notice(self, peer: int) -> StageFailure:
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(size, src=peer, group=self.group)
        raw = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.recv(raw, src=peer, group=self.group)
        record = FailureRecord.from_dict(json.loads(raw.cpu().numpy().tobytes()))
        return StageFailure(record.describe(), record, source=peer)

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

    @property
    def pending_bytes(self) -> int:
        """Bytes held in send buffers that have not completed yet."""
        self.reap()
        return sum(b.numel() * b.element_size() for _, bufs in self._pending for b in bufs)
