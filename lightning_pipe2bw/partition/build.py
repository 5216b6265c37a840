"""Turning a module's body into this rank's stage: keep the owned blocks, release the rest."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from lightning_pipe2bw.partition.pipemodel import PipeModelBody, release, restore_model
from lightning_pipe2bw.partition.split import BodyRef, Partition, make_partition
from lightning_pipe2bw.partition.ties import Tie, find_ties
from lightning_pipe2bw.runtime.stage import StageBody

__all__ = ["build_stage"]


def build_stage(
    module: nn.Module,
    ref: BodyRef,
    stage: int,
    num_stages: int,
    balance: Sequence[int] | None,
    device: torch.device,
    *,
    recompute: bool = False,
    memory_plan: Mapping[int, str] | None = None,
) -> tuple[StageBody, Partition]:
    """Replace the body ``ref`` of ``module`` by this stage's :class:`StageBody`, which
    recomputes its activations (``recompute``) or follows ``memory_plan``.

    The other stages' blocks are dropped (and freed when nothing else holds them); blocks built
    on the meta device (``configure_model``) are materialised here, owned ones only. A body that
    an earlier ``trainer`` call already partitioned is reused with its blocks, and takes this
    call's ``recompute`` and ``memory_plan``.
    """
    current = ref.module
    if isinstance(current, StageBody):
        if current.num_stages != num_stages or current.stage != stage:
            raise ValueError(
                f"this module was partitioned for stage {current.stage} of {current.num_stages}"
                f" and cannot be re-used as stage {stage} of {num_stages}"
            )
        current.recompute = recompute
        current.memory_plan = dict(memory_plan or {})
        current.partial_reason = None  # a pipeline runs it again
        return current, Partition(current.balance)
    blocks = list(current.children())
    _check_callable_blocks(blocks, ref.path)
    partition = make_partition(len(blocks), num_stages, balance)
    owned = partition.blocks_of(stage)
    model_body = current if isinstance(current, PipeModelBody) else None
    stage_body = StageBody(
        ((i, blocks[i]) for i in owned),
        stage=stage,
        num_stages=num_stages,
        balance=partition.balance,
        recompute=recompute,
        memory_plan=memory_plan,
        takes_any_call=model_body is not None,
        owner=model_body.owner if model_body is not None else None,
    )
    stage_body.ties = find_ties(blocks)
    if model_body is not None:
        model = model_body.spec.model
        object.__setattr__(stage_body, "model", model)  # not a child: it holds other stages'
        stage_body.restore = functools.partial(restore_model, model)
        stage_body.release = functools.partial(release, model)
        release(model_body.spec.model, [b for i, b in enumerate(blocks) if i not in owned])
    setattr(ref.parent, ref.attr, stage_body)  # the other stages' blocks are released here
    del blocks, current, model_body
    _check_params_outside_body(module, ref.path)
    stage_body.built_on_meta = _materialize(module, stage_body, owned, device)
    if stage_body.built_on_meta:
        retie(stage_body)
    return stage_body, partition


def retie(body: StageBody) -> None:
    """Make the blocks of ``body`` that share a parameter share it again (materialising each
    block on its own gives each its own copy): every use on this stage becomes the primary's."""
    for tie in body.ties:
        mine = [(b, n) for b, n in tie.uses if b in body.indices]
        if len(mine) < 2:
            continue
        first = body.block(mine[0][0]).get_parameter(mine[0][1])
        for block, name in mine[1:]:
            owner_path, _, attr = name.rpartition(".")
            owner = body.block(block).get_submodule(owner_path) if owner_path else body.block(block)
            owner._parameters[attr] = first


def ties_across_stages(ties: list[Tie], partition: Partition) -> list[Tie]:
    """The ties whose uses are on more than one stage (each stage trains a copy)."""
    return [t for t in ties if len(t.stages(partition)) > 1]


def _check_callable_blocks(blocks: list[nn.Module], body: str) -> None:
    """Every block is called with the previous block's output: a container without a forward
    (``nn.ModuleList``, ``nn.ModuleDict``) cannot be one."""
    bad = [
        f"{body}.{i} ({type(b).__name__})"
        for i, b in enumerate(blocks)
        if type(b).forward is nn.Module.forward
    ]
    if bad:
        raise TypeError(
            f"blocks of the pipeline body have no forward: {', '.join(bad)}. The body calls each "
            "block with the previous block's output; put the layers of a list into the body "
            "itself (nn.Sequential(*layers)), or wrap them in a module whose forward runs them"
        )


def _check_params_outside_body(module: nn.Module, body_path: str) -> None:
    stray = [name for name, _ in module.named_parameters() if not name.startswith(body_path + ".")]
    if stray:
        raise ValueError(
            f"parameters outside the pipeline body {body_path!r}: {stray}. Every layer with "
            "parameters must be a block of the body so that exactly one stage owns it; move "
            "these layers into the body (e.g. an embedding as its first block, a head as its last)"
        )


def _materialize(
    module: nn.Module, stage_body: StageBody, owned: range, device: torch.device
) -> bool:
    """Allocate meta tensors (from ``configure_model``) on ``device``. Each owned block is
    initialised with ``reset_parameters()`` under a seed derived from its index, so a block's
    initial weights do not depend on the partition. Whether there were any."""
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        return False
    base_seed = torch.initial_seed()
    for index, block in zip(owned, stage_body.children(), strict=True):
        block.to_empty(device=device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(base_seed + index)
            for sub in block.modules():
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
    # modules outside the body built on meta (parameter-free ones, or buffers): allocate only
    # what is still on meta, never re-allocating the blocks initialised above
    for sub in module.modules():
        own = (*sub.parameters(recurse=False), *sub.buffers(recurse=False))
        if any(t.is_meta for t in own):
            sub.to_empty(device=device, recurse=False)
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
    return True
