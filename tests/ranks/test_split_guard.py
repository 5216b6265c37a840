"""The guard against a split that trains silently wrong (``check_split``), on the pool's ranks: a
described model whose split computes something else is stopped at set-up, and at the first
update a trainable parameter that got no gradient on any stage is named. The observed forward
and the set-up check in one process: ``tests/unit/test_split_guard.py``."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
import torch.distributed as dist
from helpers import hf_models
from helpers.models import quiet_trainer
from torch import Tensor, nn

from lightning_pipe2bw import Pipe2BWStrategy, PipeModel
from lightning_pipe2bw.partition.observe import SplitError
from lightning_pipe2bw.runtime.failure import StageFailure
from ranks.test_real_models import M, _DescribedModule, image_loader


def _opt_late(check: bool) -> dict[str, Any]:
    """OPT built in configure_model: on the meta device, so no forward can be watched before the
    split; the registration order puts its final norm on the first stage."""
    from ranks.test_real_models import _BuiltLate

    torch.set_num_threads(1)
    module = _BuiltLate("opt")
    strategy = Pipe2BWStrategy(schedule="1f1b", microbatches=M, check_split=check)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=2)
    try:
        trainer.fit(module, hf_models.loader("opt", 2))
    except (SplitError, StageFailure) as err:  # its own finding, or the other stage's
        return {"error": str(err), "stage": strategy.stage}
    state = strategy.full_state_dict()  # collective (rank 0 gets it); the model keeps parts
    if dist.get_rank() != 0:
        return {"error": None, "norm_moved": None}
    norm = state["model.model.decoder.final_layer_norm.weight"]
    return {"error": None, "norm_moved": float((norm - 1).abs().max())}


def test_the_first_update_names_a_parameter_no_stage_used(pools: Any) -> None:
    """The guard's second half, for a model no forward could be watched on: each stage names
    its parameters that got no gradient (OPT's final norm on the first stage; on the last, the
    layers whose output the norm's stand-in replaced), and the way to turn the check off; with
    the check off, the same run trains on with the norm never updated (the silent wrongness)."""
    results = {r["stage"]: r["error"] for r in pools(2).run(_opt_late, True)}
    print(f"GUARD first update, stage 0: {results[0][:200]}")
    assert results[0].startswith(
        "2 trainable parameter(s) of stage 0 got no gradient at the first update: "
        "['model.model.decoder.final_layer_norm.bias', 'model.model.decoder.final_layer_norm.weight']"
    ), results[0]
    assert "check_split=False" in results[0]
    # the last stage stops with its own finding, or with stage 0's if that reached it first
    assert "got no gradient at the first update" in results[1], results[1]
    off = pools(2).run(_opt_late, False)
    assert all(r["error"] is None for r in off)
    assert off[0]["norm_moved"] == 0.0  # never trained: what the check prevents


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
