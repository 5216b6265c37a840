"""The blocks a ``PipeModel`` body is made of, each holding some of the model's own modules under
their own paths (so that state-dict keys are the model's):

- :class:`First`: the model's forward up to its first stack of layers, run with stand-ins for
  the layers (``partition.standin``), which gives each layer's arguments;
- :class:`Layer`: one layer, called as the model's forward calls it, with the arguments the
  carry (``partition.carry``) holds for it;
- :class:`Junction`: between two stacks of layers (an encoder's and a decoder's): the model's
  forward replayed up to the next stack (``partition.replay``), which gives that stack's
  arguments (the encoder's output among them);
- :class:`Last`: the head, on the step's own arguments (the labels): the model's forward
  replayed after the layers (a :class:`~partition.replay.ReplayHead`), or a head function.

With ``check``, every block that runs the model's forward proves each micro-batch of new shapes
to split exactly before it trains on it (``partition.guard``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe2bw.partition.carry import advance, call_of, pack, resolve
from lightning_pipe2bw.partition.guard import (
    call_problems,
    describe,
    kept_buffers,
    rewound,
    rng_state,
    shape_key,
)
from lightning_pipe2bw.partition.observe import TURN_OFF, SplitError, compare_outputs
from lightning_pipe2bw.partition.paths import get_path, set_path
from lightning_pipe2bw.partition.recorded import recorders_for, recording
from lightning_pipe2bw.partition.replay import Blanks, ReadsBlanks, ReplayHead, forward_with
from lightning_pipe2bw.partition.standin import Run, Stack
from lightning_pipe2bw.runtime.call import BodyInput

__all__ = ["First", "Junction", "Last", "Layer", "Part", "StackInfo"]

# runs the last part of the model: (model, hidden state, the step's args, its kwargs) -> output
Head = Callable[[nn.Module, Any, tuple[Any, ...], dict[str, Any]], Any]


@dataclass(frozen=True)
class StackInfo:
    """One list of layers of the model: its path, its length, the index of its first layer over
    all stacks, what its layers return (0 a tensor, n a tuple of n; as observed) and the
    positions of that output the forward passes to later layers."""

    path: str
    count: int
    offset: int
    form: int = 0
    markers: tuple[int, ...] = ()


class Part(nn.Module):
    """A block that holds some of the model's modules and parameters under their own paths
    (nested holder modules rebuild the path), so its state-dict keys are the model's."""

    whole_model: Any  # the original model object (not a child), None after travelling

    def __init__(self, model: nn.Module, paths: Sequence[str]) -> None:
        super().__init__()
        self.pipe_paths = list(paths)
        for path in self.pipe_paths:
            _set_nested(self, path, get_path(model, path))
        # the model object itself is not a child: its other parts belong to other blocks
        object.__setattr__(self, "whole_model", model)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("whole_model", None)  # travels without the rest of the model (hand-back, moves)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "whole_model", None)

    def parts(self) -> Iterator[tuple[str, nn.Module | Tensor]]:
        for path in self.pipe_paths:
            yield path, get_path(self, path)

    def watched(self) -> list[tuple[str, nn.Module]]:
        """The parts whose outputs a later stage's replay stands in for (modules holding
        parameters)."""
        return [
            (path, obj)
            for path, obj in self.parts()
            if isinstance(obj, nn.Module) and any(True for _ in obj.parameters())
        ]

    @contextmanager
    def params_in_model(self) -> Iterator[None]:
        """During a call: the model object's slots of the parameters this part holds directly
        (``cls_token``) hold what the part holds now. A module is the same object in both, but
        a parameter of the model itself is a slot of its own there, which a weight version
        swapped into the part (2BW swaps them in as ``torch.func.functional_call`` does) would
        not reach."""
        model = self.whole_model
        direct = [(p, get_path(self, p)) for p in self.pipe_paths]
        direct = [(p, t) for p, t in direct if not isinstance(t, nn.Module)]
        saved = [(p, get_path(model, p)) for p, _ in direct]
        for path, tensor in direct:
            set_path(model, path, tensor)
        try:
            yield
        finally:
            for path, tensor in saved:
                set_path(model, path, tensor)


