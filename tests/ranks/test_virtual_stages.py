"""Several stages per rank, run by the strategy: interleaved 1F1B (looped placement), ZB-V and
DualPipeV (V placement) equal single-device gradient accumulation bitwise (tolerance 0: every stage runs
its forwards and backwards in micro-batch order, so each weight's gradient adds up in the
order one device adds it). The schedules themselves: ``tests/unit/test_virtual_schedules.py``."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import workers
from helpers.models import (
    RegressionModel,
    isclose,
    make_loader,
    max_abs_diff,
    reference_2bw,
    reference_train,
)

from lightning_pipe2bw.schedule import ActionKind, cut_overhead, training_schedule

STEPS = 6

CASES = [
    (name, p, m) for name in ("interleaved-1f1b", "zb-v") for p in (2, 4) for m in (p, 2 * p, 4 * p)
] + [("dualpipe-v", p, m) for p in (2, 4) for m in (2 * p, 4 * p)]  # DualPipeV: m >= 2p


@pytest.mark.parametrize(("name", "p", "m"), CASES, ids=[f"{n}-p{p}-m{m}" for n, p, m in CASES])
def test_virtual_schedules_equal_single_device_bitwise(pools, name: str, p: int, m: int) -> None:
    """6 AdamW steps, batch 16, two stages per rank (8 blocks: one block per stage at p = 4):
    max|dW| = 0 against one device accumulating the same micro-batches; the logged losses
    agree; every rank held the blocks of its two stages."""
    samples = 16 * STEPS
    results = pools(p).run(workers.fit, name, m, STEPS, batch_size=16, samples=samples)
    data = make_loader("regression", 16, n=samples)
    ref_state, ref_losses = reference_train(STEPS, m, batch_size=16, data=data)
    diff = max_abs_diff(results[0]["state"], ref_state)
    print(f"EXACTNESS {name} p={p} m={m}: max|dW| = {diff:.3e}")
    assert diff == 0.0
    for result in results:
        assert all(isclose(a, b) for a, b in zip(result["losses"], ref_losses, strict=True))
    for result in results:
        r = result["stage"]
        other = p + r if name == "interleaved-1f1b" else 2 * p - 1 - r
        bounds = [0, *itertools.accumulate(result["balance"])]
        expected = [b for v in sorted((r, other)) for b in range(bounds[v], bounds[v + 1])]
        assert len(result["balance"]) == 2 * p and result["blocks"] == expected
        if name == "zb-v":  # every I the schedule holds is cut, but stage 0's (it sends none)
            sched = training_schedule(name, p, m, cut_overhead=cut_overhead("cpu"))
            cuts = [a for a in sched.stages[r] if a.kind is ActionKind.INPUT_GRAD and a.stage]
            assert result["split_backwards"] == STEPS * len(cuts), r


@pytest.mark.parametrize(("name", "copies"), [("zb-v", [0, 0]), ("interleaved-1f1b", [1, 1])])
def test_tied_weights_on_virtual_stages(pools, name: str, copies: list[int]) -> None:
    """Blocks 1 and 6 share a weight. Split 2 blocks a stage, the V puts their stages (0 and 3)
    on one rank: one copy and no sum across ranks; the looped placement puts them on two ranks:
    a copy on each, summed. Both equal one device (which holds one weight) bitwise."""
    samples = 16 * STEPS
    results = pools(2).run(
        workers.fit, name, 4, STEPS, batch_size=16, samples=samples, model="tied",
        balance="uniform",
    )  # fmt: skip
    ref, _ = reference_train(
        STEPS, 4, batch_size=16, data=make_loader("tied", 16, n=samples), model_name="tied"
    )
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS {name} tied weights p=2 m=4: max|dW| = {diff:.3e}")
    assert diff <= 1e-6
    assert [r["tied_copies"] for r in results] == copies


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zb-v"])
def test_validation_and_recompute_on_virtual_stages(pools, name: str) -> None:
    """Validation runs the forward-only schedule of the placement (the loss the last stage
    computes, on every rank); recompute=True recomputes each stage's blocks in its backward
    (no I is cut then: its W runs the whole backward) and stays bitwise exact."""
    samples = 16 * STEPS
    results = pools(2).run(
        workers.fit,
        name,
        4,
        STEPS,
        batch_size=16,
        samples=samples,
        recompute=True,
        val_batches=2,
        trainer_kwargs={"val_check_interval": 3, "limit_val_batches": 1},
    )
    ref, _ = reference_train(STEPS, 4, batch_size=16, data=make_loader("regression", 16, n=samples))
    assert max_abs_diff(results[0]["state"], ref) == 0.0
    runs = [r["val_runs"] for r in results]
    assert len(runs[0]) == 2 and all(run == runs[0] for run in runs)
    model = RegressionModel()
    model.load_state_dict(ref)
    x, y = next(iter(make_loader("regression", 16, n=16)))
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(model(x), y).item()
    assert isclose(runs[0][-1], expected), (runs[0][-1], expected)
    assert all(r["split_backwards"] == 0 for r in results)


V2BW = [(p, m, "adamw") for p in (2, 4) for m in (p, 2 * p, 4 * p)] + [(2, 4, "sgd")]


@pytest.mark.parametrize(("p", "m", "optimizer"), V2BW, ids=[f"p{p}-m{m}-{o}" for p, m, o in V2BW])
def test_2bw_on_a_v_equals_the_delayed_reference(pools, p: int, m: int, optimizer: str) -> None:
    """PipeDream-2BW with rank r holding stages r and 2p - 1 - r: W(t+1) = W(t) - step(grad
    f(W(t-1))) like the single-process reference, within 1e-5 after 6 steps (the default delay
    correction included), with at most two weight versions on every rank."""
    batch = 16 if m <= 8 else 32
    samples = batch * STEPS  # one epoch
    results = pools(p).run(
        workers.fit, "2bw-v", m, STEPS, optimizer, batch_size=batch, samples=samples
    )
    data = make_loader("regression", batch, n=samples)
    ref = reference_2bw(STEPS, m, batch_size=batch, optimizer=optimizer, data=data)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS 2bw-v p={p} m={m} {optimizer}: max|dW| = {diff:.3e}")
    assert diff <= 1e-5
    flush, _ = reference_train(STEPS, m, batch_size=batch, optimizer=optimizer, data=data)
    assert max_abs_diff(results[0]["state"], flush) > 1e-3  # the delay is real
    for r in results:
        assert 1 <= max(r["versions"]) <= 2 and 1 <= r["engine_versions"] <= 2


def test_2bw_on_a_v_with_a_tied_weight(pools) -> None:
    """Blocks 1 and 6 share a weight; the V puts both on rank 0: one parameter, one version
    set, and the delayed reference (which holds one weight) within 1e-6."""
    samples = 16 * STEPS
    results = pools(2).run(
        workers.fit, "2bw-v", 4, STEPS, batch_size=16, samples=samples, model="tied"
    )
    data = make_loader("tied", 16, n=samples)
    ref = reference_2bw(STEPS, 4, batch_size=16, data=data, model_name="tied")
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS 2bw-v tied weights p=2 m=4: max|dW| = {diff:.3e}")
    assert diff <= 1e-6
    assert [r["tied_copies"] for r in results] == [0, 0]
