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

from lightning_pipe2bw.partition.carry import advance, call_of, pack
from lightning_pipe2bw.partition.guard import (
    call_problems,
    describe,
    kept_buffers,
    rewound,
    rng_state,
    shape_key,
)
from lightning_pipe2bw.partition.observe import TURN_OFF, SplitError, compare_outputs
from lightning_pipe2bw.partition.paths import get_path, set_path, skeleton
from lightning_pipe2bw.partition.standin import Captured, Run, swapped, training_kwargs
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
    """Block 0: the model's forward up to its layers, run with stand-ins for them
    (``partition.standin``), which gives each layer's arguments (or ``embed`` when given, whose
    arguments every layer takes). With ``check``, a micro-batch of new shapes is proved to split
    exactly (``partition.guard``)."""

    def __init__(
        self,
        model: nn.Module,
        paths: Sequence[str],
        blocks: str,
        embed: Callable[..., Any] | None,
        form: int = 0,
        check: bool = True,
    ) -> None:
        super().__init__(model, paths)
        self.pipe_blocks = blocks
        self.pipe_embed = embed
        self.pipe_form = form  # what a layer returns (observed at set-up): 0 a tensor, n a tuple
        self.pipe_check = check
        self.pipe_checked: set[Any] = set()  # the shapes proved to split exactly

    def forward(self, x: BodyInput) -> Any:
        if not isinstance(x, BodyInput):
            raise TypeError(
                f"the first block takes the body's call arguments, got {type(x).__name__}"
            )
        if self.pipe_embed is not None:
            with self.params_in_model():
                hidden, args, kwargs = self.pipe_embed(self.whole_model, *x.args, **x.kwargs)
            n = len(_get(self.whole_model, self.pipe_blocks))  # type: ignore[arg-type]
            return pack(hidden, [(tuple(args), dict(kwargs), None)] * n)
        key = shape_key(x.args, x.kwargs, self.training) if self.pipe_check else None
        if key is None or key in self.pipe_checked:
            return self._carry(self._run(x, "capture"))
        devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
        state = rng_state(devices)
        run = self._run(x, "capture")
        with torch.no_grad(), rewound(state, devices), kept_buffers(self):
            probe = self._run(x, "probe", torch.Generator().manual_seed(0))
        calls = [c for c in run.calls if c is not None]
        problems = call_problems(calls, probe.calls, probe.problems)
        if problems:
            model = type(self.whole_model).__name__
            raise SplitError(
                f"the pipeline split of {model} would compute something else than the whole "
                f"model on a micro-batch of new {describe(key)}: {'; '.join(problems)}. The "
                f"first stage runs {model}.forward with stand-ins for its layers "
                f"{self.pipe_blocks!r} to learn what each layer is passed, which is exact only "
                "when no layer's arguments depend on what the layers compute and each layer's "
                "output goes unchanged to the next. Describe the model with "
                "PipeModel(model, blocks=..., embed=...) (docs/models.md) or train it on one "
                f"device; {TURN_OFF} turns this guard off"
            )
        self.pipe_checked.add(key)
        return self._carry(run)

    def _carry(self, run: Run) -> Any:
        calls = [c for c in run.calls if c is not None]
        return pack(run.first, calls, run.templates, self.pipe_form if self.pipe_form else -1)

    def _run(self, x: BodyInput, mode: str, generator: torch.Generator | None = None) -> Run:
        """The model's forward on ``x`` up to its last layer, with stand-ins for the layers."""
        model = self.whole_model
        layers = _get(model, self.pipe_blocks)
        run = Run(list(layers), mode, form=self.pipe_form, generator=generator)  # type: ignore[arg-type]
        handles = [
            module.register_forward_hook(run.template_of(path))
            for path, module in self.parts()
            if isinstance(module, nn.Module) and any(True for _ in module.parameters())
        ]
        try:
            with swapped(model, self.pipe_blocks, run), self.params_in_model():
                model(*x.args, **training_kwargs(model, x.kwargs))
        except Captured:
            return run
        except SplitError:
            raise
        except Exception as err:
            if not run.reached:  # the model's own code, before its layers: the user's to see
                raise
            raise SplitError(
                f"{type(model).__name__}.forward raised {type(err).__name__} ({err}) after "
                f"pipe2bw's stand-in for its layer {run.reached - 1} returned: on the first "
                f"stage the forward runs up to its last layer with stand-ins for the layers "
                f"{self.pipe_blocks!r}, which return their input{run.form_text()}. A forward "
                "that computes with what a layer returns, other than handing its hidden state "
                "to the next layer, cannot be split into stages; describe the model with "
                "PipeModel (docs/models.md) or train it on one device"
            ) from err
        finally:
            for handle in handles:
                handle.remove()
        n = len(layers)  # type: ignore[arg-type]
        raise SplitError(
            f"{type(model).__name__}.forward returned after calling {run.reached} of its {n} "
            f"layers {self.pipe_blocks!r}: the pipeline runs every layer of the list once, in "
            "order; name the list its forward iterates as `blocks`, or give an `embed` function"
        )


