"""FSDP2 inside a stage (``fsdp=True``): 2 replicas x 2 stages, every block sharded over its
stage's replicas with torch's ``fully_shard``, train the weights the same replicas train without
it (max|dW| at most 1e-6: FSDP adds the two replicas' gradients in a reduce-scatter, where the
strategy's average all-reduces them, so the sums may round apart in the last bit; the measured
differences are printed), and every rank holds about half of its stage's weights and optimizer
state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import workers
from helpers.models import max_abs_diff, tensors_equal

STEPS, M, LOCAL = 4, 2, 4  # two replicas' batches of 4 make a batch of 8
TOLERANCE = 1e-6


def _fit_both(schedule: str, **kwargs: Any) -> dict[str, Any]:
    """The same fit without and with ``fsdp`` on this rank (2 replicas x 2 stages)."""
    m = kwargs.pop("microbatches", M)

    def fit(**more: Any) -> dict[str, Any]:
        return workers.fit(schedule, m, STEPS, batch_size=LOCAL, data_parallel=2, **kwargs, **more)

    return {"plain": fit(), "fsdp": fit(fsdp=True)}


CASES = [
    ("1f1b", {}),
    ("gpipe", {}),
    ("zb-h1", {}),
    ("interleaved-1f1b", {}),
    ("zb-v", {}),
    ("dualpipe-v", {"microbatches": 4}),
    ("1f1b", {"trainer_kwargs": {"gradient_clip_val": 0.05}}),
    ("gpipe", {"trainer_kwargs": {"precision": "bf16-mixed"}}),
    ("1f1b", {"optimizer": "sgd", "recompute": True}),
    # the memory plan's levers move saved activations, never the weights FSDP gathers
    ("1f1b", {"memory_plan": {1: "swap", 2: "recompute", 3: "evict"}}),
    ("1f1b", {"balance_activations": True}),
    ("gpipe", {"val_batches": 2}),  # validation runs FSDP's gathers in forward only
]


def _label(case: tuple[str, dict[str, Any]]) -> str:
    schedule, kwargs = case
    parts = [schedule]
    for key, value in kwargs.items():
        if isinstance(value, dict):
            parts += [f"{k}={v}" for k, v in value.items()]
        else:
            parts.append(f"{key}={value}")
    return "-".join(parts)


@pytest.mark.parametrize(("schedule", "kwargs"), CASES, ids=[_label(c) for c in CASES])
def test_fsdp_trains_the_same_weights_with_half_of_each_stage(
    pools: Any, schedule: str, kwargs: dict[str, Any]
) -> None:
    results = pools(4).run(_fit_both, schedule, **kwargs)
    plain, sharded = results[0]["plain"]["state"], results[0]["fsdp"]["state"]
    diff = max_abs_diff(sharded, plain)
    weights = [r["fsdp"]["local_param_elements"] / r["plain"]["local_param_elements"] for r in results]
    states = [
        r["fsdp"]["local_opt_state_elements"] / r["plain"]["local_opt_state_elements"]
        for r in results
    ]
    print(
        f"FSDP {schedule} {kwargs}: max|dW| against the same replicas without it {diff:.3e}; "
        f"weights per rank {[f'{x:.2f}' for x in weights]}, optimizer state "
        f"{[f'{x:.2f}' for x in states]} of unsharded"
    )
    assert diff <= TOLERANCE
    assert all(r["fsdp"]["sharded_params"] > 0 for r in results)
    assert all(r["plain"]["sharded_params"] == 0 for r in results)
    # a shard is half a tensor's rows, rounded up: about half of every rank's stage
    assert all(0.4 <= x <= 0.65 for x in weights + states), (weights, states)


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_fsdp_checkpoints_as_without_it_and_resumes_exactly(
    pools: Any, tmp_path: Path, state_dict_type: str
) -> None:
    """2 replicas x 2 1F1B stages: the consolidated checkpoint written under FSDP is the file
    the same replicas write without it (weights, optimizer states, schedulers: equal to the
    bit); 3 steps + checkpoint + 3 equal 6 straight; and each run resumes from the other's
    checkpoint (FSDP's from the unsharded file, the unsharded from FSDP's)."""
    from ranks.test_checkpoint import TOL, _fit

    pool = pools(4)
    kwargs: dict[str, Any] = {"state_dict_type": state_dict_type, "data_parallel": 2}
    straight = pool.run(_fit, "1f1b", 6, **kwargs)[0]
    pool.run(_fit, "1f1b", 3, str(tmp_path / "plain"), **kwargs)
    pool.run(_fit, "1f1b", 3, str(tmp_path / "fsdp"), fsdp=True, **kwargs)
    plain, fsdp = tmp_path / "plain" / "step=3.ckpt", tmp_path / "fsdp" / "step=3.ckpt"
    if state_dict_type == "full":
        a, b = (torch.load(p, weights_only=True) for p in (plain, fsdp))
        for key in ("state_dict", "optimizer_states", "pipe2bw", "lr_schedulers"):
            assert tensors_equal(a[key], b[key]), key
    for resume, more in ((fsdp, {"fsdp": True}), (plain, {"fsdp": True}), (fsdp, {})):
        resumed = pool.run(_fit, "1f1b", 6, None, str(resume), **more, **kwargs)[0]
        diff = max_abs_diff(resumed["state"], straight["state"])
        print(f"RESUME fsdp {state_dict_type}: from {resume.parent.name} with {more}: {diff:.3e}")
        assert diff <= TOL


def _fit_refused(**strategy_kwargs: Any) -> str:
    """A fit with ``fsdp=True`` that set-up refuses: the error's text."""
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, make_optimizer, quiet_trainer
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_pipe2bw import Pipe2BWStrategy

    optimizer = strategy_kwargs.pop("optimizer", "adamw")
    plugins = [MixedPrecision("16-mixed", device="cpu")] if strategy_kwargs.pop("fp16", False) else []

    class Model(RegressionModel):
        def configure_optimizers(self) -> Any:
            opt, _ = make_optimizer(self.parameters(), optimizer)
            return opt

    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M, data_parallel=2, fsdp=True)
    trainer = quiet_trainer(
        devices=dist.get_world_size(), strategy=strategy, max_steps=1, plugins=plugins
    )
    try:
        trainer.fit(Model(), loader(LOCAL, n=16))
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"optimizer": "muon"}, "MuonAdamW orthogonalises each weight matrix whole"),
        ({"fp16": True}, "use precision='bf16-mixed'"),
    ],
    ids=["muon", "fp16-scaler"],
)
def test_what_fsdp_cannot_shard_is_refused_on_every_rank(
    pools: Any, kwargs: dict[str, Any], says: str
) -> None:
    for message in pools(4).run(_fit_refused, **kwargs):
        assert message.startswith("fsdp=True: "), message
        assert says in message, message


