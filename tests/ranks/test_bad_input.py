"""Bad input gets a clear ValueError/TypeError that names the value and the fix, on every rank,
before any rank can block in a collective or a receive.

Errors from a constructor or pure function: ``tests/unit/test_bad_input.py``. Errors that arise
in ``trainer.fit`` are checked on real ranks of the session's gloo pool: ``_on_rank_fit`` catches
the exception on each rank and returns its type and message, so the test sees every rank's error
and the pool stays usable (a task that fails in the pool tears it down, which costs a restart).
Errors in the user's step are checked on a 1-rank pool, where the one stage is both first and
last: on several ranks they are raised on one stage only (see the module notes in the report).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.models import (
    HIDDEN,
    IN,
    OUT,
    RegressionModel,
    isclose,
    loader,
    make_body,
    max_abs_diff,
    quiet_trainer,
    reference_train,
)
from helpers.workers import RecordLoss
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_pipe2bw import Pipe2BWStrategy

TIMEOUT = 60  # seconds; a rank that hangs fails the test instead of stalling the session


# ----------------------------------------------------------------------------- models


class SmallBase(LightningModule):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class OneBlock(SmallBase):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, OUT))

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)  # type: ignore[no-any-return]


class ListLayers(SmallBase):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class TwoBodies(SmallBase):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, HIDDEN))
        self.decoder = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, OUT))

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.encoder(x))  # type: ignore[no-any-return]


class StrayHead(RegressionModel):
    """A layer with parameters next to the body, used in training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(OUT, OUT)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self(x)), y)


class StrayParameter(RegressionModel):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(()))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x) / self.temperature, y)


class NestedBody(RegressionModel):
    """RegressionModel's weights, but the body lives at ``trunk.layers``."""

    def __init__(self) -> None:
        super().__init__()
        del self.body
        torch.manual_seed(1234)  # as RegressionModel does: the same initial weights
        self.trunk = nn.Module()
        self.trunk.layers = make_body()

    def forward(self, x: Tensor) -> Tensor:
        return self.trunk.layers(x)  # type: ignore[no-any-return]


class HookBody(RegressionModel):
    """RegressionModel's weights, with the body named by ``pipeline_body()``."""

    def __init__(self) -> None:
        super().__init__()
        del self.body
        torch.manual_seed(1234)
        self.layers = make_body()

    def pipeline_body(self) -> nn.Sequential:
        return self.layers

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)  # type: ignore[no-any-return]


class ManualOptimization(RegressionModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        opt = self.optimizers()
        loss = nn.functional.mse_loss(self(x), y)
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        return loss


class SkipsBody(RegressionModel):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        _, y = batch
        return (y**2).mean()


class CallsBodyTwice(RegressionModel):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y) + nn.functional.mse_loss(self(x), y)


class ReturnsNone(RegressionModel):
    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        x, y = batch
        self.log("train_loss", nn.functional.mse_loss(self(x), y))


