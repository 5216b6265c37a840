"""Parameters shared across stages: a copy on each stage that uses it, kept equal.

A tie (``partition.ties.Tie``) whose uses land on different stages (GPT-2's token embedding on
the first stage and the output head on the last) gives each of those stages its own copy. The
copies start equal (the primary's value is broadcast at set-up and after a checkpoint is loaded)
and stay equal: before every optimizer step the gradients of the copies are summed over the
stages holding them (the gradient of the shared parameter on one device is the sum of its uses'
gradients), so every copy takes the same update. Under 2BW the sum is taken on the gradient
that is due, the one the delayed update applies, at the same point of Lightning's loop on every
stage, so the version rule holds for every copy alike. Gradient clipping counts the gradient
once (on the primary's stage).

Under 2BW with one pipeline the sum is started ahead of the step (:meth:`TiedCopies.post`): a
batch's gradient is complete on a stage long before the step that applies it, so each stage
starts the all-reduce of its copies' gradients then, without waiting, and the step takes the
sums, by then in. Summed at the step, it would make the stages that hold a tie (the first and
the last) meet at every step, which puts part of the bubble back. The tie's group carries
nothing else while training, and every stage posts every batch in batch order, so the sums
pair up as at the step, over the same tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_pipe2bw.partition import Partition
from lightning_pipe2bw.partition.ties import Tie
from lightning_pipe2bw.pipeline.groups import ProcessGroups
from lightning_pipe2bw.pipeline.topology import Topology
from lightning_pipe2bw.runtime.stage import StageBody

__all__ = ["TiedCopies"]


@dataclass
class _Copy:
    tie: Tie
    param: Tensor  # this stage's copy
    group: Any  # the replica's group of the stages holding copies
    src: int  # global rank of the primary's stage
    primary: bool  # this stage holds the primary use


class TiedCopies:
    """This stage's copies of parameters shared with other stages (see the module notes)."""

    def __init__(
        self, body: StageBody, partition: Partition, topology: Topology, groups: ProcessGroups
    ) -> None:
        self.copies: list[_Copy] = []
        for tie in body.ties:
            # the ranks' places in the pipeline: with virtual stages, uses on two stages of one
            # rank share one parameter (the V puts the first and the last stage on one rank)
            stages = tuple(sorted({topology.place_of(v) for v in tie.stages(partition)}))
            if len(stages) < 2:
                continue
            group = groups.tie(stages)  # collective: every rank, every tie, in order
            if topology.stage not in stages:
                continue
            block, name = next((b, n) for b, n in tie.uses if b in body.indices)
            primary_stage = topology.place_of(partition.stage_of(tie.primary[0]))
            self.copies.append(
                _Copy(
                    tie,
                    body.block(block).get_parameter(name),
                    group,
                    topology.rank_of_stage(primary_stage),
                    primary_stage == topology.stage,
                )
            )

        # under 2BW with one pipeline: each completed batch's sums, started ahead (post)
        self.ahead = False
        self._posted: deque[tuple[int, list[tuple[_Copy, Tensor, Any]]]] = deque()

    def post(self, batch: int, grads: Sequence[Tensor | None], params: Sequence[Tensor]) -> None:
        """Batch ``batch``'s gradient (of ``params``, in that order) is complete on this stage:
        start summing its copies' gradients over the stages that hold them (no wait)."""
        by_param = {id(p): g for p, g in zip(params, grads, strict=True)}
        started = []
        for c in self.copies:
            if not c.param.requires_grad:
                continue
            grad = by_param.get(id(c.param))
            if grad is None:
                grad = c.param.detach().new_zeros(c.param.shape)
            started.append((c, grad, dist.all_reduce(grad, group=c.group, async_op=True)))
        self._posted.append((batch, started))

    def __bool__(self) -> bool:
        return bool(self.copies)

    def sync_weights(self) -> None:
        """Give every copy the primary's value (collective among the stages of each tie)."""
        for c in self.copies:
            dist.broadcast(c.param.data, src=c.src, group=c.group)

    def sum_gradients(self) -> None:
        """Sum the copies' gradients over the stages holding them (collective among them; a
        copy without a gradient contributes zeros and then has the sum). With :attr:`ahead`,
        take the sums :meth:`post` started for the oldest batch not yet applied."""
        if self.ahead:
            if not self._posted:
                raise RuntimeError(
                    "the tied copies' gradients of the update due now were not posted ahead: "
                    "the pipeline applied an update it did not complete"
                )
            _, started = self._posted.popleft()
            for c, grad, work in started:
                work.wait()
                c.param.grad = grad
            return
        for c in self.copies:
            if not c.param.requires_grad:  # frozen: no copy has a gradient to sum
                continue
            if c.param.grad is None:
                c.param.grad = c.param.detach().new_zeros(c.param.shape)
            dist.all_reduce(c.param.grad, group=c.group)

    def counted(self, param: Tensor) -> bool:
        """Whether ``param``'s gradient counts in a norm over every stage (a copy's counts on the
        primary's stage only)."""
        return all(c.primary or c.param is not param for c in self.copies)

    def copies_elsewhere(self) -> list[tuple[Tensor, tuple[int, str]]]:
        """This stage's copies whose primary use is on another stage: (the copy, the primary's
        (block, name)), so that a value named after the copy can be told for the primary's."""
        return [(c.param, c.tie.primary) for c in self.copies if not c.primary]

    def describe(self) -> list[str]:
        return [c.tie.describe() for c in self.copies]
