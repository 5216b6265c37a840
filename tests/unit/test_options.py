"""The strategy's options and the process mesh as plain values, in one process: every problem
collected and named, the layout arithmetic, and the checks that need a run or a partition.

The multi-process tests in ``test_bad_input.py`` see the same messages raised on real ranks;
here the arithmetic is checked without starting any process.
"""

from __future__ import annotations

import dataclasses
import inspect
from datetime import timedelta
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_pipe2bw import Pipe2BWStrategy, PipeOptions
from lightning_pipe2bw.config import StrategyConfig, build_strategy, strategy_problems
from lightning_pipe2bw.partition import Partition
from lightning_pipe2bw.pipeline.checks import (
    async_problems,
    memory_plan_problems,
    run_problems,
    runtime_problems,
)
from lightning_pipe2bw.pipeline.groups import choose_backend
from lightning_pipe2bw.pipeline.options import DEFAULT_SCHEDULE, OPTIONS, raise_problems
from lightning_pipe2bw.pipeline.topology import Topology
from lightning_pipe2bw.schedule import ActivationBudget

# ----------------------------------------------------------------------------- PipeOptions


def test_defaults_are_the_strategy_defaults() -> None:
    options = PipeOptions.create()
    assert options == PipeOptions()
    assert Pipe2BWStrategy().options == options
    assert options.schedule == DEFAULT_SCHEDULE and options.timeout == timedelta(minutes=3)


def test_values_are_normalised() -> None:
    options = PipeOptions.create(
        balance=iter([3, 5]),
        recompute=[True, False],
        memory_plan={"2": "swap", 0: "recompute"},
        balance_activations=True,
        repartition_threshold=1,
    )
    assert options.balance == (3, 5) and options.balance_mode is None
    assert options.recompute == (True, False)
    assert options.memory_plan == {2: "swap", 0: "recompute"}
    assert options.activation_budget == ActivationBudget()
    assert options.repartition_threshold == 1.0 and isinstance(options.repartition_threshold, float)
    assert PipeOptions.create(balance="params").balance_mode == "params"
    assert PipeOptions.create(balance_activations=2.5).activation_budget == ActivationBudget(2.5)
    assert PipeOptions.create(balance_activations=False).activation_budget is None


def test_options_are_frozen() -> None:
    options = PipeOptions.create()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.schedule = "1f1b"  # type: ignore[misc]
    budget = ActivationBudget(bytes=1024)
    assert options.with_activation_budget(budget).activation_budget == budget
    assert options.activation_budget is None  # a new value; this one is unchanged


def test_every_problem_is_listed_in_one_error() -> None:
    raw: dict[str, Any] = {
        "schedule": "2bx",
        "microbatches": 0,
        "balance": [3, 0],
        "start_method": "thread",
        "data_parallel": 0,
        "memory_plan": {"first": "swap"},
        "repartition_threshold": -1,
    }
    problems = PipeOptions.problems(**raw)
    assert [p.option for p in problems] == [
        "schedule",
        "microbatches",
        "balance",
        "start_method",
        "data_parallel",
        "memory_plan",
        "repartition_threshold",
    ]
    with pytest.raises(ValueError) as info:
        PipeOptions.create(**raw)
    message = str(info.value)
    assert message.startswith("invalid pipe2bw options:\n  - unknown schedule '2bx'")
    for problem in problems:
        assert problem.message in message
    # the same through the strategy, before any process starts
    with pytest.raises(ValueError, match="microbatches must be a positive int, got 0"):
        Pipe2BWStrategy(**raw)


def test_one_problem_raises_its_own_error() -> None:
    with pytest.raises(TypeError) as info:
        PipeOptions.create(recompute="yes")
    assert str(info.value) == "recompute must be a bool or a list of one bool per stage, got 'yes'"
    with pytest.raises(TypeError, match=r"timeout must be a datetime.timedelta .* got 30"):
        PipeOptions.create(timeout=30)
    with pytest.raises(TypeError, match=r"memory_plan must map block indices to policies"):
        PipeOptions.create(memory_plan=["swap"])
    for bad in (timedelta(0), timedelta(seconds=-5)):  # before torch's rendezvous sees it
        with pytest.raises(ValueError) as zero:
            PipeOptions.create(timeout=bad)
        seconds = f"{bad.total_seconds():g}"
        assert str(zero.value).startswith(f"timeout must be positive, got {bad!r} ({seconds} s)")
        assert "timedelta(minutes=10), or None for the default (3 minutes)" in str(zero.value)
    # only type errors: a TypeError that lists both
    with pytest.raises(TypeError, match=r"(?s)invalid pipe2bw options.*timeout.*recompute"):
        PipeOptions.create(recompute=3, timeout="1m")