class ListInsideBody(SmallBase):
    """A ModuleList as a block of the body: the body would call it, and it has no forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.ModuleList([nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)]))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.body[0]:
            x = layer(x)
        return x


class NamedListBody(ListLayers):
    def pipeline_body(self) -> nn.Module:
        return self.layers


class _Nothing(nn.Module):
    def forward(self, x: Tensor) -> None:
        return None


class BlockReturnsNone(RegressionModel):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, HIDDEN), _Nothing(), nn.Linear(HIDDEN, OUT))


MODELS: dict[str, Callable[[], LightningModule]] = {
    "regression": RegressionModel,
    "one_block": OneBlock,
    "list_layers": ListLayers,
    "two_bodies": TwoBodies,
    "stray_head": StrayHead,
    "stray_parameter": StrayParameter,
    "nested_body": NestedBody,
    "hook_body": HookBody,
    "manual_optimization": ManualOptimization,
    "skips_body": SkipsBody,
    "calls_body_twice": CallsBodyTwice,
    "returns_none": ReturnsNone,
    "list_inside_body": ListInsideBody,
    "named_list_body": NamedListBody,
    "block_returns_none": BlockReturnsNone,
}


# ----------------------------------------------------------------------------- rank function


def _on_rank_fit(
    model: str,
    strategy_kwargs: dict[str, Any],
    trainer_kwargs: dict[str, Any] | None = None,
    batch_size: int = 8,
    n: int = 64,
    steps: int = 2,
) -> dict[str, Any]:
    """Fit on every rank; return the error each rank raised, or the trained weights."""
    module = MODELS[model]()
    # a flush schedule, so that runs can be compared with single-device training
    strategy = Pipe2BWStrategy(**{"schedule": "1f1b", **strategy_kwargs})
    record = RecordLoss()
    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=strategy,
        max_steps=steps,
        max_epochs=1,
        callbacks=[record],
        **(trainer_kwargs or {}),
    )
    try:
        trainer.fit(module, loader(batch_size, n))
    except Exception as err:
        return {"error": type(err).__name__, "message": str(err), "steps": trainer.global_step}
    state = strategy.full_state_dict()
    return {
        "error": None,
        "state": state if dist.get_rank() == 0 else None,
        "losses": record.losses,
        "steps": trainer.global_step,
    }


def fit_error(pool: Any, model: str, strategy_kwargs: dict[str, Any], **kwargs: Any) -> str:
    """Run ``_on_rank_fit`` and check that every rank raised the same error; return its
    ``"Type: message"`` (the message of the last rank)."""
    results = pool.run(_on_rank_fit, model, strategy_kwargs, timeout=TIMEOUT, **kwargs)
    errors = [(r["error"], r["message"]) for r in results if r["error"] is not None]
    assert len(errors) == len(results), (
        f"only {len(errors)} of {len(results)} ranks raised: {results}"
    )
    assert len({e for e, _ in errors}) == 1, errors
    kind, message = errors[-1]
    return f"{kind}: {message}"


def fit_ok(pool: Any, model: str, strategy_kwargs: dict[str, Any], **kwargs: Any) -> list[Any]:
    results = pool.run(_on_rank_fit, model, strategy_kwargs, timeout=TIMEOUT, **kwargs)
    for r in results:
        assert r["error"] is None, r
    return results  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- constructor checks


# ----------------------------------------------------------------------------- set-up errors (2 ranks)


def test_more_stages_than_blocks(pools: Any) -> None:
    message = fit_error(pools(2), "one_block", {})
    assert message.startswith("ValueError: the body has 1 blocks but the pipeline has 2 stages")
    assert "use at most 1 devices/stages or split the body into more blocks" in message


@pytest.mark.parametrize("balance", [[3, 3], [4, 5]])
def test_balance_not_summing_to_block_count(pools: Any, balance: list[int]) -> None:
    message = fit_error(pools(2), "regression", {"balance": balance})
    assert message.startswith("ValueError: invalid balance: ")
    assert f"module has 8 blocks but balance sums to {sum(balance)} (balance={balance})" in message


def test_balance_entries_not_dividing_device_count(pools: Any) -> None:
    message = fit_error(pools(2), "regression", {"balance": [2, 3, 3]})
    assert message == (
        "ValueError: balance=[2, 3, 3] describes 3 stages but 2 devices with data_parallel=1 "
        "make pipelines of 2 stages; use a device count divisible by 3"
    )


def test_balance_fewer_stages_than_devices(pools: Any) -> None:
    message = fit_error(pools(2), "regression", {"balance": [8]})
    assert message.startswith(
        "ValueError: balance=[8] describes 1 stages but 2 devices with data_parallel=1 make "
        "pipelines of 2 stages"
    )
    assert "use data_parallel=2 (2 pipelines of 1 stages) or devices=1" in message


def test_accumulate_grad_batches(pools: Any) -> None:
    message = fit_error(pools(2), "regression", {}, trainer_kwargs={"accumulate_grad_batches": 2})
    assert message.startswith(
        "ValueError: Trainer(accumulate_grad_batches=2) is not supported by pipe2bw"
    )
    assert "Use a 2x larger batch (and more micro-batches) instead" in message


def test_manual_optimization(pools: Any) -> None:
    message = fit_error(pools(2), "manual_optimization", {})
    assert message.startswith("ValueError: pipe2bw drives forward and backward itself")
    assert "remove `self.automatic_optimization = False`" in message


def test_layers_in_module_list_without_hook(pools: Any) -> None:
    message = fit_error(pools(2), "list_layers", {})
    assert message.startswith(
        "TypeError: ListLayers has no nn.Sequential attribute to split into pipeline stages"
    )
    assert "pipeline_body(self) -> nn.Sequential" in message
    assert "Pipe2BWStrategy(body='<attribute name>')" in message
    assert "Its layers are in the nn.ModuleList 'layers': when a model's forward loops" in message
    assert "PipeModel(model, blocks=" in message


def test_two_sequential_attributes(pools: Any) -> None:
    message = fit_error(pools(2), "two_bodies", {})
    assert message.startswith(
        "ValueError: TwoBodies has several nn.Sequential attributes with parameters: "
        "['encoder', 'decoder']"
    )
    assert "Pipe2BWStrategy(body=...)" in message
    assert "pipeline_body()" in message


def test_body_name_that_is_not_an_attribute(pools: Any) -> None:
    message = fit_error(pools(2), "regression", {"body": "bdy"})
    assert message.startswith(
        "ValueError: body path 'bdy': RegressionModel has no attribute 'bdy'; pass the name of the nn.Sequential attribute"
    )


@pytest.mark.parametrize(
    ("model", "names"),
    [("stray_head", "['head.weight', 'head.bias']"), ("stray_parameter", "['temperature']")],
)
def test_parameters_outside_the_body(pools: Any, model: str, names: str) -> None:
    message = fit_error(pools(2), model, {})
    assert message.startswith(f"ValueError: parameters outside the pipeline body 'body': {names}")
    assert "move these layers into the body" in message


# ----------------------------------------------------------------------------- naming the body


@pytest.mark.parametrize(
    ("model", "strategy_kwargs", "prefix"),
    [
        ("nested_body", {"body": "trunk.layers"}, "trunk.layers."),
        ("hook_body", {}, "layers."),
    ],
    ids=["body_name", "pipeline_body_hook"],
)
def test_named_body_trains_like_one_device(
    pools: Any, model: str, strategy_kwargs: dict[str, Any], prefix: str
) -> None:
    rank0, rank1 = fit_ok(pools(2), model, strategy_kwargs, steps=2)
    assert rank0["steps"] == rank1["steps"] == 2
    state = {"body." + k.removeprefix(prefix): v for k, v in rank0["state"].items()}
    assert all(k.startswith(prefix) for k in rank0["state"])
    ref_state, ref_losses = reference_train(2, microbatches=2)
    assert max_abs_diff(state, ref_state) < 1e-5
    for got, want in zip(rank0["losses"], ref_losses, strict=True):
        assert isclose(got, want), (rank0["losses"], ref_losses)
    assert rank0["losses"] == rank1["losses"]


# ----------------------------------------------------------------------------- uneven batches


@pytest.mark.parametrize(("schedule", "microbatches"), [("1f1b", 2), ("gpipe", 3)])
def test_batch_not_divisible_by_microbatches(pools: Any, schedule: str, microbatches: int) -> None:
    """Batches of 7 in 2 (4+3) or 3 (3+2+2) micro-batches: the same weights as one device that
    weights each micro-batch's mean loss by its share of the batch."""
    steps = 3
    rank0, _ = fit_ok(
        pools(2),
        "regression",
        {"schedule": schedule, "microbatches": microbatches},
        batch_size=7,
        steps=steps,
    )
    ref_state, ref_losses = reference_train(steps, microbatches, batch_size=7)
    assert max_abs_diff(rank0["state"], ref_state) < 1e-5
    assert len(rank0["losses"]) == steps
    for got, want in zip(rank0["losses"], ref_losses, strict=True):
        assert isclose(got, want), (rank0["losses"], ref_losses)


