"""P2P transport over a real 2-rank gloo group, and the pure micro-batch split/merge helpers.

Functions whose name starts with ``_on_rank`` run on every rank of the pool (module level, so
they pickle by name); each returns plain, picklable summaries that the test process checks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.utils import _pytree as pytree

from lightning_pipe2bw.runtime.failure import FailureRecord, StageFailure
from lightning_pipe2bw.runtime.microbatch import batch_size_of, merge_outputs, split_batch
from lightning_pipe2bw.runtime.transport import (
    PACK_LIMIT,
    P2PTransport,
    TensorMeta,
    _load_header,
    flatten_payload,
)

FAST = settings(max_examples=40, deadline=None, database=None)
TIMEOUT = 60  # seconds; a deadlocked transport fails the test instead of hanging the session
MIB_FLOATS = 1 << 18  # float32 elements in 1 MiB: larger than any eager-send buffering
CONTROL = 3 * 8  # a message's control: header length, filler count, largest filler (int64)
LARGE = 40_000  # a sequence length whose message takes more than PACK_LIMIT bytes


# ----------------------------------------------------------------------------- helpers


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


# ----------------------------------------------------------------------------- payloads
# Built identically on every rank (and in the test process) from a fixed seed.


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


def mixed_dict() -> Any:
    g = torch.Generator().manual_seed(3)
    return {
        "hidden": torch.randn(2, 3, generator=g).requires_grad_(True),
        "mask": torch.tensor([True, False]),
        "n": 2,
        "name": "x",
        "none": None,
        "nested": [torch.randn(1, generator=g), (3.5, torch.randn(2, generator=g))],
    }


def dtypes() -> Any:
    g = torch.Generator().manual_seed(4)
    return (
        torch.randn(3, 2, generator=g).to(torch.bfloat16).requires_grad_(True),
        torch.randn(3, 2, generator=g).to(torch.bfloat16),
        torch.tensor([-(2**40), 0, 2**40], dtype=torch.int64),
        torch.tensor([[True, False], [False, True]]),
        torch.randn(3, 2, generator=g).to(torch.float64),
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


def sequence_message(length: int, step: int) -> Any:
    """A message whose shapes (and whether its hidden state requires grad) depend on ``length`` (a
    sequence length) and values on ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    return {
        "hidden": torch.randn(2, length, 4, generator=g).requires_grad_(length % 2 == 1),
        "positions": torch.arange(length),
    }


# ----------------------------------------------------------------------------- rank functions


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


