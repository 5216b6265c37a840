"""The split guard at every new shape: proof, on the micro-batch itself, that the split of a
model computes what the whole model computes.

A split model (``partition.pipemodel``) runs the model's own code at both ends: the first stage
runs the forward up to the layers with stand-ins for them and takes each layer's arguments from
it; the last stage runs the forward again with stand-ins for the layers and blanks for the first
stage's parts, and keeps what comes after the last layer. That is exact when three things hold,
and each can be tested on one micro-batch without the whole model:

1. no layer's arguments depend on what the layers compute: a second capture whose stand-ins
   return other values (their input plus noise, markers for the other values a layer returns)
   passes every layer the same arguments;
2. the forward hands each layer's output to the next layer unchanged (nothing runs between two
   layers on the hidden state): in that second capture each stand-in receives what the previous
   one returned;
3. the end of the forward reads no output of the first stage's parts: a second replay with
   random values in the blanks returns the same output.

What the forward does can depend on the shapes of its inputs (a sliding window shorter than the
sequence, padding, a branch for long inputs), so the guard runs on every micro-batch whose
shapes (or plain arguments) are new to the stage: once per shape, not per step. Both second runs
are taken without gradient, with the random state and the parts' buffers as the first run left
them, so that training is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from lightning_pipe2bw.partition.carry import LayerCall, Pending

__all__ = [
    "call_problems",
    "describe",
    "kept_buffers",
    "observed_problems",
    "rewound",
    "rng_state",
    "shape_key",
]

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def shape_key(args: tuple[Any, ...], kwargs: dict[str, Any], training: bool) -> tuple[Any, ...]:
    """What the guard keys a micro-batch by: the shape and dtype of each tensor of the call, its
    plain values and the mode; the values of the tensors are not part of it (the stand-ins' runs
    compute every layer's arguments from each micro-batch's own values)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (
        training,
        str(spec),
        tuple(
            (tuple(x.shape), x.dtype)
            if isinstance(x, Tensor)
            else (x if type(x) in _PLAIN else type(x).__name__)
            for x in leaves
        ),
    )


def describe(key: tuple[Any, ...]) -> str:
    """The shapes of a :func:`shape_key`, for messages."""
    shapes = [list(x[0]) for x in key[2] if isinstance(x, tuple) and len(x) == 2]
    return f"input shapes {shapes}"


@contextmanager
def rewound(state: tuple[Tensor, list[Tensor]], devices: list[int]) -> Iterator[None]:
    """The random state ``state`` (CPU, and each CUDA device of ``devices``) during the block,
    the state from before it afterwards."""
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        for device, cuda_state in zip(devices, state[1], strict=True):
            torch.cuda.set_rng_state(cuda_state, device)
        yield


def rng_state(devices: list[int]) -> tuple[Tensor, list[Tensor]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


@contextmanager
def kept_buffers(module: nn.Module) -> Iterator[None]:
    """``module``'s buffers (batch norm's running statistics) as they were before the block."""
    saved = [(b, b.detach().clone()) for b in module.buffers() if not b.is_meta]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _name(position: int | str) -> str:
    return f"argument {position}" if isinstance(position, int) else f"{position}="


def _arguments(call: LayerCall) -> dict[int | str, Any]:
    args, kwargs, _ = call
    named: dict[int | str, Any] = {i + 1: a for i, a in enumerate(args)}
    named.update(kwargs)
    return named


def _differs(a: Any, b: Any) -> str | None:
    """How the argument ``b`` of the probe differs from ``a`` of the capture, or None."""
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb:
        return "has another structure"
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, Pending) or isinstance(y, Pending):
            if x != y:
                return f"changes with what the layers before it return ({x!r}, then {y!r})"
        elif isinstance(x, Tensor) and isinstance(y, Tensor):
            if x.shape != y.shape or not torch.allclose(
                x.detach().double(), y.detach().double(), rtol=1e-5, atol=1e-6, equal_nan=True
            ):
                return "changes with what the layers before it compute"
        elif isinstance(x, Tensor) or isinstance(y, Tensor):
            return "changes with what the layers before it compute"
        elif type(x) in _PLAIN and x != y:
            return f"changes with what the layers before it compute ({x!r}, then {y!r})"
    return None


def call_problems(
    capture: Mapping[int, LayerCall], probe: Mapping[int, LayerCall], problems: list[str]
) -> list[str]:
    """What makes a split wrong, from a capture's calls and a probe's, by layer (see the module
    notes)."""
    found = list(problems)
    for j in sorted(capture):
        a, b = capture[j], probe.get(j)
        if b is None:
            found.append(f"layer {j} is not called when the layers compute other values")
            continue
        if a[2] != b[2]:
            found.append(f"layer {j} takes its hidden state by another keyword")
        named_a, named_b = _arguments(a), _arguments(b)
        for position in named_a.keys() | named_b.keys():
            if position not in named_a or position not in named_b:
                found.append(f"layer {j}'s {_name(position)} is passed only sometimes")
                continue
            why = _differs(named_a[position], named_b[position])
            if why is not None:
                found.append(f"layer {j}'s {_name(position)} {why}")
    return found


def observed_problems(layer: int, whole: LayerCall, split: LayerCall) -> list[str]:
    """Where layer ``layer``'s call in the split (``split``) differs from its call when the
    whole model runs (``whole``)."""
    found = []
    named_a, named_b = _arguments(whole), _arguments(split)
    for position in sorted(named_a.keys() | named_b.keys(), key=str):
        a, b = named_a.get(position), named_b.get(position)
        if _differs(a, b) is not None:
            found.append(
                f"layer {layer}'s {_name(position)} is {_shown(a)} in the whole model, "
                f"{_shown(b)} in the split"
            )
    return found


def _shown(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"({', '.join(_shown(v) for v in value)})"
    return repr(value)
