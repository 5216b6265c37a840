"""What each 2BW delay correction costs: seconds per step and memory per stage.

Trains the main job's GPT (4 blocks of width 128, context 128, batch 32 in 4 micro-batches) on
2 stages with ``schedule="2bw"`` and each ``delay_correction``, with AdamW and with Muon
(``MuonAdamW``), for ``--steps`` steps per run, in ``--rounds`` rounds whose order alternates (the
machine drifts). For each run it records the median step after the tenth, and
``StageMemoryMonitor``'s largest figures per stage: the weight buffers (``weight_versions``) and
the optimizer's state, which holds a correction's per-parameter state too.

    python benchmarks/delay_cost.py                   # 10 configurations x 3 rounds, ~15 min
    python benchmarks/delay_cost.py --rounds 1 --steps 30

Writes ``benchmarks/results/delay_cost.json`` and prints a table: milliseconds per step (the
median over rounds, and the range), the ratio to the plain rule with the same optimizer, and
each stage's weight-buffer and optimizer-state MiB.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything

from lightning_pipe2bw import Pipe2BWStrategy, StageMemoryMonitor
from lightning_pipe2bw.recipes.gpt import GPT, StdlibTextDataModule

ROOT = Path(__file__).resolve().parent.parent
CORRECTIONS = ("none", "predict", "error_feedback", "nesterov", "predict+error_feedback=0.5")


class Record(Callback):
    """The end time of every step, and the memory monitor's per-stage peaks, written to ``path``
    by global rank 0 at the end of fit (the fit runs in spawned workers)."""

    def __init__(self, path: Path, monitor: StageMemoryMonitor) -> None:
        self.path = path
        self.monitor = monitor
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, *_: Any) -> None:
        self.ends.append(time.perf_counter())

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps({"ends": self.ends, "peaks": self.monitor.peaks()}))


def run(optimizer: str, correction: str, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    seed_everything(0, workers=True)
    model = GPT(lr=2e-3 if optimizer == "adamw" else 8e-3, max_steps=steps, optimizer=optimizer)
    data = StdlibTextDataModule(
        block_size=128, batch_size=32, max_bytes=2_000_000, train_samples=steps * 32, seed=0
    )
    out = Path(tempfile.mkdtemp(prefix="delay-cost-")) / "record.json"
    monitor = StageMemoryMonitor(log_every_n_steps=5, plot=False)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=Pipe2BWStrategy(
            schedule="2bw", microbatches=4, delay_correction=correction, start_method="spawn"
        ),
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor, Record(out, monitor)],
    )
    trainer.fit(model, datamodule=data)
    record = json.loads(out.read_text())
    shutil.rmtree(out.parent, ignore_errors=True)
    steps_s = [b - a for a, b in pairwise(record["ends"][10:])]
    return {"step_s": statistics.median(steps_s), "peaks": record["peaks"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "muon"])
    parser.add_argument("--corrections", nargs="+", default=list(CORRECTIONS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    command = shlex.join(["python", *sys.argv])
    print(f"command: {command}", flush=True)
    configs = [(o, c) for o in args.optimizers for c in args.corrections]
    results: dict[str, dict[str, Any]] = {f"{o}/{c}": {"step_s": []} for o, c in configs}
    for round_ in range(args.rounds):
        order = configs if round_ % 2 == 0 else list(reversed(configs))
        for optimizer, correction in order:
            got = run(optimizer, correction, args.steps)
            entry = results[f"{optimizer}/{correction}"]
            entry["step_s"].append(got["step_s"])
            entry["peaks"] = got["peaks"]
            print(
                f"round {round_ + 1} {optimizer:5s} {correction:28s} "
                f"{1000 * got['step_s']:.1f} ms/step",
                flush=True,
            )
    print()
    print(
        "| optimizer | delay_correction | ms / step (median, range) | vs none | weight buffers "
        "per stage (MiB) | optimizer state per stage (MiB) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for optimizer, correction in configs:
        entry = results[f"{optimizer}/{correction}"]
        median = statistics.median(entry["step_s"])
        base = statistics.median(results[f"{optimizer}/none"]["step_s"])
        entry["median_step_s"] = median
        entry["vs_none"] = median / base
        peaks = entry["peaks"]
        weights = " / ".join(f"{s['weight_versions'] / 2**20:.2f}" for s in peaks)
        state = " / ".join(f"{s['optimizer_state'] / 2**20:.2f}" for s in peaks)
        spread = f"{1000 * min(entry['step_s']):.1f}-{1000 * max(entry['step_s']):.1f}"
        print(
            f"| {optimizer} | {correction} | {1000 * median:.1f} ({spread}) | "
            f"{median / base:.3f}x | {weights} | {state} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "delay_cost.json"
    settings = {**vars(args), "out": str(args.out)}
    report = {"command": command, "settings": settings, "results": results}
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
