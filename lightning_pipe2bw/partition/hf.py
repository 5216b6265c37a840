"""Hugging Face transformers models as they come: their layer list, what runs before and after
it, and the model's own code for the end of the forward.

:func:`pipe_model_for` describes any model with a base model (``base_model_prefix``) that keeps
its layers in an ``nn.ModuleList`` and calls them in a loop (causal and masked language models,
sequence and token classifiers, image classifiers, ...). Which parts run before the layers
(first stage) and which after (last stage) comes from one observed forward on the step's first
micro-batch (``partition.observe``); without one (a model built on the meta device), from the
order the base model registers its children, and the first step's unused-parameter check
catches what that order gets wrong.

The last stage runs the end of the forward with :func:`replay_head`: the model's own ``forward``
on the step's arguments, with the layers swapped for stand-ins that hand over the hidden state
the last layer produced, and the parts before the layers (held by the first stage) for blanks.
So the pooler, the classifier on the first token, the masked-LM head and the model's own loss
(with its ``problem_type``) are the model's code, not ours.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe2bw.partition.carry import Zeros, fill, template
from lightning_pipe2bw.partition.observe import Observation, SplitError, evaluating, observe
from lightning_pipe2bw.partition.paths import skeleton
from lightning_pipe2bw.partition.pipemodel import PipeModel, _get, _set
from lightning_pipe2bw.partition.standin import Run, swapped, training_kwargs
from lightning_pipe2bw.runtime.stage import BodyInput

__all__ = ["ReplayHead", "hf_layout", "pipe_model_for", "training_kwargs"]


def _base(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(prefix, base model) of a Hugging Face model: ``model.<base_model_prefix>``, or the
    model itself for a base model (``BertModel``)."""
    prefix = getattr(model, "base_model_prefix", None)
    if not isinstance(prefix, str) or not hasattr(model, "config"):
        return None
    base = getattr(model, prefix, None) if prefix else None
    if isinstance(base, nn.Module):
        return prefix, base
    return "", model


def _layers_in(base: nn.Module) -> str | None:
    """The name (within ``base``) of its list of layers: the ``nn.ModuleList`` holding the most
    parameters, searched one level deep (``h``, ``layers``, ``encoder.layer``)."""
    best: tuple[int, str] | None = None
    for name, sub in base.named_modules():
        if isinstance(sub, nn.ModuleList) and name.count(".") <= 1 and len(sub) > 0:
            n = sum(p.numel() for p in sub.parameters())
            if best is None or n > best[0]:
                best = (n, name)
    return None if best is None else best[1]


def hf_layout(model: nn.Module) -> tuple[str, str] | None:
    """(base prefix, layers path in the model) of a Hugging Face model the split can take, or
    None: the static shape only, nothing runs."""
    found = _base(model)
    if found is None:
        return None
    prefix, base = found
    layers = _layers_in(base)
    if layers is None:
        return None
    return prefix, f"{prefix}.{layers}" if prefix else layers


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _registered_parts(model: nn.Module, prefix: str, layers: str) -> tuple[list[str], list[str]]:
    """(pre, post) by registration order, for a model no forward was watched on: the base
    model's children (and the layer list's siblings) registered before the layers are ``pre``,
    those after that hold parameters ``post``; the model's own children besides the base (the
    head) are ``post``."""
    base = model.get_submodule(prefix) if prefix else model
    inner = layers[len(prefix) + 1 :] if prefix else layers
    top = inner.split(".")[0]
    pre: list[str] = []
    post: list[str] = []
    after = False
    for name, child in base.named_children():
        if child is None:
            continue
        if name == top:
            after = True
            if "." in inner:  # the list sits in a container (encoder.layer): its siblings
                for sub, _ in child.named_children():
                    if f"{top}.{sub}" != inner:
                        pre.append(_join(prefix, f"{top}.{sub}"))
            continue
        holds = any(True for _ in child.parameters())
        (post if after and holds else pre).append(_join(prefix, name))
    if prefix:
        for name, child in model.named_children():
            if name != prefix and child is not None:
                post.append(name)
    return pre, post


