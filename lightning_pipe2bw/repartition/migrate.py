"""Moving whole blocks between stages at a flush point (vPipe's live repartitioning, and adopting
the layout a checkpoint was written with).

A move is collective over every rank and happens in three steps, with Lightning's optimizer set-up
in between (the strategy's part):

1. :func:`carry_state`: before anything moves, every rank takes its optimizers' state by
   parameter name (Adam's moments and step counts), the schedulers' state, and the driver's
   (2BW: the batch count and the second weight version by name).
2. :func:`move_blocks`: each moving block travels, pickled on the CPU, from its old stage's rank
   to its new one in each replica, with the entries of the carried state that name its
   parameters; the stage body and the runtime's partition become the new layout.
3. :func:`restore_state`: once ``configure_optimizers`` has built optimizers over the new
   blocks, they get back their state and param-group values, and the driver continues the
   version rule over the new parameters.
"""

from __future__ import annotations

import logging
import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pipe2bw.checkpoint.storage import to_cpu
from lightning_pipe2bw.partition import make_partition
from lightning_pipe2bw.partition.ties import share_parameter
from lightning_pipe2bw.pipeline.checks import memory_plan_problems
from lightning_pipe2bw.pipeline.options import raise_problems
from lightning_pipe2bw.pipeline.stage_runtime import StageRuntime
from lightning_pipe2bw.pipeline.ties import TiedCopies
from lightning_pipe2bw.repartition.plan import (
    load_optimizer_state_by_name,
    optimizer_state_by_name,
)
from lightning_pipe2bw.repartition.travel import packed, unpacked
from lightning_pipe2bw.runtime.stage import StageBody

__all__ = ["hand_back", "relayout"]

log = logging.getLogger(__name__)


@dataclass
class CarriedState:
    """What travels with the blocks: per optimizer its state by name, the schedulers' state
    dicts, and the driver's state (``previous_weights`` by name)."""

    optimizers: list[dict[str, Any]] = field(default_factory=list)
    schedulers: list[dict[str, Any]] = field(default_factory=list)
    driver: dict[str, Any] = field(default_factory=dict)


def carry_state(
    runtime: StageRuntime,
    optimizers: Sequence[Optimizer],
    schedulers: Sequence[Any] = (),
) -> CarriedState:
    """The state this rank's blocks carry when they move (``optimizers``: the user's torch
    optimizers; ``schedulers``: their LR schedulers). Only at a flush point."""
    if not runtime.driver.at_flush_point:
        raise RuntimeError("blocks can only move at a flush point, with nothing in flight")
    driver = runtime.driver.state(runtime.weight_names())
    if not optimizers:
        return CarriedState(driver={**driver, "previous_weights": {}})
    return CarriedState(
        optimizers=[optimizer_state_by_name(runtime.root, o) for o in optimizers],
        schedulers=[s.state_dict() for s in schedulers],
        driver=driver,
    )


def _unmovable(body: StageBody, blocks: Sequence[int], world_size: int) -> list[str]:
    """Every rank's blocks among ``blocks`` that cannot be pickled (collective)."""
    problems = []
    for block in blocks:
        try:
            pickle.dumps(packed(body.block(block)))
        except Exception as err:
            problems.append(f"block {block}: {type(err).__name__}: {err}")
    everyone: list[Any] = [problems]
    if world_size > 1:
        everyone = [None] * world_size
        dist.all_gather_object(everyone, problems)
    return [p for part in everyone for p in part]


def check_movable(body: StageBody, blocks: Sequence[int], world_size: int) -> None:
    """Every rank raises the same error, before anything moves, if a block that must move
    cannot be pickled (a hook or attribute holding something that cannot travel)."""
    found = _unmovable(body, blocks, world_size)
    if found:
        raise ValueError(
            "cannot move blocks between stages: a block travels pickled (module, weights and "
            f"all), and {'; '.join(found)}. Keep hooks and references to the LightningModule "
            "out of the blocks, or turn repartition_every off"
        )


def move_blocks(runtime: StageRuntime, balance: Sequence[int], carried: CarriedState) -> None:
    """Make the pipeline run ``balance`` blocks per stage (collective over every rank; nothing
    may be in flight). ``carried`` gains the entries the blocks this rank receives bring."""
    t, body = runtime.topology, runtime.body
    old = runtime.partition
    new = make_partition(old.num_blocks, t.num_stages, balance)
    path = runtime.body_path
    previous: dict[str, Tensor] = carried.driver.setdefault("previous_weights", {})
    moves = old.moves_to(new)
    check_movable(body, [b for b, src, _ in moves if src == t.stage], t.world_size)
    for block, src, dst in moves:
        prefix = f"{path}.{block}."
        if t.stage == src:
            # the block's weight names as the driver keys them (a model's: without the index)
            names = {
                f"{path}.{body.key_of(block, local)}"
                for local, _ in body.block(block).named_parameters()
            }
            leaving = body.take_block(block)
            payload = {
                "module": packed(leaving.to("cpu")),
                # on the CPU: a pickled CUDA tensor would land on the sender's device index
                "optimizer": to_cpu(
                    [
                        {k: v for k, v in part.items() if _names_param(k, prefix)}
                        for part in carried.optimizers
                    ]
                ),
                "previous": to_cpu({k: v for k, v in previous.items() if k in names}),
            }
            dist.send_object_list([payload], dst=t.rank_of_stage(dst))
        elif t.stage == dst:
            got: list[Any] = [None]
            dist.recv_object_list(got, src=t.rank_of_stage(src))
            payload = got[0]
            device = runtime.engine.transport.device
            body.put_block(block, unpacked(payload["module"]).to(device))
            for part, extra in zip(carried.optimizers, payload["optimizer"], strict=True):
                part.update(extra)
            previous.update({k: v.to(device) for k, v in payload["previous"].items()})
        if t.rank == 0 or t.stage in (src, dst):
            log.info(
                "pipe2bw: rank %d: block %d moves from stage %d to stage %d",
                t.rank, block, src, dst,
            )  # fmt: skip
    body.rebalance(new.balance)
    runtime.partition = new
    # shared parameters: this stage's copies are other objects now, maybe on other stages
    runtime.tied = TiedCopies(body, new, t, runtime.groups)
    raise_problems(memory_plan_problems(runtime.options, new, body.recompute))


