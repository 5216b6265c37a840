"""The checks of the options against what they run on: the Trainer call, the optimizers and
precision, the partition (those against the process layout are ``Topology.option_problems``,
which the layout's rewrite keeps for now). Each is a pure function of plain values returning the
collected problems (:class:`~lightning_pipe2bw.pipeline.problems.Problem`); the caller raises them
at once (:func:`~lightning_pipe2bw.pipeline.problems.raise_problems`). The checks of one option's
value alone live with its declaration (``pipeline/optiontable.py``).
"""

from __future__ import annotations

from lightning_pipe2bw.partition.split import Partition
from lightning_pipe2bw.pipeline.options import PipeOptions
from lightning_pipe2bw.pipeline.problems import Problem
from lightning_pipe2bw.runtime.stash import check_memory_plan
from lightning_pipe2bw.schedule import ActivationBudget, offload_stages

__all__ = ["memory_plan_problems", "one_stage_note", "run_problems", "runtime_problems"]


def run_problems(
    options: PipeOptions,
    num_stages: int,
    *,
    fitting: bool,
    predicting: bool,
    automatic_optimization: bool,
    accumulate_grad_batches: int,
) -> list[Problem]:
    """What the options cannot do in this run (a Trainer call on ``num_stages`` stages)."""
    problems: list[Problem] = []
    m, w = options.num_microbatches(num_stages), options.data_parallel
    if fitting and not automatic_optimization:
        problems.append(
            Problem(
                "automatic_optimization",
                False,
                "pipe2bw drives forward and backward itself and needs automatic optimization; "
                "remove `self.automatic_optimization = False` from the LightningModule",
            )
        )
    spec = options.spec
    if not spec.virtual:  # the virtual schedules' rules: Topology.option_problems
        message = spec.microbatch_message(m, num_stages)
        if message is not None:
            problems.append(Problem("microbatches", m, message))
    if predicting and w > 1:
        problems.append(
            Problem(
                "data_parallel",
                w,
                f"trainer.predict with data_parallel={w} would split the data over the replicas "
                "and return only replica 0's predictions; predict with a strategy of "
                "data_parallel=1 (the checkpoint loads with any layout)",
            )
        )
    if accumulate_grad_batches != 1:
        n = accumulate_grad_batches
        problems.append(
            Problem(
                "accumulate_grad_batches",
                n,
                f"Trainer(accumulate_grad_batches={n}) is not supported by pipe2bw: a batch "
                f"already accumulates gradients over its micro-batches. Use a {n}x larger batch "
                "(and more micro-batches) instead",
            )
        )
    return problems


def one_stage_note(world_size: int, data_parallel: int, options: PipeOptions) -> str:
    """What a user who asked for a pipeline of one stage is told: there is no pipeline, and
    the way to one (``devices``). A run of one stage is valid (the reference curves of
    ``benchmarks/convergence.py``), so this is a warning, not an error."""
    processes = (
        "1 process" if world_size == 1 else f"{world_size} processes, data_parallel={data_parallel}"
    )
    return (
        f"pipe2bw: {processes}: one pipeline stage, so there is no pipeline: the whole body "
        f"runs in every process, as on one device, under schedule={options.schedule!r}'s "
        "update rule. For a pipeline of N stages give Trainer(devices=N) (times "
        "data_parallel); with devices left out Lightning gives one CPU device"
    )


def async_problems(
    options: PipeOptions, *, num_optimizers: int, clips_gradients: bool, scales_loss: bool
) -> list[Problem]:
    """What the schedules without a flush (``2bw``, ``pipedream``) cannot do with the run's
    optimizers and precision."""
    name = options.schedule
    problems: list[Problem] = []
    if num_optimizers != 1:
        problems.append(
            Problem(
                "schedule",
                name,
                f"schedule={name!r} keeps versions of one optimizer's weights, but "
                f"configure_optimizers returned {num_optimizers}; use one optimizer (with "
                "parameter groups if needed)",
            )
        )
    elif options.spec.updates_per_stage and (clips_gradients or scales_loss):
        problems.append(
            Problem(
                "schedule",
                name,
                f"schedule={name!r} applies each stage's update asynchronously, when that "
                "stage finishes a batch, so no global gradient norm or inf check exists at update "
                "time; remove gradient_clip_val / 16-mixed, or use schedule='2bw'",
            )
        )
    return problems


