"""Running the model's own forward on a stage that does not hold the parts before its own: the
junction into an encoder-decoder's decoder and the last stage.

Such a stage runs ``model(*args, **kwargs)`` on the step's own arguments with the layers stood in
for (``partition.standin``) and each part an earlier stage holds replaced by a :class:`Blank`,
which returns what that part returned there for this micro-batch: its value where it travels in
the carry, else zeros of its shape (``partition.carry``). The forward's own code then computes
what it computes after the layers (the pooler, the head, the loss, the decoder's masks) as the
whole model does, provided it reads nothing the blanks stand in for; the guard
(``partition.guard``) proves that on every new shape.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from lightning_pipe2bw.partition.carry import Carry, Zeros, fill, template
from lightning_pipe2bw.partition.observe import SplitError
from lightning_pipe2bw.partition.paths import get_path, set_path
from lightning_pipe2bw.partition.standin import Captured, Run, swapped, training_kwargs
from lightning_pipe2bw.runtime.call import BodyInput

__all__ = ["Blanks", "ReadsBlanks", "ReplayHead", "forward_with"]


class ReadsBlanks(SplitError):
    """The forward a stage replays reads what parts of earlier stages compute (``paths``)."""

    def __init__(self, message: str, paths: Sequence[str]) -> None:
        super().__init__(message)
        self.paths = list(paths)


class Blank(nn.Module):
    """Stands in for a part an earlier stage holds: returns ``value`` (what the part returned
    there, from the carry: travelled values as they are, zeros or, with ``generator``, random
    values for the others; zeros shaped like ``like`` where the carry holds nothing). What the
    forward reads of the part (``embeddings.patch_embeddings.projection.weight.dtype``) it
    reads from ``attributes`` (the part, or what the model object keeps of it)."""

    def __init__(
        self,
        attributes: nn.Module,
        like: Tensor,
        shape: Any = None,
        shared: tuple[Any, ...] = (),
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.__dict__.update(
            attributes=attributes, like=like, shape=shape, shared=shared, generator=generator
        )

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.__dict__["attributes"], name)
        if isinstance(value, Tensor) and value.is_meta:
            return self._off_meta(value)
        if inspect.ismethod(value) and isinstance(value.__self__, nn.Module):
            method = value  # a way into the part besides its call (ProphetNet's ``_forward``)

            def called(*args: Any, **kwargs: Any) -> Any:
                return pytree.tree_map_only(Tensor, self._off_meta, method(*args, **kwargs))

            return called
        return value

    def _off_meta(self, value: Tensor) -> Tensor:
        """A tensor the forward gets from the part's skeleton (on the meta device, where another
        stage holds the part: its weight read directly, a method's result) as zeros on the
        stage's device (without memory), or random values for the guard, which then finds
        whether the output depends on them."""
        if not value.is_meta:
            return value
        d = self.__dict__
        device = d["like"].device
        if d["generator"] is None:
            return torch.zeros((), dtype=value.dtype, device=device).expand(value.shape)
        return fill(Zeros(tuple(value.shape), value.dtype), device, generator=d["generator"])  # type: ignore[no-any-return]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        d = self.__dict__
        shape = template(d["like"]) if d["shape"] is None else d["shape"]
        return fill(shape, d["like"].device, d["shared"], d["generator"])


@dataclass
class Blanks:
    """The parts of earlier blocks a replay stands in for: modules by path and parameters held
    directly by a container (path, shape, dtype). What the forward reads of a blanked module it
    reads from what the model object holds there: the module itself where the stage has it, else
    what a released part keeps (``pipemodel.Released``: its meta-device skeleton)."""

    modules: list[str] = field(default_factory=list)
    parameters: list[tuple[str, tuple[int, ...], torch.dtype]] = field(default_factory=list)

    @classmethod
    def of(cls, model: nn.Module, paths: Sequence[str]) -> Blanks:
        """The blanks for the parts at ``paths`` that hold parameters."""
        blanks = cls()
        for path in paths:
            obj = get_path(model, path)
            if isinstance(obj, nn.Module):
                if any(True for _ in obj.parameters()):
                    blanks.modules.append(path)
            elif isinstance(obj, Tensor):
                blanks.parameters.append((path, tuple(obj.shape), obj.dtype))
        return blanks

    @property
    def paths(self) -> list[str]:
        return [*self.modules, *(p for p, _, _ in self.parameters)]

    @contextmanager
    def placed(
        self,
        model: nn.Module,
        like: Tensor,
        carry: Carry | None,
        generator: torch.Generator | None = None,
        vary: Sequence[str] | None = None,
    ) -> Iterator[None]:
        """The blanks in the model object during the block (``like``: a tensor on the stage's
        device; with ``generator``, those at the paths ``vary``, by default all, hold random
        values where they do not travel)."""
        shapes = carry["blanks"] if carry is not None else {}
        shared = carry["shared"] if carry is not None else ()

        def source(path: str) -> torch.Generator | None:
            return generator if vary is None or path in vary else None

        saved = [(p, get_path(model, p)) for p in self.paths]
        unmade = _stateless_blanks(model, self.modules, like.device)
        saved += [(p, get_path(model, p)) for p in unmade]
        try:
            for path in self.modules:
                held = get_path(model, path)
                blank = Blank(held, like, shapes.get(path), shared, source(path))  # type: ignore[arg-type]
                set_path(model, path, blank)
            for path in unmade:
                module = get_path(model, path)
                set_path(model, path, Blank(module, like, shapes.get(path), shared, source(path)))  # type: ignore[arg-type]
            for path, size, dtype in self.parameters:
                value = fill(Zeros(size, dtype), like.device, generator=source(path))
                set_path(model, path, nn.Parameter(value, requires_grad=False))
            yield
        finally:
            for path, obj in saved:
                set_path(model, path, obj)


def forward_with(
    model: nn.Module,
    call: BodyInput,
    run: Run,
    watch: Sequence[tuple[str, nn.Module]] = (),
    blanks: Blanks | None = None,
    carry: Carry | None = None,
    generator: torch.Generator | None = None,
    vary: Sequence[str] | None = None,
) -> Any:
    """``model``'s forward on the step's ``call`` with ``run``'s stand-ins for its layers,
    ``blanks`` in place of earlier stages' parts (filled from ``carry``) and the parts ``watch``
    (path, module) recorded in ``run.outputs``; returns the model's output, or None where a
    stack's capture stopped the forward. An error of the model's own code before any layer is
    the user's and raised as it is; one the stand-ins or the blanks cause is a
    :class:`SplitError` that says so."""
    like = _device_tensor(model, call, carry)
    capture = any(s.mode in ("capture", "probe") for s in run.stacks)
    name = type(model).__name__
    with ExitStack() as stack:
        for path, module in watch:
            stack.callback(module.register_forward_hook(run.output_of(path)).remove)
        if blanks is not None:
            stack.enter_context(blanks.placed(model, like, carry, generator, vary))
        stack.enter_context(swapped(model, run))
        try:
            return model(*call.args, **training_kwargs(model, call.kwargs))
        except Captured:
            return None
        except SplitError:
            raise
        except Exception as err:
            if "device meta" in str(err) or "'meta'" in str(err):
                raise SplitError(
                    f"{name}.forward raised {type(err).__name__} ({err}) on a stage that holds "
                    "only its own parts: the forward reads a tensor of a part another stage "
                    "holds (kept here on the meta device) directly, not by calling the part "
                    "(ProphetNet's decoder reads `ngram_embeddings.weight`). Describe the model "
                    "with PipeModel (docs/models.md), putting that part with the code that reads "
                    "it, or train it on one device"
                ) from err
            if not run.reached and blanks is not None and blanks.paths:
                raise SplitError(
                    f"{name}.forward raised {type(err).__name__} ({err}) before its layers on a "
                    "stage that runs it with blanks for the parts earlier stages hold "
                    f"({blanks.paths}): the forward computes with those parts' outputs in a way "
                    "the blanks do not reproduce. Describe the model with PipeModel (docs/"
                    "models.md) or train it on one device"
                ) from err
            if run.reached and capture:
                raise SplitError(
                    f"{name}.forward raised {type(err).__name__} ({err}) after pipe2bw's "
                    f"stand-in for one of its layers returned: the stage runs the forward up to "
                    f"the layers with stand-ins that return their input{run.form_text()}. A "
                    "forward that computes with what a layer returns, other than passing it "
                    "on or an item of it, cannot be split into stages; describe the model with "
                    "PipeModel (docs/models.md) or train it on one device"
                ) from err
            if run.reached and hasattr(err, "add_note"):
                err.add_note(
                    f"(raised on the last pipeline stage, in the end of {name}.forward, after "
                    "its last layer)"
                )
            raise
    raise AssertionError("unreachable")  # pragma: no cover


def _device_tensor(model: nn.Module, call: BodyInput, carry: Carry | None) -> Tensor:
    """A tensor on the stage's device: the carry's hidden state, else the call's first."""
    if carry is not None and isinstance(carry.get("hidden"), Tensor):
        return carry["hidden"]  # type: ignore[no-any-return]
    for value in (*call.args, *call.kwargs.values()):
        if isinstance(value, Tensor):
            return value
    return torch.zeros(())


