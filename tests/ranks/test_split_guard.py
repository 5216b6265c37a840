"""The guard against a split that trains silently wrong (``check_split``), on the pool's ranks: a
described model whose split computes something else is stopped at set-up, a model whose split
could not be checked at set-up is stopped at its first micro-batch, and at the first update a
trainable parameter that got no gradient on any stage is named. The observed forward and the
set-up check in one process: ``tests/unit/test_split_guard.py``."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
import torch.distributed as dist
from helpers import hf_models
from helpers.models import RegressionModel, quiet_trainer
from helpers.pool import TaskError
from lightning.pytorch import Callback
from torch import Tensor, nn

from lightning_pipe2bw import Pipe2BWStrategy, PipeModel
from lightning_pipe2bw.partition.observe import SplitError
from ranks.test_real_models import M, _DescribedModule, image_loader


def _opt_late(check: bool) -> dict[str, Any]:
    """OPT built in configure_model: on the meta device, so no forward can be watched before the
    split; the registration order puts its final norm on the first stage."""
    from ranks.test_real_models import _BuiltLate

    torch.set_num_threads(1)
    module = _BuiltLate("opt")
    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M, check_split=check)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=2)
    # an error leaves the task, as it leaves a real run: the pool then starts fresh ranks (the
    # run stopped in the middle of a schedule, with messages in flight on the process group)
    trainer.fit(module, hf_models.loader("opt", 2))
    state = strategy.full_state_dict()  # collective (rank 0 gets it); the model keeps parts
    if dist.get_rank() != 0:
        return {"error": None, "norm_moved": None}
    norm = state["model.model.decoder.final_layer_norm.weight"]
    return {"error": None, "norm_moved": float((norm - 1).abs().max())}


def test_a_model_no_forward_was_watched_on_is_stopped_at_its_first_micro_batch(pools: Any) -> None:
    """For a model no forward could be watched on before the split (built on the meta device),
    the guard runs on the ranks: at its first micro-batch the last stage replays the end of the
    forward a second time with other values in the blanks of the first stage's parts, sees the
    loss change with the final norm's blank (registration order put the norm on the first
    stage) and stops every rank with the norm named, before any update; with the check off the
    same run trains on with the norm never updated (the silent wrongness)."""
    with pytest.raises(TaskError) as info:
        pools(2).run(_opt_late, True)
    rank0, rank1 = str(info.value).split("--- rank 1 ---")  # rank 0 runs the last stage
    print(f"GUARD first micro-batch: {info.value.reason}")
    assert "ReadsBlanks: the pipeline split of OPTForCausalLM would compute something" in rank0
    assert "StageFailure: rank 0 (stage 1) failed in action 1F0: ReadsBlanks" in rank1, rank1
    for text in (rank0, rank1):
        assert "it reads what 'model.decoder.final_layer_norm' computes" in text
        assert "check_split=False" in text
    off = pools(2).run(_opt_late, False)
    assert all(r["error"] is None for r in off)
    assert off[0]["norm_moved"] == 0.0  # never trained: what the check prevents


def head_without_norm(model: nn.Module, hidden: Tensor, args: Any, kwargs: Any) -> Tensor:
    return model.head(hidden[:, 0])  # type: ignore[no-any-return, operator]


class _SkipsNorm(_DescribedModule):
    """A description whose head forgets the final norm: at initialisation the norm is the
    identity, so the split's output equals the model's and only the gradients tell."""

    def pipeline_body(self) -> PipeModel:
        return PipeModel(
            self.net,
            blocks="blocks",
            pre=["patch_embed", "cls_token", "pos_embed"],
            post=["norm", "head"],
            head=head_without_norm,
        )


def _skips_norm(check: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = _SkipsNorm()
    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M, check_split=check)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=2)
    trainer.fit(module, image_loader(2))  # an error leaves the task (see _opt_late)
    return {"error": None}


def test_the_first_update_names_a_parameter_no_stage_used(pools: Any) -> None:
    """The guard's last line: a part that is the identity at initialisation gives the same
    output whether it runs or not, so no output check sees a head that skips it; at the first
    update the stage holding it names its parameters without a gradient (the other stage stops
    with that error), and with the check off the run trains on."""
    with pytest.raises(TaskError) as info:
        pools(2).run(_skips_norm, True)
    rank0, rank1 = str(info.value).split("--- rank 1 ---")  # rank 0 runs the last stage
    print(f"GUARD first update: {info.value.reason}")
    assert (
        "SplitError: 2 trainable parameter(s) of stage 1 got no gradient at the first update: "
        "['net.norm.bias', 'net.norm.weight']"
    ) in rank0, rank0[-2000:]
    assert "check_split=False" in rank0
    assert "got no gradient at the first update" in rank1, rank1[-2000:]
    assert all(r["error"] is None for r in pools(2).run(_skips_norm, False))


def mean_token_head(model: nn.Module, hidden: Tensor, args: Any, kwargs: Any) -> Tensor:
    return model.head(model.norm(hidden).mean(1))  # type: ignore[no-any-return, operator]


class _WrongHead(_DescribedModule):
    """A description whose head pools every token where the model takes the class token: every
    parameter is used, only the output tells."""

    def pipeline_body(self) -> PipeModel:
        return PipeModel(
            self.net,
            blocks="blocks",
            pre=["patch_embed", "cls_token", "pos_embed"],
            post=["norm", "head"],
            head=mean_token_head,
        )


def _described(check: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = _WrongHead()
    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M, check_split=check)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=2)
    try:
        trainer.fit(module, image_loader(2))
    except SplitError as err:
        return {"error": str(err)}
    return {"error": None}


def test_a_described_model_with_a_wrong_head_is_stopped_at_set_up(pools: Any) -> None:
    """A PipeModel whose head pools the wrong tokens: the split's output differs from the
    model's at set-up, before any step; with the check off it trains on."""
    for r in pools(2).run(_described, True):
        assert r["error"] is not None and r["error"].startswith(
            "the pipeline split of _TinyViT computes something else than the whole model on the "
            "first micro-batch (output: max |difference|"
        ), r
    for r in pools(2).run(_described, False):
        assert r["error"] is None


