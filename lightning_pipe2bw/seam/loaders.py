"""Every stage of a pipeline must read the same batches: the strategy's hold on the dataloaders.

* Random samplers draw alike on every stage: a ``RandomSampler`` becomes a one-replica
  ``DistributedSampler`` seeded with the run's seed, and a sampler that draws from the global RNG
  because it was given no ``generator`` (``WeightedRandomSampler``, ``SubsetRandomSampler``, any
  sampler following torch's convention) gets a copy with a generator seeded with the run's seed.
  The stages' global RNGs diverge (dropout runs on some stages only), so unseeded draws differ.
* What cannot be seeded is caught: :func:`batch_fingerprint` reads a few values of every sample
  of a batch, the last stage sends its fingerprint with the step's values, and the other stages
  compare (:class:`FingerprintCheck`), raising an error that names the dataloader and the fix.
* A training loader whose last batch is smaller than the micro-batches is refused up front, from
  its length and batch size (:func:`last_batch_problem`), not when the epoch reaches that batch.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections import deque
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from lightning_pipe2bw import compat
from lightning_pipe2bw.runtime.microbatch import batch_size_of, per_sample

__all__ = [
    "FingerprintCheck",
    "batch_fingerprint",
    "describe_loader",
    "last_batch_problem",
    "seed_sampler",
]

# values read per sample and tensor: the first ones and as many spread over the rest
_HEAD, _SPREAD = 16, 16


def seed_sampler(dataloader: object, seed: int) -> object:
    """``dataloader`` with its random sampler drawing the same on every rank (see the module
    notes); any other dataloader as it is."""
    if not isinstance(dataloader, DataLoader):
        return dataloader
    sampler = dataloader.sampler
    if isinstance(sampler, RandomSampler) and sampler.generator is None:
        replaced: Any = DistributedSampler(
            dataloader.dataset, num_replicas=1, rank=0, shuffle=True, seed=seed
        )
        return compat.update_dataloader(dataloader, replaced)
    if getattr(sampler, "generator", False) is None:  # draws from the global RNG
        seeded = copy.copy(sampler)
        seeded.generator = torch.Generator().manual_seed(seed)  # type: ignore[attr-defined]
        return compat.update_dataloader(dataloader, seeded)
    return dataloader


def last_batch_problem(
    dataloader: object, microbatches: int, limit_batches: int | float, max_steps: int
) -> str | None:
    """Why the training ``dataloader`` cannot be split into ``microbatches`` parts in every batch
    it will give (its batch size, or its last batch, is smaller), told from its length and batch
    size before any batch runs; None when it can, or when its length or batch size is unknown or
    the last batch is never reached (``limit_train_batches``, ``max_steps``)."""
    if not isinstance(dataloader, DataLoader) or dataloader.batch_size is None:
        return None
    size = dataloader.batch_size
    try:
        samples = len(dataloader.sampler)  # type: ignore[arg-type]
    except TypeError:  # an iterable dataset of unknown length
        return None
    name = describe_loader(dataloader)
    if size < microbatches:
        return (
            f"the training dataloader ({name}) has batch_size={size}, fewer samples than "
            f"microbatches={microbatches}: every batch is split into micro-batches along "
            f"dimension 0. Use a batch size of at least {microbatches} or fewer micro-batches"
        )
    last = samples % size
    if dataloader.drop_last or last == 0 or last >= microbatches:
        return None
    batches = math.ceil(samples / size)
    used = batches
    if isinstance(limit_batches, int):
        used = min(limit_batches, batches)
    elif limit_batches < 1.0:
        used = int(batches * limit_batches)
    if used < batches or 0 < max_steps < batches:
        return None  # the last batch is never reached
    return (
        f"the training dataloader ({name}) ends with a batch of {last} samples ({samples} samples "
        f"in batches of {size}), fewer than microbatches={microbatches}, so that batch cannot be "
        f"split into micro-batches. Pass drop_last=True to the DataLoader, or choose a batch size "
        f"or dataset size that leaves at least {microbatches} samples in the last batch, or use "
        f"fewer micro-batches"
    )


def describe_loader(dataloader: object) -> str:
    """``dataloader`` in a few words, for errors: its type, its dataset's and its sampler's."""
    if not isinstance(dataloader, DataLoader):
        return type(dataloader).__name__
    sampler = type(dataloader.sampler).__name__
    return f"a DataLoader over {type(dataloader.dataset).__name__} with {sampler}"


def batch_fingerprint(batch: Any) -> str | None:
    """A short digest of ``batch`` that tells different samples apart: for every tensor on the
    CPU with a batch dimension, its first values and values spread over the rest of each sample
    (a few dozen per sample, whatever its size), and the per-sample Python values (names). None
    when there is nothing to read without waiting for a device (tensors on a GPU)."""
    try:
        n = batch_size_of(batch)
    except (TypeError, ValueError):
        return None
    digest = hashlib.blake2b(digest_size=8)
    read = False
    for leaf in pytree.tree_leaves(batch, is_leaf=lambda x: per_sample(x, n)):
        if isinstance(leaf, Tensor) and leaf.ndim >= 1:
            if leaf.device.type != "cpu":
                continue
            rows = leaf.detach().reshape(n, -1)
            width = rows.shape[1]
            if width > _HEAD + _SPREAD:
                spread = torch.linspace(_HEAD, width - 1, _SPREAD).long()
                rows = torch.cat([rows[:, :_HEAD], rows[:, spread]], dim=1)
            digest.update(rows.contiguous().view(torch.uint8).numpy().tobytes())  # any dtype
            read = True
        elif per_sample(leaf, n):
            digest.update(repr(leaf).encode())
            read = True
    return digest.hexdigest() if read else None


class FingerprintCheck:
    """The fingerprints of the batches this rank has run and not yet compared, oldest first,
    against the last stage's as its step values arrive (in the same step, or one step later
    with ``2bw``)."""

    def __init__(self) -> None:
        self._own: deque[str | None] = deque()

    def ran(self, fingerprint: str | None) -> None:
        self._own.append(fingerprint)

    def clear(self) -> None:
        self._own.clear()

    def compare(self, theirs: str | None, stage: int, dataloader: str) -> None:
        """Compare the oldest batch this rank ran with the last stage's fingerprint of it."""
        mine = self._own.popleft() if self._own else None
        if mine is None or theirs is None or mine == theirs:
            return
        raise ValueError(
            f"the ranks read different samples: stage {stage} and the last stage ran different "
            f"batches of the {dataloader} (batch fingerprints {mine} and {theirs}), so each stage "
            "trains on other samples. The dataloader's sampler draws differently on each rank: "
            "give it a generator seeded the same on every rank (torch samplers take "
            "generator=torch.Generator().manual_seed(seed); pipe2bw seeds a sampler whose "
            "generator attribute is None), or make its order not depend on the global RNG"
        )