def test_unknown_option_names_list_the_valid_ones() -> None:
    with pytest.raises(TypeError, match=r"unknown pipe2bw options \['scheduel'\]; valid options: "):
        PipeOptions.create(scheduel="1f1b")


@pytest.mark.parametrize(
    ("raw", "choices"),
    [
        (
            {"schedule": "zb"},
            (
                "gpipe",
                "1f1b",
                "2bw",
                "pipedream",
                "zb-h1",
                "interleaved-1f1b",
                "zb-v",
                "2bw-v",
                "dualpipe-v",
            ),
        ),
        ({"start_method": "Spawn"}, ("popen", "spawn", "fork", "forkserver")),
        ({"state_dict_type": "dcp"}, ("full", "sharded")),
        ({"balance": "even"}, ("uniform", "params", "flops", "auto")),
    ],
)
def test_unknown_names_carry_their_choices(raw: dict[str, Any], choices: tuple[str, ...]) -> None:
    (problem,) = PipeOptions.problems(**raw)
    assert problem.choices == choices
    assert repr(next(iter(raw.values()))) in problem.message


def test_schedules_of_several_stages_per_rank_are_accepted_and_placed() -> None:
    for name in ("interleaved-1f1b", "zb-v", "2bw-v", "dualpipe-v"):
        assert PipeOptions.problems(schedule=name) == []
    looped = Topology.for_schedule(4, 2, 1, "interleaved-1f1b")  # 2 pipelines of 2 ranks
    assert looped.placement == (0, 1, 0, 1) and looped.stage == 0
    assert looped.stages_here == (0, 2) and looped.is_first and not looped.is_last
    assert looped.last_rank == 0 and looped.peers == [0]
    v = Topology.for_schedule(4, 1, 3, "zb-v")  # global rank 3 runs the first place
    assert v.placement == (0, 1, 2, 3, 3, 2, 1, 0)
    assert v.stages_here == (0, 7) and v.is_first and v.is_last and v.last_rank == 3
    assert v.peers == [2] and v.neighbour_ranks() == {-1: None, 1: 2, 6: 2, 8: None}
    assert Topology.for_schedule(4, 1, 0, "1f1b").placement is None


def test_what_virtual_stages_do_not_run_yet_is_refused_with_the_way_out() -> None:
    topology = Topology.for_schedule(2, 1, 0, "zb-v")
    options = PipeOptions.create(
        schedule="zb-v", balance_activations=True, repartition_every=5, balance=[2, 2]
    )
    problems = {p.option: p.message for p in topology.option_problems(options)}
    assert set(problems) == {"activation_budget", "repartition_every", "balance"}
    assert (
        "a V placement (schedule='zb-v') balances activations by itself"
        in problems["activation_budget"]
    )
    assert "give 4 block counts" in problems["balance"]
    odd = PipeOptions.create(schedule="interleaved-1f1b", microbatches=3)
    (problem,) = Topology.for_schedule(2, 1, 0, "interleaved-1f1b").option_problems(odd)
    assert problem.option == "microbatches" and "use a multiple of 2" in problem.message
    few = PipeOptions.create(schedule="dualpipe-v", microbatches=3)
    (problem,) = Topology.for_schedule(2, 1, 0, "dualpipe-v").option_problems(few)
    assert problem.option == "microbatches" and "its 4 stages" in problem.message
    assert "use microbatches=4 or more" in problem.message
    assert Topology.for_schedule(2, 1, 0, "dualpipe-v").placement == (0, 1, 1, 0)


def test_settings_are_plain_and_equal_for_equal_options() -> None:
    a = PipeOptions.create(balance=[2, 2], memory_plan={1: "swap"}).settings(4)
    b = PipeOptions.create(balance=(2, 2), memory_plan={"1": "swap"}).settings(4)
    assert a == b and a["microbatches"] == 4 and a["balance"] == (2, 2)
    assert PipeOptions.create(balance="auto").settings(2)["balance"] == "auto"


def test_strategy_from_options_keeps_them() -> None:
    options = PipeOptions.create(schedule="1f1b", microbatches=8, process_group_backend="gloo")
    strategy = Pipe2BWStrategy.from_options(options)
    assert strategy.options is options
    assert strategy.schedule_name == "1f1b" and strategy.microbatches == 8
    assert strategy.process_group_backend == "gloo"


