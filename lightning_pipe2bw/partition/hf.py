"""Hugging Face transformers models as they come: their layer lists, what runs before, between
and after them, and the model's own code for the end of the forward.

:func:`pipe_model_for` describes any model with a base model (``base_model_prefix``) that keeps
its layers in an ``nn.ModuleList`` and calls them in a loop (causal and masked language models,
sequence and token classifiers, image classifiers, ...), and encoder-decoders
(``config.is_encoder_decoder``: BART, T5, Whisper, ...) as two such lists, the encoder's and the
decoder's, run one after the other. Which parts run before the layers (first stage), between
the lists (where the decoder's layers start) and after them (last stage) comes from one observed
forward on the step's first micro-batch (``partition.observe``); without one (a model built on
the meta device), from the order the base model registers its children, and the guard
(``partition.guard``) and the first step's unused-parameter check catch what that order gets
wrong.

The last stage runs the end of the forward with a :class:`~partition.replay.ReplayHead`: the
model's own ``forward`` on the step's arguments, with the layers swapped for stand-ins that hand
over the hidden state the last layer produced, and the parts before the layers (held by other
stages) for blanks. So the pooler, the classifier on the first token, the masked-LM head and the
model's own loss (with its ``problem_type``) are the model's code, not ours.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe2bw.partition.observe import Observation, evaluating, observe
from lightning_pipe2bw.partition.pipemodel import PipeModel
from lightning_pipe2bw.partition.replay import ReplayHead
from lightning_pipe2bw.partition.standin import training_kwargs
from lightning_pipe2bw.runtime.call import BodyInput

__all__ = ["hf_layout", "known_models", "pipe_model_for", "refuse_layer_skipping"]

# what transformers' losses leave out of their mean (``ignore_index``)
IGNORED = -100


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


def _stacks_in(model: nn.Module, prefix: str, base: nn.Module) -> list[str] | None:
    """The paths (in ``model``) of its layer lists: an encoder-decoder's encoder's and
    decoder's, else the base model's."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        found = []
        for side in ("encoder", "decoder"):
            part = getattr(base, side, None)
            inner = _layers_in(part) if isinstance(part, nn.Module) else None
            if inner is not None:
                found.append(_join(prefix, f"{side}.{inner}"))
        if len(found) == 2:
            return found
    layers = _layers_in(base)
    return None if layers is None else [_join(prefix, layers)]


def hf_layout(model: nn.Module) -> tuple[str, list[str]] | None:
    """(base prefix, the paths of the layer lists in the model) of a Hugging Face model the
    split can take, or None: the static shape only, nothing runs."""
    found = _base(model)
    if found is None:
        return None
    prefix, base = found
    stacks = _stacks_in(model, prefix, base)
    return None if stacks is None else (prefix, stacks)


def _configs(config: object, path: str = "config") -> list[tuple[str, object]]:
    """A model's config and the configs inside it (an encoder's, a text model's), by path."""
    found = [(path, config)]
    for key, value in vars(config).items():
        if hasattr(value, "model_type") and hasattr(value, "to_dict"):  # a config, duck-typed
            found += _configs(value, f"{path}.{key}")
    return found


def known_models(module: nn.Module) -> list[str]:
    """The outermost submodules of a family ``pipe_model_for`` knows (Hugging Face models)."""
    found: list[str] = []
    for path, sub in module.named_modules():
        if path and not any(path.startswith(q + ".") for q in found):
            if any(True for _ in sub.parameters()) and hf_layout(sub) is not None:
                found.append(path)
    return found


def layer_skipping(module: nn.Module) -> list[str]:
    """``"<path>.config.<setting>=<value>"`` for each setting that makes a Hugging Face model
    under ``module`` skip layers at random while training (LayerDrop: ``layerdrop``,
    ``encoder_layerdrop``, ``decoder_layerdrop``, ...): each stage would draw its own skips for
    its own layers, and the forward it replays would not be the one the stages ran."""
    found: list[str] = []
    for where in known_models(module):
        for path, cfg in _configs(module.get_submodule(where).config):
            for key, value in sorted(vars(cfg).items()):
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if "layerdrop" in key and number and value > 0:
                    found.append(f"{where}.{path}.{key}={value}")
    return found


