"""Convergence of PipeDream-2BW (one step of weight delay) against 1F1B (exact, flushed).

Trains the same small byte-level GPT (``lightning_pipe2bw.recipes.gpt``) on the Python standard library's
sources with ``schedule="2bw"`` and ``schedule="1f1b"``: same seed, same initial weights, same
batches, 2 CPU processes (one pipeline stage each), 4 micro-batches per batch, AdamW with warm-up
and cosine decay, once per peak learning rate (``--lr``, several by default: the gap 2BW's delay
opens depends strongly on it). Each run is a real Lightning ``Trainer`` with spawned workers; the
losses are read back from the CSV logger's file (written on global rank 0, the last stage).

    python benchmarks/convergence.py                      # 3 rates x 2 schedules x 300 steps
    python benchmarks/convergence.py --lr 5e-4 --steps 100 --val-every 50

Writes ``benchmarks/results/convergence.png`` (one panel per rate: training curves and
validation points) and ``benchmarks/results/convergence.json`` (the curves, the final losses and
the settings), and prints a table of the final losses and, per rate, the relative difference of
2BW's final validation loss from 1F1B's.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from lightning_pipe2bw import Pipe2BWStrategy
from lightning_pipe2bw.recipes.gpt import GPT, StdlibTextDataModule

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_OUT = ROOT / "benchmarks" / "results"


class Progress(Callback):
    """Prints the training loss every ``every`` steps, on global rank 0 only."""

    def __init__(self, label: str, every: int) -> None:
        self.label = label
        self.every = every
        self.start = 0.0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and (step % self.every == 0 or step == trainer.max_steps):
            loss = trainer.callback_metrics.get("train_loss")
            value = f"{float(loss):.4f}" if loss is not None else "n/a"
            elapsed = time.perf_counter() - self.start
            print(
                f"[{self.label}] step {step:4d}/{trainer.max_steps}  train_loss {value}  "
                f"({elapsed:.0f} s)",
                flush=True,
            )


def read_metrics(csv_path: Path) -> dict[str, list[list[float]]]:
    """``{"train": [[step, loss], ...], "val": [[step, loss, ppl], ...]}`` from a CSVLogger file."""
    train: list[list[float]] = []
    val: list[list[float]] = []
    with csv_path.open(newline="") as f:
        for row in csv.DictReader(f):
            step = float(row["step"])
            if row.get("train_loss"):
                train.append([step, float(row["train_loss"])])
            if row.get("val_loss"):
                ppl = float(row["val_ppl"]) if row.get("val_ppl") else math.nan
                val.append([step, float(row["val_loss"]), ppl])
    return {"train": train, "val": val}


def run(schedule: str, lr: float, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Train one schedule from the seed; return its curves, final losses and wall time."""
    seed_everything(args.seed, workers=True)
    model = GPT(
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        lr=lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup,
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
    logger = CSVLogger(save_dir=str(log_dir), name=f"{schedule}-lr{lr:g}", version=0)
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=Pipe2BWStrategy(
            schedule=schedule, microbatches=args.microbatches, start_method="spawn"
        ),
        max_steps=args.steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=args.log_every,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Progress(f"{schedule} lr {lr:g}", every=args.print_every)],
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    metrics = read_metrics(Path(logger.log_dir) / "metrics.csv")
    if not metrics["train"] or not metrics["val"]:
        raise RuntimeError(f"{schedule}: no losses in {logger.log_dir}/metrics.csv")
    last = [loss for _, loss in metrics["train"][-5:]]
    return {
        "train": metrics["train"],
        "val": metrics["val"],
        "final_train_loss": metrics["train"][-1][1],
        "final_train_loss_mean_last5": sum(last) / len(last),
        "final_val_loss": metrics["val"][-1][1],
        "final_val_ppl": metrics["val"][-1][2],
        "final_val_step": metrics["val"][-1][0],
        "seconds": seconds,
    }