def test_stage_processes_sharing_a_gpu_run_on_gloo() -> None:
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert choose_backend([gpu, gpu], None, "nccl") == "gloo"
    assert choose_backend([gpu, gpu], "gloo", "nccl") == "gloo"
    assert choose_backend([gpu, torch.device("cuda", 1)], None, "nccl") == "nccl"
    assert choose_backend([cpu, cpu], None, "gloo") == "gloo"
    assert choose_backend([cpu, cpu], "mpi", "gloo") == "mpi"
    with pytest.raises(
        ValueError,
        match=r"process_group_backend='nccl', but several stage processes share a GPU "
        r"\(cuda:0 3\) and NCCL refuses two ranks on one device; leave process_group_backend "
        r"unset or set it to 'gloo'",
    ):
        choose_backend([gpu, gpu, gpu, torch.device("cuda", 1)], "nccl", "nccl")


# ----------------------------------------------------------------------------- Topology


@given(
    st.integers(min_value=1, max_value=6).flatmap(
        lambda d: st.tuples(st.just(d), st.integers(min_value=1, max_value=4))
    )
)
def test_the_mesh_is_a_bijection_with_rank_0_on_the_last_stage(dims: tuple[int, int]) -> None:
    depth, replicas = dims
    world = depth * replicas
    seen = set()
    for rank in range(world):
        t = Topology.create(world, replicas, rank)
        assert t.num_stages == depth
        assert t.rank_of_stage(t.stage, t.replica) == rank
        assert rank in t.pipeline_ranks() and rank in t.stage_ranks()
        assert sorted(t.pipeline_ranks()) == list(range(t.replica * depth, (t.replica + 1) * depth))
        assert t.prev_rank == (None if t.stage == 0 else t.rank_of_stage(t.stage - 1))
        assert t.next_rank == (None if t.is_last else t.rank_of_stage(t.stage + 1))
        assert t.partner(t.partner()) == t.stage
        seen.add((t.replica, t.stage))
    assert len(seen) == world
    first = Topology.create(world, replicas, 0)
    assert first.is_last and first.replica == 0 and first.last_rank == 0


def test_topology_examples() -> None:
    t = Topology.create(4, 2, 1)  # two pipelines of two stages
    assert (t.num_stages, t.replica, t.stage) == (2, 0, 0)
    assert t.pipeline_ranks(1) == [3, 2] and t.stage_ranks(0) == [1, 3]
    assert t.describe() == "rank 1 of 4: stage 0 of 2 in replica 0 of 2"


def test_data_parallel_that_does_not_divide_the_world() -> None:
    with pytest.raises(ValueError) as info:
        Topology.create(6, 4)
    assert str(info.value) == (
        "data_parallel=4 does not divide the 6 processes (devices x num_nodes); use a "
        "data_parallel that divides 6, or 4 devices"
    )


@pytest.mark.parametrize(
    ("world", "balance", "expected"),
    [
        (
            2,
            [2, 3, 3],
            "balance=[2, 3, 3] describes 3 stages but 2 devices with data_parallel=1 make "
            "pipelines of 2 stages; use a device count divisible by 3",
        ),
        (
            2,
            [8],
            "balance=[8] describes 1 stages but 2 devices with data_parallel=1 make pipelines "
            "of 2 stages; use data_parallel=2 (2 pipelines of 1 stages) or devices=1",
        ),
    ],
)
def test_balance_for_another_number_of_stages(
    world: int, balance: list[int], expected: str
) -> None:
    """The messages test_bad_input.py sees on two real ranks, checked without them."""
    (problem,) = Topology.create(world).option_problems(PipeOptions.create(balance=balance))
    assert problem.message == expected


def test_recompute_for_another_number_of_stages() -> None:
    options = PipeOptions.create(recompute=[True, False, True])
    (problem,) = Topology.create(4, 2).option_problems(options)
    assert problem.message == (
        "recompute=[True, False, True] has 3 entries but the pipeline has 2 stages; give one "
        "bool per stage, or one bool for all"
    )
    assert Topology.create(6, 2).option_problems(options) == []


# ----------------------------------------------------------------------------- a run's checks


def _run(options: PipeOptions, stages: int = 2, **kwargs: Any) -> list[str]:
    values = {
        "fitting": True,
        "predicting": False,
        "automatic_optimization": True,
        "accumulate_grad_batches": 1,
        **kwargs,
    }
    return [p.message for p in run_problems(options, stages, **values)]


