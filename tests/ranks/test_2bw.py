"""PipeDream-2BW equals its single-process delayed-gradient reference:
W(t+1) = W(t) - step(grad f(W(t-1))). Tolerance: max abs parameter difference <= 1e-5 (fp32,
CPU) after 6 optimizer steps, for SGD with momentum and AdamW with an LR scheduler."""

from __future__ import annotations

import math
from typing import Any

import pytest
from helpers import workers
from helpers.models import isclose, max_abs_diff, reference_2bw, reference_train
from lightning.pytorch import Callback

STEPS = 6
TOL = 1e-5

CASES = [(p, m, opt) for p in (2, 4) for m in (p, 2 * p) for opt in ("sgd", "adamw")]


@pytest.mark.parametrize(
    ("p", "m", "optimizer"), CASES, ids=[f"p{p}-m{m}-{o}" for p, m, o in CASES]
)
def test_2bw_equals_delayed_gradient_reference(pools: Any, p: int, m: int, optimizer: str) -> None:
    results = pools(p).run(workers.fit, "2bw", m, STEPS, optimizer)
    ref = reference_2bw(STEPS, m, optimizer=optimizer)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS 2bw p={p} m={m} {optimizer}: max|dW| = {diff:.3e}")
    assert diff <= TOL
    # and it is not single-device training: the delay is real
    assert (
        max_abs_diff(results[0]["state"], reference_train(STEPS, m, optimizer=optimizer)[0]) > 1e-3
    )
    # two weight versions at most, and both are used, on every stage but the last, which runs
    # a batch's last backward in the call that admits it and so updates in place: one version
    for rank, r in enumerate(results):
        expected = 1 if r["stage"] == p - 1 else 2
        assert max(r["versions"]) == expected, (rank, r["stage"])
        assert 1 <= r["engine_versions"] <= 2, rank


def test_2bw_flush_every(pools: Any) -> None:
    results = pools(2).run(workers.fit, "2bw", 2, STEPS, "adamw", flush_every=2)
    diff = max_abs_diff(results[0]["state"], reference_2bw(STEPS, 2))
    print(f"EXACTNESS 2bw p=2 m=2 flush_every=2: max|dW| = {diff:.3e}")
    assert diff <= TOL


def test_2bw_across_validation(pools: Any) -> None:
    """Flush, validate, resume: the update rule is unchanged by the flush."""
    kwargs = {"val_batches": 2, "trainer_kwargs": {"val_check_interval": 3, "limit_val_batches": 2}}
    results = pools(2).run(workers.fit, "2bw", 4, STEPS, "sgd", **kwargs)
    diff = max_abs_diff(results[0]["state"], reference_2bw(STEPS, 4, optimizer="sgd"))
    print(f"EXACTNESS 2bw p=2 m=4 validation every 3 steps: max|dW| = {diff:.3e}")
    assert diff <= TOL
    assert len(results[0]["val_runs"]) == 2


def test_2bw_logged_loss_is_the_batch_loss(pools: Any) -> None:
    """The loss logged at step t is batch t's own loss, computed with version max(t-1, 0)."""
    import torch
    from helpers.models import RegressionModel, loader
    from torch import nn

    results = pools(2).run(workers.fit, "2bw", 2, 4, "sgd")
    expected = []
    for t, (x, y) in enumerate(loader(8)):
        if t == 4:
            break
        model = RegressionModel(optimizer="sgd")
        model.load_state_dict(reference_2bw(max(t - 1, 0), 2, optimizer="sgd"))
        with torch.no_grad():
            expected.append(float(nn.functional.mse_loss(model(x), y)))
    # global rank 0 runs the last stage, which has batch t's loss during step t: the progress
    # bar and the loggers show it at step t
    rank0 = results[0]
    assert rank0["stage"] == 1
    assert all(isclose(a, b) for a, b in zip(rank0["losses"], expected, strict=True)), (
        rank0["losses"],
        expected,
    )
    # the other ranks receive it without a barrier, one step late; at the last step of an
    # epoch or of fit they also wait for that step's, so they end with the last stage's values
    rank1 = results[1]
    assert math.isnan(rank1["losses"][0]), rank1["losses"]
    assert all(isclose(a, b) for a, b in zip(rank1["losses"][1:-1], expected[:-2], strict=True)), (
        rank1["losses"],
        expected,
    )
    assert isclose(rank1["losses"][-1], expected[-1]), (rank1["losses"], expected)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_flush_schedules_keep_one_version(pools: Any, schedule: str) -> None:
    for r in pools(2).run(workers.fit, schedule, 4, 2):
        assert r["versions"] == []  # no version store at all: the module's weights only
        assert r["engine_versions"] == 1  # every action referenced one set of weights