# ---------------------------------------------------------------------- a later shape diverges
class _Diverges(nn.Module):
    """Exact on sequences of up to 4 tokens; on longer ones its forward scales the hidden state
    between two layers, which a split into stages would skip."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, 8)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
            if x.shape[1] > 4:
                h = h * 1.5
        return self.head(h).mean(1)  # type: ignore[no-any-return]


class _DivergesLater(RegressionModel):
    def __init__(self) -> None:
        super().__init__()
        del self.body
        self.net = _Diverges()

    def pipeline_body(self) -> PipeModel:
        from lightning_pipe2bw.partition.replay import ReplayHead

        return PipeModel(self.net, blocks="layers", pre=["embed"], post=["head"], head=ReplayHead())

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit_diverging(check: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(8, n, 3, generator=g), torch.randn(8, 2, generator=g)) for n in (4, 4, 6)
    ]
    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M, check_split=check)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=3)
    steps: list[int] = []

    class Steps(Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            steps.append(trainer.global_step)

    trainer.callbacks.append(Steps())
    trainer.fit(_DivergesLater(), torch.utils.data.DataLoader(batches, batch_size=None))
    return {"steps": steps}  # an error leaves the task (see _opt_late)


def test_a_model_that_diverges_at_a_later_shape_stops_at_that_batch(pools: Any) -> None:
    """Two batches of 4 tokens train (the guard proves that shape once); the first batch of 6
    tokens, where the forward scales the hidden state between layers, stops every rank before
    its first micro-batch trains, with the model and the shape named; with the check off the
    run trains on through it."""
    with pytest.raises(TaskError) as info:
        pools(2).run(_fit_diverging, True)
    rank0, rank1 = str(info.value).split("--- rank 1 ---")  # rank 1 runs the first stage
    print(f"GUARD later shape: {info.value.reason}")
    assert (
        "SplitError: the pipeline split of _Diverges would compute something else than the whole "
        "model on a micro-batch of new input shapes [[2, 6, 3]]: the forward changes the "
        "hidden state between layer 0 and layer 1"
    ) in rank1, rank1[-3000:]
    assert "StageFailure" in rank0 and "_Diverges" in rank0
    assert [r["steps"] for r in pools(2).run(_fit_diverging, False)] == [[1, 2, 3], [1, 2, 3]]
