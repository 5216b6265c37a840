"""PipeDream-2BW's delay corrections (``delay_correction``, ``lightning_pipe2bw.optim.delay``) equal
their single-process references (``helpers.models.reference_2bw``, written from the rules in
``docs/pipedream-2bw.md``): max |dW| <= 1e-6 after 6 steps at p = 2 and 4, m = p and 4p, with
AdamW and with Muon (measured: 0, bitwise). The plain rule stays bitwise what it was; each
correction also holds across flushes, validation, checkpoints, clipping, ties, data
parallelism and fp16 loss scaling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import workers
from helpers.models import (
    loader,
    max_abs_diff,
    reference_2bw,
    reference_2bw_fresh,
    reference_pipedream,
)

from lightning_pipe2bw import Pipe2BWStrategy
from lightning_pipe2bw.optim.delay import CORRECTIONS, DEFAULT_CORRECTION, correction_predicts

STEPS = 6
TOL = 1e-6
# every correction alone, and a prediction with a gradient correction of strength 0.5
NAMED = [name for name in CORRECTIONS if name != "none"] + ["predict+error_feedback=0.5"]

CASES = [
    (c, p, m, opt) for c in NAMED for p in (2, 4) for m in (p, 4 * p) for opt in ("adamw", "muon")
]


@pytest.mark.parametrize(
    ("correction", "p", "m", "optimizer"),
    CASES,
    ids=[f"{c}-p{p}-m{m}-{o}" for c, p, m, o in CASES],
)
def test_each_correction_equals_its_reference(
    pools: Any, correction: str, p: int, m: int, optimizer: str
) -> None:
    batch = max(8, m)
    results = pools(p).run(
        workers.fit, "2bw", m, STEPS, optimizer, batch_size=batch, samples=batch * STEPS,
        delay_correction=correction,
    )  # fmt: skip
    data = loader(batch, n=batch * STEPS)
    ref = reference_2bw(STEPS, m, optimizer=optimizer, correction=correction, data=data)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS 2bw {correction} p={p} m={m} {optimizer}: max|dW| = {diff:.3e}")
    assert diff <= TOL
    plain = reference_2bw(STEPS, m, optimizer=optimizer, correction="none", data=data)
    assert max_abs_diff(ref, plain) > 1e-3  # the correction changed the training
    predicts = correction_predicts(correction)
    for r in results:
        # the plain rule's two weight buffers, and one more for the next batch's view under a
        # prediction; the last stage, whose batches end in the call that admits them, reuses a
        # finished batch's (two at most: the newest weights and one view)
        buffers = r["weight_buffers"]
        if r["stage"] == p - 1:
            assert buffers <= 2, (r["stage"], buffers)
        else:
            assert buffers == 2 + predicts, (r["stage"], buffers)


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "sgd"])
def test_no_correction_is_the_plain_rule(pools: Any, optimizer: str) -> None:
    results = pools(2).run(workers.fit, "2bw", 4, STEPS, optimizer, delay_correction="none")
    ref = reference_2bw(STEPS, 4, optimizer=optimizer, correction="none")
    assert max_abs_diff(results[0]["state"], ref) == 0.0


def test_2bw_applies_the_default_correction(pools: Any) -> None:
    results = pools(2).run(workers.fit, "2bw", 4, STEPS)
    ref = reference_2bw(STEPS, 4, correction=DEFAULT_CORRECTION)
    assert max_abs_diff(results[0]["state"], ref) == 0.0
    assert Pipe2BWStrategy(schedule="2bw").options.correction == DEFAULT_CORRECTION
    assert Pipe2BWStrategy(schedule="1f1b").options.correction == "none"


@pytest.mark.parametrize("correction", NAMED)
def test_corrections_hold_across_flushes_and_validation(pools: Any, correction: str) -> None:
    """A flush applies the last update early; the rule (and a prediction's view of the next
    batch) must not notice."""
    kwargs = {"val_batches": 2, "trainer_kwargs": {"val_check_interval": 3, "limit_val_batches": 2}}
    results = pools(2).run(
        workers.fit, "2bw", 4, 7, "adamw", flush_every=2, delay_correction=correction, **kwargs
    )
    ref = reference_2bw(7, 4, correction=correction)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS 2bw {correction} flush_every=2, validation every 3: max|dW| = {diff:.3e}")
    assert diff <= TOL


@pytest.mark.parametrize("correction", NAMED)
def test_corrections_with_norm_clipping(pools: Any, correction: str) -> None:
    """The correction acts on the clipped gradient (clipping's norm is the batch's, over every
    stage, as without one)."""
    trainer_kwargs = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}
    results = pools(2).run(
        workers.fit, "2bw", 2, STEPS, "adamw", trainer_kwargs=trainer_kwargs,
        delay_correction=correction,
    )  # fmt: skip
    ref = reference_2bw(STEPS, 2, clip=("norm", 0.05), correction=correction)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS 2bw {correction} clip norm=0.05: max|dW| = {diff:.3e}")
    assert diff <= 1e-5  # the norm is accumulated in float64 (docs/pipedream-2bw.md)


@pytest.mark.parametrize("correction", NAMED)
def test_corrections_with_tied_weights(pools: Any, correction: str) -> None:
    results = pools(2).run(
        workers.fit, "2bw", 4, STEPS, "adamw", model="tied", delay_correction=correction
    )
    ref = reference_2bw(STEPS, 4, model_name="tied", correction=correction)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS 2bw {correction} tied weights: max|dW| = {diff:.3e}")
    # the copies' gradients are summed as each batch completes, not at the step (pipeline.ties)
    assert [r["ties_ahead"] for r in results] == [True, True]
    assert diff <= TOL


@pytest.mark.parametrize("correction", NAMED)
def test_corrections_with_data_parallel(pools: Any, correction: str) -> None:
    from ranks.test_data_parallel import LOCAL_BATCH, _global_batches

    results = pools(4).run(
        workers.fit, "2bw", 2, 4, "adamw", batch_size=LOCAL_BATCH, data_parallel=2,
        delay_correction=correction,
    )  # fmt: skip
    ref = reference_2bw(4, 4, data=_global_batches(2, LOCAL_BATCH), correction=correction)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS 2bw {correction} dp=2 x pp=2: max|dW| = {diff:.3e}")
    assert diff <= 1e-5  # the replicas' average changes the order of additions


@pytest.mark.parametrize("correction", [n for n in NAMED if not correction_predicts(n)])
def test_gradient_corrections_under_pipedream(pools: Any, correction: str) -> None:
    """Each stage corrects its own updates, which it applies when its batch is done."""
    for p, m in ((2, 1), (2, 2), (4, 4)):
        balance = [8 // p] * p
        results = pools(p).run(
            workers.fit, "pipedream", m, STEPS, "adamw", delay_correction=correction
        )
        ref = reference_pipedream(STEPS, m, balance, correction=correction)
        diff = max_abs_diff(results[0]["state"], ref)
        print(f"EXACTNESS pipedream {correction} p={p} m={m}: max|dW| = {diff:.3e}")
        assert diff <= TOL


# ---------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("correction", NAMED)
def test_corrections_resume_exactly(pools: Any, tmp_path: Path, correction: str) -> None:
    """Their state (a previous gradient or update, a predicted view) travels in the checkpoint:
    6 steps equal 3 + checkpoint + 3, consolidated and resharded from 4 stages to 2."""
    from ranks.test_checkpoint import _fit

    straight = pools(2).run(_fit, "2bw", 6, microbatches=4, delay_correction=correction)[0]
    pools(2).run(
        _fit, "2bw", 3, str(tmp_path / "full"), microbatches=4, delay_correction=correction
    )
    resumed = pools(2).run(
        _fit, "2bw", 6, None, str(tmp_path / "full" / "step=3.ckpt"), microbatches=4,
        delay_correction=correction,
    )[0]  # fmt: skip
    diff = max_abs_diff(resumed["state"], straight["state"])
    print(f"RESUME 2bw {correction}: 6 steps vs 3 + checkpoint + 3: max|dW| = {diff:.3e}")
    assert diff == 0.0
    raw = torch.load(tmp_path / "full" / "step=3.ckpt", weights_only=True)
    assert raw["pipe2bw"]["delay_correction"] == correction
    pools(4).run(
        _fit, "2bw", 3, str(tmp_path / "sharded"), microbatches=4, state_dict_type="sharded",
        delay_correction=correction,
    )  # fmt: skip
    resharded = pools(2).run(
        _fit, "2bw", 6, None, str(tmp_path / "sharded" / "step=3.ckpt"), microbatches=4,
        state_dict_type="sharded", delay_correction=correction,
    )[0]  # fmt: skip
    diff = max_abs_diff(resharded["state"], straight["state"])
    print(f"RESUME sharded 2bw {correction}: 4 stages x 3 + 2 x 3 vs 6: max|dW| = {diff:.3e}")
    assert diff <= TOL


def test_resuming_without_the_corrections_state_drifts(pools: Any, tmp_path: Path) -> None:
    """The test above can fail: a checkpoint stripped of the correction's state resumes as if
    the correction started afresh."""
    from ranks.test_checkpoint import _fit

    straight = pools(2).run(_fit, "2bw", 6, microbatches=4, delay_correction="error_feedback")[0]
    pools(2).run(_fit, "2bw", 3, str(tmp_path), microbatches=4, delay_correction="error_feedback")
    path = tmp_path / "step=3.ckpt"
    raw = torch.load(path, weights_only=True)
    for stage in raw["optimizer_states"][0]["pipe2bw_stages"]:
        for state in stage["state"].values():
            state.pop("delay_previous_grad")
    torch.save(raw, tmp_path / "stripped.ckpt")
    resumed = pools(2).run(
        _fit, "2bw", 6, None, str(tmp_path / "stripped.ckpt"), microbatches=4,
        delay_correction="error_feedback",
    )[0]  # fmt: skip
    assert max_abs_diff(resumed["state"], straight["state"]) > 1e-5


@pytest.mark.parametrize("correction", NAMED)
def test_corrections_move_with_their_blocks(pools: Any, correction: str) -> None:
    """Live repartitioning carries a correction's state (and a prediction's view) with the
    blocks: the weights equal those of a run that does not move them."""
    from helpers import repartition_workers as rw

    kwargs = {"flush_every": 2, "delay_correction": correction}
    moved = pools(2).run(rw.fit_slow, "2bw", 6, repartition_every=2, **kwargs)
    fixed = pools(2).run(rw.fit_slow, "2bw", 6, **kwargs)
    assert moved[0]["repartitions"] and moved[0]["balance"] == [3, 5]
    diff = max_abs_diff(moved[0]["state"], fixed[0]["state"])
    print(f"REPARTITION 2bw {correction}: max|dW| against no repartitioning {diff:.3e}")
    assert diff <= TOL


def _fit_fp16(correction: str, poisoned_batch: int, steps: int) -> dict[str, Any]:
    import torch.distributed as dist
    from helpers.models import quiet_trainer
    from lightning.pytorch.plugins import MixedPrecision

    from ranks.test_precision import PoisonModel, Watch, poisoned_loader

    watch = Watch()
    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule="2bw", microbatches=2, delay_correction=correction),
        plugins=[MixedPrecision(precision="16-mixed", device="cpu")],
        max_steps=steps,
        callbacks=[watch],
    )
    trainer.fit(PoisonModel(), poisoned_loader(poisoned_batch))
    return {"fingerprints": watch.fingerprints, "scales": watch.scales}


@pytest.mark.parametrize("correction", NAMED)
def test_corrections_with_fp16_loss_scaling(pools: Any, correction: str) -> None:
    """An inf gradient on one stage skips the (delayed) update on every stage, correction
    included: the weights stay as they were and the scale halves alike."""
    poisoned, steps = 2, 6
    results = pools(2).run(_fit_fp16, correction, poisoned, steps)
    skipped = poisoned + 1  # 2BW applies batch t's update at the end of step t + 1
    for rank, r in enumerate(results):
        f, s = r["fingerprints"], r["scales"]
        assert f[skipped] == f[skipped - 1], (rank, f)
        assert f[skipped + 1] != f[skipped], (rank, f)
        assert all(map(torch.isfinite, map(torch.tensor, f))), (rank, f)
        assert s[skipped] == s[skipped - 1] / 2, (rank, s)
    assert results[0]["scales"] == results[1]["scales"]


# ---------------------------------------------------------------------- a synchronous start
# (correction, p, optimizer): every correction kind and both optimizers at p = 2 and 4
SYNC_CASES = [
    ("none", 2, "adamw"),
    ("none", 4, "muon"),
    ("predict+error_feedback=0.5", 2, "muon"),
    ("predict+error_feedback=0.5", 4, "adamw"),
    ("update_feedback", 2, "adamw"),
    ("predict+update_feedback", 4, "muon"),
]


@pytest.mark.parametrize(
    ("correction", "p", "optimizer"), SYNC_CASES, ids=[f"{c}-p{p}-{o}" for c, p, o in SYNC_CASES]
)
def test_a_synchronous_start_equals_its_reference(
    pools: Any, correction: str, p: int, optimizer: str
) -> None:
    """``sync_steps=K``: batches before K at the newest weights, flushed, uncorrected; the
    delayed rule (and the correction, from no history) from batch K on; bitwise."""
    sync, m = 3, 2 * p
    results = pools(p).run(
        workers.fit, "2bw", m, STEPS, optimizer, delay_correction=correction, sync_steps=sync
    )
    ref = reference_2bw(STEPS, m, optimizer=optimizer, correction=correction, sync_steps=sync)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS 2bw {correction} sync_steps={sync} p={p} {optimizer}: max|dW| = {diff:.3e}")
    assert diff == 0.0
    # the test can fail: the start changed the training, and so does where it ends
    delayed = reference_2bw(STEPS, m, optimizer=optimizer, correction=correction)
    assert max_abs_diff(ref, delayed) > 1e-4
    later = reference_2bw(STEPS, m, optimizer=optimizer, correction=correction, sync_steps=4)
    assert max_abs_diff(ref, later) > 1e-4


def test_a_synchronous_start_on_a_v_and_with_per_group_rates(pools: Any) -> None:
    """2BW on a V (two stages per rank) starts synchronously alike; ``MuonAdamW`` with its AdamW
    part at a rate of its own equals its reference."""
    results = pools(2).run(
        workers.fit, "2bw-v", 4, STEPS, "muon-lr", delay_correction="error_feedback", sync_steps=2
    )
    ref = reference_2bw(STEPS, 4, optimizer="muon-lr", correction="error_feedback", sync_steps=2)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS 2bw-v error_feedback sync_steps=2 muon-lr: max|dW| = {diff:.3e}")
    assert diff == 0.0
    assert max_abs_diff(ref, reference_2bw(STEPS, 4, optimizer="muon", sync_steps=2)) > 1e-4


def test_a_synchronous_start_as_a_share_of_the_fit(pools: Any) -> None:
    """``sync_steps=0.5`` of a 6-step fit is a start of 3 steps."""
    results = pools(2).run(
        workers.fit, "2bw", 4, STEPS, "adamw", delay_correction="update_feedback", sync_steps=0.5
    )
    ref = reference_2bw(STEPS, 4, correction="update_feedback", sync_steps=3)
    assert max_abs_diff(results[0]["state"], ref) == 0.0


@pytest.mark.parametrize("sync", [2, 4])
def test_a_synchronous_start_resumes_exactly(pools: Any, tmp_path: Path, sync: int) -> None:
    """A checkpoint after the switch (step 3 of a start of 2) or inside the start (of 4):
    6 steps equal 3 + checkpoint + 3."""
    from ranks.test_checkpoint import SAMPLES, _fit

    kwargs = {"microbatches": 4, "delay_correction": "predict", "sync_steps": sync}
    straight = pools(2).run(_fit, "2bw", 6, **kwargs)[0]
    pools(2).run(_fit, "2bw", 3, str(tmp_path), **kwargs)
    resumed = pools(2).run(_fit, "2bw", 6, None, str(tmp_path / "step=3.ckpt"), **kwargs)[0]
    diff = max_abs_diff(resumed["state"], straight["state"])
    print(f"RESUME 2bw sync_steps={sync}: 6 steps vs 3 + checkpoint + 3: max|dW| = {diff:.3e}")
    assert diff == 0.0
    epochs = list(loader(8, n=SAMPLES)) * 2  # two epochs of 3 batches (each ends in a flush)
    ref = reference_2bw(6, 4, correction="predict", sync_steps=sync, data=epochs)
    assert max_abs_diff(straight["state"], ref) == 0.0


# (correction, p, optimizer, sync_steps): the plain rule and each kind of correction on the
# stages before the last, p = 2 and 4, AdamW, Muon and Muon with per-group rates, and a
# synchronous start
FRESH_CASES = [
    ("none", 2, "adamw", 0),
    ("update_feedback", 2, "muon", 0),
    ("error_feedback", 4, "adamw", 0),
    ("predict", 4, "muon", 0),
    ("update_feedback", 2, "adamw", 3),
    ("predict+error_feedback=0.5", 2, "muon-lr", 2),
]


def _last_stage(results: list[dict[str, Any]]) -> Any:
    """Whether a parameter name (``body.<block>.<...>``) is on the last stage of ``results``."""
    last = max(r["stage"] for r in results)
    blocks = {str(b) for r in results if r["stage"] == last for b in r["blocks"]}
    return lambda name: name.split(".")[1] in blocks


@pytest.mark.parametrize(
    ("correction", "p", "optimizer", "sync"),
    FRESH_CASES,
    ids=[f"{c}-p{p}-{o}-sync{k}" for c, p, o, k in FRESH_CASES],
)
def test_a_fresh_last_stage_equals_its_reference(
    pools: Any, correction: str, p: int, optimizer: str, sync: int
) -> None:
    """``fresh_last_stage=True``: the last stage computes batch t at W(t) and applies its
    update in step t, uncorrected; the stages before it keep the delayed rule and its
    correction; bitwise."""
    m = 2 * p
    results = pools(p).run(
        workers.fit, "2bw", m, STEPS, optimizer, delay_correction=correction, sync_steps=sync,
        fresh_last_stage=True,
    )  # fmt: skip
    fresh = _last_stage(results)
    ref = reference_2bw_fresh(
        STEPS, m, fresh, optimizer=optimizer, correction=correction, sync_steps=sync
    )
    diff = max_abs_diff(results[0]["state"], ref)
    print(
        f"EXACTNESS 2bw fresh_last_stage {correction} sync_steps={sync} p={p} {optimizer}: "
        f"max|dW| = {diff:.3e}"
    )
    assert diff == 0.0
    # the test can fail: the fresh last stage changed the training
    delayed = reference_2bw(STEPS, m, optimizer=optimizer, correction=correction, sync_steps=sync)
    assert max_abs_diff(ref, delayed) > 1e-4
    for r in results:  # the last stage runs uncorrected
        if r["stage"] == p - 1:
            assert r["weight_buffers"] <= 2


def test_a_fresh_last_stage_with_norm_clipping(pools: Any) -> None:
    """Step t clips the delayed stages' gradient of batch t-1 together with the last stage's of
    batch t (what the step applies), and the drain clips the last delayed gradient alone."""
    trainer_kwargs = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}
    results = pools(2).run(
        workers.fit, "2bw", 2, STEPS, "sgd", trainer_kwargs=trainer_kwargs,
        delay_correction="update_feedback", fresh_last_stage=True,
    )  # fmt: skip
    fresh = _last_stage(results)
    clip = ("norm", 0.05)
    ref = reference_2bw_fresh(
        STEPS, 2, fresh, optimizer="sgd", clip=clip, correction="update_feedback"
    )
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS 2bw fresh_last_stage update_feedback clip norm=0.05: max|dW| = {diff:.3e}")
    assert diff <= 1e-5  # the norm is accumulated in float64 (docs/pipedream-2bw.md)
    unclipped = reference_2bw_fresh(STEPS, 2, fresh, optimizer="sgd", correction="update_feedback")
    assert max_abs_diff(ref, unclipped) > 1e-4


def test_a_fresh_last_stage_with_data_parallel(pools: Any) -> None:
    from ranks.test_data_parallel import LOCAL_BATCH, _global_batches

    results = pools(4).run(
        workers.fit, "2bw", 2, 4, "adamw", batch_size=LOCAL_BATCH, data_parallel=2,
        delay_correction="error_feedback", fresh_last_stage=True,
    )  # fmt: skip
    ref = reference_2bw_fresh(
        4, 4, _last_stage(results), data=_global_batches(2, LOCAL_BATCH),
        correction="error_feedback",
    )  # fmt: skip
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS 2bw fresh_last_stage error_feedback dp=2 x pp=2: max|dW| = {diff:.3e}")
    assert diff <= 1e-5  # the replicas' average changes the order of additions


def test_a_fresh_last_stage_resumes_exactly(pools: Any, tmp_path: Path) -> None:
    """6 steps equal 3 + checkpoint + 3 (two epochs of 3 batches, each ending in a flush), and
    the reference (a flush changes nothing without clipping)."""
    from ranks.test_checkpoint import SAMPLES, _fit

    kwargs = {"microbatches": 4, "delay_correction": "update_feedback", "fresh_last_stage": True}
    straight = pools(2).run(_fit, "2bw", 6, **kwargs)[0]
    pools(2).run(_fit, "2bw", 3, str(tmp_path), **kwargs)
    resumed = pools(2).run(_fit, "2bw", 6, None, str(tmp_path / "step=3.ckpt"), **kwargs)[0]
    diff = max_abs_diff(resumed["state"], straight["state"])
    print(f"RESUME 2bw fresh_last_stage: 6 steps vs 3 + checkpoint + 3: max|dW| = {diff:.3e}")
    assert diff == 0.0
    epochs = list(loader(8, n=SAMPLES)) * 2
    fresh = lambda name: name.split(".")[1] in {"4", "5", "6", "7"}  # noqa: E731 - [4, 4]
    ref = reference_2bw_fresh(6, 4, fresh, correction="update_feedback", data=epochs)
    assert max_abs_diff(straight["state"], ref) == 0.0


def _fit_warned(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """``test_checkpoint._fit`` on this rank, with the warnings it raised (their messages)."""
    import warnings

    from ranks.test_checkpoint import _fit

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _fit(*args, **kwargs)
    out["warnings"] = [str(w.message) for w in caught]
    return out


def test_resuming_with_another_rule_than_the_checkpoints_is_said(
    pools: Any, tmp_path: Path
) -> None:
    """A checkpoint records the delay correction and ``fresh_last_stage`` it was written with;
    resuming under others warns, naming both values (the run goes on, but not as the
    checkpoint's would have)."""
    written = {"microbatches": 4, "delay_correction": "update_feedback", "fresh_last_stage": True}
    pools(2).run(_fit_warned, "2bw", 3, str(tmp_path), **written)
    resumed = {"microbatches": 4, "delay_correction": "error_feedback", "fresh_last_stage": False}
    last, first = pools(2).run(
        _fit_warned, "2bw", 6, None, str(tmp_path / "step=3.ckpt"), **resumed
    )  # global rank 0 runs the last stage
    said = "\n".join(last["warnings"])
    assert "fresh_last_stage=False from a checkpoint written with fresh_last_stage=True" in said
    assert "delay_correction='error_feedback' from a checkpoint written with 'update_feedback'" in (
        said
    )
    assert not any("fresh_last_stage" in w for w in first["warnings"])  # the first stage's
    # rule is the same either way
    same = pools(2).run(_fit_warned, "2bw", 6, None, str(tmp_path / "step=3.ckpt"), **written)
    assert not any("from a checkpoint written with" in w for r in same for w in r["warnings"])
