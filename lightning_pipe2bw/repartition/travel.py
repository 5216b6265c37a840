"""A block as it travels between processes, pickled: itself, or, where it holds parametrized
tensors (weight norm in Wav2Vec2's, Hubert's, WavLM's and SEW's positional convolution), a
copy without its parametrizations and each one's modules and original tensors beside it, since
torch pickles a parametrized module's ``state_dict`` only. The receiver registers them again
and puts the originals back: the same module, weights bit for bit. torch's weight norm is
applied again with its own function, which also brings back the hook it adds for loading the
older ``weight_g``/``weight_v`` state dicts (a local function, which no pickle carries)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lightning_pipe2bw.partition.recorded import forget_capture_hooks

__all__ = ["packed", "unpacked"]


@dataclass
class _Parametrization:
    path: str  # of the submodule, in the block
    tensor: str  # the parametrized tensor's name ("weight")
    steps: list[nn.Module]  # the parametrizations, in the order they apply
    originals: dict[str, Tensor]  # "original" (or "original0", "original1", ...) -> its value
    unsafe: bool


@dataclass
class _Packed:
    module: nn.Module  # without its parametrizations
    parametrizations: list[_Parametrization]


def packed(block: nn.Module) -> Any:
    """``block`` ready to pickle (itself where nothing in it is parametrized; the block in this
    process is left as it is, but for transformers' output-capturing hooks, which no pickle
    carries and the model installs again when it needs them: ``partition.recorded``)."""
    forget_capture_hooks(block)
    if not any(parametrize.is_parametrized(m) for m in block.modules()):
        return block
    module = copy.deepcopy(block)
    found = []
    for path, sub in list(module.named_modules()):
        if not parametrize.is_parametrized(sub):
            continue
        chains = sub.parametrizations  # type: ignore[union-attr]
        plain: dict[str, nn.Parameter] = {}
        for name in list(chains):
            chain = chains[name]
            originals = {k: v.detach().clone() for k, v in chain.named_parameters(recurse=False)}
            found.append(_Parametrization(path, name, list(chain), originals, bool(chain.unsafe)))
            # the value it computes, from the block here (the copy shares torch's class for it)
            value = getattr(block.get_submodule(path), name).detach().clone()
            trained = any(v.requires_grad for v in chain.parameters(recurse=False))
            plain[name] = nn.Parameter(value, requires_grad=trained)
        # torch's remove_parametrizations would change the class the copy shares with the block:
        # the copy takes back the class torch derived its own from, and plain tensors instead
        sub.__class__ = type(sub).__bases__[0]
        del sub._modules["parametrizations"]
        for name, value in plain.items():
            sub.register_parameter(name, value)
        hooks = sub._load_state_dict_pre_hooks
        for key in [k for k, h in hooks.items() if _is_weight_norm_hook(h)]:
            del hooks[key]  # weight_norm() adds it again on arrival
    return _Packed(module, found)


def _is_weight_norm_hook(hook: Any) -> bool:
    name = getattr(getattr(hook, "hook", hook), "__qualname__", "")
    return str(name).startswith("weight_norm.<locals>.")


def _is_weight_norm(steps: list[nn.Module]) -> bool:
    return len(steps) == 1 and type(steps[0]).__name__ == "_WeightNorm" and hasattr(steps[0], "dim")


def unpacked(travelled: Any) -> nn.Module:
    """The block :func:`packed` made ready, as it was."""
    if not isinstance(travelled, _Packed):
        return travelled  # type: ignore[no-any-return]
    module = travelled.module
    for p in travelled.parametrizations:
        sub = module.get_submodule(p.path)
        if _is_weight_norm(p.steps):
            dim = int(p.steps[0].dim)  # type: ignore[arg-type]
            nn.utils.parametrizations.weight_norm(sub, p.tensor, dim=dim)
        else:
            for step in p.steps:
                parametrize.register_parametrization(sub, p.tensor, step, unsafe=p.unsafe)
        chain = sub.parametrizations[p.tensor]  # type: ignore[index]
        with torch.no_grad():
            for name, value in p.originals.items():
                getattr(chain, name).copy_(value)
    return module