def _after_fit() -> dict[str, Any]:
    """A short FSDP fit; then what the module's state_dict says, and the whole model."""
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M, data_parallel=2, fsdp=True)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=2)
    model = RegressionModel()
    trainer.fit(model, loader(LOCAL, n=16))
    try:
        model.state_dict()
        said = "no error"
    except RuntimeError as err:
        said = str(err)
    whole = strategy.full_state_dict()
    return {"said": said, "keys": sorted(whole) if dist.get_rank() == 0 else None}


def test_after_fit_the_module_keeps_its_shards_and_says_how_to_save_the_whole(
    pools: Any,
) -> None:
    """The blocks stay sharded after fit (handing every block to every rank would undo the
    sharding): the module's state_dict raises with the ways to save the whole model, and
    ``full_state_dict`` gives every key of the unpartitioned model."""
    from helpers.models import RegressionModel

    results = pools(4).run(_after_fit)
    for result in results:
        assert "sharded over the stage's replicas (fsdp=True)" in result["said"], result["said"]
        assert "trainer.save_checkpoint(path)" in result["said"]
    assert results[0]["keys"] == sorted(RegressionModel().state_dict())


def _gathered_after_forward() -> list[bool]:
    """A short FSDP fit; for every forward of a block, whether its weights were still gathered
    right after it (FSDP's own hook has run by then: this one is registered after it)."""
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer
    from lightning.pytorch import Callback
    from torch.distributed.tensor import DTensor

    from lightning_pipe2bw import Pipe2BWStrategy

    seen: list[bool] = []

    def after_forward(block: Any, args: Any, output: Any) -> None:
        seen.append(any(not isinstance(p, DTensor) for p in block.parameters()))

    class Watch(Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            for block in module.body.children():
                if any(True for _ in block.parameters()):
                    block.register_forward_hook(after_forward)

    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M, data_parallel=2, fsdp=True)
    trainer = quiet_trainer(
        devices=dist.get_world_size(), strategy=strategy, max_steps=2, callbacks=[Watch()]
    )
    trainer.fit(RegressionModel(), loader(LOCAL, n=16))
    return seen


