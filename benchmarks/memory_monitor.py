"""What ``StageMemoryMonitor`` costs: throughput with and without it, in the same run.

The model, data and timing of ``schedules.py`` (8 residual MLP blocks, width 256, fp32, AdamW) on
2 spawned CPU ranks with ``schedule="2bw"``; the monitor logs every step (its most expensive
setting: one ``all_gather_object`` per step) to a CSV logger. Prints samples/s without and with
it and the ratio, and the per-stage peaks it logged; writes
``benchmarks/results/memory_monitor.json``::

    python benchmarks/memory_monitor.py          # about 30 s on 2 quiet cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ranks import RankPool
from schedules import _env, _quiet, run_ours

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each")
    parser.add_argument("--out", default=str(RESULTS / "memory_monitor.json"))
    args = parser.parse_args(argv)
    _quiet()
    times: dict[bool, list[float]] = {False: [], True: []}
    peaks = None
    with tempfile.TemporaryDirectory() as folder, _env(OMP_NUM_THREADS="1"):
        pool = RankPool(2)
        try:
            for _ in range(args.repeats):
                for monitor in (False, True):
                    ranks = pool.run(
                        run_ours, "2bw", args.microbatches, args.batch_size, args.warmup,
                        args.steps, folder if monitor else None, timeout=600,
                    )  # fmt: skip
                    rank0 = next(r for r in ranks if r["rank"] == 0)
                    times[monitor].append(statistics.median(rank0["step_s"]))
                    peaks = rank0["memory_peaks"] or peaks
        finally:
            pool.close()
    without, with_ = statistics.median(times[False]), statistics.median(times[True])
    print(f"2bw, 2 ranks, batch {args.batch_size}, m={args.microbatches}; median step of "
          f"{args.steps} after {args.warmup}, median of {args.repeats} alternating runs each")  # fmt: skip
    print()
    print("| monitor | step ms | samples/s | ratio |")
    print("| --- | --- | --- | --- |")
    for label, t in (("off", without), ("on, every step", with_)):
        print(f"| {label} | {t * 1e3:.2f} | {args.batch_size / t:.0f} | {without / t:.3f} |")
    print()
    print("per-stage peaks it logged (MiB):")
    for s, figures in enumerate(peaks or []):
        row = ", ".join(
            f"{k} {v / 2**20:.2f}" for k, v in figures.items() if not k.startswith("cuda")
        )
        print(f"  stage {s}: {row}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python benchmarks/memory_monitor.py " + " ".join(sys.argv[1:]),
                "config": vars(args),
                "step_s": {"off": times[False], "on": times[True]},
                "ratio_on_over_off_throughput": without / with_,
                "peaks": peaks,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
