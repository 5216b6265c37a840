"""Losses normalised by the whole batch's items (tokens whose label is not ignored), not by
each micro-batch's.

A language model's loss is the mean over the batch's valid label tokens. Split into
micro-batches that hold different numbers of them, the mean of the micro-batch means weighted
by their sizes (Lightning's gradient accumulation) is another number: one device on the whole
batch divides every token's loss by the same count. So while a pipelined step runs, every
micro-batch ``i`` is told the count that makes its weighted loss the batch's: the whole batch's
count ``N`` times the micro-batch's share ``w_i`` of the batch (its size over the batch's), since
the pipeline weights micro-batch ``i``'s loss by ``w_i``. ``sum_i / (N w_i)`` weighted by ``w_i``
and summed over ``i`` is the batch's ``sum / N``; the loss Lightning logs, its gradient and the
clipping are one device's.

Two ways in:

- a Hugging Face model whose loss divides by transformers' ``num_items_in_batch`` gets it in its
  call on the last stage (the strategy counts the whole batch's labels as the model counts
  them: ``partition.hf``), with no line of the user's;
- the user's own loss divides a sum by :func:`items_in_batch` of the step's batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lightning_pipe2bw.runtime.call import BodyInput

__all__ = ["amended_call", "batch_items", "items_in_batch"]


@dataclass(frozen=True)
class BatchItems:
    """The batch a pipelined step runs now: the batch as the step was given it, each
    micro-batch's share of it by the micro-batch's identity (the object the step receives),
    and the keyword arguments the model's call on the last stage takes with the whole batch's
    counts (``{"num_items_in_batch": N}``), each scaled by the micro-batch's share."""

    whole: Any
    shares: Mapping[int, float]
    counts: Mapping[str, Tensor] = field(default_factory=dict)

    def share_of(self, microbatch: Any) -> float | None:
        return self.shares.get(id(microbatch))


_RUNNING: ContextVar[BatchItems | None] = ContextVar("pipe2bw_batch_items", default=None)


@contextmanager
def batch_items(
    whole: Any,
    microbatches: Sequence[Any],
    shares: Sequence[float],
    counts: Mapping[str, Tensor] | None = None,
) -> Iterator[None]:
    """While the ``with`` block runs ``whole``'s ``microbatches`` (each ``shares[i]`` of it),
    :func:`items_in_batch` and :func:`amended_call` normalise by the whole batch."""
    running = BatchItems(
        whole, {id(mb): w for mb, w in zip(microbatches, shares, strict=True)}, dict(counts or {})
    )
    token = _RUNNING.set(running)
    try:
        yield
    finally:
        _RUNNING.reset(token)


def amended_call(call: Any, microbatch: Any) -> Any:
    """``call`` (the step's call of the model on the last stage, for ``microbatch``) with the
    keyword arguments of :class:`BatchItems` ``counts`` for this micro-batch's share, unless
    the step passes them itself; ``call`` itself outside a step that normalises by the batch."""
    running = _RUNNING.get()
    if running is None or not running.counts or not isinstance(call, BodyInput):
        return call
    share = running.share_of(microbatch)
    if share is None:
        return call
    extra = {k: n * share for k, n in running.counts.items() if k not in call.kwargs}
    return BodyInput(call.args, {**call.kwargs, **extra}) if extra else call


def items_in_batch(batch: Any, count: Callable[[Any], Any]) -> Any:
    """The count a step divides its summed loss by, so that the loss is the whole batch's
    mean over its items, as on one device.

    ``count(batch)`` counts the items of a batch (``lambda b: (b["labels"] != -100).sum()``).
    Outside pipe2bw, or with ``loss_normalization="microbatch"``, this is ``count(batch)``.
    Inside a pipelined step, where ``batch`` is one micro-batch of the batch the dataloader
    gave, it is the whole batch's count times the micro-batch's share of the batch (its
    samples over the batch's): the pipeline weights each micro-batch's loss by that share, so
    the step's ``loss_sum / items_in_batch(batch, count)`` sums to the batch's ``loss_sum /
    count``, on any number of stages and micro-batches::

        def training_step(self, batch, batch_idx):
            logits = self(batch["input_ids"])
            total = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                    ignore_index=-100, reduction="sum")
            return total / items_in_batch(batch, lambda b: (b["labels"] != -100).sum())
    """
    running = _RUNNING.get()
    if running is None:
        return count(batch)
    share = running.share_of(batch)
    if share is None:
        raise ValueError(
            "items_in_batch(batch, count) was given an object that is not the batch this step "
            f"received (a {type(batch).__name__}); pass the step's own `batch` argument, and "
            "let `count` pick the labels out of it"
        )
    return count(running.whole) * share
