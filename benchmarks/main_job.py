"""The main job itself under several configurations: throughput, final loss and each stage's idle
share, as ``make train`` prints them.

Every configuration is the main job (``python -m lightning_pipe2bw.train``) with Hydra overrides,
run whole (200 steps, its validations and checkpoint) in interleaved rounds, in reverse order
every other round (the machine drifts). From each run it reads what the job wrote: ``result.json``
(samples per second of training, final validation loss) and ``stages.json`` (the stage table:
idle and receive shares per stage over the whole recorded timeline). The table gives the medians
over the rounds and each configuration's throughput over the first one's, taken within a round.

    python benchmarks/main_job.py --rounds 3
    python benchmarks/main_job.py --rounds 3 --configs "strategy=1f1b" "strategy=2bw" \
        "strategy.schedule=zb-v strategy.balance=params"

Writes ``benchmarks/results/main_job.json``; prints a table. Nothing here is asserted by tests.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from machine import cpu_pressure_60s

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = (
    "strategy=1f1b",
    "strategy=2bw",
    "strategy.schedule=zb-h1",
    "strategy.schedule=zb-v strategy.balance=params",
    "strategy.schedule=dualpipe-v strategy.balance=params",
    "strategy.schedule=interleaved-1f1b strategy.balance=params",
)


def launch(config: str, out: Path, *extra: str) -> None:
    """Run the main job whole with ``config``'s overrides and ``extra`` ones, its output in
    ``out`` (no progress bar); raise with the end of its stderr if it fails."""
    cmd = [sys.executable, "-m", "lightning_pipe2bw.train", *shlex.split(config)]
    cmd += [f"hydra.run.dir={out}", "trainer.enable_progress_bar=false", *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{config!r} failed:\n{done.stderr[-3000:]}")


def interleaved(configs: Sequence[str], rounds: int) -> Iterator[tuple[int, int, str]]:
    """(round, position, configuration) for every run of ``rounds`` interleaved rounds, each
    round in the reverse order of the one before (the machine drifts); announces each run."""
    for r in range(rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for i, config in enumerate(order):
            print(f"round {r + 1}/{rounds}: {config or '(defaults)'}", flush=True)
            yield r, i, config


def run(config: str, out: Path) -> dict[str, Any]:
    """One whole run of the main job with ``config``'s overrides, its output in ``out``."""
    start = time.perf_counter()
    launch(config, out)
    result = json.loads((out / "result.json").read_text())
    stages = json.loads((out / "stages.json").read_text())
    return {
        "config": config,
        "wall_s": time.perf_counter() - start,
        "samples_per_s": result["samples_per_s"],
        "train_s": result["train_s"],
        "val_loss": result["val_loss"],
        "stages": [
            {k: s[k] for k in ("stage", "rank", "blocks", "idle", "recv", "compute_s", "wall_s")}
            for s in sorted(stages, key=lambda s: s["stage"])
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/main_job.json")
    ns = parser.parse_args()
    pressure = cpu_pressure_60s()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r, i, config in interleaved(ns.configs, ns.rounds):
            result = run(config, Path(tmp) / f"r{r}c{i}")
            result["round"] = r
            runs.append(result)
    first = ns.configs[0]
    rows = []
    print()
    print(
        "| configuration | samples/s | / first (rounds) | final val loss | idle % per stage | recv % per stage |"
    )
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for config in ns.configs:
        mine = [x for x in runs if x["config"] == config]
        ratios = []
        for x in mine:
            base = next(y for y in runs if y["config"] == first and y["round"] == x["round"])
            ratios.append(x["samples_per_s"] / base["samples_per_s"])
        n_stages = len(mine[0]["stages"])
        idle = [statistics.median(x["stages"][s]["idle"] for x in mine) for s in range(n_stages)]
        recv = [statistics.median(x["stages"][s]["recv"] for x in mine) for s in range(n_stages)]
        row = {
            "config": config,
            "samples_per_s": statistics.median(x["samples_per_s"] for x in mine),
            "vs_first": statistics.median(ratios),
            "vs_first_range": [min(ratios), max(ratios)],
            "val_loss": statistics.median(x["val_loss"] for x in mine),
            "idle": idle,
            "recv": recv,
            "blocks": [s["blocks"] for s in mine[0]["stages"]],
        }
        rows.append(row)
        print(
            f"| `{config}` | {row['samples_per_s']:.1f} | {row['vs_first']:.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {row['val_loss']:.4f} | "
            + " / ".join(f"{100 * v:.1f}" for v in idle)
            + " | "
            + " / ".join(f"{100 * v:.1f}" for v in recv)
            + " |"
        )
    note = f"{ns.rounds} rounds; CPU pressure before: {pressure}"
    print(note)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"note": note, "rows": rows, "runs": runs}, indent=1) + "\n")
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
