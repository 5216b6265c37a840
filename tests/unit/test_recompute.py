"""Activation recomputation (``recompute=``) on one stage body: only the buffers a forward
updates are restored, and a weight version computes as ``torch.func.functional_call`` does. The
same weights after training, with less memory: ``tests/ranks/test_recompute.py``."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_pipe2bw.runtime.stage import StageBody


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
    ((_, learnt),) = body.recomputation.updated_buffers.values()
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