def packed_size(tensors: list[Tensor]) -> int:
    """The bytes of a packed message: a 64-byte control, then each tensor at a multiple of 64."""
    end = 64
    for t in tensors:
        end = -(-end // 64) * 64 + t.numel() * t.element_size()
    return end


def expected_deltas(lengths: list[int]) -> list[int]:
    """The bytes each message of :func:`sequence_message` puts on the channel. After a message
    that kept its predecessor's header, the receiver expects the next one to keep it too and
    posts its receives: one packed buffer (control and tensors) up to PACK_LIMIT bytes of
    tensors, else the control and a receive per tensor. Otherwise a message is the control, the
    header when it changed, and the tensors. A changed header that was expected to stay comes
    after fillers of the expected sizes."""
    deltas = []
    previous: bytes | None = None
    previous_tensors: list[Tensor] = []
    kept = False  # the previous message kept its predecessor's header
    for step, length in enumerate(lengths):
        tensors, header = flatten_payload(sequence_message(length, step))
        payload = sum(t.numel() * t.element_size() for t in tensors)
        same = header == previous
        packed = kept and sum(t.numel() * t.element_size() for t in previous_tensors) <= PACK_LIMIT
        if same and packed:
            deltas.append(packed_size(tensors))
        elif same:
            deltas.append(CONTROL + payload)
        else:
            lead = CONTROL
            if kept:
                lead = packed_size(previous_tensors) if packed else CONTROL + sum(
                    t.numel() * t.element_size() for t in previous_tensors
                )
            deltas.append(lead + len(header) + payload)
        previous, previous_tensors, kept = header, tensors, same
    return deltas


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


# ----------------------------------------------------------------------------- P2P tests


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


def test_expected_deltas_pack_and_fill_only_after_a_kept_header() -> None:
    plain = expected_deltas([3, 3, 3])
    changed = expected_deltas([3, 3, 3, 4])
    assert changed[:3] == plain
    tensors3, _ = flatten_payload(sequence_message(3, 2))
    tensors4, header4 = flatten_payload(sequence_message(4, 3))
    # the third message is expected: one packed buffer; the fourth fills that buffer first
    # the hidden state's 96 bytes at 64, the positions' 24 at 192 (the next multiple of 64)
    assert plain[2] == packed_size(tensors3) == 192 + 3 * 8
    assert changed[3] == packed_size(tensors3) + len(header4) + sum(
        t.numel() * t.element_size() for t in tensors4
    )
    large = expected_deltas([LARGE] * 3)
    tensors, _ = flatten_payload(sequence_message(LARGE, 2))
    assert large[2] == CONTROL + sum(t.numel() * t.element_size() for t in tensors)  # not packed


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


# ----------------------------------------------------------------------------- flatten_payload


def test_flatten_payload_splits_tensors_from_header() -> None:
    payload = mixed_dict()
    tensors, header = flatten_payload(payload)
    leaves = [x for x in pytree.tree_leaves(payload) if isinstance(x, Tensor)]
    assert len(tensors) == len(leaves)
    assert all(t is leaf for t, leaf in zip(tensors, leaves, strict=True))
    assert isinstance(header, bytes)
    # the header is a function of structure, plain values and tensor metadata, not tensor values
    again = pytree.tree_map(
        lambda x: (
            torch.zeros_like(x).requires_grad_(x.requires_grad) if isinstance(x, Tensor) else x
        ),
        mixed_dict(),
    )
    assert flatten_payload(again)[1] == header


@pytest.mark.parametrize(
    "change",
    [
        lambda p: {**p, "hidden": torch.zeros(3, 3)},  # shape
        lambda p: {**p, "hidden": p["hidden"].double()},  # dtype
        lambda p: {**p, "hidden": p["hidden"].detach()},  # requires_grad
        lambda p: {**p, "n": 3},  # a plain value
        lambda p: {**p, "extra": None},  # structure
    ],
    ids=["shape", "dtype", "requires_grad", "value", "structure"],
)
def test_flatten_payload_header_changes_with_metadata(change: Callable[[Any], Any]) -> None:
    payload = mixed_dict()
    assert flatten_payload(change(payload))[1] != flatten_payload(payload)[1]


def test_tensor_meta_is_what_the_receiver_allocates() -> None:
    _, header = flatten_payload(dtypes())
    _, _, metas = _load_header(header)  # what the receiver reads (torch's pytree warns)
    assert metas == [
        TensorMeta((3, 2), torch.bfloat16, True),
        TensorMeta((3, 2), torch.bfloat16, False),
        TensorMeta((3,), torch.int64, False),
        TensorMeta((2, 2), torch.bool, False),
        TensorMeta((3, 2), torch.float64, False),
    ]


def _generator() -> Any:
    yield 1


@pytest.mark.parametrize(
    ("leaf", "type_text"),
    [
        (lambda x: x, "function"),
        (threading.Lock(), "lock"),
        (_generator(), "generator"),
    ],
    ids=["lambda", "lock", "generator"],
)
def test_flatten_payload_unpicklable_leaf(leaf: Any, type_text: str) -> None:
    with pytest.raises(TypeError) as info:
        flatten_payload((torch.ones(2), {"bad": leaf}))
    message = str(info.value)
    assert "unpicklable leaf" in message
    assert "tuple" in message  # the payload's type
    assert type_text in message  # the leaf's type, from pickle's own message
    assert "tensor or a tuple/list/dict of tensors" in message  # what is allowed instead


# ----------------------------------------------------------------------------- split_batch


@FAST
@given(n=st.integers(1, 40), data=st.data())
def test_split_batch_matches_tensor_split(n: int, data: st.DataObject) -> None:
    m = data.draw(st.integers(1, n), label="microbatches")
    x = torch.arange(n * 3).reshape(n, 3)
    y = torch.arange(n)
    parts, sizes = split_batch({"x": x, "y": y}, m)
    expected_x = torch.tensor_split(x, m)
    expected_y = torch.tensor_split(y, m)
    assert len(parts) == len(sizes) == m
    assert sizes == [len(c) for c in expected_x]
    assert sum(sizes) == n
    assert max(sizes) - min(sizes) <= 1
    for part, ex, ey, k in zip(parts, expected_x, expected_y, sizes, strict=True):
        assert torch.equal(part["x"], ex)
        assert torch.equal(part["y"], ey)
        assert batch_size_of(part) == k


@pytest.mark.parametrize(("n", "m", "sizes"), [(8, 2, [4, 4]), (7, 2, [4, 3]), (7, 3, [3, 2, 2])])
def test_split_batch_sizes(n: int, m: int, sizes: list[int]) -> None:
    _, got = split_batch((torch.zeros(n, 2), torch.zeros(n)), m)
    assert got == sizes


def test_split_batch_shares_non_tensor_leaves() -> None:
    scale = torch.tensor(0.5)
    batch = {"x": torch.randn(5, 2), "scale": scale, "name": "abc", "k": 3, "none": None}
    parts, sizes = split_batch(batch, 2)
    assert sizes == [3, 2]
    for part in parts:
        assert part["scale"] is scale  # 0-dim tensors are shared, not split
        assert part["name"] == "abc"
        assert part["k"] == 3
        assert part["none"] is None
    assert torch.equal(torch.cat([p["x"] for p in parts]), batch["x"])


@pytest.mark.parametrize(("n", "m"), [(1, 2), (3, 4), (2, 8)])
def test_split_batch_smaller_than_microbatches(n: int, m: int) -> None:
    with pytest.raises(ValueError) as info:
        split_batch((torch.zeros(n, 2), torch.zeros(n)), m)
    message = str(info.value)
    assert f"a batch of {n} samples" in message
    assert f"microbatches={m}" in message
    assert f"at least {m}" in message


def test_split_batch_mismatched_sizes() -> None:
    with pytest.raises(ValueError) as info:
        split_batch({"x": torch.zeros(4, 2), "y": torch.zeros(5)}, 2)
    message = str(info.value)
    assert "[4, 5]" in message
    assert "dimension 0" in message


def test_split_batch_without_batch_dimension() -> None:
    with pytest.raises(TypeError, match="no tensor with a batch dimension"):
        split_batch({"scale": torch.tensor(1.0), "name": "x"}, 2)


# ----------------------------------------------------------------------------- merge_outputs


@FAST
@given(n=st.integers(1, 30), data=st.data())
def test_merging_microbatch_mean_losses_gives_full_batch_mean(n: int, data: st.DataObject) -> None:
    m = data.draw(st.integers(1, n), label="microbatches")
    g = torch.Generator().manual_seed(n * 100 + m)
    pred = torch.randn(n, 3, generator=g, dtype=torch.float64)
    target = torch.randn(n, 3, generator=g, dtype=torch.float64)
    parts, sizes = split_batch((pred, target), m)
    outputs = [
        {
            "loss": torch.nn.functional.mse_loss(p, t),
            "err": float((p - t).abs().mean()),
            "pred": p,
        }
        for p, t in parts
    ]
    merged = merge_outputs(outputs, sizes)
    full_loss = torch.nn.functional.mse_loss(pred, target)
    assert torch.allclose(merged["loss"], full_loss, rtol=1e-12, atol=1e-12)
    assert merged["err"] == pytest.approx(float((pred - target).abs().mean()), rel=1e-12)
    assert torch.equal(merged["pred"], pred)


def test_merge_outputs_uneven_per_sample_and_other_leaves() -> None:
    sizes = [4, 3]
    outputs = [
        (torch.full((4, 2), 1.0), torch.tensor(1.0), 2, "a", torch.zeros(5)),
        (torch.full((3, 2), 2.0), torch.tensor(4.0), 9, "b", torch.ones(5)),
    ]
    per_sample, scalar, number, text, odd = merge_outputs(outputs, sizes)
    assert torch.equal(per_sample, torch.cat([torch.full((4, 2), 1.0), torch.full((3, 2), 2.0)]))
    assert float(scalar) == pytest.approx((4 * 1.0 + 3 * 4.0) / 7)
    assert number == 2 + 9  # an integer is a count: summed, as one device counts the batch
    assert text == ["a", "b"]  # not mergeable: one per micro-batch
    assert isinstance(odd, list) and len(odd) == 2  # dim 0 is not the micro-batch size
    assert torch.equal(odd[1], torch.ones(5))


def test_split_and_merge_per_sample_python_values() -> None:
    """A string per sample (``default_collate`` gives a list of them) is split with the tensors
    and concatenated back; integer counts are summed, float means size-weighted."""
    names = [f"img{i}.png" for i in range(7)]
    batch = (torch.arange(7.0).reshape(7, 1), names, ("a", "b"), ["const"])
    parts, sizes = split_batch(batch, 2)
    assert sizes == [4, 3]
    assert [p[1] for p in parts] == [names[:4], names[4:]]
    assert all(p[2] == ("a", "b") and p[3] == ["const"] for p in parts)  # not one per sample
    outputs = [
        {"names": p[1], "ids": tuple(range(k)), "correct": torch.tensor(k - 1), "acc": 0.5 * k}
        for p, k in zip(parts, sizes, strict=True)
    ]
    merged = merge_outputs(outputs, sizes)
    assert merged["names"] == names
    assert merged["ids"] == (0, 1, 2, 3, 0, 1, 2)
    assert merged["correct"].dtype == torch.int64 and int(merged["correct"]) == 3 + 2
    assert merged["acc"] == pytest.approx((4 * 2.0 + 3 * 1.5) / 7)


def test_merge_outputs_single_and_empty() -> None:
    only = {"loss": torch.tensor(1.0)}
    assert merge_outputs([only], [8]) is only
    assert merge_outputs([], []) is None


def test_merge_outputs_different_structures_are_listed() -> None:
    outputs = [{"a": torch.zeros(2)}, {"b": torch.zeros(2)}]
    assert merge_outputs(outputs, [2, 2]) == outputs


# ----------------------------------------------------------------------------- failure notices


def _on_rank_notice(length: int) -> Any:
    """Three messages with one header, so that rank 1 posts the fourth's tensor receives with
    its control; rank 0 then fails and sends a notice in the fourth's place."""
    tr = _transport()
    if _rank() == 0:
        for step in range(3):
            tr.send(sequence_message(length, step), 1)
        tr.notify(FailureRecord(0, 0, "0F3", "RuntimeError: boom"), [1])
        tr.wait_sends()
        return None
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
    _, got = pools(2).run(_on_rank_notice, length, timeout=TIMEOUT)
    assert got == (0, "0F3", "RuntimeError: boom", 0)


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


# ----------------------------------------------------------------------------- unchanged headers

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