class _Layer(_Part):
    """One layer (``index`` in its list), called as the model's forward calls it, with the
    arguments the carry holds for it."""

    def __init__(self, model: nn.Module, paths: Sequence[str], index: int) -> None:
        super().__init__(model, paths)
        self.pipe_index = index

    def forward(self, carry: Any) -> Any:
        args, kwargs, key = call_of(carry, self.pipe_index)
        layer = _get(self, self.pipe_paths[0])
        hidden = carry["hidden"]
        if key is None:
            out = layer(hidden, *args, **kwargs)  # type: ignore[operator]
        else:
            out = layer(*args, **{key: hidden}, **kwargs)  # type: ignore[operator]
        form = len(out) if isinstance(out, tuple) else 0
        if form:  # layers that return (hidden, attentions, ...)
            out = out[0]
        return advance(carry, self.pipe_index, out, form)


class _Last(_Part):
    """The last block: ``head`` with the step's own arguments (labels). A head that replays the
    model's forward (``partition.hf.ReplayHead``) is, with ``check``, proved on every
    micro-batch of new shapes not to read the first stage's parts (``partition.guard``)."""

    takes_call_input = True

    def __init__(
        self, model: nn.Module, paths: Sequence[str], head: Head, check: bool = True
    ) -> None:
        super().__init__(model, paths)
        self.pipe_head = head
        self.pipe_check = check
        self.pipe_checked: set[Any] = set()
        self.call_input: BodyInput | None = None

    def forward(self, carry: Any) -> Any:
        call = self.call_input or BodyInput((), {})
        model = _whole(self)
        with self.params_in_model():
            replay = getattr(self.pipe_head, "replay", None)
            if replay is None:
                return self.pipe_head(model, carry["hidden"], call.args, call.kwargs)
            key = shape_key(call.args, call.kwargs, self.training) if self.pipe_check else None
            if key is None or key in self.pipe_checked:
                return replay(model, carry, call)
            devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
            state = rng_state(devices)
            out = replay(model, carry, call)
            with torch.no_grad(), rewound(state, devices), kept_buffers(self):
                other = replay(model, carry, call, torch.Generator().manual_seed(0))
        problems = compare_outputs(out, other, rtol=1e-5, atol=1e-6)
        if problems:
            name = type(model).__name__
            read = self._culprits(model, carry, call, out, (state, devices))
            raise SplitError(
                f"the pipeline split of {name} would compute something else than the whole "
                f"model on a micro-batch of new {describe(key)}: the end of {name}.forward, "
                "which the last stage runs with blanks for the parts the first stage holds, "
                f"gives another output when the blanks hold other values ({'; '.join(problems)})"
                f": it reads what {read} computes, which only the first stage has. Describe "
                "the model with PipeModel(model, ..., head=...) (docs/models.md) or train it "
                f"on one device; {TURN_OFF} turns this guard off"
            )
        self.pipe_checked.add(key)
        return out

    def _culprits(
        self, model: nn.Module, carry: Any, call: BodyInput, out: Any, random: Any
    ) -> str:
        """The blanked parts whose values change the replay's output, for the guard's message
        (one replay per part, on the failure path only; ``random``: the random state and
        devices the first replay ran with)."""
        head: Any = self.pipe_head
        read = []
        for path in head.blanked:
            with torch.no_grad(), rewound(*random), kept_buffers(self):
                other = head.replay(model, carry, call, torch.Generator().manual_seed(0), [path])
                if compare_outputs(out, other, rtol=1e-5, atol=1e-6):
                    read.append(path)
        return repr(read[0]) if len(read) == 1 else f"{read}" if read else "a part"


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

    def __init__(self, spec: PipeModel, check: bool = True) -> None:
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
        form = getattr(spec.observed, "layer_tuple", 0)
        parts: list[nn.Module] = [_First(model, spec.pre, spec.blocks, spec.embed, form, check)]
        parts += [_Layer(model, [n], i) for i, n in enumerate(names)]
        head = spec.head or functools.partial(_chain, spec.post)
        parts.append(_Last(model, spec.post, head, check))
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
                        _set(model, path, Released(path, skeleton(obj)))  # replay runs them
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