CLIPS = [("2bw", "norm", 0.05), ("2bw", "value", 0.01), ("1f1b", "norm", 0.05)]


@pytest.mark.parametrize(
    ("schedule", "algorithm", "value"), CLIPS, ids=[f"{s}-{a}" for s, a, _ in CLIPS]
)
def test_gradient_clipping_over_all_stages(
    pools: Any, schedule: str, algorithm: str, value: float
) -> None:
    """Clipping by norm uses the norm of the same batch's gradient over every stage."""
    trainer_kwargs = {"gradient_clip_val": value, "gradient_clip_algorithm": algorithm}
    results = pools(2).run(workers.fit, schedule, 2, STEPS, "sgd", trainer_kwargs=trainer_kwargs)
    clip = (algorithm, value)
    if schedule == "2bw":
        ref = reference_2bw(STEPS, 2, optimizer="sgd", clip=clip)
        unclipped = reference_2bw(STEPS, 2, optimizer="sgd")
    else:
        ref = reference_train(STEPS, 2, optimizer="sgd", clip=clip)[0]
        unclipped = reference_train(STEPS, 2, optimizer="sgd")[0]
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS {schedule} clip {algorithm}={value}: max|dW| = {diff:.3e}")
    assert diff <= TOL
    assert max_abs_diff(ref, unclipped) > 1e-3  # the clipping was active
    # 2BW sums each batch's norm as its gradient completes, not at the step
    assert [r["norms_ahead"] for r in results] == [(schedule, algorithm) == ("2bw", "norm")] * 2


class GradientHook(Callback):
    """Overrides a gradient hook (and changes nothing): clipping's norm is then summed at the
    step, where such a hook could have changed a gradient."""

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        pass


@pytest.mark.parametrize("hook", [False, True], ids=["ahead", "hooked"])
def test_clipping_norms_posted_ahead_over_four_stages(pools: Any, hook: bool) -> None:
    """Four stages, flushes every 3 batches and a synchronous start of 2: each stage posts a
    batch's squared norm as soon as its gradient is complete, in a group of their own, and the
    step takes the sum; the weights are the delayed rule's with clipping, as when the norm is
    summed at the step (where a gradient hook is overridden)."""
    trainer_kwargs = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}
    results = pools(4).run(
        workers.fit, "2bw", 4, STEPS, "sgd", trainer_kwargs=trainer_kwargs, flush_every=3,
        sync_steps=2, delay_correction="none", callbacks=[GradientHook()] if hook else [],
    )  # fmt: skip
    ref = reference_2bw(
        STEPS, 4, optimizer="sgd", clip=("norm", 0.05), sync_steps=2, correction="none"
    )
    unclipped = reference_2bw(STEPS, 4, optimizer="sgd", sync_steps=2, correction="none")
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS 2bw clip norm over 4 stages ({'hooked' if hook else 'ahead'}): {diff:.3e}")
    assert diff <= TOL
    assert max_abs_diff(ref, unclipped) > 1e-3  # the clipping was active
    assert [r["norms_ahead"] for r in results] == [not hook] * 4


def _peak_activation_bytes(schedule: str, m: int) -> tuple[int, int, int]:
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=m)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=3)
    trainer.fit(RegressionModel(), loader(8))
    assert strategy.engine is not None
    stats = strategy.engine.stats
    return strategy.stage, stats.peak_activation_bytes, stats.peak_inflight