def restore_state(
    runtime: StageRuntime, optimizers: list[Optimizer], carried: CarriedState
) -> list[Optimizer]:
    """After the move and ``configure_optimizers`` over the new blocks (``optimizers``): load
    each optimizer's carried state for the blocks this stage owns now, and continue the driver
    over the new parameters. Returns what Lightning steps (the 2BW wrapper, or
    ``optimizers``)."""
    path, owned = runtime.body_path, runtime.body.indices
    for optimizer, state in zip(optimizers, carried.optimizers, strict=False):
        mine = {
            k: v for k, v in state.items() if any(_names_param(k, f"{path}.{b}.") for b in owned)
        }
        load_optimizer_state_by_name(runtime.root, optimizer, mine)
    stepped = runtime.driver.rebind(optimizers)
    runtime.optimizers = stepped
    runtime.driver.resume(carried.driver, runtime.weight_names())
    return stepped


def relayout(
    runtime: StageRuntime,
    balance: Sequence[int],
    optimizers: Sequence[Optimizer],
    schedulers: Sequence[Any],
    rebuild: Callable[[], tuple[list[Optimizer], list[Any]]] | None,
) -> list[Optimizer] | None:
    """The three steps: make the pipeline run ``balance`` with the state of ``optimizers`` (the
    user's; empty: carry no state) and of their ``schedulers`` carried along; ``rebuild()``
    then builds optimizers and schedulers over the new blocks (``configure_optimizers``; None:
    nothing to rebuild, outside fit), which get the state back. Returns what Lightning steps
    from now on (None: nothing was rebuilt)."""
    carried = carry_state(runtime, optimizers, schedulers)
    move_blocks(runtime, balance, carried)
    if rebuild is None:
        return None
    new_optimizers, new_schedulers = rebuild()
    stepped = restore_state(runtime, new_optimizers, carried)
    for scheduler, state in zip(new_schedulers, carried.schedulers, strict=False):
        scheduler.load_state_dict(state)
    return stepped


def hand_back(runtime: StageRuntime) -> str | None:
    """At the end of a Trainer call: the user's module holds the whole trained body again, on
    every rank (collective), so that ``model.state_dict()`` in the script is the whole model.
    A body built in ``configure_model`` (too large for one rank, by the user's choice), or one
    with a block that cannot travel, stays partial, and its ``state_dict()`` raises, naming the
    ways to save the whole model: returns why, or None."""
    body = runtime.body
    reason = "its blocks were built in configure_model" if body.built_on_meta else None
    if reason is None and runtime.options.fsdp:
        reason = "its blocks are sharded over the stage's replicas (fsdp=True)"
    reason = reason or restore_body(runtime)
    body.end_call(reason)
    return reason


def restore_body(runtime: StageRuntime) -> str | None:
    """Put the whole body back into the user's module on every rank, as an ``nn.Sequential``
    of every stage's trained blocks under their original names (collective; at the end of a
    Trainer call). Each rank moves its blocks to the CPU and sends them, pickled, to the other
    stages of its pipeline. Returns why the body stays partial instead (a block that cannot be
    pickled), or None."""
    t, body = runtime.topology, runtime.body
    found = _unmovable(body, body.indices, t.world_size)
    if found:
        return "a block cannot travel between processes: " + "; ".join(found)
    path = runtime.body_path
    mine = {i: body.block(i).to("cpu") for i in body.indices}
    blocks: dict[int, nn.Module] = {}
    if t.num_stages > 1:
        group = runtime.groups.pipeline
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, {i: packed(b) for i, b in mine.items()}, group=group)
        for part in gathered:
            blocks.update({i: unpacked(b) for i, b in part.items() if i not in mine})
    blocks.update(mine)  # this stage's own modules, not copies of them
    parent_path, _, attr = path.rpartition(".")
    parent = runtime.root.get_submodule(parent_path)
    if body.restore is not None:  # a model's body: the model object, holding every block
        whole = body.restore(blocks)
    else:
        whole = nn.Sequential(OrderedDict((str(i), blocks[i]) for i in sorted(blocks)))
    for tie in body.ties:  # the copies of a shared parameter are one parameter again
        # this stage's own copy where it has one (the optimizer steps it), else the primary's
        keep = next((u for u in tie.uses if u[0] in body.indices), tie.primary)
        share_parameter(whole, body.key_of(*keep), [body.key_of(*u) for u in tie.uses])
    setattr(parent, attr, whole)
    return None


def _names_param(key: str, prefix: str) -> bool:
    """Whether a flattened optimizer-state key (``state.<name>.<key>`` or
    ``param_groups.<name>.<key>``) belongs to a parameter whose name starts with ``prefix``."""
    for head in ("state.", "param_groups."):
        if key.startswith(head):
            return key[len(head) :].startswith(prefix)
    return False
