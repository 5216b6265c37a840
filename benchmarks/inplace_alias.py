"""What making a received activation writable costs: one block's forward and backward on a
received-like input (a leaf that requires grad) as it is, through ``runtime.inplace.writable``
(an alias, no copy) and through a clone, per micro-batch, one thread::

    python benchmarks/inplace_alias.py          # about a minute on a quiet core

Prints the median microseconds of each and the ratio to the leaf as it is (for a block that
starts in place, which cannot run on the leaf, the ratio to the alias), and writes
``benchmarks/results/inplace_alias.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.models import BasicBlock  # noqa: E402

from lightning_pipe2bw.runtime.inplace import writable  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _median_us(block: nn.Module, shape: tuple[int, ...], prep: Callable[[Tensor], Tensor]) -> float:
    runs = []
    for i in range(70):
        leaf = torch.randn(shape).requires_grad_()
        start = time.perf_counter()
        out = block(prep(leaf))
        out.backward(torch.ones_like(out))
        if i >= 10:
            runs.append(time.perf_counter() - start)
    return statistics.median(runs) * 1e6


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cases: dict[str, tuple[nn.Module, tuple[int, ...]]] = {
        "BasicBlock(64), 8x64x16x16": (BasicBlock(64), (8, 64, 16, 16)),
        "Linear(256)+Tanh, 32x256": (nn.Sequential(nn.Linear(256, 256), nn.Tanh()), (32, 256)),
        "ReLU(inplace)+Linear(256), 32x256": (
            nn.Sequential(nn.ReLU(inplace=True), nn.Linear(256, 256)),
            (32, 256),
        ),
        "x*2, 32x256 (no work: the fixed cost)": (nn.Identity(), (32, 256)),
    }
    preps: dict[str, Callable[[Tensor], Tensor]] = {
        "leaf": lambda x: x,
        "alias": writable,
        "clone": lambda x: x.clone(),
    }
    out: dict[str, dict[str, float]] = {}
    for name, (block, shape) in cases.items():
        if isinstance(block, nn.Identity):
            block = _Double()
        ways = {k: v for k, v in preps.items() if not ("inplace" in name and k == "leaf")}
        samples: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(3):  # alternate, so that drift hits every way alike
            for way, prep in ways.items():
                samples[way].append(_median_us(block, shape, prep))
        medians = {k: statistics.median(v) for k, v in samples.items()}
        base = medians.get("leaf", medians["alias"])
        out[name] = medians
        print(
            name + ": " + ", ".join(f"{k} {v:.1f} us ({v / base:.3f}x)" for k, v in medians.items())
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "inplace_alias.json").write_text(json.dumps(out, indent=2) + "\n")


class _Double(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 2.0


if __name__ == "__main__":
    main()