class ReplayHead:
    """The head of a model whose forward the last stage replays (the Hugging Face intake's):
    the model's own ``forward`` on the step's arguments computes what comes after the layers,
    so that the pooler, the classifier on the first token, the masked-LM head and the model's
    own loss are the model's code. ``_Last`` runs it with the body's blanks; called as a plain
    head (``head(model, hidden, args, kwargs)``) it runs without any."""

    def __call__(
        self, model: nn.Module, hidden: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        raise TypeError(
            "ReplayHead runs the model's own forward on the last stage; it is not a head "
            "function to call"
        )


def _stateless_blanks(model: nn.Module, blank: Sequence[str], device: torch.device) -> list[str]:
    """Modules without parameters left in the model object (the first stage's rotary table)
    follow the stage's device: a later stage's model object is not moved as a whole. Those
    whose buffers were never materialised (a model built on the meta device: the first stage
    holds the real ones) are blanked too; their paths are returned."""
    meta = []
    for path, module in model.named_modules():
        if path in blank or any(True for _ in module.parameters(recurse=False)):
            continue
        if any(b is not None and b.is_meta for b in module._buffers.values()):
            if not any(True for _ in module.parameters()):
                meta.append(path)
            continue
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    return [p for p in meta if not any(p.startswith(q + ".") for q in meta if q != p)]