def refuse_layer_skipping(module: nn.Module) -> None:
    """Stop a fit of a model that skips layers at random (:func:`layer_skipping`), naming the
    setting and its fix (collective in effect: every rank finds the same and raises)."""
    skipping = layer_skipping(module)
    if skipping:
        setting = skipping[0].rsplit("=", 1)[0]
        raise ValueError(
            f"pipe2bw: the model skips layers at random while training ({', '.join(skipping)}: "
            "LayerDrop); each stage would draw the skips of its own layers, and the stages "
            f"would not run one model. Set it to 0.0 before trainer.fit ({setting} = 0.0, or "
            "the config's argument) to train the model in a pipeline"
        )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _registered_parts(
    model: nn.Module, prefix: str, stacks: list[str]
) -> tuple[list[str], list[list[str]], list[str]]:
    """(pre, between, post) by registration order, for a model no forward was watched on: the
    base model's children registered before the first list's holder are ``pre``, those after
    the last ``post`` (those without parameters ``pre``: they are on every stage); the siblings
    of a list inside a holder (``encoder.layer``) go with the list's start (``pre`` for the
    first list, ``between`` for a later one), except, for several lists, those registered after
    a list, which go with its end; the model's own children besides the base (the head) are
    ``post``."""
    base = model.get_submodule(prefix) if prefix else model
    inner = [s[len(prefix) + 1 :] if prefix else s for s in stacks]
    tops = [i.split(".")[0] for i in inner]
    phases: list[list[str]] = [[] for _ in range(len(stacks) + 1)]  # before list k, after all
    phase = 0
    for name, child in base.named_children():
        if child is None:
            continue
        if name in tops:
            k = tops.index(name)
            phase = k
            if "." in inner[k]:  # the list sits in a holder (encoder.layer): its siblings
                after = False
                for sub, _ in child.named_children():
                    if f"{name}.{sub}" == inner[k]:
                        after = len(stacks) > 1
                        continue
                    phases[k + 1 if after else k].append(_join(prefix, f"{name}.{sub}"))
            phase = k + 1
            continue
        holds = any(True for _ in child.parameters())
        phases[phase if holds else 0].append(_join(prefix, name))
    if prefix:
        for name, child in model.named_children():
            if name != prefix and child is not None:
                phases[-1].append(name)
    return phases[0], phases[1:-1], phases[-1]


def _direct_parameters(model: nn.Module, layers: str) -> list[str]:
    """The parameters held directly by the modules the layer list sits in (the model, its base,
    an encoder): they go where the list starts, as the forward uses them before the layers."""
    heads = layers.split(".")
    found = []
    for k in range(len(heads)):
        path = ".".join(heads[:k])
        holder = model.get_submodule(path) if path else model
        found += [_join(path, name) for name, _ in holder.named_parameters(recurse=False)]
    return found


def pipe_model_for(model: nn.Module, call: BodyInput | None = None) -> PipeModel | None:
    """A :class:`PipeModel` for a Hugging Face model (a base model with a layer list, or an
    encoder-decoder with two), or None for any other module. With ``call`` (the step's arguments
    for one micro-batch), what runs before, between and after the layers comes from watching
    one forward (eval mode, no gradient, the random state put back); the observation rides on
    the spec as ``observed``."""
    layout = hf_layout(model)
    if layout is None:
        return None
    prefix, stacks = layout
    static_pre, static_between, static_post = _registered_parts(model, prefix, stacks)
    observed: Observation | None = None
    if call is not None:
        kwargs = training_kwargs(model, call.kwargs)
        with evaluating(model, grad=True):  # which parameters the output depends on, too
            observed = observe(model, stacks, lambda: model(*call.args, **kwargs))
        pre, between, post = observed.before, observed.between, observed.after
        # parts that did not run stay where registration order puts them; the guard and the
        # first step's unused-parameter check name them
        for path in observed.idle:
            if path in static_pre:
                pre.append(path)
            elif any(path in b for b in static_between):
                next(b for b, s in zip(between, static_between, strict=True) if path in s).append(
                    path
                )
            else:
                post.append(path)
    else:
        pre, between, post = static_pre, static_between, static_post
    listed = set(pre)
    for k, stack in enumerate(stacks):  # the lists' holders' own parameters, where each starts
        direct = [p for p in _direct_parameters(model, stack) if p not in listed]
        (pre if k == 0 else between[k - 1]).extend(direct)
        listed.update(direct)
    init = getattr(model, "_init_weights", None)
    count = item_count(model)
    output = observed.output if observed is not None else None  # the forward just watched
    if count is not None and call is not None and not _divides_by(model, call, count, output):
        count = None
    return PipeModel(
        model,
        blocks=stacks[0] if len(stacks) == 1 else stacks,
        pre=pre,
        post=post,
        head=ReplayHead(),
        init=init if callable(init) else None,
        between=between,
        observed=observed,
        count_items=count,
    )


