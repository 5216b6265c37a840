"""Optimizer state sharded over a stage's data-parallel replicas (``shard_optimizer=True``,
ZeRO-1): 2 replicas x 2 stages train the same weights as without sharding (tolerance 0: every
parameter's update is computed by one replica with the same gradient, the same state and the
same kernels as without sharding, and copied to the other), and every rank holds about half of
its stage's optimizer state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import workers
from helpers.models import max_abs_diff, tensors_equal

from lightning_pipe2bw.optim.shard import ALIGNMENT

STEPS, M, LOCAL = 4, 2, 4  # two replicas' batches of 4 make a batch of 8


def _state_elements(result: dict[str, Any]) -> int:
    return int(result["opt_state_bytes"]) // 4  # fp32 state


def _moment_elements(result: dict[str, Any]) -> int:
    """The optimizer state's elements in tensors of a parameter's (or part's) size: every entry
    but the per-parameter counters (Adam's ``step``)."""
    return int(result["opt_moment_elements"])


def _fit_both(schedule: str, optimizer: str, **kwargs: Any) -> dict[str, Any]:
    """The same fit without and with ``shard_optimizer`` on this rank (2 replicas x 2 stages);
    ``fp16=True``: fp16 autocast with a loss scaler (Lightning's plugin, on the CPU)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    fp16 = kwargs.pop("fp16", False)

    def fit(**more: Any) -> dict[str, Any]:
        if fp16:  # a plugin of its own each time: its loss scaler keeps a scale
            more["trainer_kwargs"] = {"plugins": [MixedPrecision("16-mixed", device="cpu")]}
        return workers.fit(
            schedule, M, STEPS, optimizer, batch_size=LOCAL, data_parallel=2, **kwargs, **more
        )

    plain, sharded = fit(), fit(shard_optimizer=True)
    return {"plain": plain, "sharded": sharded}


def _label(values: dict[str, Any]) -> str:
    return "-".join(f"{k}={_label(v) if isinstance(v, dict) else v}" for k, v in values.items())


CASES = [
    ("1f1b", "adamw", {}),
    ("gpipe", "muon", {}),
    ("zb-h1", "adamw", {}),
    ("interleaved-1f1b", "muon", {}),
    ("zb-v", "adamw", {}),
    ("2bw", "adamw", {"delay_correction": "none"}),
    ("2bw", "muon", {"delay_correction": "error_feedback"}),
    ("2bw", "adamw", {"delay_correction": "predict"}),
    ("2bw", "muon", {"delay_correction": "update_feedback"}),
    ("2bw", "adamw", {"delay_correction": "nesterov"}),
    ("2bw", "adamw", {"delay_correction": "predict+error_feedback=0.5", "sync_steps": 1}),
    ("2bw", "adamw", {"fresh_last_stage": True}),
    ("2bw-v", "adamw", {}),
    ("pipedream", "muon", {}),  # each stage's update inside the pipeline, its replicas met there
    # clipping by the global norm (every replica holds the whole averaged gradient), and a
    # precision plugin
    ("1f1b", "muon", {"trainer_kwargs": {"gradient_clip_val": 0.05}}),
    ("2bw", "adamw", {"trainer_kwargs": {"gradient_clip_val": 0.05}}),
    ("2bw", "adamw", {"trainer_kwargs": {"precision": "bf16-mixed"}}),
    ("1f1b", "adamw", {"fp16": True}),
    ("2bw", "muon", {"fp16": True}),
]


@pytest.mark.parametrize(
    ("schedule", "optimizer", "kwargs"),
    [
        pytest.param(*case, id="-".join(filter(None, [case[0], case[1], _label(case[2])])))
        for case in CASES
    ],
)
def test_sharded_state_trains_the_same_weights_with_half_the_state(
    pools: Any, schedule: str, optimizer: str, kwargs: dict[str, Any]
) -> None:
    results = pools(4).run(_fit_both, schedule, optimizer, **kwargs)
    plain, sharded = results[0]["plain"]["state"], results[0]["sharded"]["state"]
    diff = max_abs_diff(sharded, plain)
    ratios = [_state_elements(r["sharded"]) / _state_elements(r["plain"]) for r in results]
    print(
        f"SHARD {schedule} {optimizer} {kwargs}: max|dW| against unsharded {diff:.3e}; "
        f"optimizer state per rank {[f'{x:.2f}' for x in ratios]} of unsharded"
    )
    assert diff == 0.0
    by_stage: dict[int, list[int]] = {}
    for r in results:
        s = r["sharded"]
        by_stage.setdefault(s["stage"], []).append(s["owned_elements"])
        # every replica holds its half of the stage within one alignment unit: AdamW's state by
        # elements; MuonAdamW's matrices whole, AdamW's elements filling around them
        assert s["owned_elements"] <= max(
            -(-s["stage_elements"] // 2) + ALIGNMENT, s["largest_whole"] + ALIGNMENT
        ), s
        if optimizer == "adamw":
            assert s["largest_whole"] == 0
            # and its state is of those elements alone: as much per element as without sharding
            plain = r["plain"]
            per_element = _moment_elements(plain) / s["stage_elements"]
            assert _moment_elements(s) == per_element * s["owned_elements"], (s, plain)
    # the two replicas of a stage own complementary parts (together: all of it)
    for stage, owned in by_stage.items():
        want = next(r["sharded"]["stage_elements"] for r in results if r["sharded"]["stage"] == stage)
        assert sum(owned) == want, (stage, owned)


def _resave(ckpt: str, out: str, data_parallel: int, shard: bool) -> None:
    """Load ``ckpt`` (written after 3 steps) into 2BW stages with ``data_parallel`` replicas,
    train no further, and write the consolidated checkpoint to ``out``."""
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    strategy = Pipe2BWStrategy(
        schedule="2bw", microbatches=2, data_parallel=data_parallel, shard_optimizer=shard
    )
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=3)
    trainer.fit(RegressionModel(), loader(8, n=24 * data_parallel), ckpt_path=ckpt)
    trainer.save_checkpoint(out)


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_sharded_state_checkpoints_as_the_unsharded_and_resumes_exactly(
    pools: Any, tmp_path: Path, state_dict_type: str
) -> None:
    """2 replicas x 2 2BW stages: the checkpoint written with sharded optimizer state holds
    what the unsharded run's holds (the consolidated file: the same file); 3 steps + checkpoint +
    3 equal 6 straight; and a sharded checkpoint reloads with sharding off, with one replica and
    sharded over 4 replicas of one stage (its optimizer state, written again consolidated, is the
    unsharded run's)."""
    from ranks.test_checkpoint import TOL, _fit

    pool = pools(4)
    kwargs: dict[str, Any] = {"state_dict_type": state_dict_type, "data_parallel": 2}
    straight = pool.run(_fit, "2bw", 6, **kwargs)[0]
    pool.run(_fit, "2bw", 3, str(tmp_path / "plain"), **kwargs)
    pool.run(_fit, "2bw", 3, str(tmp_path / "shard"), shard_optimizer=True, **kwargs)
    plain, shard = tmp_path / "plain" / "step=3.ckpt", tmp_path / "shard" / "step=3.ckpt"
    if state_dict_type == "full":
        a, b = (torch.load(p, weights_only=True) for p in (plain, shard))
        for key in ("state_dict", "optimizer_states", "pipe2bw", "lr_schedulers"):
            assert tensors_equal(a[key], b[key]), key
    resumed = pool.run(_fit, "2bw", 6, None, str(shard), shard_optimizer=True, **kwargs)[0]
    diff = max_abs_diff(resumed["state"], straight["state"])
    print(f"RESUME sharded optimizer state, {state_dict_type}: max|dW| = {diff:.3e}")
    assert diff <= TOL
    if state_dict_type == "sharded":
        pool.run(_resave, str(plain), str(tmp_path / "plain.ckpt"), 2, False)
        pool.run(_resave, str(shard), str(tmp_path / "off.ckpt"), 2, False)
        pools(2).run(_resave, str(shard), str(tmp_path / "one.ckpt"), 1, False)
        # 4 replicas of one stage, sharded: each parameter cut where d = 4 puts the cuts
        pool.run(_resave, str(shard), str(tmp_path / "four.ckpt"), 4, True)
        want = torch.load(tmp_path / "plain.ckpt", weights_only=True)
        for name in ("off.ckpt", "one.ckpt", "four.ckpt"):
            got = torch.load(tmp_path / name, weights_only=True)
            assert tensors_equal(got["state_dict"], want["state_dict"]), name
            # the consolidated file lists the state stage by stage: one stage holds the two's
            assert tensors_equal(_by_parameter(got), _by_parameter(want)), name


def _by_parameter(checkpoint: dict[str, Any]) -> list[Any]:
    """The optimizer state of a consolidated checkpoint, parameter by parameter in the model's
    order (its stages' entries one after the other)."""
    return [
        entries
        for optimizer in checkpoint["optimizer_states"]
        for stage in optimizer["pipe2bw_stages"]
        for _, entries in sorted(stage["state"].items())
    ]


def _fit_lbfgs() -> str:
    """A fit whose optimizer spans its parameters (L-BFGS) with ``shard_optimizer``: the error."""
    from helpers.models import RegressionModel

    class WithLBFGS(RegressionModel):
        def configure_optimizers(self) -> Any:
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    import torch.distributed as dist
    from helpers.models import loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    strategy = Pipe2BWStrategy(
        schedule="1f1b", microbatches=M, data_parallel=2, shard_optimizer=True
    )
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=2)
    try:
        trainer.fit(WithLBFGS(), loader(LOCAL, n=32))
    except TypeError as err:
        return str(err)
    return "no error"


def test_an_optimizer_whose_state_spans_its_parameters_is_refused(pools: Any) -> None:
    for message in pools(4).run(_fit_lbfgs):
        assert message.startswith("shard_optimizer=True: LBFGS does not update each parameter"), (
            message
        )
        assert "use shard_optimizer=False with it" in message
