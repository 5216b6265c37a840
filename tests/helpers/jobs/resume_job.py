"""A real 2-process fit (``start_method="popen"``) with a checkpoint every 3 steps, which can kill
itself (every rank, SIGKILL) after a step, or resume from the last checkpoint.

    python tests/helpers/jobs/resume_job.py --schedule 2bw --ckpt-dir D --steps 6 --kill-after 4
    python tests/helpers/jobs/resume_job.py --schedule 2bw --ckpt-dir D --steps 6 --resume --out W.pt

The data has 3 batches per epoch, so the checkpoints fall on epoch boundaries (Lightning does not
fast-forward a plain DataLoader inside an epoch). With ``--out``, rank 0 saves the final full
state dict there.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from helpers.models import RegressionModel, loader, quiet_trainer
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe2bw import Pipe2BWStrategy


class KillAfter(Callback):
    """The whole run dies at once, as on a node failure: every rank kills itself.

    The ranks meet in a barrier first. Without it, under 2BW the first stage can end its step
    (and kill itself) while the last stage still receives that step's last activation from it,
    and the last stage then stops on the lost rank (exit 1) instead of dying with the others."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.strategy.barrier()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="2bw")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=3, save_last=True)
    ]
    if args.kill_after is not None:
        callbacks.append(KillAfter(args.kill_after))
    strategy = Pipe2BWStrategy(schedule=args.schedule, microbatches=2)
    trainer = quiet_trainer(
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=callbacks,
        enable_checkpointing=True,
    )
    trainer.fit(RegressionModel(), loader(8, n=24), ckpt_path="last" if args.resume else None)
    state = strategy.full_state_dict()
    if args.out is not None and trainer.is_global_zero:
        torch.save(state, args.out)


if __name__ == "__main__":
    main()
