"""What a stage keeps for its backwards: the activations autograd saves, counted, and moved on
demand (to host memory, or to the partner stage) through ``saved_tensors_hooks``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

_ALIGN = 64  # bytes: storages packed into one buffer start at multiples of this

__all__ = ["ActivationStash", "check_memory_plan", "local_shard", "run_eagerly"]

_F = TypeVar("_F", bound=Callable[..., Any])


def run_eagerly(fn: _F) -> _F:
    """``fn`` kept out of ``torch.compile`` (``torch.compiler.disable``), typed: a hook autograd
    may call from a compiled block's frame runs as written, and is never compiled."""
    return cast(_F, torch.compiler.disable(fn))


MemoryPolicy = Literal["keep", "recompute", "swap", "evict"]
# what a memory plan may say about one block's saved activations
MEMORY_POLICIES: tuple[MemoryPolicy, ...] = ("keep", "recompute", "swap", "evict")


def check_memory_plan(plan: Mapping[Any, Any], num_blocks: int | None = None) -> dict[int, str]:
    """``plan`` as ``{block index: policy}``, or a ValueError naming the bad entry."""
    out: dict[int, str] = {}
    for key, policy in plan.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            index = -1
        if index < 0 or isinstance(key, bool) or str(index) != str(key).strip():
            raise ValueError(
                f"memory_plan key {key!r} is not a block index; key the plan by the index of the "
                "block in the body (0, 1, ...), e.g. {0: 'recompute', 5: 'swap'}"
            )
        if num_blocks is not None and index >= num_blocks:
            raise ValueError(
                f"memory_plan names block {index}, but the body has {num_blocks} blocks "
                f"(0..{num_blocks - 1})"
            )
        if policy not in MEMORY_POLICIES:
            valid = ", ".join(repr(p) for p in MEMORY_POLICIES)
            raise ValueError(
                f"memory_plan[{index}] = {policy!r} is not a policy; use one of {valid}"
            )
        out[index] = str(policy)
    return out


@dataclass(eq=False)
class _Storage:
    """One storage autograd saved for a micro-batch's backward (weights excluded)."""

    nbytes: int
    policy: str  # "keep", "swap" or "evict" (what the block that saved it first asked for)
    ptr: int
    data: Tensor | None = None  # the bytes, as uint8, where they are now (None: at the partner)
    where: Literal["device", "host", "peer"] = "device"
    ready: Any = None  # a CUDA event the copy to ``data`` is waited on with
    offset: int = 0  # where it lies in the buffer sent to the partner


@dataclass(eq=False)
class _Saved:
    """A handle autograd keeps in place of a saved tensor whose bytes may move."""

    storage: _Storage
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    tensor: Tensor | None  # the tensor itself while its storage has not moved


@dataclass(eq=False)
class _Micro:
    """What one micro-batch saved."""

    storages: list[_Storage] = field(default_factory=list)
    handles: list[_Saved] = field(default_factory=list)
    counted: dict[int, int] = field(default_factory=dict)  # storage ptr -> bytes, kept in place
    resident: int = 0  # bytes of this micro-batch on the device
    host: int = 0  # bytes of it in the host pool
    away: int = 0  # bytes of it at the partner stage
    away_size: int = 0  # the size of the buffer they were sent in (with alignment)


# a stage's micro-batch: (stage, micro-batch), what the stash counts saved bytes by (a rank with
# virtual stages holds one micro-batch's activations for each of its stages)
MicroKey = tuple[int, int]