def test_run_problems() -> None:
    assert _run(PipeOptions.create()) == []
    (accumulate,) = _run(PipeOptions.create(), accumulate_grad_batches=2)
    assert accumulate.startswith("Trainer(accumulate_grad_batches=2) is not supported by pipe2bw")
    (manual,) = _run(PipeOptions.create(), automatic_optimization=False)
    assert manual.startswith("pipe2bw drives forward and backward itself")
    assert _run(PipeOptions.create(), automatic_optimization=False, fitting=False) == []
    (few,) = _run(PipeOptions.create(schedule="2bw", microbatches=2), stages=4)
    assert few.startswith("schedule='2bw' needs at least as many micro-batches as stages")
    (predict,) = _run(PipeOptions.create(data_parallel=2), fitting=False, predicting=True)
    assert predict.startswith("trainer.predict with data_parallel=2")
    both = _run(PipeOptions.create(data_parallel=2), accumulate_grad_batches=3, predicting=True)
    assert len(both) == 2 and both[0].startswith("trainer.predict with data_parallel=2")


def test_async_problems() -> None:
    two_bw, pipedream = PipeOptions.create(), PipeOptions.create(schedule="pipedream")
    kwargs = {"clips_gradients": False, "scales_loss": False}
    assert async_problems(two_bw, num_optimizers=1, **kwargs) == []
    (many,) = async_problems(two_bw, num_optimizers=2, **kwargs)
    assert "configure_optimizers returned 2; use one optimizer" in many.message
    (clip,) = async_problems(pipedream, num_optimizers=1, clips_gradients=True, scales_loss=False)
    assert "remove gradient_clip_val / 16-mixed, or use schedule='2bw'" in clip.message
    assert async_problems(two_bw, num_optimizers=1, clips_gradients=True, scales_loss=True) == []


@pytest.mark.parametrize(
    ("options", "recompute", "text"),
    [
        (
            {"memory_plan": {9: "swap"}},
            False,
            "memory_plan names block 9, but the body has 8 blocks",
        ),
        (
            {"memory_plan": {6: "evict"}},
            False,
            "block 6 runs on stage 1 of 2, which has no partner",
        ),
        ({"memory_plan": {1: "swap"}}, True, "give either recompute or a memory_plan"),
        (
            {"memory_plan": {1: "evict"}, "balance_activations": True},
            False,
            "the activation balancer chooses what to evict itself",
        ),
    ],
)
def test_memory_plan_against_the_partition(
    options: dict[str, Any], recompute: bool, text: str
) -> None:
    """The messages test_balancer.py sees on two real ranks, checked without them."""
    (problem,) = memory_plan_problems(PipeOptions.create(**options), Partition((4, 4)), recompute)
    assert text in problem.message
    assert memory_plan_problems(PipeOptions.create(), Partition((4, 4)), True) == []


def test_what_a_training_runtime_cannot_run_is_collected() -> None:
    """The two checks of a stage's runtime (test_balancer.py and test_bad_input.py see them on
    real ranks) are collected problems, none outside training."""
    run = {"num_optimizers": 1, "clips_gradients": False, "scales_loss": False}
    gpipe = PipeOptions.create(schedule="gpipe", balance_activations=True)
    (problem,) = runtime_problems(gpipe, training=True, **run)
    assert "the balanced share moves nothing" in problem.message
    assert runtime_problems(gpipe, training=False, **run) == []
    pipedream = PipeOptions.create(schedule="pipedream")
    (problem,) = runtime_problems(
        pipedream, training=True, shared_across="0.weight = 3.weight", **run
    )
    assert problem.message.startswith(
        "parameters shared between blocks on different stages (0.weight = 3.weight) need "
        "every copy updated at the same step; schedule='pipedream'"
    )
    problems = runtime_problems(
        pipedream, training=True, shared_across="a", **{**run, "num_optimizers": 2}
    )
    assert [p.option for p in problems] == ["schedule", "schedule"]  # listed together
    assert runtime_problems(PipeOptions.create(), training=True, shared_across="a", **run) == []
    fresh = PipeOptions.create(schedule="2bw", fresh_last_stage=True)
    (problem,) = runtime_problems(fresh, training=True, shared_with_last="a = b", **run)
    assert problem.option == "fresh_last_stage" and "(a = b)" in problem.message
    assert runtime_problems(fresh, training=True, shared_across="a = b", **run) == []


