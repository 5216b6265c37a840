"""Stage state across ranks: gathering every stage's state on rank 0, loading a stage's share, and
the sharded (torch.distributed.checkpoint) files."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.optim import Optimizer

from lightning_pipe2bw.pipeline.fsdp import full_tensors, load_shards, shard_optimizer_state

__all__ = [
    "gather_named",
    "gather_optimizer_state",
    "gather_state_dict",
    "is_sharded_checkpoint",
    "load_sharded",
    "load_stage_optimizer_state",
    "load_stage_optimizer_state_by_name",
    "load_stage_state_dict",
    "read_sharded_meta",
    "save_sharded",
    "stage_optimizer_state",
    "to_cpu",
]


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in it detached and on the CPU (containers kept)."""
    return apply_to_collection(obj, Tensor, lambda t: t.detach().cpu())


def gather_state_dict(module: nn.Module, rank: int, world_size: int) -> dict[str, Any]:
    """The unpartitioned model's state dict on rank 0 (collective; ``{}`` on other ranks).

    Each stage's keys are the original model's (see ``StageBody``), so the union of the stages'
    dicts is the single-device model's dict.
    """
    return gather_named(module.state_dict(), rank, world_size)


def gather_named(local: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The union of every rank's name -> tensor dict, on CPU, on rank 0 (collective; ``{}`` on
    other ranks). A name held by several ranks keeps the lowest rank's value. A tensor FSDP
    shards (``fsdp=True``) is gathered whole first (collective over its replicas)."""
    local = to_cpu(full_tensors(dict(local)))
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
    optimizer: Optimizer,
    stage: int,
    num_stages: int,
    balance: Sequence[int],
    group: dist.ProcessGroup | None = None,
    local_state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every stage's optimizer state, in stage order, with the layout it was written for
    (collective over ``group``: the ``num_stages`` ranks of one pipeline); ``local_state``: this
    stage's, if not ``optimizer.state_dict()``. State FSDP shards is gathered whole first
    (collective over the replicas), so the file is the one an unsharded run writes."""
    state = optimizer.state_dict() if local_state is None else local_state
    local = (stage, to_cpu(full_tensors(state)))
    gathered: list[Any] = [None] * num_stages
    if num_stages > 1:
        dist.all_gather_object(gathered, local, group=group)
    else:
        gathered = [local]
    by_stage = dict(gathered)
    return {
        "pipe2bw_stages": [by_stage[s] for s in range(num_stages)],
        "pipe2bw_balance": list(balance),
    }


def load_stage_state_dict(module: nn.Module, full: Mapping[str, Any], strict: bool = True) -> None:
    """Load this stage's entries from a consolidated state dict (collective when ``strict``:
    every rank raises the same ``KeyError`` if any stage's entries are missing). Where FSDP
    shards a tensor (``fsdp=True``) this replica takes its shard of the whole one."""
    local = module.state_dict()
    local_keys = local.keys()
    if strict:
        missing = _everyone_missing([k for k in local_keys if k not in full])
        if missing:
            raise KeyError(
                f"the checkpoint lacks {len(missing)} entries this model needs, e.g. "
                f"{missing[:5]}; was it written for a different model?"
            )
    entries = {k: full[k] for k in local_keys if k in full}
    module.load_state_dict(load_shards(local, entries), strict=strict)


