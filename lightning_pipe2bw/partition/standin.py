"""Running a model's own forward with stand-ins for its layers: how the first stage learns what
each layer is passed, and how the last stage runs the end of the forward.

A :class:`Run` swaps the model's layer list for :class:`StandIn` modules, one per layer, each
answering for its layer: it reads through to the layer's attributes (a forward that picks a
layer's mask by ``layer.attention_type`` reads the real value, or the meta-device skeleton of a
layer another stage holds), and when the forward calls it, it records the call and returns its
input in the form the layer returns. Modes:

- ``"capture"`` (first stage, every micro-batch): every layer's arguments, as the model's own
  code computes them for this micro-batch; the run stops at the last layer;
- ``"probe"`` (the guard, once per new shape): the same with each layer's output changed (its
  input plus noise, markers for the other values it returns), to prove that no layer's
  arguments depend on what the layers compute and that the forward hands each layer's output
  to the next unchanged: what a split into stages needs to be exact;
- ``"replay"`` (last stage): the stand-ins pass their input on and the last hands over the
  hidden state the last layer produced, so that the forward's own code runs after the layers.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe2bw.partition.carry import LayerCall, template
from lightning_pipe2bw.partition.observe import SplitError
from lightning_pipe2bw.partition.paths import get_path, set_path

__all__ = [
    "Captured",
    "Extra",
    "Run",
    "StandIn",
    "hidden_key",
    "split_call",
    "swapped",
    "training_kwargs",
]


class Captured(BaseException):
    """Raised by the last layer's stand-in to stop a capture: a BaseException, so that no
    ``except Exception`` in the model's forward swallows it."""


class Extra:
    """A probe's marker for a value a layer returns besides its hidden state (its output
    ``[position]``): found among a later layer's arguments, it shows that the model passes
    layer outputs on, which a split does not carry."""

    __slots__ = ("layer", "position")

    def __init__(self, layer: int, position: int) -> None:
        self.layer, self.position = layer, position

    def __repr__(self) -> str:
        return f"<output [{self.position}] of layer {self.layer}>"


_KEYS: dict[type, str | None] = {}


