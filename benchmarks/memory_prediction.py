"""The planner's per-rank peak memory against the peak each rank measures: unsharded, ZeRO-1
(``shard_optimizer=True``) and FSDP2 (``fsdp=True``), under ``1f1b`` and ``2bw``, on d
replicas of a 2-stage pipeline (2 d CPU processes over gloo, one thread each).

Every configuration trains the GPT-like model of ``schedules.py --model gpt`` (8 pre-LN blocks
of width 256, sequence 128, AdamW) for a few steps.

* **Measured.** Each rank's peak resident memory over its training, above what it held when
  training started, plus the stage's weights then (``/proc/self/status``: ``VmHWM``, reset at
  the first batch through ``/proc/self/clear_refs`` and read at each batch's end, less ``VmRSS``
  at the first batch; after fit every rank receives the whole trained body back, which is not
  training's memory). Each rank sets
  glibc's mmap threshold to 64 KiB first (``mallopt``), so that every tensor larger than that
  is mapped when allocated and unmapped when freed, and resident memory follows the tensors
  the rank holds; the pool runs one untimed fit first, so that what every fit reuses (the
  transport's shared-memory rings, 8 MiB a channel, and the process groups) is resident before
  the first measured one. This counts what the planner models and also what it leaves out:
  the optimizer's temporaries in its step, allocator and Python overheads. (``torch.profiler``'s
  memory events were tried first: they miss allocations and frees made on the collectives'
  threads, and their running sum drifted by the gathers' buffers from step to step, against a
  steady census of live tensors.)
* **Predicted.** The planner's cost model (``planner.costmodel.CostModel``, as
  ``balance="auto"`` uses it) on a profile of the same blocks at the run's micro-batch size
  (``planner.measure.profile_blocks``), for the split the run used: the stage memory of each
  stage (weights by version, gradients, optimizer state by its sharding, stashed activations by
  the schedule's in-flight micro-batches, receive buffers, FSDP's gathered blocks).
* **Accounted.** ``StageMemoryMonitor``'s figures for the same rank (weights and their second
  version, gradients, optimizer state, the peak stashed activations), for reference.

    python benchmarks/memory_prediction.py                      # d = 2: about 4 minutes
    python benchmarks/memory_prediction.py --replicas 1 --configs 1f1b:none,2bw:none

Each configuration runs ``--rounds`` times (the peak's moment varies a little with the ranks'
timing); a stage's measured peak is the largest of its replicas' over the rounds. Prints a table
of predicted / measured per stage and writes
``benchmarks/results/memory_prediction.json``. Nothing here is asserted by tests.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("PIPE2BW_BENCH_MODEL", "gpt")  # before schedules reads it

import schedules
from ranks import RankPool

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = (
    "1f1b:none", "1f1b:shard_optimizer", "1f1b:fsdp", "2bw:none", "2bw:shard_optimizer",
)  # fmt: skip
OPTIONS = ("none", "shard_optimizer", "fsdp")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _memory_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measured_fit(model: Any, strategy: Any, batch: int, steps: int, replicas: int,
                 data: Any = None) -> dict[str, Any]:  # fmt: skip
    """Runs on every rank: fit ``model`` with ``strategy`` for ``steps`` steps and measure this
    rank's peak (see the module notes): ``measured_peak_bytes``, ``accounted_peak_bytes`` (the
    memory monitor's), the stage and the split."""
    import ctypes

    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback

    from lightning_pipe2bw.callbacks.memory import stage_memory

    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    schedules._quiet()
    torch.set_num_threads(1)

    class Peak(Callback):
        """The resident high-water mark from the first batch on, and the monitor's figures."""

        def __init__(self) -> None:
            self.accounted = self.weights = self.start_kib = self.high_kib = 0

        def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
            if self.start_kib == 0:
                tensors = [*module.parameters(), *module.buffers()]
                self.weights = sum(t.untyped_storage().nbytes() for t in tensors)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # the high-water mark starts again from here
                self.start_kib = _memory_kib("VmRSS")

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            # read at each batch's end, not after fit: fit's teardown gives every rank the whole
            # model back, which is not training's memory
            self.high_kib = _memory_kib("VmHWM")
            f = stage_memory(trainer)
            total = f["weight_versions"] + f["grads"] + f["optimizer_state"] + f["activations_peak"]
            self.accounted = max(self.accounted, total)

    peak = Peak()
    # each replica reads its own batches: d times as many for the same steps on each
    schedules.fit_quietly(
        model, strategy, batch, steps, [peak], num_batches=replicas * steps, data=data
    )  # fmt: skip
    grown = (peak.high_kib - peak.start_kib) * 1024
    assert strategy.split is not None
    return {
        "rank": dist.get_rank(),
        "stage": strategy.stage,
        "balance": list(strategy.split.balance),
        "measured_peak_bytes": peak.weights + grown,
        "weights_at_start_bytes": peak.weights,
        "accounted_peak_bytes": peak.accounted,
    }


