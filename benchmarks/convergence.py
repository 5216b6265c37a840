"""Time to accuracy: PipeDream-2BW with each delay remedy against the synchronous schedules,
with AdamW and Muon.

Every configuration trains the main job's GPT (``lightning_pipe2bw.recipes.gpt``: 4 blocks of
width 128, context 128, batches of 32 in 4 micro-batches, 10% warm-up then cosine decay to 10%;
``--n-embd`` and the others change it) on the Python standard library's sources from the same
seed, weights and batches. A configuration is
``<schedule>[-<correction>][/sync=<K>][/fresh]:<optimizer>[@<AdamW's rate>]``:

* the synchronous schedules ``1f1b`` (exact: one device's gradient accumulation), ``zb-h1`` and
  ``interleaved-1f1b``. All three compute one device's gradient accumulation over the same
  micro-batches (within 1e-5 in ``tests/ranks/test_exactness.py`` and the zero-bubble and
  virtual-stage tests): the last two take ``1f1b``'s curve with the same optimizer, and only
  their time is measured (phase 2, whose 2-stage runs check their final loss);
* ``2bw`` with a ``delay_correction`` (``2bw-none``, ``2bw-update_feedback``,
  ``2bw-predict+error_feedback=0.5``...), with a synchronous start of K steps
  (``2bw-error_feedback/sync=30``: ``sync_steps=30``) and with a fresh last stage
  (``2bw-update_feedback/fresh``: ``fresh_last_stage=True``);
* ``adamw``, or ``muon`` (``MuonAdamW``: Muon on the blocks' matrices, AdamW on the rest, one
  learning rate for both; ``muon@0.002``: the AdamW part at 2e-3 of its own, the swept rate
  being Muon's);
* each at several peak learning rates (``--lr-adamw``, ``--lr-muon``).

It runs in two phases:

1. **curves**: every configuration at every learning rate, trained by the strategy on one
   process (p = 1), two runs at a time with one thread each. The update rules do not depend on
   the number of stages: the tests prove each equal, bit for bit, to its single-process
   reference at p = 2 and 4 (``tests/ranks/test_delay.py``, ``tests/ranks/test_exactness.py``),
   and phase 2 checks that 2 stages give this phase's final loss. A fresh last stage is the
   exception (which blocks run without the delay depends on the split): its curves are trained
   on 2 stages, one run at a time.
2. **pipeline**: the best learning rate of each configuration (lowest final validation loss),
   trained by the real strategy on 2 processes (2 stages); its final validation loss is checked
   against phase 1's. Then ``--timing-rounds`` rounds of short runs of every configuration, in
   alternating order (the machine drifts), give each configuration's seconds per training step:
   the median over the full run and the rounds of each run's median step after the tenth.

The target loss is the best synchronous configuration's final validation loss. For every
configuration the report gives the final validation loss at its best learning rate, the steps
to reach the target (from its validation curve, measured every ``--val-every`` steps) and the
wall-clock seconds to reach it on 2 stages (steps x phase 2's seconds per training step,
validation excluded), and plots the validation loss against steps and against wall time.

    python benchmarks/convergence.py                 # the whole sweep (about 80 min on 2 cores)
    python benchmarks/convergence.py --configs 1f1b:adamw 2bw-error_feedback:adamw \\
        --lr-adamw 2e-3 --steps 100                 # a part of it
    python benchmarks/convergence.py --configs 1f1b:muon zb-h1:muon 2bw-none:muon \
        --reuse benchmarks/results/convergence.json --timing-only   # add timings to a report

Writes ``benchmarks/results/convergence.json`` (every curve, the settings, the table) and
``convergence.png``; prints the table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing as mp
import os
import shlex
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything

from lightning_pipe2bw import Pipe2BWStrategy
from lightning_pipe2bw.optim.delay import canonical_correction
from lightning_pipe2bw.recipes.gpt import GPT, StdlibTextDataModule

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results"
# the synchronous schedules; the last two train 1f1b's weights (one device's accumulation)
SYNC_SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b")
# the corrections that survived the screening (docs/pipedream-2bw.md: "nesterov" did not)
CORRECTIONS = ("none", "predict", "error_feedback", "predict+error_feedback=0.5")
DEFAULT_CONFIGS = [
    f"{schedule}:{optimizer}"
    for optimizer in ("adamw", "muon")
    for schedule in ("1f1b", *(f"2bw-{c}" for c in CORRECTIONS))
]


def parse_config(name: str) -> dict[str, Any]:
    """``"<schedule>[-<correction>][/sync=<K>][/fresh]:<optimizer>[@<adamw lr>]"`` -> its parts,
    e.g. ``"2bw-error_feedback/sync=30:muon@0.002"``: 2BW with error feedback after 30
    synchronous steps, ``MuonAdamW`` with its AdamW part at 2e-3 (the swept rate is Muon's);
    ``/fresh``: ``fresh_last_stage=True``."""
    head, _, tail = name.partition(":")
    optimizer, at, adamw_lr = tail.partition("@")
    head, *modifiers = head.split("/")
    if head in SYNC_SCHEDULES:
        schedule, correction = head, ""
    else:
        schedule, _, correction = head.partition("-")
    syncs = [m for m in modifiers if m.startswith("sync=")]
    fresh = "fresh" in modifiers
    bad = (
        schedule not in (*SYNC_SCHEDULES, "2bw")
        or optimizer not in ("adamw", "muon")
        or (at and optimizer != "muon")
        or (modifiers and schedule != "2bw")
        or len(syncs) + fresh != len(modifiers)
        or len(syncs) > 1
    )
    if bad:
        raise ValueError(
            f"bad configuration {name!r}: use e.g. 1f1b:adamw, zb-h1:muon, 2bw-predict:muon, "
            "2bw-error_feedback/sync=30:muon@0.002, 2bw-update_feedback/fresh:muon"
        )
    if schedule == "2bw":
        canonical_correction(correction or "none")  # raises for a bad spec
    return {
        "schedule": schedule,
        "correction": correction or "none",
        "optimizer": optimizer,
        "adamw_lr": float(adamw_lr) if at else None,
        "sync_steps": int(syncs[0].partition("=")[2]) if syncs else 0,
        "fresh": fresh,
    }


def curve_devices(config: str) -> int:
    """The stages a configuration's curve is trained on: one, as every rule but the fresh last
    stage's is the same on any number of stages; two for ``/fresh`` (which blocks run without
    the delay depends on the split)."""
    return 2 if parse_config(config)["fresh"] else 1


def curve_of(config: str) -> str:
    """The configuration whose curve ``config`` has: ``1f1b``'s for the other synchronous
    schedules (one device's gradient accumulation, as 1f1b), its own otherwise."""
    schedule, _, optimizer = config.partition(":")
    return f"1f1b:{optimizer}" if schedule in SYNC_SCHEDULES[1:] else config


def is_synchronous(config: str) -> bool:
    return parse_config(config)["schedule"] in SYNC_SCHEDULES


def without_start(config: str) -> str:
    """``config`` without its synchronous start (``2bw-x/sync=30:muon`` -> ``2bw-x:muon``)."""
    head, _, optimizer = config.partition(":")
    name, *modifiers = head.split("/")
    kept = [m for m in modifiers if not m.startswith("sync=")]
    return "/".join([name, *kept]) + ":" + optimizer


def speed_key(config: str) -> str:
    """What a configuration's seconds per step depend on: its schedule, correction and
    optimizer (not the AdamW part's rate; a synchronous start is timed by its parts)."""
    return without_start(config).partition("@")[0]


def clock(config: str, timing: dict[str, list[float]]) -> Any:
    """Training seconds after n steps of ``config`` on 2 stages, from the measured seconds per
    step: a configuration with a synchronous start of K steps runs them at ``1f1b``'s speed with
    the same optimizer (the same actions: a 1F1B batch drained in its step) and the rest at the
    speed of the same 2BW rule without the start."""

    def median(name: str) -> float:
        values = timing.get(name) or []
        return statistics.median(values) if values else math.nan

    sync = parse_config(config)["sync_steps"]
    if not sync:
        spp = median(speed_key(config))
        return lambda n: n * spp
    t_sync = median(speed_key("1f1b:" + config.partition(":")[2]))
    t_async = median(speed_key(config))
    return lambda n: min(n, sync) * t_sync + max(0, n - sync) * t_async


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Record(Callback):
    """Losses and the training wall time at each validation, written to ``path`` by global
    rank 0 (the last stage, which has every step's own loss) at the end of fit (spawned
    workers run the fit: their callbacks' state stays with them)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.train: list[list[float]] = []
        self.val: list[list[float]] = []
        self.start = 0.0
        self.in_validation = 0.0  # seconds spent validating so far
        self._val_start = 0.0
        self.step_end = 0.0
        self.ends: list[float] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, *_: Any) -> None:
        self.step_end = time.perf_counter()
        # training time at the end of each step, validation excluded
        self.ends.append(self.step_end - self.start - self.in_validation)
        step = trainer.global_step
        if step % 10 == 0 or step == trainer.max_steps:
            loss = trainer.callback_metrics.get("train_loss")
            if loss is not None:
                self.train.append([step, float(loss)])

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        now = time.perf_counter()
        # training time up to the end of this step (the flush before validation included)
        seconds = self._val_start - self.start - self.in_validation
        self.in_validation += now - self._val_start
        loss = trainer.callback_metrics.get("val_loss")
        if loss is not None and not trainer.sanity_checking:
            self.val.append([trainer.global_step, float(loss), seconds])

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            record = {"train": self.train, "val": self.val, "ends": self.ends}
            self.path.write_text(json.dumps(record))


def train(config: str, lr: float, devices: int, args: dict[str, Any]) -> dict[str, Any]:
    """One run of ``config`` at peak learning rate ``lr`` on ``devices`` stages: its curves and
    training wall time (validation excluded)."""
    torch.set_num_threads(1)
    parts = parse_config(config)
    schedule = parts["schedule"]

    seed_everything(args["seed"], workers=True)
    model = GPT(
        block_size=args["block_size"],
        n_layer=args["n_layer"],
        n_head=args["n_head"],
        n_embd=args["n_embd"],
        lr=lr,
        weight_decay=args["weight_decay"],
        warmup_steps=args["warmup"],
        max_steps=args["steps"],
        optimizer=parts["optimizer"],
        adamw_lr=parts["adamw_lr"],
    )
    data = StdlibTextDataModule(
        block_size=args["block_size"],
        batch_size=args["batch_size"],
        max_bytes=args["max_bytes"],
        train_samples=args["steps"] * args["batch_size"],  # one epoch is the whole run
        val_samples=args["val_batches"] * args["batch_size"],
        seed=args["seed"],
    )
    strategy = Pipe2BWStrategy(
        schedule=schedule,
        microbatches=args["microbatches"],
        start_method="spawn" if devices > 1 else "popen",
        **({"delay_correction": parts["correction"]} if schedule == "2bw" else {}),
        **({"sync_steps": parts["sync_steps"]} if parts["sync_steps"] else {}),
        **({"fresh_last_stage": True} if parts["fresh"] else {}),
    )
    out = Path(tempfile.mkdtemp(prefix="convergence-")) / "record.json"
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args["steps"],
        val_check_interval=args["val_every"],
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record(out)],
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    total = time.perf_counter() - start
    record = json.loads(out.read_text())
    shutil.rmtree(out.parent, ignore_errors=True)
    final = record["val"][-1][1] if record["val"] else math.nan
    train_s = record["val"][-1][2] if record["val"] else math.nan
    ends = record["ends"]
    # the steady state: the median step after the first ten (set-up, warm caches)
    steady = statistics.median(b - a for a, b in itertools.pairwise(ends[10:]))
    return {
        "config": config,
        "lr": lr,
        "devices": devices,
        "train": record["train"],
        "val": record["val"],
        "final_val_loss": final,
        "train_seconds": train_s,
        "seconds_per_step": train_s / args["steps"],
        "median_step_seconds": steady,
        "total_seconds": total,
    }


def _phase1_worker(job: tuple[str, float, dict[str, Any]]) -> dict[str, Any]:
    config, lr, args = job
    os.environ["MASTER_PORT"] = str(_free_port())  # two single-process runs side by side
    # one thread, as each of the 2 stages gets on 2 cores (the strategy would take them all)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.pop("LOCAL_RANK", None)
    result = train(config, lr, 1, args)
    print(
        f"[curves] {config:28s} lr {lr:<8g} final val {result['final_val_loss']:.4f} "
        f"({result['total_seconds']:.0f} s)",
        flush=True,
    )
    return result


# the settings a run's curve depends on (not the learning rates swept, nor the timing runs)
_TRAINING = (
    "steps", "microbatches", "batch_size", "block_size", "n_layer", "n_head", "n_embd",
    "weight_decay", "warmup", "max_bytes", "val_every", "val_batches", "seed",
)  # fmt: skip


def _reusable(path: Path, args: dict[str, Any]) -> dict[tuple[str, float], dict[str, Any]]:
    """The phase 1 runs of an earlier report with the same training settings, by (config, lr)."""
    report = json.loads(path.read_text())
    differ = [k for k in _TRAINING if report["settings"].get(k) != args[k]]
    if differ:
        raise SystemExit(
            f"--reuse {path}: written with other training settings ({', '.join(differ)}); "
            "run those again or use the same settings"
        )
    return {(run["config"], run["lr"]): run for run in report["runs"]}


def _reusable_pipeline(
    path: Path,
) -> tuple[dict[str, dict[str, Any]], dict[str, list[float]]]:
    """An earlier report's 2-stage runs and timings, by configuration (none if it stopped after
    phase 1)."""
    report = json.loads(path.read_text())
    timings = {
        speed_key(row["config"]): row["step_seconds_per_round"]
        for row in report.get("table", [])
        if not parse_config(row["config"])["sync_steps"]  # timed by its parts
    }
    return report.get("pipeline", {}), timings


def _write_phase1(out: Path, command: str, args: dict[str, Any], runs: list[Any]) -> None:
    partial = {"command": command, "settings": args, "runs": runs, "phase": 1}
    path = out / "convergence.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(partial, indent=1) + "\n")
    tmp.replace(path)


def steps_to(curve: list[list[float]], target: float) -> tuple[float, float]:
    """The first validation step (and its training seconds) whose loss is at most ``target``."""
    for step, loss, seconds in curve:
        if loss <= target:
            return step, seconds
    return math.nan, math.nan


def best_runs(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each configuration's run at its best learning rate (lowest final validation loss)."""
    best: dict[str, dict[str, Any]] = {}
    for run in runs:
        loss = run["final_val_loss"]
        current = best.get(run["config"])
        if not math.isnan(loss) and (current is None or loss < current["final_val_loss"]):
            best[run["config"]] = run
    return best


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["table"]
    kinds = {parse_config(row["config"])["optimizer"] for row in rows}
    optimizers = [o for o in ("adamw", "muon") if o in kinds]  # a panel per optimizer run
    fig, axes = plt.subplots(2, len(optimizers), figsize=(6.5 * len(optimizers), 9), squeeze=False)
    target = report["target_loss"]
    for col, optimizer in enumerate(optimizers):
        for row in rows:
            if parse_config(row["config"])["optimizer"] != optimizer:
                continue
            curve = row["pipeline_val"] or row["curve_val"]
            steps = [v[0] for v in row["curve_val"]]
            losses = [v[1] for v in row["curve_val"]]
            style = "-" if row["config"].startswith("2bw") else "--"
            label = f"{row['config'].split(':')[0]} (lr {row['lr']:g})"
            axes[0][col].plot(steps, losses, style, marker="o", ms=3, label=label)
            seconds = row["val_seconds"]
            if seconds and not any(math.isnan(x) for x in seconds):
                axes[1][col].plot(seconds, losses, style, marker="o", ms=3, label=label)
            del curve
        for r, xlabel in ((0, "optimizer step"), (1, "training wall time on 2 stages (s)")):
            ax = axes[r][col]
            ax.axhline(target, color="grey", lw=0.8, ls=":", label=f"target {target:.3f}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("validation loss (nats / byte)")
            ax.set_title(
                f"{'AdamW' if optimizer == 'adamw' else 'Muon'}: best lr per configuration"
            )
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(report["title"], fontsize=10, wrap=True)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--lr-adamw", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3, 4e-3])
    parser.add_argument("--lr-muon", type=float, nargs="+", default=[2e-3, 4e-3, 8e-3, 1.6e-2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument(
        "--warmup", type=int, default=None, help="warm-up steps (default: 10%% of --steps)"
    )
    parser.add_argument("--max-bytes", type=int, default=6_000_000)
    parser.add_argument("--val-every", type=int, default=25, help="steps between validations")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parallel", type=int, default=2, help="phase 1 runs at a time")
    parser.add_argument("--skip-pipeline", action="store_true", help="phase 1 only")
    parser.add_argument(
        "--timings",
        type=Path,
        default=None,
        help="a convergence.json of the same model (another horizon): its seconds per step "
        "are taken instead of being measured again",
    )
    parser.add_argument(
        "--reuse-only",
        action="store_true",
        help="with --reuse: run nothing new in phase 1 (a configuration's missing learning "
        "rates are left out of its sweep)",
    )
    parser.add_argument(
        "--timing-only",
        action="store_true",
        help="phase 2 without the full-length 2-stage runs: the timing rounds only",
    )
    parser.add_argument(
        "--timing-rounds", type=int, default=3, help="interleaved timing runs per configuration"
    )
    parser.add_argument("--timing-steps", type=int, default=60, help="steps of a timing run")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--reuse",
        type=Path,
        default=None,
        help="a convergence.json written with the same training settings: its phase 1 runs "
        "are taken instead of being run again (to add learning rates or configurations)",
    )
    ns = parser.parse_args()
    if ns.steps % ns.val_every:
        parser.error(f"--steps ({ns.steps}) must be a multiple of --val-every ({ns.val_every})")
    if ns.warmup is None:
        ns.warmup = ns.steps // 10
    configs = [c for c in ns.configs if parse_config(c)]
    args = {k: v for k, v in vars(ns).items() if k not in ("configs", "out", "reuse", "timings")}
    command = shlex.join(["python", *sys.argv])
    print(f"command: {command}", flush=True)
    started = time.perf_counter()

    missing = sorted({curve_of(c) for c in configs} - set(configs))
    if missing:
        parser.error(
            f"{', '.join(missing)} must be among --configs: the other schedules share its curve"
        )
    jobs = [
        (config, lr, args)
        for config in configs
        if curve_of(config) == config
        for lr in (ns.lr_muon if parse_config(config)["optimizer"] == "muon" else ns.lr_adamw)
    ]
    reused = _reusable(ns.reuse, args) if ns.reuse is not None else {}
    runs = [reused[(c, lr)] for c, lr, _ in jobs if (c, lr) in reused]
    jobs = [job for job in jobs if (job[0], job[1]) not in reused]
    if ns.reuse_only:  # a report from the runs at hand: the learning rates not run are left out
        jobs = []
    print(
        f"phase 1: {len(jobs)} runs, on one process each ({ns.parallel} at a time) or on two "
        "stages (/fresh, one at a time) "
        f"({len(runs)} taken from {ns.reuse})",
        flush=True,
    )
    if jobs:
        ns.out.mkdir(parents=True, exist_ok=True)
        single = [job for job in jobs if curve_devices(job[0]) == 1]
        with mp.get_context("spawn").Pool(ns.parallel, maxtasksperchild=1) as pool:
            for run in pool.imap_unordered(_phase1_worker, single, chunksize=1):
                runs.append(run)
                # every finished run at once: an interrupted sweep resumes with --reuse
                _write_phase1(ns.out, command, args, runs)
        for config, lr, _ in [job for job in jobs if curve_devices(job[0]) == 2]:
            run = train(config, lr, 2, args)  # two processes of one thread: one at a time
            print(
                f"[curves, 2 stages] {config:28s} lr {lr:<8g} final val "
                f"{run['final_val_loss']:.4f} ({run['total_seconds']:.0f} s)",
                flush=True,
            )
            runs.append(run)
            _write_phase1(ns.out, command, args, runs)

    ns.out.mkdir(parents=True, exist_ok=True)
    # phase 1 alone, reusable with --reuse if phase 2 does not finish
    _write_phase1(ns.out, command, args, runs)
    best = best_runs(runs)
    for config in configs:  # zb-h1 and interleaved-1f1b: 1f1b's run, under their own name
        if curve_of(config) != config and curve_of(config) in best:
            best[config] = {**best[curve_of(config)], "config": config}
    pipeline: dict[str, dict[str, Any]] = {}
    # from --reuse: a configuration's seconds per step do not depend on its learning rate, and
    # its 2-stage run stands if its best learning rate has not changed
    earlier = _reusable_pipeline(ns.reuse) if ns.reuse is not None else ({}, {})
    if ns.timings is not None:  # another report's timings (the same model, another horizon)
        earlier[1].update(_reusable_pipeline(ns.timings)[1])
    # seconds per step, by speed_key: the reused ones, and the ones measured below
    timing: dict[str, list[float]] = {k: list(v) for k, v in earlier[1].items()}
    if not ns.skip_pipeline:
        print(f"phase 2: the best learning rate of {len(best)} configurations on 2 stages")
        for config, run in best.items():
            key = speed_key(config)
            timing.setdefault(key, [])
            if config in earlier[0] and earlier[0][config]["lr"] == run["lr"]:
                pipeline[config] = earlier[0][config]
                continue
            if ns.timing_only:
                continue
            result = train(config, run["lr"], 2, args)
            pipeline[config] = result
            timing[key].append(result["median_step_seconds"])
            print(
                f"[2 stages] {config:28s} lr {run['lr']:<8g} final val "
                f"{result['final_val_loss']:.4f} (1 process: {run['final_val_loss']:.4f}), "
                f"{1000 * result['median_step_seconds']:.1f} ms/step",
                flush=True,
            )
        # seconds per step: interleaved rounds of short runs (the machine drifts), the median
        short = {**args, "steps": ns.timing_steps, "val_every": ns.timing_steps}
        # one timing per speed key (a synchronous start's comes from 1f1b's and its rule's)
        lr_of: dict[str, float] = {}
        for config, run in best.items():
            lr_of.setdefault(speed_key(config), run["lr"])
            if parse_config(config)["sync_steps"]:
                lr_of.setdefault(speed_key("1f1b:" + config.partition(":")[2]), run["lr"])
        for config in lr_of:
            timing.setdefault(config, [])
        untimed = [c for c in lr_of if not timing[c]]
        for round_ in range(ns.timing_rounds if untimed else 0):
            order = untimed if round_ % 2 == 0 else list(reversed(untimed))
            for config in order:
                result = train(config, lr_of[config], 2, short)
                timing[config].append(result["median_step_seconds"])
            print(f"timing round {round_ + 1}/{ns.timing_rounds} done", flush=True)

    synchronous = [r["final_val_loss"] for c, r in best.items() if is_synchronous(c)]
    target = min(synchronous) if synchronous else min(r["final_val_loss"] for r in best.values())
    table = []
    for config in configs:
        if config not in best:
            continue
        run = best[config]
        pipe = pipeline.get(config)
        at = clock(config, timing)
        spp = at(ns.steps) / ns.steps
        step, _ = steps_to(run["val"], target)
        near, _ = steps_to(run["val"], target * 1.01)
        same_opt = best.get("1f1b:" + config.split(":")[1])
        table.append(
            {
                "config": config,
                "lr": run["lr"],
                "final_val_loss": run["final_val_loss"],
                "vs_1f1b_same_optimizer": (
                    run["final_val_loss"] / same_opt["final_val_loss"] - 1 if same_opt else math.nan
                ),
                "vs_target": run["final_val_loss"] / target - 1,
                "pipeline_final_val_loss": pipe["final_val_loss"] if pipe else math.nan,
                "seconds_per_step": spp,
                "step_seconds_per_round": timing.get(speed_key(config), []),
                "steps_to_target": step,
                "seconds_to_target": at(step),
                "steps_to_1pct": near,
                "seconds_to_1pct": at(near),
                "val_seconds": [at(v[0]) for v in run["val"]],
                "curve_val": run["val"],
                "pipeline_val": pipe["val"] if pipe else [],
            }
        )
    report = {
        "command": command,
        "settings": args,
        "title": (
            f"GPT {ns.n_layer}x{ns.n_embd}, context {ns.block_size}, batch {ns.batch_size} "
            f"(m={ns.microbatches}), {ns.steps} steps; target = best synchronous final val loss"
        ),
        "target_loss": target,
        "table": table,
        "runs": runs,
        "pipeline": pipeline,
        "total_seconds": time.perf_counter() - started,
    }
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "convergence.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, ns.out / "convergence.png")

    print()
    print(f"target: {target:.4f} (the best synchronous configuration's final validation loss)")
    print()
    print(
        "| configuration | best lr | final val loss | vs target | vs 1f1b, same optimizer | "
        "2 stages: final val loss | ms / step (2 stages) | steps to target | s to target | "
        "steps to target + 1% | s to target + 1% |"
    )
    print("|" + " --- |" * 11)
    for row in table:
        print(
            f"| {row['config']} | {row['lr']:g} | {row['final_val_loss']:.4f} | "
            f"{row['vs_target']:+.1%} | {row['vs_1f1b_same_optimizer']:+.1%} | "
            f"{row['pipeline_final_val_loss']:.4f} | {1000 * row['seconds_per_step']:.1f} | "
            f"{row['steps_to_target']:g} | {row['seconds_to_target']:.0f} | "
            f"{row['steps_to_1pct']:g} | {row['seconds_to_1pct']:.0f} |"
        )
    print()
    print("final validation loss by peak learning rate:")
    for optimizer, lrs in (("adamw", ns.lr_adamw), ("muon", ns.lr_muon)):
        rows = [c for c in configs if parse_config(c)["optimizer"] == optimizer]
        if not rows:
            continue
        print()
        print("| configuration | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |")
        print("| --- |" + " --- |" * len(lrs))
        for config in rows:
            by_lr = {r["lr"]: r["final_val_loss"] for r in runs if r["config"] == curve_of(config)}
            cells = " | ".join(f"{by_lr.get(lr, math.nan):.4f}" for lr in lrs)
            print(f"| {config} | {cells} |")
    print(f"\nwrote {ns.out / 'convergence.json'} and {ns.out / 'convergence.png'}")
    print(f"total {report['total_seconds']:.0f} s")


if __name__ == "__main__":
    main()
