"""The shared-memory transport over a real 2-rank gloo group (rings in ``/dev/shm``), and the
choice between it and the process group's.

Functions whose name starts with ``_on_rank`` run on every rank of the pool; each returns
plain, picklable summaries that the test process checks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import workers
from unit.test_transport import sequence_message

from lightning_pipe2bw.failures.record import FailureRecord
from lightning_pipe2bw.runtime.shm import (
    SharedMemoryTransport,
    create_transport,
    shared_memory_problem,
)
from lightning_pipe2bw.runtime.transport import wire_device
from ranks.test_transport import PAYLOADS, TIMEOUT, assert_received, failure_after, summarize

pytestmark = pytest.mark.skipif(
    shared_memory_problem(torch.device("cpu")) is not None,
    reason=f"no shared-memory transport here: {shared_memory_problem(torch.device('cpu'))}",
)

SMALL = 64 << 10  # a ring of 64 KiB: a few messages fill it, and it wraps often


def _rank() -> int:
    return dist.get_rank()


def _token() -> str:
    token = [os.urandom(8).hex()]
    dist.broadcast_object_list(token, src=0)
    return str(token[0])


def _transport(
    capacity: int = SMALL, timeout_s: float | None = None, token: str | None = None
) -> SharedMemoryTransport:
    """A transport between the pool's two ranks (collective), like ``create_transport``'s."""
    token = token or _token()
    return SharedMemoryTransport(torch.device("cpu"), token, [1 - _rank()], timeout_s, capacity)


@contextmanager
def _env(value: str | None) -> Iterator[None]:
    old = os.environ.get("PIPE2BW_TRANSPORT")
    if value is None:
        os.environ.pop("PIPE2BW_TRANSPORT", None)
    else:
        os.environ["PIPE2BW_TRANSPORT"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PIPE2BW_TRANSPORT", None)
        else:
            os.environ["PIPE2BW_TRANSPORT"] = old


# ----------------------------------------------------------------------------- rank functions


def _on_rank_payloads() -> Any:
    """Every payload of the P2P tests, one after another, on a fresh transport."""
    token = _token()
    tr = _transport(token=token)
    dist.barrier()
    # each receiver unlinked its ring's name once it had mapped it: nothing left to clean up
    leftovers = [f for f in os.listdir("/dev/shm") if token in f]
    if _rank() == 0:
        for name in sorted(PAYLOADS):
            tr.send(PAYLOADS[name](), 1)
        tr.wait_sends()
        return {"sent": tr.bytes_sent, "leftovers": leftovers}
    got = {name: summarize(tr.recv(0)) for name in sorted(PAYLOADS)}
    return {"received": got, "bytes": tr.bytes_received, "leftovers": leftovers}


def _on_rank_stream(lengths: list[int], capacity: int, read_late: bool) -> Any:
    """Both ranks send a message of each length in ``lengths`` to the other (shapes, headers and
    sizes changing: the ring wraps, and messages over a quarter of it take the process group).
    With ``read_late`` every message is sent before any is read, so the rings fill up."""
    tr = _transport(capacity)
    me, peer = _rank(), 1 - _rank()
    got = []
    for step, length in enumerate(lengths):
        tr.send((sequence_message(length, step), me), peer)  # values differ by step
        if not read_late:
            got.append(summarize(tr.recv(peer)))
    if read_late:
        dist.barrier()  # every send has returned on both ranks before anything is read
        got = [summarize(tr.recv(peer)) for _ in lengths]
    tr.wait_sends()
    return {"received": got, "pending": tr.pending_bytes}


def _on_rank_notice(after: int) -> Any:
    tr = _transport()
    if _rank() == 0:
        for step in range(after):
            tr.send(sequence_message(3, step), 1)
        tr.notify(FailureRecord(0, 0, "0F3", "RuntimeError: boom"), [1])
        return None
    return failure_after(tr, after)


def _on_rank_big_header() -> Any:
    """A message whose non-tensor part pickles to more than the ring's reserve (8 KiB of 64)."""
    tr = _transport()
    outcome = None
    if _rank() == 0:
        try:
            tr.send((torch.ones(2), "x" * 20_000), 1)
        except ValueError as err:
            outcome = str(err)
        tr.send((torch.ones(2), "small"), 1)  # the channel is still usable
    else:
        outcome = tr.recv(0)[1]
    return outcome


