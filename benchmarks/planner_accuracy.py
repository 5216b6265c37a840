"""Measured vs predicted: the planner's step time against real runs on this machine.

For several plans (schedule, depth d, micro-batches m) the same model as ``schedules.py`` (8
residual MLP blocks, width 256, fp32, AdamW) is

* profiled once, the way ``balance="auto"`` does it: on two ranks at the same time (one
  intra-op thread each, so that the figures include what two processes on this machine cost
  each other), rank 0's figures: per-block forward and backward time and bytes at every
  micro-batch size the plans use, and the AdamW update of each block
  (``lightning_pipe2bw.planner.measure``);
* predicted by the cost model (``lightning_pipe2bw.planner.planner.predict``) on a cluster of
  d devices with the point-to-point bandwidth and per-message latency measured between two
  ranks here, and the training loop's own cost per step (``Cluster.step_overhead_s``) measured
  apart, per schedule: a one-rank run of a one-block model, its step time less its compute;
* measured: a real ``Trainer`` with ``Pipe2BWStrategy`` on d spawned CPU ranks (one thread
  each); the median step time on global rank 0 after the warm-up steps.

It prints one table (predicted and measured step time, error) and the median absolute error,
and writes the data to ``benchmarks/results/planner_accuracy.json``::

    python benchmarks/planner_accuracy.py            # batch 128: about a minute on 2 cores
    python benchmarks/planner_accuracy.py --batch-size 32 --steps 30   # small micro-batches

Four ranks on a 2-core machine share cores, which the model (one device per stage) does not
know: those rows are marked and left out of the headline median. Nothing here is asserted by
tests.
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

import torch
from machine import cpu_pressure_60s
from ranks import RankPool
from schedules import LR, WIDTH, _env, _quiet, make_body, run_ours

from lightning_pipe2bw.planner.autoplan import measure_bandwidth, measure_latency
from lightning_pipe2bw.planner.costmodel import Cluster
from lightning_pipe2bw.planner.measure import profile_sizes
from lightning_pipe2bw.planner.planner import predict
from lightning_pipe2bw.planner.profile import ProfileSet

RESULTS = Path(__file__).resolve().parent / "results"
# (schedule, depth, micro-batches)
PLANS = [
    ("2bw", 2, 2),
    ("2bw", 2, 4),
    ("2bw", 2, 8),
    ("1f1b", 2, 4),
    ("gpipe", 2, 8),
    ("1f1b", 4, 4),
    ("2bw", 4, 8),
    # two stages per rank (planned by partition.virtualplan: timed by simulation)
    ("interleaved-1f1b", 2, 4),
    ("zb-v", 2, 4),
    ("2bw-v", 2, 8),
]
VIRTUAL = ("interleaved-1f1b", "zb-v", "2bw-v")


def _link() -> tuple[float, float, float]:
    device = torch.device("cpu")
    latency, send = measure_latency(device, 1)
    return measure_bandwidth(device, 1), latency, send


def loop_overhead(schedule: str, m: int, batch_size: int, warmup: int, steps: int) -> float:
    """Runs on one rank: seconds per step outside the compute actions, with a one-block model
    (the loop, the strategy's bookkeeping and the block's tiny update); two blocks for the
    schedules with two stages per rank (one each)."""
    result = run_ours(
        schedule, m, batch_size, warmup, steps, blocks=2 if schedule in VIRTUAL else 1
    )
    compute = result["compute_s"] / max(result["steps"], 1)
    return max(statistics.median(result["step_s"]) - compute, 0.0)


def profile(batch_size: int, plans: Sequence[tuple[str, int, int]], repeats: int) -> str:
    """Runs on every rank: the profile as JSON (only rank 0's is used)."""
    sizes = sorted({batch_size // m for _, _, m in plans})
    profiles = profile_sizes(
        make_body(),
        lambda b: torch.randn(b, WIDTH),
        sizes,
        warmup=3,
        repeats=repeats,
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR),
    )
    return profiles.to_json()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=15, help="profiler repeats per block")
    parser.add_argument("--out", default=str(RESULTS / "planner_accuracy.json"))
    args = parser.parse_args(argv)
    _quiet()
    started = time.perf_counter()
    load_before = cpu_pressure_60s()

    with _env(OMP_NUM_THREADS="1"):
        pool = RankPool(2)
        try:
            profiles = ProfileSet.from_json(
                pool.run(profile, args.batch_size, PLANS, args.repeats, timeout=600)[0]
            )
            bandwidth, latency, send = pool.run(_link)[0]
        finally:
            pool.close()
        one = RankPool(1)
        try:
            overhead = {
                name: one.run(
                    loop_overhead, name, 4, args.batch_size, args.warmup, args.steps, timeout=600
                )[0]
                for name in sorted({schedule for schedule, _, _ in PLANS})
            }
        finally:
            one.close()
    print(
        f"between two ranks: {bandwidth / 1e9:.2f} GB/s, {latency * 1e3:.2f} ms per message, "
        f"{send * 1e3:.3f} ms of it in the send call "
        "(the pipeline's transport)"
    )
    print(
        "the loop's own cost per step (one rank, one block, less its compute): "
        + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in overhead.items())
    )

    rows: list[dict[str, Any]] = []
    pools: dict[int, RankPool] = {}
    try:
        for schedule, depth, m in PLANS:
            k = 2 if schedule in VIRTUAL else 1  # stages per rank
            cluster = Cluster(
                num_devices=depth,
                devices_per_node=depth,
                memory_bytes=8 * 2**30,
                intra_node_bandwidth=bandwidth,
                inter_node_bandwidth=bandwidth,
                latency_s=latency,
                send_s=send,
                step_overhead_s=overhead[schedule],
            )
            plan = predict(
                profiles,
                cluster,
                args.batch_size,
                schedule=schedule,
                depth=depth,
                microbatch_size=args.batch_size // m,
                balance=[8 // (k * depth)] * (k * depth),
            )
            if depth not in pools:
                with _env(OMP_NUM_THREADS="1"):
                    pools[depth] = RankPool(depth)
            ranks = pools[depth].run(
                run_ours, schedule, m, args.batch_size, args.warmup, args.steps, timeout=600
            )
            rank0 = next(r for r in ranks if r["rank"] == 0)
            measured = statistics.median(rank0["step_s"])
            steps = max(rank0["steps"], 1)
            # where rank 0's (the last stage's) step went, per step: compute, waiting in receives,
            # sends, and the rest (optimizer update, Lightning's loop, logging)
            split = {
                "compute_s": rank0["compute_s"] / steps,
                "recv_s": rank0["recv_s"] / steps,
                "send_s": rank0["send_s"] / steps,
            }
            split["other_s"] = rank0["wall_s"] / steps - sum(split.values())
            # the last stage's own blocks at this micro-batch size: forwards and backwards, and
            # (apart) the optimizer update, which the model spreads over the micro-batches
            blocks = profiles.at(args.batch_size // m).blocks[-(8 // (k * depth)) :]
            predicted_compute = m * sum(b.forward_s + b.backward_s for b in blocks)
            predicted_update = sum(b.update_s for b in blocks)
            error = (plan.step_time - measured) / measured
            shared = depth > (os.cpu_count() or 1)
            rows.append(
                {
                    "schedule": schedule,
                    "depth": depth,
                    "microbatches": m,
                    "microbatch_size": args.batch_size // m,
                    "predicted_step_s": plan.step_time,
                    "measured_step_s": measured,
                    "error": error,
                    "cores_shared": shared,
                    "measured_split": split,
                    "predicted_compute_s": predicted_compute,
                    "predicted_update_s": predicted_update,
                    "plan": plan.to_dict(),
                }
            )
            print(
                f"{schedule:>5} d={depth} m={m}: predicted {plan.step_time * 1e3:7.2f} ms, "
                f"measured {measured * 1e3:7.2f} ms ({error:+.0%})",
                flush=True,
            )
    finally:
        for pool in pools.values():
            pool.close()

    headline = [abs(r["error"]) for r in rows if not r["cores_shared"]]
    everything = [abs(r["error"]) for r in rows]
    print()
    print(
        f"Measured vs predicted step time, batch {args.batch_size}, median over "
        f"{args.steps} steps after {args.warmup} (rank 0)"
    )
    print()
    print(
        "| schedule | d | m | b | predicted ms | measured ms | error | last stage: predicted "
        "compute + update ms | measured compute / recv wait / send / other ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        mark = " (cores shared)" if r["cores_shared"] else ""
        x = {k: v * 1e3 for k, v in r["measured_split"].items()}
        print(
            f"| {r['schedule']} | {r['depth']} | {r['microbatches']} | {r['microbatch_size']} | "
            f"{r['predicted_step_s'] * 1e3:.2f} | {r['measured_step_s'] * 1e3:.2f} | "
            f"{r['error']:+.0%}{mark} | {r['predicted_compute_s'] * 1e3:.1f} + "
            f"{r['predicted_update_s'] * 1e3:.1f} | "
            f"{x['compute_s']:.1f} / {x['recv_s']:.1f} / {x['send_s']:.1f} / {x['other_s']:.1f} |"
        )
    print()
    print(
        f"median |error|: {statistics.median(headline):.0%} over the {len(headline)} plans with "
        f"a core per rank; {statistics.median(everything):.0%} over all {len(rows)}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python benchmarks/planner_accuracy.py " + " ".join(sys.argv[1:]),
                "config": vars(args),
                "bandwidth_bytes_per_s": bandwidth,
                "latency_s": latency,
                "send_s": send,
                "step_overhead_s": overhead,
                "profile": json.loads(profiles.to_json()),
                "rows": rows,
                "median_abs_error": statistics.median(headline),
                "median_abs_error_all": statistics.median(everything),
                "cpu_pressure_before": load_before,
                "cpu_pressure_after": cpu_pressure_60s(),
                "seconds": time.perf_counter() - started,
            },
            indent=1,
        )
    )
    print(f"wrote {out}; total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
