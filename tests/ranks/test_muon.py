"""``MuonAdamW`` through the strategy, under every schedule, with data parallelism, tied weights
and checkpoints (the optimizer alone: ``tests/unit/test_muon.py``). Tolerances: the exactness
contracts' (max |dW| <= 1e-5 after 5 steps, fp32, CPU); bitwise where the order of operations is
the reference's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import workers
from helpers.models import max_abs_diff, reference_2bw, reference_pipedream, reference_train

STEPS = 5
TOL = 1e-5


FLUSH = [(s, p, m) for s in ("gpipe", "1f1b") for p, m in ((2, 4), (4, 4))]


@pytest.mark.parametrize(("schedule", "p", "m"), FLUSH)
def test_flush_schedules_with_muon_equal_one_device(
    pools: Any, schedule: str, p: int, m: int
) -> None:
    results = pools(p).run(workers.fit, schedule, m, STEPS, "muon")
    ref, _ = reference_train(STEPS, m, optimizer="muon")
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS muon {schedule} p={p} m={m}: max|dW| = {diff:.3e}")
    assert diff <= TOL


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (4, 4)])
def test_2bw_with_muon_equals_the_delayed_reference(pools: Any, p: int, m: int) -> None:
    results = pools(p).run(workers.fit, "2bw", m, STEPS, "muon")
    ref = reference_2bw(STEPS, m, optimizer="muon")
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS muon 2bw p={p} m={m}: max|dW| = {diff:.3e}")
    assert diff <= TOL


def test_pipedream_with_muon_equals_its_reference(pools: Any) -> None:
    results = pools(2).run(workers.fit, "pipedream", 2, STEPS, "muon")
    ref = reference_pipedream(STEPS, 2, [4, 4], optimizer="muon")
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS muon pipedream p=2 m=2: max|dW| = {diff:.3e}")
    assert diff <= TOL


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_muon_with_tied_weights(pools: Any, schedule: str) -> None:
    results = pools(2).run(workers.fit, schedule, 4, STEPS, "muon", model="tied")
    if schedule == "2bw":
        ref = reference_2bw(STEPS, 4, optimizer="muon", model_name="tied")
    else:
        ref, _ = reference_train(STEPS, 4, optimizer="muon", model_name="tied")
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS muon tied {schedule}: max|dW| = {diff:.3e}")
    assert diff <= TOL


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_muon_with_data_parallel(pools: Any, schedule: str) -> None:
    from ranks.test_data_parallel import LOCAL_BATCH, _global_batches

    results = pools(4).run(
        workers.fit, schedule, 2, 4, "muon", batch_size=LOCAL_BATCH, data_parallel=2
    )
    batches = _global_batches(2, LOCAL_BATCH)
    if schedule == "2bw":
        ref = reference_2bw(4, 4, optimizer="muon", data=batches)
    else:
        ref, _ = reference_train(4, 4, optimizer="muon", data=batches)
    diff = max_abs_diff(results[0]["state"], ref)
    print(f"EXACTNESS muon dp=2 x pp=2 {schedule}: max|dW| = {diff:.3e}")
    assert diff <= TOL


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_muon_resumes_exactly_from_a_consolidated_checkpoint(
    pools: Any, tmp_path: Any, schedule: str
) -> None:
    from ranks.test_checkpoint import _fit

    pool = pools(2)
    straight = pool.run(_fit, schedule, 6, optimizer="muon")[0]
    pool.run(_fit, schedule, 3, str(tmp_path), optimizer="muon")
    ckpt = tmp_path / "step=3.ckpt"
    raw = torch.load(ckpt, weights_only=True)
    stages = raw["optimizer_states"][0]["pipe2bw_stages"]
    assert all(
        any("momentum_buffer" in s for s in stage["state"].values()) for stage in stages
    )  # Muon's state, on every stage
    resumed = pool.run(_fit, schedule, 6, None, str(ckpt), optimizer="muon")[0]
    diff = max_abs_diff(resumed["state"], straight["state"])
    print(f"RESUME muon {schedule}: 6 steps vs 3 + checkpoint + 3: max|dW| = {diff:.3e}")
    assert diff == 0.0


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_muon_reshards_from_four_stages_to_two(pools: Any, tmp_path: Any, schedule: str) -> None:
    from ranks.test_checkpoint import _fit

    straight = pools(2).run(_fit, schedule, 6, microbatches=4, optimizer="muon")[0]
    pools(4).run(
        _fit, schedule, 3, str(tmp_path), microbatches=4, state_dict_type="sharded",
        optimizer="muon",
    )  # fmt: skip
    resumed = pools(2).run(
        _fit, schedule, 6, None, str(tmp_path / "step=3.ckpt"), microbatches=4,
        state_dict_type="sharded", optimizer="muon",
    )[0]  # fmt: skip
    diff = max_abs_diff(resumed["state"], straight["state"])
    print(f"RESUME sharded muon {schedule}: 4 stages x 3 steps + 2 x 3 vs 6: {diff:.3e}")
    assert diff <= 1e-6
