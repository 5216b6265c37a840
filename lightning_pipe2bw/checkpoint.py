"""Consolidated checkpoints of a pipeline: gathering every stage's state, and loading a stage's share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = [
    "gather_named",
    "gather_optimizer_state",
    "gather_state_dict",
    "load_stage_optimizer_state",
    "load_stage_state_dict",
]


def _to_cpu(obj: Any) -> Any:
    return apply_to_collection(obj, Tensor, lambda t: t.detach().cpu())


def gather_state_dict(module: nn.Module, rank: int, world_size: int) -> dict[str, Any]:
    """The unpartitioned model's state dict on rank 0 (collective; ``{}`` on other ranks).

    Each stage's keys are the original model's (see ``StageBody``), so the union of the stages'
    dicts is the single-device model's dict.
    """
    return gather_named(module.state_dict(), rank, world_size)


def gather_named(local: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The union of every rank's name -> tensor dict, on CPU, on rank 0 (collective; ``{}`` on
    other ranks). A name held by several ranks keeps the lowest rank's value."""
    local = _to_cpu(dict(local))
    if world_size == 1:
        return dict(local)
    gathered: list[Any] = [None] * world_size if rank == 0 else []
    dist.gather_object(local, gathered if rank == 0 else None, dst=0)
    if rank != 0:
        return {}
    merged: dict[str, Any] = {}
    for part in gathered:
        for key, value in part.items():
            merged.setdefault(key, value)
    return merged


def gather_optimizer_state(
    optimizer: Optimizer, stage: int, num_stages: int, balance: Sequence[int]
) -> dict[str, Any]:
    """Every stage's optimizer state, in stage order, with the layout it was written for
    (collective over the ``num_stages`` ranks of one pipeline)."""
    local = (stage, _to_cpu(optimizer.state_dict()))
    gathered: list[Any] = [None] * num_stages
    if num_stages > 1:
        dist.all_gather_object(gathered, local)
    else:
        gathered = [local]
    by_stage = dict(gathered)
    return {
        "pipe2bw_stages": [by_stage[s] for s in range(num_stages)],
        "pipe2bw_balance": list(balance),
    }


def load_stage_state_dict(module: nn.Module, full: Mapping[str, Any], strict: bool = True) -> None:
    """Load this stage's entries from a consolidated state dict."""
    local_keys = module.state_dict().keys()
    missing = [k for k in local_keys if k not in full]
    if missing and strict:
        raise KeyError(
            f"the checkpoint lacks {len(missing)} entries this stage needs, e.g. {missing[:5]}; "
            "was it written for a different model?"
        )
    module.load_state_dict({k: full[k] for k in local_keys if k in full}, strict=strict)


def load_stage_optimizer_state(
    optimizer: Optimizer, state: Mapping[str, Any], stage: int, balance: Sequence[int]
) -> None:
    """Load stage ``stage``'s optimizer state from :func:`gather_optimizer_state`'s output."""
    if "pipe2bw_stages" not in state:
        raise ValueError(
            "this checkpoint's optimizer state was not written by pipe2bw; resume it with the "
            "strategy that wrote it, or load only the weights"
        )
    if list(state["pipe2bw_balance"]) != list(balance):
        raise ValueError(
            f"the checkpoint's optimizer state was written for balance={state['pipe2bw_balance']} "
            f"but this run uses balance={list(balance)}; resume with the same balance"
        )
    optimizer.load_state_dict(state["pipe2bw_stages"][stage])
