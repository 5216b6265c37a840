"""Running a block at a weight version other than its live parameters (2BW's versions, a
prediction's view): the weights split by block, and each block called with its tensors in
place of its parameters."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from lightning_pipe2bw.runtime.call import call_input

__all__ = ["call_block", "call_on", "weights_by_block"]


def weights_by_block(
    weights: Mapping[str, Tensor], ties: Iterable[Any], indices: Iterable[int]
) -> dict[int, dict[str, Tensor]]:
    """``weights`` (names as in a stage body's ``named_parameters()``: ``"<block>.<name in
    block>"``) split by block, with each tied weight (``ties``: ``partition.ties.Tie``) also
    under its names in the later blocks of ``indices`` that use it."""
    out: dict[int, dict[str, Tensor]] = {}
    for key, value in weights.items():
        head, _, local = key.partition(".")
        out.setdefault(int(head), {})[local] = value
    for index, aliases in _tie_aliases(ties, indices).items():
        for local, source in aliases:
            out.setdefault(index, {})[local] = weights[source]
    return out


def _tie_aliases(ties: Iterable[Any], indices: Iterable[int]) -> dict[int, list[tuple[str, str]]]:
    """Block -> ``(name in the block, weight name)`` for the uses of a parameter that an
    earlier block of the stage holds too: the weights of a version are named once (as in
    ``named_parameters()``), under the stage's first use."""
    here = set(indices)
    out: dict[int, list[tuple[str, str]]] = {}
    for tie in ties:
        mine = [(b, n) for b, n in tie.uses if b in here]
        for block, name in mine[1:]:
            out.setdefault(block, []).append((name, f"{mine[0][0]}.{mine[0][1]}"))
    return out


def call_on(
    x: Any, block: nn.Module, weights: Mapping[str, Tensor] | None, call: Any = None
) -> Any:
    return call_block(block, weights, x, call)


def call_block(
    block: nn.Module, weights: Mapping[str, Tensor] | None, x: Any, call: Any = None
) -> Any:
    with call_input(block, call):
        if weights is None:
            return block(x)
        with parameters_replaced(block, weights):
            return block(x)


@contextmanager
def parameters_replaced(block: nn.Module, weights: Mapping[str, Tensor]) -> Iterator[None]:
    """Inside the block, ``block``'s parameters named in ``weights`` (names as in
    ``block.named_parameters()``) are those tensors: what ``torch.func.functional_call(block,
    weights, strict=False)`` does around a call, tied parameters included (a parameter a block
    holds under several names takes its tensor under all of them). functional_call's general
    machinery costs tens of microseconds per call, and 2BW calls every block of every
    micro-batch with a weight version; this walks the block's modules once and swaps entries
    of their ``_parameters`` (as torch's own swap does), then puts the parameters back."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}  # id(parameter) -> where it is held
    held: dict[str, int] = {}  # every name of a parameter -> id(parameter)
    for prefix, module in block.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, attr))
                held[f"{prefix}.{attr}" if prefix else attr] = id(param)
    saved: list[tuple[nn.Module, str, Any]] = []
    try:
        for name, tensor in weights.items():
            if name not in held:
                raise KeyError(f"{type(block).__name__} has no parameter {name!r}")
            for module, attr in places[held[name]]:
                saved.append((module, attr, module._parameters[attr]))
                module._parameters[attr] = tensor  # type: ignore[assignment]
        yield
    finally:
        for module, attr, original in reversed(saved):
            module._parameters[attr] = original
