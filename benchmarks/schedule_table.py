"""Each schedule's bubble and peak activations at paper scale, from the simulator.

For p = 4 to 64 ranks and m = p to 8p micro-batches, every flush schedule (``gpipe``, ``1f1b``,
``zb-h1``, and with two stages per rank ``interleaved-1f1b``, ``zb-v`` and ``dualpipe-v`` (m >=
2p), whose stages are half as long), in the order the strategy runs it, is simulated
(``lightning_pipe2bw.schedule.simulate``, no communication cost) with two cost sets:

* F : I : W = 1 : 1 : 1 (a whole backward B = I + W = 2), the zero-bubble paper's setting;
* the ratios measured here on one pre-LayerNorm GPT block (``recipes.gpt``: width 256, 4 heads,
  sequence 128, micro-batch 8, fp32, one CPU thread): a forward, the backward cut into its inputs'
  pass and its weights' pass (``SplitBackward``), medians of ``--repeats`` runs.

It prints a markdown table (bubble fraction, the closed form where one exists, and the peak of
micro-batches a rank holds between F and the end of their backward, in whole-stage units: a
half stage's counts one half) and writes
``benchmarks/results/schedule_table.json``. Run from the repository root::

    python benchmarks/schedule_table.py          # about a minute

Closed forms at F : B = 1 : 2: GPipe and 1F1B (p - 1)/(m + p - 1); ZB-H1 (p - 1)/(3m + p - 1),
a third of 1F1B's bubble time; interleaved 1F1B with k stages per rank (p - 1)/(k m + p - 1),
a k-th of 1F1B's. Nothing here is asserted by tests (``tests/unit/test_schedule.py`` and
``tests/unit/test_zero_bubble.py`` check the same figures at small sizes).
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
from lightning_pipe2bw.schedule import (
    VIRTUAL_SCHEDULES,
    Costs,
    Schedule,
    get_schedule,
    simulate,
    virtual_schedule,
)

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "dualpipe-v")
STAGES = (4, 8, 16, 32, 64)
FACTORS = (1, 2, 4, 8)
OUT = Path(__file__).resolve().parent / "results" / "schedule_table.json"


def closed_form(name: str, p: int, m: int) -> float | None:
    """The bubble fraction at F : I : W = 1 : 1 : 1 (m >= p)."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    if name == "interleaved-1f1b":
        return (p - 1) / (2 * m + p - 1)
    return None


def build(name: str, p: int, m: int) -> tuple[Schedule, int]:
    """The schedule the strategy runs on p ranks, and its stages per rank."""
    if name in VIRTUAL_SCHEDULES:
        return virtual_schedule(name, p, m), 2
    return get_schedule(name, p, m), 1


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

    def cost_sets(k: int) -> dict[str, Costs]:  # a stage of k per rank is a k-th as long
        return {
            "1:1:1": Costs(forward=1 / k, backward=2 / k, input_grad=1 / k, weight_grad=1 / k),
            "measured": Costs(
                forward=1 / k,
                backward=(ratios["I"] + ratios["W"]) / f / k,
                input_grad=ratios["I"] / f / k,
                weight_grad=ratios["W"] / f / k,
            ),
        }

    rows = []
    for p in STAGES:
        for factor in FACTORS:
            m = factor * p
            for name in SCHEDULES:
                if name == "dualpipe-v" and m < 2 * p:
                    continue  # DualPipeV needs m >= 2p
                row: dict[str, Any] = {"schedule": name, "p": p, "m": m,
                                       "closed_form": closed_form(name, p, m)}  # fmt: skip
                for label, costs in cost_sets(2 if name in VIRTUAL_SCHEDULES else 1).items():
                    schedule, k = build(name, p, m)
                    result = simulate(schedule, costs)
                    peaks = [n / k for n in result.peak_activations]
                    row[label] = {
                        "bubble": result.mean_bubble_fraction,
                        "peak": max(peaks),
                        "peak_first": peaks[0],
                        "peak_last": peaks[-1],
                    }
                rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], ratios: dict[str, float]) -> str:
    """Bubble fractions at 1:1:1 (the closed form in brackets) and at the measured ratios, then
    the peaks (rank 0 / last rank, whole-stage micro-batches), one row per (p, m)."""
    by = {(r["p"], r["m"], r["schedule"]): r for r in rows}
    names = {"gpipe": "GPipe", "1f1b": "1F1B", "zb-h1": "ZB-H1",
             "interleaved-1f1b": "interleaved 1F1B", "zb-v": "ZB-V",
             "dualpipe-v": "DualPipeV"}  # fmt: skip
    head = [names[n] for n in SCHEDULES if n != "gpipe"]
    lines = [
        f"measured on one GPT block (this CPU): F {ratios['F']:.2f} ms, I {ratios['I']:.2f} ms, "
        f"W {ratios['W']:.2f} ms (F : I : W = 1 : {ratios['I'] / ratios['F']:.2f} : "
        f"{ratios['W'] / ratios['F']:.2f}); GPipe's bubble is 1F1B's",
        "",
        "bubble fraction, F : I : W = 1 : 1 : 1 (closed form)",
        "",
        "| p | m | " + " | ".join(head) + " |",
        "| --- | --- |" + " --- |" * len(head),
    ]

    def cell(r: dict[str, Any] | None, label: str, closed: bool) -> str:
        if r is None:
            return "-"
        text = f"{r[label]['bubble']:.3f}"
        if closed and r["closed_form"] is not None:
            text += f" ({r['closed_form']:.3f})"
        return text

    def peak(r: dict[str, Any] | None) -> str:
        if r is None:
            return "-"
        first, last = r["1:1:1"]["peak_first"], r["1:1:1"]["peak_last"]
        return f"{first:g} / {last:g}"

    for label, closed in (("1:1:1", True), ("measured", False)):
        if label == "measured":
            lines += ["", "bubble fraction, the measured ratios", ""]
            lines += [
                "| p | m | " + " | ".join(head) + " |",
                "| --- | --- |" + " --- |" * len(head),
            ]
        for p in STAGES:
            for factor in FACTORS:
                m = factor * p
                cells = [cell(by.get((p, m, n)), label, closed) for n in SCHEDULES if n != "gpipe"]
                lines.append(f"| {p} | {m} | " + " | ".join(cells) + " |")
    every = [names[n] for n in SCHEDULES]
    lines += [
        "",
        "peak activations (micro-batches of a whole stage, rank 0 / last rank)",
        "",
        "| p | m | " + " | ".join(every) + " |",
        "| --- | --- |" + " --- |" * len(every),
    ]
    for p in STAGES:
        for factor in FACTORS:
            m = factor * p
            lines.append(
                f"| {p} | {m} | " + " | ".join(peak(by.get((p, m, n))) for n in SCHEDULES) + " |"
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
