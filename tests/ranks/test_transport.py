"""P2P transport over a real 2-rank gloo group (the pure helpers: ``tests/unit/test_transport.py``).

Functions whose name starts with ``_on_rank`` run on every rank of the pool (module level, so
they pickle by name); each returns plain, picklable summaries that the test process checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils import _pytree as pytree
from unit.test_transport import (
    CONTROL,
    LARGE,
    dtypes,
    expected_deltas,
    mixed_dict,
    sequence_message,
)

import lightning_pipe2bw.runtime.transport as transport_module
from lightning_pipe2bw.failures.record import FailureRecord, StageFailure
from lightning_pipe2bw.runtime.transport import P2PTransport
from lightning_pipe2bw.runtime.wire import flatten_payload

TIMEOUT = 60  # seconds; a deadlocked transport fails the test instead of hanging the session


MIB_FLOATS = 1 << 18  # float32 elements in 1 MiB: larger than any eager-send buffering


@dataclass(frozen=True)
class Leaf:
    """What a rank saw of one tensor leaf (picklable, compared in the test process)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool
    is_leaf: bool
    value: Tensor


def summarize(obj: Any) -> Any:
    """``obj`` with each tensor replaced by a detached :class:`Leaf` description."""

    def leaf(x: Any) -> Any:
        if isinstance(x, Tensor):
            return Leaf(x.dtype, tuple(x.shape), x.requires_grad, x.is_leaf, x.detach().clone())
        return x

    return pytree.tree_map(leaf, obj)


def assert_received(received: Any, sent: Any) -> None:
    """``received`` (a summary) has ``sent``'s structure, plain values, dtypes, shapes and values;
    every tensor arrives as a leaf that requires grad exactly when the sent tensor did."""
    got, got_spec = pytree.tree_flatten(received)
    want, want_spec = pytree.tree_flatten(sent)
    assert got_spec == want_spec
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if isinstance(w, Tensor):
            assert isinstance(g, Leaf), (g, w)
            assert g.dtype == w.dtype
            assert g.shape == tuple(w.shape)
            assert g.requires_grad == w.requires_grad
            assert g.is_leaf
            assert torch.equal(g.value, w.detach()), (g.value, w)
        else:
            assert type(g) is type(w)
            assert g == w


def _rank() -> int:
    return dist.get_rank()


def _transport() -> P2PTransport:
    return P2PTransport(None, torch.device("cpu"))


def plain_tensor() -> Any:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(1))


def mixed_tuple() -> Any:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, generator=g).requires_grad_(True)
    return (
        w * 2,  # non-leaf that requires grad
        torch.randn(2, 2, generator=g),  # no grad
        7,
        "tag",
        None,
        torch.arange(3),
        w,  # a leaf that requires grad
    )


def odd_shapes() -> Any:
    g = torch.Generator().manual_seed(5)
    return {
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "transposed": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "slice": torch.arange(20.0)[::3],
    }


PAYLOADS: dict[str, Callable[[], Any]] = {
    "plain_tensor": plain_tensor,
    "mixed_tuple": mixed_tuple,
    "mixed_dict": mixed_dict,
    "dtypes": dtypes,
    "odd_shapes": odd_shapes,
}


def _on_rank_send_one(name: str) -> Any:
    tr = _transport()
    payload = PAYLOADS[name]()
    if _rank() == 0:
        tr.send(payload, 1)
        tr.wait_sends()
        return {"pending": tr.pending_bytes, "sent": tr.bytes_sent}
    received = tr.recv(0)
    return {"received": summarize(received), "bytes": tr.bytes_received}


def _on_rank_sequence(lengths: list[int]) -> Any:
    tr = _transport()
    if _rank() == 0:
        deltas = []
        for step, length in enumerate(lengths):
            before = tr.bytes_sent
            tr.send(sequence_message(length, step), 1)
            deltas.append(tr.bytes_sent - before)
        tr.wait_sends()
        return {"deltas": deltas, "pending": tr.pending_bytes}
    received = [summarize(tr.recv(0)) for _ in lengths]
    return {"received": received, "bytes": tr.bytes_received}


def _on_rank_many_before_recv(count: int) -> Any:
    """Rank 0 starts ``count`` large sends, then signals rank 1 on another tag; rank 1 receives
    only after the signal. If ``send`` blocked until delivery, rank 0 would never signal."""
    tr = _transport()
    flag = torch.zeros(1)
    if _rank() == 0:
        for i in range(count):
            tr.send((torch.full((MIB_FLOATS,), float(i)), i), 1)
        pending = tr.pending_bytes
        sent = tr.bytes_sent
        dist.send(flag, 1, tag=7)
        tr.wait_sends()
        return {
            "pending_before_recv": pending,
            "sent": sent,
            "pending_after_wait": tr.pending_bytes,
        }
    dist.recv(flag, 0, tag=7)
    out = []
    for _ in range(count):
        t, i = tr.recv(0)
        out.append((i, float(t.min()), float(t.max()), t.numel()))
    return {"received": out}