@pytest.mark.parametrize(
    ("schedule", "why"),
    [
        ("1f1b", "it flushes the pipeline after every batch"),
        ("2bw-v", "on a V the last stage shares its rank"),
        ("pipedream", "the last stage is never behind already"),
    ],
)
def test_a_fresh_last_stage_needs_2bw(schedule: str, why: str) -> None:
    with pytest.raises(ValueError) as info:
        PipeOptions.create(schedule=schedule, fresh_last_stage=True)
    message = str(info.value)
    assert (
        f"fresh_last_stage=True runs 2BW's last stage without its delay, but schedule={schedule!r}"
        in message
    )
    assert why in message and "use schedule='2bw'" in message
    with pytest.raises(TypeError, match="fresh_last_stage must be True or False, got 'yes'"):
        PipeOptions.create(schedule="2bw", fresh_last_stage="yes")


def test_several_memory_plan_problems_are_listed_together() -> None:
    options = PipeOptions.create(memory_plan={5: "evict", 6: "evict"}, balance_activations=True)
    problems = memory_plan_problems(options, Partition((4, 4)), False)
    assert len(problems) == 3
    with pytest.raises(ValueError) as info:
        raise_problems(problems)
    assert "block 5 runs on stage 1" in str(info.value) and "block 6 runs on stage 1" in str(
        info.value
    )


# ----------------------------------------------------------------------------- the Hydra config


def test_the_config_is_checked_by_the_strategy_checks() -> None:
    bad = StrategyConfig(schedule="zb", start_method="thread", microbatches=0)
    problems = strategy_problems(bad, world_size=2)
    assert problems == [
        "strategy.schedule='zb' is unknown; valid: gpipe, 1f1b, 2bw, pipedream, zb-h1, "
        "interleaved-1f1b, zb-v, 2bw-v, dualpipe-v",
        "strategy.microbatches: microbatches must be a positive int, got 0",
        "strategy.start_method='thread' is unknown; valid: auto, popen, spawn, fork, forkserver",
    ]
    (layout,) = strategy_problems(StrategyConfig(data_parallel=3), world_size=4)
    assert layout.startswith("strategy.data_parallel: data_parallel=3 does not divide the 4")
    (stages,) = strategy_problems(StrategyConfig(balance=[1, 2, 3]), world_size=2)
    assert stages.startswith("strategy.balance: balance=[1, 2, 3] describes 3 stages")
    assert strategy_problems(StrategyConfig(balance="params"), world_size=2) == []
    strategy = build_strategy(
        StrategyConfig(schedule="1f1b", timeout_s=30, memory_plan={1: "swap"})
    )
    assert strategy.options.timeout == timedelta(seconds=30)
    assert strategy.options.memory_plan == {1: "swap"} and strategy.schedule_name == "1f1b"


def test_every_option_is_declared_once_in_the_table() -> None:
    """The strategy's keywords and defaults, and the Hydra schema's fields, are the table's."""
    signature = inspect.signature(Pipe2BWStrategy.__init__).parameters
    keywords = [n for n, p in signature.items() if n != "self" and p.kind is not p.VAR_KEYWORD]
    assert keywords == [o.name for o in OPTIONS]
    assert [signature[o.name].default for o in OPTIONS] == [o.default for o in OPTIONS]
    schema = dataclasses.fields(StrategyConfig)
    assert [f.name for f in schema] == [o.field_name for o in OPTIONS]
    assert [f.default for f in schema] == [o.field_default for o in OPTIONS]
    assert StrategyConfig().timeout_s is None and StrategyConfig().microbatches == 4


@pytest.mark.parametrize(
    ("value", "kept"),
    [(False, None), (None, None), (True, {}), ({"backend": "aot_eager"}, {"backend": "aot_eager"})],
)
def test_compile_blocks_takes_a_flag_or_torch_compile_arguments(value: Any, kept: Any) -> None:
    assert PipeOptions.create(compile_blocks=value).compile_blocks == kept


@pytest.mark.parametrize("value", ["yes", 1, {1: "aot_eager"}])
def test_compile_blocks_of_another_kind_is_refused_naming_it(value: Any) -> None:
    with pytest.raises(TypeError) as info:
        PipeOptions.create(compile_blocks=value)
    assert "compile_blocks must be True, False or a dict of torch.compile keyword arguments" in str(
        info.value
    )
    assert repr(value) in str(info.value)
