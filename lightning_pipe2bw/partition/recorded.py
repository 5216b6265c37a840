"""Values the layers produce and the model's end reads: a mixture-of-experts router's logits,
from which the end of the forward computes the load-balancing loss.

Hugging Face models record them with hooks: their base model's forward (``capture_outputs``)
opens a collector of the keys asked for (``output_router_logits=True`` opens
``"router_logits"``) and hooks on the modules inside the layers (``MixtralTopKRouter``) append
what those modules return, in the order they run. In a pipeline, the layers run on their stages,
outside that forward, and the last stage replays the model's end with stand-ins for them, so
nothing would reach the collector there.

So the values travel with the carry (``partition.carry``), and their gradients return to the
stages that made them as the hidden state's do:

- the stage that opens a stack notes which keys the forward collects (:func:`collected_keys`,
  read while the forward calls the stand-ins);
- each layer block records, while its layer runs, what the modules the model's recorders name
  return (:func:`recording`: hooks for that call only) into ``carry["recorded"][layer]``;
- the replay's stand-in for layer ``g`` hands layer ``g``'s values to the collector that is open
  then (:func:`hand_over`), in the order the hooks would have appended them.

transformers installs its own hooks once per model, the first time a forward collects (here: the
intake's whole-model forward), as local functions no pickle carries. A block that travels
between processes leaves them behind (:func:`forget_capture_hooks`), and a model put back
together installs them afresh at its next such forward.

The hidden states (``output_hidden_states``) are not carried: their collector also selects
layers and keeps the input of the first, which a training loss does not read.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "collected_keys",
    "forget_capture_hooks",
    "hand_over",
    "recorders_for",
    "recording",
]

# keys a collector may hold that are not values recorded by the layers' modules
_NOT_CARRIED = frozenset({"hidden_states", "_hidden_states_layers"})


def _capturing() -> Any:
    """transformers' output-capturing module where a model of it was built (it is imported
    then), else None: nothing imports transformers for a model that is not one of its own."""
    return sys.modules.get("transformers.utils.output_capturing")


def _collector() -> dict[str, list[Any]] | None:
    """transformers' collector open now (inside a base model's ``capture_outputs`` forward),
    or None."""
    active = getattr(_capturing(), "_active_collector", None)
    return active.get() if active is not None else None


def collected_keys() -> tuple[str, ...]:
    """The keys the forward running now collects from its layers' modules, sorted."""
    collector = _collector()
    if not collector:
        return ()
    return tuple(sorted(k for k in collector if k not in _NOT_CARRIED))


def hand_over(values: Mapping[str, tuple[Any, ...]] | None) -> None:
    """Append one layer's recorded ``values`` to the collector open now, as its hooks would
    have when the layer ran."""
    collector = _collector()
    if not values or collector is None:
        return
    for key, items in values.items():
        if key in collector:
            collector[key].extend(items)


@dataclass(frozen=True)
class Recorder:
    """Which modules of a layer record a key, as transformers' ``OutputRecorder`` names them:
    by class (``target_class``) or a suffix of the module's name (``class_name``), within
    modules whose name holds ``layer_name``; ``index``: the position in a tuple output."""

    key: str
    index: int
    target_class: type | None = None
    class_name: str | None = None
    layer_name: str | None = None

    def matches(self, name: str, module: nn.Module) -> bool:
        hit = (self.target_class is not None and isinstance(module, self.target_class)) or (
            self.class_name is not None and name.endswith(self.class_name)
        )
        if not hit or self.layer_name is None:
            return hit
        return f".{self.layer_name.strip('.')}." in name + "."


def recorders_for(model: nn.Module, path: str) -> tuple[Recorder, ...]:
    """The recorders that apply to the module at ``path`` in ``model`` (a layer): those of the
    closest Hugging Face model above it whose forward collects outputs (its
    ``_can_record_outputs``), hidden states left out."""
    output_capturing = _capturing()
    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    recorder_type = getattr(output_capturing, "OutputRecorder", None)
    if registry is None or recorder_type is None:
        return ()
    heads = path.split(".")
    for k in range(len(heads) - 1, -1, -1):
        holder = model.get_submodule(".".join(heads[:k]))
        flags = registry.get(holder)
        if flags:
            return tuple(_recorders(flags, recorder_type))
    return ()


def _recorders(flags: Mapping[str, Any], recorder_type: type) -> Iterator[Recorder]:
    for key, specs in flags.items():
        if key in _NOT_CARRIED:
            continue
        listed: list[Any] = specs if isinstance(specs, list) else [specs]
        for spec in listed:
            if isinstance(spec, recorder_type):
                found: Any = spec
                yield Recorder(
                    key, found.index, found.target_class, found.class_name, found.layer_name
                )
            elif isinstance(spec, str):
                yield Recorder(key, 1, class_name=spec)
            else:
                yield Recorder(key, 1, target_class=spec)


@contextmanager
def recording(
    layer: nn.Module, name: str, keys: tuple[str, ...], recorders: tuple[Recorder, ...]
) -> Iterator[dict[str, tuple[Any, ...]]]:
    """While the ``with`` block runs ``layer`` (at ``name`` in the model): what its modules
    that record one of ``keys`` return, by key, in the order they ran (filled when the block
    ends)."""
    wanted = [r for r in recorders if r.key in keys]
    if not keys:
        yield {}
        return
    found: dict[str, list[Any]] = {key: [] for key in keys}
    handles = []

    def hook(recorder: Recorder) -> Any:
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            if not isinstance(output, tuple):
                found[recorder.key].append(output)
            elif output[recorder.index] is not None:
                found[recorder.key].append(output[recorder.index])

        return keep

    for sub, module in layer.named_modules(prefix=name):
        for recorder in wanted:
            if recorder.matches(sub, module):
                handles.append(module.register_forward_hook(hook(recorder)))
    got: dict[str, tuple[Any, ...]] = {}
    try:
        yield got
    finally:
        for handle in handles:
            handle.remove()
        got.update({key: tuple(items) for key, items in found.items()})


def forget_capture_hooks(module: nn.Module) -> None:
    """Remove transformers' output-capturing hooks from ``module`` and everything in it, and
    let every model in it install them again when a forward next collects."""
    for sub in module.modules():
        hooks = sub._forward_hooks
        for key in [k for k, h in hooks.items() if _is_capture_hook(h)]:
            del hooks[key]
        if sub.__dict__.get("_output_capturing_hooks_installed"):
            sub.__dict__["_output_capturing_hooks_installed"] = False


def _is_capture_hook(hook: Any) -> bool:
    return "output_capturing_hook" in getattr(hook, "__qualname__", "")