def _everyone_missing(missing: list[str]) -> list[str]:
    """The union of every rank's missing names (collective when distributed), in order."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, missing)
        missing = list({k: None for part in everyone for k in part})
    return missing


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
            f"but this run uses balance={list(balance)}; resume with the same balance, or save with "
            "Pipe2BWStrategy(state_dict_type='sharded'), which reloads with any partition"
        )
    optimizer.load_state_dict(shard_optimizer_state(optimizer, state["pipe2bw_stages"][stage]))


# ----------------------------------------------------------------------------- sharded format
# A directory: torch.distributed.checkpoint (DCP) files holding every stage's tensors under the
# original model's names, plus ``meta.pt`` (written by rank 0) with Lightning's other keys.
# Because tensors are found by name, the directory reloads with any number of stages.

SHARDED_META = "meta.pt"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    return Path(path).is_dir() and (Path(path) / SHARDED_META).is_file()


def stage_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """This stage's optimizer state keyed by parameter name (``state.<name>.<key>`` and
    ``param_groups.<name>.<key>``), so that any partition can pick its share."""
    return get_optimizer_state_dict(module, optimizer, options=_OPTIONS)


def load_stage_optimizer_state_by_name(
    module: nn.Module, optimizer: Optimizer, state: dict[str, Any]
) -> None:
    set_optimizer_state_dict(module, optimizer, state, options=_OPTIONS)
    # torch's loader keeps only the entries the optimizer makes itself; the others (a delay
    # correction's, see add_stored_optimizer_entries) are put back here
    params = dict(module.named_parameters(remove_duplicate=False))
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for key, value in state.items():
        if not key.startswith("state.") or not isinstance(value, Tensor):
            continue
        name, entry = key[len("state.") :].rsplit(".", 1)
        param = params.get(name)
        if param is None or id(param) not in held or entry in optimizer.state[param]:
            continue
        dtype = param.dtype if value.is_floating_point() else value.dtype
        optimizer.state[param][entry] = value.to(device=param.device, dtype=dtype)


def save_sharded(
    path: str | os.PathLike[str], tensors: dict[str, Any], meta: dict[str, Any], rank: int
) -> None:
    """Write this rank's ``tensors`` (collective) and, on rank 0, ``meta``.

    ``meta.pt`` marks a complete checkpoint: rank 0 removes an old one before anything is
    written and writes the new one last (to a temporary name, then renamed), after every rank's
    shard is on disk, so an interrupted save is never loaded as if it were complete."""
    path = Path(path)
    if path.is_file():
        raise FileExistsError(
            f"{path} is a file, but a sharded checkpoint is a directory; choose another path"
        )
    path.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (path / SHARDED_META).unlink(missing_ok=True)
    dcp_save(tensors, checkpoint_id=path)  # collective: when it returns, every shard is written
    if rank == 0:
        tmp = path / f"{SHARDED_META}.tmp"
        torch.save(meta, tmp)
        os.replace(tmp, path / SHARDED_META)


def read_sharded_meta(path: str | os.PathLike[str], weights_only: bool = True) -> dict[str, Any]:
    """The non-tensor part of a sharded checkpoint (Lightning's loops, schedulers, ...)."""
    meta: dict[str, Any] = torch.load(Path(path) / SHARDED_META, weights_only=weights_only)
    return meta


def load_sharded(path: str | os.PathLike[str], template: dict[str, Any]) -> None:
    """Fill ``template`` (this rank's tensors, by name) from a sharded checkpoint, in place
    (collective). Every rank raises the same ``KeyError`` if any rank's names are missing."""
    path = Path(path)
    missing = _everyone_missing(_missing_keys(path, template))
    # the model's own names first: they say most about which model wrote the file
    missing.sort(key=lambda k: (not k.startswith("state_dict."), k))
    if missing:
        raise KeyError(
            f"the sharded checkpoint {path} lacks {len(missing)} entries this model needs, e.g. "
            f"{missing[:5]}; was it written for a different model?"
        )
    dcp_load(template, checkpoint_id=path)


def add_stored_optimizer_entries(
    path: str | os.PathLike[str], template: dict[str, Any], prefix: str
) -> None:
    """Add to an optimizer-state ``template`` (flat: ``state.<name>.<key>``) the entries the
    sharded checkpoint at ``path`` stores (under ``prefix``) for the same parameters that the
    template lacks: state the optimizer gets beside its own (a delay correction's), which the
    template, made from a freshly initialised optimizer, cannot know of."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    names = {key[len("state.") : key.rindex(".")] for key in template if key.startswith("state.")}
    stored = FileSystemReader(Path(path)).read_metadata().state_dict_metadata
    for key, meta in stored.items():
        if not key.startswith(prefix + "state.") or not isinstance(meta, TensorStorageMetadata):
            continue
        flat = key[len(prefix) :]
        name = flat[len("state.") : flat.rindex(".")]
        if name in names and flat not in template:
            template[flat] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)


def _missing_keys(path: Path, template: dict[str, Any]) -> list[str]:
    stored = FileSystemReader(path).read_metadata().state_dict_metadata.keys()
    return [k for k in _flat_keys(template) if k not in stored]


def _flat_keys(obj: Any, prefix: str = "") -> list[str]:
    """DCP's names for the leaves of a nested dict/list (``a.b.0``)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    keys: list[str] = []
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list)) and value:
            keys += _flat_keys(value, name + ".")
        else:
            keys.append(name)
    return keys
