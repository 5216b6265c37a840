"""What the planners simulate: each stage's action costs, and a flush schedule's step.

A plan's stages come from the partition search as :class:`~.costmodel.StageCost` (forward,
backward, incoming transfers, all-reduce). The simulator wants each action's duration as its
rank spends it: a forward with the wait for its activation and its send folded in, a backward
with the wait for its gradient and its send, and for a backward cut in two (``I`` and ``W``:
ZB-H1 and ZB-V cut every one, DualPipeV those at its ends, the ``early_input_grad`` pass the
ones a neighbour waits for) the measured passes of its blocks' backward cut in two
(:attr:`~.profile.BlockProfile.split_times`). Both the one-stage planner
(:mod:`~.planner`) and the two-stage one (:mod:`~.virtualplan`) build their costs here and
simulate :func:`~lightning_pipe2bw.schedule.training_schedule`, the list the engine runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pipe2bw.planner.costmodel import CostModel, StageCost
from lightning_pipe2bw.schedule import (
    Costs,
    SimResult,
    cut_overhead,
    simulate,
    training_schedule,
)

__all__ = ["flush_step", "simulation_costs"]


def simulation_costs(
    model: CostModel,
    bounds: Sequence[int],
    stages: Sequence[StageCost],
    placement: Sequence[int],
    recompute: Sequence[bool],
) -> Costs:
    """Each stage's actions for the simulation; stage v holds blocks ``bounds[v] ..
    bounds[v + 1] - 1`` and runs on rank ``placement[v]``.

    A hand-over between two stages of one rank (the V's turn) is not a message: neither side
    pays for it. ``I`` waits for the gradient and sends the inputs' one; ``W`` computes the
    weights' gradients and carries the stage's share of the update (flush schedules spread the
    update over the micro-batches, as the cost model does). The first stage has no inputs'
    gradient to send, so its ``I`` is only the wait and its backward runs whole in ``W``; a
    stage that recomputes its activations runs the recomputed forward and the whole backward in
    ``I`` (the engine's cut needs the saved graph, which recompute rebuilds in one piece).
    Every action pays the cluster's ``action_s``."""
    profile, cluster = model.profile, model.cluster
    n, send, action = len(stages), cluster.send_s, cluster.action_s
    forward, backward, inputs, weights = [], [], [], []
    for v, st in enumerate(stages):
        # whether stage v's previous / next stage is on its own rank (a hand-over)
        local_in = v > 0 and placement[v - 1] == placement[v]
        local_out = v < n - 1 and placement[v + 1] == placement[v]
        received = 0.0 if local_out else st.recv_gradient_s
        forward.append(
            st.forward_s
            - (send if local_out else 0.0)
            + (0.0 if local_in else st.recv_activation_s)
        )
        backward.append(st.backward_s - (send if local_in else 0.0) + received)
        blocks = profile.blocks[bounds[v] : bounds[v + 1]]
        update = sum(b.update_s for b in blocks) / model.m if model.flush else 0.0
        whole = sum(b.backward_s for b in blocks) + update
        if recompute[v]:
            whole += sum(b.forward_s for b in blocks)
        sent = 0.0 if v == 0 or local_in else send
        if v == 0:
            inputs.append(received + action)
            weights.append(whole + action)
        elif recompute[v]:
            inputs.append(whole + action + sent + received)
            weights.append(action)
        else:
            inputs.append(sum(b.split_times[0] for b in blocks) + action + sent + received)
            weights.append(sum(b.split_times[1] for b in blocks) + update + action)
    return Costs(forward=forward, backward=backward, input_grad=inputs, weight_grad=weights)


def flush_step(
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    costs: Costs,
    allreduce: Sequence[float],
    overhead_s: float,
    device_type: str = "cpu",
) -> tuple[float, SimResult]:
    """A flush schedule's step: the simulated run of the list the engine runs on
    ``device_type`` (zero bubble's cuts where they pay there: ``schedule.cut_overhead``), each
    rank's all-reduce after its last action, then ``overhead_s`` (the loop's cost per step);
    ``allreduce`` has one entry per rank."""
    runs = training_schedule(
        schedule, num_ranks, num_microbatches, cut_overhead=cut_overhead(device_type)
    )
    result = simulate(runs, costs)
    ends = [row[-1][2] if row else 0.0 for row in result.timeline]
    step = max(end + ar for end, ar in zip(ends, allreduce, strict=True)) + overhead_s
    return step, result
