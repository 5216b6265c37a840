"""Third-party models trained as they come (Hugging Face GPT-2, Llama, ViT): the module holds the
model, its step calls it; the strategy finds the layer list, splits it, carries what the layers
take between stages (hidden state, mask, position ids, rotary cos/sin), and keeps tied weights
(GPT-2's embedding and head) as one copy per stage, summed gradients and one saved name.

Tolerance: max abs difference <= 1e-5 after 5 AdamW steps against the whole model on one device
(1f1b: gradient accumulation over the same micro-batches; 2bw: the delayed-update rule)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

import hf_models
import torch
import torch.distributed as dist
from models import (
    HIDDEN,
    IN,
    OUT,
    Block,
    RegressionModel,
    accumulate_gradient,
    loader,
    make_optimizer,
    max_abs_diff,
    quiet_trainer,
)
from torch import Tensor, nn

from lightning_pipe2bw import Pipe2BWStrategy

STEPS, M = 5, 4
TOL = 1e-5


def _fit(family: str, schedule: str, **kwargs: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = hf_models.HFModule(family)
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=M, **kwargs)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=STEPS)
    trainer.fit(module, hf_models.loader(family, STEPS))
    whole = {f"model.{k}": v.detach().clone() for k, v in module.model.state_dict().items()}
    state = strategy.full_state_dict()  # collective
    return {
        "state": state if dist.get_rank() == 0 else None,
        "whole": whole,
        "type": type(module.model).__name__,
        "blocks": list(strategy.engine.body.indices) if strategy.engine else [],
    }


@pytest.mark.parametrize("family", ["gpt2", "gpt2_untied", "llama", "vit"])
@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_hf_model_as_it_comes(pools: Any, family: str, schedule: str) -> None:
    results = pools(2).run(_fit, family, schedule)
    ref = hf_models.reference(family, STEPS, M, delayed=schedule == "2bw")
    state = results[0]["state"]
    diff = max_abs_diff(state, ref)
    worst = max(state, key=lambda k: (state[k].double() - ref[k].double()).abs().max().item())
    print(
        f"{family} {schedule}: max|dW| vs one device {diff:.3e} (at {worst}); "
        f"blocks {[r['blocks'] for r in results]}"
    )
    assert diff <= TOL
    for r in results:  # after fit: the Hugging Face model again, whole, on every rank
        assert r["type"] == type(hf_models.FAMILIES[family]()).__name__
        assert max_abs_diff(r["whole"], ref) <= TOL


# ---------------------------------------------------------------------- a tie in a plain body
class _TiedModel(RegressionModel):
    """Blocks 1 and 6 share one weight: on two stages, each holds a copy."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.body = nn.Sequential(
            nn.Linear(IN, HIDDEN),
            nn.Linear(HIDDEN, HIDDEN, bias=False),
            *[Block(HIDDEN) for _ in range(4)],
            nn.Linear(HIDDEN, HIDDEN, bias=False),
            nn.Linear(HIDDEN, OUT),
        )
        self.body[6].weight = self.body[1].weight


def _fit_tied(schedule: str, clip: float | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = _TiedModel()
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=M)
    extra = {"gradient_clip_val": clip} if clip is not None else {}
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=STEPS, **extra)
    trainer.fit(module, loader(8))
    state = strategy.full_state_dict()
    return {
        "state": state if dist.get_rank() == 0 else None,
        "tied_again": module.body[6].weight is module.body[1].weight,
    }


def _reference_tied(delayed: bool, clip: float | None) -> dict[str, Tensor]:
    model, shadow = _TiedModel(), _TiedModel()
    opt, sched = make_optimizer(model.parameters())
    history = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    for step, (x, y) in enumerate(loader(8)):
        if step == STEPS:
            break
        if delayed:
            shadow.load_state_dict(history[max(step - 1, 0)])
            shadow.zero_grad()
            accumulate_gradient(shadow, x, y, M)
            for p, q in zip(model.parameters(), shadow.parameters(), strict=True):
                p.grad = None if q.grad is None else q.grad.clone()
        else:
            opt.zero_grad()
            accumulate_gradient(model, x, y, M)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        history[step + 1] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return history[STEPS]


@pytest.mark.parametrize(
    ("schedule", "clip"), [("1f1b", None), ("1f1b", 0.05), ("gpipe", None), ("2bw", None)]
)
def test_a_weight_tied_across_stages(pools: Any, schedule: str, clip: float | None) -> None:
    """Each stage trains a copy; the copies' gradients are summed before every update (and
    counted once by clipping), so the copies stay equal and equal one device with the tie."""
    results = pools(2).run(_fit_tied, schedule, clip)
    state = results[0]["state"]
    ref = _reference_tied(schedule == "2bw", clip)
    diff = max_abs_diff(state, ref)
    print(f"tie {schedule} clip={clip}: max|dW| vs one device {diff:.3e}")
    assert diff <= TOL
    assert torch.equal(state["body.1.weight"], state["body.6.weight"])
    assert all(r["tied_again"] for r in results)  # one parameter again after fit
