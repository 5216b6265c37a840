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

``--accelerator gpu`` runs the same comparison on one GPU (each step ends with a device
synchronisation on both sides, so a step's time is the GPU's, not the launch queue's), and
``--model gpt`` uses the GPT-like model of ``schedules.py`` (global batch 32 unless given)::

    python benchmarks/overhead.py --accelerator gpu --model gpt   # results/overhead_gpu_gpt.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import schedules
import torch
from machine import cpu_pressure_60s
from schedules import _lightning_module, _quiet, fit_quietly

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = ("plain Trainer", "pipe2bw 1f1b (1 stage)", "pipe2bw 2bw (1 stage)")


def _timed_fit(run: str, batch_size: int, warmup: int, steps: int, accelerator: str) -> float:
    """samples/s of one fit: the median step time over the timed steps."""
    from lightning.pytorch import Callback

    from lightning_pipe2bw import Pipe2BWStrategy

    marks: list[float] = []
    gpu = accelerator == "gpu"

    class Clock(Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            if gpu:
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

    strategy: Any = "auto"
    if run != RUNS[0]:
        schedule = "1f1b" if "1f1b" in run else "2bw"
        strategy = Pipe2BWStrategy(schedule=schedule, microbatches=1)
    fit_quietly(
        _lightning_module(),
        strategy,
        batch_size,
        warmup + steps + 1,
        [Clock()],
        accelerator=accelerator,
    )
    step_s = [b - a for a, b in zip(marks[warmup:], marks[warmup + 1 :], strict=False)]
    return batch_size / statistics.median(step_s)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--batch-size", type=int, help="global batch (128 for mlp, 32 for gpt)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (A B C ...)")
    parser.add_argument("--out", help="JSON path (default results/overhead[_gpu][_gpt].json)")
    args = parser.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 32 if args.model == "gpt" else 128
    if args.out is None:
        tags = [t for t in (args.accelerator, args.model) if t not in ("cpu", "mlp")]
        args.out = str(RESULTS / "_".join(["overhead", *tags])) + ".json"
    schedules.MODEL = args.model
    _quiet()
    # one intra-op thread for every run: the strategy, like Lightning's DDP, sizes the threads
    # of its process unless OMP_NUM_THREADS is set, and the setting would outlive its run
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    pressure = cpu_pressure_60s()
    where = torch.cuda.get_device_name() if args.accelerator == "gpu" else "CPU, one thread"
    # One untimed fit first: a process's first fit pays one-time costs (kernel selection,
    # allocator growth, imports) that would otherwise fall on the first run of round one.
    _timed_fit(RUNS[0], args.batch_size, 1, 2, args.accelerator)
    rates: dict[str, list[float]] = {run: [] for run in RUNS}
    for _ in range(args.rounds):
        for run in RUNS:
            rates[run].append(
                _timed_fit(run, args.batch_size, args.warmup, args.steps, args.accelerator)
            )
    base = rates[RUNS[0]]
    print(
        f"{args.model}, one process ({where}), batch {args.batch_size}, {args.steps} timed steps, "
        f"{args.rounds} interleaved rounds (CPU pressure before: {pressure})"
    )
    print(
        f"{'run':<26} {'median samples/s':>17} {'per-round ratio to plain (median, min-max)':>44}"
    )
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
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "device": where, "runs": table}, indent=2)
    )
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
