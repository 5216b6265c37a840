"""The receive-wait limits that stop the ranks beside a hung one grow away from the hang. The
runs that hang, raise or are killed: ``tests/launch/test_faults.py``."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_wait_limits_grow_away_from_a_hang(stages: int) -> None:
    """Wherever a rank hangs, its neighbour's limit is the shortest on the waiting chain: the
    limits are within the timeout, at least half of it, and grow by stage in the direction of the
    wait (forward inputs flow to higher stages, gradients to lower)."""
    from lightning_pipe2bw.failures.record import wait_limits

    limits = [wait_limits(s, stages, 60.0) for s in range(stages)]
    for forward, backward in limits:
        assert 30.0 <= forward <= 60.0 and 30.0 <= backward <= 60.0
    if stages > 2:
        forwards = [f for f, _ in limits[1:]]  # stage 0 receives no forward input
        backwards = [b for _, b in limits[:-1]]  # the last stage receives no gradient
        assert forwards == sorted(forwards) and len(set(forwards)) == len(forwards)
        assert backwards == sorted(backwards, reverse=True)
        assert len(set(backwards)) == len(backwards)
        assert limits[-1][0] == 60.0 and limits[0][1] == 60.0
    else:
        assert limits == [(60.0, 60.0)] * stages
