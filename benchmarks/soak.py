"""Soak test: does a long PipeDream-2BW run keep each rank's memory flat?

Trains the tiny byte-level GPT of ``lightning_pipe2bw.recipes.gpt`` (2 layers, width 32, block 32) for a
few thousand steps on 2 spawned CPU processes with ``schedule="2bw"``, one intra-op thread each,
with a validation every ``--val-every`` steps (a 2BW flush point) and a ``ModelCheckpoint`` every
``--ckpt-every`` steps (``save_top_k=2`` on the step, so older files are deleted; in a temp dir),
and a CSV logger. A callback on every rank samples the process's resident set size (``VmRSS`` and
``RssAnon`` from ``/proc/self/status``) every ``--sample-every`` steps, together with the engine's
counters (live and peak activation bytes, in-flight slots, the action timeline's length, pending
send bytes, 2BW weight buffers, per-batch leaves and hyper-parameter snapshots, report-channel
sends) and ``sys.getallocatedblocks()`` (Python's small-object blocks: a cheap count of Python
objects); ``len(gc.get_objects())`` is taken at the start and the end of training only, or every
``--gc-every`` steps (its list of every object, ~3 MiB here, raises the heap's high-water mark, so
periodic counts perturb RSS). With spawned workers nothing comes back by itself, so each rank
writes its samples to a JSON file that this process reads.

    python benchmarks/soak.py                     # 3000 steps, 2 to 5 minutes on 2 cores
    python benchmarks/soak.py --steps 1000 --no-timeline

It prints one row per rank: the RSS at the first sample after warm-up (after the first validation
and the first checkpoint, which allocate once), at the end, the growth (in MiB and per 1000
steps), the least-squares slope over the second half of the run and the maximum, with the verdict
"flat" when that slope is below ``--flat-threshold`` MiB per 1000 steps and "GROWING" otherwise;
then the engine's counters at the end of fit and the action timeline's share of the slope.
Writes every sample to ``--out`` (``benchmarks/results/soak.json``) and a plot of RSS against
step next to it (``soak.png``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shlex
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from machine import cpu_pressure_60s

from lightning_pipe2bw import Pipe2BWStrategy
from lightning_pipe2bw.recipes.gpt import GPT, StdlibTextDataModule
from lightning_pipe2bw.runtime.engine import ActionTiming
from lightning_pipe2bw.schedule import Action, ActionKind

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "soak.json"
MIB = 1024.0 * 1024.0


def read_status() -> dict[str, int]:
    """``VmRSS``, ``VmHWM`` and ``RssAnon`` of this process in bytes (``/proc/self/status``)."""
    wanted = {"VmRSS": "rss", "VmHWM": "hwm", "RssAnon": "rss_anon"}
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in wanted:
                out[wanted[key]] = int(value.split()[0]) * 1024  # the kernel reports kB
    return out


def timeline_entry_bytes(n: int = 20_000) -> float:
    """Python heap bytes per entry of the engine's action timeline (an ``ActionTiming`` holding a
    fresh ``Action``, as the 2BW driver makes them), measured here with ``tracemalloc``."""
    entries: list[ActionTiming] = []
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for k in range(n):
        action = Action(0, ActionKind.FORWARD, 1000 + k, 1000 + k // 4)
        entries.append(ActionTiming(action, time.perf_counter(), time.perf_counter()))
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / n - 8  # less the list slot the deque does not pay


def machine_load() -> dict[str, float | None]:
    """The 1/5/15-minute load averages and, where the kernel has it, the 60 s CPU pressure."""
    one, five, fifteen = os.getloadavg()
    return {
        "load_1m": one,
        "load_5m": five,
        "load_15m": fifteen,
        "cpu_pressure_60s": cpu_pressure_60s(),
    }


def malloc_trim() -> None:
    """Give glibc's free heap pages back to the kernel, so that RSS counts memory in use rather
    than the allocator's high-water mark (a no-op without glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class MemorySampler(Callback):
    """Samples this rank's memory and the pipeline's counters; writes them to
    ``<out_dir>/rank<global rank>.json`` at the end of fit (after the strategy's last flush)."""

    def __init__(
        self,
        out_dir: Path,
        every: int,
        gc_every: int,
        threads: int,
        timeline: bool,
        trim: bool,
        mid_step: int = 0,
    ) -> None:
        self.out_dir = out_dir
        self.mid_step = mid_step  # Python objects are counted by type here and at the end
        self.type_counts: dict[str, Counter[str]] = {}
        self.every = every
        self.gc_every = gc_every
        self.threads = threads
        self.timeline = timeline
        self.trim = trim
        self.samples: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.start = 0.0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        torch.set_num_threads(self.threads)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start = time.perf_counter()
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        engine.record_timeline = self.timeline
        self._sample(trainer, "train_start")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step % self.every == 0:
            sample = self._sample(trainer, "step")
            if trainer.is_global_zero and step % (self.every * 10) == 0:
                print(
                    f"[soak] step {step}/{trainer.max_steps}  rank 0 RSS "
                    f"{sample['rss'] / MIB:.1f} MiB  ({sample['t']:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self.events.append({"step": trainer.global_step, "kind": "validation"})

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.events.append({"step": trainer.global_step, "kind": "checkpoint"})

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._sample(trainer, "fit_end")
        strategy = trainer.strategy
        record = {
            "global_rank": trainer.global_rank,
            "stage": getattr(strategy, "stage", None),
            "threads": torch.get_num_threads(),
            "pid": os.getpid(),
            "seconds": time.perf_counter() - self.start,
            "timeline_maxlen": strategy.engine.stats.timeline.maxlen,  # type: ignore[attr-defined]
            "samples": self.samples,
            "events": self.events,
            "type_growth": _growth(self.type_counts),
        }
        path = self.out_dir / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps(record) + "\n")

    def _sample(self, trainer: Trainer, kind: str) -> dict[str, Any]:
        strategy: Any = trainer.strategy
        engine, driver = strategy.engine, strategy.driver
        reports = getattr(driver, "channel", None)  # 2BW's channel of step values
        step = trainer.global_step
        sample: dict[str, Any] = {"step": step, "kind": kind, "t": time.perf_counter() - self.start}
        if self.trim:
            malloc_trim()
        sample.update(read_status())
        stats = engine.stats
        sample.update(
            activation_bytes=stats.activation_bytes,
            peak_activation_bytes=stats.peak_activation_bytes,
            slots=len(engine.slots),
            timeline=len(stats.timeline),
            pending_bytes=engine.transport.pending_bytes,
            pending_sends=len(getattr(engine.transport, "_pending", ())),
            callback_metrics=len(trainer.callback_metrics),
            allocated_blocks=sys.getallocatedblocks(),
        )
        if hasattr(driver, "versions"):  # private counters, read with a default: diagnostics only
            sample.update(
                weight_buffers=driver.weight_buffers,
                leaf_sets=len(getattr(driver.versions, "_leaves", ())),
                hyper_snapshots=len(getattr(driver.optimizer, "_hyper", ())),
            )
        if reports is not None:
            sample.update(report_sends=len(reports._sends), report_backlog=reports.backlog)
        if kind != "step" or (self.gc_every and step % self.gc_every == 0):
            sample["gc_objects"] = len(gc.get_objects())  # after the RSS reading above
        if (kind == "step" and step >= self.mid_step and "mid" not in self.type_counts) or (
            kind == "fit_end"
        ):  # what kinds of Python object accumulate (after the RSS reading above)
            label = "end" if kind == "fit_end" else "mid"
            objects = gc.get_objects()
            counts = Counter(type(o).__qualname__ for o in objects)
            # classes made while training (a class per call somewhere) show up by their names
            counts.update(
                f"class {o.__module__}.{o.__qualname__}" for o in objects if isinstance(o, type)
            )
            self.type_counts[label] = counts
            sample[f"type_counts_{label}"] = True
        self.samples.append(sample)
        return sample


