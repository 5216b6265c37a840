"""vPipe live repartitioning: throughput before and after blocks move, against a run without.

The body is ``BLOCKS`` (16) equal residual MLP blocks of ``schedules.py`` (width 256, hidden 1024,
fp32, AdamW), except that the blocks of stage 0 under the even split (the first 16 / p blocks;
stage 0 runs on global rank p - 1) are wrapped in :class:`HeavyBlock`, made slow in one of two
ways (``--slow``, both by default):

* ``compute``: ``--extra`` (30) additional ``(rows x 256) @ (256 x 1024)`` products in every
  training forward, thrown away: heavier compute on one stage;
* ``delay``: a ``--delay-ms`` (3 ms) wait in every training forward: a slower device, or an
  operation that does not use this machine's cores.

Either way the output and gradients are unchanged, and stage 0 measures about 2.5x the others.
For each p in ``--ranks`` (2 and 4 spawned CPU ranks, one intra-op thread each) and each
schedule (``--schedules``: 1f1b; 2bw is accepted too, with ``flush_every`` = the check interval
so that blocks move at flush points) it runs ``--steps`` (40) steps of batch 64 in m = 8
micro-batches with ``Pipe2BWStrategy(repartition_every=10, repartition_threshold=0.15)``, then
the same with repartitioning off as the control. A callback on global rank 0 times every
training batch and notes the step at which each repartition happened. It prints one table
(samples/s = batch / median step time):

* before: over the steps before the first repartition, after ``--warmup`` (2) warm-up steps;
* after: over the steps after the last repartition, without the step that moved the blocks
  (the move is inside it) and the first one after it;
* without: the control run over the same steps as "after";

with the balance before and after and every repartition's ``describe()``. Writes
``benchmarks/results/repartition.json``::

    python benchmarks/repartition.py                  # about 2 minutes on 2 cores
    python benchmarks/repartition.py --ranks 2 --schedules 1f1b,2bw

With 2 cores, 4 ranks are oversubscribed: the OS shares 2 cores among 4 stages, so a faster
slowest stage helps less than it would with a core per stage (the total work is unchanged),
and rank-0 step times swing from run to run. The figures with p = 2 (a core per rank) are the
meaningful ones here. A weaker imbalance (m = 4, stage 0 about 2x) gained little even on 2
ranks: a step also holds the pipeline's fill and drain and the loop's own per-step work, which
no split shortens.
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
from schedules import OUR_SCHEDULES, _env, _quiet, fit_quietly
from schedules import _lightning_module as schedules_module
from torch import Tensor, nn

RESULTS = Path(__file__).resolve().parent / "results"
BLOCKS = 16


class HeavyBlock(nn.Module):
    """A block that does ``extra`` additional ``(rows x 256) @ (256 x 1024)`` products in every
    training forward and discards them, or (``delay_s``) waits that long, as on a slower device
    or behind an operation that does not use this machine's cores: the wrapped block's output
    and gradients are unchanged. Module level and holding nothing but the block and numbers,
    so it pickles (blocks travel between ranks pickled)."""

    def __init__(self, block: nn.Module, extra: int, delay_s: float = 0.0) -> None:
        super().__init__()
        self.block = block
        self.extra = extra
        self.delay_s = delay_s

    def forward(self, x: Tensor) -> Tensor:
        if self.training and torch.is_grad_enabled():
            if self.delay_s:
                time.sleep(self.delay_s)
            with torch.no_grad():
                rows = x.detach().reshape(-1, x.shape[-1])
                weight = self.block.fc1.weight.detach()
                for _ in range(self.extra):
                    torch.mm(rows, weight.t())
        return self.block(x)


def _lightning_module(heavy: int, extra: int, delay_s: float = 0.0) -> Any:
    """``schedules.py``'s LightningModule with ``BLOCKS`` blocks, the first ``heavy`` of them
    slow (the body is split into stages only when training starts)."""
    model = schedules_module(BLOCKS)
    for index in range(heavy):
        model.body[index] = HeavyBlock(model.body[index], extra, delay_s)
    return model


def _make_step_timer() -> Any:
    from lightning.pytorch import Callback

    class StepTimer(Callback):
        """Every training batch's wall time, the balance at the start, and the batch index at
        which each repartition happened (the strategy checks in its ``on_train_batch_start``,
        after the callbacks', so the move is inside that batch's time)."""

        def __init__(self) -> None:
            self.start = 0.0
            self.step_s: list[float] = []
            self.balance_before: list[int] | None = None
            self.repartition_steps: list[int] = []
            self.seen = 0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.balance_before = list(trainer.strategy.partition.balance)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int
        ) -> None:
            self.step_s.append(time.perf_counter() - self.start)
            done = len(trainer.strategy.repartitions)
            if done > self.seen:
                self.repartition_steps += [idx] * (done - self.seen)
                self.seen = done

    return StepTimer()


def run_rank(
    schedule: str,
    m: int,
    batch_size: int,
    steps: int,
    extra: int,
    every: int,
    threshold: float,
    repartition: bool,
    delay_s: float = 0.0,
) -> dict[str, Any]:
    """Runs on every rank: fit ``steps`` steps with the first 16 / p blocks heavy."""
    import torch.distributed as dist

    from lightning_pipe2bw import Pipe2BWStrategy

    _quiet()
    world = dist.get_world_size()
    kwargs: dict[str, Any] = {"flush_every": every} if schedule == "2bw" else {}
    if repartition:
        kwargs.update(repartition_every=every, repartition_threshold=threshold)
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=m, **kwargs)
    timer = _make_step_timer()
    model = _lightning_module(BLOCKS // world, extra, delay_s)
    trainer = fit_quietly(model, strategy, batch_size, steps, [timer])
    assert strategy.partition is not None
    return {
        "rank": dist.get_rank(),
        "stage": strategy.stage,
        "step_s": timer.step_s,
        "balance_before": timer.balance_before,
        "balance_after": list(strategy.partition.balance),
        "repartition_steps": timer.repartition_steps,
        "repartitions": [
            {
                "describe": r.describe(),
                "current": list(r.current),
                "best": list(r.best),
                "current_s": list(r.current_s),
                "best_s": list(r.best_s),
                "slowdown": r.slowdown,
            }
            for r in strategy.repartitions
        ],
        "final_loss": float(trainer.callback_metrics.get("train_loss", float("nan"))),
    }


def _throughput(step_s: Sequence[float], lo: int, hi: int, batch_size: int) -> float | None:
    """Samples/s from the median of steps [lo, hi), or None if that window is empty."""
    window = list(step_s[lo:hi])
    return batch_size / statistics.median(window) if window else None


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """For every p and schedule, a run with repartitioning and the control without; rank 0's
    figures and the windows."""
    rows = []
    with _env(OMP_NUM_THREADS="1"):
        for p in args.ranks:
            pool = RankPool(p, pg_timeout_s=120.0, initializer=_quiet)
            try:
                for schedule in args.schedules:
                    for slow in args.slow:
                        extra, delay_s = (
                            (args.extra, 0.0) if slow == "compute" else (0, args.delay_ms / 1e3)
                        )
                        runs = {}
                        for on in (True, False):
                            ranks = pool.run(
                                run_rank, schedule, args.microbatches, args.batch_size,
                                args.steps, extra, args.every, args.threshold, on, delay_s,
                                timeout=300,
                            )  # fmt: skip
                            runs[on] = next(r for r in ranks if r["rank"] == 0)
                            print(f"p={p} {schedule} {slow} repartition {'on' if on else 'off'}: "
                                  "done", file=sys.stderr, flush=True)  # fmt: skip
                        row = summarize(p, schedule, runs[True], runs[False], args)
                        rows.append({"slow": slow, **row})
            finally:
                pool.close()
    return rows


def summarize(
    p: int, schedule: str, on: dict[str, Any], off: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    moved = on["repartition_steps"]
    before = (args.warmup, moved[0] if moved else len(on["step_s"]))
    # after the step that moved the blocks (it is inside that step) and the first one after it
    after = (moved[-1] + 2, len(on["step_s"])) if moved else None
    b = args.batch_size
    before_sps = _throughput(on["step_s"], *before, b)
    after_sps = _throughput(on["step_s"], *after, b) if after else None
    without_sps = _throughput(off["step_s"], *after, b) if after else None
    return {
        "p": p,
        "schedule": schedule,
        "balance_before": on["balance_before"],
        "balance_after": on["balance_after"],
        "repartition_steps": moved,
        "repartitions": on["repartitions"],
        "before_window": list(before),
        "after_window": list(after) if after else None,
        "samples_per_s_before": before_sps,
        "samples_per_s_after": after_sps,
        "after_over_before": after_sps / before_sps if after_sps and before_sps else None,
        "samples_per_s_without": without_sps,
        "samples_per_s_without_before_window": _throughput(off["step_s"], *before, b),
        "after_over_without": after_sps / without_sps if after_sps and without_sps else None,
        "control_balance": off["balance_after"],
        "step_s_on": on["step_s"],
        "step_s_off": off["step_s"],
        "final_loss_on": on["final_loss"],
        "final_loss_off": off["final_loss"],
    }


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    cores = len(os.sched_getaffinity(0))
    print(
        f"{BLOCKS} x residual MLP (width 256, hidden 1024), the first 16/p slow (compute: "
        f"+{args.extra} products per forward; delay: {args.delay_ms:g} ms per forward); batch {args.batch_size}, m={args.microbatches}, {args.steps} "
        f"steps, repartition_every={args.every}, threshold {args.threshold:.0%}; 1 thread per "
        f"rank on {cores} cores; samples/s = batch / median rank-0 step"
    )
    print()
    print(
        "| p | schedule | slow stage | balance before | balance after | samples/s before "
        "| samples/s after | after / before | samples/s without (same steps) | after / without |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['p']} | {r['schedule']} | {r['slow']} | {r['balance_before']} "
            f"| {r['balance_after']} "
            f"| {_f(r['samples_per_s_before'], '.0f')} | {_f(r['samples_per_s_after'], '.0f')} "
            f"| {_f(r['after_over_before'], '.3f')} | {_f(r['samples_per_s_without'], '.0f')} "
            f"| {_f(r['after_over_without'], '.3f')} |"
        )
    print()
    for r in rows:
        lo, hi = r["before_window"]
        after = r["after_window"]
        print(
            f"p={r['p']} {r['schedule']} {r['slow']}: before = steps {lo}-{hi - 1}, after = "
            + (f"steps {after[0]}-{after[1] - 1}" if after else "- (no repartition)")
            + f"; final loss on {r['final_loss_on']:.4f}, off {r['final_loss_off']:.4f}"
        )
        if not r["repartitions"]:
            print("  NO REPARTITION HAPPENED")
        for step, rep in zip(r["repartition_steps"], r["repartitions"], strict=True):
            print(f"  step {step}: {rep['describe']}")
    if max(args.ranks) > cores:
        print()
        print(
            f"Note: {max(args.ranks)} ranks on {cores} cores are oversubscribed: the stages share "
            "the cores, so balancing them shortens the step less than with a core per stage."
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="2,4", help="pipeline sizes, comma separated")
    parser.add_argument("--schedules", default="1f1b", help="comma separated (1f1b, 2bw, ...)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of 'before'")
    parser.add_argument("--every", type=int, default=10, help="repartition_every")
    parser.add_argument("--threshold", type=float, default=0.15, help="repartition_threshold")
    parser.add_argument("--extra", type=int, default=30, help="extra products per heavy forward")
    parser.add_argument(
        "--slow", default="compute,delay", help="how stage 0 is slow: compute, delay or both"
    )
    parser.add_argument("--delay-ms", type=float, default=3.0, help="wait per heavy forward")
    parser.add_argument("--out", default=str(RESULTS / "repartition.json"))
    args = parser.parse_args(argv)
    args.ranks = [int(p) for p in args.ranks.split(",") if p.strip()]
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    args.slow = [s.strip() for s in args.slow.split(",") if s.strip()]
    if set(args.slow) - {"compute", "delay"}:
        parser.error(f"--slow takes compute and/or delay, got {args.slow}")
    unknown = set(args.schedules) - set(OUR_SCHEDULES)
    if unknown:
        parser.error(f"unknown schedules {sorted(unknown)}; choose from {OUR_SCHEDULES}")
    if any(BLOCKS % p for p in args.ranks):
        parser.error(f"every p must divide {BLOCKS}")
    if args.batch_size % args.microbatches:
        parser.error(f"--batch-size {args.batch_size} is not divisible by {args.microbatches}")
    _quiet()
    load_before = {"loadavg_1m": os.getloadavg()[0], "cpu_pressure_60s": cpu_pressure_60s()}
    started = time.perf_counter()
    rows = measure(args)
    runtime = time.perf_counter() - started
    load_after = {"loadavg_1m": os.getloadavg()[0], "cpu_pressure_60s": cpu_pressure_60s()}
    report(args, rows)
    print(
        f"load average before {load_before['loadavg_1m']:.2f}, after "
        f"{load_after['loadavg_1m']:.2f}; runtime {runtime:.0f} s"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python benchmarks/repartition.py " + " ".join(sys.argv[1:]),
                "config": {**vars(args), "blocks": BLOCKS, "cores": len(os.sched_getaffinity(0))},
                "runtime_s": runtime,
                "load_before": load_before,
                "load_after": load_after,
                "results": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
