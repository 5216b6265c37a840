"""BPipe activation balancing: per-stage peak activation memory and throughput, without and with.

The model, data and timing of ``schedules.py`` (8 equal residual MLP blocks, width 256, fp32,
AdamW; 2 blocks per stage) on 4 spawned CPU ranks with one intra-op thread each. For each
schedule (``--schedules``, 1f1b and 2bw) it runs ``Pipe2BWStrategy`` without and with
``balance_activations=True``, alternating, ``--repeats`` times, and prints

* per stage, the peak bytes saved for backward (``engine.stats.peak_activation_bytes``, counted
  exactly, including the bytes a stage holds for its partner), without and with balancing, and
  the max / min ratio over stages of each;
* samples/s (batch size / median step time of global rank 0, median over the repeats) without
  and with, and the ratio.

Writes ``benchmarks/results/balancer.json`` and ``balancer.png`` (per-stage peaks, one panel per
schedule)::

    python benchmarks/balancer.py     # about 1 minute on 2 cores (58 s measured)

Four ranks oversubscribe 2 cores, so a rank-0 step time swings by 1.5-2x from one run to the next
(how the OS shares the cores); hence 5 alternating repeats by default (2 took 52 s but gave
throughput ratios of 1.21 and 0.78 that the next run did not reproduce). Peak bytes are exact
and identical in every repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from machine import cpu_pressure_60s
from ranks import RankPool
from schedules import OUR_SCHEDULES, _env, _quiet, run_ours

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = 4
MODES = {False: "without", True: "with"}


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f}"


def _ratio(values: Sequence[int]) -> float:
    return max(values) / min(values) if min(values) > 0 else float("inf")


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Every run, alternating without and with balancing; per schedule and mode the rank-0
    median step times (one per repeat) and the per-stage peaks (one list per repeat)."""
    results: dict[str, Any] = {
        s: {MODES[b]: {"step_s": [], "peaks": [], "runs": []} for b in MODES}
        for s in args.schedules
    }
    with _env(OMP_NUM_THREADS="1"):
        pool = RankPool(RANKS)
        try:
            for _ in range(args.repeats):
                for schedule in args.schedules:
                    for balanced in MODES:
                        kwargs = {"balance_activations": True} if balanced else {}
                        ranks = pool.run(
                            run_ours, schedule, args.microbatches, args.batch_size,
                            args.warmup, args.steps, timeout=600, **kwargs,
                        )  # fmt: skip
                        by_stage = sorted(ranks, key=lambda r: r["stage"])
                        rank0 = next(r for r in ranks if r["rank"] == 0)
                        entry = results[schedule][MODES[balanced]]
                        entry["step_s"].append(statistics.median(rank0["step_s"]))
                        entry["peaks"].append([r["peak_activation_bytes"] for r in by_stage])
                        entry["runs"].append(
                            [
                                {
                                    "rank": r["rank"],
                                    "stage": r["stage"],
                                    "peak_activation_bytes": r["peak_activation_bytes"],
                                    "peak_inflight": r["peak_inflight"],
                                    "median_step_s": statistics.median(r["step_s"]),
                                    "final_loss": r["final_loss"],
                                }
                                for r in by_stage
                            ]
                        )
        finally:
            pool.close()
    problems = []
    for schedule, modes in results.items():
        for mode, entry in modes.items():
            if any(p != entry["peaks"][0] for p in entry["peaks"]):
                problems.append(
                    f"{schedule} {mode}: peaks differ between repeats: {entry['peaks']}"
                )
            entry["peak_activation_bytes"] = entry["peaks"][0]
            entry["median_step_s"] = statistics.median(entry["step_s"])
            entry["samples_per_s"] = args.batch_size / entry["median_step_s"]
            entry["max_over_min"] = _ratio(entry["peak_activation_bytes"])
        modes["throughput_ratio_with_over_without"] = (
            modes["with"]["samples_per_s"] / modes["without"]["samples_per_s"]
        )
        losses = {
            mode: [r["final_loss"] for run in modes[mode]["runs"] for r in run if r["rank"] == 0]
            for mode in MODES.values()
        }
        if losses["with"] != losses["without"]:
            problems.append(f"{schedule}: final losses differ without and with: {losses}")
    return results, problems