def _growth(counts: dict[str, Counter[str]]) -> list[tuple[str, int]]:
    """The object types whose count grew most between the middle and the end of the run."""
    if "mid" not in counts or "end" not in counts:
        return []
    delta = counts["end"].copy()
    delta.subtract(counts["mid"])
    return [(name, n) for name, n in delta.most_common(12) if n > 0]


def slope_per_1000(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x, times 1000 (MiB per 1000 steps)."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return 1000.0 * sxy / sxx if sxx else float("nan")


def _filling_rate(samples: list[dict[str, Any]], maxlen: int | None) -> float:
    """Timeline entries per step while the timeline fills (before it reaches ``maxlen``)."""
    filling = [s for s in samples if maxlen is None or s["timeline"] < maxlen]
    if len(filling) < 2 or filling[-1]["step"] == filling[0]["step"]:
        return 0.0
    return (filling[-1]["timeline"] - filling[0]["timeline"]) / (
        filling[-1]["step"] - filling[0]["step"]
    )


def summarize(
    record: dict[str, Any], args: argparse.Namespace, entry_bytes: float
) -> dict[str, Any]:
    """RSS after warm-up, at the end, growth, second-half slope and the verdict of one rank."""
    steps = [s for s in record["samples"] if s["kind"] == "step"]
    warm = max(args.val_every, args.ckpt_every)  # the first validation and checkpoint are done
    after = [s for s in steps if s["step"] > warm] or steps
    first, last = after[0], steps[-1]
    half = [(s["step"], s["rss"] / MIB) for s in steps if s["step"] >= args.steps / 2]
    half_anon = [(s["step"], s["rss_anon"] / MIB) for s in steps if s["step"] >= args.steps / 2]
    span = max(last["step"] - first["step"], 1)
    growth = (last["rss"] - first["rss"]) / MIB
    slope = slope_per_1000(half)
    end = record["samples"][-1]
    gcs = [(s["step"], s["gc_objects"]) for s in record["samples"] if "gc_objects" in s]
    blocks = [(s["step"], s["allocated_blocks"]) for s in steps if s["step"] >= args.steps / 2]
    half_timeline = [(s["step"], s["timeline"]) for s in steps if s["step"] >= args.steps / 2]
    return {
        "rank": record["global_rank"],
        "stage": record["stage"],
        "threads": record["threads"],
        "warm_step": first["step"],
        "rss_warm_mib": first["rss"] / MIB,
        "end_step": last["step"],
        "rss_end_mib": last["rss"] / MIB,
        "growth_mib": growth,
        "growth_mib_per_1000": 1000.0 * growth / span,
        "slope_second_half_mib_per_1000": slope,
        "slope_second_half_anon_mib_per_1000": slope_per_1000(half_anon),
        "rss_max_mib": max(s["rss"] for s in steps) / MIB,
        "hwm_mib": end["hwm"] / MIB,
        "verdict": "flat" if abs(slope) < args.flat_threshold else "GROWING",
        "gc_objects_first_last": [gcs[0], gcs[-1]] if gcs else None,
        "allocated_blocks_warm_end": [first["allocated_blocks"], last["allocated_blocks"]],
        "allocated_blocks_slope_second_half_per_1000": slope_per_1000(blocks),
        "pending_bytes_max": max(s["pending_bytes"] for s in steps),
        "report_sends_max": max(s.get("report_sends", 0) for s in steps),
        "timeline_per_step": _filling_rate(record["samples"], record["timeline_maxlen"]),
        "type_growth_second_half": record.get("type_growth", []),
        "timeline_share_mib_per_1000": 1000.0
        * (half_timeline[-1][1] - half_timeline[0][1])
        / max(half_timeline[-1][0] - half_timeline[0][0], 1)
        * entry_bytes
        / MIB,
        "end_counters": {
            k: end.get(k)
            for k in (
                "slots",
                "activation_bytes",
                "peak_activation_bytes",
                "pending_bytes",
                "pending_sends",
                "weight_buffers",
                "leaf_sets",
                "hyper_snapshots",
                "report_sends",
                "report_backlog",
                "timeline",
                "gc_objects",
            )
        },
        "timeline_maxlen": record["timeline_maxlen"],
        "seconds": record["seconds"],
    }


def plot(
    records: list[dict[str, Any]], summaries: list[dict[str, Any]], path: Path, title: str
) -> None:
    """RSS against step, one line per rank, with the second-half fit and the flush points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    for record, summary in zip(records, summaries, strict=True):
        steps = [s for s in record["samples"] if s["kind"] == "step"]
        xs = [s["step"] for s in steps]
        line = ax.plot(
            xs,
            [s["rss"] / MIB for s in steps],
            lw=1.3,
            label=(
                f"rank {summary['rank']} (stage {summary['stage']}): "
                f"{summary['slope_second_half_mib_per_1000']:+.2f} MiB/1000 steps, "
                f"{summary['verdict']}"
            ),
        )
        half = [s for s in steps if s["step"] >= xs[-1] / 2]
        if len(half) >= 2:
            slope = summary["slope_second_half_mib_per_1000"] / 1000.0
            mx = sum(s["step"] for s in half) / len(half)
            my = sum(s["rss"] / MIB for s in half) / len(half)
            ends = [half[0]["step"], half[-1]["step"]]
            ax.plot(
                ends,
                [my + slope * (x - mx) for x in ends],
                ls="--",
                lw=1,
                color=line[0].get_color(),
            )
    marks = {(e["step"], e["kind"]) for e in records[0]["events"]}
    for step, kind in sorted(marks):
        ax.axvline(
            step,
            color="grey" if kind == "validation" else "tab:green",
            lw=0.6,
            alpha=0.4,
            ls=":" if kind == "validation" else "-",
        )
    ax.set_xlabel("optimizer step (grey dotted: validation, green: checkpoint)")
    ax.set_ylabel("resident set size (MiB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """One fit on spawned workers; returns each rank's record, in rank order."""
    seed_everything(args.seed, workers=True)
    model = GPT(
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        lr=args.lr,
        warmup_steps=30,
        max_steps=args.steps,
    )
    data = StdlibTextDataModule(
        block_size=args.block_size,
        batch_size=args.batch_size,
        max_bytes=args.max_bytes,
        train_samples=args.steps * args.batch_size,  # one epoch is the whole run
        val_samples=args.val_batches * args.batch_size,
        seed=args.seed,
    )
    checkpoints = ModelCheckpoint(
        dirpath=tmp / "checkpoints",
        monitor="step",  # the two newest checkpoints stay; older ones are deleted
        mode="max",
        save_top_k=2,
        every_n_train_steps=args.ckpt_every,
    )
    sampler = MemorySampler(
        tmp,
        args.sample_every,
        args.gc_every,
        args.threads,
        args.timeline,
        args.malloc_trim,
        mid_step=args.steps // 2,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=Pipe2BWStrategy(
            schedule="2bw",
            microbatches=args.microbatches,
            flush_every=args.flush_every,
            start_method="spawn",
        ),
        max_steps=args.steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=args.log_every,
        logger=CSVLogger(save_dir=str(tmp), name="logs", version=0),
        default_root_dir=str(tmp),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[sampler, checkpoints],
    )
    trainer.fit(model, datamodule=data)
    records = []
    for rank in range(args.devices):
        path = tmp / f"rank{rank}.json"
        if not path.exists():
            raise RuntimeError(f"rank {rank} wrote no samples ({path})")
        records.append(json.loads(path.read_text()))
    files = sorted(p.name for p in (tmp / "checkpoints").glob("*.ckpt"))
    for record in records:
        record["checkpoint_files_at_end"] = files
    return records


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--val-every", type=int, default=250, help="steps between validations")
    parser.add_argument("--ckpt-every", type=int, default=500, help="steps between checkpoints")
    parser.add_argument("--sample-every", type=int, default=50, help="steps between RSS samples")
    parser.add_argument(
        "--gc-every",
        type=int,
        default=0,
        help="steps between len(gc.get_objects()) counts; 0: at the start and end of training only",
    )
    parser.add_argument(
        "--flat-threshold",
        type=float,
        default=1.0,
        help="MiB per 1000 steps: a second-half RSS slope below it is 'flat'",
    )
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-bytes", type=int, default=300_000)
    parser.add_argument("--val-batches", type=int, default=4)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-timeline",
        dest="timeline",
        action="store_false",
        help="turn off the engine's action timeline (to tell its growth from the rest)",
    )
    parser.add_argument(
        "--flush-every",
        type=int,
        default=None,
        help="also drain the 2BW pipeline every this many steps (the strategy's flush_every)",
    )
    parser.add_argument(
        "--malloc-trim",
        action="store_true",
        help="call glibc's malloc_trim(0) before every sample: RSS then shows memory in use",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="the JSON; the PNG goes beside it"
    )
    args = parser.parse_args()
    if args.sample_every < 1 or args.gc_every < 0:
        parser.error("--sample-every must be positive and --gc-every not negative")
    command = shlex.join(["python", *sys.argv])
    print(f"command: {command}", flush=True)
    # spawned ranks inherit this, so torch starts there with one intra-op thread (and Lightning's
    # own choice, cores // local ranks, is skipped); the sampler also sets it in each rank
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    load_before = machine_load()
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores, load before {load_before}", flush=True
    )

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        records = run(args, Path(tmp))
    wall = time.perf_counter() - start
    load_after = machine_load()
    entry_bytes = timeline_entry_bytes()
    summaries = [summarize(r, args, entry_bytes) for r in records]

    print()
    print(
        f"{args.steps} steps of 2BW on {args.devices} ranks in {wall:.0f} s; validation every "
        f"{args.val_every}, checkpoint every {args.ckpt_every}; RSS sampled every "
        f"{args.sample_every} steps; action timeline {'on' if args.timeline else 'off'}, "
        f"flush_every {args.flush_every}, malloc_trim {'on' if args.malloc_trim else 'off'}"
    )
    print()
    print(
        "| rank | stage | threads | RSS after warm-up MiB (step) | RSS end MiB (step) | growth MiB "
        "| per 1000 steps | 2nd-half slope MiB/1000 (anon) | max MiB | verdict |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in summaries:
        print(
            f"| {s['rank']} | {s['stage']} | {s['threads']} | {s['rss_warm_mib']:.1f} "
            f"({s['warm_step']}) | {s['rss_end_mib']:.1f} ({s['end_step']}) | "
            f"{s['growth_mib']:+.2f} | {s['growth_mib_per_1000']:+.2f} | "
            f"{s['slope_second_half_mib_per_1000']:+.2f} "
            f"({s['slope_second_half_anon_mib_per_1000']:+.2f}) | {s['rss_max_mib']:.1f} | "
            f"{s['verdict']} |"
        )
    print(f"(flat: |2nd-half slope| < {args.flat_threshold:g} MiB per 1000 steps)")
    print()
    print('engine counters at the end of fit (after the final flush; "max": over the samples)')
    print(
        "| rank | in-flight slots | live / peak act. bytes | pending send bytes (max) "
        "| weight buffers | leaf sets | hyper snapshots | report sends (max) "
        "| timeline entries / maxlen (per step) | Python blocks, 2nd-half slope per 1000 steps "
        "| gc objects start -> end |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in summaries:
        c = s["end_counters"]
        gcs = s["gc_objects_first_last"]
        gc_text = f"{gcs[0][1]} -> {gcs[-1][1]}" if gcs else "-"
        print(
            f"| {s['rank']} | {c['slots']} | {c['activation_bytes']} / "
            f"{c['peak_activation_bytes']} | {c['pending_bytes']} ({s['pending_bytes_max']}) | "
            f"{c['weight_buffers']} | {c['leaf_sets']} | {c['hyper_snapshots']} | "
            f"{c['report_sends']} ({s['report_sends_max']}) | {c['timeline']} / "
            f"{s['timeline_maxlen']} ({s['timeline_per_step']:.1f}) | "
            f"{s['allocated_blocks_slope_second_half_per_1000']:+.0f} | {gc_text} |"
        )
    for s in summaries:
        maxlen = s["timeline_maxlen"]
        per_step = s["timeline_per_step"]
        if not per_step:
            print(f"rank {s['rank']}: action timeline off")
            continue
        full = f"full after about {maxlen / per_step:.0f} steps"
        print(
            f"rank {s['rank']}: action timeline {full}, then about "
            f"{maxlen * entry_bytes / MIB:.0f} MiB ({entry_bytes:.0f} B per entry); its share of "
            f"the 2nd-half slope {s['timeline_share_mib_per_1000']:+.2f} MiB/1000 steps, the rest "
            f"{s['slope_second_half_mib_per_1000'] - s['timeline_share_mib_per_1000']:+.2f}"
        )
    for s in summaries:
        growth = ", ".join(f"{name} +{n}" for name, n in s["type_growth_second_half"]) or "none"
        print(f"rank {s['rank']}: Python objects that grew over the 2nd half, by type: {growth}")
    print(f"checkpoint files left: {records[0]['checkpoint_files_at_end']}")
    print(f"load before {load_before}")
    print(f"load after  {load_after}")

    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report = {
        "command": command,
        "config": config,
        "wall_seconds": wall,
        "timeline_entry_bytes": entry_bytes,
        "load_before": load_before,
        "load_after": load_after,
        "summary": summaries,
        "ranks": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    title = (
        f"GPT {args.n_layer}x{args.n_embd}, block {args.block_size}, batch {args.batch_size}, "
        f"m={args.microbatches}, 2BW on {args.devices} CPU ranks, {args.steps} steps, "
        f"validation every {args.val_every}, checkpoint every {args.ckpt_every}"
    )
    plot(records, summaries, png, title)
    print(f"wrote {args.out} and {png}; total {wall:.0f} s")


if __name__ == "__main__":
    main()
