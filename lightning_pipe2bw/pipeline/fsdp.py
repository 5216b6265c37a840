"""FSDP2 inside a stage (``Pipe2BWStrategy(data_parallel=d, fsdp=True)``): every block of a stage
sharded over the stage's d replicas with torch's ``fully_shard``, as torchtitan composes pipeline
stages with FSDP2.

Each block's weights, gradients and optimizer state are DTensors sharded along their first
dimension over the replica group (a 1-D ``DeviceMesh`` made from it). A block's weights are
gathered before its forward and again before its backward (``reshard_after_forward=True``, said
outright: every block is its own FSDP root, and a root left to choose keeps them gathered in
between, which in a pipeline holds every block whole while a micro-batch is in flight), and its
gradient is reduce-scattered (averaged over the replicas) after the batch's last backward of
its stage: :class:`GradientSync` turns FSDP's gradient synchronisation on for that backward only,
so that the micro-batches' gradients add up unsharded first, as the strategy's own average over
the replicas does without FSDP. The strategy's average then leaves those gradients alone
(:func:`is_sharded`).

What meets a stage's weights outside the blocks takes full tensors: a consolidated checkpoint
holds the gathered weights and optimizer state (:func:`full_tensors`), the same file as without
FSDP, and loading it slices each tensor back into this replica's shard (:func:`load_shards`).

Refused, with the reason (``pipeline/options.py``): one replica per stage, the schedules that keep
a second whole version of each weight (2BW's double buffer, PipeDream's stash), ``shard_optimizer``
(FSDP shards that state already), blocks that move between stages; at set-up
(:func:`tie_problems`, :func:`dtype_problems`, :func:`optimizer_problems`): parameters shared
between blocks, a block's parameters of several dtypes (FSDP gathers them in one buffer), Muon (it
orthogonalises each matrix whole, which FSDP holds in row shards), fp16 with a loss scaler (use
bf16).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from lightning_pipe2bw.pipeline.problems import Problem
from lightning_pipe2bw.runtime.stash import local_shard

__all__ = [
    "GradientSync",
    "dtype_problems",
    "full_tensors",
    "is_sharded",
    "load_shards",
    "local_elements",
    "optimizer_problems",
    "shard_blocks",
    "shard_optimizer_state",
    "sharded_blocks",
    "tie_problems",
]


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (a weight, gradient or state entry FSDP shards)."""
    return isinstance(tensor, DTensor)


def local_elements(tensors: Iterable[Tensor]) -> int:
    """The elements this rank holds of ``tensors`` (a DTensor's local shard only)."""
    return sum(local_shard(t).numel() for t in tensors)


def shard_blocks(
    blocks: Sequence[nn.Module], group: dist.ProcessGroup, device: torch.device
) -> None:
    """``fully_shard`` each of ``blocks`` that has parameters over ``group`` (the stage's
    replicas, in replica order), in place (a block without parameters stays as it is)."""
    mesh = DeviceMesh.from_group(group, device.type)
    for block in blocks:
        if any(True for _ in block.parameters()):
            # said, not left to FSDP: each block is its own root (no module above it is
            # sharded), and a root left to choose keeps its weights gathered from its forward to
            # its backward, which in a pipeline is every block, for every micro-batch in flight
            fully_shard(block, mesh=mesh, reshard_after_forward=True)


def sharded_blocks(blocks: Iterable[nn.Module]) -> list[FSDPModule]:
    """The blocks among ``blocks`` that :func:`shard_blocks` sharded (those with parameters)."""
    return [b for b in blocks if isinstance(b, FSDPModule)]


class GradientSync:
    """Turns FSDP's gradient reduction on for the batch's last backward of each stage only.

    Every micro-batch's backward runs whole once on each stage (FSDP's hooks leave nothing for
    zero bubble's cut: the engine runs its backwards whole), so the engine calls
    :meth:`before_backward` once per micro-batch and stage; the ``m``-th call of a batch is the
    last. Until then FSDP keeps the unsharded gradients and adds each micro-batch's into them,
    in the order one process adds them; that backward reduce-scatters their sum.
    ``blocks_by_stage``: the blocks :func:`shard_blocks` sharded (see :func:`sharded_blocks`)."""

    def __init__(self, blocks_by_stage: Mapping[int, Sequence[Any]]) -> None:
        self.blocks_by_stage = {v: list(blocks) for v, blocks in blocks_by_stage.items()}
        self._count: dict[int, int] = {}
        self._microbatches = 0

    def start(self, num_microbatches: int) -> None:
        """A training batch of ``num_microbatches`` begins."""
        self._microbatches = num_microbatches
        self._count = dict.fromkeys(self.blocks_by_stage, 0)

    def before_backward(self, stage: int) -> None:
        """Stage ``stage`` is about to run a micro-batch's whole backward."""
        if stage not in self._count:
            return
        self._count[stage] += 1
        last = self._count[stage] == self._microbatches
        for block in self.blocks_by_stage[stage]:
            block.set_requires_gradient_sync(last, recurse=False)


