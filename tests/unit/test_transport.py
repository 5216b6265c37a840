"""The pure helpers of the P2P transport: payloads flattened into a header and tensors, the
expected header deltas, and the micro-batch split and merge. The transport over a real 2-rank
gloo group: ``tests/ranks/test_transport.py``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.utils import _pytree as pytree

from lightning_pipe2bw.runtime.microbatch import batch_size_of, merge_outputs, split_batch
from lightning_pipe2bw.runtime.wire import PACK_LIMIT, TensorMeta, flatten_payload, load_header

FAST = settings(max_examples=40, deadline=None, database=None)
CONTROL = 3 * 8  # a message's control: header length, filler count, largest filler (int64)
LARGE = 40_000  # a sequence length whose message takes more than PACK_LIMIT bytes


# ----------------------------------------------------------------------------- helpers


# ----------------------------------------------------------------------------- payloads
# Built identically on every rank (and in the test process) from a fixed seed.


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


def sequence_message(length: int, step: int) -> Any:
    """A message whose shapes (and whether its hidden state requires grad) depend on ``length`` (a
    sequence length) and values on ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    return {
        "hidden": torch.randn(2, length, 4, generator=g).requires_grad_(length % 2 == 1),
        "positions": torch.arange(length),
    }


# ----------------------------------------------------------------------------- rank functions


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
                lead = (
                    packed_size(previous_tensors)
                    if packed
                    else CONTROL + sum(t.numel() * t.element_size() for t in previous_tensors)
                )
            deltas.append(lead + len(header) + payload)
        previous, previous_tensors, kept = header, tensors, same
    return deltas


# ----------------------------------------------------------------------------- P2P tests


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
    _, _, metas = load_header(header)  # what the receiver reads (torch's pytree warns)
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


# ----------------------------------------------------------------------------- unchanged headers
