"""Blocks that act in place on their input: received activations they may modify, and the
inputs of recomputed regions kept as the first forward saw them."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["Alias", "copy_tensors", "tensor_versions", "writable"]


class Alias(torch.autograd.Function):
    """The same tensor (same storage, same version counter), as a non-leaf whose gradient is
    passed to its input unchanged. Autograd refuses in-place operations on a leaf that requires
    grad, and on a view of one (``x.view_as(x)``); the output of a function that is not a view
    is an ordinary intermediate result, which may be modified in place. Sharing the version
    counter keeps autograd's check that nothing saved for the backward was modified."""

    @staticmethod
    def forward(ctx: Any, t: Tensor) -> Tensor:
        return t.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def writable(payload: Any) -> Any:
    """``payload`` with each leaf tensor that requires grad (a received activation, which the
    transport makes a leaf) replaced by an alias that blocks may modify in place
    (``nn.ReLU(inplace=True)``, ``x += residual``), without copying: its gradient accumulates
    into the leaf's ``.grad`` as before. Other values are returned as they are."""

    def alias(x: Any) -> Any:
        if isinstance(x, Tensor) and x.requires_grad and x.is_leaf:
            return Alias.apply(x)
        return x

    return pytree.tree_map(alias, payload)


def copy_tensors(payload: Any) -> Any:
    """``payload`` with every tensor cloned (differentiably): a copy a block may modify in
    place while the original stays as it was."""
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, payload)


def tensor_versions(payload: Any) -> tuple[int, ...]:
    """The version counters of ``payload``'s tensors: they change when one is modified in place
    (directly or through a view)."""
    return tuple(x._version for x in pytree.tree_leaves(payload) if isinstance(x, Tensor))
