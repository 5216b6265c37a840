"""What ``fsdp=True`` refuses when the strategy is built, each with its way out (what it trains:
``tests/ranks/test_fsdp.py``)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lightning_pipe2bw import Pipe2BWStrategy
from lightning_pipe2bw.pipeline.fsdp import GradientSync, full_tensors, local_elements


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "but data_parallel=1 gives each stage one; use data_parallel=2"),
        (
            {"data_parallel": 2, "schedule": "2bw"},
            "fsdp=True with schedule='2bw' keeps a second version of every weight",
        ),
        ({"data_parallel": 2, "schedule": "pipedream"}, "PipeDream's stash"),
        (
            {"data_parallel": 2, "shard_optimizer": True},
            "fsdp=True with shard_optimizer=True shards only the optimizer state",
        ),
        (
            {"data_parallel": 2, "repartition_every": 10},
            "fsdp=True with repartition_every=10 moves blocks between stages",
        ),
        ({"data_parallel": 2, "compile_blocks": True}, "compile_blocks with fsdp=True"),
    ],
    ids=["one-replica", "2bw", "pipedream", "shard_optimizer", "repartition", "compile"],
)
def test_what_fsdp_cannot_run_is_refused_with_the_way_out(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Pipe2BWStrategy(fsdp=True, **kwargs)  # type: ignore[arg-type]


def test_fsdp_on_a_flushed_schedule_with_replicas_is_accepted() -> None:
    for schedule in ("1f1b", "gpipe", "zb-h1", "interleaved-1f1b", "zb-v", "dualpipe-v"):
        assert Pipe2BWStrategy(schedule=schedule, data_parallel=2, fsdp=True).options.fsdp


class _Block:
    """What GradientSync drives: a block's FSDP gradient synchronisation flag."""

    def __init__(self) -> None:
        self.flags: list[bool] = []

    def set_requires_gradient_sync(self, sync: bool, recurse: bool = True) -> None:
        self.flags.append(sync)


def test_gradient_sync_is_on_for_each_stages_last_backward_of_a_batch_only() -> None:
    a, b = _Block(), _Block()
    sync = GradientSync({0: [a], 3: [b]})  # type: ignore[list-item]
    for m in (3, 2):  # two batches, of 3 and 2 micro-batches, backwards of both stages mixed
        sync.start(m)
        for stage in [3, 0, 3, 0, 3, 0][: 2 * m]:
            sync.before_backward(stage)
    assert a.flags == [False, False, True, False, True]
    assert b.flags == [False, False, True, False, True]


def test_plain_tensors_pass_through_the_full_and_local_helpers() -> None:
    state = {"w": torch.ones(2, 3), "n": 4, "nested": [torch.zeros(5)]}
    assert full_tensors(state)["w"] is state["w"]
    assert local_elements(nn.Linear(3, 2).parameters()) == 8