def test_a_block_gives_its_gathered_weights_back_after_each_forward(pools: Any) -> None:
    """Each block is its own FSDP root, and a root left to choose keeps its weights gathered
    from its forward to its backward: in a pipeline that is every block with a micro-batch in
    flight, so no weight was sharded at the stage's peak. Every forward now ends sharded."""
    for seen in pools(4).run(_gathered_after_forward):
        assert seen and not any(seen), seen


def _fit_hf_both(family: str) -> dict[str, Any]:
    """A Hugging Face model as it comes, 2 replicas x 2 stages, without and with FSDP (or the
    error with FSDP)."""
    import torch.distributed as dist
    from helpers import hf_models
    from helpers.models import quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy
    from ranks.test_real_models import STEPS as HF_STEPS

    def fit(**kwargs: Any) -> Any:
        torch.set_num_threads(1)
        module = hf_models.HFModule(family)
        strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M, data_parallel=2, **kwargs)
        trainer = quiet_trainer(
            devices=dist.get_world_size(), strategy=strategy, max_steps=HF_STEPS
        )
        trainer.fit(module, hf_models.loader(family, 2 * HF_STEPS))
        state = strategy.full_state_dict()  # collective
        return state if dist.get_rank() == 0 else None

    plain = fit()
    try:
        sharded = fit(fsdp=True)
    except ValueError as err:
        return {"plain": plain, "error": str(err)}
    return {"plain": plain, "fsdp": sharded}


@pytest.mark.parametrize("family", ["llama", "gpt2_untied"])
def test_a_hugging_face_model_trains_the_same_under_fsdp(pools: Any, family: str) -> None:
    results = pools(4).run(_fit_hf_both, family)
    assert "error" not in results[0], results[0].get("error")
    diff = max_abs_diff(results[0]["fsdp"], results[0]["plain"])
    print(f"FSDP {family}: max|dW| against the same replicas without it {diff:.3e}")
    assert diff <= TOLERANCE


def test_a_weight_tied_across_blocks_is_refused_with_the_tie_named(pools: Any) -> None:
    """GPT-2 ties its embedding to its head (the first and the last stage): FSDP shards each
    block's own parameters, so the run stops at set-up, on every rank, naming the tie."""
    for result in pools(4).run(_fit_hf_both, "gpt2"):
        message = result.get("error", "no error")
        assert message.startswith("fsdp=True: the body's blocks share parameters ("), message
        assert "wte.weight" in message and "untie them" in message, message


def _fit_with_a_block_without_parameters(fsdp: bool) -> Any:
    """The regression model with one block that has no parameters (a tanh), 2 x 2 stages."""
    import torch.distributed as dist
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    model = RegressionModel()
    model.body[2] = torch.nn.Tanh()  # on stage 0: FSDP leaves it as it is
    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M, data_parallel=2, fsdp=fsdp)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=STEPS)
    trainer.fit(model, loader(LOCAL, n=2 * LOCAL * STEPS))
    state = strategy.full_state_dict()
    return state if dist.get_rank() == 0 else None


