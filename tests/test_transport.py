"""P2P transport over a real 2-rank gloo group, and the pure micro-batch split/merge helpers.

Functions whose name starts with ``_on_rank`` run on every rank of the pool (module level, so
they pickle by name); each returns plain, picklable summaries that the test process checks.
"""

from __future__ import annotations

import pickle
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

from lightning_pipe2bw.runtime.microbatch import batch_size_of, merge_outputs, split_batch
from lightning_pipe2bw.runtime.transport import P2PTransport, TensorMeta, flatten_payload

FAST = settings(max_examples=40, deadline=None, database=None)
TIMEOUT = 60  # seconds; a deadlocked transport fails the test instead of hanging the session
MIB_FLOATS = 1 << 18  # float32 elements in 1 MiB: larger than any eager-send buffering


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
    """A message whose shapes depend on ``length`` (a sequence length) and values on ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    return {
        "hidden": torch.randn(2, length, 4, generator=g).requires_grad_(step % 2 == 0),
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
    return {"received": [summarize(tr.recv(0)) for _ in lengths]}


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
    # one int64 length, the header (first message on the channel) and the tensor leaves, counted
    # the same way at both ends
    assert sender["sent"] == 8 + len(header) + payload_bytes
    assert receiver["bytes"] == sender["sent"]


def test_requires_grad_is_carried_over(pools: Any) -> None:
    _, receiver = pools(2).run(_on_rank_send_one, "mixed_tuple", timeout=TIMEOUT)
    got = [x for x in pytree.tree_leaves(receiver["received"]) if isinstance(x, Leaf)]
    # (w * 2, plain, arange, w): the non-leaf and the leaf that require grad arrive as leaves
    # requiring grad; the others do not (and int64 never does)
    assert [x.requires_grad for x in got] == [True, False, False, True]
    assert all(x.is_leaf for x in got)


def test_shapes_change_between_messages_on_one_channel(pools: Any) -> None:
    lengths = [5, 7, 5, 5, 3, 7, 7]
    sender, receiver = pools(2).run(_on_rank_sequence, lengths, timeout=TIMEOUT)
    for step, (length, got) in enumerate(zip(lengths, receiver["received"], strict=True)):
        assert_received(got, sequence_message(length, step))
    # the header goes out only when it differs from the previous one on the channel
    expected = []
    previous: bytes | None = None
    for step, length in enumerate(lengths):
        tensors, header = flatten_payload(sequence_message(length, step))
        payload_bytes = sum(t.numel() * t.element_size() for t in tensors)
        expected.append(8 + (0 if header == previous else len(header)) + payload_bytes)
        previous = header
    assert sender["deltas"] == expected
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
    _, _, metas = pickle.loads(header)
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
    assert number == pytest.approx((4 * 2 + 3 * 9) / 7)
    assert text == ["a", "b"]  # not mergeable: one per micro-batch
    assert isinstance(odd, list) and len(odd) == 2  # dim 0 is not the micro-batch size
    assert torch.equal(odd[1], torch.ones(5))


def test_merge_outputs_single_and_empty() -> None:
    only = {"loss": torch.tensor(1.0)}
    assert merge_outputs([only], [8]) is only
    assert merge_outputs([], []) is None


def test_merge_outputs_different_structures_are_listed() -> None:
    outputs = [{"a": torch.zeros(2)}, {"b": torch.zeros(2)}]
    assert merge_outputs(outputs, [2, 2]) == outputs
