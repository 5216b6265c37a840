"""How far each stage of the main job is from the least idle time its schedule allows.

The stage table of ``make train`` counts as idle everything in a rank's wall time that is not a
forward or a backward: the schedule's own bubble (fill and drain), the optimizer step, sends,
waiting for a peer beyond the bubble, and the engine's and Lightning's own Python. Two of these
are not overhead: the bubble is the schedule's, and the optimizer is work every step does once,
after the batch's last backward (Lightning's step order: the closure, then clipping and the
update). This script measures both and sets them beside the idle share the table shows.

For each configuration (Hydra overrides of the main job, as ``benchmarks/main_job.py`` takes them)
it runs ``python -m lightning_pipe2bw.train`` once per round with validation off, and reads from
the run's ``trace.json`` (the last 20 training steps, steady state):

* **measured idle**: per rank, 1 - compute / wall over those steps (the stage table's share,
  over steady steps instead of the whole run);
* **bubble floor**: the schedule's action list as the engine runs it
  (``schedule.training_schedule``) simulated (``schedule.simulate``) at the mean measured cost of
  each virtual stage's forward, backward, input and weight gradients, with no transfer time and
  no cost between actions: the idle share of the schedule itself;
* **optimizer**: the job's own optimizer (``GPT.configure_optimizers`` on the blocks this rank
  holds, 1 intra-op thread), its ``step`` timed apart from the pipeline on random gradients;
* **floor**: the idle share with only those two: 1 - compute / (simulated step + the slowest
  rank's optimizer step), as every rank's next step waits for the first stage's update.

::

    python benchmarks/idle_floor.py --rounds 3
    python benchmarks/idle_floor.py --rounds 3 --configs "" "strategy.microbatches=8"

Writes ``benchmarks/results/idle_floor.json``; prints a table. Nothing here is asserted by tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import yaml
from machine import cpu_pressure_60s
from main_job import interleaved, launch

from lightning_pipe2bw.recipes.gpt.model import GPT
from lightning_pipe2bw.schedule import Schedule
from lightning_pipe2bw.schedule.passes import cut_overhead, training_schedule
from lightning_pipe2bw.schedule.simulate import Costs, simulate

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"F": "forward", "B": "backward", "I": "input_grad", "W": "weight_grad"}


def run_job(config: str, out: Path) -> dict[str, Any]:
    """One run of the main job with ``config``'s overrides (validation and checkpoints off)."""
    launch(
        config,
        out,
        "trainer.val_check_interval=100000",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_checkpointing=false",
    )
    return {
        "trace": json.loads((out / "trace.json").read_text()),
        "stages": json.loads((out / "stages.json").read_text()),
        "result": json.loads((out / "result.json").read_text()),
        "hparams": yaml.safe_load((out / "hparams.yaml").read_text()),
    }