def _set_nested(holder: nn.Module, path: str, value: nn.Module | Tensor) -> None:
    *heads, name = path.split(".")
    node = holder
    for head in heads:
        child = node._modules.get(head)
        if child is None:
            child = nn.Module()
            node.add_module(head, child)
        node = child
    if isinstance(value, nn.Parameter):
        node.register_parameter(name, value)
    elif isinstance(value, nn.Module):
        node.add_module(name, value)
    else:
        raise TypeError(f"{path!r} is a {type(value).__name__}: name modules or parameters")


def whole(part: nn.Module) -> Any:
    """The model object a block belongs to."""
    model = getattr(part, "whole_model", None)
    if model is None:
        raise RuntimeError("this block travelled without its model; restore the model first")
    return model


def _stacks(
    model: nn.Module,
    layout: Sequence[StackInfo],
    modes: dict[int, str],
    forms: dict[int, int] | None = None,
    outputs: dict[int, Any] | None = None,
    noisy: bool = False,
) -> list[Stack]:
    """The model's stacks for a :class:`~partition.standin.Run`: what each stand-in reads
    through to (the model object's layers now), each stack's mode, its layers' form (as the
    carry learnt it, else as observed) and, for a stack passed over, its known output."""
    return [
        Stack(
            info.path,
            list(get_path(model, info.path)),  # type: ignore[arg-type]
            info.offset,
            modes.get(k, "idle"),
            (forms or {}).get(k, info.form),
            info.markers,
            output=(outputs or {}).get(k),
            noisy=noisy and modes.get(k) == "pass",
        )
        for k, info in enumerate(layout)
    ]


def _devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_initialized() else []


def _wrong(model: nn.Module, key: Any, problems: Sequence[str], how: str) -> str:
    name = type(model).__name__
    return (
        f"the pipeline split of {name} would compute something else than the whole model on a "
        f"micro-batch of new {describe(key)}: {'; '.join(problems)}. {how} Describe the model "
        "with PipeModel (docs/models.md) or train it on one device; "
        f"{TURN_OFF} turns this guard off"
    )


_STAND_INS = (
    "The stage runs {model}.forward with stand-ins for its layers {stack!r} to learn what each "
    "layer is passed, which is exact only when no layer's arguments depend on what the layers "
    "compute and each layer's output goes unchanged to the next."
)


class _Guarded(Part):
    """A block that runs the model's forward and proves each new shape (``check``)."""

    def __init__(
        self,
        model: nn.Module,
        paths: Sequence[str],
        layout: Sequence[StackInfo],
        check: bool,
        carried: Sequence[str],
    ) -> None:
        super().__init__(model, paths)
        self.pipe_layout = list(layout)
        self.pipe_check = check
        self.pipe_checked: set[Any] = set()  # the shapes proved to split exactly
        # the parts (and "stack outputs") whose values travel to later replays
        self.pipe_carried = set(carried)

    def _fresh(self, call: BodyInput) -> Any:
        """The shape key of ``call`` if the guard has yet to prove it, else None."""
        if not self.pipe_check:
            return None
        key = shape_key(call.args, call.kwargs, self.training)
        return None if key in self.pipe_checked else key

    def _parts_out(self, run: Run) -> dict[str, tuple[Any, bool]]:
        return {path: (out, path in self.pipe_carried) for path, out in run.outputs.items()}