def _on_rank_silence() -> Any:
    """Rank 1 waits for a message that never comes, with a short limit."""
    tr = _transport()
    if _rank() == 0:
        dist.barrier()
        return None
    start = time.monotonic()
    try:
        tr.recv(0, timeout_s=0.6)
    except RuntimeError as err:
        message = str(err)
    else:
        message = "received"
    waited = time.monotonic() - start
    dist.barrier()
    return message, waited


def _on_rank_peer_gone() -> Any:
    """Rank 0's transport closes (as when its process dies: the kernel closes its socket) after
    one message; rank 1 gets that message, then an error instead of waiting for the timeout."""
    tr = _transport(timeout_s=60.0)
    if _rank() == 0:
        tr.send(torch.ones(2), 1)
        tr.close()
        dist.barrier()
        return None
    time.sleep(0.3)  # the peer is gone before the message is read
    first = tr.recv(0).tolist()
    start = time.monotonic()
    try:
        tr.recv(0)
    except ConnectionError as err:
        outcome = str(err)
    else:
        outcome = "received"
    waited = time.monotonic() - start
    dist.barrier()
    return first, outcome, waited


def _on_rank_choice(value: str | None) -> Any:
    with _env(value):
        try:
            tr = create_transport(torch.device("cpu"), [1 - _rank()])
        except ValueError as err:
            return "error", str(err)
    return type(tr).__name__, None


def _on_rank_no_room(value: str, huge_on: int) -> Any:
    """Rank ``huge_on`` asks for rings larger than /dev/shm can hold."""
    from lightning_pipe2bw.runtime import shm

    before = set(os.listdir("/dev/shm"))
    old = shm.CAPACITY
    shm.CAPACITY = 1 << 45 if _rank() == huge_on else old  # 32 TiB
    try:
        with _env(value):
            outcome = type(create_transport(torch.device("cpu"), [1 - _rank()])).__name__
    except ValueError as err:
        outcome = f"error: {err}"
    finally:
        shm.CAPACITY = old
    dist.barrier()
    return outcome, sorted(set(os.listdir("/dev/shm")) - before)


def _on_rank_fit(transport: str, schedule: str) -> Any:
    with _env(transport):
        result = workers.fit(schedule, 4, 4)
    return {"state": result["state"], "losses": result["losses"]}


# ----------------------------------------------------------------------------- tests


def test_every_payload_arrives_as_sent(pools: Any) -> None:
    sender, receiver = pools(2).run(_on_rank_payloads, timeout=TIMEOUT)
    for name, make in PAYLOADS.items():
        assert_received(receiver["received"][name], make())
    assert receiver["bytes"] == sender["sent"] > 0
    assert sender["leftovers"] == receiver["leftovers"] == []


# 2 x L x 4 float32 + L int64 = 40 L bytes per message of sequence length L: 24 KiB for L = 600,
# over a quarter of the 64 KiB ring (the process group carries those from L = 410)
CHANGING = [3, 3, 3, 600, 600, 5, 450, 7, 7, 7, 300, 300, 300, 300, 2, 600, 9, 9] * 3
# 12 KiB each: the ring is seven-eighths full after four; the others are announced in its last
# eighth (64 bytes each, and the header where it changes) and come over the process group
FILLING = [300] * 20 + [301] * 10 + [300] * 10 + [600, 3, 3]


@pytest.mark.parametrize(
    ("lengths", "read_late"),
    [(CHANGING, False), (FILLING, True)],
    ids=["changing-in-turn-wraps", "all-sent-first-fills"],
)
def test_a_stream_of_messages_wraps_and_overflows_in_order(
    pools: Any, lengths: list[int], read_late: bool
) -> None:
    results = pools(2).run(_on_rank_stream, lengths, SMALL, read_late, timeout=TIMEOUT)
    for me, result in enumerate(results):
        peer = 1 - me
        assert len(result["received"]) == len(lengths)
        for step, (got, length) in enumerate(zip(result["received"], lengths, strict=True)):
            assert_received(got, (sequence_message(length, step), peer))
        assert result["pending"] == 0


