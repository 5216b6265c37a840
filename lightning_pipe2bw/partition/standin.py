"""Running a model's own forward with stand-ins for its layers: how a stage learns what each layer
is passed, and how a later stage runs the forward's own code between and after the layers.

A :class:`Run` swaps each of the model's layer lists (a :class:`Stack`: one for a decoder-only
model, the encoder's and the decoder's for an encoder-decoder) for :class:`StandIn` modules, one
per layer, each answering for its layer: it reads through to the layer's attributes (a forward
that picks a layer's mask by ``layer.attention_type`` reads the real value, or the meta-device
skeleton of a layer another stage holds), and when the forward calls it, it acts by its stack's
mode:

- ``"capture"`` (the stage that opens the stack, every micro-batch): records every layer's
  arguments, as the model's own code computes them for this micro-batch, returns its input (in
  the form the layer returns its output, with markers where the forward passes a layer's other
  values on) and stops the forward at the last layer;
- ``"probe"`` (the guard, once per new shape): the same with each layer's output changed (its
  input plus noise), to prove that no layer's arguments depend on what the layers compute and
  that the forward hands each layer's output to the next unchanged: what a split into stages
  needs to be exact;
- ``"replay"`` (the stage after a stack: the junction into the next stack, or the last stage):
  hands its input on, and the last hands over the hidden state the stack's last layer produced,
  so that the forward's own code runs after the layers; ``"pass"``: hands its input on (an
  earlier stack, whose output the replay does not need). Both return markers where the layer
  returns values the forward passes on (what a later layer takes, which a replay does not use),
  so that a forward which indexes them runs.

A marker (:class:`~partition.carry.Pending`) may be indexed: Swinv2's forward passes the next
layer ``(output_dimensions[-2], output_dimensions[-1])``, two items of a layer's output, which
travel as such.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe2bw.partition.carry import LayerCall, Pending
from lightning_pipe2bw.partition.observe import SplitError
from lightning_pipe2bw.partition.paths import get_path, set_path
from lightning_pipe2bw.partition.recorded import collected_keys, hand_over

__all__ = ["Captured", "Run", "Stack", "split_call", "swapped", "training_kwargs"]


class Captured(BaseException):
    """Raised by the last stand-in of the stack a run captures, to stop the forward there: a
    BaseException, so that no ``except Exception`` in the model's forward swallows it."""


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
    """Stands in for layer ``index`` of stack ``stack`` during a :class:`Run`; reads through to
    the layer's own attributes (``target``: the layer, or what the model object keeps of a layer
    another stage holds)."""

    def __init__(self, stack: int, index: int, run: Run, target: Any) -> None:
        super().__init__()
        self.__dict__.update(stack=stack, index=index, run=run, target=target)
        self.training = getattr(target, "training", True)  # a forward may read layer.training

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            target = self.__dict__.get("target")
            if target is None:
                raise
            return getattr(target, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        d = self.__dict__
        return d["run"].called(d["stack"], d["index"], args, kwargs)


@dataclass
class Stack:
    """One list of layers in a :class:`Run`: where it is in the model, what its stand-ins read
    through to, the index of its first layer over all stacks, and what its stand-ins do
    (``mode``: ``"idle"`` not expected to run, ``"pass"`` hand their input on, the last the
    stack's ``output`` where it is known, ``"replay"`` the same with the last handing over the
    run's ``hidden``, ``"capture"``/``"probe"`` record each call and stop the forward at the
    last), the form its layers return their output in, and the positions of that output whose
    values the forward passes on (a capture returns a :class:`~partition.carry.Pending`
    there)."""

    path: str
    layers: list[Any]
    offset: int = 0
    mode: str = "idle"
    form: int = 0
    markers: tuple[int, ...] = ()
    output: Any = None  # pass: what the last stand-in returns (the stack's real output), if known
    noisy: bool = False  # pass: the guard's run, the last stand-in returns its input plus noise


class Run:
    """One run of a model's forward with its layers stood in for (see the module notes)."""

    def __init__(
        self,
        stacks: Sequence[Stack],
        hidden: Any = None,
        generator: torch.Generator | None = None,
        rest: tuple[Any, ...] | None = None,
        recorded: Mapping[int, Any] | None = None,
    ) -> None:
        self.stacks = list(stacks)
        self.hidden, self.generator = hidden, generator
        self.rest = rest  # replay: the rest of the replayed stack's last output, if it has one
        # pass, replay: what each layer's modules recorded where it ran (``partition.recorded``)
        self.recorded = recorded or {}
        self.collects: tuple[str, ...] = ()  # capture: the keys the forward collects
        self.calls: dict[int, LayerCall] = {}  # by layer index over all stacks
        self.first: Any = None  # the hidden state of the captured stack's first layer
        self.sent: Any = None  # what the previous stand-in returned (probe)
        self.problems: list[str] = []  # probe: where the forward did not hand a layer's output on
        self.reached = 0  # the stand-ins' calls so far
        self.outputs: dict[str, Any] = {}  # what each watched part returned

    def output_of(self, path: str) -> Any:
        """A forward hook for the part at ``path``: keeps what it returns."""

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.outputs[path] = output

        return hook

    def called(self, k: int, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        stack = self.stacks[k]
        n = len(stack.layers)
        self.reached += 1
        hidden, call = split_call(stack.layers[index], index, args, kwargs)
        if stack.mode in ("pass", "replay"):  # what the layer's modules recorded where it ran
            hand_over(self.recorded.get(stack.offset + index))
        if stack.mode == "pass":
            if index == n - 1 and stack.output is not None:
                hidden = stack.output
            elif index == n - 1 and stack.noisy:
                hidden = _perturbed(hidden, self.generator)
            return self._shaped(stack, hidden, index, marked=True)
        if stack.mode == "replay":
            if index == n - 1 and self.rest is not None:
                return (self.hidden, *self.rest)  # the last layer's output as it returned it
            # markers where the forward passes a value on, which it may index (Swinv2's
            # output dimensions): what a later layer takes is not used in a replay
            return self._shaped(
                stack, self.hidden if index == n - 1 else hidden, index, marked=True
            )
        if stack.mode == "idle":
            raise SplitError(
                f"the model's forward called layer {index} of {stack.path!r} where pipe2bw did "
                "not expect it: it runs its layer lists one after the other, each once"
            )
        g = stack.offset + index
        done = sum(stack.offset <= j < stack.offset + n for j in self.calls)
        if index != done:
            raise SplitError(
                f"the model's forward called layer {index} of {stack.path!r} after {done} of "
                f"its {n} layers: the pipeline runs each layer once, in its list's order"
            )
        self.calls[g] = call
        if index == 0:
            self.first = hidden
            self.collects = collected_keys()
        if stack.mode == "probe":
            if index > 0 and not _same(hidden, self.sent):
                self.problems.append(
                    f"the forward changes the hidden state between layer {g - 1} and layer {g} "
                    f"(it calls layer {g} with something else than what layer {g - 1} returned)"
                )
            hidden = _perturbed(hidden, self.generator)
            self.sent = hidden
        if index == n - 1:
            raise Captured()
        return self._shaped(stack, hidden, index, marked=True)

    def _shaped(self, stack: Stack, hidden: Any, index: int, marked: bool = False) -> Any:
        """``hidden`` as the stack's layers return their output: a tuple of ``form`` (hidden
        first, the values the forward passes on as markers in a capture, None elsewhere) or the
        tensor itself."""
        if not stack.form:
            return hidden
        g = stack.offset + index
        rest = [
            Pending(g, p) if marked and p in stack.markers else None for p in range(1, stack.form)
        ]
        return (hidden, *rest)

    def form_text(self) -> str:
        forms = {s.form for s in self.stacks}
        if forms == {0}:
            return ""
        return " (in a tuple, as the layers return their output)"


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
def swapped(model: nn.Module, run: Run) -> Iterator[None]:
    """Each of the model's layer lists replaced by ``run``'s stand-ins for them."""
    saved = []
    for k, stack in enumerate(run.stacks):
        layers = get_path(model, stack.path)
        stand_ins = [StandIn(k, i, run, t) for i, t in enumerate(stack.layers)]
        swap = nn.Sequential(*stand_ins) if isinstance(layers, nn.Sequential) else None
        saved.append((stack.path, layers))
        set_path(model, stack.path, swap if swap is not None else nn.ModuleList(stand_ins))
    try:
        yield
    finally:
        for path, layers in reversed(saved):
            set_path(model, path, layers)


def training_kwargs(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The step's keyword arguments for a training forward: without a key/value cache."""
    kwargs = dict(kwargs)
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        kwargs.setdefault("use_cache", False)
    return kwargs