def lanes(trace: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """The trace's actions by pipeline position (the lane's sort index), in time order."""
    position = {
        e["pid"]: e["args"]["sort_index"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_sort_index"
    }
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out[position[e["pid"]]].append(e)
    for events in out.values():
        events.sort(key=lambda e: e["ts"])
    return dict(out)


def steps_shown(trace: dict[str, Any]) -> int:
    """How many training steps the trace holds (its metadata: "training steps a-b")."""
    first, last = trace["metadata"]["shows"].rsplit(" ", 1)[1].split("-")
    return int(last) - int(first) + 1


def stage_costs(by_rank: dict[int, list[dict[str, Any]]], schedule: Schedule) -> Costs:
    """Mean milliseconds of each virtual stage's F, B, I and W in the trace; a stage that never
    ran a whole B costs I + W, and one that never split its backward halves B.

    The trace names a rank, not the virtual stage an action ran on: each rank's compute actions
    are matched, in order, with its compute actions in ``schedule`` (one step after another), and
    a mismatch of kind or micro-batch is an error."""
    took: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r, events in by_rank.items():
        order = [a for a in schedule.stages[r] if a.kind.value in KINDS]
        ran = [e for e in events if e["args"]["kind"] in KINDS]
        if len(ran) % len(order):
            raise ValueError(f"rank {r}: {len(ran)} compute actions, not whole steps")
        for k, e in enumerate(ran):
            action = order[k % len(order)]
            if (e["args"]["kind"], e["args"]["microbatch"]) != (
                action.kind.value,
                action.microbatch,
            ):
                raise ValueError(
                    f"rank {r}, action {k}: the trace has {e['args']}, the schedule {action}"
                )
            took[action.kind.value, action.stage].append(e["dur"] / 1e3)

    def mean(kind: str, stage: int) -> float | None:
        values = took.get((kind, stage))
        return statistics.fmean(values) if values else None

    forward, backward, inputs, weights = [], [], [], []
    for v in range(schedule.num_stages):
        f, b, i, w = (mean(k, v) for k in "FBIW")
        if b is None:
            b = (i or 0.0) + (w or 0.0)
        forward.append(f or 0.0)
        backward.append(b)
        inputs.append(i if i is not None else b / 2)
        weights.append(w if w is not None else b / 2)
    return Costs(forward=forward, backward=backward, input_grad=inputs, weight_grad=weights)


def optimizer_ms(hparams: dict[str, Any], blocks: list[int], reps: int = 30) -> float:
    """Median milliseconds of one ``step`` of the job's optimizer over ``blocks``' parameters."""
    model = GPT(**hparams)
    model.body = torch.nn.Sequential(*[model.body[i] for i in blocks])
    optimizer = model.configure_optimizers()["optimizer"]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    gen = torch.Generator().manual_seed(0)
    times = []
    for r in range(reps + 5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        start = time.perf_counter()
        optimizer.step()
        if r >= 5:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def analyse(job: dict[str, Any]) -> dict[str, Any]:
    trace, stages, result = job["trace"], job["stages"], job["result"]
    by_rank = lanes(trace)
    steps = steps_shown(trace)
    name, m = result["schedule"], result["microbatches"]
    # the list the engine ran: the job's schedule with the cuts that pay on a CPU
    schedule = training_schedule(name, len(by_rank), m, cut_overhead=cut_overhead("cpu"))
    costs = stage_costs(by_rank, schedule)
    sim = simulate(schedule, costs)
    optim = {s["stage"]: optimizer_ms(job["hparams"], s["blocks"]) for s in stages}
    floor_step = sim.step_time + max(optim.values())
    rows = []
    for r, events in sorted(by_rank.items()):
        wall = (events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]) / 1e3
        compute = sum(e["dur"] for e in events if e["args"]["kind"] in KINDS) / 1e3
        rows.append(
            {
                "stage": r,
                "step_ms": wall / steps,
                "idle": 1 - compute / wall,
                "sim_step_ms": sim.step_time,
                "bubble": sim.bubble_fraction[r],
                "optimizer_ms": optim[r],
                "floor": 1 - sim.busy[r] / floor_step,
            }
        )
    # ms per virtual stage, as simulated
    kinds = {
        k: list(getattr(costs, k)) for k in ("forward", "backward", "input_grad", "weight_grad")
    }
    return {"schedule": name, "microbatches": m, "stage_costs_ms": kinds, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=[""])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/idle_floor.json")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    pressure = cpu_pressure_60s()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r, i, config in interleaved(ns.configs, ns.rounds):
            job = run_job(f"{config} trainer.max_steps={ns.steps}", Path(tmp) / f"r{r}c{i}")
            runs.append({"config": config, "round": r, **analyse(job)})
    print(
        "\n| configuration | stage | step ms | idle % (measured) | bubble % (simulated) "
        "| optimizer ms | floor % (bubble + optimizer) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for config in ns.configs:
        mine = [run for run in runs if run["config"] == config]
        for s in range(len(mine[0]["rows"])):
            rows = [run["rows"][s] for run in mine]

            def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
                return statistics.median(row[key] for row in rows)

            print(
                f"| `{config or 'defaults'}` ({mine[0]['schedule']}, m = {mine[0]['microbatches']}) "
                f"| {s} | {med('step_ms'):.1f} | {100 * med('idle'):.1f} "
                f"| {100 * med('bubble'):.1f} | {med('optimizer_ms'):.1f} "
                f"| {100 * med('floor'):.1f} |"
            )
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"cpu_pressure_60s": pressure, "runs": runs}, indent=1) + "\n")
    print(f"\nwrote {ns.out}")


if __name__ == "__main__":
    main()
