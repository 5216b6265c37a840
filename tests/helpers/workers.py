"""Functions run on every rank of a test pool (module level, so they pickle by name)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from helpers.models import RegressionModel, loader, make_loader, make_model, quiet_trainer
from lightning_pipe2bw import Pipe2BWStrategy
from lightning_pipe2bw.optim.wrapper import unwrap_optimizer
from lightning_pipe2bw.pipeline.fsdp import is_sharded, local_elements


class RecordLoss(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val_runs: list[float] = []

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # with 2BW, ranks other than 0 log a step's values one step late: nothing at step 0
        self.losses.append(float(trainer.callback_metrics.get("train_loss", math.nan)))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.val_runs.append(float(trainer.callback_metrics["val_loss"]))


def fit(
    schedule: str,
    microbatches: int | None,
    steps: int,
    optimizer: str = "adamw",
    batch_size: int = 8,
    **strategy_kwargs: Any,
) -> dict[str, Any]:
    world = dist.get_world_size()
    model_name = strategy_kwargs.pop("model", "regression")  # see models.make_model
    model = make_model(model_name, optimizer)
    trainer_kwargs = strategy_kwargs.pop("trainer_kwargs", {})
    val_batches = strategy_kwargs.pop("val_batches", 0)
    callbacks = strategy_kwargs.pop("callbacks", [])
    samples = strategy_kwargs.pop("samples", 64)  # in the training set
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=microbatches, **strategy_kwargs)
    strategy.version_log = []
    record = RecordLoss()
    trainer = quiet_trainer(
        devices=world,
        strategy=strategy,
        max_steps=steps,
        callbacks=[record, *callbacks],
        **trainer_kwargs,
    )
    val = make_loader(model_name, batch_size, n=8 * val_batches) if val_batches else None
    trainer.fit(model, make_loader(model_name, batch_size, n=samples), val)
    state = strategy.full_state_dict()
    opt = trainer.optimizers[0]
    return {
        "state": state if dist.get_rank() == 0 else None,
        "losses": record.losses,
        # what this rank held while it trained: its stage (after fit the module is whole again)
        "param_bytes": sum(p.numel() * p.element_size() for p in strategy.engine.body.parameters()),
        "opt_params": sum(p.numel() for g in opt.param_groups for p in g["params"]),
        "opt_state_bytes": sum(
            t.numel() * t.element_size()
            for s in opt.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        ),
        "opt_moment_elements": sum(
            t.numel()
            for s in opt.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        ),
        # what this rank held of them (fsdp=True: its shards)
        "local_param_elements": local_elements(strategy.engine.body.parameters()),
        "local_opt_state_elements": local_elements(
            t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        ),
        "sharded_params": sum(is_sharded(p) for p in strategy.engine.body.parameters()),
        # shard_optimizer: the stage's elements this replica updates, and the largest parameter
        # it must keep whole (Muon's matrices), of the user's optimizer
        **_shard_counts(strategy, opt),
        "blocks": list(strategy.engine.body.indices),
        # the blocks per stage and the rule that chose them (the stage table's line)
        "balance": list(strategy.split.balance) if strategy.split else None,
        "split": strategy.split.describe() if strategy.split else "",
        "stage": strategy.stage,
        "versions": strategy.version_log,
        "engine_versions": strategy.engine.stats.max_weight_versions if strategy.engine else 0,
        "split_backwards": strategy.engine.stats.split_backwards if strategy.engine else 0,
        "whole_backward_note": strategy.engine.stats.whole_backward_note if strategy.engine else "",
        "weight_buffers": strategy.driver.weight_buffers if strategy.driver else 0,
        # 2BW's sums over tied copies started as each gradient completes (pipeline.ties)
        "ties_ahead": bool(
            strategy.runtime and strategy.runtime.tied and strategy.runtime.tied.ahead
        ),
        # 2BW's clipping norms summed as each gradient completes (seam.agreement.NormsAhead)
        "norms_ahead": any(
            f.__qualname__ == "NormsAhead.post" for f in getattr(strategy.driver, "on_complete", [])
        ),
        "microbatches": strategy.num_microbatches,
        "peak_activation_bytes": (
            strategy.engine.stats.peak_activation_bytes if strategy.engine else 0
        ),
        "val_runs": record.val_runs,
        # this rank's copies of parameters shared with blocks on other ranks
        "tied_copies": len(strategy.runtime.tied.copies)
        if strategy.runtime is not None and strategy.runtime.tied is not None
        else 0,
    }


class LateBuiltModel(RegressionModel):
    """Builds its body in ``configure_model`` (Lightning's hook for large models)."""

    def __init__(self, width: int, num_blocks: int) -> None:
        super().__init__()
        del self.body
        self.body: Any = None
        self.width = width
        self.num_blocks = num_blocks
        self.built_on_meta: bool | None = None

    def configure_model(self) -> None:
        if self.body is not None:
            return
        w = self.width
        self.body = torch.nn.Sequential(*[torch.nn.Linear(w, w) for _ in range(self.num_blocks)])
        # a buffer outside the body, also created on meta: materialising it must not touch the
        # blocks initialised before it
        self.register_buffer("calls", torch.zeros(()), persistent=False)
        self.built_on_meta = all(p.is_meta for p in self.body.parameters())

    def reset_parameters(self) -> None:
        """Materialising calls this for the module's own tensors built on meta: the buffer."""
        self.calls.zero_()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x = batch[0]
        return self(x).pow(2).mean()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class PeakAtFitStart(Callback):
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.peak_kib = _status_kib("VmHWM")
        self.state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def fit_late_built(width: int, num_blocks: int) -> dict[str, Any]:
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader, TensorDataset

    seed_everything(42, verbose=False)
    world = dist.get_world_size()
    model = LateBuiltModel(width, num_blocks)
    data = DataLoader(TensorDataset(torch.randn(8, width)), batch_size=4)
    peak = PeakAtFitStart()
    trainer = quiet_trainer(
        devices=world,
        strategy=Pipe2BWStrategy(microbatches=2),
        max_steps=1,
        callbacks=[peak],
    )
    # reset the peak resident set size so that VmHWM measures set-up alone
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    trainer.fit(model, data)
    return {
        "built_on_meta": model.built_on_meta,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "meta_left": any(t.is_meta for t in (*model.parameters(), *model.buffers())),
        "peak_increase_bytes": (peak.peak_kib - before) * 1024,
        "initial_state": peak.state,
        "blocks": list(model.body.indices),
    }


def fit_error(schedule: str, **strategy_kwargs: Any) -> str:
    """The message of the error a short fit raises ("no error" if it trains)."""
    microbatches = strategy_kwargs.pop("microbatches", 4)
    try:
        fit(schedule, microbatches, 2, **strategy_kwargs)
    except (ValueError, TypeError) as err:
        return str(err)
    return "no error"


# ----------------------------------------------------------------------------- initialising a
# body built in configure_model: a block without reset_parameters (transformers' Conv1D)


class ConvBlock(torch.nn.Module):
    """GPT-2's layer: transformers' ``Conv1D`` has no ``reset_parameters`` (it initialises
    itself in ``__init__``, which the meta device skips)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.proj = Conv1D(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


def conv_body() -> torch.nn.Sequential:
    """Four blocks; with ``balance=[3, 1]`` the Conv1D blocks are all on stage 0."""
    from helpers.models import HIDDEN, IN, OUT

    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        ConvBlock(HIDDEN),
        ConvBlock(HIDDEN),
        torch.nn.Linear(HIDDEN, OUT),
    )


def conv_init(module: torch.nn.Module) -> None:
    """GPT-2's initialisation of ``Conv1D``, ``reset_parameters()`` for the rest."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):
        torch.nn.init.normal_(module.weight, std=0.02)
        torch.nn.init.zeros_(module.bias)
    elif isinstance(module, torch.nn.Linear):
        module.reset_parameters()


class LateConvModel(RegressionModel):
    """``conv_body()`` built in ``configure_model``, without an initialiser for Conv1D."""

    def __init__(self) -> None:
        super().__init__()
        del self.body
        self.body: Any = None

    def configure_model(self) -> None:
        if self.body is None:
            self.body = conv_body()


class LateConvModelWithInit(LateConvModel):
    def pipeline_init(self, module: torch.nn.Module) -> None:
        conv_init(module)


class StateAtFitStart(Callback):
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def fit_late_conv(with_init: bool, steps: int, microbatches: int) -> dict[str, Any]:
    """Fit ``LateConvModel`` (seed 42) with 1F1B on balance [3, 1]: the error each rank raises,
    or its stage's initial weights and the trained model."""
    from lightning.pytorch import seed_everything

    seed_everything(42, verbose=False)
    model = LateConvModelWithInit() if with_init else LateConvModel()
    start = StateAtFitStart()
    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=microbatches, balance=[3, 1])
    trainer = quiet_trainer(
        devices=dist.get_world_size(), strategy=strategy, max_steps=steps, callbacks=[start]
    )
    try:
        trainer.fit(model, loader(8))
    except Exception as err:
        return {"error": type(err).__name__, "message": str(err)}
    full = strategy.full_state_dict()
    return {
        "error": None,
        "initial": start.state,
        "blocks": list(strategy.engine.body.indices),
        "state": full if dist.get_rank() == 0 else None,
    }


def _shard_counts(strategy: Any, optimizer: Any) -> dict[str, int]:
    shards = strategy.runtime.shards_of(unwrap_optimizer(optimizer)) if strategy.runtime else None
    if shards is None:
        return {}
    return {
        "owned_elements": shards.owned_elements(),
        "stage_elements": sum(p.numel() for p in shards.params),
        "largest_whole": max(
            [p.numel() for p, whole in zip(shards.params, shards.whole, strict=True) if whole],
            default=0,
        ),
    }
