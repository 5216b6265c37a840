"""What the engine holds and counts: a micro-batch's slot, one call's shared state, the stages a
rank holds, and the counters callbacks and benchmarks read."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from lightning_pipe2bw.runtime.payload import StepFn
from lightning_pipe2bw.runtime.stash import ActivationStash, local_shard
from lightning_pipe2bw.schedule import Action

__all__ = [
    "WHOLE",
    "ActionTiming",
    "Call",
    "EngineStats",
    "Slot",
    "VirtualStages",
    "weight_buffers_referenced",
]


@dataclass(frozen=True)
class ActionTiming:
    """When one action ran on this rank (``time.perf_counter`` seconds)."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class VirtualStages:
    """The stages a rank holds (several, with virtual stages) and where their neighbours are.

    ``stages``: the rank's stages of the whole pipeline, in order; ``num_stages``: the
    pipeline's stages; ``ranks``: the (pipeline group) rank of each stage next to one of them
    (None: none, past either end)."""

    stages: tuple[int, ...]
    num_stages: int
    ranks: Mapping[int, int | None]
    placement: tuple[int, ...] | None = None  # the place in the pipeline of every stage


@dataclass
class Slot:
    """What the stage holds for one in-flight micro-batch."""

    inputs: Any = None  # payload received from the previous stage
    outputs: Any = None  # payload this stage produced (kept until its backward)
    result: Any = None  # the user's step output (last stage)
    grads_in: Any = None  # gradients received from the next stage
    grads_out: Any = None  # gradients of this stage's inputs, to send back
    body_calls: int = 0
    weight: float = 0.0  # the loss weight of this micro-batch (n_i / N)
    saved_bytes: int = 0  # bytes autograd saved for this micro-batch's backward
    loading: bool = False  # its evicted activations are on their way back from the partner
    params: Mapping[str, Tensor] | None = None  # the weight version it computes with
    upstream_batch: Any = None  # the previous stage's micro-batch signature, to compare
    # what the micro-batch's W has left to do after its I: the split's weights' pass, the
    # whole backward (WHOLE), or nothing (None)
    weights_left: Any = None
    sent: bool = False  # its inputs' gradient has left (SEND_B)
    done: bool = False  # its weights' gradients are in (B or W)


WHOLE = "whole"  # a W that runs the micro-batch's whole backward


@dataclass
class Call:
    """One :meth:`PipelineEngine.execute` call: what its handlers share."""

    actions: Sequence[Action]
    microbatches: Mapping[int, Any]
    step: StepFn
    train: bool
    loss_weights: Mapping[int, float]
    backward: Callable[[Tensor], None] | None
    weights_for: Callable[[int], Mapping[str, Tensor]] | None
    loss_root: Callable[[Tensor], Tensor] | None
    last_input: int  # the index of the call's last I (-1: none)
    results: dict[int, Any] = field(default_factory=dict)


@dataclass
class EngineStats:
    """Counters the engine keeps about what it ran (read by callbacks and benchmarks)."""

    peak_inflight: int = 0
    busy_s: float = 0.0
    forward_s: float = 0.0  # of busy_s, in training forwards
    backward_s: float = 0.0  # of busy_s, in backwards
    # bytes autograd saved for backward in this stage's forwards (storage de-duplicated, weights
    # excluded), counted through saved_tensors_hooks, that are on this stage's device: its own
    # micro-batches' and those it holds for its partner (BPipe); live now, and the peak
    activation_bytes: int = 0
    peak_activation_bytes: int = 0
    # with several stages per rank: the peak of each stage's own saved bytes on this device
    stage_peak_bytes: dict[int, int] = field(default_factory=dict)
    host_bytes: int = 0  # saved bytes swapped out to the host pool (memory plan "swap")
    partner_bytes: int = 0  # saved bytes of the partner's micro-batches held here (BPipe)
    evicted_bytes: int = 0  # this stage's saved bytes now at its partner
    # distinct weight buffers the stage's parameters and in-flight micro-batches reference,
    # checked after every action: 1 for flush schedules, <= 2 for 2BW, <= p - s for stashing
    max_weight_versions: int = 0
    # I actions: backwards cut into an inputs' pass and a weights' pass (SplitBackward), and
    # those whose graph did not allow it, where the inputs' gradient took one more pass before
    # the whole backward (the call's last I)
    split_backwards: int = 0
    repeated_input_passes: int = 0
    # why this stage's backwards ran whole where they would have been cut, when the reason is
    # the user's (torch.compile'd blocks); said once, in the log
    whole_backward_note: str = ""
    # the most recent actions only, so that long runs keep bounded memory
    timeline: deque[ActionTiming] = field(default_factory=lambda: deque(maxlen=20_000))

    def sample(self, stash: ActivationStash, partner: int, stages: Sequence[int]) -> None:
        """Update the activation figures after an action from the stash and the ``partner``'s
        bytes held here (the link's threads move bytes too); with several ``stages`` per rank,
        each one's peak too."""
        self.partner_bytes = partner
        self.host_bytes = stash.host_bytes
        self.evicted_bytes = stash.away_bytes
        self.activation_bytes = stash.resident_bytes + partner
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.activation_bytes)
        if len(stages) > 1:
            per = dict.fromkeys(stages, 0)
            for (v, _), micro in stash.micro.items():
                per[v] += micro.resident
            peaks = self.stage_peak_bytes
            for v, nbytes in per.items():
                if nbytes > peaks.get(v, -1):
                    peaks[v] = nbytes


def weight_buffers_referenced(body: nn.Module, slots: Iterable[Slot]) -> int:
    """How many distinct weight buffers are in use: the live parameters' and those the
    in-flight micro-batches (``slots``) compute with (identified by their first tensor's
    storage)."""
    first = next(body.parameters(), None)
    ptrs = {_buffer_key(first)} if first is not None else set()
    for slot in slots:
        if slot.params:
            ptrs.add(_buffer_key(next(iter(slot.params.values()))))
    return len(ptrs)


def _buffer_key(t: Tensor) -> int:
    """Which buffer ``t`` lives in: its storage (a DTensor's shard's, under ``fsdp=True``; a
    weight FSDP has gathered for a block's call, whose storage it frees and refills, by id)."""
    t = local_shard(t)
    try:
        return int(t.untyped_storage().data_ptr())
    except RuntimeError:
        return -id(t)