def _direct_parameters(model: nn.Module, layers: str) -> list[str]:
    """The parameters held directly by the modules the layer list sits in (the model, its base,
    an encoder): they go with the first stage, as the forward uses them before the layers."""
    heads = layers.split(".")
    found = []
    for k in range(len(heads)):
        path = ".".join(heads[:k])
        holder = model.get_submodule(path) if path else model
        found += [_join(path, name) for name, _ in holder.named_parameters(recurse=False)]
    return found


def pipe_model_for(model: nn.Module, call: BodyInput | None = None) -> PipeModel | None:
    """A :class:`PipeModel` for a Hugging Face model (a base model with a layer list), or None
    for any other module. With ``call`` (the step's arguments for one micro-batch), what runs
    before and after the layers comes from watching one forward (eval mode, no gradient, the
    random state put back); the observation rides on the spec as ``observed``."""
    layout = hf_layout(model)
    if layout is None:
        return None
    prefix, layers = layout
    observed: Observation | None = None
    if call is not None:
        kwargs = training_kwargs(model, call.kwargs)
        with evaluating(model):
            observed = observe(model, layers, lambda: model(*call.args, **kwargs))
        pre = observed.before + _direct_parameters(model, layers)
        # parts that did not run stay where registration order puts them; the first step's
        # unused-parameter check names them
        static_pre, _ = _registered_parts(model, prefix, layers)
        pre += [p for p in observed.idle if p in static_pre]
        post = observed.after + [p for p in observed.idle if p not in static_pre]
    else:
        pre, post = _registered_parts(model, prefix, layers)
        pre += _direct_parameters(model, layers)
    blanks = [p for p in pre if _holds_parameters(model, p)]
    shapes = tuple(
        (p, tuple(t.shape), t.dtype)
        for p in blanks
        if isinstance(t := _get(model, p), Tensor) and not isinstance(t, nn.Module)
    )
    head = ReplayHead(
        layers,
        {p: skeleton(m) for p in blanks if isinstance(m := _get(model, p), nn.Module)},
        shapes,
        observed.layer_tuple if observed is not None else 0,
    )
    init = getattr(model, "_init_weights", None)
    return PipeModel(
        model,
        blocks=layers,
        pre=pre,
        post=post,
        head=head,
        init=init if callable(init) else None,
        observed=observed,
    )


def _holds_parameters(model: nn.Module, path: str) -> bool:
    obj = _get(model, path)
    if isinstance(obj, nn.Module):
        return any(True for _ in obj.parameters())
    return isinstance(obj, nn.Parameter)


