"""What a meeting of the stages at every step costs 2BW, and what is left of it.

A 2BW pipeline has no flush: its stages end their steps at different times (the first stage
about a backward before the last). Anything that makes every stage wait for the others at
every step puts part of the bubble back. Two common ones, each measured here against a plain
run of the same pipeline in interleaved rounds:

* **clip**: ``Trainer(gradient_clip_val=1.0)``, clipping by the norm over every stage. The
  strategy sums each batch's squared norm as soon as its gradient is complete on a stage
  (``seam.agreement.NormsAhead``), so the step takes a sum that is already in;
* **grad_norm**: Lightning's ``self.log_dict(grad_norm(self, 2))`` in
  ``on_before_optimizer_step``. The stages post what they log to the last stage without a
  barrier (``seam.hooklogs.RelayedLogs``); what is left is Lightning's own ``self.log`` of
  about a hundred values per step on each rank, which one device pays too;
* **grad_norm+clip**: both. A hook that may change a gradient keeps the clipping norm's sum at
  the step (where it is the gradient the hook left), so this one still meets;
* **tied**: the head's weight is the token embedding's (as GPT-2 ties them), one copy on each
  stage whose gradients are summed over the two stages for every update
  (``pipeline.ties``), started as each batch's gradient completes.

The model is the GPT-like one of ``schedules.py --model gpt`` (batch 32, AdamW) on 2 CPU ranks
with one thread each. Per configuration: the median step (slowest rank, after the first 4
steps), its ratio to the plain run of the same round (median over the rounds), and each rank's
idle share: 1 - (the engine's compute actions / wall time) over the timed steps. Idle counts
waiting for the other stage and everything outside the forwards and backwards (the optimizer,
Lightning, logging), so it moves less with the machine's drift than the step does::

    python benchmarks/step_meetings.py                   # 3 rounds, m = 4
    python benchmarks/step_meetings.py --rounds 5 --microbatches 8

Writes ``benchmarks/results/step_meetings.json``. Nothing here is asserted by tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("PIPE2BW_BENCH_MODEL", "gpt")  # before schedules is imported, here and
# in the ranks (they inherit the environment)

import schedules
from machine import cpu_pressure_60s
from ranks import RankPool

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ("plain", "clip", "grad_norm", "grad_norm+clip", "tied")
SKIP = 4  # steps left out of the timing


def run_config(schedule: str, m: int, steps: int, config: str) -> dict[str, Any]:
    """On every rank: fit ``steps`` steps of the GPT under ``config``; the step times and the
    engine's compute seconds over the timed steps."""
    import torch.distributed as dist
    from lightning.pytorch.utilities import grad_norm

    from lightning_pipe2bw import Pipe2BWStrategy

    schedules._quiet()
    timer = schedules._make_timer(SKIP, steps - SKIP)
    module = schedules._lightning_module()
    if "grad_norm" in config:

        class GradNorms(type(module)):  # type: ignore[misc]
            def on_before_optimizer_step(self, optimizer: Any) -> None:
                self.log_dict(grad_norm(self, norm_type=2))

        module = GradNorms()
    if config == "tied":
        body = module.body
        body[-1].head.weight = body[0].token.weight  # both (vocabulary, d)
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=m)
    schedules.fit_quietly(
        module, strategy, 32, steps, [timer],
        gradient_clip_val=1.0 if "clip" in config else None,
    )  # fmt: skip
    t0, t1 = timer.t0, timer.t1
    timeline = strategy.engine.stats.timeline
    compute = sum(
        e.end - e.start for e in timeline if e.action.is_compute and t0 <= e.start and e.end <= t1
    )
    return {
        "rank": dist.get_rank(),
        "stage": strategy.stage,
        "step_s": timer.step_s,
        "idle": 1 - compute / (t1 - t0),
        "ties_ahead": bool(
            strategy.runtime
            and strategy.runtime.tied
            and getattr(strategy.runtime.tied, "ahead", False)
        ),
        "norms_ahead": any(
            f.__qualname__ == "NormsAhead.post" for f in getattr(strategy.driver, "on_complete", [])
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=14, help="per run, the first 4 untimed")
    parser.add_argument("--schedule", default="2bw")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", type=Path, default=RESULTS / "step_meetings.json")
    args = parser.parse_args()
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")
    before = {"load_1min": os.getloadavg()[0], "cpu_pressure_60s": cpu_pressure_60s()}
    pool = RankPool(2, run_id="meetings", pg_timeout_s=90.0, initializer=schedules._quiet)
    runs: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            for config in order:
                ranks = pool.run(run_config, args.schedule, args.microbatches, args.steps, config)
                ranks.sort(key=lambda x: x["rank"])
                steps = zip(*(x["step_s"] for x in ranks), strict=True)
                step = statistics.median(max(s) for s in steps)
                runs.append({"round": r, "config": config, "step_s": step, "ranks": ranks})
                idle = " / ".join(f"{x['idle']:.3f}" for x in ranks)
                print(
                    f"round {r + 1}: {config}: {step * 1000:.0f} ms, idle {idle}", file=sys.stderr
                )
    finally:
        pool.close()
    rows = []
    for config in configs:
        mine = [x for x in runs if x["config"] == config]
        ratios = []
        for x in mine:
            plain = next(
                (y for y in runs if y["round"] == x["round"] and y["config"] == configs[0]), None
            )
            if plain is not None:
                ratios.append(x["step_s"] / plain["step_s"])
        idle = [statistics.median(x["ranks"][k]["idle"] for x in mine) for k in range(2)]
        rows.append(
            {
                "config": config,
                "step_ms": 1000 * statistics.median(x["step_s"] for x in mine),
                "vs_first": statistics.median(ratios),
                "vs_first_range": [min(ratios), max(ratios)],
                "idle_by_rank": idle,
                "stage_by_rank": [mine[0]["ranks"][k]["stage"] for k in range(2)],
                "ahead": ", ".join(
                    what
                    for what, key in (("clipping norm", "norms_ahead"), ("tied", "ties_ahead"))
                    if mine[0]["ranks"][0][key]
                )
                or "-",
            }
        )
    title = (
        f"{args.schedule}, m = {args.microbatches}, GPT-like (batch 32, AdamW), 2 CPU ranks, "
        f"medians of {args.rounds} interleaved rounds"
    )
    print(title)
    print(
        f"| configuration | step ms | / {configs[0]} (range) | idle rank 0 (stage "
        f"{rows[0]['stage_by_rank'][0]}) | idle rank 1 (stage {rows[0]['stage_by_rank'][1]}) "
        "| summed ahead |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        low, high = row["vs_first_range"]
        print(
            f"| {row['config']} | {row['step_ms']:.0f} | {row['vs_first']:.3f} ({low:.3f}-"
            f"{high:.3f}) | {row['idle_by_rank'][0]:.3f} | {row['idle_by_rank'][1]:.3f} | "
            f"{row['ahead']} |"
        )
    after = {"load_1min": os.getloadavg()[0], "cpu_pressure_60s": cpu_pressure_60s()}
    print(f"load before {before}, after {after}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"title": title, "rows": rows, "runs": runs, "before": before, "after": after},
            indent=1,
        )
    )
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
