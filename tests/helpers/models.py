"""Small models, data and the single-device reference used by the multi-process tests."""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Iterable
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


def default_balance(body: nn.Module, schedule: str, ranks: int) -> tuple[int, ...]:
    """The blocks per stage that ``balance`` left out gives a plain body under ``schedule`` on
    ``ranks`` ranks: its blocks' multiplied parameters evened out per rank
    (``partition.cost``, ``partition.balance``)."""
    from lightning_pipe2bw.partition.balance import balance_by_weights
    from lightning_pipe2bw.partition.cost import multiplied_parameters
    from lightning_pipe2bw.schedule import placement_of, schedule_spec

    weights = multiplied_parameters(list(body.children()))
    stages = ranks * schedule_spec(schedule).stages_per_rank
    return balance_by_weights(weights, stages, placement_of(schedule, ranks))


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.3 * step)


def make_optimizer(params: Any, kind: str = "adamw") -> tuple[torch.optim.Optimizer, Any]:
    """``"adamw"``, ``"sgd"`` (with momentum), ``"muon"`` (:class:`MuonAdamW`: Muon on every
    2-D tensor, AdamW on the rest) or ``"muon-lr"`` (the same with ``adamw_lr`` of its own),
    with a LambdaLR schedule."""
    if kind == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    elif kind == "muon":
        from lightning_pipe2bw import MuonAdamW

        params = list(params)
        groups = [
            {"params": [p for p in params if p.ndim == 2], "muon": True},
            {"params": [p for p in params if p.ndim != 2], "muon": False},
        ]
        opt = MuonAdamW([g for g in groups if g["params"]], lr=0.05, weight_decay=0.1)
    elif kind == "muon-lr":  # MuonAdamW with its AdamW part at a learning rate of its own
        from lightning_pipe2bw import MuonAdamW

        params = list(params)
        groups = [
            {"params": [p for p in params if p.ndim == 2], "muon": True},
            {"params": [p for p in params if p.ndim != 2], "muon": False},
        ]
        opt = MuonAdamW(
            [g for g in groups if g["params"]], lr=0.05, adamw_lr=0.01, weight_decay=0.1
        )
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


class BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock`` (torchvision does not import here): two 3x3
    convolutions with batch norm, the residual added in place, one ``ReLU(inplace=True)``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class InPlaceShift(nn.Module):
    """Adds a learned per-channel shift to its input in place (``x += residual`` style): not
    idempotent, so running it again on its own output would give another result."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.linspace(-0.5, 0.5, channels))

    def forward(self, x: Tensor) -> Tensor:
        x += self.shift.view(1, -1, 1, 1)
        return x


CHANNELS, SIDE = 4, 6


def make_conv_body() -> nn.Sequential:
    """A small ResNet-style body whose blocks act in place: block 2 is ``ReLU(inplace=True)``
    (the first block of stage 1 with ``balance=[2, 6]``) and block 5 adds to its input in place
    (the first of stage 1 with ``balance=[5, 3]``; it follows a convolution, which does not
    save its output); batch norm in blocks 1, 3 and 6."""
    c = CHANNELS
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1, bias=False),
        nn.BatchNorm2d(c),
        nn.ReLU(inplace=True),
        BasicBlock(c),
        nn.Conv2d(c, c, 1),
        InPlaceShift(c),
        BasicBlock(c),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, OUT)),
    )


class ConvModel(RegressionModel):
    """``RegressionModel`` with the ResNet-style body (images of 3 x SIDE x SIDE in)."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__(optimizer=optimizer)
        torch.manual_seed(1234)
        self.body = make_conv_body()


