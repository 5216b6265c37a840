"""Activation recomputation (``recompute=``): the same weights after training, less memory.

With recomputation a stage keeps only its input per in-flight micro-batch and runs its blocks
again in the backward (``torch.utils.checkpoint``, non-reentrant), with the micro-batch's own
weight version under 2BW. Tolerance: max abs parameter difference <= 1e-6 against the same run
without recomputation (fp32, CPU; recomputing repeats the same operations, so it is 0 here),
and <= 1e-5 against the single-device references.
"""

from __future__ import annotations

import pytest
import torch
from helpers import workers
from helpers.models import max_abs_diff, reference_2bw, reference_train
from torch import Tensor, nn

from lightning_pipe2bw.runtime.stage import StageBody

STEPS = 4


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_recompute_changes_nothing_but_memory(pools, schedule: str) -> None:
    plain = pools(2).run(workers.fit, schedule, 4, STEPS)
    again = pools(2).run(workers.fit, schedule, 4, STEPS, recompute=True)
    diff = max_abs_diff(again[0]["state"], plain[0]["state"])
    ref = reference_2bw(STEPS, 4) if schedule == "2bw" else reference_train(STEPS, 4)[0]
    print(
        f"RECOMPUTE {schedule}: max|dW| vs no recompute {diff:.3e}, vs reference "
        f"{max_abs_diff(again[0]['state'], ref):.3e}; peak saved bytes per stage "
        f"{[r['peak_activation_bytes'] for r in plain]} -> "
        f"{[r['peak_activation_bytes'] for r in again]}"
    )
    assert diff <= 1e-6
    assert max_abs_diff(again[0]["state"], ref) <= 1e-5
    for before, after in zip(plain, again, strict=True):
        assert after["peak_activation_bytes"] < before["peak_activation_bytes"] / 2, (before, after)


def test_recompute_per_stage(pools) -> None:
    """``recompute=[True, False]``: stage 0 (global rank 1) recomputes, stage 1 does not."""
    plain = pools(2).run(workers.fit, "1f1b", 4, 2)
    mixed = pools(2).run(workers.fit, "1f1b", 4, 2, recompute=[True, False])
    by_stage = {r["stage"]: r["peak_activation_bytes"] for r in plain}
    mixed_by_stage = {r["stage"]: r["peak_activation_bytes"] for r in mixed}
    assert mixed_by_stage[0] < by_stage[0] / 2
    assert mixed_by_stage[1] == by_stage[1]
    assert max_abs_diff(mixed[0]["state"], plain[0]["state"]) <= 1e-6


def test_recompute_list_must_match_the_stages(pools) -> None:
    for message in pools(2).run(workers.fit_error, "1f1b", recompute=[True, False, True]):
        assert "recompute=[True, False, True] has 3 entries but the pipeline has 2" in message


def test_recompute_protects_the_input_of_an_in_place_first_block(pools) -> None:
    """Stage 1 starts with ``x += shift`` (``balance=[5, 3]``), which is not idempotent: the
    recomputation must see the input the first forward saw, not the one it modified. (The
    weights; the buffers are the next test's.)"""
    kwargs = dict(model="conv", balance=[5, 3])
    plain = pools(2).run(workers.fit, "1f1b", 4, 3, **kwargs)
    again = pools(2).run(workers.fit, "1f1b", 4, 3, recompute=True, **kwargs)
    ref = reference_train(3, 4, model_name="conv")[0]
    weights = [k for k in ref if "running_" not in k and "num_batches" not in k]
    got = {k: again[0]["state"][k] for k in weights}
    assert max_abs_diff(got, {k: plain[0]["state"][k] for k in weights}) <= 1e-6
    assert max_abs_diff(got, {k: ref[k] for k in weights}) <= 1e-5


