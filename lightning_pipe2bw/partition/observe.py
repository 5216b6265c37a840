"""A model's structure as its forward runs it: which of its modules run before its layer list,
which after, and whether each layer keeps to its own modules.

The split of a model that is not an ``nn.Sequential`` (``partition.pipemodel``) puts what runs
before the layers on the first stage and what runs after them on the last. Registration order
does not say which is which (OPT registers its final norm before its layers); one forward, watched
with module hooks, does. :func:`observe` runs it on one micro-batch at set-up;
:func:`compare_outputs` is the guard that the split model computes what the whole model does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

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
    # several layer lists: the parts that ran between list k and list k + 1, for each k
    between: list[list[str]] = field(default_factory=list)
    # what each list's layers returned: 0 a tensor, n a tuple of n (hidden first); and the
    # positions of that tuple that held a value (not None) besides the hidden state
    forms: dict[int, int] = field(default_factory=dict)
    markers: dict[int, tuple[int, ...]] = field(default_factory=dict)
    output: Any = None  # what the model returned
    # what the forward passed each layer (index over all lists): (positional, keyword) arguments
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    # trainable parameters no output of the forward depends on (the cross-attention of a
    # decoder used alone, a pooler a causal LM does not return): no gradient on one device
    # either; found where the forward ran with gradient
    unused: list[str] = field(default_factory=list)

    @property
    def layer_tuple(self) -> int:
        """What the first list's layers return (0 a tensor, n a tuple of n)."""
        return self.forms.get(0, 0)


@dataclass
class _Trace:
    counts: list[int]  # the layers in each list
    started: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    current: tuple[int, int] | None = None  # (list, layer) running now
    sequence: list[tuple[int, int]] = field(default_factory=list)  # (list, layer) as they ran
    phases: dict[str, set[int]] = field(default_factory=dict)  # module path -> when it ran
    strays: list[tuple[int, str]] = field(default_factory=list)  # (layer, module outside it)
    forms: dict[int, int] = field(default_factory=dict)
    markers: dict[int, set[int]] = field(default_factory=dict)
    calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.started = [0] * len(self.counts)
        self.finished = [0] * len(self.counts)

    def phase(self) -> int:
        """When a part runs: 2k before list k (2K after the last of K lists), 2k + 1 between two
        layers of list k."""
        k = 0
        while k < len(self.counts) and self.finished[k] >= self.counts[k]:
            k += 1
        if k < len(self.counts) and self.started[k]:
            return 2 * k + 1
        return 2 * k


