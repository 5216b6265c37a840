"""A body built in ``configure_model`` (on the meta device), fitted through the 2-rank pool:
every rank raises for a Conv1D body without an init, and ``pipeline_init`` trains as the same
model initialised on one device (the reference, and the checks of ``build_stage`` in one
process: ``tests/unit/test_materialize.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from helpers import workers
from helpers.models import accumulate_gradient, loader, make_optimizer, max_abs_diff
from torch import nn


def test_every_rank_raises_for_a_conv1d_body_without_init(pools: Any) -> None:
    """Only stage 0 holds Conv1D blocks; both ranks raise the same error (no rank is left
    waiting for the other)."""
    results = pools(2).run(workers.fit_late_conv, False, 2, 2, timeout=120)
    messages = {r["message"] for r in results}
    assert [r["error"] for r in results] == ["UninitializedError", "UninitializedError"]
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "body.1.proj.weight (parameter of Conv1D) holds NaN" in message
    assert "body.2.proj.bias (parameter of Conv1D) holds NaN" in message
    assert "pipeline_init(self, module)" in message


def test_pipeline_init_trains_as_the_same_model_on_one_device(pools: Any) -> None:
    steps, microbatches = 3, 2
    results = pools(2).run(workers.fit_late_conv, True, steps, microbatches, timeout=180)
    for r in results:
        assert r["error"] is None, r
    body = workers.conv_body()
    for i, block in enumerate(body):
        torch.manual_seed(42 + i)  # fit_late_conv's seed
        with torch.no_grad():
            block.apply(workers.conv_init)
    initial = {f"body.{k}": v.detach().clone() for k, v in body.state_dict().items()}
    seen = []
    for r in results:
        for i in r["blocks"]:
            for name in ("weight", "bias"):
                key = f"body.{i}.proj.{name}" if i in (1, 2) else f"body.{i}.{name}"
                torch.testing.assert_close(r["initial"][key], initial[key], rtol=0, atol=0)
            seen.append(i)
    assert sorted(seen) == [0, 1, 2, 3]
    # trained as on one device, from the same initial weights
    model = nn.Module()
    model.body = body
    opt, sched = make_optimizer(model.parameters())
    for step, (x, y) in enumerate(loader(8)):
        if step == steps:
            break
        opt.zero_grad()
        accumulate_gradient(body, x, y, microbatches)
        opt.step()
        sched.step()
    expected = {k: v.detach() for k, v in model.state_dict().items()}
    state = results[0]["state"]
    assert all(bool(torch.isfinite(v).all()) for v in state.values())
    assert max_abs_diff(state, expected) <= 1e-6