class ActivationStash:
    """Records what autograd saves during each micro-batch's forward and keeps it for the
    backward: in place (``keep``), in a host pool (``swap``), or at the partner stage
    (``evict``, by the engine's EVICT/LOAD actions).

    Counting is exact and storage-based: views of one storage count once, and weights (the
    stage's parameters and the micro-batch's weight version) are not activations. A tensor whose
    storage is managed (swap, or a candidate for eviction) is replaced in the graph by a small
    handle; the storage is copied back, and the tensor rebuilt with its dtype, offset, size and
    stride, when the backward unpacks it: the bytes are the same, so results are bitwise equal.

    :attr:`current_policy` is the policy of the block that is saving (set by the stage body
    around each block call, from its memory plan; ``None`` outside the blocks);
    :attr:`evictable` makes every saved storage of a ``keep`` block a candidate for eviction
    (the balancer picks how many bytes at run time).
    """

    def __init__(self, device: torch.device, evictable: bool = False) -> None:
        self.device = device
        self.micro: dict[MicroKey, _Micro] = {}
        # keep / recompute / swap / evict: the running block's, set by the stage body
        self.current_policy: str | None = None
        self.evictable = evictable  # every storage may be evicted (the balancer's fraction)
        self.resident_bytes = 0  # saved bytes of this stage's micro-batches on the device
        self.host_bytes = 0  # in the host pool
        self.away_bytes = 0  # at the partner stage
        self._side: Any = None  # the CUDA stream swaps copy on

    # ------------------------------------------------------------------ forward
    @contextmanager
    def recording(self, microbatch: MicroKey, weights: Iterable[Tensor]) -> Iterator[None]:
        """Record what the forward of ``microbatch`` saves for its backward."""
        # the weights' storages (a DTensor's, under fsdp=True: its shard; the weights FSDP
        # gathers for a block's call are parameters, or views of them, when saved)
        skip = {local_shard(t).untyped_storage().data_ptr() for t in weights}
        micro = self.micro.setdefault(microbatch, _Micro())
        by_ptr: dict[int, _Storage] = {}

        # what a pack hook returns, autograd keeps in the node that saved it. A tensor that is
        # the node's own output holds that node as its grad_fn: kept as it is, it would make a
        # cycle through C++ that Python's collector cannot see, and a graph kept for a second
        # pass (a backward cut in two, SplitBackward) would never be freed. So the hook keeps
        # a detached alias (same storage and version counter); autograd reattaches the grad_fn
        # when it unpacks it, as it does without hooks. Both hooks run as written even when
        # autograd calls them from a compiled block (after a graph break, the rest of the
        # block's frame runs under torch.compile's frame hook, which would otherwise compile
        # them, and again for every new storage address it guarded on).
        @run_eagerly
        def pack(t: Tensor) -> Any:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in skip or _is_weight(t):
                return t.detach()
            policy = self.current_policy or "keep"
            if policy == "keep" and self.evictable and self.current_policy is not None:
                policy = "evict"
            # storages no block asked to move stay in autograd's graph, only counted
            if policy not in ("swap", "evict") and ptr not in by_ptr:
                if ptr not in micro.counted and ptr not in by_ptr:
                    micro.counted[ptr] = storage.nbytes()
                    self._add(micro, storage.nbytes(), "device")
                return t.detach()
            rec = by_ptr.get(ptr)
            if rec is None:
                if ptr in micro.counted:  # a kept storage that a managed block saves again
                    return t.detach()
                rec = _Storage(storage.nbytes(), policy, ptr)
                rec.data = _bytes_of(t)
                by_ptr[ptr] = rec
                micro.storages.append(rec)
                self._add(micro, rec.nbytes, "device")
            offset = int(t.storage_offset())
            handle = _Saved(rec, t.dtype, offset, tuple(t.shape), tuple(t.stride()), t.detach())
            micro.handles.append(handle)
            return handle

        @run_eagerly
        def unpack(saved: Any) -> Tensor:
            if isinstance(saved, Tensor):
                return saved
            return self._unpack(saved)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        # storages stay referenced until the forward ends, so that no new tensor of this
        # forward reuses the address of one already recorded; now swap out what asks for it
        for rec in micro.storages:
            if rec.policy == "swap" and rec.where == "device":
                self._swap_out(micro, rec)

    def note_held(self, microbatch: MicroKey, tensors: Any) -> None:
        """Count tensors the forward holds for the backward outside autograd's saved tensors
        (the inputs ``torch.utils.checkpoint`` keeps to recompute a block)."""
        micro = self.micro.setdefault(microbatch, _Micro())
        for t in pytree.tree_leaves(tensors):
            if isinstance(t, Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in micro.counted:
                    micro.counted[storage.data_ptr()] = storage.nbytes()
                    self._add(micro, storage.nbytes(), "device")

    def saved_bytes(self, microbatch: MicroKey) -> int:
        """All bytes ``microbatch`` saved, wherever they are now."""
        micro = self.micro.get(microbatch)
        return 0 if micro is None else micro.resident + micro.host + micro.away

    # ------------------------------------------------------------------ moving bytes
    def _add(self, micro: _Micro, nbytes: int, where: str) -> None:
        if where == "device":
            micro.resident += nbytes
            self.resident_bytes += nbytes
        elif where == "host":
            micro.host += nbytes
            self.host_bytes += nbytes
        else:
            micro.away += nbytes
            self.away_bytes += nbytes

    def _move(self, micro: _Micro, rec: _Storage, to: Literal["device", "host", "peer"]) -> None:
        self._add(micro, -rec.nbytes, rec.where)
        self._add(micro, rec.nbytes, to)
        rec.where = to
        for handle in micro.handles:  # the graph now holds only the handle
            if handle.storage is rec:
                handle.tensor = None

    def _swap_out(self, micro: _Micro, rec: _Storage) -> None:
        assert rec.data is not None
        src = rec.data
        if src.is_cuda:
            side = self._side_stream()
            side.wait_stream(torch.cuda.current_stream(src.device))
            host = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(side):
                host.copy_(src, non_blocking=True)
                src.record_stream(side)  # the allocator waits for the copy before reuse
                rec.ready = torch.cuda.Event()
                rec.ready.record(side)
        else:  # the same path on CPU: the bytes move to a pool of their own
            host = src.clone()
        rec.data = host
        self._move(micro, rec, "host")

    def prefetch(self, microbatch: MicroKey) -> None:
        """Start copying ``microbatch``'s swapped storages back (before its backward)."""
        micro = self.micro.get(microbatch)
        if micro is None:
            return
        for rec in micro.storages:
            if rec.where != "host":
                continue
            assert rec.data is not None
            if self.device.type == "cuda":
                side = self._side_stream()
                with torch.cuda.stream(side):
                    if rec.ready is not None:
                        side.wait_event(rec.ready)
                    rec.data = rec.data.to(self.device, non_blocking=True)
                    rec.ready = torch.cuda.Event()
                    rec.ready.record(side)
            else:
                rec.data = rec.data.clone()
            self._move(micro, rec, "device")

    def _side_stream(self) -> Any:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def evict(self, microbatch: MicroKey, fraction: float | None, keep: Any = ()) -> Tensor | None:
        """Take storages of ``microbatch`` off this stage, newest first, and return their bytes
        packed in one uint8 buffer for the partner (None if nothing is taken). With
        ``fraction``, about that share of the micro-batch's saved bytes (the storages whose
        sizes best approach it); without, the storages of blocks whose policy is ``evict``.
        Storages that ``keep`` (the stage's input and output, which the engine holds anyway)
        also references are never taken: sending them would free nothing."""
        micro = self.micro.get(microbatch)
        if micro is None:
            return None
        pinned = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves(keep)
            if isinstance(t, Tensor)
        }
        candidates = [
            rec
            for rec in reversed(micro.storages)
            if rec.where == "device" and rec.policy == "evict" and rec.ptr not in pinned
        ]
        taken: list[_Storage] = []
        if fraction is None:
            taken = candidates
        elif fraction > 0:
            target = fraction * (micro.resident + micro.host + micro.away)
            total = 0
            for rec in candidates:
                if total + rec.nbytes / 2 > target:
                    break
                taken.append(rec)
                total += rec.nbytes
        if not taken:
            return None
        # one buffer, each storage at an offset aligned for any dtype (and vector loads)
        offsets, size = [], 0
        for rec in taken:
            offsets.append(size)
            size += -(-rec.nbytes // _ALIGN) * _ALIGN
        flat = torch.empty(size, dtype=torch.uint8, device=self.device)
        for rec, offset in zip(taken, offsets, strict=True):
            assert rec.data is not None
            flat[offset : offset + rec.nbytes].copy_(rec.data)
            rec.data = None
            rec.offset = offset
            self._move(micro, rec, "peer")
        micro.away_size = size
        return flat

    def away_size(self, microbatch: MicroKey) -> int:
        """The size of the buffer :meth:`evict` sent for ``microbatch`` (0: nothing)."""
        micro = self.micro.get(microbatch)
        return 0 if micro is None else micro.away_size

    def restore(self, microbatch: MicroKey, flat: Tensor | None) -> None:
        """Put back the storages :meth:`evict` took, from the buffer the partner returned."""
        micro = self.micro.get(microbatch)
        expected = self.away_size(microbatch)
        got = 0 if flat is None else flat.numel()
        if got != expected:
            raise RuntimeError(
                f"micro-batch {microbatch} came back from the partner stage with {got} bytes but "
                f"{expected} were sent: the stages' offload actions are out of order"
            )
        if micro is None or flat is None:
            return
        for rec in micro.storages:
            if rec.where == "peer":
                rec.data = flat[rec.offset : rec.offset + rec.nbytes]
                self._move(micro, rec, "device")
        micro.away_size = 0

    def release(self, microbatch: MicroKey) -> None:
        """Forget ``microbatch`` after its backward: autograd has let go of its saved tensors."""
        micro = self.micro.pop(microbatch, None)
        if micro is not None:
            self.resident_bytes -= micro.resident
            self.host_bytes -= micro.host
            self.away_bytes -= micro.away

    def clear(self) -> None:
        """Forget everything (evaluation, or a failed step)."""
        for microbatch in list(self.micro):
            self.release(microbatch)

    # ------------------------------------------------------------------ backward
    def _unpack(self, saved: _Saved) -> Tensor:
        if saved.tensor is not None:
            return saved.tensor
        rec = saved.storage
        if rec.where != "device" or rec.data is None:
            raise RuntimeError(
                f"the backward needs a saved activation that is still {rec.where!r}: the memory "
                "plan's actions did not bring it back before the backward (a bug in pipe2bw)"
            )
        if rec.ready is not None:
            torch.cuda.current_stream(rec.data.device).wait_event(rec.ready)
            rec.data.record_stream(torch.cuda.current_stream(rec.data.device))
            rec.ready = None
        # ``data`` may lie inside a larger buffer (what came back from the partner), at an
        # offset aligned for every dtype
        start = rec.data.storage_offset() // saved.dtype.itemsize + saved.offset
        return torch.empty(0, dtype=saved.dtype, device=rec.data.device).set_(
            rec.data.untyped_storage(), start, saved.size, saved.stride
        )


def _bytes_of(t: Tensor) -> Tensor:
    """The whole storage under ``t``, as a flat uint8 tensor sharing it."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def local_shard(t: Tensor) -> Tensor:
    """``t``, or the shard this rank holds of a DTensor (``fsdp=True``)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _is_weight(t: Tensor) -> bool:
    """A parameter, or a view of one (a linear layer saves its weight's transpose)."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
