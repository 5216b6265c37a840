"""2BW's step multiplier: how many more steps PipeDream-2BW needs to reach the flushed
schedules' loss, and, joined with the measured step times at depth, which schedule reaches
that loss soonest at each (p, m).

The flushed schedules all train one device's gradient accumulation, and every 2BW rule is
bitwise its one-process reference on any number of stages (``tests/ranks/test_delay.py``), so
the loss curves do not depend on p: they are trained here on one process (``convergence.py``'s
``train``, the main job's GPT and data). A horizon's report (``convergence.py --steps H``) gives
the target, its best synchronous configuration's final validation loss, and each recipe's
best learning rate at that horizon. Each 2BW recipe then trains for k x H steps, k in
``--stretch``, each run with its own learning-rate schedule (warm-up 10% then cosine to 10%,
over the k x H steps), with no synchronous start and with one of each share in ``--sync``
(``sync_steps`` = the share of the run's steps, trained by 1F1B's rule). A run's steps to
target are where its validation curve first reaches the target (linear between the two
validations around the crossing); the recipe's multiplier is the least of its runs' steps to
target over H.

With ``--depth`` (``benchmarks/depth.py``'s JSON) it joins each multiplier with the measured
ms per step at every (p, m): a flushed schedule reaches the target in H steps, a 2BW run in
its steps to target, its synchronous start at 1F1B's step and the rest at its own (``2bw``
and ``2bw-v`` train the same rule). The table gives each schedule's time to target and which
reaches it soonest, and by how much.

    python benchmarks/step_multiplier.py --report benchmarks/results/convergence.json \\
        --out benchmarks/results/step_multiplier_300.json       # 300 steps (about 35 min)
    python benchmarks/step_multiplier.py --report benchmarks/results/convergence_1200.json \\
        --recipes 2bw-error_feedback:muon@0.002 2bw-update_feedback:muon --sync 0 0.1 \\
        --out benchmarks/results/step_multiplier_1200.json      # 1200 steps (about 70 min)
    python benchmarks/step_multiplier.py --reuse benchmarks/results/step_multiplier_300.json \\
        --depth benchmarks/results/depth.json                   # the joined table only

Nothing here is asserted by tests.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from convergence import _phase1_worker, best_runs, parse_config

from lightning_pipe2bw.schedule import REGISTRY

DEFAULT_RECIPES = (
    "2bw-error_feedback:muon@0.002",
    "2bw-update_feedback:muon",
    "2bw-predict:muon",
)


def crossing(curve: list[list[float]], target: float) -> float:
    """The step at which ``curve`` ([step, loss, ...] at each validation) first reaches
    ``target``, linear between the validations around it; nan if it never does."""
    previous: list[float] | None = None
    for point in curve:
        step, loss = point[0], point[1]
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(step)
            s0, l0 = previous[0], previous[1]
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        previous = point
    return math.nan


def run_config(recipe: str, sync: float, steps: int) -> str:
    """The convergence.py configuration of ``recipe`` with a synchronous start of ``sync`` x
    ``steps`` steps."""
    if not sync:
        return recipe
    head, _, tail = recipe.partition(":")
    return f"{head}/sync={round(sync * steps)}:{tail}"


def plan_runs(
    report: dict[str, Any], recipes: list[str], stretch: list[float], syncs: list[float]
) -> list[tuple[str, str, float, float, int, float, dict[str, Any]]]:
    """(recipe, config, k, sync share, steps, lr, training settings) of every run."""
    settings = report["settings"]
    horizon, every = settings["steps"], settings["val_every"]
    best = best_runs(report["runs"])
    runs = []
    for recipe in recipes:
        if recipe not in best:
            raise SystemExit(
                f"{recipe} is not in the report's runs; run it first with convergence.py at "
                f"this horizon ({horizon} steps) or choose among {sorted(best)}"
            )
        lr = best[recipe]["lr"]
        for k in stretch:
            steps = max(every, round(k * horizon / every) * every)
            args = {**settings, "steps": steps, "warmup": steps // 10}
            for sync in syncs:
                runs.append((recipe, run_config(recipe, sync, steps), k, sync, steps, lr, args))
    return runs


def summarize(
    report: dict[str, Any], runs: list[dict[str, Any]], horizon: int
) -> list[dict[str, Any]]:
    """One row per (recipe, sync share): each stretch's final loss and steps to target, and
    the multiplier (the least steps to target over the horizon)."""
    target = report["target_loss"]
    rows: dict[tuple[str, float], dict[str, Any]] = {}
    for run in runs:
        key = (run["recipe"], run["sync"])
        row = rows.setdefault(key, {"recipe": run["recipe"], "sync": run["sync"], "runs": []})
        at = crossing(run["val"], target)
        row["runs"].append({
            "k": run["k"], "steps": run["steps"], "sync_steps": round(run["sync"] * run["steps"]),
            "final_val_loss": run["final_val_loss"], "steps_to_target": at,
            "seconds": run["total_seconds"],
        })  # fmt: skip
    for row in rows.values():
        row["runs"].sort(key=lambda r: r["k"])
        reached = [r for r in row["runs"] if not math.isnan(r["steps_to_target"])]
        best = min(reached, key=lambda r: r["steps_to_target"], default=None)
        row["multiplier"] = best["steps_to_target"] / horizon if best else math.nan
        row["best_k"] = best["k"] if best else math.nan
        row["sync_steps"] = best["sync_steps"] if best else 0
    return sorted(rows.values(), key=lambda r: (r["recipe"], r["sync"]))


def print_rows(rows: list[dict[str, Any]], horizon: int, target: float, stretch: list[float]) -> None:
    print(f"\nhorizon {horizon} steps, target {target:.4f} (the best synchronous configuration)")
    print("\n| recipe | synchronous start | " + " | ".join(
        f"{k:g} x H: final loss, steps to target" for k in stretch) + " | multiplier |")  # fmt: skip
    print("| --- | --- |" + " --- |" * (len(stretch) + 1))
    for row in rows:
        cells = []
        for k in stretch:
            r = next((r for r in row["runs"] if r["k"] == k), None)
            if r is None:
                cells.append("-")
            else:
                at = r["steps_to_target"]
                cells.append(f"{r['final_val_loss']:.4f}, " + ("not reached" if math.isnan(at)
                             else f"{at:.0f}"))  # fmt: skip
        mult = row["multiplier"]
        print(f"| {row['recipe']} | {row['sync']:.0%} | " + " | ".join(cells) + " | "
              + (f"**{mult:.2f}**" if not math.isnan(mult) else f"> {max(stretch):g}") + " |")  # fmt: skip


def join(rows: list[dict[str, Any]], depth: dict[str, Any], horizon: int) -> list[dict[str, Any]]:
    """Time to target at every (p, m) of a depth.json: each flushed schedule's H steps, each
    2BW recipe's (and 2BW on a V's) steps to target with its synchronous start at 1F1B's step;
    the soonest, and how much sooner than the soonest of the other kind."""
    lines = [line for line in depth["lines"] if line["kind"] == "ours" and line["split"] == "default"]
    table = []
    for p, m in dict.fromkeys((line["p"], line["m"]) for line in lines):
        here = {line["name"]: line["step_ms"] / 1e3 for line in lines if (line["p"], line["m"]) == (p, m)}
        times: dict[str, float] = {}
        for name, step_s in here.items():
            if REGISTRY[name].flushes:
                times[name] = horizon * step_s
        flush_step = here.get("1f1b")
        for row in rows:
            if math.isnan(row["multiplier"]):
                continue
            steps = row["multiplier"] * horizon
            sync = min(row["sync_steps"], steps)
            for name in ("2bw", "2bw-v"):
                if name not in here or (sync and flush_step is None):
                    continue
                label = f"{name} {row['recipe'][4:]} sync {row['sync']:.0%}"
                times[label] = sync * (flush_step or 0.0) + (steps - sync) * here[name]
        flushed = {k: v for k, v in times.items() if k in REGISTRY}
        delayed = {k: v for k, v in times.items() if k not in REGISTRY}
        best = min(times, key=times.__getitem__)
        other = flushed if best not in flushed else delayed
        table.append({
            "p": p, "m": m, "seconds_to_target": times, "soonest": best,
            "soonest_flushed": min(flushed, key=flushed.__getitem__) if flushed else None,
            "soonest_2bw": min(delayed, key=delayed.__getitem__) if delayed else None,
            "margin": (min(other.values()) / times[best]) if other else math.nan,
        })  # fmt: skip
    return table


def print_join(table: list[dict[str, Any]], horizon: int) -> None:
    print(f"\ntime to target at each depth ({horizon}-step horizon; measured ms per step, "
          "benchmarks/depth.py)")  # fmt: skip
    print("\n| p | m | soonest flushed (s) | soonest 2BW (s) | soonest | by |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in table:
        t = row["seconds_to_target"]
        f, d = row["soonest_flushed"], row["soonest_2bw"]
        print(f"| {row['p']} | {row['m']} | {f} {t[f]:.0f} | "
              + (f"{d} {t[d]:.0f}" if d else "-") + f" | **{row['soonest']}** | "
              f"{row['margin']:.2f}x |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--report", type=Path, help="a convergence.py report: the horizon")
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES))
    parser.add_argument("--stretch", type=float, nargs="+", default=[1.25, 1.5, 2.0])
    parser.add_argument("--sync", type=float, nargs="+", default=[0.0, 0.1, 0.3],
                        help="synchronous starts, as shares of a run's steps")  # fmt: skip
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--reuse", type=Path, help="an earlier output: its runs, not run again")
    parser.add_argument("--depth", type=Path, help="benchmarks/depth.py's JSON, to join with")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/step_multiplier.json"))
    ns = parser.parse_args()
    started = time.perf_counter()
    earlier = json.loads(ns.reuse.read_text()) if ns.reuse else None
    if ns.report is None and earlier is None:
        parser.error("give --report (a convergence.py report) or --reuse")
    report = json.loads(ns.report.read_text()) if ns.report else earlier["report"]
    horizon = report["settings"]["steps"]
    for recipe in ns.recipes:
        if parse_config(recipe)["schedule"] != "2bw" or parse_config(recipe)["sync_steps"]:
            parser.error(f"{recipe}: give 2BW recipes without a synchronous start (--sync sets it)")
    done = {(r["config"], r["steps"], r["lr"]): r for r in (earlier or {}).get("runs", [])}
    planned = plan_runs(report, ns.recipes, ns.stretch, ns.sync)
    results = []
    jobs = []
    for recipe, config, k, sync, steps, lr, args in planned:
        run = done.get((config, steps, lr))
        if run is not None:
            results.append({**run, "recipe": recipe, "k": k, "sync": sync})
        else:
            jobs.append(((config, lr, args), (recipe, k, sync, steps)))
    print(f"{len(jobs)} runs to train ({len(results)} reused), {ns.parallel} at a time", flush=True)

    def write() -> None:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        rows = summarize(report, results, horizon)
        payload = {
            "command": shlex.join(["python", *sys.argv]),
            "report": {k: report[k] for k in ("command", "settings", "target_loss", "runs")},
            "horizon": horizon, "target_loss": report["target_loss"],
            "rows": rows, "runs": results,
            "joined": join(rows, json.loads(ns.depth.read_text()), horizon) if ns.depth else None,
            "seconds": time.perf_counter() - started,
        }  # fmt: skip
        ns.out.write_text(json.dumps(payload, indent=1) + "\n")

    if jobs:
        with mp.get_context("spawn").Pool(ns.parallel, maxtasksperchild=1) as pool:
            for (_, (recipe, k, sync, steps)), run in zip(
                jobs, pool.imap(_phase1_worker, [job for job, _ in jobs], chunksize=1), strict=True
            ):
                results.append({**run, "recipe": recipe, "k": k, "sync": sync, "steps": steps})
                write()  # every finished run at once: an interrupted sweep resumes with --reuse
    write()
    rows = summarize(report, results, horizon)
    print_rows(rows, horizon, report["target_loss"], ns.stretch)
    if ns.depth:
        print_join(join(rows, json.loads(ns.depth.read_text()), horizon), horizon)
    print(f"\nwrote {ns.out} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
