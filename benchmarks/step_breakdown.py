"""A pipeline step taken apart: where each rank's time goes, per step, in one table.

Runs ``Pipe2BWStrategy`` on 2 CPU ranks (one intra-op thread each) with the GPT-like model of
``schedules.py --model gpt`` (embedding, 8 pre-LN blocks, d=256, sequence 128, vocabulary 256,
batch 32, AdamW), for each schedule and micro-batch count asked, in interleaved rounds. On every
rank it times, over the timed steps:

* **compute**: the engine's compute actions (forward, backward, input and weight gradients);
* **wait**: receive actions, i.e. waiting for a peer's activation or gradient;
* **send**: send actions (copying into the transport);
* **engine**: the engine's own Python between actions (its ``execute`` call's wall time less
  the actions');
* **driver**: the schedule driver's per-step work outside ``execute`` (admitting the batch,
  taking the due gradient);
* **optimizer**: the user's optimizer's ``step`` (AdamW here), without the closure Lightning
  hands it (which runs a flush schedule's whole batch);
* **correction**: the rest of a 2BW update (the delay correction's passes, the weight-version
  bookkeeping), i.e. ``TwoBWOptimizer.apply`` less the optimizer's step, and with
  ``delay_correction="predict"`` the prediction of each batch's weights (made in the update
  before the batch, or else in its first forward: then taken out of compute);
* **Lightning**: the rest of the step, from ``on_train_batch_start`` to ``on_train_batch_end``:
  Lightning's closure and hooks and the strategy's own per-step work (splitting the batch,
  step values, logging replay);
* **between**: from one step's ``on_train_batch_end`` to the next one's start (data loading,
  the loop's bookkeeping).

The timers wrap the real objects' methods on the ranks (no copy of the library's code); nothing
else changes. The table shows, per configuration and rank, milliseconds per step (medians over
rounds) and each part's share of the step; the JSON keeps every round::

    python benchmarks/step_breakdown.py                          # 2bw, 1f1b at m = 4, 8; 5 rounds
    python benchmarks/step_breakdown.py --schedules 2bw,2bw-v --ms 8 --rounds 3
    python benchmarks/step_breakdown.py --schedules 2bw/none,2bw/predict,2bw/nesterov --ms 8

Writes ``benchmarks/results/step_breakdown.json``. Nothing here is asserted by tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("PIPE2BW_BENCH_MODEL", "gpt")  # before schedules is imported, here and
# in the ranks (they inherit the environment)

import schedules
import torch
from machine import cpu_pressure_60s
from ranks import RankPool, TaskError

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = (
    "compute",
    "wait",
    "send",
    "engine",
    "driver",
    "optimizer",
    "correction",
    "Lightning",
    "between",
)


class _Clock:
    """Total seconds spent in wrapped calls (re-entrant calls count once)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.total += time.perf_counter() - start

        return timed