class _Blank(nn.Module):
    """Stands in, on the last stage, for a part that runs before the layers (the first
    stage's): returns what the part returned on the first stage for this micro-batch, shaped
    alike (``shape``: its :func:`~partition.carry.template` from the carry), as zeros (or, for
    the guard's second replay, random values from ``generator``); zeros like the hidden state
    where the first stage did not say. What the forward reads of the part
    (``embeddings.patch_embeddings.projection.weight.dtype``) it reads from the part's
    meta-device skeleton."""

    def __init__(
        self,
        skeleton_of: nn.Module,
        like: Tensor,
        shape: Any = None,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.__dict__.update(skeleton_of=skeleton_of, like=like, shape=shape, generator=generator)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["skeleton_of"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        like, generator = self.__dict__["like"], self.__dict__["generator"]
        shape = self.__dict__["shape"]
        return fill(template(like) if shape is None else shape, like.device, generator)


class ReplayHead:
    """The end of the model's forward on the last stage: ``model(*args, **kwargs)`` (the step's
    arguments) with its layers ``blocks`` swapped for stand-ins whose last hands over the hidden
    state the last layer produced (``partition.standin``), the modules ``blank`` (run before the
    layers, on the first stage; by path, their meta-device skeletons) for blanks (:class:`_Blank`) and
    the parameters ``blank_parameters`` for zeros. Parts without parameters that run before the
    layers (a rotary table, a dropout) run as they are, on the hidden state's device. So the
    pooler, the classifier on the first token, the masked-LM head and the model's own loss are
    the model's code."""

    def __init__(
        self,
        blocks: str,
        blank: Mapping[str, nn.Module],
        blank_parameters: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
        layer_tuple: int,
    ) -> None:
        self.blocks, self.blank, self.blank_parameters = blocks, dict(blank), list(blank_parameters)
        self.layer_tuple = layer_tuple

    @property
    def blanked(self) -> list[str]:
        """The paths of the parts the replay blanks (the first stage's)."""
        return [*self.blank, *(p for p, _, _ in self.blank_parameters)]

    def __call__(
        self, model: nn.Module, hidden: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        carry = {"hidden": hidden, "blanks": {}, "form": -1}
        return self.replay(model, carry, BodyInput(args, kwargs))

    def replay(
        self,
        model: nn.Module,
        carry: dict[str, Any],
        call: BodyInput,
        generator: torch.Generator | None = None,
        vary: Sequence[str] | None = None,
    ) -> Any:
        """The model's output for the step's ``call`` with the last layer's output from
        ``carry``; with ``generator``, the blanks (those at the paths ``vary``, by default all)
        hold random values instead of zeros."""

        def source(path: str) -> torch.Generator | None:
            return generator if vary is None or path in vary else None

        hidden = carry["hidden"]
        form = carry["form"] if carry["form"] >= 0 else self.layer_tuple
        layers = _get(model, self.blocks)
        run = Run(list(layers), "replay", form=form, hidden=hidden)  # type: ignore[arg-type]
        saved = [(p, _get(model, p)) for p in self.blank]
        saved += [(p, _get(model, p)) for p, _, _ in self.blank_parameters]
        unmade = _stateless_blanks(model, self.blank, hidden.device)
        saved += [(p, _get(model, p)) for p in unmade]
        shapes = carry["blanks"]
        for path, skeleton_of in self.blank.items():
            _set(model, path, _Blank(skeleton_of, hidden, shapes.get(path), source(path)))
        for path in unmade:
            blank = _Blank(_get(model, path), hidden, shapes.get(path), source(path))  # type: ignore[arg-type]
            _set(model, path, blank)
        for path, size, dtype in self.blank_parameters:
            value = fill(Zeros(size, dtype), hidden.device, source(path))
            _set(model, path, nn.Parameter(value, requires_grad=False))
        try:
            with swapped(model, self.blocks, run):
                return model(*call.args, **training_kwargs(model, call.kwargs))
        except SplitError:
            raise
        except Exception as err:
            if not run.reached:  # the forward failed before the layers, on the blanks
                raise SplitError(
                    f"{type(model).__name__}.forward raised {type(err).__name__} ({err}) before "
                    "its layers on the last stage, where pipe2bw runs it with blanks for the "
                    f"parts the first stage holds ({sorted(self.blank)}) to compute what comes "
                    "after the layers: the forward computes with those parts' outputs in a way "
                    "the blanks do not reproduce. Describe the model with PipeModel(model, ..., "
                    "head=...) (docs/models.md) or train it on one device"
                ) from err
            if hasattr(err, "add_note"):
                err.add_note(
                    f"(raised on the last pipeline stage, in the end of {type(model).__name__}"
                    ".forward, after its last layer)"
                )
            raise
        finally:
            for path, obj in saved:
                _set(model, path, obj)  # type: ignore[arg-type]


def _stateless_blanks(
    model: nn.Module, blank: Mapping[str, nn.Module], device: torch.device
) -> list[str]:
    """Modules without parameters left in the model object (the first stage's rotary table)
    follow the hidden state's device: the last stage's model object is not moved as a whole.
    Those whose buffers were never materialised (a model built on the meta device: the first
    stage holds the real ones) are blanked too; their paths are returned."""
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