def plot(sweep: dict[float, dict[str, Any]], path: Path, title: str) -> None:
    """One panel per learning rate: both schedules' training curves and validation points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweep), figsize=(6 * len(sweep), 4.5), squeeze=False)
    styles = {"2bw": ("tab:red", "PipeDream-2BW"), "1f1b": ("tab:blue", "1F1B (flush)")}
    for ax, (lr, entry) in zip(axes[0], sweep.items(), strict=True):
        for schedule, res in entry["runs"].items():
            color, label = styles.get(schedule, (None, schedule))
            steps, losses = zip(*res["train"], strict=True)
            ax.plot(steps, losses, color=color, alpha=0.8, lw=1.2, label=f"{label}: train")
            vsteps = [v[0] for v in res["val"]]
            vlosses = [v[1] for v in res["val"]]
            ax.plot(
                vsteps,
                vlosses,
                color=color,
                marker="o",
                ls="--",
                ms=6,
                label=f"{label}: validation",
            )
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats / byte)")
        ax.set_title(
            f"lr {lr:g}: final val loss, 2BW vs 1F1B {entry['relative']:+.1%}", fontsize=10
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--schedules", nargs="+", default=["2bw", "1f1b"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument(
        "--lr",
        type=float,
        nargs="+",
        default=[2e-4, 5e-4, 2e-3],
        help="peak learning rates; both schedules train once per rate",
    )
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--max-bytes", type=int, default=6_000_000)
    parser.add_argument("--val-every", type=int, default=100, help="steps between validations")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--print-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="keep the CSV logs here (default: a temp dir)"
    )
    args = parser.parse_args()
    if args.steps % args.val_every != 0:
        parser.error(
            f"--steps ({args.steps}) must be a multiple of --val-every ({args.val_every}) so that "
            "the last step is validated"
        )
    command = shlex.join(["python", *sys.argv])
    print(f"command: {command}", flush=True)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads in the launcher", flush=True
    )

    start = time.perf_counter()
    sweep: dict[float, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="convergence-") as tmp:
        log_dir = args.log_dir if args.log_dir is not None else Path(tmp)
        for lr in args.lr:
            results: dict[str, dict[str, Any]] = {}
            for schedule in args.schedules:
                results[schedule] = run(schedule, lr, args, log_dir)
                print(
                    f"[{schedule} lr {lr:g}] done in {results[schedule]['seconds']:.1f} s",
                    flush=True,
                )
            rel = math.nan
            if "2bw" in results and "1f1b" in results:
                base = results["1f1b"]["final_val_loss"]
                rel = (results["2bw"]["final_val_loss"] - base) / base
            sweep[lr] = {"runs": results, "relative": rel}
    total = time.perf_counter() - start

    print()
    print("| lr | schedule | final train loss (mean of last 5) | final val loss | val ppl | s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for lr, entry in sweep.items():
        for schedule, res in entry["runs"].items():
            print(
                f"| {lr:g} | {schedule} | {res['final_train_loss_mean_last5']:.4f} | "
                f"{res['final_val_loss']:.4f} | {res['final_val_ppl']:.3f} | {res['seconds']:.0f} |"
            )
    print()
    for lr, entry in sweep.items():
        print(f"lr {lr:g}: 2BW's final val loss vs 1F1B's: {entry['relative']:+.2%}")

    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    title = (
        f"GPT {args.n_layer}x{args.n_embd}, block {args.block_size}, batch {args.batch_size}, "
        f"{args.devices} stages, m={args.microbatches}, {args.steps} steps, AdamW"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "convergence.png"
    plot(sweep, png, title)
    report = {
        "command": command,
        "config": config,
        "total_seconds": total,
        "relative_difference_final_val_loss_2bw_vs_1f1b": {
            f"{lr:g}": entry["relative"] for lr, entry in sweep.items()
        },
        "runs": {f"{lr:g}": entry["runs"] for lr, entry in sweep.items()},
    }
    json_path = args.out / "convergence.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {png} and {json_path}")
    print(f"total time {total:.1f} s")


if __name__ == "__main__":
    main()
