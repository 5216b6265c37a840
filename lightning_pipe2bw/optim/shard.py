"""Optimizer state sharded across a stage's data-parallel replicas (ZeRO stage 1):
``Pipe2BWStrategy(data_parallel=d, shard_optimizer=True)``.

The d replicas of a stage hold the same parameters and, once their gradients are averaged, the
same gradients. Without sharding each of them runs the whole optimizer step and keeps the whole
optimizer state (AdamW's two moments, Muon's momentum, a delay correction's buffer): d copies of
the same numbers. With sharding every element of every parameter has one owner among the
replicas (:func:`layout`); at each update a replica steps only what it owns, so the optimizer
makes state for that alone, and then every replica's updated values are gathered into every
replica (:meth:`ParameterShards.gather`, one all-gather per dtype), so that all of them go on
with the same weights.

What a replica owns depends on what the optimizer's step needs, per param group:

- **By elements**, for the optimizers that update each element from that element's gradient and
  state alone (:data:`ELEMENTWISE`: AdamW, Adam, SGD with or without momentum, ...; and the
  AdamW groups of ``MuonAdamW``), as DeepSpeed's ZeRO-1 and Megatron's distributed optimizer
  shard a flat buffer. A stage's parameters of one dtype, concatenated in order, are cut into d
  contiguous ranges, so every replica holds 1/d of their state plus at most one alignment unit,
  however unevenly the elements are spread over the parameters (one embedding matrix dominates
  the first stage of a language model). A cut may fall inside a parameter: the replicas that own
  part of it step a 1-D view of their part, with the matching view of its gradient, and keep
  state of their part's size. The result is the same to the bit: each element sees the same
  arithmetic, and a cut lies a multiple of :data:`ALIGNMENT` elements from its parameter's start,
  so every element keeps its place in the kernels' vector lanes.
- **Whole**, for everything else: Muon orthogonalises each matrix whole (Newton-Schulz needs
  it), a LAMB-like rule scales each tensor by its own norm, Adafactor factors a matrix's second
  moment by rows and columns, and an optimizer this module does not know may do any of these.
  Each such parameter has one owner, balanced by size (largest first), and the ranges by
  elements are then cut around them so that every replica's total is as even as possible.

The user's optimizer keeps every parameter in its param groups, so schedulers, Lightning's
clipping, the loss scaler and the gradient hooks see what they see on one device. Only while it
steps (:meth:`ParameterShards.updating_own`) do its groups hold this replica's parts, with the
others' gradients hidden (``None``), as every torch optimizer skips a parameter without a
gradient; outside a step its state is keyed by the user's parameters, each entry the size of this
replica's part. Checkpoints hold the unsharded state (:meth:`ParameterShards.whole_state` joins
the parts of a parameter cut between replicas), so they are the files an unsharded run writes
and resume under any number of replicas.

Gradients are averaged over the replicas with an all-reduce, as without sharding, so that every
replica holds the whole averaged gradient for clipping by the global norm and for the gradient
hooks; a reduce-scatter would send half as much, but leaves each replica the average of its own
parameters only.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_pipe2bw.optim.wrapper import WrappedOptimizer

__all__ = ["ParameterShards", "ShardedOptimizer", "by_elements", "shard_problem"]

# elements: where a range of optimizer state ends inside a parameter, it ends a multiple of this
# from the parameter's start (256 bytes of fp32: every CPU vector width and a GPU's wide loads)
ALIGNMENT = 64

# the optimizers whose step treats every element on its own (its state per element, or per
# parameter and the same for every part: Adam's step count), by exact class: a subclass may change
# the step
ELEMENTWISE: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
)


def by_elements(optimizer: Optimizer, group: dict[str, Any]) -> bool:
    """Whether ``group``'s state can be sharded by elements (see the module notes)."""
    from lightning_pipe2bw.optim.muon import MuonAdamW

    if isinstance(optimizer, MuonAdamW):
        return not group["muon"]
    return type(optimizer) in ELEMENTWISE


def assign_owners(sizes: Sequence[int], replicas: int) -> list[int]:
    """The replica that owns each whole parameter (by its number of elements ``sizes``): largest
    first, each to the replica that owns the fewest elements so far (the lowest on a tie), the
    longest-processing-time rule; every rank computes the same."""
    return _assign(sizes, [0] * _positive(replicas))


def _positive(replicas: int) -> int:
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive int, got {replicas!r}")
    return replicas


