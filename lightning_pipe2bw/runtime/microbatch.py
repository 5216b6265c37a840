"""Splitting a batch into micro-batches and merging per-micro-batch outputs back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["batch_size_of", "merge_outputs", "per_sample", "split_batch"]


def batch_size_of(batch: Any) -> int:
    """The size of dimension 0 shared by every tensor leaf of ``batch`` (with ndim >= 1)."""
    leaves = [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor) and x.ndim >= 1]
    if not leaves:
        raise TypeError(
            "pipe2bw splits each batch into micro-batches along dimension 0, but the batch holds no "
            f"tensor with a batch dimension (got {type(batch).__name__})"
        )
    sizes = {int(x.shape[0]) for x in leaves}
    if len(sizes) != 1:
        raise ValueError(
            "every tensor in a batch must share the size of dimension 0 so that it can be split into "
            f"micro-batches; found sizes {sorted(sizes)}. Move per-batch constants out of the batch."
        )
    return sizes.pop()


def per_sample(value: Any, size: int) -> bool:
    """Whether ``value`` is a per-sample field of a batch of ``size`` samples that holds no
    tensor: a list or tuple of ``size`` Python values (what ``default_collate`` makes of a
    string per sample: file names, ids, captions). Such a list is split with the tensors."""
    return (
        isinstance(value, (list, tuple))
        and not _is_namedtuple(value)
        and len(value) == size
        and not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(list(value)))
    )


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def split_batch(batch: Any, num_microbatches: int) -> tuple[list[Any], list[int]]:
    """Split ``batch`` into ``num_microbatches`` parts along dim 0 (``torch.tensor_split`` sizes).

    Sizes differ by at most one when the batch size is not divisible. Lists and tuples of Python
    values with one item per sample (:func:`per_sample`: a file name per sample) are split
    the same way; other non-tensor leaves and 0-dim tensors are shared by every micro-batch.
    Returns the micro-batches and their sizes.
    """
    n = batch_size_of(batch)
    if n < num_microbatches:
        raise ValueError(
            f"a batch of {n} samples cannot be split into microbatches={num_microbatches}; use a batch "
            f"size of at least {num_microbatches} or fewer micro-batches"
        )
    leaves, spec = pytree.tree_flatten(batch, is_leaf=lambda x: per_sample(x, n))
    bounds = [_slice(n, num_microbatches, i) for i in range(num_microbatches)]
    parts: list[list[Any]] = [[] for _ in range(num_microbatches)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.ndim >= 1:
            for i, chunk in enumerate(torch.tensor_split(leaf, num_microbatches, dim=0)):
                parts[i].append(chunk)
        elif per_sample(leaf, n):
            for part, bound in zip(parts, bounds, strict=True):
                part.append(leaf[bound])
        else:
            for part in parts:
                part.append(leaf)
    sizes = [b.stop - b.start for b in bounds]
    return [pytree.tree_unflatten(p, spec) for p in parts], sizes


def _slice(n: int, m: int, i: int) -> slice:
    # torch.tensor_split gives the first n % m parts one extra element
    q, r = divmod(n, m)
    start = i * q + min(i, r)
    return slice(start, start + q + (1 if i < r else 0))


def merge_outputs(outputs: Sequence[Any], sizes: Sequence[int]) -> Any:
    """Merge the step outputs of the micro-batches of one batch into the batch's output, as one
    device computes it on the whole batch.

    Tensors whose dim 0 equals the micro-batch size are concatenated, and so are lists and tuples
    of Python values with one item per sample (:func:`per_sample`); integer scalars (Python ints,
    integer 0-dim tensors: counts such as the number of correct predictions) are summed; floating
    scalars (0-dim tensors, Python floats) are averaged weighted by micro-batch size, which gives
    the full batch's value for per-sample means such as a loss; anything else is returned as a
    list, one per micro-batch.
    """
    if not outputs:
        return None
    if len(outputs) == 1:
        return outputs[0]
    flat = [_flatten(o, k) for o, k in zip(outputs, sizes, strict=True)]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        return list(outputs)
    total = float(sum(sizes))
    merged: list[Any] = []
    for column in zip(*(leaves for leaves, _ in flat), strict=True):
        first = column[0]
        if (
            isinstance(first, torch.Tensor)
            and first.ndim >= 1
            and all(
                isinstance(c, torch.Tensor) and c.ndim >= 1 and c.shape[0] == k
                for c, k in zip(column, sizes, strict=True)
            )
        ):
            merged.append(torch.cat(list(column), dim=0))
        elif all(per_sample(c, k) for c, k in zip(column, sizes, strict=True)):
            items = [item for c in column for item in c]
            merged.append(items if isinstance(first, list) else tuple(items))
        elif isinstance(first, torch.Tensor) and first.ndim == 0:
            if _is_count(first):
                merged.append(sum(column[1:], column[0]))
            else:
                merged.append(sum(c * (k / total) for c, k in zip(column, sizes, strict=True)))
        elif isinstance(first, int) and not isinstance(first, bool):
            merged.append(sum(column))
        elif isinstance(first, float):
            merged.append(sum(float(c) * (k / total) for c, k in zip(column, sizes, strict=True)))
        else:
            merged.append(list(column))
    return pytree.tree_unflatten(merged, spec)


def _flatten(output: Any, size: int) -> tuple[list[Any], Any]:
    """``output``'s leaves (a per-sample list of ``size`` Python values is one) and structure."""

    def leaf(x: Any) -> bool:
        return per_sample(x, size)

    return pytree.tree_flatten(output, is_leaf=leaf)


def _is_count(value: torch.Tensor) -> bool:
    return (
        not value.dtype.is_floating_point
        and not value.dtype.is_complex
        and value.dtype != torch.bool
    )
