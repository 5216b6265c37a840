"""Everyday Lightning idioms behave as on one device, second round (issue #31).

Each test runs a real 2-stage fit on the session's gloo pool and compares it with Lightning on one
device (the same LightningModule under a plain ``Trainer``) in this process: 1F1B must equal it;
2BW (``delay_correction="none"``) must equal the plain delayed rule, W(t+1) = W(t) - lr * grad
f(W(t-1)), written out below with the same module, where weights matter.

1. parameter groups built by indexing the body (``self.body[-1].parameters()``: a head's rate);
2. a ``training_step`` that returns a dict with more keys than the loss (``outputs["correct"]``
   in ``on_train_batch_end``);
3. Lightning's ``grad_norm`` logged in ``on_before_optimizer_step``: every parameter's key on
   every rank and the whole model's total, a tied parameter once;
4. ``StochasticWeightAveraging``: the average over the whole model, batch norm recomputed;
5. a string per sample in the batch, split with the tensors, and predictions of strings;
6. an unseeded ``WeightedRandomSampler`` draws alike on every stage; a sampler that cannot be
   seeded and draws differently is caught, naming the dataloader;
7. a training loader whose last batch is smaller than the micro-batches is refused before any
   step runs.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler
from unit.test_idioms2 import _data

from lightning_pipe2bw import Pipe2BWStrategy

TIMEOUT = 120
STEPS = 6  # 48 samples in batches of 8


class Captured(Logger):
    """Keeps every ``log_metrics`` call (on every rank: Lightning calls it on each)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "captured"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.setdefault(int(step or 0), {}).update({k: float(v) for k, v in metrics.items()})


class Plain(LightningModule):
    """A classifier whose head learns at 0.5 and the rest at 0.1: parameter groups built by
    indexing the body, as for an ``nn.Sequential``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(
            [
                {"params": self.body[:-1].parameters()},
                {"params": self.body[-1].parameters(), "lr": 0.5},
            ],
            lr=0.1,
        )


class Idioms(Plain):
    """``Plain``, with a step that returns a dict with a count and the predictions, and
    Lightning's gradient norms logged before every update."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[list[str], float, list[float]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        preds = logits.argmax(-1)
        return {"loss": loss, "correct": (preds == y).sum(), "preds": preds}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        correct = outputs["correct"]
        self.outputs.append((sorted(outputs), float(correct), outputs["preds"].tolist()))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log_dict(grad_norm(self, norm_type=2))


def _trainer(strategy: Any, devices: int, **kwargs: Any) -> Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return Trainer(**options)