class First(_Guarded):
    """Block 0: the model's forward up to its first stack, with stand-ins for the layers (or
    ``embed`` when given, whose arguments every layer of the stack takes)."""

    def __init__(
        self,
        model: nn.Module,
        paths: Sequence[str],
        layout: Sequence[StackInfo],
        embed: Callable[..., Any] | None = None,
        check: bool = True,
        carried: Sequence[str] = (),
    ) -> None:
        super().__init__(model, paths, layout, check, carried)
        self.pipe_embed = embed

    def forward(self, x: BodyInput) -> Any:
        if not isinstance(x, BodyInput):
            raise TypeError(
                f"the first block takes the body's call arguments, got {type(x).__name__}"
            )
        if self.pipe_embed is not None:
            with self.params_in_model():
                hidden, args, kwargs = self.pipe_embed(self.whole_model, *x.args, **x.kwargs)
            stack = self.pipe_layout[0]
            call = (tuple(args), dict(kwargs), None)
            return pack(hidden, {stack.offset + j: call for j in range(stack.count)})
        key = self._fresh(x)
        state = rng_state(_devices()) if key is not None else None
        run = self._run(x, "capture")
        if key is not None:
            with torch.no_grad(), rewound(state, _devices()), kept_buffers(self):  # type: ignore[arg-type]
                probe = self._run(x, "probe", torch.Generator().manual_seed(0))
            problems = call_problems(run.calls, probe.calls, probe.problems)
            if probe.first is not None and not _equal(run.first, probe.first):
                problems.append("the first layer's hidden state changes from one run to the next")
            if problems:
                model = self.whole_model
                how = _STAND_INS.format(model=type(model).__name__, stack=self.pipe_layout[0].path)
                raise SplitError(_wrong(model, key, problems, how))
            self.pipe_checked.add(key)
        return pack(run.first, run.calls, self._parts_out(run), collects=run.collects)

    def _run(self, x: BodyInput, mode: str, generator: torch.Generator | None = None) -> Run:
        model = self.whole_model
        run = Run(_stacks(model, self.pipe_layout, {0: mode}), generator=generator)
        with self.params_in_model():
            out = forward_with(model, x, run, self.watched())
        if out is not None:
            stack = self.pipe_layout[0]
            raise SplitError(
                f"{type(model).__name__}.forward returned after calling {len(run.calls)} of the "
                f"{stack.count} layers {stack.path!r}: the pipeline runs every layer of the "
                "list once, in order; name the list its forward iterates as `blocks`, or give "
                "an `embed` function"
            )
        return run