def _both_with_a_block_without_parameters() -> dict[str, Any]:
    return {
        "plain": _fit_with_a_block_without_parameters(False),
        "fsdp": _fit_with_a_block_without_parameters(True),
    }


def test_a_block_without_parameters_is_left_unsharded(pools: Any) -> None:
    results = pools(4).run(_both_with_a_block_without_parameters)
    assert max_abs_diff(results[0]["fsdp"], results[0]["plain"]) <= TOLERANCE


class _Gained(torch.nn.Module):
    """A block whose gain is kept in float64 beside its float32 weight (mixed dtypes), or that
    holds a parameter its forward never uses."""

    def __init__(self, width: int, dtype: torch.dtype, unused: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.gain = torch.nn.Parameter(torch.ones(width, dtype=dtype))
        if unused:
            self.spare = torch.nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * self.gain.to(x.dtype)


def _fit_odd_block(change: str, fsdp: bool) -> Any:
    """The regression model with one block changed on stage 0 (``change``: ``frozen``, a frozen
    weight beside trainable ones; ``unused``, a parameter that gets no gradient, with the split
    check and without it, ``unused-unchecked``; ``mixed``, a float64 parameter beside float32
    ones), 2 x 2 stages; the full state on rank 0, or the error every rank stopped with and the
    steps taken."""
    import torch.distributed as dist
    from helpers.models import HIDDEN, RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    model = RegressionModel()
    if change == "frozen":
        model.body[2].requires_grad_(False)
        next(model.body[2].parameters()).requires_grad_(True)
    else:
        dtype = torch.float64 if change == "mixed" else torch.float32
        model.body[2] = _Gained(HIDDEN, dtype, unused=change.startswith("unused"))
    strategy = Pipe2BWStrategy(
        schedule="1f1b",
        microbatches=M,
        data_parallel=2,
        fsdp=fsdp,
        check_split=change != "unused-unchecked",
    )
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=STEPS)
    try:
        trainer.fit(model, loader(LOCAL, n=2 * LOCAL * STEPS))
    except Exception as err:  # every rank stops with it
        return {"error": f"{type(err).__name__}: {err}", "steps": trainer.global_step}
    state = strategy.full_state_dict()
    return state if dist.get_rank() == 0 else {}


def _odd_both(change: str) -> dict[str, Any]:
    return {"plain": _fit_odd_block(change, False), "fsdp": _fit_odd_block(change, True)}


@pytest.mark.parametrize("change", ["frozen", "unused-unchecked", "unused", "mixed"])
def test_a_block_fsdp_meets_oddly_trains_exactly_or_stops_before_a_step(
    pools: Any, change: str
) -> None:
    """What FSDP meets in a block either trains as the same replicas without FSDP, to the same
    tolerance, or stops every rank before the first update, naming the parameter and the way
    out: a frozen weight beside trainable ones and a parameter that gets no gradient (with the
    split check off) train; with the check on, the parameter without gradient stops both runs
    alike; parameters of two dtypes in one block stop the FSDP run at set-up."""
    results = pools(4).run(_odd_both, change)
    if change in ("frozen", "unused-unchecked"):
        diff = max_abs_diff(results[0]["fsdp"], results[0]["plain"])
        print(f"FSDP {change}: max|dW| against the same replicas without it {diff:.3e}")
        assert diff <= TOLERANCE
        return
    for r in results:
        stopped = r["fsdp"]
        assert "error" in stopped, stopped
        if change == "unused":  # the split's own check, at the first update, before it applies
            assert r["plain"].get("error") == stopped["error"]
            assert "got no gradient at the first update: ['body.2.spare']" in stopped["error"]
        else:
            assert stopped["steps"] == 0 and "error" not in r["plain"], r["plain"]
            assert "block 2 (_Gained) holds parameters of 2 dtypes: gain (float64)" in (
                stopped["error"]
            ), stopped
            assert "cast the block to one dtype" in stopped["error"]