def report(args: argparse.Namespace, results: dict[str, Any], problems: list[str]) -> None:
    print(
        f"{RANKS} ranks (1 thread each) on {len(os.sched_getaffinity(0))} cores, batch "
        f"{args.batch_size}, m={args.microbatches}; median step of rank 0 over {args.steps} after "
        f"{args.warmup}, median of {args.repeats} alternating runs each"
    )
    for schedule, modes in results.items():
        without, with_ = modes["without"], modes["with"]
        print()
        print(f"### {schedule}: peak saved activations per stage (MiB)")
        print()
        print("| stage | without | with | with / without |")
        print("| --- | --- | --- | --- |")
        pairs = zip(without["peak_activation_bytes"], with_["peak_activation_bytes"], strict=True)
        for stage, (a, b) in enumerate(pairs):
            print(f"| {stage} | {_mib(a)} | {_mib(b)} | {b / a:.3f} |")
        top_a, top_b = max(without["peak_activation_bytes"]), max(with_["peak_activation_bytes"])
        print(f"| max | {_mib(top_a)} | {_mib(top_b)} | {top_b / top_a:.3f} |")
        print(f"| max / min | {without['max_over_min']:.2f} | {with_['max_over_min']:.2f} | |")
        print()
        print("| balancing | step ms | samples/s |")
        print("| --- | --- | --- |")
        for label, entry in (("without", without), ("with", with_)):
            print(
                f"| {label} | {entry['median_step_s'] * 1e3:.1f} | {entry['samples_per_s']:.0f} |"
            )
        print()
        print(
            f"throughput with / without: {modes['throughput_ratio_with_over_without']:.3f} "
            f"(rank-0 medians per repeat, ms: without "
            f"{', '.join(f'{t * 1e3:.1f}' for t in without['step_s'])}; with "
            f"{', '.join(f'{t * 1e3:.1f}' for t in with_['step_s'])})"
        )
    print()
    for problem in problems:
        print(f"WARNING: {problem}")
    if not problems:
        print(
            "peaks identical across repeats; rank 0's final loss identical without and with "
            "balancing in every run"
        )


def plot(results: dict[str, Any], path: Path, title: str) -> None:
    """Grouped bars of per-stage peak activation MiB, without vs with, one panel per schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False, sharey=True
    )
    width = 0.38
    for ax, (schedule, modes) in zip(axes[0], results.items(), strict=True):
        for i, (mode, color) in enumerate((("without", "tab:gray"), ("with", "tab:green"))):
            peaks = [v / 2**20 for v in modes[mode]["peak_activation_bytes"]]
            xs = [s + (i - 0.5) * width for s in range(len(peaks))]
            bars = ax.bar(xs, peaks, width, color=color, label=f"{mode} balancing")
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(RANKS))
        ax.set_xlabel("pipeline stage")
        ax.set_ylabel("peak saved activations (MiB)")
        ax.set_title(
            f"{schedule}: max/min {modes['without']['max_over_min']:.2f} -> "
            f"{modes['with']['max_over_min']:.2f}, throughput x"
            f"{modes['throughput_ratio_with_over_without']:.2f}",
            fontsize=10,
        )
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", default="1f1b,2bw", help="comma separated")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs of each")
    parser.add_argument("--out", default=str(RESULTS / "balancer.json"))
    parser.add_argument("--plot", default=str(RESULTS / "balancer.png"))
    args = parser.parse_args(argv)
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = set(args.schedules) - set(OUR_SCHEDULES)
    if unknown:
        parser.error(f"unknown schedules {sorted(unknown)}; choose from {OUR_SCHEDULES}")
    if args.batch_size % args.microbatches:
        parser.error(f"--batch-size {args.batch_size} is not divisible by {args.microbatches}")
    _quiet()
    load_before = {"loadavg_1m": os.getloadavg()[0], "cpu_pressure_60s": cpu_pressure_60s()}
    started = time.perf_counter()
    results, problems = measure(args)
    runtime = time.perf_counter() - started
    load_after = {"loadavg_1m": os.getloadavg()[0], "cpu_pressure_60s": cpu_pressure_60s()}
    report(args, results, problems)
    print(
        f"load average before {load_before['loadavg_1m']:.2f}, after "
        f"{load_after['loadavg_1m']:.2f}; runtime {runtime:.0f} s"
    )
    title = (
        f"BPipe activation balancing, {RANKS} CPU ranks, 8 x residual MLP (width 256), "
        f"batch {args.batch_size}, m={args.microbatches}"
    )
    plot(results, Path(args.plot), title)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python benchmarks/balancer.py " + " ".join(sys.argv[1:]),
                "config": {**vars(args), "ranks": RANKS},
                "runtime_s": runtime,
                "load_before": load_before,
                "load_after": load_after,
                "problems": problems,
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out} and {args.plot}")


if __name__ == "__main__":
    main()