def test_batch_smaller_than_microbatches(pools: Any) -> None:
    """64 samples in batches of 3 end with a batch of 1, which 2 micro-batches cannot split;
    the loader's length and batch size tell it, so every rank stops with the same error before
    the first batch (not after the 21 full batches trained)."""
    results = pools(2).run(
        _on_rank_fit, "regression", {"microbatches": 2}, batch_size=3, steps=-1, timeout=TIMEOUT
    )
    for r in results:
        assert r["error"] == "ValueError"
        assert r["message"].startswith(
            "the training dataloader (a DataLoader over TensorDataset with SequentialSampler) ends "
            "with a batch of 1 samples (64 samples in batches of 3), fewer than microbatches=2"
        ), r["message"]
        assert "Pass drop_last=True to the DataLoader" in r["message"]
        assert r["steps"] == 0


# ----------------------------------------------------------------------------- the user's step (1 rank)
# On one rank the stage is both first and last, so these errors are raised on every rank. With
# several stages each is raised on one stage only and the others wait in a receive.


def test_training_step_does_not_call_body(pools: Any) -> None:
    message = fit_error(pools(1), "skips_body", {})
    assert message.startswith(
        "RuntimeError: the step of micro-batch 0 returned without calling the pipeline body"
    )
    assert "exactly once" in message


def test_training_step_calls_body_twice(pools: Any) -> None:
    message = fit_error(pools(1), "calls_body_twice", {})
    assert message.startswith("RuntimeError: the pipeline body was called twice in one step")
    assert "call self.body(x) / self(x) exactly once in each step" in message


def test_training_step_returns_none(pools: Any) -> None:
    message = fit_error(pools(1), "returns_none", {})
    assert message.startswith("TypeError: with pipe2bw, training_step must return the loss tensor")
    assert "micro-batch 0 returned NoneType" in message


