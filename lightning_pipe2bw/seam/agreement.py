"""Decisions every stage must take alike: the gradient norm to clip by, and skipping a step; and
the set-up every rank checks it shares with the others."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import lightning
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_pipe2bw.compat import found_inf_state, override_clipping
from lightning_pipe2bw.pipeline.options import PipeOptions
from lightning_pipe2bw.pipeline.stage_runtime import StageRuntime
from lightning_pipe2bw.runtime.twobw import TwoBWDriver
from lightning_pipe2bw.runtime.versions import TwoBWOptimizer
from lightning_pipe2bw.seam.hooklogs import logs_in_gradient_hooks

__all__ = ["agree_across_stages", "check_same_setup", "setup_settings"]


def _grads(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _params_with_grad(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _squares(
    params: Iterable[torch.Tensor],
    grad_of: Callable[[torch.Tensor], torch.Tensor | None],
    counted: Callable[[torch.Tensor], bool],
    device: torch.device,
) -> torch.Tensor:
    """The sum of the squared gradients of the ``counted`` params, in float64, in their order.
    A gradient FSDP shards over the stage's replicas (``fsdp=True``) adds its shards' squares,
    summed over the replicas (collective over them: they clip at the same point)."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    shards, group = torch.zeros((), dtype=torch.float64, device=device), None
    for p in params:
        grad = grad_of(p)
        if grad is None or not counted(p):
            continue
        if isinstance(grad, DTensor):
            shards += grad.to_local().detach().double().pow(2).sum()
            group = grad.device_mesh.get_group()
        else:
            squares += grad.detach().double().pow(2).sum()
    if group is not None:
        dist.all_reduce(shards, group=group)
        squares += shards
    return squares


class NormsAhead:
    """2BW's clipping norms, summed over the stages without a meeting at the step.

    Clipping by norm needs every stage's gradient of the batch an update applies. Summed at the
    step (one all-reduce there), it makes every stage wait for the slowest at every step, which
    a flush schedule does anyway and 2BW exists not to. But under 2BW a batch's gradient is
    complete on a stage long before the step that applies it (on the last stage a whole call
    before, on the first early in the call): :meth:`post` sums its squares there and starts the
    all-reduce without waiting, and the step only takes the result (:meth:`take`), by then in.

    Every stage posts every batch in batch order, in a ``group`` of their own (nothing else can
    come between two of them in another order on another rank). The squares are summed as
    :func:`make_clipping_global` sums them at the step, over the optimizer's parameters in its
    order (``params()``), so the norm is the same to the bit. It holds only where the gradient
    at the step is the one the pipeline computed: one pipeline (no replicas to average over),
    no parameter shared across stages, no loss scaler, no hook that may change a gradient
    (:func:`posts_norms_ahead` decides).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        params: Callable[[], list[torch.Tensor]],
        stage_params: Sequence[torch.Tensor],
    ) -> None:
        self.group = group
        self.device = device
        self.params = params
        self.stage_params = stage_params  # the order of the gradients :meth:`post` gets
        self._posted: dict[int, tuple[Any, torch.Tensor]] = {}

    def post(self, batch: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Batch ``batch``'s gradient is complete on this stage: start summing its squares
        over the stages."""
        by_param = {id(p): g for p, g in zip(self.stage_params, grads, strict=True)}
        squares = _squares(self.params(), lambda p: by_param.get(id(p)), _every, self.device)
        work = dist.all_reduce(squares, group=self.group, async_op=True)
        self._posted[batch] = (work, squares)

    def take(self, batch: int) -> torch.Tensor:
        """The squares of batch ``batch``'s gradient summed over every stage."""
        if batch not in self._posted:
            raise RuntimeError(
                f"2BW's clipping norm of batch {batch} was not posted ahead (posted: "
                f"{sorted(self._posted)}): the pipeline applied an update it did not complete"
            )
        work, squares = self._posted.pop(batch)
        work.wait()
        return squares


def _every(_: torch.Tensor) -> bool:
    return True


