"""Peak saved activations per rank with two stages per rank, against one stage per rank.

The model and data of ``schedules.py`` (8 equal residual MLP blocks, width 256, fp32, AdamW) on
4 CPU ranks (one intra-op thread each), m = 8 micro-batches of a batch of 32. For each schedule
it prints every rank's peak bytes saved for backward (``engine.stats.peak_activation_bytes``,
counted exactly through saved_tensors_hooks, both stages of a rank together) and the max / min
ratio over ranks. A V (``zb-v``: rank r holds stages r and 2p - 1 - r) stashes about as much on
every rank by its placement alone; 1F1B's first stage stashes p micro-batches, its last one,
which BPipe (``balance_activations=True``) evens out by moving activations between ranks.

Writes ``benchmarks/results/virtual_memory.json``::

    python benchmarks/virtual_memory.py     # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import schedules
from ranks import RankPool
from schedules import _env, run_ours

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = 4
RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "1f1b": ("1f1b", {}),
    "2bw": ("2bw", {}),
    "1f1b + BPipe": ("1f1b", {"balance_activations": True}),
    "2bw + BPipe": ("2bw", {"balance_activations": True}),
    "interleaved-1f1b": ("interleaved-1f1b", {}),
    "zb-v": ("zb-v", {}),
}


def run_own_batches(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """``run_ours`` with each batch in its own storage: ``schedules.Batches`` hands out slices
    of the whole data set, which the first stage's input and the last stage's target would keep
    alive (and the stash would count) in full."""

    def own(self: Any, index: int) -> tuple[Any, ...]:
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return tuple(t[rows].clone() for t in self.tensors)

    schedules.Batches.__getitem__ = own  # type: ignore[method-assign]
    return run_ours(*args, **kwargs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    with _env(OMP_NUM_THREADS="1"):
        pool = RankPool(RANKS)
        try:
            for label, (schedule, kwargs) in RUNS.items():
                ranks = pool.run(
                    run_own_batches, schedule, args.microbatches, args.batch_size, 1, args.steps,
                    timeout=600, **kwargs,
                )  # fmt: skip
                by_place = sorted(ranks, key=lambda r: r["stage"])
                peaks = [r["peak_activation_bytes"] for r in by_place]
                results[label] = {
                    "peak_activation_bytes": peaks,
                    "max_over_min": max(peaks) / min(peaks),
                    "final_loss": by_place[0]["final_loss"],
                }
        finally:
            pool.close()
    print(
        f"{RANKS} ranks, batch {args.batch_size}, m = {args.microbatches}: peak saved activations "
        "per rank (MiB), by the rank's place in the pipeline"
    )
    print()
    print("| schedule | " + " | ".join(f"rank at place {s}" for s in range(RANKS)) + " | max/min |")
    print("|---|" + "---:|" * (RANKS + 1))
    for label, entry in results.items():
        cells = " | ".join(f"{b / 2**20:.2f}" for b in entry["peak_activation_bytes"])
        print(f"| {label} | {cells} | {entry['max_over_min']:.2f} |")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "virtual_memory.json"
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
