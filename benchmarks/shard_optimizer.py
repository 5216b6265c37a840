"""What sharding the optimizer state over a stage's replicas (``shard_optimizer=True``, ZeRO-1),
or every block's weights, gradients and optimizer state with FSDP2 (``--option fsdp``:
``fsdp=True``), saves in memory and costs in time, on CPU processes over gloo.

Every configuration trains the GPT-like model of ``schedules.py --model gpt`` (8 pre-LN blocks,
width 256, AdamW or ``MuonAdamW``) on d replicas of a 2-stage pipeline (2 d processes, one
thread each), with and without ``shard_optimizer``, in interleaved rounds (reverse order every
other round). Per rank it reports the optimizer state (every tensor the optimizer keeps, with
the delay correction's buffer under 2BW), the strategy's accounted peak (weights and their
second version, gradients, optimizer state and the peak saved activations, as
``StageMemoryMonitor`` counts them) and the process's resident high-water mark, and the median
step after the warm-up; the ratios sharded / unsharded are taken within each round.

    python benchmarks/shard_optimizer.py                  # d = 2, 3 rounds: about 6 minutes
    python benchmarks/shard_optimizer.py --replicas 2,4 --rounds 1 --steps 4   # memory at d = 4
    python benchmarks/shard_optimizer.py --option fsdp --configs 1f1b:adamw,gpipe:adamw \
        --out benchmarks/results/fsdp.json                # FSDP2 inside each stage

The accounted weights and gradients are what the stage's parameters hold after a step (a
DTensor's shard under FSDP); FSDP's transient buffers (a block's gathered weights while it runs,
and the stage's unsharded gradients, which it adds the micro-batches' gradients into until the
batch's last backward) are not in them.

At d = 4 the 8 processes share the 2 cores: its times measure the oversubscription, not the
sharding; its memory figures hold. Writes ``benchmarks/results/shard_optimizer.json``; prints a
table. Nothing here is asserted by tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

os.environ.setdefault("PIPE2BW_BENCH_MODEL", "gpt")  # before schedules reads it

import schedules
from machine import cpu_pressure_60s
from ranks import RankPool

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("1f1b:adamw", "2bw:adamw", "2bw:muon")


def run(
    config: str, shard: bool, replicas: int, batch: int, warmup: int, steps: int, option: str
) -> Any:
    """Runs on every rank: one fit, and this rank's memory figures."""
    import torch
    import torch.distributed as dist

    from lightning_pipe2bw import MuonAdamW, Pipe2BWStrategy, StageMemoryMonitor
    from lightning_pipe2bw.callbacks.memory import stage_memory

    schedules._quiet()
    torch.set_num_threads(1)
    schedule, _, optimizer = config.partition(":")
    model = schedules._lightning_module()
    if optimizer == "muon":
        model.configure_optimizers = lambda: MuonAdamW.for_module(model, lr=1e-2)  # type: ignore[method-assign]
    strategy = Pipe2BWStrategy(
        schedule=schedule, microbatches=4, data_parallel=replicas, **{option: shard}
    )
    timer = schedules._make_timer(warmup, steps)

    class Peaks(StageMemoryMonitor):
        """The largest accounted bytes of this rank over the steps (no logging)."""

        def __init__(self) -> None:
            super().__init__(log_every_n_steps=1, plot=False)
            self.peak = self.optimizer = self.weights_grads = 0

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            m = stage_memory(trainer)
            total = m["weight_versions"] + m["grads"] + m["optimizer_state"] + m["activations_peak"]
            self.peak = max(self.peak, total)
            self.optimizer = max(self.optimizer, m["optimizer_state"])
            self.weights_grads = max(self.weights_grads, m["weight_versions"] + m["grads"])

    peaks = Peaks()
    # each replica reads its own batches: d times as many for the same steps on each
    schedules.fit_quietly(
        model,
        strategy,
        batch,
        warmup + steps,
        [timer, peaks],
        num_batches=replicas * (warmup + steps),
    )
    return {
        "rank": dist.get_rank(),
        "stage": strategy.stage,
        "optimizer_state_bytes": peaks.optimizer,
        "weights_grads_bytes": peaks.weights_grads,
        "accounted_peak_bytes": peaks.peak,
        "step_s": statistics.median(timer.step_s),
        "loss": timer.loss,
    }


