"""The intake learns a model's structure from one observed forward, and the guard against a split
that trains silently wrong (``check_split``, on by default):

- at set-up, the split model (its blocks run one after the other in the process) must return
  what the whole model returns on the first micro-batch (rtol 1e-4, atol 1e-5);
- at the first update, every trainable parameter must have a gradient on some stage.

OPT is the case that trained silently wrong before: it registers its final norm before its layer
list, and registration order put that norm on the first stage, where nothing ran it.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
import torch.distributed as dist
from helpers import hf_models
from helpers.models import quiet_trainer
from ranks.test_real_models import M, _DescribedModule, image_loader
from torch import Tensor, nn

from lightning_pipe2bw import Pipe2BWStrategy, PipeModel
from lightning_pipe2bw.partition.hf import pipe_model_for
from lightning_pipe2bw.partition.observe import SplitError, observe
from lightning_pipe2bw.partition.split import check_split
from lightning_pipe2bw.runtime.failure import StageFailure
from lightning_pipe2bw.runtime.stage import BodyInput


def _opt_call() -> tuple[nn.Module, BodyInput]:
    torch.manual_seed(0)
    model = hf_models.opt()
    x, y = hf_models.batches("opt", 1)[0]
    return model, BodyInput((), {"input_ids": x[:2], "labels": y[:2]})


def test_the_forward_shows_where_registration_order_misleads() -> None:
    model, call = _opt_call()
    static = pipe_model_for(model)  # no forward watched: registration order
    learnt = pipe_model_for(model, call)
    assert static is not None and learnt is not None
    assert "model.decoder.final_layer_norm" in static.pre
    assert "model.decoder.final_layer_norm" in learnt.post
    assert "model.decoder.final_layer_norm" not in learnt.pre
    check_split(learnt, learnt.body(), call)  # the learnt split computes what the model does


def test_the_set_up_check_catches_a_split_that_computes_something_else() -> None:
    """The guard's first half on the split registration order gives OPT: the final norm never
    runs, so the loss and the logits differ from the whole model's."""
    model, call = _opt_call()
    static = pipe_model_for(model)
    assert static is not None
    with pytest.raises(SplitError) as info:
        check_split(static, static.body(), call)
    message = str(info.value)
    print(f"GUARD set-up: {message[:300]}")
    assert message.startswith(
        "the pipeline split of OPTForCausalLM computes something else than the whole model on "
        "the first micro-batch (logits: max |difference|"
    )
    assert "loss: max |difference|" in message
    assert "'model.decoder.final_layer_norm'" in message  # where it was put, named
    assert "check_split=False" in message


class _UsesShared(nn.Module):
    """A layer that calls a module it does not hold (a module shared by layers)."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.own = nn.Linear(4, 4)
        object.__setattr__(self, "other", shared)

    def forward(self, x: Tensor) -> Tensor:
        return self.other(self.own(x))  # type: ignore[no-any-return, operator]


class _Odd(nn.Module):
    """Layers that call a module outside them, a module run between two layers, or a norm run
    before and after the layers."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm(4)
        self.shared = nn.Linear(4, 4)
        if kind == "inside":
            self.layers = nn.ModuleList([_UsesShared(self.shared) for _ in range(3)])
        else:
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.kind == "between" and i == 0:
                x = self.shared(x)
        return self.norm(x) if self.kind == "twice" else self.shared(x)


def test_a_module_without_parameters_may_run_anywhere() -> None:
    """A dropout (or rotary table) without parameters is on every stage: one instance used
    before the layers, between them and after them, or by every layer, is no problem."""

    class _Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.0)
            self.embed = nn.Linear(4, 4)
            self.layers = nn.ModuleList([_UsesShared(self.drop) for _ in range(3)])
            self.head = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            x = self.drop(self.embed(x))
            for i, layer in enumerate(self.layers):
                x = layer(x)
                x = self.drop(x) if i == 0 else x
            return self.head(self.drop(x))  # type: ignore[no-any-return]

    model = _Shared()
    seen = observe(model, "layers", lambda: model(torch.randn(2, 4)))
    assert seen.before == ["drop", "embed"] and seen.after == ["head"], (seen.before, seen.after)


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("inside", "layer 0 of _Odd ('layers') calls 'shared', which is not part of it (and 2 more)"),
        ("between", "'shared' of _Odd runs after and between the layers"),
        ("twice", "'norm' of _Odd runs after and before the layers"),
    ],
)
def test_a_forward_the_split_cannot_carry_is_refused(kind: str, says: str) -> None:
    model = _Odd(kind)
    with pytest.raises(SplitError) as info:
        observe(model, "layers", lambda: model(torch.randn(2, 4)))
    assert str(info.value).startswith(says), str(info.value)
    assert "PipeModel" in str(info.value)


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