@pytest.mark.parametrize("after", [0, 3])
def test_a_notice_takes_the_place_of_the_next_message(pools: Any, after: int) -> None:
    _, got = pools(2).run(_on_rank_notice, after, timeout=TIMEOUT)
    assert got == (0, "0F3", "RuntimeError: boom", 0)


def test_a_receive_times_out_with_an_error_that_says_so(pools: Any) -> None:
    _, (message, waited) = pools(2).run(_on_rank_silence, timeout=TIMEOUT)
    assert "timed out after 0.6 s waiting for a message from rank 0" in message
    assert 0.5 < waited < 10


def test_a_gone_peer_ends_the_wait_after_its_last_message(pools: Any) -> None:
    _, (first, outcome, waited) = pools(2).run(_on_rank_peer_gone, timeout=TIMEOUT)
    assert first == [1.0, 1.0]
    assert "rank 0's process is gone" in outcome
    assert waited < 10  # far below the 60 s limit: noticed within a poll or two


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "SharedMemoryTransport"),
        ("auto", "SharedMemoryTransport"),
        ("SHM", "SharedMemoryTransport"),
        ("gloo", "P2PTransport"),
    ],
)
def test_the_transport_is_chosen_by_pipe2bw_transport(
    pools: Any, value: str | None, expected: str
) -> None:
    for kind, error in pools(2).run(_on_rank_choice, value, timeout=TIMEOUT):
        assert (kind, error) == (expected, None)


def test_an_unknown_transport_is_refused_with_the_choices(pools: Any) -> None:
    for kind, error in pools(2).run(_on_rank_choice, "nccl-ish", timeout=TIMEOUT):
        assert kind == "error"
        assert (
            "PIPE2BW_TRANSPORT='nccl-ish' is not a transport; use one of auto, shm, gloo" in error
        )


def _on_rank_gpu_wire() -> tuple[str, str, str | None]:
    gpu = torch.device("cuda", 0)  # a device object only: nothing is allocated on it
    return str(wire_device(gpu)), str(wire_device(torch.device("cpu"))), shared_memory_problem(gpu)


def test_a_gpu_stage_on_gloo_travels_through_the_host(pools: Any) -> None:
    """Stage processes sharing a GPU run on gloo, whose messages live in host memory: their
    transport stages through the host, and shared memory serves them like CPU ranks."""
    for wire, cpu_wire, problem in pools(2).run(_on_rank_gpu_wire, timeout=TIMEOUT):
        assert (wire, cpu_wire, problem) == ("cpu", "cpu", None)


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_training_is_bitwise_the_same_on_either_transport(pools: Any, schedule: str) -> None:
    """A transport only moves bytes: the same run over shared memory and over gloo ends with
    bitwise equal weights and logs the same losses."""
    shm = pools(2).run(_on_rank_fit, "shm", schedule)
    gloo = pools(2).run(_on_rank_fit, "gloo", schedule)
    for name, value in gloo[0]["state"].items():
        assert torch.equal(shm[0]["state"][name], value), name
    for a, b in zip(shm, gloo, strict=True):
        assert a["losses"] == pytest.approx(b["losses"], abs=0, nan_ok=True)


@pytest.mark.parametrize("huge_on", [0, 1])
def test_without_room_in_dev_shm_every_rank_falls_back_to_gloo(pools: Any, huge_on: int) -> None:
    """The rings take their pages when made: a /dev/shm too small (a default Docker container
    has 64 MiB) shows at once, on every rank alike, and nothing is left behind."""
    for outcome, left in pools(2).run(_on_rank_no_room, "auto", huge_on, timeout=TIMEOUT):
        assert outcome == "P2PTransport"
        assert left == []
    for outcome, _ in pools(2).run(_on_rank_no_room, "shm", huge_on, timeout=TIMEOUT):
        assert outcome.startswith(f"error: PIPE2BW_TRANSPORT=shm: rank {huge_on} could not make")
        assert "Unset it (auto) or set it to gloo" in outcome


def test_a_header_too_large_for_the_ring_is_refused_with_the_fix(pools: Any) -> None:
    error, received = pools(2).run(_on_rank_big_header, timeout=TIMEOUT)
    assert "non-tensor part pickles to 20" in error
    assert "more than the shared-memory transport carries (8128 bytes)" in error
    assert "pass large values as tensors, or set PIPE2BW_TRANSPORT=gloo" in error
    assert received == "small"