def conv_loader(batch_size: int = 8, n: int = 64, seed: int = 0) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, SIDE, SIDE, generator=g)
    y = torch.randn(n, OUT, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class TiedModel(RegressionModel):
    """Blocks 1 and 6 share one weight (an embedding/head tie in miniature): on two stages,
    each holds a copy."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__(optimizer=optimizer)
        torch.manual_seed(7)
        self.body = nn.Sequential(
            nn.Linear(IN, HIDDEN),
            nn.Linear(HIDDEN, HIDDEN, bias=False),
            *[Block(HIDDEN) for _ in range(4)],
            nn.Linear(HIDDEN, HIDDEN, bias=False),
            nn.Linear(HIDDEN, OUT),
        )
        self.body[6].weight = self.body[1].weight


class CompiledModel(RegressionModel):
    """The MLP with each residual block compiled by the user (``torch.compile``, an
    ``OptimizedModule`` in the body). The ``aot_eager`` backend: AOTAutograd's compiled forward
    and backward (one autograd node per block, which computes every gradient of the block at
    once), without generating kernels, which takes tens of seconds a block on a CPU here."""

    def __init__(self, optimizer: str = "adamw", num_blocks: int = 8) -> None:
        super().__init__(num_blocks, optimizer)
        for i, block in enumerate(self.body):
            if isinstance(block, Block):
                self.body[i] = torch.compile(block, backend="aot_eager")


def compiled_in_place(model: RegressionModel) -> RegressionModel:
    """``model`` with every block of its body compiled in place (``nn.Module.compile``, the
    ``aot_eager`` backend), as ``Pipe2BWStrategy(compile_blocks=...)`` compiles a stage's."""
    for block in model.body:
        block.compile(backend="aot_eager")
    return model


def make_model(name: str, optimizer: str = "adamw", num_blocks: int = 8) -> RegressionModel:
    """A test model by name: ``"regression"`` (the MLP), ``"conv"`` (:class:`ConvModel`),
    ``"tied"`` (:class:`TiedModel`), ``"compiled"`` (:class:`CompiledModel`) or
    ``"compiled-in-place"`` (the MLP, :func:`compiled_in_place`)."""
    if name == "compiled-in-place":
        return compiled_in_place(RegressionModel(num_blocks, optimizer))
    if name == "conv":
        return ConvModel(optimizer)
    if name == "tied":
        return TiedModel(optimizer)
    if name == "compiled":
        return CompiledModel(optimizer, num_blocks)
    return RegressionModel(num_blocks, optimizer)


def make_loader(name: str, batch_size: int = 8, n: int = 64) -> DataLoader[Any]:
    """The data of the test model ``name``."""
    return conv_loader(batch_size, n) if name == "conv" else loader(batch_size, n)


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
    model_name: str = "regression",
    device: str | torch.device = "cpu",
) -> tuple[dict[str, Tensor], list[float]]:
    """Single-device gradient accumulation over the same micro-batches: the exactness reference.
    Batch norm normalises each micro-batch with its own statistics and updates its running
    statistics once per micro-batch, as a pipeline stage does. Trains on ``device``; the state
    comes back on the CPU."""
    model = make_model(model_name, optimizer, num_blocks).to(device)
    opt, sched = make_optimizer(model.parameters(), optimizer)
    losses = []
    data = make_loader(model_name, batch_size) if data is None else data
    for step, (x, y) in enumerate(data):
        if step == steps:
            break
        opt.zero_grad()
        losses.append(accumulate_gradient(model, x.to(device), y.to(device), microbatches))
        _clip(model.parameters(), clip)
        opt.step()
        sched.step()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, losses