def _step_apart(step: Callable[..., Any], clock: _Clock) -> Callable[..., Any]:
    """The optimizer's ``step``, timed without its closure: a flush schedule's closure (run by
    Lightning through ``step(closure)``) is the whole pipelined batch. The closure runs first,
    with gradients enabled, as torch's optimizers run it; then the timed step, without it."""
    timed = clock.wrap(step)

    def split(closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        timed()
        return loss

    return split


def run_rank(schedule: str, m: int, batch_size: int, warmup: int, steps: int) -> dict[str, Any]:
    """Runs on every rank: one fit with the timers in place; returns seconds per timed step."""
    import torch.distributed as dist
    from lightning.pytorch import Callback

    from lightning_pipe2bw import Pipe2BWStrategy
    from lightning_pipe2bw.optim.wrapper import unwrap_optimizer
    from lightning_pipe2bw.runtime.versions import TwoBWOptimizer

    schedules._quiet()
    schedule, _, correction = schedule.partition("/")
    extra = {"delay_correction": correction} if correction else {}
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=m, **extra)
    names = ("execute", "train_batch", "optimizer", "apply", "predict")
    clocks = {name: _Clock() for name in names}

    class Timers(Callback):
        def __init__(self) -> None:
            self.marks: list[tuple[float, float]] = []  # (batch start, batch end)
            self.totals: list[dict[str, float]] = []  # clock totals at each batch end

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            engine, driver = trainer.strategy.engine, trainer.strategy.driver
            engine.execute = clocks["execute"].wrap(engine.execute)
            driver.train_batch = clocks["train_batch"].wrap(driver.train_batch)
            wrapper = trainer.optimizers[0]
            inner = unwrap_optimizer(wrapper)
            inner.step = _step_apart(inner.step, clocks["optimizer"])
            outer = getattr(driver, "optimizer", None)
            if isinstance(outer, TwoBWOptimizer):
                outer.apply = clocks["apply"].wrap(outer.apply)
                versions = driver.versions
                if versions.predict is not None:
                    # a batch's view is mostly made in the update before it (inside apply);
                    # otherwise in the batch's first forward: that time is counted here
                    predict, apply_clock = versions.predict, clocks["apply"]
                    timed_predict = clocks["predict"].wrap(predict)

                    def outside_apply(*args: Any) -> Any:
                        inside = apply_clock._depth > 0
                        return (predict if inside else timed_predict)(*args)

                    versions.predict = outside_apply

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self.marks.append((time.perf_counter(), 0.0))

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self.marks[-1] = (self.marks[-1][0], time.perf_counter())
            self.totals.append({k: c.total for k, c in clocks.items()})

    timers = Timers()
    schedules.fit_quietly(
        schedules._lightning_module(), strategy, batch_size, warmup + steps + 1, [timers]
    )
    # the timed window: from the start of step `warmup` to the start of the last step
    t0, t1 = timers.marks[warmup][0], timers.marks[-1][0]
    n = len(timers.marks) - 1 - warmup
    actions = {"compute": 0.0, "wait": 0.0, "send": 0.0}
    for entry in strategy.engine.stats.timeline:
        if entry.start < t0 or entry.end > t1:
            continue
        kind = entry.action.kind.value
        part = "compute" if entry.action.is_compute else "wait" if kind.startswith("RECV") else None
        if part is None and kind.startswith("SEND"):
            part = "send"
        if part is not None:
            actions[part] += entry.end - entry.start
    first, last = timers.totals[warmup - 1], timers.totals[-2]
    spent = {k: last[k] - first[k] for k in clocks}
    in_steps = sum(end - start for start, end in timers.marks[warmup:-1])
    out = dict(actions)
    out["compute"] -= spent["predict"]  # views made in the forward that needs them
    out["engine"] = spent["execute"] - sum(actions.values())
    out["driver"] = spent["train_batch"] - spent["execute"]
    out["optimizer"] = spent["optimizer"]
    update_rest = spent["apply"] - spent["optimizer"] if spent["apply"] else 0.0
    out["correction"] = update_rest + spent["predict"]
    out["Lightning"] = in_steps - spent["train_batch"] - spent["optimizer"] - update_rest
    out["between"] = (t1 - t0) - in_steps
    return {
        "rank": dist.get_rank(),
        "stage": strategy.stage,
        "step_s": (t1 - t0) / n,
        "parts_s": {k: v / n for k, v in out.items()},
        "timers_s": {k: v / n for k, v in spent.items()},
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--schedules",
        default="2bw,1f1b",
        help="comma separated; a 2BW schedule may name its delay correction after a slash "
        "(2bw/none, 2bw/predict; without one: the default correction)",
    )
    parser.add_argument("--ms", default="4,8", help="micro-batch counts, comma separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS / "step_breakdown.json")
    args = parser.parse_args(argv)
    names = [s for s in args.schedules.split(",") if s]
    ms = [int(m) for m in args.ms.split(",") if m]
    configs = [(name, m) for m in ms for name in names]
    runs: list[dict[str, Any]] = []
    pool = RankPool(2, run_id="breakdown", pg_timeout_s=90.0, initializer=schedules._quiet)
    load = {"loadavg_1m": os.getloadavg()[0], "cpu_pressure_60s": cpu_pressure_60s()}
    try:
        for r in range(args.rounds):
            order = configs if r % 2 == 0 else list(reversed(configs))
            for name, m in order:
                print(f"round {r + 1}: {name} m={m}", file=sys.stderr, flush=True)
                try:
                    ranks = pool.run(
                        run_rank, name, m, args.batch_size, args.warmup, args.steps, timeout=300
                    )
                except TaskError as err:
                    print(f"  failed: {err.reason}", file=sys.stderr)
                    continue
                runs.append({"schedule": name, "m": m, "round": r, "ranks": ranks})
    finally:
        pool.close()
    _table(configs, runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "model": schedules.GPT,
        "batch_size": args.batch_size,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "load_before": load,
    }
    args.out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    print(f"JSON: {args.out}")


def _table(configs: list[tuple[str, int]], runs: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="A step taken apart: ms per step on each rank (share of the step)")
    for column in ("schedule", "m", "rank (stage)", "step", *PARTS):
        table.add_column(column, justify="right")
    for name, m in configs:
        mine = [r for r in runs if r["schedule"] == name and r["m"] == m]
        if not mine:
            continue
        for rank in sorted({x["rank"] for r in mine for x in r["ranks"]}):
            rows = [x for r in mine for x in r["ranks"] if x["rank"] == rank]
            step = statistics.median(x["step_s"] for x in rows)
            cells = []
            for part in PARTS:
                value = statistics.median(x["parts_s"][part] for x in rows)
                cells.append(f"{value * 1e3:.1f} ({value / step:.0%})")
            stage = rows[0]["stage"]
            table.add_row(name, str(m), f"{rank} ({stage})", f"{step * 1e3:.0f}", *cells)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
