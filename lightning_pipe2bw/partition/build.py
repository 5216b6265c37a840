"""Turning a module's body into this rank's stage: keep the owned blocks, release the rest."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from lightning_pipe2bw.partition.split import BodyRef, Partition, make_partition
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
    _check_no_tied_parameters(blocks, partition, ref.path)
    owned = partition.blocks_of(stage)
    stage_body = StageBody(
        ((i, blocks[i]) for i in owned),
        stage=stage,
        num_stages=num_stages,
        balance=partition.balance,
        recompute=recompute,
        memory_plan=memory_plan,
    )
    setattr(ref.parent, ref.attr, stage_body)  # the other stages' blocks are released here
    del blocks, current
    _check_params_outside_body(module, ref.path)
    stage_body.built_on_meta = _materialize(module, stage_body, owned, device)
    return stage_body, partition


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


def _check_no_tied_parameters(blocks: list[nn.Module], partition: Partition, body: str) -> None:
    """A parameter shared by blocks on different stages would be trained as two copies."""
    owner: dict[int, tuple[int, int, str]] = {}
    problems = []
    for stage in range(partition.num_stages):
        for index in partition.blocks_of(stage):
            for name, param in blocks[index].named_parameters(remove_duplicate=False):
                first = owner.setdefault(id(param), (stage, index, name))
                if first[0] != stage:
                    problems.append(
                        f"{body}.{first[1]}.{first[2]} (stage {first[0]}) is "
                        f"{body}.{index}.{name} (stage {stage})"
                    )
    if problems:
        raise ValueError(
            f"parameters shared between blocks on different stages: {problems}. Each stage "
            "would train its own copy; untie them, or choose a balance that puts the blocks that "
            "share a parameter on one stage"
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