def _on_rank_both_directions(count: int) -> Any:
    """Both ranks send ``count`` large messages to each other before either receives."""
    tr = _transport()
    me, peer = _rank(), 1 - _rank()
    for i in range(count):
        tr.send({"src": me, "i": i, "data": torch.full((MIB_FLOATS,), float(10 * me + i))}, peer)
    got = []
    for _ in range(count):
        msg = tr.recv(peer)
        got.append((msg["src"], msg["i"], float(msg["data"].min()), float(msg["data"].max())))
    tr.wait_sends()
    return {"received": got, "pending": tr.pending_bytes}


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_send_recv_roundtrip(pools: Any, name: str) -> None:
    sender, receiver = pools(2).run(_on_rank_send_one, name, timeout=TIMEOUT)
    sent = PAYLOADS[name]()
    assert_received(receiver["received"], sent)
    assert sender["pending"] == 0
    tensors, header = flatten_payload(sent)
    payload_bytes = sum(t.numel() * t.element_size() for t in tensors)
    # the control, the header (first message on the channel) and the tensor leaves, counted the
    # same way at both ends
    assert sender["sent"] == CONTROL + len(header) + payload_bytes
    assert receiver["bytes"] == sender["sent"]


def test_requires_grad_is_carried_over(pools: Any) -> None:
    _, receiver = pools(2).run(_on_rank_send_one, "mixed_tuple", timeout=TIMEOUT)
    got = [x for x in pytree.tree_leaves(receiver["received"]) if isinstance(x, Leaf)]
    # (w * 2, plain, arange, w): the non-leaf and the leaf that require grad arrive as leaves
    # requiring grad; the others do not (and int64 never does)
    assert [x.requires_grad for x in got] == [True, False, False, True]
    assert all(x.is_leaf for x in got)


@pytest.mark.parametrize(
    "lengths",
    [
        [5, 7, 5, 5, 3, 7, 7],
        [4, 4, 4, 6, 6, 6, 2, 4, 4, 9],
        [LARGE, LARGE, LARGE, LARGE + 1, LARGE + 1, LARGE + 1, 3],
    ],
    ids=["changing", "steady-then-changing", "larger-than-a-packed-message"],
)
def test_shapes_change_between_messages_on_one_channel(pools: Any, lengths: list[int]) -> None:
    sender, receiver = pools(2).run(_on_rank_sequence, lengths, timeout=TIMEOUT)
    for step, (length, got) in enumerate(zip(lengths, receiver["received"], strict=True)):
        assert_received(got, sequence_message(length, step))
    # the header goes out only when it differs from the previous one on the channel; fillers
    # only for a change right after a kept header (rounds 5 of the first list, 4 and 7 of the
    # second, 4 and 7 of the third, whose tensors are not packed)
    assert sender["deltas"] == expected_deltas(lengths)
    assert sum(sender["deltas"]) == receiver["bytes"]
    assert sender["pending"] == 0


def test_sends_do_not_block_and_arrive_in_order(pools: Any) -> None:
    count = 4
    sender, receiver = pools(2).run(_on_rank_many_before_recv, count, timeout=TIMEOUT)
    assert receiver["received"] == [(i, float(i), float(i), MIB_FLOATS) for i in range(count)]
    # every send returned while the receiver had not posted a single recv: data still buffered
    assert 0 < sender["pending_before_recv"] <= sender["sent"]
    assert sender["pending_after_wait"] == 0


def test_both_directions_at_once(pools: Any) -> None:
    count = 2
    results = pools(2).run(_on_rank_both_directions, count, timeout=TIMEOUT)
    for me, result in enumerate(results):
        peer = 1 - me
        assert result["received"] == [
            (peer, i, float(10 * peer + i), float(10 * peer + i)) for i in range(count)
        ]
        assert result["pending"] == 0


def _on_rank_byte_counters() -> Any:
    tr = _transport()
    if _rank() == 0:
        tr.send(mixed_dict(), 1)
        tr.wait_sends()
        return tr.bytes_sent
    tr.recv(0)
    return tr.bytes_received


def test_byte_counters_agree_across_a_channel(pools: Any) -> None:
    sent, received = pools(2).run(_on_rank_byte_counters, timeout=TIMEOUT)
    assert sent == received


