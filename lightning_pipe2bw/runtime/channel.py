"""In-order delivery of small Python objects from one rank to the others, without a barrier."""

from __future__ import annotations

import io
import pickle
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["CHANNEL_TAGS", "DEFAULT_TAG", "ObjectChannel"]

# tags of their own, apart from the pipeline transports' (on gloo the channel may share the
# default group with them): an object's first message on ``tag``, the rest on ``tag + 1``; two
# channels between the same ranks in the same group need tags of their own (``CHANNEL_TAGS``)
DEFAULT_TAG = 1 << 19  # the step values' channel
CHANNEL_TAGS = 2  # the tags one channel takes, from its ``tag`` on
# an object's first message: its length (int64), then up to FIRST_BYTES - 8 bytes of it; a larger
# object sends the rest in a second message
FIRST_BYTES = 4096


class ObjectChannel:
    """One rank posts picklable objects; every other rank receives them in order.

    The source does not wait: each object goes out with non-blocking sends, whose buffers are kept
    until the sends are done; only when ``max_unread`` objects are still unread does it wait for
    the oldest (which bounds memory; in the strategy the receivers are one object behind). A
    receiver blocks only in :meth:`receive`. The channel runs on a gloo group (so CPU objects never
    wait on a GPU stream; ``None``: the default group, which must then be gloo), on tags of its
    own (``tag`` and ``tag + 1``), so its messages never mix with the pipeline's activations and
    gradients, nor with another channel's between the same ranks.

    Receivers count what the source has posted, or will post, with :meth:`expect` (the two sides
    post and expect at the same points of the training loop), so :attr:`backlog` tells whether an
    object is owed. ``expect`` also posts the receive of the object's first message, which
    holds an object of up to ``FIRST_BYTES - 8`` bytes whole: gloo writes a message at once only
    into a receive that is already posted (otherwise the sender's background thread must deliver
    it later), so a receiver that expects an object before the source posts it gets it without a
    round trip.
    """

    def __init__(
        self,
        source: int,
        group: dist.ProcessGroup | None,
        members: list[int] | None = None,
        tag: int = DEFAULT_TAG,
    ) -> None:
        self.source = source
        self._first_tag, self._rest_tag = tag, tag + 1
        self.group = group
        self.rank = dist.get_rank()
        # the global ranks of the pipeline (default: the whole world)
        self.members = list(range(dist.get_world_size())) if members is None else list(members)
        self.backlog = 0  # on a receiver: objects expected and not yet received
        self._sends: deque[list[tuple[dist.Work, torch.Tensor]]] = deque()  # per object
        self._posted: deque[tuple[dist.Work, torch.Tensor]] = deque()  # first messages expected
        self.max_unread = 8  # the source waits only when this many objects are still unread

    @property
    def is_source(self) -> bool:
        return self.rank == self.source

    def post(self, obj: Any) -> None:
        """Send ``obj`` to every other rank without waiting (on the source). Its tensors arrive
        on the CPU (a device's tensors are copied to the host here)."""
        obj = pytree.tree_map_only(Tensor, _on_host, obj)
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        data = buffer.getvalue()
        first = torch.zeros(FIRST_BYTES, dtype=torch.uint8)
        first[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        head = data[: FIRST_BYTES - 8]
        first[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        messages = [(first, self._first_tag)]
        if len(data) > len(head):
            rest = torch.frombuffer(bytearray(data[len(head) :]), dtype=torch.uint8)
            messages.append((rest, self._rest_tag))
        # keep the sends of the last `max_unread` objects; wait for older ones, which the
        # receivers (one step behind in the strategy) took long ago, so the wait returns at once
        # and the held buffers stay bounded (gloo marks a send complete only once waited for)
        while len(self._sends) >= self.max_unread:
            for work, _ in self._sends.popleft():
                work.wait()
        sends = []
        for rank in self.members:
            if rank == self.source:
                continue
            for tensor, tag in messages:
                sent = dist.isend(tensor, dst=rank, group=self.group, tag=tag)
                assert sent is not None
                sends.append((sent, tensor))
        self._sends.append(sends)

    def expect(self) -> None:
        """Note that the source posts one more object, and post its receive (on a receiver)."""
        first = torch.empty(FIRST_BYTES, dtype=torch.uint8)
        work = dist.irecv(first, src=self.source, group=self.group, tag=self._first_tag)
        assert work is not None
        self._posted.append((work, first))
        self.backlog += 1

    def receive(self) -> Any:
        """The oldest object not yet received (on a receiver; blocks until it arrives)."""
        if self.backlog <= 0:
            raise RuntimeError("no report is owed: receive() without a matching expect()")
        work, first = self._posted.popleft()
        work.wait()
        size = int(first[:8].view(torch.int64).item())
        data = first[8 : 8 + min(size, FIRST_BYTES - 8)].numpy().tobytes()
        if size > len(data):
            rest = torch.empty(size - len(data), dtype=torch.uint8)
            dist.recv(rest, src=self.source, group=self.group, tag=self._rest_tag)
            data += rest.numpy().tobytes()
        self.backlog -= 1
        return pickle.loads(data)

    def drain(self) -> None:
        """Settle the channel: a receiver takes (and drops) every owed object, the source waits
        until all its sends are done. Both sides call it at the same point."""
        while self.backlog > 0:
            self.receive()
        while self._sends:
            for work, _ in self._sends.popleft():
                work.wait()


def _on_host(tensor: Tensor) -> Tensor:
    return tensor.detach().cpu()


class _Pickler(pickle.Pickler):
    """Pickles plain CPU tensors as their bytes, dtype and shape. The default pickling of a
    tensor routes its storage through ``torch.save`` and ``torch.load``, which costs about 0.2 ms
    a tensor on each side: more than the rest of a step's values, on the critical path of a
    pipeline step. The bytes are the tensor's own, so the values arrive bitwise equal."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is not Tensor
            or obj.device.type != "cpu"
            or obj.layout is not torch.strided
            or obj.is_quantized
            or obj.requires_grad
        ):
            return NotImplemented
        flat = obj.contiguous().reshape(-1).view(torch.uint8)
        return _tensor_from_bytes, (flat.numpy().tobytes(), obj.dtype, tuple(obj.shape))


def _tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