class Junction(_Guarded):
    """Between stack ``stack - 1`` and stack ``stack`` (an encoder's layers and a decoder's):
    the model's forward replayed with the parts of earlier blocks as blanks, the previous stack
    handing over the hidden state its last layer produced, this block's parts run for real, up
    to the next stack, whose calls it captures. Takes the step's own arguments."""

    takes_call_input = True

    def __init__(
        self,
        model: nn.Module,
        paths: Sequence[str],
        layout: Sequence[StackInfo],
        stack: int,
        blanks: Blanks,
        check: bool = True,
        carried: Sequence[str] = (),
    ) -> None:
        super().__init__(model, paths, layout, check, carried)
        self.pipe_stack = stack
        self.pipe_blanks = blanks
        self.call_input: BodyInput | None = None

    def forward(self, carry: Any) -> Any:
        call = self.call_input or BodyInput((), {})
        key = self._fresh(call)
        state = rng_state(_devices()) if key is not None else None
        run = self._run(carry, call, "capture")
        if key is not None:
            random = (state, _devices())
            with torch.no_grad(), rewound(*random), kept_buffers(self):  # type: ignore[arg-type]
                probe = self._run(carry, call, "probe", torch.Generator().manual_seed(0))
            problems = call_problems(run.calls, probe.calls, probe.problems)
            if not _equal(run.first, probe.first):
                problems.append(f"the hidden state of layer {self._first_layer} changes")
            if problems:
                read = self._culprits(carry, call, run, random)
                model = self.whole_model
                how = _STAND_INS.format(
                    model=type(model).__name__, stack=self.pipe_layout[self.pipe_stack].path
                )
                if read:
                    how += f" The stage reads what {_listed(read)}, which earlier stages hold."
                raise ReadsBlanks(_wrong(model, key, problems, how), read)
            self.pipe_checked.add(key)
        previous = self.pipe_layout[self.pipe_stack - 1]
        outputs = (
            {self.pipe_stack - 1: carry["hidden"]} if previous.path in self.pipe_carried else {}
        )
        return pack(
            run.first, run.calls, self._parts_out(run), outputs, before=carry,
            collects=run.collects,
        )  # fmt: skip

    @property
    def _first_layer(self) -> int:
        return self.pipe_layout[self.pipe_stack].offset

    def _run(
        self,
        carry: Any,
        call: BodyInput,
        mode: str,
        generator: torch.Generator | None = None,
        vary: Sequence[str] | None = None,
    ) -> Run:
        model = self.whole_model
        k = self.pipe_stack
        modes = {j: "pass" for j in range(k - 1)} | {k - 1: "replay", k: mode}
        noisy = generator is not None
        stacks = _stacks(model, self.pipe_layout, modes, carry["forms"], _outputs(carry), noisy)
        for stack in stacks:
            stack.noisy = stack.noisy and (vary is None or stack.path in vary)
        run = Run(
            stacks, hidden=carry["hidden"], generator=generator, rest=carry.get("rest"),
            recorded=carry.get("recorded"),
        )  # fmt: skip
        with self.params_in_model():
            out = forward_with(
                model, call, run, self.watched(), self.pipe_blanks, carry, generator, vary
            )
        if out is not None:
            info = self.pipe_layout[k]
            raise SplitError(
                f"{type(model).__name__}.forward returned before calling all {info.count} "
                f"layers {info.path!r} after the layers before them: the pipeline runs the "
                "layer lists one after the other"
            )
        return run

    def _culprits(self, carry: Any, call: BodyInput, run: Run, random: Any) -> list[str]:
        """The blanked parts and passed-over stacks whose values change what this stage
        captures (one run per part, on the failure path only)."""
        passed = [s.path for s in self.pipe_layout[: self.pipe_stack - 1]]
        read = []
        for path in self.pipe_blanks.paths + passed:
            with torch.no_grad(), rewound(*random), kept_buffers(self):
                other = self._run(carry, call, "capture", torch.Generator().manual_seed(0), [path])
            if call_problems(run.calls, other.calls, []) or not _equal(run.first, other.first):
                read.append(path)
        return read


class Layer(Part):
    """One layer (``index`` over all stacks, in stack ``stack``), called as the model's forward
    calls it, with the arguments the carry holds for it."""

    def __init__(
        self, model: nn.Module, paths: Sequence[str], index: int, stack: int = 0, last: bool = False
    ) -> None:
        super().__init__(model, paths)
        self.pipe_index = index
        self.pipe_stack = stack
        self.pipe_last = last  # the last layer of its stack: the rest of its output travels on
        # which of its modules record values the model's end reads (``partition.recorded``)
        self.pipe_recorders = recorders_for(model, self.pipe_paths[0])

    def forward(self, carry: Any) -> Any:
        args, kwargs, key = call_of(carry, self.pipe_index)
        path = self.pipe_paths[0]
        layer = get_path(self, path)
        assert isinstance(layer, nn.Module), f"{path!r} names a module"
        hidden = carry["hidden"]
        keys = carry.get("collects", ())
        with recording(layer, path, keys, self.pipe_recorders) as recorded:
            if key is None:
                out = layer(hidden, *args, **kwargs)
            else:
                out = layer(*args, **{key: hidden}, **kwargs)
        after = advance(carry, self.pipe_index, self.pipe_stack, out, self.pipe_last)
        if keys:
            after["recorded"] = {**carry["recorded"], self.pipe_index: recorded}
        return after


