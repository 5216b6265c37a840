"""Small models, data and the single-device reference used by the multi-process tests."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

IN, HIDDEN, OUT = 6, 12, 3


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.fc(x))


def make_body(num_blocks: int = 8) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(IN, HIDDEN)]
    layers += [Block(HIDDEN) for _ in range(num_blocks - 2)]
    layers.append(nn.Linear(HIDDEN, OUT))
    return nn.Sequential(*layers)


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.3 * step)


def make_optimizer(params: Any, kind: str = "adamw") -> tuple[torch.optim.Optimizer, Any]:
    if kind == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)


class RegressionModel(LightningModule):
    """A module written for one device: forward runs the body, training_step computes the loss."""

    def __init__(self, num_blocks: int = 8, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.body = make_body(num_blocks)
        self.optimizer_kind = optimizer
        self.seen_val: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, _ = batch
        return self(x)

    def configure_optimizers(self) -> Any:
        opt, sched = make_optimizer(self.parameters(), self.optimizer_kind)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    y = torch.randn(n, OUT, generator=g)
    return TensorDataset(x, y)


def loader(batch_size: int = 8, n: int = 64) -> DataLoader[Any]:
    return DataLoader(dataset(n), batch_size=batch_size, shuffle=False)


def quiet_trainer(**kwargs: Any) -> Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    defaults.update(kwargs)
    return Trainer(**defaults)


def accumulate_gradient(model: nn.Module, x: Tensor, y: Tensor, microbatches: int) -> float:
    """Backward of the batch's mean loss as the pipeline computes it: micro-batch i's loss
    weighted by its share of the batch; returns the batch loss."""
    total = 0.0
    for xs, ys in zip(
        torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches), strict=True
    ):
        loss = nn.functional.mse_loss(model(xs), ys) * (xs.shape[0] / x.shape[0])
        loss.backward()
        total += float(loss)
    return total


def _clip(params: Any, clip: tuple[str, float] | None) -> None:
    if clip is None:
        return
    algorithm, value = clip
    if algorithm == "norm":
        torch.nn.utils.clip_grad_norm_(list(params), value)
    else:
        torch.nn.utils.clip_grad_value_(list(params), value)


def reference_train(
    steps: int,
    microbatches: int,
    batch_size: int = 8,
    num_blocks: int = 8,
    optimizer: str = "adamw",
    clip: tuple[str, float] | None = None,
    data: Iterable[Any] | None = None,
) -> tuple[dict[str, Tensor], list[float]]:
    """Single-device gradient accumulation over the same micro-batches: the exactness reference."""
    model = RegressionModel(num_blocks, optimizer)
    opt, sched = make_optimizer(model.parameters(), optimizer)
    losses = []
    for step, (x, y) in enumerate(loader(batch_size) if data is None else data):
        if step == steps:
            break
        opt.zero_grad()
        losses.append(accumulate_gradient(model, x, y, microbatches))
        _clip(model.parameters(), clip)
        opt.step()
        sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def max_abs_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def isclose(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


def reference_2bw(
    steps: int,
    microbatches: int,
    batch_size: int = 8,
    num_blocks: int = 8,
    optimizer: str = "adamw",
    clip: tuple[str, float] | None = None,
    data: Iterable[Any] | None = None,
) -> dict[str, Tensor]:
    """Single-process PipeDream-2BW: batch t's gradient is computed with weight version
    max(t - 1, 0) and applied by the optimizer to the newest weights, so
    W(t+1) = W(t) - step(grad f(W(t-1))), W(-1) = W(0). The scheduler steps once per update,
    so the update of batch t uses the learning rate of step t, as on one device."""
    model = RegressionModel(num_blocks, optimizer)
    shadow = RegressionModel(num_blocks, optimizer)  # evaluates gradients at old versions
    opt, sched = make_optimizer(model.parameters(), optimizer)
    history = {0: {k: v.detach().clone() for k, v in model.state_dict().items()}}
    for step, (x, y) in enumerate(loader(batch_size) if data is None else data):
        if step == steps:
            break
        shadow.load_state_dict(history[max(step - 1, 0)])
        shadow.zero_grad()
        accumulate_gradient(shadow, x, y, microbatches)
        for p, q in zip(model.parameters(), shadow.parameters(), strict=True):
            p.grad = q.grad.detach().clone() if q.grad is not None else None
        _clip(model.parameters(), clip)
        opt.step()
        sched.step()
        history[step + 1] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return history[min(steps, len(history) - 1)]


def reference_pipedream(
    steps: int, microbatches: int, balance: list[int], optimizer: str = "adamw", batch_size: int = 8
) -> dict[str, Tensor]:
    """Single-process PipeDream with weight stashing, stage by stage.

    Stage s (warm-up w = p - s - 1) runs micro-batch k's forward after the backward of
    micro-batch k - w - 1, so it has applied floor((k - w) / m) updates by then (none during
    warm-up): the forward and the backward of k on stage s use that version of the stage's
    weights. A stage applies batch t's update as soon as its own last backward of t is done,
    with the learning rate of step t; each stage has its own optimizer state."""
    p = len(balance)
    model = RegressionModel(optimizer=optimizer)
    blocks = list(model.body.children())
    bounds = [sum(balance[:s]) for s in range(p + 1)]
    stage_params = [
        [
            (f"body.{i}.{n}", q)
            for i in range(bounds[s], bounds[s + 1])
            for n, q in blocks[i].named_parameters()
        ]
        for s in range(p)
    ]
    opts = [make_optimizer([q for _, q in params], optimizer)[0] for params in stage_params]
    base_lr = opts[0].param_groups[0]["lr"]
    history = [[{n: q.detach().clone() for n, q in params}] for params in stage_params]
    m = microbatches
    for t, (x, y) in enumerate(loader(batch_size)):
        if t == steps:
            break
        acc: list[dict[str, Tensor]] = [{} for _ in range(p)]
        for j, (xs, ys) in enumerate(
            zip(torch.tensor_split(x, m), torch.tensor_split(y, m), strict=True)
        ):
            k = t * m + j
            weights: dict[str, Tensor] = {}
            for s in range(p):
                w = p - s - 1
                version = 0 if k < w else (k - w) // m
                for name, value in history[s][version].items():
                    weights[name] = value.clone().requires_grad_(True)
            out = torch.func.functional_call(model, weights, (xs,))
            loss = nn.functional.mse_loss(out, ys) * (xs.shape[0] / x.shape[0])
            loss.backward()
            for s in range(p):
                for name, _ in stage_params[s]:
                    g = weights[name].grad
                    acc[s][name] = acc[s].get(name, torch.zeros_like(g)) + g
        for s in range(p):
            for group in opts[s].param_groups:
                group["lr"] = base_lr * lr_lambda(t)
            for name, q in stage_params[s]:
                q.grad = acc[s][name]
            opts[s].step()
            history[s].append({n: q.detach().clone() for n, q in stage_params[s]})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
