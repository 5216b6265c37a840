"""The Lightning seam: ``Pipe2BWStrategy`` sets up stages and hands each step to the pipeline engine."""

from __future__ import annotations

import atexit
import importlib.metadata
import logging
import math
import os
import pickle
import subprocess
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, get_args

import lightning
import torch
import torch.distributed as dist
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler
from typing_extensions import override

from lightning_pipe2bw.agreement import (
    agree_on_inf_checks,
    check_same_setup,
    make_clipping_global,
)
from lightning_pipe2bw.autoplan import AutoPlanInputs, auto_plan
from lightning_pipe2bw.callbacks.balancer import (
    ActivationBudget,
    evict_share,
    stashed_microbatches,
)
from lightning_pipe2bw.checkpoint import (
    gather_named,
    gather_optimizer_state,
    gather_state_dict,
    is_sharded_checkpoint,
    load_sharded,
    load_stage_optimizer_state,
    load_stage_optimizer_state_by_name,
    load_stage_state_dict,
    read_sharded_meta,
    save_sharded,
    stage_optimizer_state,
    to_cpu,
)
from lightning_pipe2bw.launcher import PipeSpawnLauncher
from lightning_pipe2bw.partition import BodyRef, Partition, build_stage, find_body, make_partition
from lightning_pipe2bw.partition.balance import balance_by_params
from lightning_pipe2bw.partition.plans import PlanResult
from lightning_pipe2bw.repartition import (
    Repartition,
    StageTiming,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    plan_repartition,
)
from lightning_pipe2bw.runtime import P2PTransport, PipelineEngine, StageBody, merge_outputs
from lightning_pipe2bw.runtime.engine import step_loss
from lightning_pipe2bw.runtime.failure import FailureRecord, StageFailure, action_of, wait_limits
from lightning_pipe2bw.runtime.microbatch import batch_size_of, split_batch
from lightning_pipe2bw.runtime.peer import PeerLink
from lightning_pipe2bw.runtime.reports import ReportChannel
from lightning_pipe2bw.runtime.stash import check_memory_plan
from lightning_pipe2bw.runtime.twobw import PipeDreamDriver, TwoBWDriver
from lightning_pipe2bw.runtime.versions import TwoBWOptimizer, WeightVersions
from lightning_pipe2bw.schedule import (
    SCHEDULES,
    Schedule,
    add_communication,
    add_offload_schedule,
    get_schedule,
    offload_stages,
)
from lightning_pipe2bw.schedule.generators import forward_only
from lightning_pipe2bw.steplog import LogRecorder, replay

__all__ = ["Pipe2BWStrategy"]

log = logging.getLogger(__name__)

_StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
BalanceMode = Literal["uniform", "params", "auto"]
BALANCE_MODES: tuple[str, ...] = get_args(BalanceMode)


def _say(text: str) -> None:
    """Write ``text`` and a newline to stderr in one write, so that lines from several ranks
    sharing the launcher's stderr do not run into each other."""
    data = (text.rstrip("\n") + "\n").encode()
    try:
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), data)
    except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor
        print(text, file=sys.stderr, flush=True)


# how long a rank waits for another before the run stops (torch's own default is 30 minutes)
DEFAULT_TIMEOUT = timedelta(minutes=3)


