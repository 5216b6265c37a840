"""Each schedule's bubble and peak activations at paper scale, from the simulator.

For p = 4 to 64 stages and m = p to 8p micro-batches, every registered flush schedule (``gpipe``,
``1f1b``, ``zb-h1``) is simulated (``lightning_pipe2bw.schedule.simulate``, no communication
cost) with two cost sets:

* F : I : W = 1 : 1 : 1 (a whole backward B = I + W = 2), the zero-bubble paper's setting;
* the ratios measured here on one pre-LayerNorm GPT block (``recipes.gpt``: width 256, 4 heads,
  sequence 128, micro-batch 8, fp32, one CPU thread): a forward, the backward cut into its inputs'
  pass and its weights' pass (``SplitBackward``), medians of ``--repeats`` runs.

It prints a markdown table (bubble fraction, the closed form where one exists, and the largest
per-stage peak of micro-batches held between F and the end of their backward) and writes
``benchmarks/results/schedule_table.json``. Run from the repository root::

    python benchmarks/schedule_table.py          # about a minute

Closed forms at F : B = 1 : 2: GPipe and 1F1B (p - 1)/(m + p - 1); ZB-H1 (p - 1)/(3m + p - 1),
a third of 1F1B's bubble time. Nothing here is asserted by tests (``tests/test_schedule.py`` and
``tests/test_zero_bubble.py`` check the same figures at small sizes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from lightning_pipe2bw.recipes.gpt.model import Block
from lightning_pipe2bw.runtime.splitgrad import SplitBackward
from lightning_pipe2bw.schedule import Costs, get_schedule, simulate

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
STAGES = (4, 8, 16, 32, 64)
FACTORS = (1, 2, 4, 8)
OUT = Path(__file__).resolve().parent / "results" / "schedule_table.json"


def closed_form(name: str, p: int, m: int) -> float | None:
    """The bubble fraction at F : I : W = 1 : 1 : 1 (m >= p)."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    return None


def measure_ratios(repeats: int) -> dict[str, float]:
    """F, I and W of one GPT block on this CPU (one thread), in milliseconds."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = Block(256, 4)
    times: dict[str, list[float]] = {"F": [], "I": [], "W": []}
    for _ in range(repeats + 2):  # two warm-up rounds
        x = torch.randn(8, 128, 256, requires_grad=True)
        t0 = time.perf_counter()
        y = block(x)
        t1 = time.perf_counter()
        split = SplitBackward.plan([y], [torch.ones_like(y)], [x])
        assert split is not None, "the GPT block's backward cannot be cut"
        split.inputs_pass()
        t2 = time.perf_counter()
        split.weights_pass()
        t3 = time.perf_counter()
        block.zero_grad(set_to_none=True)
        for key, value in zip("FIW", (t1 - t0, t2 - t1, t3 - t2), strict=True):
            times[key].append(value * 1e3)
    return {key: statistics.median(values[2:]) for key, values in times.items()}


def table(ratios: dict[str, float]) -> list[dict[str, Any]]:
    f = ratios["F"]
    cost_sets = {
        "1:1:1": Costs(forward=1.0, backward=2.0, input_grad=1.0, weight_grad=1.0),
        "measured": Costs(
            forward=1.0,
            backward=(ratios["I"] + ratios["W"]) / f,
            input_grad=ratios["I"] / f,
            weight_grad=ratios["W"] / f,
        ),
    }
    rows = []
    for p in STAGES:
        for factor in FACTORS:
            m = factor * p
            for name in SCHEDULES:
                schedule = get_schedule(name, p, m)
                row: dict[str, Any] = {"schedule": name, "p": p, "m": m,
                                       "closed_form": closed_form(name, p, m)}  # fmt: skip
                for label, costs in cost_sets.items():
                    result = simulate(schedule, costs)
                    row[label] = {
                        "bubble": result.mean_bubble_fraction,
                        "peak": max(result.peak_activations),
                        "peak_first": result.peak_activations[0],
                        "peak_last": result.peak_activations[-1],
                    }
                rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], ratios: dict[str, float]) -> str:
    """One row per (p, m): each schedule's bubble fraction at 1:1:1 (closed form in brackets)
    and at the measured ratios, and its peak activations (largest stage; stage 0 / last)."""
    by = {(r["p"], r["m"], r["schedule"]): r for r in rows}
    lines = [
        f"measured on one GPT block (this CPU): F {ratios['F']:.2f} ms, I {ratios['I']:.2f} ms, "
        f"W {ratios['W']:.2f} ms (F : I : W = 1 : {ratios['I'] / ratios['F']:.2f} : "
        f"{ratios['W'] / ratios['F']:.2f})",
        "",
        "| p | m | bubble, 1:1:1: GPipe = 1F1B | ZB-H1 | bubble, measured: 1F1B | ZB-H1 "
        "| peak micro-batches (stage 0 / last): GPipe | 1F1B | ZB-H1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in STAGES:
        for factor in FACTORS:
            m = factor * p
            one, zb, gp = by[(p, m, "1f1b")], by[(p, m, "zb-h1")], by[(p, m, "gpipe")]

            def peak(r: dict[str, Any]) -> str:
                return f"{r['1:1:1']['peak_first']} / {r['1:1:1']['peak_last']}"

            lines.append(
                f"| {p} | {m} | {one['1:1:1']['bubble']:.3f} ({one['closed_form']:.3f}) "
                f"| {zb['1:1:1']['bubble']:.3f} ({zb['closed_form']:.3f}) "
                f"| {one['measured']['bubble']:.3f} | {zb['measured']['bubble']:.3f} "
                f"| {peak(gp)} | {peak(one)} | {peak(zb)} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    ratios = measure_ratios(args.repeats)
    rows = table(ratios)
    print(markdown(rows, ratios))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"ratios_ms": ratios, "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