def max_abs_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def tensors_equal(a: Any, b: Any) -> bool:
    """``a`` and ``b`` hold the same structure, with equal tensors, bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


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
    model_name: str = "regression",
    device: str | torch.device = "cpu",
    correction: str = "auto",
    start: dict[str, Tensor] | None = None,
    sync_steps: int = 0,
) -> dict[str, Tensor]:
    """Single-process PipeDream-2BW: batch t's gradient is computed with weight version
    max(t - 1, 0) and applied by the optimizer to the newest weights, so
    W(t+1) = W(t) - step(grad f(W(t-1))), W(-1) = W(0). The scheduler steps once per update,
    so the update of batch t uses the learning rate of step t, as on one device. Buffers (batch
    norm's running statistics) are not versioned: every forward updates the live ones. Trains
    on ``device``; the state comes back on the CPU.

    ``correction`` (``docs/pipedream-2bw.md``), written here from the rules, not from the
    library's code:

    - ``"predict"``: batch t is evaluated at E(t) = W(t-1) - U(m(t-1); S(t-1)), the update the
      optimizer applies to W(t-1) (batch t-1's, with its learning rate) were batch t-1's gradient
      its first moment m (``exp_avg`` or ``momentum_buffer``); E(t) = W(t-1) without moments.
    - ``"error_feedback"``: the optimizer steps with g_t + k (g_t - g_{t-1}) (k: the
      correction's strength; g as clipped, before the correction; none for the first update).
    - ``"nesterov"``: after the optimizer's own update u_t the weights move by
      -b (u_t - u_{t-1}) (b: the correction's momentum; none for the first update).
    - ``"update_feedback"`` (arXiv 2606.30634's rule as reported): W(t+1) = W(t) - 2 u_t + u_{t-1},
      u_t the optimizer's whole step (none for the first update).

    A spec may join them with ``+`` and give coefficients (``"predict+error_feedback=0.5"``);
    ``"auto"`` is the library's default for 2bw.

    ``start``: the weights to start from (a fit after an earlier one starts the rule afresh
    from the weights it holds: W(-1) = W(0), a new optimizer, no correction history).

    ``sync_steps`` (K, a synchronous start): batches t < K are evaluated at W(t) and their
    updates are plain, W(t+1) = W(t) - U(grad f_t(W(t))); from batch K on the rule above holds
    (batch K at W(K-1)), the correction's history starting empty at update K.
    """
    previous: dict[Any, Tensor] = {}  # g_{t-1} and u_{t-1}, by parameter
    model = make_model(model_name, optimizer, num_blocks).to(device)
    if start is not None:
        model.load_state_dict(start)
    # evaluates old weight versions
    shadow = make_model(model_name, optimizer, num_blocks).to(device)
    opt, sched = make_optimizer(model.parameters(), optimizer)
    history = {0: {k: v.detach().clone() for k, v in model.state_dict().items()}}
    points = {0: history[0]}  # where each batch is evaluated (corrections that predict)
    data = make_loader(model_name, batch_size) if data is None else data
    for step, (x, y) in enumerate(data):
        if step == steps:
            break
        synchronous = step < sync_steps
        if synchronous:
            shadow.load_state_dict(history[step])
        elif "predict" in correction_terms(correction):
            # batch step + 1's point: this update applied with the moments as the gradient
            points[step + 1] = predicted(
                model, opt, lambda params: make_optimizer(params, optimizer)[0]
            )
            shadow.load_state_dict(points[step])
        else:
            shadow.load_state_dict(history[max(step - 1, 0)])
        with torch.no_grad():
            for live, old in zip(model.buffers(), shadow.buffers(), strict=True):
                old.copy_(live)
        shadow.zero_grad()
        accumulate_gradient(shadow, x.to(device), y.to(device), microbatches)
        with torch.no_grad():
            for live, old in zip(model.buffers(), shadow.buffers(), strict=True):
                live.copy_(old)
        for p, q in zip(model.parameters(), shadow.parameters(), strict=True):
            p.grad = q.grad.detach().clone() if q.grad is not None else None
        _clip(model.parameters(), clip)
        if synchronous:
            if step + 1 == sync_steps and "predict" in correction_terms(correction):
                # batch K's point, from W(K-1) and the state before update K-1
                points[step + 1] = predicted(
                    model, opt, lambda params: make_optimizer(params, optimizer)[0]
                )
            opt.step()
        else:
            corrected_step(opt, list(model.parameters()), correction, previous)
        sched.step()
        history[step + 1] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {k: v.cpu() for k, v in history[min(steps, len(history) - 1)].items()}


def reference_2bw_fresh(
    steps: int,
    microbatches: int,
    fresh: Callable[[str], bool],
    batch_size: int = 8,
    optimizer: str = "adamw",
    clip: tuple[str, float] | None = None,
    data: Iterable[Any] | None = None,
    correction: str = "auto",
    sync_steps: int = 0,
) -> dict[str, Tensor]:
    """Single-process 2BW with a fresh last stage (``fresh_last_stage``): the parameters named
    ``fresh`` (the last stage's) compute batch t at W(t) and take its update in step t,
    uncorrected; the others follow :func:`reference_2bw`'s rule (batch t at W(t-1), or its
    prediction; update in step t+1, corrected), and every parameter follows it during a
    synchronous start (``sync_steps``). Written from the rule, step by step as Lightning
    counts them, because clipping by the global norm pairs what one step applies: step t clips
    the delayed parameters' gradient of batch t-1 together with the fresh ones' of batch t, and
    the drain after the last batch (one epoch: ``data`` must not flush in between) applies the
    delayed parameters' gradient of batch T-1 alone. Each update uses its own batch's learning
    rate."""
    model = make_model("regression", optimizer)
    shadow = make_model("regression", optimizer)  # evaluates the points
    opt, sched = make_optimizer(model.parameters(), optimizer)
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    late = [params[n] for n in names if not fresh(n)]
    now = [params[n] for n in names if fresh(n)]
    assert late and now, "both stages need parameters"
    predicts = "predict" in correction_terms(correction)
    previous: dict[Any, Tensor] = {}  # the correction's g_{t-1} and u_{t-1}

    def snapshot() -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def apply(group: list[Tensor], grads: list[Tensor | None], lrs: list[float], corr: str) -> None:
        others = [p for p in params.values() if all(p is not q for q in group)]
        for p in others:
            p.grad = None
        for p, g in zip(group, grads, strict=True):
            p.grad = g
        now_lrs = [g["lr"] for g in opt.param_groups]
        for g, lr in zip(opt.param_groups, lrs, strict=True):
            g["lr"] = lr
        if corr == "none":
            opt.step()
        else:
            corrected_step(opt, group, corr, previous)
        for g, lr in zip(opt.param_groups, now_lrs, strict=True):
            g["lr"] = lr

    data = make_loader("regression", batch_size) if data is None else data
    point = snapshot()  # where the delayed parameters evaluate the next batch
    pending: tuple[list[Tensor | None], list[float]] | None = None  # batch t-1's, delayed
    batches = list(itertools.islice(data, steps))
    for step, (x, y) in enumerate(batches):
        synchronous = step < sync_steps
        current = snapshot()
        shadow.load_state_dict(
            {k: current[k] if fresh(k) or synchronous else point[k] for k in current}
        )
        shadow.zero_grad()
        accumulate_gradient(shadow, x, y, microbatches)
        grads = {n: (q.grad.detach().clone() if q.grad is not None else None)
                 for n, q in shadow.named_parameters()}  # fmt: skip
        lrs = [g["lr"] for g in opt.param_groups]
        # this step's gradients, clipped together
        if synchronous:  # every stage applies batch t, as a flush schedule does
            applied_late: list[Tensor | None] | None = [grads[n] for n in names if not fresh(n)]
        else:  # the delayed stages apply batch t-1's (none in the first delayed step)
            applied_late = pending[0] if pending is not None else None
        fresh_grads = [grads[n] for n in names if fresh(n)]
        for p in params.values():
            p.grad = None
        if applied_late is not None:
            for p, g in zip(late, applied_late, strict=True):
                p.grad = g
        for p, g in zip(now, fresh_grads, strict=True):
            p.grad = g
        _clip(params.values(), clip)
        clipped_late = [p.grad for p in late]
        clipped_fresh = [p.grad for p in now]
        if synchronous:
            # batch K runs at W(K-1) (or its prediction, from the state before update K-1)
            point = current
            if step + 1 == sync_steps and predicts:
                point = predicted(model, opt, lambda ps: make_optimizer(ps, optimizer)[0])
            apply(late, clipped_late, lrs, "none")
        elif pending is not None:
            apply(late, clipped_late, pending[1], correction)
        apply(now, clipped_fresh, lrs, "none")
        if not synchronous:
            pending = ([grads[n] for n in names if not fresh(n)], lrs)
            if predicts:
                # batch t+1's point: from W(t) and the state before update t, at batch t's rate
                saved = [g["lr"] for g in opt.param_groups]
                for g, lr in zip(opt.param_groups, lrs, strict=True):
                    g["lr"] = lr
                point = predicted(model, opt, lambda ps: make_optimizer(ps, optimizer)[0])
                for g, lr in zip(opt.param_groups, saved, strict=True):
                    g["lr"] = lr
            else:
                point = snapshot()
        sched.step()
    if pending is not None:  # the drain: batch T-1's update of the delayed parameters, alone
        for p in params.values():
            p.grad = None
        for p, g in zip(late, pending[0], strict=True):
            p.grad = g
        _clip(params.values(), clip)
        apply(late, [p.grad for p in late], pending[1], correction)
    return {k: v.cpu() for k, v in snapshot().items()}


def corrected_step(
    opt: torch.optim.Optimizer,
    params: list[Tensor],
    correction: str,
    previous: dict[Any, Tensor],
) -> None:
    """``opt.step()`` with the gradient and update corrections of ``correction`` (a spec such
    as ``"predict+error_feedback=0.5"``; ``previous`` keeps each parameter's g_{t-1} and
    u_{t-1}, updated here): ``error_feedback`` steps with g + k (g - g_prev), ``nesterov``
    moves on by -b (u - u_prev) after the optimizer's own update u, ``update_feedback`` by
    -(u - u_prev)."""
    terms = correction_terms(correction)
    with_grad = [p for p in params if p.grad is not None]
    strength = terms.get("error_feedback")
    if strength is not None:
        raw = {p: p.grad.detach().clone() for p in with_grad}  # type: ignore[union-attr]
        for p in with_grad:
            if ("g", p) in previous:
                p.grad = raw[p].add(raw[p] - previous[("g", p)], alpha=strength)
        previous.update({("g", p): g for p, g in raw.items()})
    before = {p: p.detach().clone() for p in with_grad}
    opt.step()
    if "update_feedback" in terms:
        with torch.no_grad():
            for p in with_grad:
                u = before[p] - p  # the optimizer's own update, applied once already
                if ("u", p) in previous:  # W - 2u + u_prev, grouped as (W - u) - (u - u_prev)
                    p.sub_(u - previous[("u", p)])
                previous[("u", p)] = u
    momentum = terms.get("nesterov")
    if momentum is not None:
        with torch.no_grad():
            for p in with_grad:
                update = before[p] - p
                if ("u", p) in previous:
                    p.sub_(update - previous[("u", p)], alpha=momentum)
                previous[("u", p)] = update


def correction_terms(spec: str) -> dict[str, float | None]:
    """A correction spec's terms with each coefficient (the class's default when not given)."""
    from lightning_pipe2bw.optim.delay import (
        DEFAULT_CORRECTION,
        ErrorFeedback,
        NesterovLookahead,
        parse_correction,
    )

    defaults = {"error_feedback": ErrorFeedback.strength, "nesterov": NesterovLookahead.momentum}
    spec = DEFAULT_CORRECTION if spec == "auto" else spec
    return {name: c if c is not None else defaults.get(name) for name, c in parse_correction(spec)}


def predicted(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    build: Callable[[Iterable[Tensor]], torch.optim.Optimizer],
) -> dict[str, Tensor]:
    """The weights the optimizer's next step gives with each parameter's first moment as its
    gradient, computed on copies (the model and the optimizer are left as they are; ``build``
    makes an optimizer like ``opt`` over other parameters)."""
    twin = copy.deepcopy(model)
    twin_opt = build(twin.parameters())
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for live, copied in zip(model.parameters(), twin.parameters(), strict=True):
        state = opt.state.get(live, {})
        moment = next((state[k] for k in ("exp_avg", "momentum_buffer") if k in state), None)
        copied.grad = None if moment is None else moment.detach().clone()
    twin_opt.step()
    return {k: v.detach().clone() for k, v in twin.state_dict().items()}


def reference_pipedream(
    steps: int,
    microbatches: int,
    balance: list[int],
    optimizer: str = "adamw",
    batch_size: int = 8,
    correction: str = "none",
    model_name: str = "regression",
    data: Iterable[Any] | None = None,
) -> dict[str, Tensor]:
    """Single-process PipeDream with weight stashing, stage by stage (on ``data``, batches of
    (x, y), or the test loader's batches of ``batch_size``).

    Stage s (warm-up w = p - s - 1) runs micro-batch k's forward after the backward of
    micro-batch k - w - 1, so it has applied floor((k - w) / m) updates by then (none during
    warm-up): the forward and the backward of k on stage s use that version of the stage's
    weights. A stage applies batch t's update as soon as its own last backward of t is done,
    with the learning rate of step t; each stage has its own optimizer state (and its own
    gradient ``correction``, as :func:`corrected_step`)."""
    p = len(balance)
    model = make_model(model_name, optimizer)
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
    previous: dict[Any, Tensor] = {}  # a gradient correction's g_{t-1} and u_{t-1}
    m = microbatches
    for t, (x, y) in enumerate(loader(batch_size) if data is None else data):
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
            corrected_step(opts[s], [q for _, q in stage_params[s]], correction, previous)
            history[s].append({n: q.detach().clone() for n, q in stage_params[s]})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
