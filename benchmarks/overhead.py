"""The strategy's own cost on one device: a plain single-device ``Trainer`` against
``Pipe2BWStrategy`` with one stage (``devices=1``), same model, data and optimizer, in the same
run, interleaved over several rounds (the machine drifts 15-25% between runs).

The model and data of ``schedules.py`` (8 residual MLP blocks, width 256, fp32, AdamW), one
intra-op thread, one process. The pipeline runs one micro-batch per batch (``microbatches=1``:
the same computation as the plain Trainer) with the flush schedule (``1f1b``) and with ``2bw``
(which on one stage keeps one weight version and applies each update one step late). Prints the
median samples/s of each and, per round, the ratio to the plain Trainer of the same round;
writes ``benchmarks/results/overhead.json``::

    python benchmarks/overhead.py              # about a minute on 2 quiet cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from machine import cpu_pressure_60s
from schedules import _lightning_module, _quiet, fit_quietly

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = ("plain Trainer", "pipe2bw 1f1b (1 stage)", "pipe2bw 2bw (1 stage)")


def _timed_fit(run: str, batch_size: int, warmup: int, steps: int) -> float:
    """samples/s of one fit: the median step time over the timed steps."""
    from lightning.pytorch import Callback

    from lightning_pipe2bw import Pipe2BWStrategy

    marks: list[float] = []

    class Clock(Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            marks.append(time.perf_counter())

    strategy: Any = "auto"
    if run != RUNS[0]:
        schedule = "1f1b" if "1f1b" in run else "2bw"
        strategy = Pipe2BWStrategy(schedule=schedule, microbatches=1)
    fit_quietly(_lightning_module(), strategy, batch_size, warmup + steps + 1, [Clock()])
    step_s = [b - a for a, b in zip(marks[warmup:], marks[warmup + 1 :], strict=False)]
    return batch_size / statistics.median(step_s)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (A B C ...)")
    parser.add_argument("--out", default=str(RESULTS / "overhead.json"))
    args = parser.parse_args(argv)
    _quiet()
    torch.set_num_threads(1)
    pressure = cpu_pressure_60s()
    rates: dict[str, list[float]] = {run: [] for run in RUNS}
    for _ in range(args.rounds):
        for run in RUNS:
            rates[run].append(_timed_fit(run, args.batch_size, args.warmup, args.steps))
    base = rates[RUNS[0]]
    print(
        f"one process, one thread, batch {args.batch_size}, {args.steps} timed steps, "
        f"{args.rounds} interleaved rounds (CPU pressure before: {pressure})"
    )
    print(f"{'run':<26} {'median samples/s':>17} {'per-round ratio to plain (median, min-max)':>44}")
    table = []
    for run in RUNS:
        ratios = [r / b for r, b in zip(rates[run], base, strict=True)]
        row = {
            "run": run,
            "samples_per_s": rates[run],
            "median": statistics.median(rates[run]),
            "ratio_per_round": ratios,
            "ratio_median": statistics.median(ratios),
        }
        table.append(row)
        print(
            f"{run:<26} {row['median']:>17.0f} {row['ratio_median']:>30.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f})"
        )
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": table}, indent=2))
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
