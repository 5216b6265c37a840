"""Lightning's private API that ``lightning_pipe2bw.compat`` relies on is still there.

A Lightning release that renames one of these breaks ``compat`` only; this test says which name
is gone, instead of a failure deep inside a multi-process run.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe2bw import compat


@pytest.mark.parametrize(("module", "name"), compat.REQUIRED, ids=lambda x: str(x))
def test_every_private_name_compat_uses_exists(module: str, name: str) -> None:
    mod = importlib.import_module(module)
    assert hasattr(mod, name), (
        f"lightning {importlib.import_module('lightning').__version__} has no {module}.{name}, "
        "which lightning_pipe2bw.compat uses: update compat for this Lightning release"
    )


def test_compat_lists_every_private_name_it_imports() -> None:
    """``REQUIRED`` is the list this test checks: it must name every private import of compat."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(compat))
    imported = {
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning")
        for alias in node.names
        if alias.name.startswith("_")
    }
    imported |= {("lightning.pytorch.trainer.call", n) for n in ("_call_callback_hooks",)}
    assert imported <= set(compat.REQUIRED), imported - set(compat.REQUIRED)


def test_private_attributes_on_real_objects() -> None:
    """The attributes compat reads off Lightning's and torch's objects."""
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert hasattr(trainer.fit_loop, "_data_source"), "Trainer.fit_loop._data_source is gone"
    epoch_loop = trainer.fit_loop.epoch_loop
    assert callable(getattr(epoch_loop, "_broadcast_sigterm_tensor", None)), (
        "the training epoch loop's _broadcast_sigterm_tensor is gone"
    )
    assert callable(getattr(trainer.fit_loop._data_source, "dataloader", None))
    plugin = trainer.strategy.precision_plugin
    for method in ("clip_grad_by_norm", "clip_grad_by_value"):
        assert callable(getattr(plugin, method, None)), f"Precision.{method} is gone"
    launcher = compat.SubprocessScriptLauncher(LightningEnvironment(), 2, 1)
    assert compat.launched_processes(launcher) == []
    assert callable(getattr(launcher, "_call_children_scripts", None)), (
        "the popen launcher's _call_children_scripts is gone"
    )
    assert hasattr(compat.MultiProcessingLauncher, "_collect_rank_zero_results")
    fields = list(compat.WorkerOutput._fields)  # the launcher builds one positionally
    assert fields == [
        "best_model_path",
        "weights_path",
        "trainer_state",
        "trainer_results",
        "extra",
    ], fields
    assert compat.skips_backward(trainer) is False, "Trainer.fit_loop._skip_backward is gone"
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    swa = StochasticWeightAveraging(swa_lrs=0.1)
    assert compat.averaged_model(swa) is None, "StochasticWeightAveraging._average_model is gone"
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

    assert compat.summary_depth(ModelSummary(max_depth=2)) == 2, "ModelSummary._max_depth is gone"
    rich = RichModelSummary(header_style="bold")
    assert compat.summary_options(rich)["header_style"] == "bold", (
        "RichModelSummary._summarize_kwargs is gone"
    )
    module = _Tiny()
    assert compat.current_hook(module) is None
    with compat.running_hook(module, "on_before_optimizer_step"):
        assert module._current_fx_name == "on_before_optimizer_step"
    assert compat.current_hook(module) is None
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    opt.param_groups[0]["params"][0].grad = torch.ones(1)
    scaler.scale(torch.ones(1))
    scaler.unscale_(opt)
    assert "found_inf_per_device" in compat.found_inf_state(scaler, opt)


ORDER: list[str] = []


class _Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01, betas=(0.8, 0.9))

    def on_before_backward(self, loss: torch.Tensor) -> None:
        ORDER.append("module:before")

    def on_after_backward(self) -> None:
        ORDER.append("module:after")


class _Probe(Callback):
    def __init__(self) -> None:
        self.loader: Any = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.loader = compat.training_dataloader(trainer)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        ORDER.append("callback:before")

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        ORDER.append("callback:after")


def test_compat_functions_on_a_real_fit() -> None:
    data = DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=4)
    model, probe = _Tiny(), _Probe()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    ORDER.clear()
    trainer.fit(model, data)
    assert probe.loader is data  # the DataLoader fit was given, before the loop set it up
    expected = ["callback:before", "module:before", "callback:after", "module:after"]
    assert expected == ORDER  # Lightning's own backward, for one step
    ORDER.clear()
    compat.call_backward_hooks(trainer, torch.zeros(()))
    assert expected == ORDER  # compat's calls: the same hooks in the same order
    make = compat.optimizer_factory(model)
    assert make is not None
    built = make([nn.Parameter(torch.zeros(3))])
    assert isinstance(built, torch.optim.Adam) and built.defaults["betas"] == (0.8, 0.9)
    assert compat.torch_optimizer(trainer.optimizers[0]) is trainer.optimizers[0]