def _state(module: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _pipe(schedule: str) -> Pipe2BWStrategy:
    return Pipe2BWStrategy(schedule=schedule, microbatches=2, delay_correction="none")


def _fit_idioms(strategy: Any, devices: int) -> dict[str, Any]:
    model, logger = Idioms(), Captured()
    _trainer(strategy, devices, logger=logger).fit(model, _data())
    rank = dist.get_rank() if devices > 1 else 0
    return {"rank": rank, "state": _state(model), "outputs": model.outputs, "logged": logger.rows}


def _on_rank_idioms(schedule: str) -> dict[str, Any]:
    return _fit_idioms(_pipe(schedule), dist.get_world_size())


def _grad_rows(rows: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    out = {step: {k: v for k, v in m.items() if k.startswith("grad_")} for step, m in rows.items()}
    return {step: m for step, m in out.items() if m}


def _delayed_reference(batches: Iterable[Any]) -> dict[str, Any]:
    """2BW's rule without correction, in one process: batch t's gradient at W(t-1) (W(-1) =
    W(0)) is applied to W(t) by the module's own optimizer. Per update: the gradient norms as
    ``grad_norm`` gives them, and what batch t's step returned (its count and predictions)."""
    model = Idioms()
    opt = model.configure_optimizers()
    history = [_state(model)]
    shadow = copy.deepcopy(model)
    norms, outputs = [], []
    for t, (x, y) in enumerate(batches):
        shadow.load_state_dict(history[max(t - 1, 0)])
        shadow.zero_grad()
        out = shadow.training_step((x, y), t)
        out["loss"].backward()
        outputs.append((float(out["correct"]), out["preds"].tolist()))
        for p, q in zip(model.parameters(), shadow.parameters(), strict=True):
            p.grad = q.grad.detach().clone()
        norms.append({k: float(v) for k, v in grad_norm(model, 2).items()})
        opt.step()
        history.append(_state(model))
    return {"state": history[-1], "norms": norms, "outputs": outputs}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


def _max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def one_device() -> dict[str, Any]:
    return _fit_idioms("auto", 1)


@pytest.fixture(scope="module", params=["1f1b", "2bw"])
def pipelined(request: pytest.FixtureRequest, pools: Any) -> tuple[str, list[dict[str, Any]]]:
    return request.param, pools(2).run(_on_rank_idioms, request.param, timeout=TIMEOUT)


# ------------------------------------------------------------------ 1. body indexing


def test_parameter_groups_by_indexing_the_body(
    pipelined: tuple[str, list[dict[str, Any]]], one_device: dict[str, Any]
) -> None:
    """``self.body[:-1].parameters()`` and ``self.body[-1].parameters()`` (a head rate of 0.5
    against 0.1): every stage builds the groups over its own parameters; the weights equal one
    device's (1F1B) or the delayed rule's with the same groups (2BW), on every rank."""
    schedule, results = pipelined
    want = one_device["state"] if schedule == "1f1b" else _delayed_reference(_data())["state"]
    for r in results:
        diff = _max_diff(r["state"], want)
        print(f"IDIOMS2 body indexing {schedule} rank {r['rank']}: max |dW| = {diff:.2e}")
        assert diff <= 1e-6, diff


# ------------------------------------------------------------------ 2. step dicts


def test_a_step_dict_reaches_on_train_batch_end(
    pipelined: tuple[str, list[dict[str, Any]]], one_device: dict[str, Any]
) -> None:
    """``outputs`` holds the step's keys on every rank. On the last stage (rank 0) each step's
    count is the batch's (summed over micro-batches) and the predictions are the batch's, as one
    device's (1F1B) or the delayed rule's at the weights batch t ran with (2BW). Under 2BW the
    other ranks get them one step late (NaN at the first step; every value at the epoch's last)."""
    schedule, results = pipelined
    keys = ["correct", "loss", "preds"]
    if schedule == "1f1b":
        want = [(c, p) for _, c, p in one_device["outputs"]]
    else:
        want = _delayed_reference(_data())["outputs"]
    assert len(want) == STEPS
    first, other = results
    for r in results:
        assert [k for k, _, _ in r["outputs"]] == [keys] * STEPS, r["outputs"]
    got = [(c, p) for _, c, p in first["outputs"]]
    print(
        f"IDIOMS2 step dict {schedule}: rank 0 counts {[c for c, _ in got]}, want {[c for c, _ in want]}"
    )
    assert got == want
    seen = [(c, p) for _, c, p in other["outputs"]]
    if schedule == "1f1b":
        assert seen == want
    else:
        assert math.isnan(seen[0][0]) and all(math.isnan(v) for v in seen[0][1])
        assert seen[1:-1] == want[:-2] and seen[-1] == want[-1]


# ------------------------------------------------------------------ 3. grad_norm


def test_grad_norm_covers_every_stage(
    pipelined: tuple[str, list[dict[str, Any]]], one_device: dict[str, Any]
) -> None:
    """``self.log_dict(grad_norm(self, 2))`` logs all 7 keys (6 parameters and the total) on
    every rank, with one device's values at every step (1F1B). Under 2BW the update of step t
    applies batch t-1's gradient, so step t logs the delayed rule's gradient t-1 (nothing at
    step 0; at the epoch's last step the drained last gradient): its first logged total is one
    device's first. Under 2BW the stages do not wait for each other at a step: the last stage
    (rank 0, the loggers) logs each step's merged values in that step, the other rank one step
    late, and at the epoch's last step every value owed."""
    schedule, results = pipelined
    reference = _grad_rows(one_device["logged"])
    assert len(reference) == STEPS
    keys = set(next(iter(reference.values())))
    assert len(keys) == 7
    if schedule == "1f1b":
        want = reference
    else:
        norms = _delayed_reference(_data())["norms"]
        steps = sorted(reference)
        want = {steps[t]: norms[t - 1] for t in range(1, STEPS - 1)}
        want[steps[-1]] = norms[-1]
        assert _close(norms[0]["grad_2.0_norm_total"], reference[steps[0]]["grad_2.0_norm_total"])
    for r in results:
        got = _grad_rows(r["logged"])
        expected = want
        if schedule == "2bw" and r["rank"] != 0:  # one step late; all of it at the last step
            steps = sorted(want)
            expected = {steps[i + 1]: want[steps[i]] for i in range(len(steps) - 2)}
            expected[steps[-1]] = want[steps[-1]]
        assert got.keys() == expected.keys(), (r["rank"], sorted(got), sorted(expected))
        for step, metrics in expected.items():
            assert set(got[step]) == keys, (step, sorted(got[step]))
            for key, value in metrics.items():
                assert _close(got[step][key], value), (schedule, r["rank"], step, key)
        step = min(expected)
        total = got[step]["grad_2.0_norm_total"]
        print(
            f"IDIOMS2 grad_norm {schedule} rank {r['rank']}: {len(got[step])} keys, total at "
            f"step {step} {total:.4f} (reference {expected[step]['grad_2.0_norm_total']:.4f})"
        )


def _fit_idioms_epochs(strategy: Any, devices: int) -> dict[str, Any]:
    model, logger = Idioms(), Captured()
    _trainer(strategy, devices, logger=logger, max_epochs=2).fit(model, _data())
    rank = dist.get_rank() if devices > 1 else 0
    return {"rank": rank, "logged": _grad_rows(logger.rows)}


def _pipe_2bw4() -> Pipe2BWStrategy:
    return Pipe2BWStrategy(schedule="2bw", microbatches=4, delay_correction="none")


def _on_rank_idioms_epochs() -> dict[str, Any]:
    return _fit_idioms_epochs(_pipe_2bw4(), dist.get_world_size())


def test_grad_norm_under_2bw_keeps_no_stage_waiting_over_four_stages(pools: Any) -> None:
    """Four stages, two epochs of 2BW: the stages post what they log in the gradient hooks to the
    last one without a barrier. The last stage (rank 0) logs every step what one 2BW stage
    logs; every other rank logs each value one step late, and at the last step of each epoch
    every value owed (the epoch's drained update last)."""
    # one 2BW stage, on a rank of its own: a fit of this strategy leaves its process group and
    # environment behind in the process that ran it, and later tests' references run here
    want = pools(1).run(_on_rank_idioms_epochs, timeout=TIMEOUT)[0]["logged"]
    assert len(want) == 2 * (STEPS - 1), sorted(want)  # nothing is due at an epoch's first step
    results = pools(4).run(_on_rank_idioms_epochs, timeout=TIMEOUT)
    late: dict[int, dict[str, float]] = {}
    for epoch in range(2):
        steps = sorted(s for s in want if epoch * STEPS <= s < (epoch + 1) * STEPS)
        late.update({steps[i + 1]: want[steps[i]] for i in range(len(steps) - 2)})
        late[steps[-1]] = want[steps[-1]]
    for r in results:
        expected = want if r["rank"] == 0 else late
        got = r["logged"]
        assert got.keys() == expected.keys(), (r["rank"], sorted(got), sorted(expected))
        for step, metrics in expected.items():
            assert got[step].keys() == metrics.keys(), (r["rank"], step)
            for key, value in metrics.items():
                assert _close(got[step][key], value), (r["rank"], step, key)
    print(f"IDIOMS2 grad_norm 2bw over 4 stages: {len(want)} steps logged, rank 0 as one stage")


def _fit_tied_norms(strategy: Any, devices: int) -> dict[int, dict[str, float]]:
    from helpers.models import TiedModel, loader

    class TiedNorms(TiedModel):
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.log_dict(grad_norm(self, norm_type=2))

    logger = Captured()
    _trainer(strategy, devices, logger=logger, max_steps=3).fit(TiedNorms(), loader())
    return _grad_rows(logger.rows)


def _on_rank_tied_norms() -> dict[int, dict[str, float]]:
    return _fit_tied_norms(_pipe("1f1b"), dist.get_world_size())


def test_grad_norm_counts_a_tied_parameter_once(pools: Any) -> None:
    """Blocks 1 and 6 share a weight; on two stages each holds a copy with the summed gradient.
    One device logs it once, under its first name (``body.1.weight``), and counts it once in
    the total: so do the stages."""
    want = _fit_tied_norms("auto", 1)
    assert len(want) == 3 and not any("body.6.weight" in k for m in want.values() for k in m)
    for rank, got in enumerate(pools(2).run(_on_rank_tied_norms, timeout=TIMEOUT)):
        assert got.keys() == want.keys()
        for step, metrics in want.items():
            assert set(got[step]) == set(metrics), sorted(set(got[step]) ^ set(metrics))
            for key, value in metrics.items():
                assert _close(got[step][key], value), (rank, step, key, got[step][key], value)
        total = got[min(got)]["grad_2.0_norm_total"]
        print(f"IDIOMS2 tied grad_norm rank {rank}: {len(got[min(got)])} keys, total {total:.5f}")


# ------------------------------------------------------------------ 5. strings per sample


class NamedSamples(torch.utils.data.Dataset[tuple[Tensor, Tensor, Tensor, str]]):
    """32 samples with an id and a file name each: ``default_collate`` gives a batch
    ``(x, ids, y, names)`` with ``names`` a list of 8 strings."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(2)
        self.x, self.y = torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor, str]:
        return self.x[i], torch.tensor(i), self.y[i], f"img_{i:03d}.png"


class Named(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        self.seen: list[tuple[int, list[str], list[str]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, ids, y, names = batch
        self.seen.append((len(x), list(names), [f"img_{int(i):03d}.png" for i in ids]))
        return nn.functional.cross_entropy(self.body(x), y)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        x, _, _, names = batch
        return {"names": names, "pred": self.body(x).argmax(-1)}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_named(strategy: Any, devices: int, predict_strategy: Any) -> dict[str, Any]:
    model = Named()
    loader = DataLoader(NamedSamples(), batch_size=8)
    _trainer(strategy, devices).fit(model, loader)
    predictions = _trainer(predict_strategy, devices).predict(model, loader)
    assert predictions is not None
    return {
        "seen": model.seen,
        "state": _state(model),
        "names": [n for p in predictions for n in p["names"]],  # type: ignore[index]
        "preds": torch.cat([p["pred"] for p in predictions]).tolist(),  # type: ignore[index]
    }


def _on_rank_named(schedule: str) -> dict[str, Any]:
    return _fit_named(_pipe(schedule), dist.get_world_size(), _pipe(schedule))


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_a_string_per_sample_is_split_with_the_tensors(pools: Any, schedule: str) -> None:
    """Each micro-batch's step sees its own 4 names beside its 4 samples (the names of exactly
    those samples: what the step appends to a list, merged over the micro-batches, is one
    device's), and ``trainer.predict`` returns the 32 names and predictions one device returns,
    in order. The weights equal one device's (1F1B)."""
    want = _fit_named("auto", 1, "auto")
    assert [n for n, _, _ in want["seen"]] == [8] * 4 and len(want["names"]) == 32
    for rank, got in enumerate(pools(2).run(_on_rank_named, schedule, timeout=TIMEOUT)):
        # the step runs once per micro-batch; the list it appends to gets the batch's item, as
        # one device's (the micro-batches' items merged: counts summed, names concatenated)
        assert got["seen"] == want["seen"]
        assert got["names"] == want["names"]
        if schedule == "1f1b":
            assert got["preds"] == want["preds"]
            diff = _max_diff(got["state"], want["state"])
            assert diff <= 1e-6, diff
        print(
            f"IDIOMS2 strings {schedule} rank {rank}: {len(got['names'])} names, {got['names'][:2]}"
        )


# ------------------------------------------------------------------ 6. samplers


def _weighted_loader(generator: torch.Generator | None) -> DataLoader[Any]:
    data = _data().dataset
    weights = torch.linspace(0.2, 1.0, 48)
    sampler = torch.utils.data.WeightedRandomSampler(weights, 48, generator=generator)
    return DataLoader(data, batch_size=8, sampler=sampler)


class _RanksDiverge:
    """Every rank's global RNG differs (as once dropout has run on some stages only), and no
    ``PL_GLOBAL_SEED`` makes set-up reseed it alike."""

    def __enter__(self) -> int:
        self.saved = os.environ.pop("PL_GLOBAL_SEED", None)
        torch.manual_seed(100 + dist.get_rank())
        return 0  # the seed the strategy seeds samplers with, without PL_GLOBAL_SEED

    def __exit__(self, *exc: Any) -> None:
        if self.saved is not None:
            os.environ["PL_GLOBAL_SEED"] = self.saved


def _on_rank_weighted(schedule: str) -> dict[str, Any]:
    model = Plain()
    with _RanksDiverge():
        _trainer(_pipe(schedule), 2, max_epochs=2).fit(model, _weighted_loader(None))
    return {"state": _state(model), "rank": dist.get_rank()}


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_an_unseeded_weighted_sampler_draws_alike_on_every_stage(pools: Any, schedule: str) -> None:
    """An unseeded ``WeightedRandomSampler`` would draw from each rank's global RNG; the
    strategy gives it a generator seeded with the run's seed, so both stages train on the same
    samples: two epochs give one device's weights with that generator (1F1B), or the delayed
    rule's on the same batches (2BW)."""
    if schedule == "1f1b":
        model = Plain()
        _trainer("auto", 1, max_epochs=2).fit(
            model, _weighted_loader(torch.Generator().manual_seed(0))
        )
        want = _state(model)
    else:
        loader = _weighted_loader(torch.Generator().manual_seed(0))
        want = _delayed_reference([*loader, *loader])["state"]
    for r in pools(2).run(_on_rank_weighted, schedule, timeout=TIMEOUT):
        diff = _max_diff(r["state"], want)
        print(f"IDIOMS2 weighted sampler {schedule} rank {r['rank']}: max |dW| = {diff:.2e}")
        assert diff <= 1e-6, diff


class GlobalShuffle(Sampler[int]):
    """A sampler of one's own that shuffles with the global RNG and has no generator to seed."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n).tolist())


def _on_rank_shuffled(schedule: str) -> None:
    model, loader = Plain(), DataLoader(_data().dataset, batch_size=8, sampler=GlobalShuffle(48))
    with _RanksDiverge():
        _trainer(_pipe(schedule), 2).fit(model, loader)


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_stages_that_read_different_samples_are_stopped(pools: Any, schedule: str) -> None:
    """A sampler that cannot be seeded draws differently on each rank: the first stage finds its
    batch differs from the last stage's (their fingerprints travel with the step's values) and
    raises, naming the dataloader, its sampler and the fix; the last stage stops with it."""
    with pytest.raises(Exception) as info:
        pools(2).run(_on_rank_shuffled, schedule, timeout=TIMEOUT)
    message = str(info.value)
    print(f"IDIOMS2 different samples {schedule}: {message.splitlines()[0][:300]}")
    assert "ValueError: the ranks read different samples" in message
    assert "training dataloader (a DataLoader over TensorDataset with GlobalShuffle)" in message
    assert "generator=torch.Generator().manual_seed(seed)" in message
    assert "rank 1 (stage 0) failed" in message  # the last stage's rank names the cause


# ------------------------------------------------------------------ 7. a short last batch


SHORT = [
    ("1f1b", 41, 8, "ends with a batch of 1 samples (41 samples in batches of 8)"),
    ("2bw", 41, 8, "ends with a batch of 1 samples (41 samples in batches of 8)"),
    ("1f1b", 8, 1, "has batch_size=1, fewer samples than microbatches=2"),
]


def _on_rank_short_last() -> list[str]:
    """Each case's error on this rank (no rank waits for another before it: the pool is kept)."""
    errors = []
    for schedule, n, batch_size, _ in SHORT:
        model = Idioms()  # its on_train_batch_end records every step
        try:
            _trainer(_pipe(schedule), 2).fit(model, _data(n, batch_size))
        except ValueError as err:
            errors.append(str(err))
        assert model.outputs == [], "a training step ran before the error"
    return errors


def test_a_short_last_batch_is_refused_before_any_step(pools: Any) -> None:
    """With ``drop_last=False`` the loader's length and batch size tell that its last batch
    cannot be split into the micro-batches: every rank refuses it before the first step, with
    the same error (one device would train on it; the pipeline cannot split it), under 1F1B and
    2BW; a batch size below the micro-batches likewise."""
    for rank, errors in enumerate(pools(2).run(_on_rank_short_last, timeout=TIMEOUT)):
        assert len(errors) == len(SHORT), errors
        for message, (schedule, _, batch_size, text) in zip(errors, SHORT, strict=True):
            assert message.startswith("the training dataloader (a DataLoader over TensorDataset")
            assert text in message, message
            if batch_size > 1:
                assert "Pass drop_last=True to the DataLoader" in message
            print(f"IDIOMS2 short last batch {schedule} rank {rank}: {message[:200]}")


# ------------------------------------------------------------------ 4. weight averaging


class PlainNorm(Plain):
    """``Plain`` with batch norm in the first stage's blocks (SWA then adds an epoch that
    recomputes its statistics with the averaged weights)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 3)
        )


def _swa(swa_lrs: float | list[float]) -> Any:
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    return StochasticWeightAveraging(swa_lrs=swa_lrs, swa_epoch_start=2, annealing_epochs=2)


def _fit_swa(
    strategy: Any, devices: int, norm: bool, swa_lrs: Any, folder: str, batch_size: int = 8,
    accumulate: int = 1,
) -> dict[str, Any]:  # fmt: skip
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = PlainNorm() if norm else Plain()
    # a checkpoint drains 2BW's pipeline: without one, only the strategy's own drain at the end
    # of every epoch makes the weights at the next epoch's start the delayed rule's
    checkpoints = [ModelCheckpoint(dirpath=folder)] if folder else []
    trainer = _trainer(
        strategy, devices, max_epochs=3, enable_checkpointing=bool(folder),
        callbacks=[_swa(swa_lrs), *checkpoints], accumulate_grad_batches=accumulate,
    )  # fmt: skip
    trainer.fit(model, _data(48, batch_size))
    path = trainer.checkpoint_callback.best_model_path if folder else ""  # type: ignore[union-attr]
    saved = torch.load(path, weights_only=False) if path and os.path.exists(path) else {}
    averaged = next(
        (
            v["average_model_state"]
            for k, v in saved.get("callbacks", {}).items()
            if "Stochastic" in k
        ),
        None,
    )
    return {"state": _state(model), "averaged": averaged, "file": os.path.basename(path)}


def _on_rank_swa(schedule: str, norm: bool, swa_lrs: Any, folder: str) -> dict[str, Any]:
    folder = os.path.join(folder, str(dist.get_rank())) if folder else ""
    out = _fit_swa(_pipe(schedule), 2, norm, swa_lrs, folder)
    return {**out, "rank": dist.get_rank()}


def _delayed_average(epochs: int = 3, start: int = 1) -> dict[str, Tensor]:
    """SWA over the delayed rule at constant learning rates: the mean of the weights at the start
    of epochs ``start`` .. ``epochs - 1`` (the callback averages at each epoch's start)."""
    loader = _data()
    per_epoch = len(loader)
    states = []
    for e in range(start, epochs):
        batches = [b for _ in range(e) for b in loader]
        states.append(_delayed_reference(batches)["state"] if batches else _state(Plain()))
    return {k: sum(s[k] for s in states) / len(states) for k in states[0]} if per_epoch else {}


@pytest.mark.parametrize(("schedule", "norm"), [("1f1b", False), ("2bw", False), ("1f1b", True)])
def test_weight_averaging_covers_the_whole_model(
    pools: Any, tmp_path: Any, schedule: str, norm: bool
) -> None:
    """``StochasticWeightAveraging`` from epoch 2 of 3: every stage averages its own parameters,
    and after fit every rank's module is the whole averaged model: one device's (1F1B, the
    learning rates annealed to 0.05; with batch norm also its recomputed statistics, one device
    accumulating the same micro-batches), or the average of the delayed rule's weights at the
    epochs' starts (2BW, the rates held). The checkpoint holds the whole average, as one
    device's does."""
    swa_lrs: Any = 0.05 if schedule == "1f1b" else [0.1, 0.5]  # 2BW: the groups' own rates
    if schedule == "1f1b":
        size, accumulate = (4, 2) if norm else (8, 1)
        want = _fit_swa("auto", 1, norm, swa_lrs, str(tmp_path / "one"), size, accumulate)
        wanted_average = want["averaged"]
        want_state = want["state"]
    else:
        want_state = _delayed_average()
        wanted_average = None
    folder = str(tmp_path) if schedule == "1f1b" else ""  # 2BW: no checkpoint drains it
    for r in pools(2).run(_on_rank_swa, schedule, norm, swa_lrs, folder, timeout=TIMEOUT):
        diff = _max_diff(r["state"], want_state)
        print(f"IDIOMS2 SWA {schedule} norm={norm} rank {r['rank']}: max |dW| = {diff:.2e}")
        assert diff <= 1e-6, diff
        if r["rank"] == 0 and wanted_average is not None:
            assert r["averaged"] is not None, r["file"]
            average_diff = _max_diff(r["averaged"], wanted_average)
            print(
                f"IDIOMS2 SWA checkpoint {r['file']}: averaged model max |d| = {average_diff:.2e}"
            )
            assert average_diff <= 1e-6
