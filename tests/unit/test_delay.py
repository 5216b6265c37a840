"""PipeDream-2BW's delay corrections (``delay_correction``, ``lightning_pipe2bw.optim.delay``):
bad ones are refused with the fix, and a spec has one spelling. Each correction against its
single-process reference: ``tests/ranks/test_delay.py``."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_pipe2bw import Pipe2BWStrategy
from lightning_pipe2bw.optim.delay import canonical_correction


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"schedule": "1f1b", "delay_correction": "error_feedback"},
            "schedule='1f1b' flushes the pipeline after every batch, so its gradients are not "
            "delayed and delay_correction='error_feedback' has nothing to correct",
        ),
        (
            {"schedule": "pipedream", "delay_correction": "predict"},
            "needs 2BW's delay of exactly one update",
        ),
        ({"delay_correction": "ef"}, "unknown delay_correction 'ef'; valid: 'auto', 'none'"),
        (
            {"delay_correction": "predict=2"},
            "delay_correction 'predict=2': 'predict' takes no coefficient; only "
            "'error_feedback', 'nesterov' do",
        ),
        (
            {"delay_correction": "error_feedback=-1"},
            "'error_feedback''s coefficient must be a finite number >= 0, got -1.0",
        ),
        (
            {"delay_correction": "error_feedback+error_feedback"},
            "names 'error_feedback' twice",
        ),
        ({"delay_correction": "none+predict"}, "'none' cannot be combined with others"),
        (
            {"delay_correction": "nesterov+update_feedback"},
            "joins 'nesterov' and 'update_feedback', which both correct the update; keep one",
        ),
        (
            {"delay_correction": "update_feedback=0.5"},
            "'update_feedback' takes no coefficient",
        ),
        ({"sync_steps": -1}, "sync_steps must be an int >= 0 (the batches 2BW runs"),
        ({"sync_steps": 2.5}, "or a float between 0 and 1 (that share of the fit's optimizer"),
        ({"sync_steps": True}, "sync_steps must be an int >= 0"),
        (
            {"schedule": "1f1b", "sync_steps": 10},
            "sync_steps=10 starts 2BW synchronously, but schedule='1f1b' is not 2BW",
        ),
    ],
)
def test_bad_corrections_are_refused_with_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Pipe2BWStrategy(**kwargs)


def test_a_synchronous_start_is_a_count_or_a_share() -> None:
    options = Pipe2BWStrategy(schedule="2bw", sync_steps=0.8).options
    assert options.synchronous_steps(300) == 240 and options.synchronous_steps(7) == 6
    assert Pipe2BWStrategy(schedule="2bw", sync_steps=30).options.synchronous_steps(300) == 30


def test_muon_adamw_gives_its_adamw_part_a_rate_of_its_own() -> None:
    """``adamw_lr``: the AdamW groups start at it, Muon's at ``lr``; a LambdaLR scales each
    group's own rate."""
    import torch
    from torch import nn

    from lightning_pipe2bw import MuonAdamW

    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    opt = MuonAdamW.for_module(model, lr=0.02, adamw_lr=0.002)
    rates = {bool(g["muon"]): g["lr"] for g in opt.param_groups}
    assert rates == {True: 0.02, False: 0.002}
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert sorted(g["lr"] for g in opt.param_groups) == [0.001, 0.001, 0.01]
    del sched
    same = MuonAdamW.for_module(model, lr=0.02)
    assert {g["lr"] for g in same.param_groups} == {0.02}
    with pytest.raises(ValueError, match=r"adamw_lr=-1\.0 must be a number >= 0"):
        MuonAdamW.for_module(model, lr=0.02, adamw_lr=-1.0)


def test_a_spec_has_one_spelling() -> None:
    assert canonical_correction(" error_feedback=0.50 + predict") == "predict+error_feedback=0.5"
    options = Pipe2BWStrategy(schedule="2bw", delay_correction="error_feedback=1").options
    assert options.correction == ("error_feedback=1.0")


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "sgd"])
def test_prediction_is_the_same_in_any_chunking(optimizer: str) -> None:
    """The prediction steps a group's parameters together in chunks of copied state: any chunk
    size gives, bit for bit, one optimizer step over copies of all parameters with their first
    moments as gradients (the reference's rule), and leaves the optimizer untouched."""
    import copy

    import torch
    from helpers.models import make_optimizer, predicted
    from torch import nn

    from lightning_pipe2bw.optim.delay import WeightPrediction

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    opt, _ = make_optimizer(model.parameters(), optimizer)
    for _ in range(2):  # moments that differ from the gradients
        model(torch.randn(5, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    params = list(model.parameters())
    expected = list(predicted(model, opt, lambda ps: make_optimizer(ps, optimizer)[0]).values())
    state_before = copy.deepcopy(opt.state_dict())
    for chunk_bytes in (1, 200, 2**30):
        correction = WeightPrediction(opt, params)
        correction.PREDICT_CHUNK_BYTES = chunk_bytes
        out = [torch.empty_like(p) for p in params]
        correction.predict([p.detach() for p in params], out, None)
        for got, want in zip(out, expected, strict=True):
            assert torch.equal(got, want), chunk_bytes
        assert all(p.grad is None for p in params)
    after = opt.state_dict()["state"]
    for index, state in state_before["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(after[index][key]), torch.as_tensor(value))
