"""The shared-memory transport in one process: devices other than the CPU keep the process
group's transport, and a ring keeps room for announcements. The transport over a real 2-rank
gloo group: ``tests/ranks/test_shm.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_pipe2bw.runtime.shm import create_transport, shared_memory_problem
from lightning_pipe2bw.runtime.transport import P2PTransport

pytestmark = pytest.mark.skipif(
    shared_memory_problem(torch.device("cpu")) is not None,
    reason=f"no shared-memory transport here: {shared_memory_problem(torch.device('cpu'))}",
)


def test_gloo_is_kept_for_devices_other_than_the_cpu() -> None:
    tr = create_transport(torch.device("meta"), [])  # no collective: the choice is local
    assert isinstance(tr, P2PTransport)
    assert "not on the CPU" in (shared_memory_problem(torch.device("meta")) or "")


def test_a_ring_keeps_room_for_announcements(tmp_path: Any) -> None:
    """Messages stop short of the ring's last ``keep`` bytes; the small records that announce
    the process group's messages (``keep=0``) still find room there, and the reader's progress
    frees it. Records never wrap: one that does not fit before the end starts over at 0."""
    from lightning_pipe2bw.runtime.ring import Ring

    path = str(tmp_path / "ring")
    writer, reader = Ring(path, True, 4096), Ring(path, False, 4096)
    sizes = []
    while (spot := writer.reserve(1024, keep=512)) is not None:
        pos, skip = spot
        writer.record(pos)[0], writer.record(pos)[1] = 1024, 1
        writer.commit(skip, 1024)
        sizes.append(pos)
    assert sizes == [0, 1024, 2048]  # a fourth would leave less than 512 bytes
    spot = writer.reserve(64)  # an announcement: room in the kept bytes
    assert spot == (3072, 0)
    writer.record(3072)[0], writer.record(3072)[1] = 64, 2
    writer.commit(0, 64)
    assert writer.reserve(1024, keep=512) is None
    for expected in (0, 1024):  # the reader frees two records
        assert reader.next() == expected
        reader.release(reader.record(expected)[0])
    spot = writer.reserve(1024, keep=512)  # 960 bytes left before the end: wraps to 0
    assert spot == (0, 4096 - 3136)
    pos, skip = spot
    writer.record(pos)[0], writer.record(pos)[1] = 1024, 1
    writer.commit(skip, 1024)
    seen = []
    while (pos := reader.next()) is not None:
        seen.append(pos)
        reader.release(reader.record(pos)[0])
    assert seen == [2048, 3072, 0]  # the wrap record was skipped
    assert reader.tail == writer.head == 4096 + 1024
