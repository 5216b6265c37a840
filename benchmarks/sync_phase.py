"""How fast is 2BW's synchronous start (``sync_steps``) against 1F1B?

``benchmarks/convergence.py`` times a synchronous start's steps as 1F1B's: each synchronous 2BW
batch runs 1F1B's actions and is drained in its own step, through 2BW's driver and weight
versions. This checks that assumption: interleaved rounds of 2-stage runs of the main job's GPT
(Muon at 1.6e-2), 1F1B against 2BW that stays synchronous for the whole run, the median step
after the tenth of each run.

    python benchmarks/sync_phase.py --rounds 3

Writes ``benchmarks/results/sync_phase.json``; prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import convergence

CONFIGS = ("1f1b:muon", "2bw-update_feedback/sync=1000000:muon")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=convergence.DEFAULT_OUT / "sync_phase.json")
    ns = parser.parse_args()
    args = dict(
        steps=ns.steps, microbatches=4, batch_size=32, block_size=128, n_layer=4, n_head=4,
        n_embd=128, weight_decay=0.1, warmup=ns.steps // 10, max_bytes=6_000_000,
        val_every=ns.steps, val_batches=2, seed=0,
    )  # fmt: skip
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for round_ in range(ns.rounds):
        for config in CONFIGS if round_ % 2 == 0 else CONFIGS[::-1]:
            result = convergence.train(config, 1.6e-2, 2, args)
            times[config].append(result["median_step_seconds"])
    medians = {c: statistics.median(v) for c, v in times.items()}
    ratio = medians[CONFIGS[1]] / medians[CONFIGS[0]]
    print("| configuration | ms / step per round | median | vs 1f1b |")
    print("| --- | --- | --- | --- |")
    for config, values in times.items():
        rounds = ", ".join(f"{1000 * v:.1f}" for v in values)
        rel = medians[config] / medians[CONFIGS[0]]
        print(f"| {config} | {rounds} | {1000 * medians[config]:.1f} | {rel:.2f}x |")
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(
        json.dumps(
            {"settings": args, "seconds": times, "medians": medians, "ratio": ratio}, indent=1
        )
        + "\n"
    )
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