def hidden_key(layer: Any) -> str | None:
    """The name of the first parameter of ``layer``'s forward (its hidden state), or None."""
    kind = type(layer)
    if kind not in _KEYS:
        try:
            params = list(inspect.signature(layer.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        first = params[0] if params else None
        named = first is not None and first.kind in (
            first.POSITIONAL_OR_KEYWORD,
            first.KEYWORD_ONLY,
        )
        _KEYS[kind] = first.name if named and first is not None else None
    return _KEYS[kind]


def split_call(
    layer: Any, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, LayerCall]:
    """(hidden state, the rest of the call) of a call of ``layer``: the hidden state is the first
    positional argument, or the keyword its forward names first (``hidden_states``)."""
    if args:
        return args[0], (tuple(args[1:]), dict(kwargs), None)
    for key in (hidden_key(layer), "hidden_states", "hidden_state", "x"):
        if key is not None and key in kwargs:
            rest = {k: v for k, v in kwargs.items() if k != key}
            return kwargs[key], ((), rest, key)
    raise SplitError(
        f"layer {index} ({type(layer).__name__}) was called without a positional argument and "
        f"without any keyword its forward names first (keywords {sorted(kwargs)}): pipe2bw "
        "cannot tell which argument is the hidden state that flows from layer to layer"
    )


class StandIn(nn.Module):
    """Stands in for layer ``index`` during a :class:`Run`; reads through to the layer's own
    attributes (``target``: the layer, or what the model object keeps of a layer another stage
    holds)."""

    def __init__(self, index: int, run: Run, target: Any) -> None:
        super().__init__()
        self.__dict__["index"] = index
        self.__dict__["run"] = run
        self.__dict__["target"] = target

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            target = self.__dict__.get("target")
            if target is None:
                raise
            return getattr(target, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["run"].called(self.__dict__["index"], args, kwargs)


class Run:
    """One run of a model's forward with its layers stood in for (see the module notes)."""

    def __init__(
        self,
        layers: Sequence[Any],
        mode: str,
        form: int = 0,
        hidden: Any = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.layers = list(layers)  # what each stand-in reads through to
        self.mode, self.form, self.hidden, self.generator = mode, max(form, 0), hidden, generator
        self.calls: list[LayerCall | None] = [None] * len(self.layers)
        self.first: Any = None  # the first layer's hidden state
        self.sent: Any = None  # what the previous stand-in returned (probe)
        self.problems: list[str] = []  # probe: where the forward did not hand a layer's output on
        self.reached = 0  # the stand-ins' calls so far
        self.templates: dict[str, Any] = {}  # what each part before the layers returned

    def template_of(self, path: str) -> Any:
        """A forward hook for the part at ``path``: keeps the shape of what it returns before
        the layers (the last stage's replay returns that in its place)."""

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.reached:
                self.templates[path] = template(output)

        return hook

    def form_text(self) -> str:
        if not self.form:
            return ""
        return f" (in a tuple of {self.form}, as the layers return their output)"

    def stand_ins(self) -> list[StandIn]:
        return [StandIn(i, self, layer) for i, layer in enumerate(self.layers)]

    def called(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        n = len(self.layers)
        self.reached += 1
        hidden, call = split_call(self.layers[index], index, args, kwargs)
        if self.mode == "replay":
            return self._shaped(self.hidden if index == n - 1 else hidden, index, markers=False)
        done = sum(c is not None for c in self.calls)
        if index != done:
            raise SplitError(
                f"the model's forward called layer {index} after {done} of its {n} layers: the "
                "pipeline runs each layer once, in its list's order"
            )
        self.calls[index] = call
        if index == 0:
            self.first = hidden
        if self.mode == "probe":
            if index > 0 and not _same(hidden, self.sent):
                self.problems.append(
                    f"the forward changes the hidden state between layer {index - 1} and layer "
                    f"{index} (it calls layer {index} with something else than what layer "
                    f"{index - 1} returned)"
                )
            hidden = _perturbed(hidden, self.generator)
            self.sent = hidden
        if index == n - 1:
            raise Captured()
        return self._shaped(hidden, index, markers=self.mode == "probe")

    def _shaped(self, hidden: Any, index: int, markers: bool) -> Any:
        """``hidden`` as the layer returns its output: a tuple of ``form`` (hidden first) or the
        tensor itself; a probe puts markers where the layer returns other values."""
        if not self.form:
            return hidden
        rest = tuple(Extra(index, k) if markers else None for k in range(1, self.form))
        return (hidden, *rest)


def _same(received: Any, sent: Any) -> bool:
    if received is sent:
        return True
    if isinstance(received, Tensor) and isinstance(sent, Tensor):
        return received.shape == sent.shape and torch.equal(received, sent)
    return False


def _perturbed(hidden: Any, generator: torch.Generator | None) -> Any:
    if not isinstance(hidden, Tensor):
        return hidden
    if not (hidden.dtype.is_floating_point or hidden.dtype.is_complex):
        return hidden + 1
    noise = torch.randn(hidden.shape, generator=generator, device="cpu")
    return hidden.detach() + noise.to(hidden.device, hidden.dtype)


@contextmanager
def swapped(model: nn.Module, path: str, run: Run) -> Iterator[None]:
    """The model's layer list at ``path`` replaced by ``run``'s stand-ins for the block."""
    layers = get_path(model, path)
    stand_ins = run.stand_ins()
    set_path(
        model,
        path,
        nn.Sequential(*stand_ins)
        if isinstance(layers, nn.Sequential)
        else nn.ModuleList(stand_ins),
    )
    try:
        yield
    finally:
        set_path(model, path, layers)


def training_kwargs(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The step's keyword arguments for a training forward: without a key/value cache."""
    kwargs = dict(kwargs)
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        kwargs.setdefault("use_cache", False)
    return kwargs
