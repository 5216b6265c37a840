"""Bad input to a constructor or a pure function gets a clear ValueError/TypeError that names the
value and the fix, checked in this process. Errors that arise in ``trainer.fit``, on every rank:
``tests/ranks/test_bad_input.py``."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_pipe2bw import Pipe2BWStrategy
from lightning_pipe2bw.partition import make_partition
from lightning_pipe2bw.schedule import SCHEDULES


@pytest.mark.parametrize("schedule", ["zb", "1F1B", "", "pipe_dream"])
def test_unknown_schedule(schedule: str) -> None:
    with pytest.raises(ValueError) as info:
        Pipe2BWStrategy(schedule=schedule)
    message = str(info.value)
    assert f"unknown schedule {schedule!r}" in message
    for name in SCHEDULES:
        assert repr(name) in message


@pytest.mark.parametrize("microbatches", [0, -2, 2.0, "4", True])
def test_bad_microbatches(microbatches: Any) -> None:
    with pytest.raises(ValueError) as info:
        Pipe2BWStrategy(microbatches=microbatches)
    assert str(info.value) == f"microbatches must be a positive int, got {microbatches!r}"


@pytest.mark.parametrize("start_method", ["thread", "Spawn", ""])
def test_bad_start_method(start_method: str) -> None:
    with pytest.raises(ValueError) as info:
        Pipe2BWStrategy(start_method=start_method)  # type: ignore[arg-type]
    message = str(info.value)
    assert repr(start_method) in message
    for valid in ("popen", "spawn", "fork", "forkserver"):
        assert repr(valid) in message


@pytest.mark.parametrize("balance", [[4, 0, 4], [5, -1, 4], [0]])
def test_balance_with_empty_stage(balance: list[int]) -> None:
    with pytest.raises(ValueError) as info:
        Pipe2BWStrategy(balance=balance)
    message = str(info.value)
    assert "at least one block" in message
    assert str(balance) in message


@pytest.mark.parametrize("balance", [[4.0, 4.0], [4, "4"], [True, 7], [4, None], b"44"])
def test_balance_with_non_int_entries(balance: Any) -> None:
    with pytest.raises(TypeError) as info:
        Pipe2BWStrategy(balance=balance)
    message = str(info.value)
    assert "balance must be a list of block counts per stage" in message
    assert repr(balance) in message


def test_balance_string_that_is_no_mode() -> None:
    with pytest.raises(ValueError) as info:
        Pipe2BWStrategy(balance="44")  # type: ignore[arg-type]
    message = str(info.value)
    assert "balance='44' is not a balance mode ('uniform', 'params', 'flops', 'auto')" in message
    assert "a list of block counts per stage such as [3, 5]" in message


@pytest.mark.parametrize(
    ("blocks", "stages", "balance", "texts"),
    [
        (8, 2, [3, 3], ["module has 8 blocks but balance sums to 6"]),
        (8, 2, [5, 5], ["module has 8 blocks but balance sums to 10"]),
        (8, 3, [4, 4], ["balance has 2 entries but the pipeline has 3 stages"]),
        (
            8,
            2,
            [1, 2, 0],
            ["3 entries", "sums to 3", "at least one block", "has 0"],
        ),
    ],
)
def test_make_partition_lists_every_problem(
    blocks: int, stages: int, balance: list[int], texts: list[str]
) -> None:
    with pytest.raises(ValueError) as info:
        make_partition(blocks, stages, balance)
    message = str(info.value)
    assert message.startswith("invalid balance: ")
    for text in texts:
        assert text in message


def test_make_partition_more_stages_than_blocks() -> None:
    with pytest.raises(ValueError) as info:
        make_partition(3, 4, None)
    message = str(info.value)
    assert "the body has 3 blocks but the pipeline has 4 stages" in message
    assert "use at most 3 devices/stages" in message


def test_empty_balance() -> None:
    for empty in ([], (), iter([])):
        with pytest.raises(ValueError, match=r"balance=\[\] lists no stage; give one block count"):
            Pipe2BWStrategy(balance=empty)