def _per_rank(found: list[dict[str, Any]], key: str) -> list[float]:
    """The largest figure ``key`` of each rank over the rounds ``found``."""
    size = len(found[0]["ranks"])
    by_rank = [sorted(x["ranks"], key=lambda k: k["rank"]) for x in found]
    return [max(ranks[i][key] for ranks in by_rank) for i in range(size)]


def _slowest(run_: dict[str, Any]) -> float:
    return float(max(k["step_s"] for k in run_["ranks"]))


def summarize(runs: list[dict[str, Any]], d: int, config: str) -> dict[str, Any]:
    """One row of the table: ``config`` at width ``d``, without and with sharding."""
    off, on = (
        [x for x in runs if (x["d"], x["config"], x["shard"]) == (d, config, shard)]
        for shard in (False, True)
    )
    ratios = [_slowest(b) / _slowest(a) for a, b in zip(off, on, strict=True)]
    return {
        "d": d,
        "config": config,
        "optimizer_state_bytes": [_per_rank(x, "optimizer_state_bytes") for x in (off, on)],
        "weights_grads_bytes": [_per_rank(x, "weights_grads_bytes") for x in (off, on)],
        "accounted_peak_bytes": [_per_rank(x, "accounted_peak_bytes") for x in (off, on)],
        "step_s": [statistics.median(_slowest(r) for r in x) for x in (off, on)],
        "step_ratio": statistics.median(ratios),
        "step_ratio_range": [min(ratios), max(ratios)],
    }


def _pair(values: list[list[float]]) -> str:
    off, on = (" / ".join(f"{v / 2**20:.1f}" for v in x) for x in values)
    return f"{off} -> {on}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="2", help="data-parallel widths d, comma separated")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument(
        "--option", choices=("shard_optimizer", "fsdp"), default="shard_optimizer",
        help="the strategy option each configuration runs without and with",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per replica")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/shard_optimizer.json"
    )
    ns = parser.parse_args()
    widths = [int(x) for x in ns.replicas.split(",")]
    configs = ns.configs.split(",")
    pressure = cpu_pressure_60s()
    runs: list[dict[str, Any]] = []
    for d in widths:
        pool = RankPool(2 * d, run_id="shard", initializer=schedules._quiet)
        try:
            for r in range(ns.rounds):
                order = [(c, s) for c in configs for s in (False, True)]
                for config, shard in order if r % 2 == 0 else order[::-1]:
                    print(f"d={d} round {r + 1}/{ns.rounds}: {config} {ns.option}={shard}", flush=True)
                    ranks = pool.run(
                        run, config, shard, d, ns.batch_size, ns.warmup, ns.steps, ns.option
                    )
                    runs.append(
                        {"d": d, "config": config, "shard": shard, "round": r, "ranks": ranks}
                    )
        finally:
            pool.close()
    print()
    print(
        f"| d | configuration ({ns.option}) | weights + gradients MiB per rank (off -> on) | "
        "optimizer state MiB per rank (off -> on) | accounted peak MiB (off -> on) | step s "
        "(off -> on) | step on / off (rounds) |"
    )
    print("| ---: | --- | --- | --- | --- | --- | ---: |")
    rows = [summarize(runs, d, config) for d in widths for config in configs]
    for row in rows:
        low, high = row["step_ratio_range"]
        print(
            f"| {row['d']} | `{row['config']}` | {_pair(row['weights_grads_bytes'])} | "
            f"{_pair(row['optimizer_state_bytes'])} | "
            f"{_pair(row['accounted_peak_bytes'])} | {row['step_s'][0]:.3f} -> "
            f"{row['step_s'][1]:.3f} | {row['step_ratio']:.3f} ({low:.2f}-{high:.2f}) |"
        )
    note = f"{ns.option}: {ns.rounds} rounds, {ns.steps} timed steps after {ns.warmup}; CPU pressure before: {pressure}"
    print(note)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"note": note, "rows": rows, "runs": runs}, indent=1) + "\n")
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
