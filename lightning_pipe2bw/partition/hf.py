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

import copy
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe2bw.partition.observe import Observation, evaluating, observe
from lightning_pipe2bw.partition.pipemodel import PipeModel, _get, _set
from lightning_pipe2bw.runtime.stage import BodyInput

__all__ = ["hf_layout", "pipe_model_for", "replay_head", "training_kwargs"]


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
    head = functools.partial(
        replay_head,
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


def training_kwargs(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(kwargs)
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        kwargs.setdefault("use_cache", False)  # no key/value cache in training
    return kwargs


def skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module`` on the meta device (its structure, its parameters' shapes and
    dtypes, no memory), made without copying its data."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


class _Blank(nn.Module):
    """Stands in, on the last stage, for a part that runs before the layers (the first
    stage's): returns zeros shaped like the hidden state, which only the layers' stand-ins see.
    What the forward reads of the part (``embeddings.patch_embeddings.projection.weight.dtype``)
    it reads from the part's meta-device skeleton."""

    def __init__(self, shape: nn.Module, like: Tensor) -> None:
        super().__init__()
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "like", like)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "shape"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        return torch.zeros_like(self.like)


class _Pass(nn.Module):
    """Stands in for a layer of another stage: hands its hidden state on unchanged (``hidden``
    set: hands over that one, the last layer's real output)."""

    def __init__(self, as_tuple: int, hidden: Tensor | None = None) -> None:
        super().__init__()
        self.as_tuple, self.hidden = as_tuple, hidden

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.hidden
        if out is None:
            out = args[0] if args else kwargs.get("hidden_states")
        if self.as_tuple:
            return (out,) + (None,) * (self.as_tuple - 1)
        return out


def replay_head(
    blocks: str,
    blank: Mapping[str, nn.Module],
    blank_parameters: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
    layer_tuple: int,
    model: nn.Module,
    hidden: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The end of the model's forward on the last stage: ``model(*args, **kwargs)`` with its
    layers ``blocks`` swapped for stand-ins whose last hands over ``hidden`` (the last layer's
    output), the modules ``blank`` (run before the layers, on the first stage; by path, their
    meta-device skeletons) for blanks and
    the parameters ``blank_parameters`` for zeros. Parts without parameters that run before the
    layers (a rotary table, a dropout) run as they are, on ``hidden``'s device."""
    layers = _get(model, blocks)
    n = len(layers)  # type: ignore[arg-type]
    stand_ins = [_Pass(layer_tuple) for _ in range(n - 1)] + [_Pass(layer_tuple, hidden)]
    swapped: nn.Module = (
        nn.Sequential(*stand_ins) if isinstance(layers, nn.Sequential) else nn.ModuleList(stand_ins)
    )
    saved = [(blocks, layers)] + [(p, _get(model, p)) for p in blank]
    saved += [(p, _get(model, p)) for p, _, _ in blank_parameters]
    _set(model, blocks, swapped)
    unmade = _stateless_blanks(model, blank, hidden.device)
    saved += [(p, _get(model, p)) for p in unmade]
    for path, skeleton_of in blank.items():
        _set(model, path, _Blank(skeleton_of, hidden))
    for path in unmade:
        _set(model, path, _Blank(_get(model, path), hidden))  # type: ignore[arg-type]
    for path, size, dtype in blank_parameters:
        _set(model, path, nn.Parameter(hidden.new_zeros(size, dtype=dtype), requires_grad=False))
    try:
        return model(*args, **training_kwargs(model, kwargs))
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