def tie_problems(body: Any) -> list[Problem]:
    """Parameters that blocks of ``body`` share: FSDP shards each block's own (checked before
    the blocks are sharded)."""
    if not body.ties:
        return []
    names = "; ".join(tie.describe() for tie in body.ties)
    return [
        Problem(
            "fsdp",
            True,
            f"fsdp=True: the body's blocks share parameters ({names}), and FSDP shards each "
            "block's own parameters; untie them, or leave fsdp False",
        )
    ]


def dtype_problems(body: Any) -> list[Problem]:
    """Blocks of ``body`` whose parameters are of more than one dtype: FSDP all-gathers a
    block's parameters in one flat buffer, of one dtype (checked before the blocks are
    sharded)."""
    problems = []
    for i in body.indices:
        named = list(body.block(i).named_parameters())
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) < 2:
            continue
        common = max(dtypes, key=lambda d: sum(p.numel() for _, p in named if p.dtype == d))
        odd = [f"{n} ({str(p.dtype).removeprefix('torch.')})" for n, p in named if p.dtype != common]
        problems.append(
            Problem(
                "fsdp",
                True,
                f"fsdp=True: block {i} ({type(body.block(i)).__name__}) holds parameters of "
                f"{len(dtypes)} dtypes: {', '.join(odd[:5])} beside "
                f"{str(common).removeprefix('torch.')} ones, and FSDP gathers a block's "
                "parameters in one buffer of one dtype; cast the block to one dtype (e.g. "
                "block.float(); precision='bf16-mixed' lowers the compute's precision without "
                "changing the parameters'), or leave fsdp False and shard the optimizer state "
                "alone with shard_optimizer=True, which takes any dtypes",
                TypeError,
            )
        )
    return problems


def optimizer_problems(optimizers: Sequence[Optimizer], scales_loss: bool) -> list[Problem]:
    """What ``fsdp=True`` cannot update: an optimizer that needs whole matrices, or gradients
    a loss scaler unscales per device."""
    from lightning_pipe2bw.optim.muon import MuonAdamW
    from lightning_pipe2bw.optim.wrapper import unwrap_optimizer

    problems = []
    if any(isinstance(unwrap_optimizer(o), MuonAdamW) for o in optimizers):
        problems.append(
            Problem(
                "fsdp",
                True,
                "fsdp=True: MuonAdamW orthogonalises each weight matrix whole, and FSDP holds it "
                "in row shards over the replicas; use AdamW (or another element-wise optimizer) "
                "with fsdp=True, or shard_optimizer=True, which keeps each matrix whole on one "
                "replica",
            )
        )
    if scales_loss:
        problems.append(
            Problem(
                "fsdp",
                True,
                "fsdp=True: fp16 with a loss scaler unscales the gradients per device, and "
                "FSDP's are DTensor shards; use precision='bf16-mixed', which needs no scaler",
            )
        )
    return problems


def full_tensors(obj: Any) -> Any:
    """``obj`` with each DTensor in it replaced by the whole tensor (collective over each
    DTensor's replicas: every replica calls it on the same structure, in the same order)."""
    return apply_to_collection(obj, DTensor, lambda t: t.full_tensor())


def _shard_like(target: Tensor, value: Any) -> Any:
    """``value`` (a whole tensor) as a DTensor laid out as ``target`` is (this replica slices its
    own shard: every replica holds the same whole tensor)."""
    if not isinstance(target, DTensor) or not isinstance(value, Tensor) or is_sharded(value):
        return value
    return distribute_tensor(
        value.to(target.device), target.device_mesh, target.placements, src_data_rank=None
    )


def load_shards(local: Mapping[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (whole tensors by state-dict key) with each entry the module's own state dict
    ``local`` holds as a DTensor made this replica's shard of it, ready for
    ``load_state_dict``."""
    return {k: _shard_like(local[k], v) if k in local else v for k, v in state.items()}


def shard_optimizer_state(optimizer: Optimizer, state: Mapping[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()``-shaped ``state`` holding whole tensors, with each parameter's
    entries of a parameter's shape made this replica's shard, as the sharded parameter is."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = dict(state)
    entries = {}
    for index, values in state.get("state", {}).items():
        param = params[index] if isinstance(index, int) and index < len(params) else None
        if param is None or not isinstance(param, DTensor):
            entries[index] = values
            continue
        entries[index] = {
            key: _shard_like(param, value)
            if isinstance(value, Tensor) and value.shape == param.shape
            else value
            for key, value in values.items()
        }
    out["state"] = entries
    return out
