"""The link between a stage and its partner (stage p-1-s) that carries evicted activations.

BPipe moves saved activations from an early stage, which stashes many micro-batches, to its
partner, which stashes few, and back before the backward. Each direction has a two-rank
process group of its own, so these transfers never queue behind the pipeline's activations and
gradients:

* the evicting stage's EVICT packs micro-batch i's chosen storages into one buffer and posts a
  non-blocking send (a small header, then the buffer); its next forward waits for that send, so
  the bytes leave the stage before new ones are saved. Its LOAD waits for the same, then posts a
  non-blocking receive of micro-batch i's bytes (it knows how many it sent); the backward of i
  waits for that;
* the partner receives every evicted micro-batch on a thread of its own, as soon as it is sent:
  the evicting stage's wait returns at once, whatever the partner's main thread is doing, so no
  action order can deadlock on it. Its RETURN takes micro-batch i from that inbox (waiting if it
  has not arrived) and hands it to a second thread, which sends it back and frees it once the
  evicting stage has taken it. (The partner's main thread must not wait for that itself: under
  2BW the evicting stage may take it only in its next step, after a collective of Lightning's
  loop that the partner would never reach.)

A header is one int64 tensor ``[kind, micro-batch, bytes]``: data, close (the evicting stage is
done) or failure (the bytes are a JSON failure record), so the partner never waits for an
evicting stage that has stopped.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe2bw.failures.record import FailureRecord, StageFailure
from lightning_pipe2bw.runtime.transport import wire_device

__all__ = ["PeerLink"]

_DATA, _CLOSE, _FAILURE = 0, 1, 2


class PeerLink:
    """One side of the link between an evicting stage and its partner (``holder``).

    ``send_group`` carries this rank's messages to the partner, ``recv_group`` the partner's to
    this rank (two-rank groups, one per direction). On gloo a GPU stage's bytes travel, and
    wait at the partner, in host memory (:func:`~lightning_pipe2bw.runtime.transport.wire_device`).
    """

    def __init__(
        self,
        partner: int,
        partner_stage: int,
        send_group: Any,
        recv_group: Any,
        device: torch.device,
        *,
        holder: bool,
        timeout_s: float,
    ) -> None:
        self.partner = partner
        self.partner_stage = partner_stage
        self.device = device
        self.wire = wire_device(device, send_group)  # where the bytes travel and wait
        self.holder = holder
        self.timeout_s = timeout_s
        self._send_group = send_group
        self._recv_group = recv_group
        self._to = 1 - dist.get_rank(send_group)
        self._from = 1 - dist.get_rank(recv_group)
        self._sends: list[tuple[list[Any], int]] = []  # (works and buffers, bytes) not waited
        self._loads: dict[int, tuple[Any, Tensor]] = {}  # posted receives, by micro-batch
        self._lock = threading.Condition()
        self._inbox: dict[int, Tensor | None] = {}
        self._failure: BaseException | None = None
        self.outgoing_bytes = 0  # sent, not yet known to have arrived
        self.incoming_bytes = 0  # receive buffers posted, not yet taken
        self.inbox_bytes = 0  # the partner's micro-batches held here (holder)
        self._receiver: threading.Thread | None = None
        self._returns: queue.Queue[Tensor | None] = queue.Queue()  # the holder's sends back
        self._sender: threading.Thread | None = None
        if holder:
            self._receiver = threading.Thread(
                target=self._receive_all, name="pipe2bw-offload-recv", daemon=True
            )
            self._sender = threading.Thread(
                target=self._return_all, name="pipe2bw-offload-send", daemon=True
            )
            self._receiver.start()
            self._sender.start()

    @property
    def held_bytes(self) -> int:
        """Bytes of saved activations the link keeps on this rank now."""
        with self._lock:
            return self.outgoing_bytes + self.incoming_bytes + self.inbox_bytes

    # ------------------------------------------------------------------ evicting stage
    def evict(self, microbatch: int, data: Tensor | None) -> None:
        """Post the send of ``data`` (uint8, or None for nothing) to the partner."""
        nbytes = 0 if data is None else data.numel()
        self._send([_DATA, microbatch, nbytes], None if data is None else data.to(self.wire))

    def load(self, microbatch: int, nbytes: int) -> None:
        """Post the receive of micro-batch ``microbatch``'s ``nbytes`` bytes from the partner."""
        self.settle()  # the eviction just sent leaves before the returned bytes come in
        if nbytes == 0:
            return
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.wire)
        work = dist.irecv(buf, group=self._recv_group, group_src=self._from)
        self._loads[microbatch] = (work, buf)
        with self._lock:
            self.incoming_bytes += nbytes

    def loaded(self, microbatch: int) -> Tensor | None:
        """Wait for :meth:`load`'s bytes of ``microbatch`` (None if it evicted nothing)."""
        posted = self._loads.pop(microbatch, None)
        if posted is None:
            return None
        work, buf = posted
        try:
            work.wait()
        except Exception as err:
            raise self._lost(err) from err
        with self._lock:
            self.incoming_bytes -= buf.numel()
        return buf.to(self.device)

    def fail(self, record: FailureRecord) -> None:
        """Tell a holding partner that this rank stops (it may be waiting for activations)."""
        if not self.holder:
            data = json.dumps(record.to_dict()).encode()
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.wire)
            self._send([_FAILURE, -1, raw.numel()], raw)

    def close(self, timeout_s: float = 30.0) -> None:
        """End the link when training ends: every send is waited for, the partner's thread
        stops (the evicting stage sends it a close)."""
        if not self.holder:
            self._send([_CLOSE, -1, 0], None)
        self.settle()
        if self._sender is not None:
            self._returns.put(None)
            self._sender.join(timeout_s)
        if self._receiver is not None:
            self._receiver.join(timeout_s)

    # ------------------------------------------------------------------ holding partner
    def give_back(self, microbatch: int) -> None:
        """Wait for micro-batch ``microbatch``'s evicted bytes, then post their send back."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            while microbatch not in self._inbox:
                if self._failure is not None:
                    raise self._failure
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageFailure(
                        f"stage {self.partner_stage} (rank {self.partner}) sent no activations of "
                        f"micro-batch {microbatch} to hold within {self.timeout_s:.0f} s (the "
                        "process-group timeout); it hangs or is gone",
                        FailureRecord(
                            self.partner, self.partner_stage, "an unknown action", "timed out"
                        ),
                        source=self.partner,
                    )
                self._lock.wait(min(left, 1.0))
            data = self._inbox.pop(microbatch)
            if data is not None:
                self.inbox_bytes -= data.numel()
                self.outgoing_bytes += data.numel()
        if data is not None:
            self._returns.put(data)

    def _return_all(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            while (data := self._returns.get()) is not None:
                dist.send(data, group=self._send_group, group_dst=self._to)
                with self._lock:
                    self.outgoing_bytes -= data.numel()
                    self._lock.notify_all()
                del data
        except BaseException as err:  # handed to the main thread
            with self._lock:
                self._failure = self._lost(err)
                self._lock.notify_all()

    # ------------------------------------------------------------------ both
    def settle(self) -> None:
        """Wait for every posted send and release its buffer (on the holding partner: until
        the evicting stage has taken back everything handed to it, so only where it will)."""
        if self.holder:
            with self._lock:
                while self.outgoing_bytes > 0:
                    if self._failure is not None:
                        raise self._failure
                    self._lock.wait(1.0)
            return
        sends, self._sends = self._sends, []
        for items, nbytes in sends:
            try:
                items[0].wait()
                if len(items) > 2:
                    items[2].wait()
            except Exception as err:
                raise self._lost(err) from err
            with self._lock:
                self.outgoing_bytes -= nbytes

    def _send(self, header: list[int], data: Tensor | None) -> None:
        head = torch.tensor(header, dtype=torch.int64, device=self.wire)
        items: list[Any] = [dist.isend(head, group=self._send_group, group_dst=self._to), head]
        nbytes = 0
        if data is not None and data.numel() > 0:
            items += [dist.isend(data, group=self._send_group, group_dst=self._to), data]
            nbytes = data.numel() if header[0] == _DATA else 0
        with self._lock:
            self.outgoing_bytes += nbytes
        self._sends.append((items, nbytes))

    def _lost(self, err: BaseException) -> StageFailure:
        record = FailureRecord(
            self.partner,
            self.partner_stage,
            "an unknown action",
            "its link to this stage broke (the process vanished or stopped answering)",
        )
        return StageFailure(
            f"lost the partner stage {self.partner_stage} (rank {self.partner}) that holds or "
            f"returns evicted activations: {type(err).__name__}: {err}",
            record,
            source=self.partner,
        )

    def _receive_all(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            while True:
                head = torch.empty(3, dtype=torch.int64, device=self.wire)
                dist.recv(head, group=self._recv_group, group_src=self._from)
                kind, microbatch, nbytes = (int(v) for v in head.tolist())
                data = None
                if nbytes > 0:
                    data = torch.empty(nbytes, dtype=torch.uint8, device=self.wire)
                    dist.recv(data, group=self._recv_group, group_src=self._from)
                if kind == _CLOSE:
                    return
                if kind == _FAILURE:
                    assert data is not None
                    record = FailureRecord.from_dict(json.loads(data.cpu().numpy().tobytes()))
                    raise StageFailure(record.describe(), record, source=self.partner)
                with self._lock:
                    self._inbox[microbatch] = data
                    self.inbox_bytes += nbytes
                    self._lock.notify_all()
        except BaseException as err:  # handed to the main thread's next give_back
            failure = err if isinstance(err, StageFailure) else self._lost(err)
            with self._lock:
                self._failure = failure
                self._lock.notify_all()
