"""``MuonAdamW``: Muon on the hidden matrices and AdamW on the rest as one optimizer, bitwise the
two torch optimizers it runs; its state dict resumes exactly, tied and head weights stay with
AdamW, and bad groups are refused. Through the strategy: ``tests/ranks/test_muon.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import max_abs_diff
from torch import nn

from lightning_pipe2bw import MuonAdamW


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)
        self.hidden = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.lm_head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.hidden(self.embed(x)))
        return self.lm_head(h + self.mlp(h))


def _train(model: Tiny, optimizers: list[torch.optim.Optimizer], steps: int) -> None:
    x = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        for opt in optimizers:
            opt.zero_grad()
        model(x).square().mean().backward()
        for opt in optimizers:
            opt.step()


def test_it_is_torch_muon_and_adamw_bitwise() -> None:
    model, twin = Tiny(), Tiny()
    ours = MuonAdamW.for_module(model, lr=0.02, weight_decay=0.1)
    assert ours.muon_names == ["hidden.weight", "mlp.0.weight", "mlp.2.weight"]
    matrices = [twin.hidden.weight, twin.mlp[0].weight, twin.mlp[2].weight]
    muon = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    rest = [p for p in twin.parameters() if all(p is not q for q in matrices)]
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.ndim >= 2]},
            {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=0.02,
        weight_decay=0.1,
        betas=(0.9, 0.95),
    )
    _train(model, [ours], 4)
    _train(twin, [muon, adamw], 4)
    assert max_abs_diff(model.state_dict(), twin.state_dict()) == 0.0


def test_its_state_dict_resumes_exactly() -> None:
    straight = Tiny()
    _train(straight, [MuonAdamW.for_module(straight, lr=0.02)], 4)
    first = Tiny()
    opt = MuonAdamW.for_module(first, lr=0.02)
    _train(first, [opt], 2)
    saved = copy.deepcopy(opt.state_dict())
    assert {"momentum_buffer", "exp_avg", "exp_avg_sq"} <= {
        k for s in saved["state"].values() for k in s
    }
    resumed = copy.deepcopy(first)
    again = MuonAdamW.for_module(resumed, lr=0.02)
    again.load_state_dict(saved)
    _train(resumed, [again], 2)
    assert max_abs_diff(resumed.state_dict(), straight.state_dict()) == 0.0


def test_tied_and_head_weights_stay_with_adamw() -> None:
    model = Tiny()
    model.lm_head.weight = model.embed.weight  # an embedding tied to the head
    opt = MuonAdamW.for_module(model)
    assert opt.muon_names == ["hidden.weight", "mlp.0.weight", "mlp.2.weight"]
    adamw = [p for g in opt.param_groups if not g["muon"] for p in g["params"]]
    assert any(p is model.embed.weight for p in adamw)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_bad_groups_are_refused_with_the_fix() -> None:
    w = nn.Parameter(torch.zeros(3, 3))
    b = nn.Parameter(torch.zeros(3))
    with pytest.raises(TypeError, match="param groups with a 'muon' key"):
        MuonAdamW([{"params": [w]}])
    with pytest.raises(ValueError, match=r"Muon takes 2-D parameters only.*\(3,\)"):
        MuonAdamW([{"params": [w, b], "muon": True}])


def test_a_torch_without_muon_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.optim.Muon came with torch 2.9; pyproject.toml admits 2.6 (FSDP2): on an older
    torch MuonAdamW says which version it needs and what else to do, not an AttributeError."""
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(RuntimeError, match=r"torch\.optim\.Muon, which torch 2\.9 added; this is torch "):
        MuonAdamW.for_module(nn.Linear(4, 4))
