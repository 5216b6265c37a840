"""Optimizer state sharded across a stage's data-parallel replicas (ZeRO stage 1), by whole
parameter: ``Pipe2BWStrategy(data_parallel=d, shard_optimizer=True)``.

The d replicas of a stage hold the same parameters and, once their gradients are averaged, the
same gradients. Without sharding each of them runs the whole optimizer step and keeps the whole
optimizer state (AdamW's two moments, Muon's momentum, a delay correction's buffer): d copies of
the same numbers. With sharding every parameter has one owner among the replicas
(:func:`assign_owners`: the parameters balanced over the replicas by size, largest first); at
each update a replica steps only the parameters it owns, so the optimizer makes state for those
alone, and then every replica's updated parameters are gathered into every replica
(:meth:`ParameterShards.gather`, one all-gather per dtype), so that all of them go on with the
same weights.

A parameter is the unit, not a flat slice of the concatenated parameters, because that keeps
every optimizer exact without knowing its update rule: Muon orthogonalises each matrix whole, a
LAMB-like rule scales each tensor by its own norm, and every optimizer of ``torch.optim`` treats
each parameter on its own. The user's optimizer keeps every parameter in its param groups, so
schedulers, Lightning's clipping, the loss scaler and the gradient hooks see what they see on one
device; what it skips is the parameters whose gradient is hidden (``None``) while it steps
(:meth:`ParameterShards.updating_own`), as every torch optimizer skips a parameter without a
gradient. The price of the whole-parameter unit: the shares are as even as the parameters'
sizes allow (at most the largest parameter apart).

Gradients are averaged over the replicas with an all-reduce, as without sharding, so that every
replica holds the whole averaged gradient for clipping by the global norm and for the gradient
hooks; a reduce-scatter would send half as much, but leaves each replica the average of its own
parameters only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_pipe2bw.optim.wrapper import WrappedOptimizer

__all__ = ["ParameterShards", "ShardedOptimizer", "shard_problem"]


def assign_owners(sizes: Sequence[int], replicas: int) -> list[int]:
    """The replica that owns each parameter (by its number of elements ``sizes``): largest
    first, each to the replica that owns the fewest elements so far (the lowest on a tie), the
    longest-processing-time rule; every rank computes the same."""
    if replicas < 1:
        raise ValueError(f"replicas must be a positive int, got {replicas!r}")
    load = [0] * replicas
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(replicas), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


# optimizers whose state or step is not one parameter's at a time: they re-evaluate the loss
# (L-BFGS keeps a history of the whole flat gradient), or already shard (torch's ZeRO)
_UNSHARDABLE = ("LBFGS", "ZeroRedundancyOptimizer")


def shard_problem(optimizer: Optimizer) -> str | None:
    """Why ``optimizer`` (the user's) cannot be sharded by parameter, or None if it can."""
    name = type(optimizer).__name__
    if name in _UNSHARDABLE:
        return (
            f"{name} does not update each parameter on its own (its state spans all of them), "
            "so its state cannot be split by parameter over the replicas; use "
            "shard_optimizer=False with it, or an optimizer such as AdamW, SGD or MuonAdamW"
        )
    return None


class ParameterShards:
    """Which replica of a stage updates each of the stage's ``params`` (see the module notes):
    ``replicas`` replicas in ``group``, this one number ``index`` among them."""

    def __init__(self, params: Sequence[Tensor], group: Any, replicas: int, index: int) -> None:
        self.params = list(params)
        self.group = group
        self.replicas = replicas
        self.index = index
        self.owner = assign_owners([p.numel() for p in self.params], replicas)
        self._others = [p for p, r in zip(self.params, self.owner, strict=True) if r != index]

    @contextlib.contextmanager
    def updating_own(self) -> Iterator[None]:
        """While it runs, the parameters other replicas own have no gradient: the optimizer (and
        a delay correction) steps and keeps state for this replica's alone."""
        held = [(p, p.grad) for p in self._others]
        for p in self._others:
            p.grad = None
        try:
            yield
        finally:
            for p, grad in held:
                p.grad = grad

    @torch.no_grad()
    def gather(
        self, tensors: Sequence[Tensor] | None = None, params: Sequence[Tensor] | None = None
    ) -> None:
        """Give every replica the values each owner holds (collective over the replicas): the
        parameters after an update, or ``tensors``, one for each of ``params`` (the weights a
        delay correction predicted for them; a tensor of a parameter not sharded here, frozen,
        is left as it is). One all-gather per dtype and device, of flat buffers as long as the
        largest replica's share."""
        values: list[Tensor | None]
        if tensors is None:
            values = list(self.params)
        else:
            given = list(tensors)
            order = list(self.params if params is None else params)
            if len(given) != len(order):
                raise ValueError(
                    f"gather takes one tensor per parameter: {len(order)}, got {len(given)}"
                )
            at = {id(p): t for p, t in zip(order, given, strict=True)}
            values = [at.get(id(p)) for p in self.params]
        kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, t in enumerate(values):
            if t is not None:
                kinds.setdefault((t.dtype, t.device), []).append(i)
        for (dtype, device), indices in kinds.items():
            by_owner: list[list[Tensor]] = [[] for _ in range(self.replicas)]
            for i in indices:
                value = values[i]
                assert value is not None
                by_owner[self.owner[i]].append(value)
            lengths = [sum(t.numel() for t in mine) for mine in by_owner]
            longest = max(lengths)
            if longest == 0:
                continue
            send = torch.zeros(longest, dtype=dtype, device=device)
            mine = by_owner[self.index]
            if mine:
                torch.cat([t.reshape(-1) for t in mine], out=send[: lengths[self.index]])
            received = [torch.empty_like(send) for _ in range(self.replicas)]
            dist.all_gather(received, send, group=self.group)
            for r, owned in enumerate(by_owner):
                if r == self.index:
                    continue
                offset = 0
                for t in owned:
                    n = t.numel()
                    t.copy_(received[r][offset : offset + n].view_as(t))
                    offset += n

    def drop_others(self, optimizer: Optimizer) -> None:
        """Forget the state of the parameters other replicas own (after loading a whole stage's
        state, or after torch's checkpoint helpers initialised it for every parameter)."""
        for p in self._others:
            optimizer.state.pop(p, None)

    def merged_state_dict(self, optimizer: Optimizer) -> dict[str, Any]:
        """The stage's whole optimizer state dict, as one replica without sharding has it: every
        replica's own entries, merged (collective over the replicas)."""
        local = optimizer.state_dict()
        everyone: list[Any] = [None] * self.replicas
        dist.all_gather_object(everyone, local["state"], group=self.group)
        state: dict[int, Any] = {}
        for part in everyone:
            state.update(part)
        return {"state": dict(sorted(state.items())), "param_groups": local["param_groups"]}


class ShardedOptimizer(WrappedOptimizer):
    """The user's optimizer under a flush schedule with ``shard_optimizer``: Lightning steps it
    once per batch; it steps the parameters this replica owns, then gathers every replica's
    (2BW and PipeDream shard inside their own wrapper, ``runtime.versions.TwoBWOptimizer``)."""

    def __init__(self, optimizer: Optimizer, shards: ParameterShards) -> None:
        super().__init__(optimizer)
        self.shards = shards

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        with self.shards.updating_own():
            self.optimizer.step()
        self.shards.gather()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        self.shards.drop_others(self.optimizer)