def make_clipping_global(
    plugin: Precision,
    device: torch.device,
    group: dist.ProcessGroup | None,
    num_stages: int,
    counted: Callable[[torch.Tensor], bool] = lambda p: True,
    ahead: NormsAhead | None = None,
) -> None:
    """Make ``plugin``'s gradient clipping behave as on one device.

    By norm: the norm is taken over every stage's gradient (squared norms summed with one
    all-reduce, in float64) and the coefficient is ``torch.nn.utils.clip_grad_norm_``'s,
    ``max_norm / (norm + 1e-6)`` capped at 1. Every rank clips at the same point of Lightning's
    loop, so the all-reduce lines up. A parameter whose copies live on several stages (a tie)
    counts once: ``counted(param)`` is False for the other copies. With ``ahead`` (2BW, see
    :class:`NormsAhead`) the sum was started when the batch's gradient was complete, and the
    step takes it; an update with nothing due (the first of a segment) has nothing to clip on
    any stage. By value: element-wise, so stage-local; it tolerates a stage without gradients
    (2BW's first step).
    """

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: int | float) -> None:
        params = _params_with_grad(optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        if ahead is not None:
            due = optimizer.due if isinstance(optimizer, TwoBWOptimizer) else None
            if due is None:
                return  # nothing due on any stage
            squares = ahead.take(due)
        else:
            squares = _squares(params, lambda p: p.grad, counted, device)
            if num_stages > 1:
                dist.all_reduce(squares, group=group)
        coef = min(1.0, float(clip_val) / (float(squares.sqrt()) + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.detach().mul_(coef)

    def clip_grad_by_value(optimizer: Optimizer, clip_val: int | float) -> None:
        params = _params_with_grad(optimizer)
        if params:
            torch.nn.utils.clip_grad_value_(params, clip_val)

    override_clipping(plugin, clip_grad_by_norm, clip_grad_by_value)


def agree_on_inf_checks(
    scaler: torch.amp.GradScaler,
    device: torch.device,
    group: dist.ProcessGroup | None,
    num_stages: int,
) -> None:
    """Make the loss scaler's inf/NaN check global.

    Only the last stage scales a loss, but every stage unscales the scaled gradients it holds,
    so every stage's scaler starts with the same scale. After a stage unscales, the stages take
    the max of their found-inf flags: a step skipped for inf/NaN is skipped on every stage, and
    every stage's scale then moves alike.
    """
    unscale = scaler.unscale_
    scaler.scale(torch.zeros(1, device=device))  # initialises the scale on every stage

    def agreed_unscale(optimizer: Optimizer) -> None:
        unscale(optimizer)
        state = found_inf_state(scaler, optimizer)
        found = state["found_inf_per_device"]
        flag = sum((f.to(device) for f in found.values()), torch.zeros(1, device=device))
        if num_stages > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        # one entry decides the scaler's step (a stage without gradients still needs one)
        state["found_inf_per_device"] = {device: flag.clamp(max=1.0)}

    scaler.unscale_ = agreed_unscale  # type: ignore[method-assign]


def check_same_setup(settings: dict[str, object]) -> None:
    """Raise the same ``ValueError`` on every rank if the ranks' ``settings`` differ
    (collective). Run at set-up, it turns a mismatch that would deadlock the pipeline later (a
    different schedule, micro-batch count or stage split, another package version) into an
    error that lists every difference."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    everyone: list[dict[str, object]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, settings)
    problems = []
    for key in everyone[0]:
        values = [s.get(key) for s in everyone]
        if any(v != values[0] for v in values):
            listed = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            problems.append(f"{key} ({listed})")
    if problems:
        raise ValueError(
            "the ranks of this pipeline were set up differently: "
            + "; ".join(problems)
            + ". Every rank must run the same script with the same options and package versions"
        )


def agree_across_stages(
    plugin: Precision, runtime: StageRuntime, device: torch.device, trainer: Trainer
) -> None:
    """Make ``plugin``'s clipping and (mixed precision) inf checks span ``runtime``'s pipeline,
    counting each of its tied parameters once (collective where 2BW posts its clipping norms
    ahead: every rank makes their group)."""
    group = runtime.groups.pipeline  # clipping and inf checks span one pipeline
    num_stages = runtime.topology.num_stages

    def counted(param: torch.Tensor) -> bool:  # the current runtime's ties (moves rebuild them)
        return runtime.tied is None or runtime.tied.counted(param)

    ahead = None
    driver = runtime.driver
    if (
        posts_norms_ahead(plugin, runtime, trainer)
        and isinstance(driver, TwoBWDriver)
        and _optimizes_stage_only(driver)
    ):
        optimizer = driver.optimizer
        ahead = NormsAhead(
            runtime.groups.norms(),
            device,
            lambda: [p for g in optimizer.param_groups for p in g["params"]],
            driver.versions.params,
        )
        driver.on_complete.append(ahead.post)
    make_clipping_global(plugin, device, group, num_stages, counted, ahead)
    scaler = plugin.scaler if isinstance(plugin, MixedPrecision) else None
    if scaler is not None:
        agree_on_inf_checks(scaler, device, group, num_stages)


def _optimizes_stage_only(driver: TwoBWDriver) -> bool:
    """Whether every trainable parameter the optimizer holds is one of the stage's, whose
    gradients the driver hands over as each batch completes."""
    stage = {id(p) for p in driver.versions.params}
    held = [p for g in driver.optimizer.param_groups for p in g["params"] if p.requires_grad]
    return all(id(p) in stage for p in held)


def posts_norms_ahead(plugin: Precision, runtime: StageRuntime, trainer: Trainer) -> bool:
    """Whether this fit clips by norm under 2BW where the gradient at the step is the one the
    pipeline computed, so that each batch's norm can be summed as soon as its gradient is
    complete (:class:`NormsAhead`): the same answer on every rank (the options, the Trainer's
    and the module's set-up are checked alike)."""
    options, topology = runtime.options, runtime.topology
    module = trainer.lightning_module
    return (
        bool(trainer.gradient_clip_val)
        and trainer.gradient_clip_algorithm in (None, "norm")
        and topology.num_stages > 1
        and topology.data_parallel == 1
        and options.is_async
        and not options.spec.updates_per_stage  # PipeDream updates inside the pipeline
        and not options.fresh_last_stage  # its last stage's update pairs with another batch
        and options.repartition_every is None  # moves may tie parameters across stages
        and not runtime.tied
        and not isinstance(plugin, MixedPrecision)  # a scaler unscales at the step
        and not logs_in_gradient_hooks(trainer, trainer.lightning_module)  # may change grads
        # the module's own clipping may change them before it clips, or clip at some steps only
        and not is_overridden("configure_gradient_clipping", module, LightningModule)
    )


def setup_settings(
    options: PipeOptions, num_microbatches: int, trainer: Trainer
) -> dict[str, object]:
    """What every rank of the pipeline must agree on (see :func:`check_same_setup`)."""
    return {
        **options.settings(num_microbatches),
        "precision": trainer.precision,
        "gradient_clip_val": trainer.gradient_clip_val,
        "gradient_clip_algorithm": trainer.gradient_clip_algorithm,
        "lightning_pipe2bw": _package_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
    }


def _package_version() -> str:
    try:
        return importlib.metadata.version("lightning-pipe2bw")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing
        return "unknown"
