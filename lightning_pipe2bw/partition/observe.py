"""A model's structure as its forward runs it: which of its modules run before its layer list,
which after, and whether each layer keeps to its own modules.

The split of a model that is not an ``nn.Sequential`` (``partition.pipemodel``) puts what runs
before the layers on the first stage and what runs after them on the last. Registration order
does not say which is which (OPT registers its final norm before its layers); one forward, watched
with module hooks, does. :func:`observe` runs it on one micro-batch at set-up;
:func:`compare_outputs` is the guard that the split model computes what the whole model does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

__all__ = ["TURN_OFF", "Observation", "SplitError", "compare_outputs", "evaluating", "observe"]

# how a user turns the guard off, named by every error of it
TURN_OFF = "Pipe2BWStrategy(check_split=False) (strategy.check_split=false in a config)"


class SplitError(ValueError):
    """A model does something the pipeline split cannot carry, or its split computes something
    else than the whole model."""


@dataclass
class Observation:
    """What one forward of a model showed about it (paths are dotted paths in the model)."""

    before: list[str] = field(default_factory=list)  # parts that ran before the first layer
    after: list[str] = field(default_factory=list)  # parts that ran after the last layer
    idle: list[str] = field(default_factory=list)  # parts with parameters that did not run
    layer_tuple: int = 0  # a layer's output: 0 a tensor, n a tuple of n (hidden first)
    output: Any = None  # what the model returned
    # what the forward passed each layer: (positional, keyword) arguments, by layer index
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)


@dataclass
class _Trace:
    count: int  # the layers in the list
    started: int = 0
    finished: int = 0
    current: int | None = None  # the layer running now
    order: list[int] = field(default_factory=list)  # layer indices in the order they ran
    phases: dict[str, set[str]] = field(default_factory=dict)  # module path -> when it ran
    strays: list[tuple[int, str]] = field(default_factory=list)  # (layer, module outside it)
    layer_tuple: int = 0
    calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict)

    def phase(self) -> str:
        if self.started == 0:
            return "before"
        return "after" if self.finished >= self.count else "between"


def observe(model: nn.Module, blocks: str, call: Callable[[], Any]) -> Observation:
    """Run ``call()`` (one forward of ``model``) with hooks on every module of ``model`` and say,
    for each part that is not the layer list ``blocks`` nor a module the layer list sits in,
    whether it ran before the first layer or after the last. Raises :class:`SplitError` where
    the forward does something a split cannot carry: no call of the layers, layers out of order
    or twice, a layer that calls a module with parameters outside it (a shared module), a part
    with parameters that runs both before and after the layers, or between two of them. A
    module without parameters (a dropout, a rotary table) stays on every stage, so it may run
    anywhere."""
    layers = model.get_submodule(blocks)
    index = {id(layer): i for i, layer in enumerate(layers.children())}
    names = list(layers._modules)  # the layers' names in the list, by index
    # the modules the list sits in (the model, the base model, an encoder): their forward spans
    # the layers' calls, so they are containers, not parts
    heads = blocks.split(".")
    containers = {""} | {".".join(heads[:k]) for k in range(1, len(heads) + 1)}
    trace = _Trace(len(index))
    handles = []

    def before_layer(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            trace.started += 1
            trace.current = i
            trace.order.append(i)
            trace.calls.setdefault(i, (tuple(args), dict(kwargs)))

        return hook

    def after_layer(module: nn.Module, args: Any, output: Any) -> None:
        trace.finished += 1
        trace.current = None
        trace.layer_tuple = len(output) if isinstance(output, tuple) else 0

    def before_part(path: str, holds: bool) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if trace.current is not None:
                inside = path.startswith(f"{blocks}.{names[trace.current]}.")
                if not inside and holds:  # a module without parameters is on every stage
                    trace.strays.append((trace.current, path))
                return
            trace.phases.setdefault(path, set()).add(trace.phase())

        return hook

    for path, module in model.named_modules():
        if path in containers:
            continue
        if id(module) in index and path == f"{blocks}.{names[index[id(module)]]}":
            hook = before_layer(index[id(module)])
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            handles.append(module.register_forward_hook(after_layer))
        else:
            holds = any(True for _ in module.parameters())
            handles.append(module.register_forward_pre_hook(before_part(path, holds)))
    try:
        output = call()
    finally:
        for handle in handles:
            handle.remove()
    return _conclude(model, blocks, containers, trace, output)


def _conclude(
    model: nn.Module, blocks: str, containers: set[str], trace: _Trace, output: Any
) -> Observation:
    name = type(model).__name__
    n = trace.count
    if trace.started == 0:
        raise SplitError(
            f"{name}.forward did not call its layers {blocks!r} on the first micro-batch: the "
            "split runs a model whose forward calls its layer list; describe it with "
            "PipeModel(model, blocks=..., pre=[...], post=[...]) and an `embed` function"
        )
    if trace.order != list(range(n)):
        shown = trace.order if len(trace.order) <= 12 else [*trace.order[:12], "..."]
        raise SplitError(
            f"{name}.forward called its {n} layers {blocks!r} in the order {shown}, not once "
            "each in order: the pipeline runs each layer once, in its list's order; describe "
            "the model with PipeModel and an order its forward keeps"
        )
    if trace.strays:
        layer, path = trace.strays[0]
        more = f" (and {len(trace.strays) - 1} more)" if len(trace.strays) > 1 else ""
        raise SplitError(
            f"layer {layer} of {name} ({blocks!r}) calls {path!r}, which is not part of it{more}: "
            "a layer that uses a module outside it (a module shared by layers) cannot be split "
            "over stages; describe the model with PipeModel, keeping the shared module in "
            "`pre` or `post`, or train it on one device"
        )
    calls = [trace.calls[i] for i in range(n)]
    seen = Observation(layer_tuple=trace.layer_tuple, output=output, calls=calls)
    _sort(model, "", blocks, containers, trace.phases, seen)
    return seen


def _phases_under(path: str, phases: dict[str, set[str]]) -> set[str]:
    found: set[str] = set()
    for p, when in phases.items():
        if p == path or p.startswith(path + "."):
            found |= when
    return found


def _sort(
    model: nn.Module,
    prefix: str,
    blocks: str,
    containers: set[str],
    phases: dict[str, set[str]],
    seen: Observation,
) -> None:
    """Put each child of the container at ``prefix`` (and, through containers, their children)
    in ``before``, ``after`` or ``idle``; a part that ran in several phases is split into its
    children when it was not called itself, else refused."""
    parent = model.get_submodule(prefix) if prefix else model
    for child_name, child in parent.named_children():
        if child is None:
            continue
        path = f"{prefix}.{child_name}" if prefix else child_name
        if path == blocks:
            continue
        if path in containers:
            _sort(model, path, blocks, containers, phases, seen)
            continue
        when = _phases_under(path, phases)
        holds = any(True for _ in child.parameters())
        if not when:
            if holds:
                seen.idle.append(path)
            continue
        if when == {"before"} or (not holds and "before" in when):
            seen.before.append(path)  # without parameters a part stays on every stage too
        elif when == {"after"} or not holds:
            seen.after.append(path)
        elif path not in phases and any(True for _ in child.children()):
            _sort(model, path, blocks, containers, phases, seen)  # a holder: look inside
        else:
            ran = " and ".join(sorted(when))
            raise SplitError(
                f"{path!r} of {type(model).__name__} runs {ran} the layers: the split puts a "
                "part on the first stage (before the layers) or the last (after them), not both"
                "; describe the model with PipeModel, or give the part a copy for each use"
            )


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (dropout off, batch norm's running statistics read, not updated)
    with the random number generators' states put back afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        model.eval()
        try:
            yield
        finally:
            for m, mode in modes:
                m.training = mode


def _tensors(output: Any) -> dict[str, Tensor]:
    """The tensors of a model's output by name: a ``ModelOutput``'s or dict's keys, a tuple's
    positions."""
    if isinstance(output, Tensor):
        return {"output": output}
    if isinstance(output, dict):  # ModelOutput is an OrderedDict
        items: Any = output.items()
    elif isinstance(output, (tuple, list)):
        items = enumerate(output)
    else:
        leaves, _ = tree_flatten(output)
        items = enumerate(leaves)
    return {str(k): v for k, v in items if isinstance(v, Tensor)}


def compare_outputs(whole: Any, split: Any, rtol: float = 1e-4, atol: float = 1e-5) -> list[str]:
    """What differs between the whole model's output and the split model's: each tensor both
    have (``loss``, ``logits``) that differs beyond the tolerances, or a tensor only one has."""
    a, b = _tensors(whole), _tensors(split)
    problems = []
    for key in a.keys() & b.keys():
        x, y = a[key], b[key]
        if x.shape != y.shape:
            problems.append(f"{key}: shape {tuple(y.shape)}, not {tuple(x.shape)}")
        elif not torch.allclose(y.float(), x.float().to(y.device), rtol=rtol, atol=atol):
            diff = (y.double() - x.double().to(y.device)).abs().max().item()
            problems.append(f"{key}: max |difference| {diff:.3g}")
    if not a.keys() & b.keys():
        problems.append(
            f"no output in common (the whole model returned {sorted(a) or 'no tensor'}, the "
            f"split {sorted(b) or 'no tensor'})"
        )
    return sorted(problems)