# ---------------------------------------------------------------------- the loss's item count
def item_count(model: nn.Module) -> functools.partial[Tensor | None] | None:
    """How ``model``'s own loss counts the items of a call (a :class:`BodyInput`): the labels
    that are not -100, as transformers' Trainer counts them for ``num_items_in_batch`` (the
    labels after the shift a causal language model's loss makes, ``shift_labels`` where the
    call gives them), or None for a model whose forward takes no loss keywords (transformers'
    ``accepts_loss_kwargs``, else a ``**kwargs`` in its signature). The function gives None for
    a call without integer labels, or one that passes ``num_items_in_batch`` itself."""
    forward = inspect.signature(model.forward).parameters
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is None:
        accepts = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in forward.values())
    if not accepts:
        return None
    positional = [
        name for name, p in forward.items()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]  # fmt: skip
    at = positional.index("labels") if "labels" in positional else None
    return functools.partial(_count_labels, shifted=_loss_shifts_labels(model), labels_at=at)


def _loss_shifts_labels(model: nn.Module) -> bool:
    """A causal language model's loss (transformers' ``ForCausalLMLoss``, not in an
    encoder-decoder): position 0 of each row is never a target."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:  # transformers without its loss table: by the class's name
        return type(model).__name__.endswith("ForCausalLM")
    loss = LOSS_MAPPING.get(getattr(model, "loss_type", None) or "")
    encoder_decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    return loss is ForCausalLMLoss and not encoder_decoder


def _count_labels(call: BodyInput, *, shifted: bool, labels_at: int | None) -> Tensor | None:
    kwargs = call.kwargs
    if "num_items_in_batch" in kwargs:
        return None
    labels = kwargs.get("shift_labels")
    if labels is None:
        labels = kwargs.get("labels")
        if labels is None and labels_at is not None and labels_at < len(call.args):
            labels = call.args[labels_at]
        if isinstance(labels, Tensor) and shifted:
            labels = labels[..., 1:]
    if not isinstance(labels, Tensor) or labels.is_floating_point() or labels.is_complex():
        return None
    if labels.dtype == torch.bool:
        return None
    return labels.ne(IGNORED).sum()


def _divides_by(
    model: nn.Module,
    call: BodyInput,
    count: functools.partial[Tensor | None],
    output: Any = None,
) -> bool:
    """Whether ``model``'s loss on ``call`` (the first micro-batch) is its summed loss over
    ``num_items_in_batch``, with the count :func:`item_count` gives (eval mode, no gradient,
    the random state put back): the loss with twice the count is half the loss without
    (``output``: the model's output on ``call`` in eval mode where the intake has it already).
    A model whose loss ignores the keyword (its own ``CrossEntropyLoss``) or counts otherwise
    keeps each micro-batch's own mean; a warning says so where its labels ignore some items."""
    n = count(call)
    if n is None or int(n) == 0:
        return True  # nothing to check on: the rule is transformers' own
    kwargs = training_kwargs(model, call.kwargs)
    with evaluating(model):
        if output is None:
            output = model(*call.args, **kwargs)
        plain = getattr(output, "loss", None)
        try:  # a forward whose **kwargs reach a module that takes no such keyword
            scaled = model(*call.args, **kwargs, num_items_in_batch=2 * n)
        except TypeError:
            return False
        halved = getattr(scaled, "loss", None)
    if not isinstance(plain, Tensor) or not isinstance(halved, Tensor):
        return False
    if torch.allclose(2 * halved.double(), plain.double(), rtol=1e-5, atol=1e-7):
        return True
    labels = call.kwargs.get("labels")
    if isinstance(labels, Tensor) and bool(labels.eq(IGNORED).any()):
        warnings.warn(
            f"pipe2bw: {type(model).__name__}'s loss does not divide by `num_items_in_batch` "
            "(its loss with twice the count is not half its loss), so each micro-batch's loss "
            "stays the mean over its own labels, and the batch's is the micro-batches' means "
            "weighted by size, which differs from one device's whole-batch mean where "
            "micro-batches hold different numbers of -100 labels",
            stacklevel=2,
        )
    return False