def test_stashed_activations_follow_the_schedule(pools: Any) -> None:
    """Counted through saved_tensors_hooks: GPipe stashes all m micro-batches on every stage,
    1F1B and 2BW at most p - s; in-flight counts match the simulator's bounds."""
    m = 4
    gpipe = pools(2).run(_peak_activation_bytes, "gpipe", m)
    for schedule in ("1f1b", "2bw"):
        got = pools(2).run(_peak_activation_bytes, schedule, m)
        for (stage, g_bytes, g_n), (_, b, n) in zip(sorted(gpipe), sorted(got), strict=True):
            assert g_n == m and n == 2 - stage, (schedule, stage, n)
            # equal micro-batches save equal bytes: the peak scales with the count in flight
            assert b * g_n == g_bytes * n, (schedule, stage, b, g_bytes)


def _fit_2bw_too_few_microbatches() -> str:
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule="2bw", microbatches=1),
        max_steps=1,
    )
    try:
        trainer.fit(RegressionModel(), loader(8))
    except ValueError as err:
        return str(err)
    return "no error"


def test_2bw_needs_a_microbatch_per_stage(pools: Any) -> None:
    for message in pools(2).run(_fit_2bw_too_few_microbatches):
        assert message == (
            "schedule='2bw' needs at least as many micro-batches as stages, got microbatches=1 "
            "for 2 stages; use microbatches=2 or more"
        )


def _scheduler_warnings() -> list[str]:
    import warnings

    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule="2bw", microbatches=2),
        max_steps=3,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(RegressionModel(), loader(8))
    return [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]


def test_first_deferred_update_does_not_trip_the_scheduler_warning(pools: Any) -> None:
    """Step 0 of 2BW applies nothing yet; torch's LR scheduler must not take that for a
    skipped optimizer step (its first learning rate is recorded and used for update 0)."""
    assert pools(2).run(_scheduler_warnings) == [[], []]


def _pending_sends_over_a_long_run(steps: int) -> list[int]:
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer
    from lightning.pytorch import Callback

    from lightning_pipe2bw import Pipe2BWStrategy

    counts: list[int] = []

    class Count(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            transport = trainer.strategy.engine.transport
            counts.append(len(transport._pending))

    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule="2bw", microbatches=2),
        max_steps=steps,
        callbacks=[Count()],
    )
    trainer.fit(RegressionModel(), loader(8, n=8 * steps))
    return counts


def test_send_buffers_stay_bounded_without_a_flush(pools: Any) -> None:
    """2BW never flushes between validations; the buffers of sent messages must not pile up
    (gloo reports a send complete only once it is waited for)."""
    for counts in pools(2).run(_pending_sends_over_a_long_run, 30):
        assert len(counts) == 30
        assert max(counts) <= 12 and counts[-1] == counts[10], counts  # flat, not growing


def test_tied_sums_posted_ahead_over_four_stages(pools: Any) -> None:
    """A weight shared by blocks on the first and the last of four stages, with flushes every 3
    batches and a synchronous start of 2: the two stages start summing a batch's copies'
    gradients as soon as it is complete on each, and the step takes the sums; the weights are
    the delayed rule's on one device."""
    results = pools(4).run(
        workers.fit, "2bw", 4, STEPS, "adamw", model="tied", flush_every=3, sync_steps=2,
        delay_correction="none",
    )  # fmt: skip
    ref = reference_2bw(STEPS, 4, model_name="tied", sync_steps=2, correction="none")
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS 2bw tied weights over 4 stages, sums ahead: max|dW| = {diff:.3e}")
    assert diff <= TOL
    holding = [r["stage"] in (0, 3) for r in sorted(results, key=lambda r: r["stage"])]
    assert [r["ties_ahead"] for r in sorted(results, key=lambda r: r["stage"])] == holding
    assert holding == [True, False, False, True]