def memory_plan_problems(
    options: PipeOptions, partition: Partition, recompute: bool
) -> list[Problem]:
    """What is wrong with the memory plan on this partition (``recompute``: whether this
    stage recomputes every block anyway)."""
    plan = options.memory_plan
    if not plan:
        return []
    try:
        check_memory_plan(plan, partition.num_blocks)
    except ValueError as err:
        return [Problem("memory_plan", plan, str(err))]
    problems: list[Problem] = []
    if recompute and any(policy != "keep" for policy in plan.values()):
        problems.append(
            Problem(
                "memory_plan",
                plan,
                "recompute=True already recomputes every block of the stage; give either "
                "recompute or a memory_plan (whose 'recompute' entries pick the blocks)",
            )
        )
    p = partition.num_stages
    evicting = offload_stages(p)
    for index, policy in sorted(plan.items()):
        stage = partition.stage_of(index)
        if policy == "evict" and stage not in evicting:
            where = f"stages {list(evicting)}" if evicting else "no stage (one stage only)"
            problems.append(
                Problem(
                    "memory_plan",
                    plan,
                    f"memory_plan[{index}] = 'evict', but block {index} runs on stage {stage} "
                    f"of {p}, which has no partner that stashes less: {where} can evict. Use "
                    "'swap' or 'recompute' for this block",
                )
            )
    if options.activation_budget is not None and "evict" in plan.values():
        problems.append(
            Problem(
                "memory_plan",
                plan,
                "the activation balancer chooses what to evict itself; give either "
                "balance_activations / ActivationBalancer or 'evict' entries in memory_plan",
            )
        )
    return problems


def runtime_problems(
    options: PipeOptions,
    *,
    training: bool,
    num_optimizers: int,
    clips_gradients: bool,
    scales_loss: bool,
    shared_across: str | None = None,
    shared_with_last: str | None = None,
) -> list[Problem]:
    """What a stage's runtime cannot run (none outside training): BPipe's balanced share under
    GPipe, :func:`async_problems`, parameters shared by blocks on different stages under
    ``pipedream`` (``shared_across``: the description of one such tie, if any), and such a tie
    that includes the last stage under ``fresh_last_stage`` (``shared_with_last``)."""
    if not training:
        return []
    problems: list[Problem] = []
    if options.spec.stashes_everything and options.activation_budget == ActivationBudget():
        problems.append(
            Problem(
                "balance_activations",
                True,
                f"schedule={options.schedule!r} stashes all m micro-batches on every stage, so "
                "the balanced share moves nothing; balance activations with '1f1b', '2bw' or "
                "'pipedream', or give a budget",
            )
        )
    if options.is_async:
        problems += async_problems(
            options,
            num_optimizers=num_optimizers,
            clips_gradients=clips_gradients,
            scales_loss=scales_loss,
        )
    if shared_across is not None and options.spec.updates_per_stage:
        problems.append(
            Problem(
                "schedule",
                options.schedule,
                f"parameters shared between blocks on different stages ({shared_across}) "
                f"need every copy updated at the same step; schedule={options.schedule!r} "
                "updates each stage on its own. Use '2bw', '1f1b' or 'gpipe', or a balance that "
                "puts the blocks sharing a parameter on one stage",
            )
        )
    if shared_with_last is not None and options.fresh_last_stage:
        problems.append(
            Problem(
                "fresh_last_stage",
                True,
                f"parameters shared between the last stage and another ({shared_with_last}) "
                "need every copy updated with the same batch's gradient; fresh_last_stage=True "
                "updates the last stage one batch ahead of the others. Leave fresh_last_stage "
                "False, or use a balance that keeps the blocks sharing a parameter off the last "
                "stage",
            )
        )
    return problems
