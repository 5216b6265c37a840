"""Decisions every stage must take alike: the gradient norm to clip by, and skipping a step; and
the set-up every rank checks it shares with the others."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

import lightning
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_pipe2bw.compat import found_inf_state, override_clipping
from lightning_pipe2bw.pipeline.options import PipeOptions
from lightning_pipe2bw.pipeline.stage_runtime import StageRuntime

__all__ = ["agree_across_stages", "check_same_setup", "setup_settings"]


def _grads(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _params_with_grad(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def make_clipping_global(
    plugin: Precision,
    device: torch.device,
    group: dist.ProcessGroup | None,
    num_stages: int,
    counted: Callable[[torch.Tensor], bool] = lambda p: True,
) -> None:
    """Make ``plugin``'s gradient clipping behave as on one device.

    By norm: the norm is taken over every stage's gradient (squared norms summed with one
    all-reduce, in float64) and the coefficient is ``torch.nn.utils.clip_grad_norm_``'s,
    ``max_norm / (norm + 1e-6)`` capped at 1. Every rank clips at the same point of Lightning's
    loop, so the all-reduce lines up. A parameter whose copies live on several stages (a tie)
    counts once: ``counted(param)`` is False for the other copies. By value: element-wise, so stage-local; it tolerates a
    stage without gradients (2BW's first step).
    """

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: int | float) -> None:
        params = _params_with_grad(optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=device)
        for p in params:
            if p.grad is not None and counted(p):
                squares += p.grad.detach().double().pow(2).sum()
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


def agree_across_stages(plugin: Precision, runtime: StageRuntime, device: torch.device) -> None:
    """Make ``plugin``'s clipping and (mixed precision) inf checks span ``runtime``'s pipeline,
    counting each of its tied parameters once."""
    group = runtime.groups.pipeline  # clipping and inf checks span one pipeline
    num_stages = runtime.topology.num_stages

    def counted(param: torch.Tensor) -> bool:  # the current runtime's ties (moves rebuild them)
        return runtime.tied is None or runtime.tied.counted(param)

    make_clipping_global(plugin, device, group, num_stages, counted)
    scaler = plugin.scaler if isinstance(plugin, MixedPrecision) else None
    if scaler is not None:
        agree_on_inf_checks(scaler, device, group, num_stages)


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