def observe(model: nn.Module, blocks: str | Sequence[str], call: Callable[[], Any]) -> Observation:
    """Run ``call()`` (one forward of ``model``) with hooks on every module of ``model`` and say,
    for each part that is not a layer list ``blocks`` (one path, or several the forward runs one
    after the other) nor a module the lists sit in, whether it ran before the first layer,
    between two lists, or after the last layer. Raises :class:`SplitError` where the forward
    does something a split cannot carry: no call of the layers, layers out of order or twice, a
    layer that calls a module with parameters outside it (a shared module), a part with
    parameters that runs at two of those points, or between two layers of a list. A module
    without parameters (a dropout, a rotary table) stays on every stage, so it may run
    anywhere."""
    stacks = [blocks] if isinstance(blocks, str) else list(blocks)
    lists = [model.get_submodule(path) for path in stacks]
    index = {
        id(layer): (k, i)
        for k, layers in enumerate(lists)
        for i, layer in enumerate(layers.children())
    }
    names = [list(layers._modules) for layers in lists]  # the layers' names in each list
    offsets = [sum(len(n) for n in names[:k]) for k in range(len(names))]
    # the modules the lists sit in (the model, the base model, an encoder): their forward spans
    # the layers' calls, so they are containers, not parts
    containers = {""}
    for path in stacks:
        heads = path.split(".")
        containers |= {".".join(heads[:k]) for k in range(1, len(heads) + 1)}
    trace = _Trace([len(n) for n in names])
    handles = []

    def before_layer(k: int, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            trace.started[k] += 1
            trace.current = (k, i)
            trace.sequence.append((k, i))
            trace.calls.setdefault(offsets[k] + i, (tuple(args), dict(kwargs)))

        return hook

    def after_layer(k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            trace.finished[k] += 1
            trace.current = None
            if isinstance(output, (tuple, list)):  # a list too (OpenAI GPT's blocks)
                trace.forms[k] = len(output)
                held = {p for p in range(1, len(output)) if output[p] is not None}
                trace.markers.setdefault(k, set()).update(held)
            else:
                trace.forms[k] = 0

        return hook

    def before_part(path: str, holds: bool) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if trace.current is not None:
                k, i = trace.current
                inside = path.startswith(f"{stacks[k]}.{names[k][i]}.")
                if not inside and holds:  # a module without parameters is on every stage
                    trace.strays.append((offsets[k] + i, path))
                return
            trace.phases.setdefault(path, set()).add(trace.phase())

        return hook

    for path, module in model.named_modules():
        if path in containers:
            continue
        where = index.get(id(module))
        if where is not None and path == f"{stacks[where[0]]}.{names[where[0]][where[1]]}":
            hook = before_layer(*where)
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            handles.append(module.register_forward_hook(after_layer(where[0])))
        else:
            holds = any(True for _ in module.parameters())
            handles.append(module.register_forward_pre_hook(before_part(path, holds)))
    try:
        output = call()
    finally:
        for handle in handles:
            handle.remove()
    return _conclude(model, stacks, containers, trace, output)


def _conclude(
    model: nn.Module, stacks: list[str], containers: set[str], trace: _Trace, output: Any
) -> Observation:
    name = type(model).__name__
    expected = [(k, i) for k, n in enumerate(trace.counts) for i in range(n)]
    for k, path in enumerate(stacks):
        if trace.started[k] == 0:
            layers = model.get_submodule(path)
            nested = [
                type(layer).__name__
                for layer in layers.children()
                if isinstance(layer, (nn.ModuleList, nn.ModuleDict))
            ]
            why = (
                f"{path!r} holds lists of layers ({nested[0]} items), which the forward runs "
                "one list inside the other, with its own code between the lists (a stage's "
                "pooling or downsampling): the split takes one flat list of layers called in "
                "order"
                if nested
                else "the split runs a model whose forward calls its layer list"
            )
            raise SplitError(
                f"{name}.forward did not call its layers {path!r} on the first micro-batch: "
                f"{why}; describe it with PipeModel(model, blocks=..., pre=[...], post=[...]) "
                "and an `embed` function"
            )
    if trace.sequence != expected:
        for k, path in enumerate(stacks):
            order = [i for j, i in trace.sequence if j == k]
            if order != list(range(trace.counts[k])):
                shown = order if len(order) <= 12 else [*order[:12], "..."]
                raise SplitError(
                    f"{name}.forward called its {trace.counts[k]} layers {path!r} in the order "
                    f"{shown}, not once each in order: the pipeline runs each layer once, in "
                    "its list's order; describe the model with PipeModel and an order its "
                    "forward keeps"
                )
        raise SplitError(
            f"{name}.forward runs its layer lists {stacks} interleaved, not one after the "
            "other: the pipeline runs each list whole before the next"
        )
    if trace.strays:
        layer, path = trace.strays[0]
        where = repr(stacks[0]) if len(stacks) == 1 else str(stacks)
        more = f" (and {len(trace.strays) - 1} more)" if len(trace.strays) > 1 else ""
        raise SplitError(
            f"layer {layer} of {name} ({where}) calls {path!r}, which is not part of it{more}: "
            "a layer that uses a module outside it (a module shared by layers) cannot be split "
            "over stages; describe the model with PipeModel, keeping the shared module in "
            "`pre` or `post`, or train it on one device"
        )
    calls = [trace.calls[g] for g in range(len(expected))]
    markers = {k: tuple(sorted(v)) for k, v in trace.markers.items()}
    seen = Observation(output=output, calls=calls, forms=dict(trace.forms), markers=markers)
    seen.unused = _without_gradient(model, output)
    seen.output = tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, output)
    seen.between = [[] for _ in range(len(stacks) - 1)]
    _sort(model, "", set(stacks), containers, trace.phases, seen, len(stacks))
    return seen


def _without_gradient(model: nn.Module, output: Any) -> list[str]:
    """The trainable parameters that no tensor of the forward's ``output`` depends on (the
    cross-attention of a decoder used on its own, a pooler whose output the model does not
    return), by name: on one device they get no gradient either. Empty where the forward ran
    without gradient."""
    roots = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not roots or not named:
        return []
    total = torch.stack([(r.float() * 0).sum() for r in roots]).sum()
    grads = torch.autograd.grad(total, [p for _, p in named], allow_unused=True)
    return [n for (n, _), g in zip(named, grads, strict=True) if g is None]


def _phases_under(path: str, phases: dict[str, set[int]]) -> set[int]:
    found: set[int] = set()
    for p, when in phases.items():
        if p == path or p.startswith(path + "."):
            found |= when
    return found


def _when(phase: int, stacks: int) -> str:
    if phase % 2:
        return "between two layers" + (f" of list {phase // 2}" if stacks > 1 else "")
    if phase == 0:
        return "before the layers"
    if phase == 2 * stacks:
        return "after the layers"
    return f"between layer list {phase // 2 - 1} and list {phase // 2}"


def _sort(
    model: nn.Module,
    prefix: str,
    stacks: set[str],
    containers: set[str],
    phases: dict[str, set[int]],
    seen: Observation,
    count: int,
) -> None:
    """Put each child of the container at ``prefix`` (and, through containers, their children)
    in ``before``, ``between[k]``, ``after`` or ``idle``; a part that ran at several points is
    split into its children when it was not called itself, else refused."""
    parent = model.get_submodule(prefix) if prefix else model
    for child_name, child in parent.named_children():
        if child is None:
            continue
        path = f"{prefix}.{child_name}" if prefix else child_name
        if path in stacks:
            continue
        if path in containers:
            _sort(model, path, stacks, containers, phases, seen, count)
            continue
        when = _phases_under(path, phases)
        holds = any(True for _ in child.parameters())
        if not when:
            if holds:
                seen.idle.append(path)
            continue
        even = sorted(p for p in when if p % 2 == 0)
        if (len(when) == 1 and even) or (not holds and even):
            _place(seen, path, even[0], count)  # without parameters a part is on every stage
        elif not holds:
            seen.after.append(path)
        elif path not in phases and any(True for _ in child.children()):
            _sort(model, path, stacks, containers, phases, seen, count)  # a holder: look inside
        else:
            ran = " and ".join(_when(p, count) for p in sorted(when))
            raise SplitError(
                f"{path!r} of {type(model).__name__} runs {ran}: the split puts a part on one "
                "stage, the first (before the layers), the last (after them) or where the next "
                "layer list starts; describe the model with PipeModel, or give the part a "
                "copy for each use"
            )


def _place(seen: Observation, path: str, phase: int, count: int) -> None:
    if phase == 0:
        seen.before.append(path)
    elif phase == 2 * count:
        seen.after.append(path)
    else:
        seen.between[phase // 2 - 1].append(path)


@contextmanager
def evaluating(model: nn.Module, grad: bool = False) -> Iterator[None]:
    """``model`` in eval mode (dropout off, batch norm's running statistics read, not updated)
    with the random number generators' states put back afterwards; without gradient unless
    ``grad``. The numbers a module keeps as attributes are put back too: a forward may set one
    in eval mode that training then reads (NLLB-MoE's router sets its expert capacity from an
    eval batch's token count). Flags and names stay as the forward left them: a forward that
    switches how a model computes does it for good, with its modules (BigBird's attention type
    with its attention modules, RWKV's rescaled weights with their flag)."""
    modes = [(m, m.training) for m in model.modules()]
    numbers = [(m, _numbers(m)) for m in model.modules()]
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(grad):
        model.eval()
        try:
            yield
        finally:
            for m, mode in modes:
                m.training = mode
            for m, kept in numbers:
                now = _numbers(m)
                for key, value in kept.items():
                    if key in now and now[key] != value:
                        m.__dict__[key] = value


def _numbers(module: nn.Module) -> dict[str, Any]:
    """The attributes of ``module`` that hold numbers (not flags) or None: a number that
    became another number (or None) is put back; one that became a tensor or a name, or an
    attribute the forward added, is left."""
    return {
        k: v
        for k, v in module.__dict__.items()
        if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
    }


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
