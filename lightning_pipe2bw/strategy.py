"""The Lightning seam: ``Pipe2BWStrategy`` turns Lightning's hooks into calls on one pipeline stage.

This module is wiring. What it delegates to knows nothing of Lightning (``docs/design.md``):
the options and their checks (``pipeline.options``, ``pipeline.checks``), the process mesh
(``pipeline.topology``, ``pipeline.groups``), the stage's runtime (``pipeline.assembly``: body,
engine, driver, stash, BPipe link), the checkpoint format (``checkpoint.format``), block
migration (``repartition.migrate``) and the rest of ``runtime/``, ``schedule/`` and ``partition/``.
The Lightning side of each idea lives with the idea: a Trainer call's steps
(``steps.pipelined``), a step's values on every rank (``steps.delivery``), a lost rank named and
workers stopped (``failures.hooks``), the checkpoint hooks' barrier, write and load
(``checkpoint.hooks``), ``balance="auto"`` (``planner.hooks``), blocks moved under Lightning
(``repartition.hooks``); the rest in ``seam/``: the default process group (``process_group``),
what the stages agree on (``agreement``). Lightning's private API is
reached through ``compat`` only.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics import Metric
from typing_extensions import override

from lightning_pipe2bw import compat
from lightning_pipe2bw.callbacks.summary import use_pipeline_summary
from lightning_pipe2bw.callbacks.view import PipelineView
from lightning_pipe2bw.checkpoint.format import CheckpointFormat
from lightning_pipe2bw.checkpoint.hooks import checkpoint_barrier, load_trusting, write_replacing
from lightning_pipe2bw.checkpoint.storage import gather_state_dict, is_sharded_checkpoint
from lightning_pipe2bw.failures.hooks import lost_rank, names_lost_ranks, stop_workers_after
from lightning_pipe2bw.failures.peers import PeerDirectory
from lightning_pipe2bw.failures.record import StageFailure
from lightning_pipe2bw.failures.signals import SignalGuard
from lightning_pipe2bw.partition import Partition, find_body
from lightning_pipe2bw.partition.balance import Split
from lightning_pipe2bw.partition.hf import refuse_layer_skipping
from lightning_pipe2bw.pipeline.assembly import build_runtime, place_stage, resolve_split
from lightning_pipe2bw.pipeline.checks import one_stage_note, run_problems
from lightning_pipe2bw.pipeline.groups import ProcessGroups, choose_backend, forget_process_groups
from lightning_pipe2bw.pipeline.intake import step_call
from lightning_pipe2bw.pipeline.optiondocs import docstring
from lightning_pipe2bw.pipeline.options import (
    DEFAULT_SCHEDULE,
    DEFAULT_TIMEOUT,
    OPTION_NAMES,
    BalanceMode,
    PipeOptions,
    StartMethod,
    raise_problems,
)
from lightning_pipe2bw.pipeline.stage_runtime import StageRuntime
from lightning_pipe2bw.pipeline.topology import Topology
from lightning_pipe2bw.planner.autoplan import PlanCheck
from lightning_pipe2bw.planner.hooks import check_plan, finish_plan_check, plan_auto
from lightning_pipe2bw.planner.plans import PlanResult
from lightning_pipe2bw.repartition.hooks import checkpoint_layout, move_blocks, repartition_at
from lightning_pipe2bw.repartition.migrate import hand_back
from lightning_pipe2bw.repartition.plan import Repartition, Repartitioner
from lightning_pipe2bw.runtime import PipelineEngine, StageBody
from lightning_pipe2bw.runtime.driver import Driver
from lightning_pipe2bw.schedule import REGISTRY, ActivationBudget
from lightning_pipe2bw.seam.agreement import agree_across_stages, check_same_setup, setup_settings
from lightning_pipe2bw.seam.averaging import average_stage, check_averaging, whole_averages
from lightning_pipe2bw.seam.hooklogs import stage_logs
from lightning_pipe2bw.seam.launcher import PipePopenLauncher, PipeSpawnLauncher, kill_workers
from lightning_pipe2bw.seam.loaders import batch_fingerprint, last_batch_problem, seed_sampler
from lightning_pipe2bw.seam.process_group import (
    broadcast_object,
    connect,
    control_group,
    is_initialized,
    rank_zero_decision,
)
from lightning_pipe2bw.seam.requeue import RequeueRelay
from lightning_pipe2bw.steps.delivery import StepDelivery
from lightning_pipe2bw.steps.log import quiet_epoch_sync_advice, share_metrics
from lightning_pipe2bw.steps.pipelined import PipelinedSteps, scaler_of

__all__ = ["Pipe2BWStrategy"]


class Pipe2BWStrategy(ParallelStrategy):
    # the Args are the options' own text (pipeline/optiontable.py), written there once
    __doc__ = docstring(
        "Pipeline-parallel training: one stage of the model's body per process.",
        "The options are checked at once (:class:`~lightning_pipe2bw.pipeline.options.PipeOptions`, "
        "every problem in one error); :meth:`from_options` takes them already built.",
    )

    strategy_name = "pipe2bw"
    # set to a list before fit to record the weight versions alive after every action (tests)
    version_log: list[int] | None = None
    # how long the launching process lets its workers stop on their own after a failure
    worker_grace_s = 15.0

    def __init__(
        self,
        schedule: str = DEFAULT_SCHEDULE,
        microbatches: int | None = None,
        flush_every: int | None = None,
        balance: Sequence[int] | BalanceMode | None = None,
        body: str | None = None,
        start_method: StartMethod = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        state_dict_type: Literal["full", "sharded"] = "full",
        loss_normalization: Literal["batch", "microbatch"] = "batch",
        data_parallel: int = 1,
        shard_optimizer: bool = False,
        fsdp: bool = False,
        recompute: bool | Sequence[bool] | None = None,
        memory_plan: Mapping[int, str] | None = None,
        balance_activations: bool | float | None = None,
        repartition_every: int | None = None,
        repartition_threshold: float = 0.15,
        early_input_grad: bool = True,
        delay_correction: str = "auto",
        sync_steps: int | float = 0,
        fresh_last_stage: bool = False,
        compile_blocks: bool | Mapping[str, Any] = False,
        check_split: bool = True,
        **kwargs: Any,
    ) -> None:
        # the keywords are the options' table (pipeline.optiontable.OPTIONS, held to this signature
        # by tests/unit/test_options.py), given as they are
        given = {name: value for name, value in locals().items() if name in OPTION_NAMES}
        super().__init__(**kwargs)
        self.options = PipeOptions.create(**given)
        self._num_nodes = 1
        self._process_group_backend = self.options.process_group_backend
        self.groups: ProcessGroups | None = None  # this call's, of the process's groups
        self.runtime: StageRuntime | None = None  # this rank's stage, rebuilt by every set-up
        self.plan: PlanResult | None = None  # what balance="auto" chose (saved in checkpoints)
        self.split: Split | None = None  # the blocks per stage and the rule that chose them
        # the plan's predicted throughput against the run's (``plan_check.result`` once measured)
        self.plan_check: PlanCheck | None = None
        self._repartitioner = Repartitioner(repartition_every, self.options.repartition_threshold)
        self._failed = False  # this Trainer call raised: no collective at teardown
        self._peers: PeerDirectory | None = None  # every rank's host and process (set-up)
        self._control: Any = None  # a gloo group of every rank when the default one is not
        self._steps: PipelinedSteps | None = None  # this Trainer call's steps (set-up)
        # a step's values, from the last stage to what every rank logs and returns
        self._delivery = StepDelivery()
        # SIGTERM / SIGINT end every rank within seconds (see failures.signals)
        self._signals = SignalGuard(self._describe, self._on_forced_exit)
        # SLURM's requeue warning answered at a step boundary (see requeue.py)
        self._requeue = RequeueRelay(self._describe)

    @classmethod
    def from_options(cls, options: PipeOptions, **kwargs: Any) -> Pipe2BWStrategy:
        """The strategy for ``options`` already built (``kwargs``: ``ParallelStrategy``'s)."""
        strategy = cls(**kwargs)
        strategy.options = options
        strategy._process_group_backend = options.process_group_backend
        strategy._repartitioner = Repartitioner(
            options.repartition_every, options.repartition_threshold
        )
        return strategy

    # Lightning's Trainer sets the module it was given here first, then refuses a compiled
    # LightningModule for every strategy but its three with words that do not show the way out
    # of a pipeline; this says it first
    @property
    def _lightning_module(self) -> Any:
        return self.__dict__.get("_pipe2bw_lightning_module")

    @_lightning_module.setter
    def _lightning_module(self, module: Any) -> None:
        if getattr(module, "_compiler_ctx", None) is not None:
            raise RuntimeError(
                "pipe2bw: the LightningModule was compiled whole (torch.compile(model)); a "
                "pipeline runs its body's blocks on different processes, so it cannot run one "
                "compiled forward. Compile the blocks instead: torch.compile(block) for each "
                "block of the body, or Pipe2BWStrategy(compile_blocks=True) (or a dict of "
                "torch.compile's keyword arguments), and pass the module uncompiled"
            )
        self.__dict__["_pipe2bw_lightning_module"] = module

    # ------------------------------------------------------------------ options and layout
    @property
    def schedule_name(self) -> str:
        return self.options.schedule

    @property
    def microbatches(self) -> int | None:
        """The micro-batches per batch asked for (or planned by ``balance="auto"``)."""
        return self.plan.best.num_microbatches if self.plan else self.options.microbatches

    @property
    def num_microbatches(self) -> int:
        m = self.microbatches
        return m if m is not None else self.num_stages

    @property
    def data_parallel(self) -> int:
        return self.options.data_parallel

    @property
    def activation_budget(self) -> ActivationBudget | None:
        """BPipe's budget (None: off); the ``ActivationBalancer`` callback sets it."""
        return self.options.activation_budget

    @activation_budget.setter
    def activation_budget(self, budget: ActivationBudget | None) -> None:
        self.options = self.options.with_activation_budget(budget)

    @property
    def repartitions(self) -> list[Repartition]:
        """The live repartitions of this strategy's fits, in order."""
        return self._repartitioner.history

    @property
    def topology(self) -> Topology:
        return Topology.for_schedule(
            self.world_size, self.options.data_parallel, self.global_rank, self.options.schedule
        )

    @property
    def num_stages(self) -> int:
        return self.topology.num_stages

    @property
    def replica(self) -> int:
        """This rank's pipeline replica (contiguous ranks: a pipeline stays inside a node)."""
        return self.topology.replica

    @property
    def stage(self) -> int:
        """This rank's pipeline stage; global rank 0 runs the *last* (see ``Topology``)."""
        return self.topology.stage

    @property
    def engine(self) -> PipelineEngine | None:
        return self.runtime.engine if self.runtime is not None else None

    @property
    def driver(self) -> Driver | None:
        return self.runtime.driver if self.runtime is not None else None

    @property
    def partition(self) -> Partition | None:
        return self.runtime.partition if self.runtime is not None else None

    def pipeline_view(self) -> PipelineView:
        """What the callbacks read: this rank's place in the pipeline, its engine and driver."""
        return PipelineView(
            self.stage, self.num_stages, self.replica, self.root_device, self.engine, self.driver,
            self.split,
        )  # fmt: skip

    @property
    def _runtime(self) -> StageRuntime:
        assert self.runtime is not None, "the pipeline stage is built at set-up"
        return self.runtime

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
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of one pipeline reads the same batches: its replica's shard
        return {"num_replicas": self.data_parallel, "rank": self.replica}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make random sampling agree across stages (``loaders.seed_sampler``: the stages'
        global RNGs diverge, dropout runs on some stages only), and refuse a training loader
        whose batch size or last batch is smaller than the micro-batches before any batch runs."""
        trainer = self._trainer()
        if trainer is not None and trainer.training:
            problem = last_batch_problem(
                dataloader, self.num_microbatches, trainer.limit_train_batches, trainer.max_steps
            )
            if problem is not None:
                raise ValueError(problem)
        if trainer is not None:
            self._delivery.name_loader(trainer, dataloader)
        return seed_sampler(dataloader, int(os.environ.get("PL_GLOBAL_SEED", 0)))

    def _trainer(self) -> Trainer | None:
        module = self.lightning_module
        try:
            return module.trainer if module is not None else None
        except RuntimeError:  # not attached to a Trainer
            return None

    @override
    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any:
        """Before the batch leaves the host: its fingerprint, which the last stage sends with
        the step's values and the other stages compare with their own (``loaders``)."""
        self._delivery.fingerprint = batch_fingerprint(batch) if self.num_stages > 1 else None
        return super().batch_to_device(batch, device, dataloader_idx)

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    # ------------------------------------------------------------------ launch and environment
    def _resolve_backend(self) -> str:
        """The process group's backend: the one asked for, else Lightning's for the device, but
        gloo where stage processes share a GPU (NCCL refuses that; asking for it is an error)."""
        backend = choose_backend(
            self.parallel_devices or [self.root_device],
            self._process_group_backend,
            compat.default_process_group_backend(self.root_device),
        )
        self._process_group_backend = backend
        return backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._resolve_backend()  # a bad choice fails here, before any process starts
        if self.options.start_method == "popen":
            self._launcher = PipePopenLauncher(
                self.cluster_environment,
                self.num_processes,
                self.num_nodes,
                grace_s=2 * self.worker_grace_s,  # its own failure path waits worker_grace_s
            )
        else:
            method = self.options.start_method
            self._launcher = PipeSpawnLauncher(self, start_method=method)  # type: ignore[arg-type]

    @override
    def setup_environment(self) -> None:
        self._signals.install()  # from here to teardown, a signal stops every rank
        super().setup_environment()
        compat.set_num_threads_if_needed(num_processes=max(self.num_processes, 1))
        reset_seed()
        env = self.cluster_environment
        assert env is not None
        env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        env.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        topology = Topology.create(self.world_size, self.data_parallel, self.global_rank)
        topology = replace(topology, placement=self.topology.placement)
        raise_problems(topology.option_problems(self.options))
        if topology.num_stages == 1:
            rank_zero_warn(one_stage_note(self.world_size, self.data_parallel, self.options))
        connect(env, self._resolve_backend(), self.options.timeout)
        self.groups = ProcessGroups.create(topology)
        # a gloo group of every rank, for the checkpoint's monitored barrier (collective)
        self._control = control_group()

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
        assert self.accelerator is not None and self.groups is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.runtime, self._steps, self._failed = None, None, False
        compat.skip_sigterm_broadcast(trainer)  # the signal guard stops every rank instead
        use_pipeline_summary(trainer)  # the whole model, labelled by stage
        raise_problems(
            run_problems(
                self.options,
                self.num_stages,
                fitting=fitting,
                predicting=trainer.state.fn == TrainerFn.PREDICTING,
                automatic_optimization=module.automatic_optimization,
                accumulate_grad_batches=trainer.accumulate_grad_batches,
            )
        )
        check_same_setup(setup_settings(self.options, self.num_microbatches, trainer))
        if fitting:
            refuse_layer_skipping(module)
        if self._peers is None and self.world_size > 1:
            topology = self.topology
            self._peers = PeerDirectory.gather(lambda r: replace(topology, rank=r).stage)
        ref = find_body(
            module, self.options.body, self._step_call(trainer), check=self.options.check_split
        )
        averaging = fitting and check_averaging(trainer, self.options)
        # the whole model's, before it is partitioned (StochasticWeightAveraging's own test)
        has_batch_norm = StochasticWeightAveraging.pl_module_contains_batch_norm(module)
        if (
            fitting
            and self.options.balance_mode == "auto"
            and not isinstance(ref.module, StageBody)
        ):
            self.plan, self.plan_check = plan_auto(
                module, ref, self.options, self.root_device, self.world_size,
                self.num_processes, self.global_rank,
            )  # fmt: skip
        self.split = resolve_split(
            self.options, ref, self.topology, self.plan, self._step_call(trainer, shapes_only=True)
        )
        recompute = self.plan.best.recompute if self.plan is not None else self.options.recompute
        body, partition = place_stage(
            module, ref, self.options, self.topology, self.split.balance, self.root_device, recompute,
            replicas=self.groups.stage,
        )  # fmt: skip
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            compat.optimizers_to_device(self.optimizers, self.root_device)
        self.runtime = build_runtime(
            root=module, body=body, partition=partition, options=self.options,
            topology=self.topology, groups=self.groups, device=self.root_device,
            num_microbatches=self.num_microbatches, training=fitting,
            optimizers=self.optimizers if fitting else [],
            clips_gradients=bool(trainer.gradient_clip_val),
            scales_loss=scaler_of(self.precision_plugin) is not None,
            version_log=self.version_log,
            total_steps=self._total_steps(trainer) if fitting else 0,
        )  # fmt: skip
        if fitting:
            self.optimizers = self.runtime.optimizers
            if self.options.repartition_every is not None:
                self.runtime.start_block_timing()
        agree_across_stages(self.precision_plugin, self.runtime, self.root_device, trainer)
        self._delivery.restart()
        self._steps = PipelinedSteps(
            module, self.runtime, self.precision_plugin, self.root_device, self._delivery,
            self._requeue,
            hook_logs=stage_logs(trainer, module, self.runtime, self.root_device) if fitting else None,
            # the guard's second half: every parameter gets a gradient at the first update
            check_use=fitting and self.options.check_split,
        )  # fmt: skip
        if averaging:
            average_stage(trainer, module, self.runtime, has_batch_norm)
        if any(isinstance(m, Metric) for m in module.modules()):  # the same on every rank
            group = self.groups.metrics() if self.data_parallel > 1 else None
            share_metrics(module, self.topology.is_last, group)
        quiet_epoch_sync_advice()

    def _step_call(
        self, trainer: Trainer, shapes_only: bool = False
    ) -> Callable[[nn.Module], Any] | None:
        """The arguments the step passes to a model on the first micro-batch of this Trainer
        call's first loader (``pipeline.intake.step_call``), or None without a loader."""
        found = compat.current_dataloader(trainer)
        module = self.lightning_module
        if found is None or module is None:
            return None
        loader, hook = found
        return step_call(module, hook, loader, self.num_microbatches, shapes_only=shapes_only)

    def _lost_rank(self, error: BaseException, where: str) -> StageFailure | None:
        """The error naming a rank found gone, for ``error`` raised in ``where``; None when the
        error does not say a peer is gone, or no rank is found gone."""
        return lost_rank(self._peers, self._launcher, error, where)

    # ------------------------------------------------------------------ steps
    @names_lost_ranks("a step (delivering its values)")
    def _run_pipelined(
        self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any], train: bool
    ) -> Any:
        return self._steps_now.run(hook, args, kwargs, train)

    @property
    def _steps_now(self) -> PipelinedSteps:
        assert self._steps is not None, "the pipeline stage is built at set-up"
        return self._steps

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        # Lightning's closure runs training_step, then zero_grad, then backward; the engine runs
        # the backwards inside the step, so the gradient the step applies is held out of .grad
        # until `backward`, and zero_grad (with its hooks) acts on nothing in between.
        module = self.lightning_module
        assert module is not None
        if compat.skips_backward(module.trainer):
            return self._forward_only(args, kwargs)
        with self.precision_plugin.train_step_context():
            loss = self._run_pipelined("training_step", args, kwargs, train=True)
        self._steps_now.take_due()
        return loss  # type: ignore[no-any-return]

    def _forward_only(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> STEP_OUTPUT:
        """A training step without backward or update (``StochasticWeightAveraging``'s epoch
        that recomputes batch norm statistics with the averaged weights): the batch runs through
        the live weights in training mode, forward only, outside 2BW's stream."""
        with self.precision_plugin.train_step_context(), torch.no_grad():
            return self._run_pipelined("training_step", args, kwargs, train=False)  # type: ignore[no-any-return]

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
    @names_lost_ranks("the optimizer step's gradient exchange")
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """The engine already ran every micro-batch's backward; only the hooks are left to call."""
        self._steps_now.backward(closure_loss)
        return closure_loss

    @override
    @names_lost_ranks("the optimizer step")
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        steps, step = self._steps_now, super().optimizer_step
        output = steps.optimizer_step(lambda run: step(optimizer, run, model, **kwargs), closure)
        if steps.finish_update():  # 2BW: a flush is due, or the epoch ends
            self.flush()
        return output

    @names_lost_ranks("a flush of the pipeline")
    def flush(self) -> None:
        """Drain a 2BW pipeline and apply the last batch's update (collective: every rank calls it
        at the same point of Lightning's loop). A no-op for flush schedules or an empty pipeline."""
        if self.runtime is not None and self._steps is not None:
            self._steps.flush()

    # ------------------------------------------------------------------ live repartitioning
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        module, runtime = self.lightning_module, self.runtime
        if module is None or runtime is None:
            return
        self._requeue.start_batch()  # SLURM's requeue warning, once every rank knows of it
        step = module.trainer.global_step
        check_plan(self.plan_check, step, batch, self.data_parallel, self.global_rank)
        repartition_at(
            step, self._repartitioner, runtime, self.flush, self._move_blocks, self.global_rank
        )

    def _move_blocks(
        self, balance: Sequence[int], carry: bool = True, why: str = "moved by live repartitioning"
    ) -> None:
        """Make the pipeline run ``balance`` (collective; at a flush point), carrying the
        optimizers' and schedulers' state (not before a checkpoint's state is loaded:
        ``carry=False``); see ``repartition.migrate``. ``why``: the split's rule now."""
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer

        def rebuild() -> tuple[list[Optimizer], list[Any]]:
            self.setup_optimizers(trainer)
            compat.optimizers_to_device(self.optimizers, self.root_device)
            return self.optimizers, [c.scheduler for c in self.lr_scheduler_configs]

        fitting = trainer.state.fn == TrainerFn.FITTING and bool(self.optimizers)
        stepped = move_blocks(
            self._runtime,
            balance,
            self.optimizers if carry else [],
            self.lr_scheduler_configs if carry else [],
            rebuild if fitting else None,
        )
        if stepped is not None:
            self.optimizers = stepped
        self.split = Split(tuple(balance), why)

    def _adopt_layout(self, state: Mapping[str, Any] | None) -> None:
        """Run the blocks-per-stage layout a checkpoint was written with (collective: every
        rank reads the same checkpoint)."""
        saved = checkpoint_layout(state, self.runtime, self.options.balance is not None)
        if saved is not None:
            self._move_blocks(saved, carry=False, why="the checkpoint's")

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_start(self) -> None:
        self._install_signals()  # after Lightning registered its own handlers

    @override
    def on_validation_start(self) -> None:
        self._install_signals()
        self.flush()

    @override
    def on_test_start(self) -> None:
        self._install_signals()

    @override
    def on_predict_start(self) -> None:
        self._install_signals()

    def _install_signals(self) -> None:
        self._signals.install()
        module = self.lightning_module
        fitting = module is not None and module.trainer.state.fn == TrainerFn.FITTING
        self._requeue.install(self.cluster_environment, fitting)

    @override
    def teardown(self) -> None:
        self._signals.uninstall()
        self._requeue.uninstall()
        runtime = self.runtime
        # spawned workers end here; the launching process gets the gathered weights instead
        if runtime is not None and not self._failed:
            if not isinstance(self._launcher, PipeSpawnLauncher):
                self._hand_back(runtime)
            # after a failure the transport stays: its notice may still be on its way, and a
            # closed socket would tell the neighbours this process is gone instead
            runtime.release_transport()
        super().teardown()

    @names_lost_ranks("the hand-back of the trained model after the Trainer call")
    def _hand_back(self, runtime: StageRuntime) -> None:
        """The whole trained body back in the user's module, on every rank (collective)."""
        reason = hand_back(runtime)
        if reason is not None:
            rank_zero_warn(
                f"pipe2bw: the module keeps each rank's stage of its body only ({reason}); save "
                "the whole model with trainer.save_checkpoint(path) or strategy.full_state_dict()"
            )

    def _describe(self) -> str:
        return f"rank {self.global_rank} (stage {self.stage})"

    def _on_forced_exit(self) -> None:
        if self.global_rank == 0:  # the launching process of a popen run: no worker left behind
            kill_workers(self._launcher)

    @override
    def on_train_end(self) -> None:
        finish_plan_check(self.plan_check, self.global_rank)
        self._requeue.answer()  # a requeue warning delivered in the fit's last steps
        self.flush()
        if self._steps is not None:
            self._steps.close()
        if self.runtime is not None:
            self.runtime.close()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell the neighbour stages, so that they stop now with an error naming this failure
        instead of waiting until the process-group timeout; the launching process of a
        ``popen`` run then makes sure its workers stop (passing a signal on to them first)."""
        self._failed = True
        forget_process_groups()  # the next call in this process makes its groups anew
        if self.runtime is not None:
            self.runtime.report_failure(exception)
        if self.global_rank == 0:
            stop_workers_after(exception, self._launcher, self.worker_grace_s)

    @override
    @names_lost_ranks("a decision shared by every rank (reduce_boolean_decision)")
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Global rank 0's decision, on every rank.

        Callbacks such as ``EarlyStopping`` and ``ModelCheckpoint`` decide from logged metrics.
        Every stage sees the same data, and rank 0 (the last stage) holds the metrics as a
        single-device run logs them; with 2BW the other ranks receive the training-step values one
        step late, so their own decisions could differ. Rank 0's decision is the single-device one.
        """
        return rank_zero_decision(decision, self.root_device)

    @override
    @names_lost_ranks("a barrier")
    def barrier(self, name: str | None = None) -> None:
        if not is_initialized():
            return
        if name == "Trainer.save_checkpoint" and self.world_size > 1:
            self._checkpoint_barrier()
            return
        dist.barrier()

    def _checkpoint_barrier(self) -> None:
        """Every rank reaches ``trainer.save_checkpoint`` (``checkpoint.hooks.checkpoint_barrier``)."""
        checkpoint_barrier(
            self._control, self.options.timeout, self.world_size, self._describe(), self._lost_rank
        )

    @override
    @names_lost_ranks("a broadcast")
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src)

    @override
    @names_lost_ranks("a reduction (strategy.reduce)")
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
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

    @names_lost_ranks("full_state_dict (gathering the weights)")
    def full_state_dict(self) -> dict[str, Any]:
        """The unpartitioned model's state dict on global rank 0 (collective; ``{}`` elsewhere)."""
        module = self.lightning_module
        assert module is not None
        if self.runtime is not None:
            return self._format().whole_state()
        return gather_state_dict(module, self.global_rank, self.world_size)

    def _format(self) -> CheckpointFormat:
        return CheckpointFormat(self._runtime, self.plan)

    def _torch_optimizers(self) -> list[Optimizer]:
        return [compat.torch_optimizer(o) for o in self.optimizers]

    @override
    @names_lost_ranks("trainer.save_checkpoint (gathering the weights)")
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._checkpoint_barrier()  # every rank is saving: the gather below needs them all
        self.flush()  # a checkpoint is a flush point: no micro-batch in flight, no update pending
        return self._format().model_state()

    @override
    @names_lost_ranks("trainer.save_checkpoint (gathering the optimizer state)")
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self._format().optimizer_state(compat.torch_optimizer(optimizer))

    @override
    @names_lost_ranks("trainer.save_checkpoint")
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        module = self.lightning_module
        if module is not None and self.runtime is not None:
            whole_averages(checkpoint, module.trainer, self.global_rank, self.world_size)
        checkpoints = self._format()
        if checkpoints.sharded:
            checkpoints.save_sharded(checkpoint, filepath)
            return
        write = functools.partial(super().save_checkpoint, storage_options=storage_options)
        write_replacing(
            checkpoints.full_checkpoint(checkpoint), filepath, write, self.is_global_zero
        )

    @override
    @names_lost_ranks("loading a checkpoint")
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Lightning's loader, with ``weights_only=True`` unless the caller chose: a pipe2bw
        checkpoint holds tensors and plain containers only. A checkpoint that needs arbitrary
        unpickling (e.g. custom hyper-parameter objects) is loaded with ``weights_only=False``
        after a warning; pass ``weights_only=False`` to ``fit`` to skip the first attempt.
        First, every rank must be able to read it (``PeerDirectory.check_readable``)."""
        if self._peers is not None and "://" not in str(checkpoint_path):
            self._peers.check_readable(str(checkpoint_path))
        if is_sharded_checkpoint(checkpoint_path):
            return self._format().load_sharded(
                checkpoint_path, weights_only is not False, self._torch_optimizers,
                self._adopt_layout,
            )  # fmt: skip
        return load_trusting(checkpoint_path, weights_only, super().load_checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._format().load_model_state(checkpoint, strict, self._adopt_layout)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._format().load_optimizer_states(self._torch_optimizers(), checkpoint)

    def _total_steps(self, trainer: Trainer) -> int:
        """The fit's optimizer steps (``max_steps``, or Lightning's estimate of the epochs'):
        what a synchronous start given as a share (``sync_steps=0.8``) is a share of."""
        if not isinstance(self.options.sync_steps, float):
            return 0  # not needed
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return int(trainer.max_steps)
        estimate = trainer.estimated_stepping_batches
        if not math.isfinite(estimate):
            raise ValueError(
                f"sync_steps={self.options.sync_steps} is a share of the fit's optimizer steps, "
                "but this fit's length is not known (no max_steps, an endless dataloader): "
                "give Trainer(max_steps=...) or sync_steps as a number of steps"
            )
        return int(estimate)

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: compat.StrategyRegistryType) -> None:
        """Register ``"pipe2bw"`` (the default schedule), ``"pipe2bw_spawn"`` (spawned
        workers) and ``"pipe2bw_<schedule>"`` for every schedule of the registry, named as it is
        registered (``"pipe2bw_2bw"``, ``"pipe2bw_zb-h1"``)."""
        entries: list[tuple[str, str, dict[str, Any]]] = [
            ("pipe2bw", f"pipeline parallelism, schedule {DEFAULT_SCHEDULE!r}", {}),
            ("pipe2bw_spawn", "pipeline parallelism, spawned workers", {"start_method": "spawn"}),
        ]
        for name in REGISTRY:
            entries.append(
                (f"pipe2bw_{name}", f"pipeline parallelism, schedule {name!r}", {"schedule": name})
            )
        for name, description, init in entries:
            strategy_registry.register(name, cls, description=description, override=True, **init)