def _assign(sizes: Sequence[int], load: list[int]) -> list[int]:
    """:func:`assign_owners` onto replicas that hold ``load`` already (updated in place)."""
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(len(load)), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def _fill(load: Sequence[int], total: int) -> list[int]:
    """How many of ``total`` elements each replica takes so that the largest of ``load`` plus
    its share is as small as it can be (water filling); the shares sum to ``total``."""
    order = sorted(range(len(load)), key=lambda r: (load[r], r))
    level = 0.0
    taking = order
    for k in range(1, len(order) + 1):
        level = (total + sum(load[r] for r in order[:k])) / k
        if k == len(order) or level <= load[order[k]]:
            taking = order[:k]
            break
    shares = [0] * len(load)
    for r in taking:
        shares[r] = max(0, math.floor(level - load[r]))
    for r in taking[: total - sum(shares)]:  # what flooring left: one more each, lowest load first
        shares[r] += 1
    return shares


Segment = tuple[int, int, int]  # (replica, start, end) of a parameter's flattened elements


def layout(
    sizes: Sequence[int],
    whole: Sequence[bool],
    kinds: Sequence[Hashable],
    replicas: int,
    align: int = ALIGNMENT,
) -> list[tuple[Segment, ...]]:
    """For each parameter (``sizes``: its number of elements; ``whole``: whether it must stay
    whole; ``kinds``: its dtype and device, which share one flat buffer), the ranges of its
    flattened elements each replica owns, in order. Per kind: the whole parameters are assigned
    largest first; the others, concatenated in order, are cut into one contiguous range per
    replica, sized so that every replica's total is as even as possible, each cut moved up to a
    multiple of ``align`` from the start of the parameter it falls in. Every rank computes the
    same."""
    replicas = _positive(replicas)
    segments: list[tuple[Segment, ...]] = [() for _ in sizes]
    for kind in dict.fromkeys(kinds):
        members = [i for i, k in enumerate(kinds) if k == kind]
        load = [0] * replicas
        held = [i for i in members if whole[i]]
        for i, r in zip(held, _assign([sizes[i] for i in held], load), strict=True):
            segments[i] = ((r, 0, sizes[i]),)
        flat = [i for i in members if not whole[i]]
        shares = _fill(load, sum(sizes[i] for i in flat))
        cuts = _snapped(list(itertools.accumulate(shares)), [sizes[i] for i in flat], align)
        bounds = [0, *cuts]
        base = 0
        for i in flat:
            n = sizes[i]
            segments[i] = tuple(
                (r, max(lo, base) - base, min(hi, base + n) - base)
                for r, (lo, hi) in enumerate(itertools.pairwise(bounds))
                if max(lo, base) < min(hi, base + n)
            )
            base += n
    return segments


