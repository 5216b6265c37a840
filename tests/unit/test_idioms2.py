"""Everyday Lightning idioms, second round (issue #31): the parts checked in this process: a
stage's body indexes like the whole ``Sequential``, the last-batch check, merging what the stages
log in gradient hooks, and the batch fingerprint. The fits against one device:
``tests/ranks/test_idioms2.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _data(n: int = 48, batch_size: int = 8) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def test_stage_body_indexes_like_the_sequential() -> None:
    """``len``, indexing, slicing and iteration of a stage's body follow the whole body's
    indices: a block of another stage is an empty module that says where the block lives."""
    from lightning_pipe2bw.runtime.remote import RemoteBlock
    from lightning_pipe2bw.runtime.stage import StageBody

    blocks = [nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 3)]
    body = StageBody(((i, blocks[i]) for i in (2, 3, 4)), stage=1, num_stages=2, balance=(2, 3))
    assert len(body) == 5
    assert body[-1] is blocks[4] and body[2] is blocks[2]
    assert isinstance(body[0], RemoteBlock) and list(body[0].parameters()) == []
    assert [type(b).__name__ for b in body] == ["RemoteBlock"] * 2 + ["Linear", "Tanh", "Linear"]
    head = body[:-1]
    assert isinstance(head, nn.Sequential) and list(head._modules) == ["0", "1", "2", "3"]
    assert [p is q for p, q in zip(head.parameters(), blocks[2].parameters(), strict=True)]
    with pytest.raises(IndexError, match="index 5 is out of range"):
        body[5]
    with pytest.raises(AttributeError, match="block 0 of the pipeline body lives on stage 0"):
        body[0].weight  # noqa: B018
    with pytest.raises(RuntimeError, match="cannot run it here"):
        body[1](torch.ones(2))


def test_the_last_batch_check_knows_when_the_last_batch_runs() -> None:
    from lightning_pipe2bw.seam.loaders import last_batch_problem

    short = _data(41, 8)
    assert last_batch_problem(short, 2, 1.0, -1) is not None
    assert last_batch_problem(short, 1, 1.0, -1) is None  # one micro-batch: nothing to split
    assert last_batch_problem(_data(42, 8), 2, 1.0, -1) is None  # 2 samples left: enough
    assert last_batch_problem(DataLoader(short.dataset, 8, drop_last=True), 2, 1.0, -1) is None
    assert last_batch_problem(short, 2, 3, -1) is None  # limit_train_batches=3 of 6
    assert last_batch_problem(short, 2, 0.5, -1) is None
    assert last_batch_problem(short, 2, 1.0, 4) is None  # max_steps=4 ends the fit first


def test_merging_what_the_stages_log_in_gradient_hooks() -> None:
    """Names one stage logs keep its value, names logged alike are logged once, Lightning's
    ``grad_norm`` total is the p-norm of every stage's per-parameter norms, a tied copy's name
    gives way to its primary's, and names logged with different values are reported."""
    from lightning_pipe2bw.seam.hooklogs import LogCall, merge_stage_logs

    def call(name: str, value: float) -> LogCall:
        return LogCall("on_before_optimizer_step", name, torch.tensor(value), {})

    stage0 = [call("grad_2.0_norm/body.0.weight", 3.0), call("grad_2.0_norm_total", 3.0)]
    stage0 += [call("lr", 0.1), call("mean_weight", 0.5)]
    stage1 = [call("grad_2.0_norm/body.5.weight", 4.0), call("grad_2.0_norm/body.6.weight", 3.0)]
    stage1 += [call("grad_2.0_norm_total", 5.0), call("lr", 0.1), call("mean_weight", 0.7)]
    tied = {"body.6.weight": "body.0.weight"}  # stage 1's copy of stage 0's parameter
    merged, differing = merge_stage_logs([(0, {}, stage0), (1, tied, stage1)])
    values = {c.name: float(c.value) for c in merged}
    assert list(values) == [
        "grad_2.0_norm/body.0.weight",
        "grad_2.0_norm/body.5.weight",
        "grad_2.0_norm_total",
        "lr",
        "mean_weight",
    ]
    assert values["grad_2.0_norm_total"] == pytest.approx(5.0)  # sqrt(3^2 + 4^2): counted once
    assert values["lr"] == pytest.approx(0.1) and values["mean_weight"] == pytest.approx(0.7)
    assert differing == ["mean_weight"]


def test_a_batch_fingerprint_tells_samples_apart() -> None:
    from lightning_pipe2bw.seam.loaders import batch_fingerprint

    x = torch.randn(6, 3, 32, 32)
    names = [f"n{i}" for i in range(6)]
    same = batch_fingerprint((x, names))
    assert same == batch_fingerprint((x.clone(), list(names)))
    assert same != batch_fingerprint((x[[1, 0, 2, 3, 4, 5]], names))  # another order
    other = x.clone()
    other[5, 2, 31, 31] += 1.0  # the last value of the last sample (read: spread values)
    assert same != batch_fingerprint((other, names))
    assert same != batch_fingerprint((x, [*names[:5], "other"]))
    assert batch_fingerprint({"scale": 1.0}) is None  # nothing with a batch dimension
