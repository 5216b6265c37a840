"""Models that are not an ``nn.Sequential``: how a model that keeps its layers in a list splits
into pipeline blocks, without rewriting it.

A :class:`PipeModel` names three parts of a model, by their dotted paths in it:

- ``blocks``: the ``nn.ModuleList`` (or ``nn.Sequential``) of repeated layers its forward runs in
  order (``"transformer.h"`` in Hugging Face's GPT-2, ``"model.layers"`` in Llama);
- ``pre``: the modules (or parameters) that run before the first layer (embeddings, the rotary
  table): they live on the first stage;
- ``post``: those after the last layer (final norm, head): they live on the last stage.

Every parameter of the model must be in one of them (the error lists the ones that are not).
From it, :meth:`PipeModel.body` makes a :class:`PipeModelBody`: an ``nn.Sequential`` of
``1 + len(blocks) + 1`` adapter blocks that the strategy partitions like any body. Each adapter
holds the model's own modules under their own paths, so the body's ``state_dict`` keys are the
model's keys (``transformer.h.3.attn.c_attn.weight``), and :meth:`PipeModelBody.restore` puts the
trained modules back into the original model object (after a Trainer call your ``self.model`` is
the Hugging Face model again).

How the parts run:

- the **first block** runs the model's own ``forward`` on the step's arguments, with the layer
  list swapped for one that stops at the first layer and captures what the model passes it (the
  hidden state and every other argument: attention mask, position ids, rotary ``(cos, sin)``):
  the model's own code computes them, for any model whose forward calls its layer list;
- each **layer block** calls its layer as the model's loop does: ``layer(hidden, *args,
  **kwargs)`` with the captured arguments, which travel with the hidden state between stages;
- the **last block** runs ``head(model, hidden, args, kwargs)`` with the step's arguments (the
  labels) on the last stage: for Hugging Face models the final norm, the head and the model's own
  loss function, returning the model's output class (``out.loss``, ``out.logits``).

:func:`partition.hf.pipe_model_for` describes Hugging Face models (found by watching one
forward); any other model is described by hand.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe2bw.runtime.stage import (
    BodyInput,
    add_block_index,
    call_input,
    drop_block_index,
)

__all__ = [
    "BodyInput",
    "PipeModel",
    "PipeModelBody",
    "Released",
]

# runs the last part of the model: (model, hidden state, the step's args, its kwargs) -> output
Head = Callable[[nn.Module, Any, tuple[Any, ...], dict[str, Any]], Any]


class _Captured(BaseException):
    """Raised by the stand-in for the first layer: a BaseException, so that no ``except
    Exception`` in the model's forward swallows it."""

    def __init__(self, hidden: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("captured the first layer's input")
        self.carry = (hidden, args, kwargs)


class _Capture(nn.Module):
    """Stands in for the first layer during the first block: stops the model's forward there."""

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(hidden, args, kwargs)


class Released(nn.Module):
    """What remains in the original model object of a part another stage runs."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.path!r} runs on another pipeline stage: this rank holds only its stage's part "
            "of the model (call the model through trainer.fit/validate/test/predict)"
        )


def _get(root: nn.Module, path: str) -> nn.Module | Tensor:
    obj: Any = root
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj  # type: ignore[no-any-return]


def _set(root: nn.Module, path: str, value: nn.Module | Tensor) -> None:
    parent_path, _, name = path.rpartition(".")
    parent: Any = root.get_submodule(parent_path) if parent_path else root
    if isinstance(value, nn.Parameter) or name in parent._parameters:
        parent._parameters[name] = value
    else:
        parent._modules[name] = value


class _Part(nn.Module):
    """A block that holds some of the model's modules and parameters under their own paths
    (nested holder modules rebuild the path), so its state-dict keys are the model's."""

    whole_model: Any  # the original model object (not a child), None after travelling

    def __init__(self, model: nn.Module, paths: Sequence[str]) -> None:
        super().__init__()
        self.pipe_paths = list(paths)
        for path in self.pipe_paths:
            _set_nested(self, path, _get(model, path))
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
            yield path, _get(self, path)

    @contextmanager
    def params_in_model(self) -> Iterator[None]:
        """During a call: the model object's slots of the parameters this part holds directly
        (``cls_token``) hold what the part holds now. A module is the same object in both, but
        a parameter of the model itself is a slot of its own there, which a weight version
        swapped into the part (2BW swaps them in as ``torch.func.functional_call`` does) would
        not reach."""
        model = self.whole_model
        direct = [(p, _get(self, p)) for p in self.pipe_paths]
        direct = [(p, t) for p, t in direct if not isinstance(t, nn.Module)]
        saved = [(p, _get(model, p)) for p, _ in direct]
        for path, tensor in direct:
            _set(model, path, tensor)
        try:
            yield
        finally:
            for path, tensor in saved:
                _set(model, path, tensor)


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


class _First(_Part):
    """Block 0: the model's forward up to its first layer (or ``embed`` when given)."""

    def __init__(
        self, model: nn.Module, paths: Sequence[str], blocks: str, embed: Callable[..., Any] | None
    ) -> None:
        super().__init__(model, paths)
        self.pipe_blocks = blocks
        self.pipe_embed = embed

    def forward(self, x: BodyInput) -> Any:
        if not isinstance(x, BodyInput):
            raise TypeError(
                f"the first block takes the body's call arguments, got {type(x).__name__}"
            )
        if self.pipe_embed is not None:
            with self.params_in_model():
                return self.pipe_embed(self.whole_model, *x.args, **x.kwargs)
        model = self.whole_model
        layers = _get(model, self.pipe_blocks)
        stand_in: nn.Module = (
            nn.Sequential(_Capture())
            if isinstance(layers, nn.Sequential)
            else nn.ModuleList([_Capture()])
        )
        kwargs = dict(x.kwargs)
        if getattr(getattr(model, "config", None), "use_cache", None) is not None:
            kwargs.setdefault("use_cache", False)  # no key/value cache in training
        _set(model, self.pipe_blocks, stand_in)
        try:
            with self.params_in_model():
                model(*x.args, **kwargs)
        except _Captured as captured:
            return captured.carry
        finally:
            _set(model, self.pipe_blocks, layers)  # type: ignore[arg-type]
        raise RuntimeError(
            f"{type(model).__name__}.forward returned without calling its layers "
            f"{self.pipe_blocks!r}: name the list its forward iterates as `blocks`, or give an "
            "`embed` function"
        )


class _Layer(_Part):
    """One layer, called as the model's loop calls it."""

    def forward(self, carry: Any) -> Any:
        hidden, args, kwargs = carry
        out = _get(self, self.pipe_paths[0])(hidden, *args, **kwargs)  # type: ignore[operator]
        if isinstance(out, tuple):  # older layers return (hidden, attentions, ...)
            out = out[0]
        return out, args, kwargs


class _Last(_Part):
    """The last block: ``head`` with the step's own arguments (labels)."""

    takes_call_input = True

    def __init__(self, model: nn.Module, paths: Sequence[str], head: Head) -> None:
        super().__init__(model, paths)
        self.pipe_head = head
        self.call_input: BodyInput | None = None

    def forward(self, carry: Any) -> Any:
        hidden, _, _ = carry  # (hidden, args, kwargs) from the last layer
        call = self.call_input or BodyInput((), {})
        with self.params_in_model():
            return self.pipe_head(_whole(self), hidden, call.args, call.kwargs)


@dataclass
class PipeModel:
    """How ``model`` splits into pipeline blocks (see the module notes).

    ``head(model, hidden, args, kwargs)`` runs the ``post`` part on the last stage; it receives
    the model object (whose ``post`` modules are there: ``model.lm_head``) and the step's
    arguments (the labels). Without ``head`` the ``post`` modules are applied in order to the
    hidden state. ``head`` and ``embed`` must be module-level functions (or
    ``functools.partial`` of one): blocks travel between processes pickled.
    ``embed(model, *args, **kwargs)`` replaces the capture of the first layer's arguments; it
    must then return what the first layer block takes: ``(hidden, args, kwargs)``. ``init(module)`` initialises a module built on
    the meta device (default: the model's ``_init_weights``, as Hugging Face models have).
    """

    model: nn.Module
    blocks: str
    pre: Sequence[str] = ()
    post: Sequence[str] = ()
    head: Head | None = None
    embed: Callable[..., Any] | None = None
    init: Callable[[nn.Module], None] | None = None
    # set by the intake that watched the model's forward (``partition.observe``): the whole
    # model's output on the first micro-batch, which the split's output is checked against
    observed: Any = field(default=None, repr=False, compare=False)

    def body(self) -> PipeModelBody:
        """The model as an ``nn.Sequential`` of blocks (the model's modules, not copies)."""
        return PipeModelBody(self)


def _chain(
    paths: Sequence[str],
    model: nn.Module,
    hidden: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The default head: the ``post`` modules applied in order."""
    for path in paths:
        hidden = _get(model, path)(hidden)  # type: ignore[operator]
    return hidden


class PipeModelBody(nn.Sequential):
    """A :class:`PipeModel` as a body: ``[first, layer 0, ..., layer L-1, last]``.

    Its state-dict keys are the model's (the block index is left out), its call takes any
    arguments (they reach the first block, and the last as :class:`BodyInput`), and
    :meth:`restore` returns the original model object holding the given blocks' modules.
    """

    takes_any_call = True
    spec: PipeModel

    def __init__(self, spec: PipeModel) -> None:
        model = spec.model
        layers = _get(model, spec.blocks)
        if not isinstance(layers, (nn.ModuleList, nn.Sequential)):
            raise TypeError(
                f"blocks={spec.blocks!r} of {type(model).__name__} is a {type(layers).__name__}; "
                "name the nn.ModuleList (or nn.Sequential) of layers its forward runs in order"
            )
        problems = [p for p in (*spec.pre, *spec.post) if not _resolves(model, p)]
        if problems:
            raise ValueError(
                f"{type(model).__name__} has no submodule or parameter {problems} (pre/post name "
                "modules or parameters by their dotted paths in the model)"
            )
        names = [f"{spec.blocks}.{name}" for name in layers._modules]
        parts: list[nn.Module] = [_First(model, spec.pre, spec.blocks, spec.embed)]
        parts += [_Layer(model, [n]) for n in names]
        parts.append(_Last(model, spec.post, spec.head or functools.partial(_chain, spec.post)))
        super().__init__(*parts)
        object.__setattr__(self, "spec", spec)
        if spec.init is not None:  # a body built on meta is initialised by the model's own init
            object.__setattr__(self, "_init_weights", spec.init)
        covered = {id(p) for part in parts for p in part.parameters()}
        stray = [n for n, p in model.named_parameters() if id(p) not in covered]
        if stray:
            raise ValueError(
                f"parameters of {type(model).__name__} in none of its pipeline parts: {stray}. "
                f"Every parameter must be in `pre`, `blocks` ({spec.blocks!r}) or `post`; add the "
                "modules that hold them to `pre` (run before the layers) or `post` (after)"
            )
        self._owner = {key: index for index, part in enumerate(parts) for key in part.state_dict()}
        self._register_state_dict_hook(drop_block_index)
        self._register_load_state_dict_pre_hook(self._add_block_index, with_module=False)

    # ------------------------------------------------------------------ names
    def _add_block_index(self, state: dict[str, Any], prefix: str, *args: Any) -> None:
        add_block_index(state, prefix, self._owner)

    @property
    def owner(self) -> Mapping[str, int]:
        """Which block holds each state-dict key of the model."""
        return self._owner

    # ------------------------------------------------------------------ calls
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x: Any = BodyInput(args, kwargs)
        call = x
        for block in self:
            with call_input(block, call):
                x = block(x)
        return x

    def restore(self, blocks: Mapping[int, nn.Module]) -> nn.Module:
        """The original model object holding ``blocks``' modules (every block: the whole model,
        trained; after a hand-back the blocks may be copies received from other ranks)."""
        return restore_model(self.spec.model, blocks)


def restore_model(model: nn.Module, blocks: Mapping[int, nn.Module]) -> nn.Module:
    """Put each block's modules and parameters back into ``model`` at their paths."""
    for block in blocks.values():
        if isinstance(block, _Part):
            for path, obj in block.parts():
                _set(model, path, obj)
    for block in blocks.values():
        if isinstance(block, _Part):
            object.__setattr__(block, "whole_model", model)
    return model


def release(model: nn.Module, blocks: Sequence[nn.Module]) -> None:
    """Replace, in the original model object, the parts held by ``blocks`` (other stages') by
    :class:`Released` stand-ins, so that their memory is freed."""
    for block in blocks:
        if isinstance(block, _Part):
            for path, obj in list(block.parts()):
                if isinstance(obj, nn.Module):
                    if any(True for _ in obj.parameters()):  # modules without any stay: the
                        _set(model, path, Released(path))  # last stage's replay runs them
                else:
                    _set(model, path, nn.Parameter(torch.empty(0), requires_grad=False))


def _resolves(model: nn.Module, path: str) -> bool:
    try:
        obj = _get(model, path)
    except AttributeError:
        return False
    return isinstance(obj, (nn.Module, nn.Parameter))


def _whole(part: nn.Module) -> Any:
    model = getattr(part, "whole_model", None)
    if model is None:
        raise RuntimeError("this block travelled without its model; restore the model first")
    return model