def _snapped(cuts: list[int], sizes: list[int], align: int) -> list[int]:
    """``cuts`` (positions in the concatenation of parameters of ``sizes``) each moved up to the
    next multiple of ``align`` from the start of the parameter it falls in (or its end)."""
    out: list[int] = []
    base, k = 0, 0
    for cut in cuts:
        while k < len(sizes) and base + sizes[k] <= cut:
            base += sizes[k]
            k += 1
        if k == len(sizes) or cut == base:
            out.append(cut)
        else:
            out.append(base + min(sizes[k], -(-(cut - base) // align) * align))
    return out


# optimizers whose state or step is not one parameter's at a time: they re-evaluate the loss
# (L-BFGS keeps a history of the whole flat gradient), or already shard (torch's ZeRO)
_UNSHARDABLE = ("LBFGS", "ZeroRedundancyOptimizer")


def shard_problem(optimizer: Optimizer) -> str | None:
    """Why ``optimizer`` (the user's) cannot be sharded, or None if it can."""
    name = type(optimizer).__name__
    if name in _UNSHARDABLE:
        return (
            f"{name} does not update each parameter on its own (its state spans all of them), "
            "so its state cannot be split by parameter over the replicas; use "
            "shard_optimizer=False with it, or an optimizer such as AdamW, SGD or MuonAdamW"
        )
    return None


def _flat(tensor: Tensor) -> Tensor:
    """``tensor``'s elements as a 1-D view (a parameter cut between replicas is contiguous)."""
    return tensor.view(-1)


class ParameterShards:
    """Which replica of a stage updates which elements of the stage's ``params`` (see the module
    notes): ``replicas`` replicas in ``group``, this one number ``index`` among them; ``whole``:
    for each parameter, whether it must stay whole (default: every one)."""

    def __init__(
        self,
        params: Sequence[Tensor],
        group: Any,
        replicas: int,
        index: int,
        whole: Sequence[bool] | None = None,
    ) -> None:
        self.params = list(params)
        self.group = group
        self.replicas = replicas
        self.index = index
        keep = [True] * len(self.params) if whole is None else list(whole)
        # whether each parameter stays whole (only a contiguous one has a 1-D view of a part)
        self.whole = [k or not p.is_contiguous() for k, p in zip(keep, self.params, strict=True)]
        self.segments = layout(
            [p.numel() for p in self.params],
            self.whole,
            [(p.dtype, p.device) for p in self.params],
            replicas,
        )
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # this replica's (start, end) of each parameter, None where it owns none of it
        self.mine: list[tuple[int, int] | None] = [
            next(((a, b) for r, a, b in segments if r == index), None)
            for segments in self.segments
        ]

    def owned_elements(self) -> int:
        """How many of the stage's parameter elements this replica updates."""
        return sum(b - a for a, b in filter(None, self.mine))

    def _part(self, i: int, tensor: Tensor) -> Tensor | None:
        """This replica's part of ``tensor`` (parameter ``i``'s or one of its size): the tensor
        itself where it owns all of it, a 1-D view of its part, or None."""
        span = self.mine[i]
        if span is None:
            return None
        a, b = span
        return tensor if (a, b) == (0, tensor.numel()) else _flat(tensor)[a:b]

    def own(self, tensors: Sequence[Tensor], params: Sequence[Tensor]) -> list[Tensor]:
        """This replica's parts of ``tensors`` (one for each of ``params``, in that order): for
        the parameters it owns any of, and whole for those not sharded here (frozen), in the
        order of the parameters a delay correction steps under :meth:`updating_own`."""
        index = self._index
        parts = [
            self._part(index[id(p)], t) if id(p) in index else t
            for t, p in zip(tensors, params, strict=True)
        ]
        return [part for part in parts if part is not None]

    @contextlib.contextmanager
    def updating_own(self, optimizer: Optimizer, correction: Any = None) -> Iterator[None]:
        """While it runs, ``optimizer`` (and the delay correction ``correction``, if given)
        steps and keeps state for this replica's parts alone: the parameters other replicas own
        have no gradient, and a parameter owned in part is replaced in the param groups by a view
        of the part, with its gradient's part and its state (moved back afterwards)."""
        hidden = [(p, p.grad) for p, span in zip(self.params, self.mine, strict=True) if not span]
        for p, _ in hidden:
            p.grad = None
        with self._parts(optimizer, correction, grads=True):
            try:
                yield
            finally:
                for p, grad in hidden:
                    p.grad = grad

    @contextlib.contextmanager
    def predicting(self, optimizer: Optimizer, correction: Any) -> Iterator[None]:
        """While it runs, ``correction`` predicts weights for this replica's parts alone (their
        state is the optimizer's for those parts): see :meth:`own` for the tensors it writes."""
        with self._parts(optimizer, correction, grads=False):
            yield

    @contextlib.contextmanager
    def _parts(self, optimizer: Optimizer, correction: Any, grads: bool) -> Iterator[None]:
        state = optimizer.state
        parts: dict[int, tuple[Tensor, Tensor]] = {}  # id(param) -> (param, its part's view)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                span = self.mine[i]
                if span is None or span == (0, p.numel()):
                    continue
                part = _flat(p.detach())[span[0] : span[1]]
                if grads and p.grad is not None:
                    part.grad = p.grad.reshape(-1)[span[0] : span[1]]
                if p in state:
                    state[part] = state.pop(p)
                parts[id(p)] = (p, part)
        groups = [(g, g["params"]) for g in optimizer.param_groups]
        for g, params in groups:
            g["params"] = [parts[id(p)][1] if id(p) in parts else p for p in params]
        stepping: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if correction is not None:  # its parameters: the parts owned here, and any not sharded
            others = {id(p) for p, span in zip(self.params, self.mine, strict=True) if not span}
            stepping = correction.stepping(
                [parts[id(p)][1] if id(p) in parts else p for p in correction.params
                 if id(p) not in others]
            )  # fmt: skip
        try:
            with stepping:
                yield
        finally:
            for g, params in groups:
                g["params"] = params
            for p, part in parts.values():
                if part in state:
                    state[p] = state.pop(part)
                part.grad = None

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
            by_owner: list[list[tuple[Tensor, int, int]]] = [[] for _ in range(self.replicas)]
            for i in indices:
                value = values[i]
                assert value is not None
                for r, a, b in self.segments[i]:
                    by_owner[r].append((value, a, b))
            lengths = [sum(b - a for _, a, b in owned) for owned in by_owner]
            longest = max(lengths)
            if longest == 0:
                continue
            send = torch.zeros(longest, dtype=dtype, device=device)
            mine = by_owner[self.index]
            if mine:
                torch.cat([t.reshape(-1)[a:b] for t, a, b in mine], out=send[: lengths[self.index]])
            received = [torch.empty_like(send) for _ in range(self.replicas)]
            dist.all_gather(received, send, group=self.group)
            for r, owned in enumerate(by_owner):
                if r == self.index:
                    continue
                offset = 0
                for t, a, b in owned:
                    chunk = received[r][offset : offset + b - a]
                    if (a, b) == (0, t.numel()):
                        t.copy_(chunk.view_as(t))
                    else:
                        _flat(t)[a:b].copy_(chunk)
                    offset += b - a

    def keep_own(self, optimizer: Optimizer) -> None:
        """Keep only this replica's state (after loading a whole stage's state, or after torch's
        checkpoint helpers initialised it for every parameter): forget the parameters other
        replicas own, and cut a parameter owned in part to its part."""
        state = optimizer.state
        for p, span in zip(self.params, self.mine, strict=True):
            if span is None:
                state.pop(p, None)
            elif span != (0, p.numel()) and p in state:
                # a new dict: a state dict taken meanwhile holds the old one, whole
                state[p] = {
                    key: value.reshape(-1)[span[0] : span[1]].clone()
                    if isinstance(value, Tensor) and value.shape == p.shape
                    else value
                    for key, value in state[p].items()
                }

    @contextlib.contextmanager
    def whole_state(self, optimizer: Optimizer) -> Iterator[None]:
        """While it runs, the state of a parameter cut between replicas is whole on each of
        them, as without sharding (collective over the replicas, on entry): what a checkpoint
        saves. On exit this replica keeps its own again (:meth:`keep_own`), also of the state
        torch's checkpoint helpers made meanwhile for every parameter."""
        split = [i for i, segments in enumerate(self.segments) if len(segments) > 1]
        if split:
            self._join(optimizer, split)
        try:
            yield
        finally:
            self.keep_own(optimizer)

    def _join(self, optimizer: Optimizer, split: list[int]) -> None:
        """Make the state of the parameters ``split`` (cut between replicas) whole on each
        replica that holds part of it (collective over the replicas)."""
        state = optimizer.state
        local = {
            i: {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in entries.items()}
            for i in split
            if self.mine[i] and (entries := state.get(self.params[i]))
        }
        everyone: list[Any] = [None] * self.replicas
        dist.all_gather_object(everyone, local, group=self.group)
        for i in split:
            p = self.params[i]
            if i not in local:
                continue
            parts = [everyone[r].get(i) for r, _, _ in self.segments[i]]
            if any(part is None for part in parts):
                raise RuntimeError(
                    f"shard_optimizer: the replicas disagree on which hold optimizer state for a "
                    f"parameter of shape {tuple(p.shape)}; its state cannot be joined"
                )
            entries = dict(state[p])
            for key, value in state[p].items():
                pieces = [part.get(key) for part in parts]
                if isinstance(value, Tensor) and all(
                    isinstance(x, Tensor) and x.dim() == 1 and x.numel() == b - a
                    for x, (_, a, b) in zip(pieces, self.segments[i], strict=True)
                ):
                    joined = torch.cat(pieces).view(p.shape)
                    entries[key] = joined.to(device=value.device, dtype=value.dtype)
            state[p] = entries

    def merged_state_dict(self, optimizer: Optimizer) -> dict[str, Any]:
        """The stage's whole optimizer state dict, as one replica without sharding has it: every
        replica's own entries, merged (collective over the replicas)."""
        with self.whole_state(optimizer):
            local = optimizer.state_dict()
        everyone: list[Any] = [None] * self.replicas
        dist.all_gather_object(everyone, local["state"], group=self.group)
        state: dict[int, Any] = {}
        for part in everyone:
            state.update(part)
        return {"state": dict(sorted(state.items())), "param_groups": local["param_groups"]}


class ShardedOptimizer(WrappedOptimizer):
    """The user's optimizer under a flush schedule with ``shard_optimizer``: Lightning steps it
    once per batch; it steps the parts this replica owns, then gathers every replica's (2BW and
    PipeDream shard inside their own wrapper, ``runtime.versions.TwoBWOptimizer``)."""

    def __init__(self, optimizer: Optimizer, shards: ParameterShards) -> None:
        super().__init__(optimizer)
        self.shards = shards

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        with self.shards.updating_own(self.optimizer):
            self.optimizer.step()
        self.shards.gather()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        self.shards.keep_own(self.optimizer)
