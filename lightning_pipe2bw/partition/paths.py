"""Reading and replacing a model's parts by their dotted paths (``model.layers.3``,
``cls_token``): modules and parameters alike."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["get_path", "set_path", "skeleton"]


def get_path(root: nn.Module, path: str) -> nn.Module | Tensor:
    """The module or parameter at ``path`` in ``root``."""
    obj: Any = root
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj  # type: ignore[no-any-return]


def set_path(root: nn.Module, path: str, value: nn.Module | Tensor) -> None:
    """Put ``value`` at ``path`` in ``root``: a parameter slot takes a tensor, a module slot a
    module, without the checks ``setattr`` makes (a stand-in may take a parameter's place)."""
    parent_path, _, name = path.rpartition(".")
    parent: Any = root.get_submodule(parent_path) if parent_path else root
    if isinstance(value, nn.Parameter) or name in parent._parameters:
        parent._parameters[name] = value
    else:
        parent._modules[name] = value


def skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module`` on the meta device (its structure, its attributes, its parameters'
    shapes and dtypes, no memory), made without copying its data."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)
