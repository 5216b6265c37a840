"""Models that are not an ``nn.Sequential``: how a model that keeps its layers in a list splits
into pipeline blocks, without rewriting it.

A :class:`PipeModel` names the parts of a model by their dotted paths in it:

- ``blocks``: the ``nn.ModuleList`` (or ``nn.Sequential``) of repeated layers its forward runs in
  order (``"transformer.h"`` in Hugging Face's GPT-2, ``"model.layers"`` in Llama), or several
  such lists that it runs one after the other (an encoder's and a decoder's:
  ``["model.encoder.layers", "model.decoder.layers"]``);
- ``pre``: the modules (or parameters) that run before the first layer (embeddings, the rotary
  table): they live on the first stage;
- ``between``: for several lists, the parts that run between list k and list k + 1 (the
  encoder's final norm, the decoder's embeddings): they live where list k + 1 starts;
- ``post``: those after the last layer (final norm, head): they live on the last stage.

Every parameter of the model must be in one of them (the error lists the ones that are not).
From it, :meth:`PipeModel.body` makes a :class:`PipeModelBody`: an ``nn.Sequential`` of adapter
blocks (``partition.blocks``), ``[first, the layers of list 0, junction, the layers of list 1,
..., last]``, that the strategy partitions like any body. Each adapter holds the model's own
modules under their own paths, so the body's ``state_dict`` keys are the model's keys
(``transformer.h.3.attn.c_attn.weight``), and :meth:`PipeModelBody.restore` puts the trained
modules back into the original model object (after a Trainer call your ``self.model`` is the
Hugging Face model again).

How the parts run (nothing of the model is re-implemented):

- the **first block** runs the model's own ``forward`` on the step's arguments, with each layer
  swapped for a stand-in that records what the model passes it (the hidden state and every
  other argument: attention mask, position ids, rotary ``(cos, sin)``, each layer its own) and
  stops at the last layer (``partition.standin``): the model's own code computes every layer's
  arguments, for any model whose forward calls its layer list;
- each **layer block** calls its layer as the model's loop does: ``layer(hidden, *args,
  **kwargs)`` with its own captured arguments, which travel with the hidden state between
  stages, each distinct tensor once (``partition.carry``);
- a **junction** (several lists) runs the model's ``forward`` again, with the parts earlier
  stages hold as blanks and the previous list handing over its real output, up to the next
  list, whose arguments it records (the encoder's output among the decoder's);
- the **last block** runs ``head(model, hidden, args, kwargs)`` with the step's arguments (the
  labels) on the last stage: for Hugging Face models the model's own ``forward`` replayed after
  the layers (``partition.replay``), returning the model's output class (``out.loss``,
  ``out.logits``).

With ``check`` (the strategy's ``check_split``), each block that runs the model's forward proves
each micro-batch of new shapes to split exactly (``partition.guard``).

:func:`partition.hf.pipe_model_for` describes Hugging Face models (found by watching one
forward); any other model is described by hand.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_pipe2bw.partition.blocks import First, Head, Junction, Last, Layer, Part, StackInfo
from lightning_pipe2bw.partition.paths import get_path, set_path, skeleton
from lightning_pipe2bw.partition.recorded import forget_capture_hooks
from lightning_pipe2bw.partition.replay import Blanks
from lightning_pipe2bw.runtime.call import BodyInput, call_input
from lightning_pipe2bw.runtime.stage import add_block_index, drop_block_index

__all__ = ["PipeModel", "PipeModelBody"]

# the parts of a model by their dotted paths (kept under these names for the modules that use them)
_get, _set = get_path, set_path


class Released(nn.Module):
    """What remains in the original model object of a part another stage runs: calling it
    raises; its attributes are read from ``skeleton`` (the part on the meta device), so that a
    forward that reads them (``layer.attention_type``, a weight's dtype) runs as it does with
    the part."""

    def __init__(self, path: str, skeleton: nn.Module | None = None) -> None:
        super().__init__()
        self.path = path
        self.__dict__["skeleton"] = skeleton  # not a submodule: no state, no hooks

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            shape = self.__dict__.get("skeleton")
            if shape is None:
                raise
            return getattr(shape, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.path!r} runs on another pipeline stage: this rank holds only its stage's part "
            "of the model (call the model through trainer.fit/validate/test/predict)"
        )


@dataclass
class PipeModel:
    """How ``model`` splits into pipeline blocks (see the module notes).

    ``head(model, hidden, args, kwargs)`` runs the ``post`` part on the last stage; it receives
    the model object (whose ``post`` modules are there: ``model.lm_head``) and the step's
    arguments (the labels). Without ``head`` the ``post`` modules are applied in order to the
    hidden state; ``head=ReplayHead()`` (``lightning_pipe2bw.partition.replay``) runs the
    model's own forward after the layers, as the Hugging Face intake does. ``head`` and
    ``embed`` must be module-level functions (or ``functools.partial`` of one): blocks travel
    between processes pickled. ``embed(model, *args, **kwargs)`` replaces the capture of the
    first layer's arguments; it must then return ``(hidden, args, kwargs)``, which every layer
    of the first list is called with. ``between[k]`` are the parts that run between list k and
    list k + 1 of ``blocks`` (several lists only). ``carried`` names parts whose outputs, and
    lists whose last layer's output, travel to the stages after them, for a forward that reads
    them after the layers (an encoder-decoder's output holds the encoder's); the intake sets it
    where the guard finds the end of the forward reading them. ``init(module)`` initialises a
    module built on the meta device (default: the model's ``_init_weights``, as Hugging Face
    models have).
    """

    model: nn.Module
    blocks: str | Sequence[str]
    pre: Sequence[str] = ()
    post: Sequence[str] = ()
    head: Head | None = None
    embed: Callable[..., Any] | None = None
    init: Callable[[nn.Module], None] | None = None
    between: Sequence[Sequence[str]] = ()
    carried: Sequence[str] = ()
    # how the model's own loss counts a call's items (``partition.hf.item_count``), for a loss
    # that divides by the whole batch's count (``num_items_in_batch``); a module-level function
    # or a partial of one (it travels with the last block)
    count_items: Callable[[BodyInput], Any] | None = None
    # set by the intake that watched the model's forward (``partition.observe``): the whole
    # model's output on the first micro-batch, which the split's output is checked against,
    # and what each list's layers return
    observed: Any = field(default=None, repr=False, compare=False)

    @property
    def stacks(self) -> list[str]:
        """The paths of the layer lists, in the order the forward runs them."""
        return [self.blocks] if isinstance(self.blocks, str) else list(self.blocks)

    def body(self, check: bool = True) -> PipeModelBody:
        """The model as an ``nn.Sequential`` of blocks (the model's modules, not copies); with
        ``check``, each micro-batch of new shapes is proved to split exactly
        (``partition.guard``)."""
        return PipeModelBody(self, check)


def _chain(
    paths: Sequence[str],
    model: nn.Module,
    hidden: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The default head: the ``post`` modules applied in order."""
    for path in paths:
        hidden = get_path(model, path)(hidden)  # type: ignore[operator]
    return hidden


class PipeModelBody(nn.Sequential):
    """A :class:`PipeModel` as a body: ``[first, layers of list 0, (junction, layers of list 1,
    ...), last]``.

    Its state-dict keys are the model's (the block index is left out), its call takes any
    arguments (they reach the first block, and the junctions and the last as
    :class:`BodyInput`), and :meth:`restore` returns the original model object holding the
    given blocks' modules.
    """

    takes_any_call = True
    spec: PipeModel

    def __init__(self, spec: PipeModel, check: bool = True) -> None:
        model = spec.model
        stacks = spec.stacks
        between = [list(b) for b in spec.between]
        name = type(model).__name__
        if len(between) != len(stacks) - 1:
            raise ValueError(
                f"PipeModel of {name} has {len(stacks)} layer lists {stacks} and "
                f"{len(between)} `between` lists: give one list of parts for each place "
                "between two layer lists (the parts that run there)"
            )
        lists = [get_path(model, path) for path in stacks]
        for path, layers in zip(stacks, lists, strict=True):
            if not isinstance(layers, (nn.ModuleList, nn.Sequential)):
                raise TypeError(
                    f"blocks={path!r} of {name} is a {type(layers).__name__}; name the "
                    "nn.ModuleList (or nn.Sequential) of layers its forward runs in order"
                )
        named = [*spec.pre, *spec.post, *(p for b in between for p in b)]
        problems = [p for p in named if not _resolves(model, p)]
        if problems:
            raise ValueError(
                f"{name} has no submodule or parameter {problems} (pre/between/post name "
                "modules or parameters by their dotted paths in the model)"
            )
        layout = _layout(stacks, lists, spec.observed)
        carried = list(spec.carried)
        parts: list[nn.Module] = [First(model, spec.pre, layout, spec.embed, check, carried)]
        earlier = list(spec.pre)
        for k, (path, layers) in enumerate(zip(stacks, lists, strict=True)):
            if k:
                blanks = Blanks.of(model, earlier)
                junction = Junction(model, between[k - 1], layout, k, blanks, check, carried)
                parts.append(junction)
                earlier += between[k - 1]
            offset = layout[k].offset
            names = list(layers._modules)  # type: ignore[union-attr]
            parts += [
                Layer(model, [f"{path}.{n}"], offset + i, k, last=i == len(names) - 1)
                for i, n in enumerate(names)
            ]
        head = spec.head or functools.partial(_chain, spec.post)
        parts.append(
            Last(
                model, spec.post, head, layout, Blanks.of(model, earlier), check,
                count=spec.count_items,
            )
        )  # fmt: skip
        super().__init__(*parts)
        object.__setattr__(self, "spec", spec)
        if spec.init is not None:  # a body built on meta is initialised by the model's own init
            object.__setattr__(self, "_init_weights", spec.init)
        covered = {id(p) for part in parts for p in part.parameters()}
        stray = [n for n, p in model.named_parameters() if id(p) not in covered]
        if stray:
            raise ValueError(
                f"parameters of {name} in none of its pipeline parts: {stray}. Every parameter "
                f"must be in `pre`, `blocks` ({spec.blocks!r}), `between` or `post`; add the "
                "modules that hold them to `pre` (run before the layers) or `post` (after)"
            )
        self._owner = {key: index for index, part in enumerate(parts) for key in part.state_dict()}
        # parameters the whole model's forward never reached (as observed): no gradient on one
        # device either
        self.unused_by_model = frozenset(getattr(spec.observed, "unused", ()))
        self._register_state_dict_hook(drop_block_index)
        self._register_load_state_dict_pre_hook(self._add_block_index, with_module=False)

    def carry_parts(self, paths: Sequence[str]) -> None:
        """Let the outputs of the parts (or layer lists) at ``paths`` travel to the later
        stages' replays (see :class:`PipeModel`'s ``carried``)."""
        self.spec.carried = [*self.spec.carried, *paths]
        for block in self:
            carried, checked = (
                getattr(block, "pipe_carried", None),
                getattr(block, "pipe_checked", None),
            )
            if isinstance(carried, set) and isinstance(checked, set):
                carried.update(paths)
                checked.clear()

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


def _layout(stacks: Sequence[str], lists: Sequence[Any], observed: Any) -> list[StackInfo]:
    """Each layer list's place among all layers, and what its layers return (as observed)."""
    forms = getattr(observed, "forms", None) or {}
    markers = getattr(observed, "markers", None) or {}
    layout, offset = [], 0
    for k, (path, layers) in enumerate(zip(stacks, lists, strict=True)):
        layout.append(StackInfo(path, len(layers), offset, forms.get(k, 0), markers.get(k, ())))
        offset += len(layers)
    return layout


def restore_model(model: nn.Module, blocks: Mapping[int, nn.Module]) -> nn.Module:
    """Put each block's modules and parameters back into ``model`` at their paths."""
    for block in blocks.values():
        if isinstance(block, Part):
            for path, obj in block.parts():
                _set(model, path, obj)
    for block in blocks.values():
        if isinstance(block, Part):
            object.__setattr__(block, "whole_model", model)
    forget_capture_hooks(model)  # installed afresh on the whole model when next needed
    return model


def release(model: nn.Module, blocks: Sequence[nn.Module]) -> None:
    """Replace, in the original model object, the parts held by ``blocks`` (other stages') by
    :class:`Released` stand-ins, so that their memory is freed."""
    for block in blocks:
        if isinstance(block, Part):
            for path, obj in list(block.parts()):
                if isinstance(obj, nn.Module):
                    if any(True for _ in obj.parameters()):  # modules without any stay: the
                        _set(model, path, Released(path, skeleton(obj)))  # replay runs them
                else:
                    _set(model, path, nn.Parameter(torch.empty(0), requires_grad=False))


def _resolves(model: nn.Module, path: str) -> bool:
    try:
        obj = _get(model, path)
    except AttributeError:
        return False
    return isinstance(obj, (nn.Module, nn.Parameter))