class Last(_Guarded):
    """The last block: ``head`` with the step's own arguments (labels). A
    :class:`~partition.replay.ReplayHead` replays the model's forward with blanks for the
    earlier blocks' parts (``blanks``); with ``check``, each micro-batch of new shapes is
    proved not to read them."""

    takes_call_input = True

    def __init__(
        self,
        model: nn.Module,
        paths: Sequence[str],
        head: Head,
        layout: Sequence[StackInfo] = (),
        blanks: Blanks | None = None,
        check: bool = True,
        count: Callable[[BodyInput], Any] | None = None,
    ) -> None:
        super().__init__(model, paths, layout, check, ())
        self.pipe_head = head
        self.pipe_blanks = blanks or Blanks()
        self.call_input: BodyInput | None = None
        # how the model's loss counts a call's items (``PipeModel.count_items``), or None
        self.pipe_count = count

    def forward(self, carry: Any) -> Any:
        call = self.call_input or BodyInput((), {})
        model = whole(self)
        with self.params_in_model():
            if not isinstance(self.pipe_head, ReplayHead):
                return self.pipe_head(model, carry["hidden"], call.args, call.kwargs)
            key = self._fresh(call)
            if key is None:
                return self.replay(carry, call)
            random = (rng_state(_devices()), _devices())
            out = self.replay(carry, call)
            with torch.no_grad(), rewound(*random), kept_buffers(self):
                other = self.replay(carry, call, torch.Generator().manual_seed(0))
            problems = compare_outputs(out, other, rtol=1e-5, atol=1e-6)
            if problems:
                read = self._culprits(carry, call, out, random)
                name = type(model).__name__
                how = (
                    f"The end of {name}.forward, which the last stage runs with blanks for the "
                    "parts earlier stages hold, gives another output when the blanks hold other "
                    f"values: it reads what {_listed(read)}, which only earlier stages have."
                )
                raise ReadsBlanks(_wrong(model, key, problems, how), read)
        self.pipe_checked.add(key)
        return out

    def replay(
        self,
        carry: Any,
        call: BodyInput,
        generator: torch.Generator | None = None,
        vary: Sequence[str] | None = None,
    ) -> Any:
        """The model's output for the step's ``call``, with the last layer's output from
        ``carry``; with ``generator``, the blanks (those at ``vary``, by default all) hold random
        values where they do not travel, and so do the outputs of stacks passed over."""
        model = whole(self)
        last = len(self.pipe_layout) - 1
        modes = {j: "pass" for j in range(last)} | {last: "replay"}
        stacks = _stacks(
            model,
            self.pipe_layout,
            modes,
            carry.get("forms"),
            _outputs(carry),
            generator is not None,
        )
        for stack in stacks:
            stack.noisy = stack.noisy and (vary is None or stack.path in vary)
        run = Run(
            stacks, hidden=carry["hidden"], generator=generator, rest=carry.get("rest"),
            recorded=carry.get("recorded"),
        )  # fmt: skip
        return forward_with(model, call, run, (), self.pipe_blanks, carry, generator, vary)

    def _culprits(self, carry: Any, call: BodyInput, out: Any, random: Any) -> list[str]:
        """The blanked parts and passed-over stacks whose values change the replay's output
        (one replay each, on the failure path only)."""
        candidates = self.pipe_blanks.paths + [s.path for s in self.pipe_layout[:-1]]
        read = []
        for path in candidates:
            with torch.no_grad(), rewound(*random), kept_buffers(self):
                other = self.replay(carry, call, torch.Generator().manual_seed(0), [path])
            if compare_outputs(out, other, rtol=1e-5, atol=1e-6):
                read.append(path)
        return read


def _outputs(carry: Any) -> dict[int, Any]:
    return dict(resolve(carry.get("outputs", {}), carry["shared"]))


def _listed(paths: Sequence[str]) -> str:
    """``paths`` as the subject of "computes"."""
    if not paths:
        return "a part computes"
    return f"{paths[0]!r} computes" if len(paths) == 1 else f"{list(paths)} compute"


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.shape == b.shape and torch.allclose(
            a.detach().double(), b.detach().double(), rtol=1e-5, atol=1e-6
        )
    return a is b or a == b