@pytest.mark.parametrize(
    ("schedule", "recompute", "plan"),
    [
        ("1f1b", True, None),
        ("2bw", True, None),
        ("gpipe", False, {1: "recompute", 3: "recompute"}),
        ("2bw", False, {2: "recompute", 3: "recompute", 6: "recompute"}),
    ],
)
def test_recompute_leaves_batch_norm_statistics_alone(
    pools, schedule: str, recompute: bool, plan: dict[int, str] | None
) -> None:
    """The recomputed forward normalises with batch statistics, as the first one did, but does
    not update the running statistics again: weights and buffers (running_mean, running_var,
    num_batches_tracked) equal the run without recomputation, and the references. Stage 1
    starts with ReLU(inplace=True) (``balance=[2, 6]``), so recomputation also runs an in-place
    first block."""
    steps, m = 5, 4
    kwargs = dict(model="conv", balance=[2, 6])
    plain = pools(2).run(workers.fit, schedule, m, steps, **kwargs)
    again = pools(2).run(
        workers.fit, schedule, m, steps, recompute=recompute, memory_plan=plan, **kwargs
    )
    ref = (
        reference_2bw(steps, m, model_name="conv")
        if schedule == "2bw"
        else reference_train(steps, m, model_name="conv")[0]
    )
    state = again[0]["state"]
    diff = max_abs_diff(state, plain[0]["state"])
    print(
        f"RECOMPUTE BN {schedule} {recompute} {plan}: max|d| weights and buffers vs no recompute "
        f"{diff:.3e}, vs reference {max_abs_diff(state, ref):.3e}"
    )
    for key in ("body.1.num_batches_tracked", "body.3.bn2.num_batches_tracked"):
        assert int(state[key]) == steps * m, (key, int(state[key]))
    assert diff <= 1e-6
    assert max_abs_diff(state, ref) <= 1e-5


def test_recomputation_restores_only_the_buffers_a_forward_updates() -> None:
    """On one stage body: after a forward and its backward (which recomputes), batch norm's
    running statistics are those of one forward; a static buffer is never copied (it is not
    among the buffers the recomputation saves and restores)."""
    import torch
    from torch import nn

    from lightning_pipe2bw.runtime.stage import StageBody

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.mask

    def blocks() -> list[tuple[int, nn.Module]]:
        torch.manual_seed(0)
        return [(0, nn.Linear(4, 4)), (1, nn.BatchNorm1d(4)), (2, Masked())]

    x = torch.randn(6, 4)
    plain = StageBody(blocks(), 0, 2)
    plain.run_blocks(x).sum().backward()
    body = StageBody(blocks(), 0, 2, recompute=True)
    body.run_blocks(x).sum().backward()
    for key, value in plain.state_dict().items():
        assert torch.equal(body.state_dict()[key], value), key
    bn, masked = body.block(1), body.block(2)
    ((_, learnt),) = body._updated_buffers.values()
    assert {(id(m), n) for m, n in learnt} == {
        (id(bn), "running_mean"),
        (id(bn), "running_var"),
        (id(bn), "num_batches_tracked"),
    }
    assert all(m is not masked for m, _ in learnt)


class _TiedPair(nn.Module):
    """A block that holds one parameter under two names (a tied projection)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("recompute", [False, True])
def test_a_weight_version_computes_as_functional_call_does(recompute: bool) -> None:
    """A stage's blocks run with other weights (2BW's versions) exactly as under
    torch.func.functional_call: the same output and the same gradients in the given tensors,
    a tied parameter replaced under both its names, and the parameters back afterwards."""
    torch.manual_seed(0)
    blocks = [(0, _TiedPair()), (1, nn.Sequential(nn.Linear(6, 6), nn.GELU())), (2, _TiedPair())]
    body = StageBody(blocks, 0, 1, recompute=recompute)
    originals = {n: p for n, p in body.named_parameters()}
    version = {n: (p.detach() * 0.5 + 0.1).requires_grad_() for n, p in originals.items()}
    twins = {n: t.detach().clone().requires_grad_() for n, t in version.items()}
    x = torch.randn(4, 6)

    out = body.run_blocks(x, version)
    out.square().sum().backward()
    ref = x
    for index, block in blocks:
        own = {k.split(".", 1)[1]: v for k, v in twins.items() if k.startswith(f"{index}.")}
        ref = torch.func.functional_call(block, own, (ref,), strict=False)
    ref.square().sum().backward()

    assert torch.equal(out, ref)
    for name in version:
        assert torch.equal(version[name].grad, twins[name].grad), name
    assert all(p.grad is None for p in originals.values())  # the live weights took no gradient
    assert dict(body.named_parameters()) == originals  # the same objects, back in place
    assert blocks[0][1].b.weight is blocks[0][1].a.weight  # the tie holds
    with pytest.raises(KeyError, match="has no parameter 'missing'"):
        body.run_blocks(x, {**version, "1.missing": version["1.0.weight"]})
    assert dict(body.named_parameters()) == originals