class Pipe2BWStrategy(ParallelStrategy):
    """Pipeline-parallel training: one stage of the model's body per process.

    Args:
        schedule: the pipeline schedule, one of ``lightning_pipe2bw.schedule.SCHEDULES``:
            ``"2bw"`` (PipeDream-2BW, the default: double-buffered weights, no flush between
            batches, W(t+1) = W(t) - step(grad f(W(t-1)))), ``"1f1b"`` (PipeDream-Flush) or
            ``"gpipe"``; the flush schedules equal single-device training exactly.
        flush_every: with ``"2bw"``, also drain the pipeline every this many batches (it is
            always drained before validation, before a checkpoint and at the end of fit).
        microbatches: micro-batches per batch (``m``); each batch is split along dim 0. Defaults to
            the number of stages. Uneven splits are allowed (sizes differ by at most one).
        balance: blocks per stage, e.g. ``[3, 5]``; ``None`` splits the body evenly.
        body: dotted attribute name of the ``nn.Sequential`` body, if it cannot be found
            automatically (see the user rule in the docs).
        start_method: ``"popen"`` re-runs the script per rank (like ``ddp``); ``"spawn"``/``"fork"``
            start workers from this process (like ``ddp_spawn``) and bring the trained weights and
            predictions back to it. Under ``torchrun`` or a cluster launcher nothing is started.
        process_group_backend: defaults to ``"nccl"`` on CUDA and ``"gloo"`` on CPU.
        timeout: the process-group timeout (default 3 minutes): the longest any rank waits for
            another. A rank that hangs without failing (a deadlock in user code) stops the run
            after this long, with an error naming it; raise it if one rank may legitimately keep
            the others waiting longer (a very slow step, writing a huge consolidated checkpoint).
        data_parallel: pipeline replicas (``w``). ``devices * num_nodes`` must be a multiple of it;
            each replica is a pipeline of ``world_size / w`` stages that reads its own shard of
            the data, and every stage averages its gradients with its replicas before the update.
        state_dict_type: ``"full"`` writes one consolidated Lightning checkpoint, loadable on one
            device (gathered on rank 0); ``"sharded"`` writes a directory in which every rank
            saves its own stage with ``torch.distributed.checkpoint`` under the original
            parameter names, so it reloads with any number of stages.
        recompute: recompute every block's activations in the backward (a bool, or one per
            stage); with ``balance="auto"`` and ``None``, the planner decides.
        memory_plan: what each block does with the activations it saves for the backward,
            ``{block index: "keep" | "recompute" | "swap" | "evict"}`` (blocks not named keep
            theirs): ``"swap"`` moves them to host memory until the backward, ``"evict"`` to the
            partner stage p-1-s (only stages with s < p-1-s have one). See ``docs/memory.md``.
        balance_activations: BPipe: ``True`` makes each early stage hand the balanced share of
            its saved activations to its partner p-1-s; a number is a budget in micro-batches of
            its own saved activations an evicting stage keeps at its peak (the
            ``ActivationBalancer`` callback also takes a budget in bytes).
        repartition_every: vPipe: every this many steps, measure each block's time and move
            whole blocks between stages when the slowest stage is more than
            ``repartition_threshold`` slower than the best split of the measured times
            (``None``: off). Blocks move at a flush point (2BW drains the pipeline first, unless
            ``flush_every`` already did), with their weights, 2BW weight versions and optimizer
            state; the math is unchanged. See ``docs/repartition.md``.
        repartition_threshold: how much slower (0.15: 15%) the slowest stage must be than the
            best split's before blocks move.
    """

    strategy_name = "pipe2bw"

    def __init__(
        self,
        schedule: str = "2bw",
        microbatches: int | None = None,
        flush_every: int | None = None,
        balance: Sequence[int] | BalanceMode | None = None,
        body: str | None = None,
        start_method: _StartMethod = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        state_dict_type: Literal["full", "sharded"] = "full",
        data_parallel: int = 1,
        recompute: bool | Sequence[bool] | None = None,
        memory_plan: Mapping[int, str] | None = None,
        balance_activations: bool | float | None = None,
        repartition_every: int | None = None,
        repartition_threshold: float = 0.15,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if repartition_every is not None and (
            not isinstance(repartition_every, int)
            or isinstance(repartition_every, bool)
            or repartition_every < 1
        ):
            raise ValueError(
                f"repartition_every must be a positive int (steps) or None, got {repartition_every!r}"
            )
        if (
            isinstance(repartition_threshold, bool)
            or not isinstance(repartition_threshold, (int, float))
            or not 0 <= repartition_threshold < 10
        ):
            raise ValueError(
                "repartition_threshold must be a fraction >= 0 such as 0.15 (15% slower), got "
                f"{repartition_threshold!r}"
            )
        self.repartition_every = repartition_every
        self.repartition_threshold = float(repartition_threshold)
        self.repartitions: list[Repartition] = []  # the repartitions of this run, in order
        self._last_check = 0
        self.memory_plan = check_memory_plan(memory_plan) if memory_plan is not None else None
        if isinstance(balance_activations, bool) or balance_activations is None:
            budget = ActivationBudget() if balance_activations else None
        else:
            budget = ActivationBudget(microbatches=balance_activations)
        # BPipe's budget (None: off); the ActivationBalancer callback sets it too
        self.activation_budget: ActivationBudget | None = budget
        if (
            not isinstance(data_parallel, int)
            or isinstance(data_parallel, bool)
            or data_parallel < 1
        ):
            raise ValueError(
                f"data_parallel must be a positive int (pipeline replicas), got {data_parallel!r}"
            )
        if schedule not in SCHEDULES:
            valid = ", ".join(repr(name) for name in SCHEDULES)
            raise ValueError(f"unknown schedule {schedule!r}; valid schedules: {valid}")
        if microbatches is not None and (
            not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1
        ):
            raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
        if isinstance(balance, str) and balance not in BALANCE_MODES:
            modes = ", ".join(repr(m) for m in BALANCE_MODES)
            raise ValueError(
                f"balance={balance!r} is not a balance mode ({modes}) nor a list of block counts "
                "per stage such as [3, 5]"
            )
        if balance is not None and not isinstance(balance, str):
            if isinstance(balance, bytes):
                raise TypeError(
                    f"balance must be a list of block counts per stage, got {balance!r}"
                )
            balance = list(balance)
            if not balance:
                raise ValueError(
                    "balance=[] lists no stage; give one block count per stage, or None for an even split"
                )
            if not all(isinstance(b, int) and not isinstance(b, bool) for b in balance):
                raise TypeError(
                    f"balance must be a list of block counts per stage, got {balance!r}"
                )
            if any(b <= 0 for b in balance):
                raise ValueError(
                    f"every stage needs at least one block, but balance={list(balance)}"
                )
        if flush_every is not None and (
            not isinstance(flush_every, int) or isinstance(flush_every, bool) or flush_every < 1
        ):
            raise ValueError(
                f"flush_every must be a positive int (batches) or None, got {flush_every!r}"
            )
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(
                f"start_method must be 'popen', 'spawn', 'fork' or 'forkserver', got {start_method!r}"
            )
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(
                f"state_dict_type must be 'full' (one consolidated file) or 'sharded' (a directory "
                f"of per-stage files), got {state_dict_type!r}"
            )
        self.state_dict_type = state_dict_type
        self.data_parallel = data_parallel
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.flush_every = flush_every
        # a list of block counts, or a mode resolved at set-up (see _resolve_balance)
        self.balance_mode = balance if isinstance(balance, str) else None
        self.balance = (
            tuple(balance) if balance is not None and not isinstance(balance, str) else None
        )
        if recompute is None or isinstance(recompute, bool):
            self.recompute: bool | tuple[bool, ...] | None = recompute
        else:
            flags = tuple(recompute)
            if not flags or not all(isinstance(f, bool) for f in flags):
                raise TypeError(
                    f"recompute must be a bool or a list of one bool per stage, got {recompute!r}"
                )
            self.recompute = flags
        self.body_name = body
        self._start_method: _StartMethod = start_method
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self.partition: Partition | None = None
        self.engine: PipelineEngine | None = None
        self._schedules: dict[tuple[str, int], Schedule] = {}
        self._grad_stash: list[tuple[nn.Parameter, Tensor | None]] = []
        self.driver: TwoBWDriver | None = None
        self._reports: ReportChannel | None = None  # the last stage's step values, for 2BW
        self._report_group: Any = None
        self.plan: PlanResult | None = None  # what balance="auto" chose (saved in checkpoints)
        self._pipe_group: Any = None  # this replica's pipeline (None: the whole world is one)
        self._offload_groups: dict[tuple[int, int], Any] = {}  # (src rank, dst rank) -> group
        self._offload_stages: frozenset[int] = frozenset()  # the stages that evict, this fit
        self._stage_group: Any = None  # this stage's replicas (None: no data parallelism)

    # ------------------------------------------------------------------ topology
    @property
    def is_distributed(self) -> bool:
        # Lightning injects a DistributedSampler only for data-parallel replicas (with
        # ``distributed_sampler_kwargs``): every stage of one pipeline reads its replica's shard
        return self.data_parallel > 1

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def num_stages(self) -> int:
        return self.world_size // self.data_parallel

    @property
    def replica(self) -> int:
        """This rank's pipeline replica: ranks ``replica * num_stages`` onwards, contiguous, so
        that a pipeline stays inside a node where it fits."""
        return self.global_rank // self.num_stages

    @property
    def stage(self) -> int:
        """This rank's pipeline stage. Global rank 0 runs the *last* stage: the loss is computed
        there, and Lightning's progress bar, loggers and checkpoint writer live on rank 0, so
        they see each step's values the moment they exist, with no message in between."""
        return self.num_stages - 1 - self.global_rank % self.num_stages

    def rank_of_stage(self, stage: int, replica: int | None = None) -> int:
        """The global rank that runs ``stage`` of ``replica`` (default: this rank's)."""
        replica = self.replica if replica is None else replica
        return replica * self.num_stages + self.num_stages - 1 - stage

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of one pipeline reads the same batches: its replica's shard
        return {"num_replicas": self.data_parallel, "rank": self.replica}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make random sampling agree across stages: a ``RandomSampler`` draws from each rank's
        global RNG, which the stages consume differently (dropout), so it is replaced by a
        ``DistributedSampler`` with one replica, seeded with the run's seed."""
        if isinstance(dataloader, DataLoader) and isinstance(dataloader.sampler, RandomSampler):
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
            sampler: DistributedSampler[Any] = DistributedSampler(
                dataloader.dataset,
                num_replicas=1,
                rank=0,
                shuffle=True,
                seed=seed,  # type: ignore[arg-type]
            )
            return _update_dataloader(dataloader, sampler)
        return dataloader

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else self.num_stages

    # ------------------------------------------------------------------ launch and environment
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = PipeSpawnLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        _set_num_threads_if_needed(num_processes=max(self.num_processes, 1))
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(
            self.node_rank * self.num_processes + self.local_rank
        )
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        if self._process_group_backend is None:
            self._process_group_backend = _get_default_process_group_backend_for_device(
                self.root_device
            )
        created = not _distributed_is_initialized()
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout
        )
        if created:
            atexit.register(_destroy_process_group)
        self._check_world()

    def _check_world(self) -> None:
        world, w = self.world_size, self.data_parallel
        if world % w != 0:
            raise ValueError(
                f"data_parallel={w} does not divide the {world} processes (devices x num_nodes); "
                f"use a data_parallel that divides {world}, or {w * max(world // w, 1)} devices"
            )
        if self.balance is not None and len(self.balance) != self.num_stages:
            stages = len(self.balance)
            hint = (
                f"data_parallel={world // stages} ({world // stages} pipelines of {stages} stages) "
                f"or devices={stages * w}"
                if world % stages == 0
                else f"a device count divisible by {stages}"
            )
            raise ValueError(
                f"balance={list(self.balance)} describes {stages} stages but {world} devices with "
                f"data_parallel={w} make pipelines of {self.num_stages} stages; use {hint}"
            )
        if isinstance(self.recompute, tuple) and len(self.recompute) != self.num_stages:
            raise ValueError(
                f"recompute={list(self.recompute)} has {len(self.recompute)} entries but the "
                f"pipeline has {self.num_stages} stages; give one bool per stage, or one bool for all"
            )
        self._make_groups()

    def _make_groups(self) -> None:
        """The 2D mesh: one group per pipeline replica (its stages talk, clip and agree in it) and
        one per stage (its replicas average gradients in it). Collective: every rank creates every
        group, in the same order."""
        w, d = self.data_parallel, self.num_stages
        if w == 1:  # one pipeline: the default group; the report group is made on first use
            return
        for replica in range(w):
            ranks = [replica * d + i for i in range(d)]
            group = dist.new_group(ranks)
            reports = dist.new_group(ranks, backend="gloo") if d > 1 else None
            if replica == self.replica:
                self._pipe_group, self._report_group = group, reports
        for stage in range(d):
            group = dist.new_group([self.rank_of_stage(stage, r) for r in range(w)])
            if stage == self.stage:
                self._stage_group = group

    # ------------------------------------------------------------------ model set-up
    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Build ``configure_model``'s modules on the meta device; setup materialises only the
        blocks this rank owns."""
        with torch.device("meta"):
            yield

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.driver, self._reports = None, None  # a 2BW driver serves one fit
        self._check_trainer(trainer)
        check_same_setup(self._settings(trainer))
        self._build_stage()
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            if self.schedule_name in ("2bw", "pipedream"):
                self._setup_async(trainer)
            self._setup_offload()
            if self.repartition_every is not None:
                self._start_repartition_window()
        self._agree_across_stages()

    def _setup_async(self, trainer: Trainer) -> None:
        """Weight versions and the driver for the schedules without a flush between batches."""
        engine = self.engine
        assert engine is not None
        name = self.schedule_name
        if len(self.optimizers) != 1:
            raise ValueError(
                f"schedule={name!r} keeps versions of one optimizer's weights, but configure_optimizers "
                f"returned {len(self.optimizers)}; use one optimizer (with parameter groups if needed)"
            )
        if name == "pipedream":
            plugin = self.precision_plugin
            if trainer.gradient_clip_val or (isinstance(plugin, MixedPrecision) and plugin.scaler):
                raise ValueError(
                    "schedule='pipedream' applies each stage's update asynchronously, when that "
                    "stage finishes a batch, so no global gradient norm or inf check exists at update "
                    "time; remove gradient_clip_val / 16-mixed, or use schedule='2bw'"
                )
        self._make_driver()
        if self.num_stages > 1:
            if self._report_group is None:  # collective: every rank sets up the same schedule
                self._report_group = dist.new_group(backend="gloo")
            last = self.rank_of_stage(self.num_stages - 1)
            members = [self.rank_of_stage(s) for s in range(self.num_stages)]
            self._reports = ReportChannel(last, self._report_group, members)

    def _make_driver(self) -> None:
        """The weight versions over this stage's parameters, the optimizer that keeps them and
        the driver (again after a repartition)."""
        engine = self.engine
        assert engine is not None
        bound = 2 if self.schedule_name == "2bw" else self.num_stages - self.stage
        versions = WeightVersions(list(engine.body.named_parameters()), max_versions=bound)
        optimizer = TwoBWOptimizer(_torch_optimizer(self.optimizers[0]), versions)
        self.optimizers = [optimizer]
        driver_cls = TwoBWDriver if self.schedule_name == "2bw" else PipeDreamDriver
        self.driver = driver_cls(engine, versions, optimizer, self.num_microbatches)
        self.driver.version_log = self.version_log
        self.driver.offload = self._offload_stages

    def _check_trainer(self, trainer: Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
            raise ValueError(
                "pipe2bw drives forward and backward itself and needs automatic optimization; "
                "remove `self.automatic_optimization = False` from the LightningModule"
            )
        if self.schedule_name == "2bw" and self.num_microbatches < self.num_stages:
            raise ValueError(
                f"schedule='2bw' needs at least as many micro-batches as stages, got "
                f"microbatches={self.num_microbatches} for {self.num_stages} stages; use "
                f"microbatches={self.num_stages} or more"
            )
        if trainer.state.fn == TrainerFn.PREDICTING and self.data_parallel > 1:
            raise ValueError(
                f"trainer.predict with data_parallel={self.data_parallel} would split the data "
                "over the replicas and return only replica 0's predictions; predict with a "
                "strategy of data_parallel=1 (the checkpoint loads with any layout)"
            )
        if self.schedule_name == "pipedream" and self.data_parallel > 1:
            raise ValueError(
                "schedule='pipedream' updates each stage in the middle of the pipeline, with no "
                "point at which replicas could average their gradients; use schedule='2bw' (or a "
                "flush schedule) with data_parallel > 1"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported "
                "by pipe2bw: a batch already accumulates gradients over its micro-batches. Use a "
                f"{trainer.accumulate_grad_batches}x larger batch (and more micro-batches) instead"
            )

    def _settings(self, trainer: Trainer) -> dict[str, object]:
        """What every rank of the pipeline must agree on (see ``check_same_setup``)."""
        return {
            "schedule": self.schedule_name,
            "microbatches": self.num_microbatches,
            "flush_every": self.flush_every,
            "balance": self.balance if self.balance_mode is None else self.balance_mode,
            "recompute": self.recompute,
            "memory_plan": self.memory_plan,
            "activation_budget": self.activation_budget,
            "repartition": (self.repartition_every, self.repartition_threshold),
            "data_parallel": self.data_parallel,
            "body": self.body_name,
            "state_dict_type": self.state_dict_type,
            "precision": trainer.precision,
            "gradient_clip_val": trainer.gradient_clip_val,
            "gradient_clip_algorithm": trainer.gradient_clip_algorithm,
            "lightning_pipe2bw": _package_version(),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
        }

    def _build_stage(self) -> None:
        module = self.lightning_module
        assert module is not None
        ref = find_body(module, self.body_name)
        balance = self._resolve_balance(ref)
        body, self.partition = build_stage(
            module, ref, self.stage, self.num_stages, balance, self.root_device
        )
        recompute = self.plan.best.recompute if self.plan is not None else self.recompute
        body.recompute = recompute[self.stage] if isinstance(recompute, tuple) else bool(recompute)
        self._apply_memory_plan(body)
        log.info(
            "pipe2bw: rank %d runs stage %d/%d with blocks %s of %r",
            self.global_rank, self.stage, self.num_stages, body.indices, ref.path,
        )  # fmt: skip
        self._setup_engine(body)

    def _apply_memory_plan(self, body: StageBody) -> None:
        """Give the stage its blocks' memory policies, after checking the plan against the
        partition (every rank checks the same plan, so every rank raises alike)."""
        plan = self.memory_plan
        if not plan:
            body.policy = {}
            return
        partition = Partition(body.balance)
        check_memory_plan(plan, partition.num_blocks)
        if body.recompute and any(policy != "keep" for policy in plan.values()):
            raise ValueError(
                "recompute=True already recomputes every block of the stage; give either "
                "recompute or a memory_plan (whose 'recompute' entries pick the blocks)"
            )
        p = self.num_stages
        evicting = offload_stages(p)
        for index, policy in sorted(plan.items()):
            stage = partition.stage_of(index)
            if policy == "evict" and stage not in evicting:
                where = f"stages {list(evicting)}" if evicting else "no stage (one stage only)"
                raise ValueError(
                    f"memory_plan[{index}] = 'evict', but block {index} runs on stage {stage} of "
                    f"{p}, which has no partner that stashes less: {where} can evict. Use 'swap' "
                    "or 'recompute' for this block"
                )
        if self.activation_budget is not None and "evict" in plan.values():
            raise ValueError(
                "the activation balancer chooses what to evict itself; give either "
                "balance_activations / ActivationBalancer or 'evict' entries in memory_plan"
            )
        body.policy = {i: plan[i] for i in body.indices if i in plan}

    def _setup_offload(self) -> None:
        """BPipe: decide which stages evict (the same on every rank), make the two-rank groups
        of each pair (collective, once per strategy) and this rank's link to its partner."""
        engine = self.engine
        assert engine is not None
        p, stage = self.num_stages, self.stage
        budget = self.activation_budget
        engine.stash.evictable = False
        evicting: set[int] = set()
        if budget is not None:
            if self.schedule_name == "gpipe" and budget == ActivationBudget():
                raise ValueError(
                    "schedule='gpipe' stashes all m micro-batches on every stage, so the balanced "
                    "share moves nothing; balance activations with '1f1b', '2bw' or 'pipedream', "
                    "or give a budget"
                )
            evicting = set(offload_stages(p))
        elif self.memory_plan:
            partition = Partition(engine.body.balance)
            evicting = {
                partition.stage_of(i) for i, policy in self.memory_plan.items() if policy == "evict"
            }
        self._offload_stages = frozenset(evicting)
        if self.driver is not None:
            self.driver.offload = self._offload_stages
        self._schedules.clear()
        if not evicting:
            return
        for replica in range(self.data_parallel):
            for s in sorted(evicting):
                a, b = self.rank_of_stage(s, replica), self.rank_of_stage(p - 1 - s, replica)
                for pair in ((a, b), (b, a)):
                    if pair not in self._offload_groups:  # collective: all ranks, same order
                        self._offload_groups[pair] = dist.new_group(sorted(pair))
        partner = p - 1 - stage
        if stage not in evicting and partner not in evicting:
            return
        me, other = self.global_rank, self.rank_of_stage(partner)
        timeout = self._timeout.total_seconds() if self._timeout is not None else 1800.0
        engine.link = PeerLink(
            other,
            partner,
            self._offload_groups[(me, other)],
            self._offload_groups[(other, me)],
            self.root_device,
            holder=stage not in evicting,
            timeout_s=timeout,
        )
        if stage in evicting:
            engine.stash.evictable = budget is not None
            if budget is not None:
                m = self.num_microbatches
                mine = stashed_microbatches(self.schedule_name, stage, p, m)
                theirs = stashed_microbatches(self.schedule_name, partner, p, m)
                stash = engine.stash
                engine.evict_share = lambda i: evict_share(
                    budget, mine, theirs, stash.saved_bytes(i)
                )
        log.info(
            "pipe2bw: rank %d (stage %d) offloads activations with stage %d (rank %d)",
            me, stage, partner, other,
        )  # fmt: skip

    def _close_offload(self) -> None:
        engine = self.engine
        if engine is not None and engine.link is not None:
            engine.link.close()
            engine.link = None

    def _resolve_balance(self, ref: BodyRef) -> Sequence[int] | None:
        """The blocks per stage: the user's list, an even split (``None``/``"uniform"``), or one
        evening out the blocks' parameter counts (``"params"``). The same on every rank."""
        mode = self.balance_mode
        if mode is None:
            return self.balance
        if isinstance(ref.module, StageBody):  # partitioned by an earlier trainer call
            return ref.module.balance
        if mode == "uniform":
            return None
        blocks = list(ref.module.children())
        module = self.lightning_module
        assert module is not None
        if mode == "auto" and module.trainer.state.fn == TrainerFn.FITTING:
            return self._plan_auto(module, ref)
        # "params", or "auto" outside fit (no training batch to profile with)
        return balance_by_params(blocks, self.num_stages)

    def _plan_auto(self, module: LightningModule, ref: BodyRef) -> Sequence[int]:
        """Profile, plan and apply the plan: partition, micro-batches (unless given) and
        recomputation (unless given). Every rank gets rank 0's profile, so every rank applies the
        same plan; it is logged on rank 0 and saved in checkpoints (``strategy.plan``)."""
        loader = module.trainer.fit_loop._data_source.dataloader()
        if not isinstance(loader, DataLoader):
            raise ValueError(
                "balance='auto' profiles the body with the first batch of the training "
                f"DataLoader, but train_dataloader() returned a {type(loader).__name__}; give "
                "balance as a list of block counts or 'params'"
            )
        batch = next(iter(loader))
        inputs = AutoPlanInputs(
            self.schedule_name,
            self.data_parallel,
            self.microbatches,
            self.recompute,
            self.root_device,
            self.world_size,
            self.num_processes,
        )
        result = auto_plan(module, ref, batch, inputs)
        best = result.best
        self.plan = result
        self.microbatches = best.num_microbatches
        if self.global_rank == 0:
            log.info("pipe2bw: balance='auto' planned\n%s", result.explain())
            rank_zero_info(f"pipe2bw: balance='auto' chose {best.summary()}")
        return best.balance

    def _setup_engine(self, body: StageBody) -> None:
        stage = self.stage
        transport = P2PTransport(None, self.root_device)  # the whole world is one pipeline
        self.engine = PipelineEngine(
            body,
            stage=stage,
            num_stages=self.num_stages,
            transport=transport,
            prev_rank=self.rank_of_stage(stage - 1) if stage > 0 else None,
            next_rank=self.rank_of_stage(stage + 1) if stage < self.num_stages - 1 else None,
        )
        if self._timeout is not None:
            self.engine.wait_limits = wait_limits(
                stage, self.num_stages, self._timeout.total_seconds()
            )

    def _schedule(self, train: bool, num_microbatches: int) -> Schedule:
        key = (self.schedule_name if train else "forward", num_microbatches)
        if key not in self._schedules:
            if train:
                sched = get_schedule(self.schedule_name, self.num_stages, num_microbatches)
            else:
                sched = forward_only(self.num_stages, num_microbatches)
            with_comm = add_communication(sched)
            if train and self._offload_stages:
                with_comm = add_offload_schedule(with_comm, self._offload_stages)
            self._schedules[key] = with_comm
        return self._schedules[key]

    # ------------------------------------------------------------------ steps
    def _run_pipelined(
        self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any], train: bool
    ) -> Any:
        module = self.lightning_module
        engine = self.engine
        assert module is not None and engine is not None
        batch, rest = args[0], args[1:]
        size = batch_size_of(batch)
        m = min(self.num_microbatches, size) if not train else self.num_microbatches
        microbatches, sizes = split_batch(batch, m)
        weights = [k / size for k in sizes]
        fn = getattr(module, hook)
        recorder = LogRecorder(module, active=engine.is_last)

        def step(mb: Any) -> Any:
            recorder.begin_microbatch(batch_size_of(mb))
            return fn(mb, *rest, **kwargs)

        with recorder:
            if train and self.driver is not None:
                results = self.driver.train_batch(
                    microbatches, weights, step, self._backward_microbatch
                )
            else:
                results = engine.run(
                    self._schedule(train, m),
                    microbatches,
                    step,
                    train=train,
                    loss_weights=weights,
                    backward=self._backward_microbatch,
                )
        payload: dict[str, Any] = {}
        if engine.is_last:
            payload["logs"] = recorder.summary()
            if train:
                payload["loss"] = math.fsum(
                    w * float(step_loss(r, i).detach())
                    for i, (w, r) in enumerate(zip(weights, results, strict=True))
                )
            else:
                payload["output"] = apply_to_collection(
                    merge_outputs(results, sizes), Tensor, lambda t: t.detach().cpu()
                )
        if train and self.driver is not None:
            report = self._report_late(payload)
            if report is None:  # the first step of a fit, on a rank other than 0
                return torch.tensor(math.nan, device=self.root_device)
            payload = report
        else:
            payload = self._from_last_stage(payload)
        replay(module.log, payload["logs"], self.root_device)  # the recorder is gone: real log
        if train:
            return torch.tensor(payload["loss"], device=self.root_device)
        return apply_to_collection(payload["output"], Tensor, lambda t: t.to(self.root_device))

    def _report_late(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        """The logged values of a 2BW / PipeDream step, without a barrier.

        Without a flush, the other stages finish call t before the last stage has batch t's loss
        (their call ends with the first forwards of batch t+1); waiting for it would put the
        pipeline bubble back into every step. So the last stage (global rank 0: the progress bar
        and the loggers) logs batch t's own values in call t, and posts them to the other ranks,
        which log them one call late, in call t+1, when they have long arrived. Returns what this
        rank logs now: ``None`` on a rank other than 0 before the first report is owed.
        """
        channel = self._reports
        if channel is None:  # one stage
            return payload
        if channel.is_source:
            channel.post(payload)
            return payload
        report = channel.receive() if channel.backlog else None  # batch t-1's values
        channel.expect()  # batch t's, posted by the last stage during this call
        return report  # type: ignore[no-any-return]

    def _from_last_stage(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self.num_stages == 1:
            return payload
        box = [payload]
        dist.broadcast_object_list(
            box, src=self.rank_of_stage(self.num_stages - 1), group=self._pipe_group
        )
        return box[0]  # type: ignore[no-any-return]

    def _backward_microbatch(self, loss: Tensor) -> None:
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            loss = plugin.scaler.scale(loss)
        module = self.lightning_module
        assert module is not None
        plugin.backward(loss, module, None)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        # Lightning's closure runs training_step, then zero_grad, then backward; the engine runs
        # the backwards inside the step, so the gradients are set aside here and put back in
        # `backward`, and zero_grad (with its hooks) acts on nothing in between.
        module = self.lightning_module
        assert module is not None
        for p in module.parameters():
            p.grad = None
        with self.precision_plugin.train_step_context():
            loss = self._run_pipelined("training_step", args, kwargs, train=True)
        driver = self.driver
        if driver is None:  # flush schedule: this batch's gradient is in .grad
            self._grad_stash = [(p, p.grad) for p in module.parameters()]
            for p in module.parameters():
                p.grad = None
        else:  # 2BW: the gradient of the previous batch is due now, if any
            self._stash_due_gradient(driver, driver.due_batch())
        return loss  # type: ignore[no-any-return]

    def _stash_due_gradient(self, driver: TwoBWDriver, batch: int | None) -> None:
        optimizer = driver.optimizer
        optimizer.due = batch
        if batch is None:
            self._grad_stash = []
            return
        grads = driver.take_gradient(batch)
        self._grad_stash = list(zip(driver.versions.params, grads, strict=True))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.val_step_context():
            return self._run_pipelined("validation_step", args, kwargs, train=False)  # type: ignore[no-any-return]

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.test_step_context():
            return self._run_pipelined("test_step", args, kwargs, train=False)  # type: ignore[no-any-return]

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._run_pipelined("predict_step", args, kwargs, train=False)

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """The engine already ran every micro-batch's backward; only the hooks are left to call."""
        module = self.lightning_module
        assert module is not None
        for p, grad in self._grad_stash:
            p.grad = grad
        self._grad_stash = []
        self._average_over_replicas([p for p in module.parameters() if p.grad is not None])
        trainer = module.trainer
        call._call_callback_hooks(trainer, "on_before_backward", closure_loss)
        call._call_lightning_module_hook(trainer, "on_before_backward", closure_loss)
        call._call_callback_hooks(trainer, "on_after_backward")
        call._call_lightning_module_hook(trainer, "on_after_backward")
        return closure_loss

    def _average_over_replicas(self, params: list[nn.Parameter]) -> None:
        """Average this stage's gradients with its replicas (data parallel x pipeline): one
        all-reduce over the stage's group, on a flat buffer, just before the update. Every replica
        holds the same parameters with gradients, so the buffers line up."""
        group = self._stage_group
        if group is None or not params:
            return
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            assert p.grad is not None
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            flat /= self.data_parallel
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _agree_across_stages(self) -> None:
        group = self._pipe_group  # clipping and inf checks span one pipeline
        make_clipping_global(self.precision_plugin, self.root_device, group, self.num_stages)
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            agree_on_inf_checks(plugin.scaler, self.root_device, group, self.num_stages)

    # ------------------------------------------------------------------ 2BW flush points
    def flush(self) -> None:
        """Drain a 2BW pipeline and apply the last batch's update (collective: every rank calls it
        at the same point of Lightning's loop). A no-op for flush schedules or an empty pipeline."""
        driver = self.driver
        if driver is None:
            return
        module = self.lightning_module
        assert module is not None
        batch = driver.flush(self._backward_microbatch)
        if batch is None:
            return
        optimizer = driver.optimizer
        for p, grad in zip(driver.versions.params, driver.take_gradient(batch), strict=True):
            p.grad = grad
        self._average_over_replicas([p for p in driver.versions.params if p.grad is not None])
        optimizer.due = batch
        # Lightning's own step path: loss-scaler unscale and (agreed) inf check, the
        # on_before_optimizer_step hooks, clipping over all stages, then the update
        done = torch.zeros((), device=self.root_device)
        self.precision_plugin.optimizer_step(optimizer, model=module, closure=lambda: done)
        optimizer.finish_step()
        for p in driver.versions.params:
            p.grad = None
        log.debug("pipe2bw: flushed after batch %d", batch)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        driver = self.driver
        if driver is not None:
            driver.optimizer.finish_step()
            if self.flush_every and driver.admitted % self.flush_every == 0:
                self.flush()
        return output

    # set to a list before fit to record the weight versions alive after every action (tests)
    version_log: list[int] | None = None

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        every = self.repartition_every
        module = self.lightning_module
        if every is None or module is None:
            return
        step = module.trainer.global_step
        if step == 0 or step % every or step == self._last_check:
            return
        self._last_check = step
        self._check_balance(step)

    def _start_repartition_window(self) -> None:
        engine = self.engine
        assert engine is not None
        engine.body.timing = True
        engine.body.take_block_times()
        engine.stats.forward_s = engine.stats.backward_s = 0.0

    def _check_balance(self, step: int) -> None:
        """Gather every stage's measured times (collective), and move blocks if the slowest
        stage is over the threshold (every rank decides alike from the same figures)."""
        engine = self.engine
        assert engine is not None and self.partition is not None
        stats = engine.stats
        mine = StageTiming(
            self.stage, engine.body.take_block_times(), stats.forward_s, stats.backward_s
        )
        stats.forward_s = stats.backward_s = 0.0
        everyone: list[Any] = [mine]
        if self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, mine)
        decision = plan_repartition(everyone, self.partition.balance, self.repartition_threshold)
        log.debug("pipe2bw: balance check at step %d: %s", step, decision.describe())
        if not decision.needed:
            return
        self.flush()  # 2BW: drain first (a no-op after a flush, and for flush schedules)
        if self.global_rank == 0:
            rank_zero_info(f"pipe2bw: repartition at step {step}: {decision.describe()}")
        self._migrate(decision.best)
        self.repartitions.append(decision)

    def _migrate(self, balance: Sequence[int], carry_state: bool = True) -> None:
        """Move whole blocks so that the pipeline runs ``balance`` (collective over every rank;
        nothing may be in flight). Each moving block travels from its old stage's rank to its
        new one in each replica, with its optimizer state (by parameter name, so Adam's moments
        and step counts follow it) and, under 2BW, its second weight version; the optimizers are
        then rebuilt by ``configure_optimizers`` over the new blocks and given back their state,
        param-group values and schedulers. ``carry_state=False`` moves the blocks only (before
        a checkpoint's state is loaded into them)."""
        engine, module = self.engine, self.lightning_module
        assert engine is not None and module is not None and self.partition is not None
        body = engine.body
        trainer = module.trainer
        old, new = (
            self.partition,
            make_partition(self.partition.num_blocks, self.num_stages, balance),
        )
        path = next(name for name, m in module.named_modules() if m is body)
        driver = self.driver
        if driver is not None and driver.admitted != driver.segment_start:
            raise RuntimeError("blocks can only move at a flush point, with nothing in flight")
        carry = carry_state and bool(self.optimizers)
        flat: list[dict[str, Any]] = []
        previous: dict[str, Tensor] = {}
        schedulers: list[Any] = []
        if carry:
            flat = [optimizer_state_by_name(module, _torch_optimizer(o)) for o in self.optimizers]
            schedulers = [config.scheduler.state_dict() for config in self.lr_scheduler_configs]
            if driver is not None:
                kept = driver.previous_version()
                if kept is not None:
                    names = self._parameter_names(driver)
                    previous = dict(zip(names, kept, strict=True))
        moves = old.moves_to(new)
        self._check_movable(body, [b for b, src, _ in moves if src == self.stage])
        for block, src, dst in moves:
            prefix = f"{path}.{block}."
            if self.stage == src:
                leaving = body._modules.pop(str(block))
                assert leaving is not None
                payload = {
                    "module": leaving.to("cpu"),
                    # on the CPU: a pickled CUDA tensor would land on the sender's device index
                    "optimizer": to_cpu(
                        [
                            {k: v for k, v in part.items() if _names_param(k, prefix)}
                            for part in flat
                        ]
                    ),
                    "previous": to_cpu({k: v for k, v in previous.items() if k.startswith(prefix)}),
                }
                dist.send_object_list([payload], dst=self.rank_of_stage(dst))
            elif self.stage == dst:
                got: list[Any] = [None]
                dist.recv_object_list(got, src=self.rank_of_stage(src))
                payload = got[0]
                body.add_module(str(block), payload["module"].to(self.root_device))
                for part, extra in zip(flat, payload["optimizer"], strict=True):
                    part.update(extra)
                previous.update({k: v.to(self.root_device) for k, v in payload["previous"].items()})
            if self.global_rank == 0 or self.stage in (src, dst):
                log.info(
                    "pipe2bw: rank %d: block %d moves from stage %d to stage %d",
                    self.global_rank, block, src, dst,
                )  # fmt: skip
        body._modules = OrderedDict(sorted(body._modules.items(), key=lambda kv: int(kv[0])))
        body.indices = sorted(int(k) for k in body._modules)
        body.balance = new.balance
        self.partition = new
        self._apply_memory_plan(body)
        if trainer.state.fn != TrainerFn.FITTING or not self.optimizers:
            return
        self.setup_optimizers(trainer)
        _optimizers_to_device(self.optimizers, self.root_device)
        for optimizer, state in zip(self.optimizers, flat, strict=False):  # none if not carry
            mine = {
                k: v
                for k, v in state.items()
                if any(_names_param(k, f"{path}.{b}.") for b in body.indices)
            }
            load_optimizer_state_by_name(module, _torch_optimizer(optimizer), mine)
        for config, state in zip(self.lr_scheduler_configs, schedulers, strict=False):
            config.scheduler.load_state_dict(state)
        if driver is not None:
            admitted = driver.admitted
            self._make_driver()
            assert self.driver is not None
            names = self._parameter_names(self.driver)
            kept_list = [previous[n] for n in names] if previous else None
            self.driver.resume(admitted, kept_list)

    def _check_movable(self, body: StageBody, blocks: list[int]) -> None:
        """Every rank raises the same error, before anything moves, if a block that must move
        cannot be pickled (a hook or attribute holding something that cannot travel)."""
        problems = []
        for block in blocks:
            try:
                pickle.dumps(body._modules[str(block)])
            except Exception as err:
                problems.append(f"block {block}: {type(err).__name__}: {err}")
        everyone: list[Any] = [problems]
        if self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, problems)
        found = [p for part in everyone for p in part]
        if found:
            raise ValueError(
                "cannot move blocks between stages: a block travels pickled (module, weights and "
                f"all), and {'; '.join(found)}. Keep hooks and references to the LightningModule "
                "out of the blocks, or turn repartition_every off"
            )

    @override
    def on_validation_start(self) -> None:
        self.flush()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell the neighbour stages, so that they stop now with an error naming this failure
        instead of waiting for a message until the process-group timeout (see
        ``lightning_pipe2bw.runtime.failure``)."""
        engine = self.engine
        if engine is None or self.num_stages == 1 or not _distributed_is_initialized():
            return
        if isinstance(exception, StageFailure):  # pass the first failure on, away from its source
            record, source = exception.record, exception.source
            _say(f"pipe2bw: rank {self.global_rank} (stage {self.stage}) stops: {exception}")
        else:
            where = action_of(exception) or "code outside the pipeline schedule"
            error = f"{type(exception).__name__}: {exception}"
            record, source = FailureRecord(self.global_rank, self.stage, where, error), None
            # print it now: once the neighbours stop, a launcher may kill this process (the
            # popen launcher's observer kills rank 0 when a worker exits with an error)
            _say(f"pipe2bw: {record.describe()}\n" + "".join(traceback.format_exception(exception)))
        peers = [r for r in (engine.prev_rank, engine.next_rank) if r is not None and r != source]
        if engine.link is not None and engine.link.partner != source:
            engine.link.fail(record)  # the partner may be waiting for activations
        try:
            engine.transport.notify(record, peers)
        except Exception as err:  # a neighbour that is gone already; the failure stands
            log.debug("pipe2bw: could not send the failure notice: %s", err)
        self._stop_workers()

    # how long the launching process lets its workers stop on their own after a failure
    worker_grace_s = 15.0

    def _stop_workers(self) -> None:
        """In the launching process of a ``popen`` run, wait for the workers it started to stop
        (the failure notice stops them within seconds), then kill those that have not: a worker
        that hangs would otherwise outlive the run. ``torchrun`` and the spawn launchers do the
        same for their own workers."""
        launcher = self._launcher
        if not isinstance(launcher, _SubprocessScriptLauncher) or self.global_rank != 0:
            return
        deadline = time.monotonic() + self.worker_grace_s
        for proc in launcher.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                _say(
                    f"pipe2bw: killing worker process {proc.pid}, which did not stop within "
                    f"{self.worker_grace_s:.0f} s of the failure"
                )
                proc.kill()
                proc.wait()

    @override
    def on_train_end(self) -> None:
        self.flush()
        if self._reports is not None:
            self._reports.drain()  # the last step's values, owed to the other ranks
        self._close_offload()

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Global rank 0's decision, on every rank.

        Callbacks such as ``EarlyStopping`` and ``ModelCheckpoint`` decide from logged metrics.
        Every stage sees the same data, and rank 0 (the last stage) holds the metrics as a
        single-device run logs them; with 2BW the other ranks receive the training-step values one
        step late, so their own decisions could differ. Rank 0's decision is the single-device one.
        """
        if not _distributed_is_initialized():
            return decision
        flag = torch.tensor(int(bool(decision)), device=self.root_device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def full_state_dict(self) -> dict[str, Any]:
        """The unpartitioned model's state dict on global rank 0 (collective; ``{}`` elsewhere)."""
        module = self.lightning_module
        assert module is not None
        return gather_state_dict(module, self.global_rank, self.world_size)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.flush()  # a checkpoint is a flush point: no micro-batch in flight, no update pending
        if self.state_dict_type == "sharded":
            module = self.lightning_module
            assert module is not None
            return module.state_dict()  # this stage's share, under the original names
        return self.full_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.partition is not None
        if self.state_dict_type == "sharded":
            module = self.lightning_module
            assert module is not None
            return stage_optimizer_state(module, _torch_optimizer(optimizer))
        opt = getattr(optimizer, "_optimizer", optimizer)
        return gather_optimizer_state(
            opt, self.stage, self.num_stages, self.partition.balance, self._pipe_group
        )

    def _pipeline_state(self, consolidate: bool = True) -> dict[str, Any]:
        """What a checkpoint needs beyond Lightning's own keys: the layout, and for 2BW the batch
        count and the second weight version by parameter name (consolidated on rank 0, a
        collective, unless ``consolidate`` is False), so that a resumed run continues the
        version rule exactly."""
        assert self.partition is not None
        state: dict[str, Any] = {
            "schedule": self.schedule_name,
            "num_stages": self.num_stages,
            "balance": list(self.partition.balance),
            "data_parallel": self.data_parallel,
        }
        if self.plan is not None:  # JSON-ready: loads with weights_only=True
            state["plan"] = self.plan.best.to_dict()
        driver = self.driver
        if driver is None:
            return state
        previous = driver.previous_version()
        names = self._parameter_names(driver)
        local = dict(zip(names, previous, strict=True)) if previous is not None else {}
        state["batches"] = driver.admitted
        if consolidate:
            local = gather_named(local, self.global_rank, self.world_size)
        state["previous_weights"] = local
        return state

    def _parameter_names(self, driver: TwoBWDriver) -> list[str]:
        """The LightningModule's names of the parameters the driver's weight versions hold."""
        module = self.lightning_module
        assert module is not None
        name_of = {id(p): name for name, p in module.named_parameters()}
        return [name_of[id(p)] for p in driver.versions.params]

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if self.state_dict_type == "sharded":
            self._save_sharded(checkpoint, filepath)
            return
        if "optimizer_states" in checkpoint:  # a full checkpoint, to resume from
            checkpoint = {**checkpoint, "pipe2bw": self._pipeline_state()}
        path = str(filepath)
        if "://" in path:  # a remote file system: its own write semantics
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        # write to a temporary name, then rename: a crash mid-write leaves no file that looks
        # complete under the checkpoint's name
        tmp = f"{path}.tmp"
        super().save_checkpoint(checkpoint, tmp, storage_options)
        if self.is_global_zero:
            os.replace(tmp, path)

    def _save_sharded(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """Every rank writes its own tensors (DCP), under the original model's names; rank 0
        writes the rest of Lightning's checkpoint to ``meta.pt``."""
        meta = dict(checkpoint)
        tensors: dict[str, Any] = {"state_dict": meta.pop("state_dict")}
        pipeline = self._pipeline_state(consolidate=False)
        pipeline["format"] = "sharded"
        if "optimizer_states" in meta:
            states = meta.pop("optimizer_states")
            tensors["optimizer_states"] = {str(i): s for i, s in enumerate(states)}
            pipeline["num_optimizers"] = len(states)
        previous = pipeline.pop("previous_weights", {})
        # whether any stage holds a second version (all do, or none)
        pipeline["has_previous"] = bool(previous)
        if previous:
            tensors["previous_weights"] = previous
        meta["pipe2bw"] = pipeline
        save_sharded(filepath, tensors, meta, self.global_rank)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Lightning's loader, with ``weights_only=True`` unless the caller chose: a pipe2bw
        checkpoint holds tensors and plain containers only. A checkpoint that needs arbitrary
        unpickling (e.g. custom hyper-parameter objects) is loaded with ``weights_only=False``
        after a warning; pass ``weights_only=False`` to ``fit`` to skip the first attempt."""
        if is_sharded_checkpoint(checkpoint_path):
            return self._load_sharded(checkpoint_path, weights_only is not False)
        if weights_only is not None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        try:
            return super().load_checkpoint(checkpoint_path, weights_only=True)
        except pickle.UnpicklingError as err:
            rank_zero_warn(
                f"{checkpoint_path} cannot be loaded with weights_only=True ({err}); loading it "
                "with weights_only=False, which runs arbitrary code from the file: only do this "
                "with files you trust"
            )
            return super().load_checkpoint(checkpoint_path, weights_only=False)

    def _load_sharded(self, path: Any, weights_only: bool) -> dict[str, Any]:
        """Read this stage's share of a sharded checkpoint, whatever partition wrote it
        (collective): the tensors are found by name."""
        module = self.lightning_module
        assert module is not None
        meta = read_sharded_meta(path, weights_only)
        pipeline = dict(meta.get("pipe2bw", {}))
        self._adopt_layout(pipeline)
        template: dict[str, Any] = {"state_dict": module.state_dict()}
        restoring_optimizers = self.optimizers and pipeline.get("num_optimizers")
        if restoring_optimizers:
            if pipeline["num_optimizers"] != len(self.optimizers):
                raise ValueError(
                    f"{path} holds the state of {pipeline['num_optimizers']} optimizers, but "
                    f"configure_optimizers returned {len(self.optimizers)}"
                )
            template["optimizer_states"] = {
                str(i): stage_optimizer_state(module, _torch_optimizer(opt))
                for i, opt in enumerate(self.optimizers)
            }
        driver = self.driver
        if driver is not None and pipeline.get("has_previous"):
            names = self._parameter_names(driver)
            template["previous_weights"] = {
                name: torch.empty_like(p)
                for name, p in zip(names, driver.versions.params, strict=True)
            }
        load_sharded(path, template)
        checkpoint = {**meta, "state_dict": template["state_dict"]}
        if restoring_optimizers:
            states = template["optimizer_states"]
            checkpoint["optimizer_states"] = [states[str(i)] for i in range(len(states))]
        pipeline["previous_weights"] = template.get("previous_weights", {})
        checkpoint["pipe2bw"] = pipeline
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        if checkpoint.get("pipe2bw", {}).get("format") != "sharded":  # sharded: adopted on read
            self._adopt_layout(checkpoint.get("pipe2bw"))
        load_stage_state_dict(module, checkpoint["state_dict"], strict)
        self._resume_pipeline(checkpoint.get("pipe2bw"))

    def _adopt_layout(self, state: Mapping[str, Any] | None) -> None:
        """Run the blocks-per-stage layout a checkpoint was written with (after a live
        repartition it differs from the one set up), unless the user fixed a ``balance``
        (collective: every rank reads the same checkpoint)."""
        if not state or "balance" not in state or self.partition is None or self.balance:
            return
        saved = tuple(int(b) for b in state["balance"])
        if len(saved) != self.num_stages or saved == tuple(self.partition.balance):
            return
        if sum(saved) != self.partition.num_blocks:
            return  # another model: loading its state names what does not match
        rank_zero_info(
            f"pipe2bw: the checkpoint was written with balance={list(saved)}; moving blocks from "
            f"{list(self.partition.balance)} to it"
        )
        self._migrate(saved, carry_state=False)

    def _resume_pipeline(self, state: Mapping[str, Any] | None) -> None:
        """Continue the 2BW version rule where the checkpoint left it. A checkpoint without it
        (written by a flush schedule, or not by pipe2bw) restarts the rule at the loaded
        weights, as at the start of training: W(-1) = W(0)."""
        driver = self.driver
        if driver is None or state is None or "batches" not in state:
            return
        batches = int(state["batches"])
        previous: list[Tensor] | None = None
        saved = state.get("previous_weights") or {}
        if saved:
            names = self._parameter_names(driver)
            missing = [n for n in names if n not in saved]
            if missing:
                raise KeyError(
                    f"the checkpoint's second 2BW weight version lacks {len(missing)} parameters "
                    f"this stage needs, e.g. {missing[:5]}; was it written for a different model?"
                )
            previous = [saved[n] for n in names]
        driver.resume(batches, previous)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.partition is not None
        module = self.lightning_module
        assert module is not None
        sharded = checkpoint.get("pipe2bw", {}).get("format") == "sharded"
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            if sharded:
                load_stage_optimizer_state_by_name(module, _torch_optimizer(optimizer), state)
            else:
                load_stage_optimizer_state(optimizer, state, self.stage, self.partition.balance)

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries: list[tuple[str, str, dict[str, Any]]] = [
            ("pipe2bw", "pipeline parallelism (default schedule)", {}),
            ("pipe2bw_spawn", "pipeline parallelism, spawned workers", {"start_method": "spawn"}),
        ]
        for name in SCHEDULES:
            entries.append(
                (f"pipe_{name}", f"pipeline parallelism, schedule {name!r}", {"schedule": name})
            )
        for name, description, init in entries:
            strategy_registry.register(name, cls, description=description, override=True, **init)


def _names_param(key: str, prefix: str) -> bool:
    """Whether a flattened optimizer-state key (``state.<name>.<key>`` or
    ``param_groups.<name>.<key>``) belongs to a parameter whose name starts with ``prefix``."""
    for head in ("state.", "param_groups."):
        if key.startswith(head):
            return key[len(head) :].startswith(prefix)
    return False


def _package_version() -> str:
    try:
        return importlib.metadata.version("lightning-pipe2bw")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing
        return "unknown"


def _torch_optimizer(optimizer: Any) -> Optimizer:
    """The user's optimizer inside Lightning's and the 2BW wrappers."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    while isinstance(optimizer, TwoBWOptimizer):
        optimizer = optimizer.optimizer
    return optimizer  # type: ignore[no-any-return]


def _destroy_process_group() -> None:
    """Tear down a process group this strategy created while the interpreter is still intact
    (gloo's threads torn down during interpreter shutdown can abort the process)."""
    if _distributed_is_initialized():
        dist.destroy_process_group()