class _TiedModel(RegressionModel):
    """First and last block share one weight (an embedding/head tie in miniature)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(IN, IN, bias=False),
            *[torch.nn.Linear(IN, IN) for _ in range(2)],
            torch.nn.Linear(IN, IN, bias=False),
        )
        self.body[3].weight = self.body[0].weight

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch[0]).pow(2).mean()


def _on_rank_fit_tied(**options: Any) -> str:
    from lightning_pipe2bw import Pipe2BWStrategy as Strategy

    trainer = quiet_trainer(devices=2, strategy=Strategy(**options), max_steps=1)
    try:
        trainer.fit(_TiedModel(), loader(8))
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_parameter_tied_across_stages_is_refused_by_pipedream(pools: Any) -> None:
    """Weight stashing updates each stage on its own: the copies of a tie would drift apart
    (2bw, 1f1b and gpipe keep them equal: tests/ranks/test_real_models.py)."""
    for message in pools(2).run(_on_rank_fit_tied, schedule="pipedream", timeout=TIMEOUT):
        assert message.startswith(
            "parameters shared between blocks on different stages (0.weight = 3.weight) need "
            "every copy updated at the same step; schedule='pipedream'"
        ), message


def test_a_parameter_tied_with_a_fresh_last_stage_is_refused(pools: Any) -> None:
    """``fresh_last_stage`` updates the last stage one batch ahead of the others: a copy of a
    tie there would take another batch's gradient than the rest."""
    options = {"schedule": "2bw", "fresh_last_stage": True}
    for message in pools(2).run(_on_rank_fit_tied, **options, timeout=TIMEOUT):
        assert message.startswith(
            "parameters shared between the last stage and another (0.weight = 3.weight) need "
            "every copy updated with the same batch's gradient; fresh_last_stage=True"
        ), message


def test_a_module_list_as_a_block_is_refused_before_anything_runs(pools: Any) -> None:
    message = fit_error(pools(2), "list_inside_body", {})
    assert message.startswith(
        "TypeError: blocks of the pipeline body have no forward: body.0 (ModuleList)"
    )
    assert "nn.Sequential(*layers)" in message


def test_a_module_list_named_as_the_body_says_how_to_make_it_one(pools: Any) -> None:
    message = fit_error(pools(2), "named_list_body", {})
    assert message.startswith(
        "TypeError: the pipeline body 'layers' must be an nn.Sequential of blocks, got ModuleList"
    )
    assert "nn.Sequential(*layers) holds the same layers under the same names" in message
    assert "describe it with a `pipeline_body()` method returning PipeModel(model" in message


def test_a_block_that_returns_none_is_named(pools: Any) -> None:
    message = fit_error(pools(1), "block_returns_none", {})
    assert message.startswith(
        "TypeError: block 1 (_Nothing) of the pipeline body returned None; every block must "
        "return the next block's input"
    )


def _fit_one_device(devices: int | None) -> dict[str, Any]:
    """Runs on the pool's one rank: a fit with devices=1 or devices left out, and what it
    warned."""
    import warnings

    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    kwargs: dict[str, Any] = {} if devices is None else {"devices": devices}
    trainer = quiet_trainer(strategy=Pipe2BWStrategy(schedule="2bw"), max_steps=2, **kwargs)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(RegressionModel(), loader(8))
    return {"steps": trainer.global_step, "warned": [str(w.message) for w in seen]}


@pytest.mark.parametrize("devices", [1, None])
def test_one_device_says_there_is_no_pipeline(pools: Any, devices: int | None) -> None:
    """devices=1, or devices left out (one device: a CPU machine's, or one launched process):
    one stage, no pipeline. It trains (a run of one stage is a valid reference), and says so,
    naming devices."""
    (result,) = pools(1).run(_fit_one_device, devices)
    assert result["steps"] == 2
    notes = [w for w in result["warned"] if "one pipeline stage, so there is no pipeline" in w]
    assert len(notes) == 1, result["warned"]
    assert "1 process" in notes[0] and "Trainer(devices=N)" in notes[0] and "'2bw'" in notes[0]


def _fit_one_process(schedule: str, steps: int, m: int) -> dict[str, Any]:
    """Runs on the pool's one rank: a flushed schedule's fit with devices=1, its weights."""
    from helpers.models import RegressionModel, loader, quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    model = RegressionModel()
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=m)
    quiet_trainer(strategy=strategy, devices=1, max_steps=steps).fit(model, loader(8))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v", "dualpipe-v"])
def test_a_schedule_of_two_stages_per_rank_trains_on_one_process(pools: Any, schedule: str) -> None:
    """Both stages of the V (or the interleaving) on the one rank: nothing is sent, and the
    weights are one device's gradient accumulation, as on p ranks (it failed at the first
    batch: the early-input-gradient pass took the list for one without its messages)."""
    steps, m = 3, 2
    (state,) = pools(1).run(_fit_one_process, schedule, steps, m)
    reference, _ = reference_train(steps, m)
    assert max_abs_diff(state, reference) <= 1e-6
