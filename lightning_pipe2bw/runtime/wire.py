"""The wire format of a point-to-point message: a pytree of tensors split into its tensors and a
pickled header, what both ends of a channel remember of the last header, and the layout of a
packed message (its control, then each tensor at an aligned offset). Used by both transports:
``transport.P2PTransport`` (the process group) and ``shm.SharedMemoryTransport``."""

from __future__ import annotations

import math
import pickle
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

__all__ = ["ALIGN", "Channel", "aligned", "encode", "layout", "view", "views", "wire_device"]

ALIGN = 64  # bytes: where a packed message's control ends and each of its tensors starts
# a message whose tensors take up to this many bytes travels as one buffer with its control
# when the receiver expects it (copied in at the sender; the receiver's tensors are views of it)
PACK_LIMIT = 1 << 20


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


# non-tensor leaves of these types are compared by value and type to tell whether a header is
# unchanged without pickling it, and may be shared between the messages that carry them
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def wire_device(device: torch.device, group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor of a stage on ``device`` must be to travel point to point on ``group``:
    on ``device`` itself when the group's backend for that device type moves device memory
    (NCCL), on the host when it is gloo, whose sends and receives read and write host memory
    only. Stage processes that share one GPU (NCCL refuses two ranks on one device) run on gloo
    and so exchange their activations through host memory."""
    if device.type == "cpu" or not (dist.is_available() and dist.is_initialized()):
        return device
    config = dist.get_backend_config(group)  # e.g. "cpu:gloo,cuda:gloo" or "cuda:nccl"
    backends = dict(item.split(":", 1) for item in config.split(",") if ":" in item)
    backend = backends.get(device.type, config)
    return torch.device("cpu") if backend == "gloo" else device


def _split(obj: Any) -> tuple[list[torch.Tensor], Any, list[Any], list[TensorMeta]]:
    """``obj``'s tensor leaves, tree structure, header leaves (a slot per tensor) and metas."""
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
    return tensors, spec, header_leaves, metas


def _pickle_header(obj: Any, spec: Any, header_leaves: list[Any], metas: list[TensorMeta]) -> bytes:
    try:
        with warnings.catch_warnings():  # torch 2.13 warns when its own LeafSpec is pickled
            warnings.simplefilter("ignore", FutureWarning)
            return pickle.dumps((spec, header_leaves, metas), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise TypeError(
            "a pipeline stage output must be a tensor or a tuple/list/dict of tensors and picklable "
            f"Python values; got {type(obj).__name__} with an unpicklable leaf ({err})"
        ) from err


def flatten_payload(obj: Any) -> tuple[list[torch.Tensor], bytes]:
    """Split ``obj`` into its tensor leaves and a pickled header describing everything else.

    The header holds the tree structure, the non-tensor leaves (plain Python values) and a
    :class:`TensorMeta` per tensor, so shapes may change from one message to the next.
    """
    tensors, spec, header_leaves, metas = _split(obj)
    return tensors, _pickle_header(obj, spec, header_leaves, metas)


def encode(
    channel: Channel, obj: Any
) -> tuple[list[torch.Tensor], list[TensorMeta], bytes | None, bool]:
    """``obj`` to send on ``channel``: its tensors and their metadata, its pickled header (None
    when the channel's cached header is known to serve without pickling) and whether the
    receiver's cached header serves (``same``)."""
    tensors, spec, header_leaves, metas = _split(obj)
    if channel.keeps(spec, header_leaves, metas):
        return tensors, metas, None, True
    header = _pickle_header(obj, spec, header_leaves, metas)
    return tensors, metas, header, header == channel.header


def load_header(header: bytes) -> tuple[Any, list[Any], list[TensorMeta]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return pickle.loads(header)  # type: ignore[no-any-return]


def _plain(header_leaves: list[Any]) -> bool:
    return all(isinstance(x, _TensorSlot) or type(x) in _PLAIN for x in header_leaves)


def _same_leaves(a: list[Any], b: list[Any]) -> bool:
    """Equal header leaves, plain values compared with their types (1, 1.0 and True differ)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, _TensorSlot):
            if not isinstance(y, _TensorSlot) or x.index != y.index:
                return False
        elif type(x) is not type(y) or not (x == y or (x != x and y != y)):  # NaN equals NaN
            return False
    return True


def _nbytes(meta: TensorMeta) -> int:
    return math.prod(meta.shape) * meta.dtype.itemsize


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(metas: list[TensorMeta], start: int = ALIGN) -> tuple[list[int], int]:
    """Where each tensor starts in a message whose tensors follow ``start`` bytes (by default a
    packed message's control), and where the last one ends: each tensor at a multiple of
    ``ALIGN`` bytes (so that every dtype may view it)."""
    offsets, end = [], start
    for meta in metas:
        end = aligned(end)
        offsets.append(end)
        end += _nbytes(meta)
    return offsets, end


def view(buffer: torch.Tensor, offset: int, meta: TensorMeta) -> torch.Tensor:
    """The tensor of ``meta`` at byte ``offset`` of ``buffer``, as a view of it."""
    return buffer[offset : offset + _nbytes(meta)].view(meta.dtype).view(meta.shape)


def views(buffer: torch.Tensor, channel: Channel) -> list[torch.Tensor]:
    """The tensors of a packed message, as views of its buffer."""
    return [
        view(buffer, start, meta)
        for start, meta in zip(channel.offsets, channel.metas, strict=True)
    ]


class Channel:
    """What both ends of a channel (an ordered pair of ranks) know of it after the same
    messages: the last header, and whether the receiver posts the next message's tensors with
    its control message."""

    __slots__ = ("header", "leaves", "metas", "offsets", "plain", "predicted", "size", "spec")

    def __init__(self) -> None:
        self.header: bytes | None = None
        self.spec: Any = None
        self.leaves: list[Any] = []  # header leaves: plain values and a slot per tensor
        self.metas: list[TensorMeta] = []
        self.plain = False  # every non-tensor leaf is a plain value (shared between messages)
        # the last message kept its predecessor's header, so the receiver expects the next one to
        # keep it too and posts its tensors' receives together with its control message
        self.predicted = False
        self.offsets: list[int] = []  # of each tensor in a packed message
        self.size = 0  # bytes of a packed message

    @property
    def packed(self) -> bool:
        """The receiver expects the next message as one buffer: control, then each tensor."""
        return self.predicted and self.size - ALIGN <= PACK_LIMIT

    def advance(self, header: bytes | None, same: bool) -> None:
        """Both ends, after a message: ``header`` (None: unchanged, ``same``)."""
        if not same:
            assert header is not None
            self.header = header
            self.spec, self.leaves, self.metas = load_header(header)
            self.plain = _plain(self.leaves)
            self.offsets, self.size = layout(self.metas)
        self.predicted = same

    def keeps(self, spec: Any, header_leaves: list[Any], metas: list[TensorMeta]) -> bool:
        """Whether a message with these parts has the last header, told without pickling it
        (plain leaves only)."""
        return (
            self.plain
            and metas == self.metas
            and _same_leaves(header_leaves, self.leaves)
            and spec == self.spec
        )

    def unflatten(self, tensors: list[torch.Tensor]) -> Any:
        """The message with the last header and these tensors."""
        assert self.header is not None
        spec, header_leaves = self.spec, self.leaves
        if not self.plain:  # fresh objects for every message
            spec, header_leaves, _ = load_header(self.header)
        leaves = [tensors[x.index] if isinstance(x, _TensorSlot) else x for x in header_leaves]
        return pytree.tree_unflatten(leaves, spec)