def _on_rank_notice(length: int) -> Any:
    """Three messages with one header, so that rank 1 posts the fourth's tensor receives with
    its control; rank 0 then fails and sends a notice in the fourth's place."""
    tr = _transport()
    if _rank() == 0:
        for step in range(3):
            tr.send(sequence_message(length, step), 1)
        unread = len(transport_module._UNREAD_NOTICES)
        tr.notify(FailureRecord(0, 0, "0F3", "RuntimeError: boom"), [1], timeout_s=20.0)
        tr.wait_sends()
        # taken, and seen taken: kept as unread, or (gloo marks a send completed only once it
        # is waited for) notify would wait out its whole timeout after every notice
        return len(transport_module._UNREAD_NOTICES) - unread
    return failure_after(tr, 3)


def failure_after(tr: Any, messages: int) -> Any:
    """On the receiving rank: take ``messages`` messages from rank 0, then the failure notice
    that must follow them, as (rank, action, error, source); "no failure" if a message came."""
    for _ in range(messages):
        tr.recv(0)
    try:
        tr.recv(0)
    except StageFailure as failure:
        return (failure.record.rank, failure.record.action, failure.record.error, failure.source)
    return "no failure"


@pytest.mark.parametrize("length", [3, LARGE], ids=["packed", "larger-than-a-packed-message"])
def test_a_notice_takes_the_place_of_an_expected_message(pools: Any, length: int) -> None:
    unread, got = pools(2).run(_on_rank_notice, length, timeout=TIMEOUT)
    assert got == (0, "0F3", "RuntimeError: boom", 0)
    assert unread == 0


def _on_rank_stale_notice() -> Any:
    """An earlier transport's notice, with a filler for the message its receiver expected and
    never posted, stays on that transport's tag: the next transport on the channel gets its own
    message."""
    old = _transport()
    if _rank() == 0:
        for step in range(3):
            old.send(sequence_message(3, step), 1)
        old.notify(FailureRecord(0, 0, "0F3", "RuntimeError: old"), [1], timeout_s=0.5)
    else:
        for _ in range(3):
            old.recv(0)  # the receiver fails here too, before it reads the notice
    new = _transport()  # created on both ranks, as every rank creates its transports
    if _rank() == 0:
        new.send(sequence_message(5, 9), 1)
        new.wait_sends()
        return None
    return summarize(new.recv(0))


def test_a_notice_of_an_earlier_run_is_not_taken_for_a_message(pools: Any) -> None:
    _, got = pools(2).run(_on_rank_stale_notice, timeout=TIMEOUT)
    assert_received(got, sequence_message(5, 9))


LEAVES = [1, 1, 1.0, True, float("nan"), float("nan"), "a", "a", torch.float16, None]


def _on_rank_plain_leaves() -> Any:
    """A tensor with each of ``LEAVES`` in turn: an unchanged header is told without pickling,
    which must not take 1, 1.0 and True for one another (they compare equal)."""
    tr = _transport()
    x = torch.ones(2)
    if _rank() == 0:
        deltas = []
        for leaf in LEAVES:
            before = tr.bytes_sent
            tr.send((x, leaf), 1)
            deltas.append(tr.bytes_sent - before)
        tr.wait_sends()
        return deltas
    got = [tr.recv(0)[1] for _ in LEAVES]
    return [(type(v).__name__, repr(v)) for v in got]


def test_unchanged_headers_keep_the_types_of_plain_leaves(pools: Any) -> None:
    deltas, got = pools(2).run(_on_rank_plain_leaves, timeout=TIMEOUT)
    assert got == [(type(v).__name__, repr(v)) for v in LEAVES]
    # the header went out with every change of value or type, not with a repeat (NaN included)
    resent = [d > CONTROL + 8 + 16 for d in deltas]  # control, fillers of 8 B, tensor: no header
    assert resent == [True, False, True, True, True, False, True, False, True, True]


class Box:
    """A picklable, mutable non-tensor leaf."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:  # equal whatever the value: a careless __eq__
        return isinstance(other, Box)

    __hash__ = None  # type: ignore[assignment]


def _on_rank_object_leaves() -> Any:
    tr = _transport()
    if _rank() == 0:
        for i in range(3):
            tr.send((torch.ones(1), Box(i)), 1)
        tr.wait_sends()
        return None
    boxes = [tr.recv(0)[1] for _ in range(3)]
    return [b.value for b in boxes], len({id(b) for b in boxes})


def test_other_leaves_arrive_as_sent_and_as_fresh_objects(pools: Any) -> None:
    _, (values, distinct) = pools(2).run(_on_rank_object_leaves, timeout=TIMEOUT)
    assert values == [0, 1, 2]  # Box's __eq__ would have kept the first header
    assert distinct == 3