def run(schedule: str, option: str, replicas: int, batch: int, m: int, steps: int) -> Any:
    """Runs on every rank: one fit of the GPT-like model; this rank's memory figures."""
    from lightning_pipe2bw import Pipe2BWStrategy

    kwargs = {} if option == "none" else {option: True}
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=m, data_parallel=replicas, **kwargs)
    return measured_fit(schedules._lightning_module(), strategy, batch, steps, replicas)


def stage_memories(profile: Any, schedule: str, option: str, replicas: int, m: int,
                   balance: list[int]) -> list[float]:  # fmt: skip
    """The cost model's memory of each stage of ``balance`` (module counts per stage) on
    ``profile``, with ``option`` (``none``, ``recompute``, ``shard_optimizer`` or ``fsdp``) on a
    machine whose memory and links do not bind."""
    from lightning_pipe2bw.planner.costmodel import Cluster, CostModel

    depth = len(balance)
    cluster = Cluster(
        num_devices=replicas * depth, devices_per_node=replicas * depth,
        memory_bytes=2**40, intra_node_bandwidth=1e9, inter_node_bandwidth=1e9,
    )  # fmt: skip
    model = CostModel(
        profile, cluster, schedule, replicas, depth, m,
        shard_optimizer=option == "shard_optimizer", fsdp=option == "fsdp",
    )  # fmt: skip
    out, lo = [], 0
    for s, count in enumerate(balance):
        out.append(model.stage(s, lo, lo + count, recompute=option == "recompute").memory_bytes)
        lo += count
    return out


def predict(schedule: str, option: str, replicas: int, batch: int, m: int,
            balance: list[int]) -> list[float]:  # fmt: skip
    """The cost model's memory of each stage of ``balance`` for the GPT-like model."""
    import torch

    from lightning_pipe2bw.planner.measure import profile_blocks

    torch.set_num_threads(1)
    body = schedules.make_body()
    x, _ = schedules.make_data(batch // m, 1)
    profile = profile_blocks(list(body.children()), x, warmup=1, repeats=1)
    return stage_memories(profile, schedule, option, replicas, m, balance)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="data-parallel width d")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"schedule:option, options {', '.join(OPTIONS)}")  # fmt: skip
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32, help="per replica")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/memory_prediction.json"
    )
    ns = parser.parse_args()
    configs = [tuple(c.split(":")) for c in ns.configs.split(",")]
    for schedule, option in configs:
        if option not in OPTIONS:
            parser.error(f"unknown option {option!r} in {schedule}:{option}; use one of {OPTIONS}")
    d, m, b = ns.replicas, ns.microbatches, ns.batch_size
    rows = []
    pool = RankPool(2 * d, run_id="memory", initializer=schedules._quiet)
    try:
        pool.run(run, "1f1b", "none", d, b, m, 1)  # what every fit reuses, made resident
        for round_ in range(ns.rounds):
            for schedule, option in configs if round_ % 2 == 0 else configs[::-1]:
                print(f"round {round_ + 1}: {schedule} {option}, d = {d}", flush=True)
                ranks = pool.run(run, schedule, option, d, b, m, ns.steps)
                predicted = predict(schedule, option, d, b, m, ranks[0]["balance"])
                for r in ranks:
                    r["predicted_bytes"] = predicted[r["stage"]]
                rows.append({"schedule": schedule, "option": option, "d": d, "m": m,
                             "batch_size": b, "round": round_, "ranks": ranks})  # fmt: skip
    finally:
        pool.close()
    mib = 2**20
    print()
    print("| schedule | option | stage | predicted MiB | measured peak MiB (replicas, rounds) | "
          "predicted / measured | accounted MiB |")  # fmt: skip
    print("| --- | --- | ---: | ---: | --- | ---: | ---: |")
    errors = []
    for schedule, option in configs:
        found = [r for row in rows if (row["schedule"], row["option"]) == (schedule, option)
                 for r in row["ranks"]]  # fmt: skip
        for stage in sorted({r["stage"] for r in found}):
            mine = [r for r in found if r["stage"] == stage]
            peaks = [r["measured_peak_bytes"] for r in mine]
            predicted = mine[0]["predicted_bytes"]
            errors.append(predicted / max(peaks) - 1)
            print(
                f"| {schedule} | {option} | {stage} | {predicted / mib:.1f} | "
                f"{max(peaks) / mib:.1f} ({min(peaks) / mib:.1f}-{max(peaks) / mib:.1f}) | "
                f"{predicted / max(peaks):.2f} | "
                f"{max(r['accounted_peak_bytes'] for r in mine) / mib:.1f} |"
            )
    worst = max(errors, key=abs)
    note = (f"d = {d}, m = {m}, batch {b} per replica, {ns.steps} steps, {ns.rounds} rounds; "
            f"measured = the largest peak of the stage's replicas over the rounds; the largest "
            f"|predicted / measured - 1|: {abs(worst):.1%}")  # fmt: skip
    print(note)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"note": note, "rows": rows}, indent=1) + "\n")
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
