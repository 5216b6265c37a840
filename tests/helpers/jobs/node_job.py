"""A small fit under any launcher (the strategy's own, torchrun as one or several "nodes", a
SLURM-like environment), writing the trained weights from global rank 0.

    python tests/helpers/jobs/node_job.py --weights W.pt [--nodes 2 --devices 1] [--data-parallel 2]
        [--ckpt-dir D [--kill-at 4 | --kill-all-after 4]] [--sigusr1-at 4 [--sigusr1-rank 0]]
        [--schedule 1f1b]

The schedule is ``2bw`` unless told: the one with the most state to carry over a restart (its
second weight version and its batch count). The data has 3 batches per epoch, so the
checkpoints fall on epoch boundaries (Lightning does not fast-forward a plain DataLoader inside
an epoch).

``--ckpt-dir`` keeps ``last.ckpt`` (every 3 steps, the epoch's end) and the fit resumes from it
when it is there (``ckpt_path="last"``: the one line an elastic restart needs). ``--kill-at``
sends SIGKILL to global rank 1 in that step of the first attempt only (torchrun's
``TORCHELASTIC_RESTART_COUNT`` is 0), so that ``torchrun --max-restarts=1`` restarts the run.
``--kill-all-after`` kills every rank (SIGKILL) after that step, as a node failure ends a whole
run. ``--sigusr1-at`` sends SIGUSR1 to every rank in that step (SLURM's warning before the end
of a job's time, ``--signal=USR1@T``), once, where a real one lands: anywhere, here at the start
of the step on the first stages and inside the last stage's first micro-batch; ``--sigusr1-rank``
sends it to that rank only, at the start of the step.
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
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe2bw import Pipe2BWStrategy

STEPS_PER_EPOCH = 3


class Job(RegressionModel):
    def __init__(self, kill_at: int | None, warn_at: int | None = None) -> None:
        super().__init__()
        self.kill_at, self.warn_at = kill_at, warn_at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        step = self.trainer.global_step
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if step == self.kill_at and first_attempt and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.warn_at:  # the last stage (the only one that runs training_step)
            self.warn_at = None
            os.kill(os.getpid(), signal.SIGUSR1)
        return super().training_step(batch, batch_idx)


class KillAll(Callback):
    """The whole run dies at once after a step, as on a node failure: every rank kills itself.

    The ranks meet in a barrier first. Without it, under 2BW the first stage can end its step
    (and kill itself) while the last stage still receives that step's last activation from it,
    and the last stage then stops on the lost rank (exit 1) instead of dying with the others."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.strategy.barrier()
            os.kill(os.getpid(), signal.SIGKILL)


class Warn(Callback):
    """SIGUSR1 at the start of a step on ``rank``, or on every rank but the last stage's (a
    callback runs on every stage)."""

    def __init__(self, step: int, rank: int | None) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, Pipe2BWStrategy)
        last = strategy.stage == strategy.num_stages - 1
        chosen = trainer.global_rank == self.rank if self.rank is not None else not last
        if trainer.global_step == self.step and chosen:
            self.step = -1
            os.kill(os.getpid(), signal.SIGUSR1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--data-parallel", type=int, default=1)
    parser.add_argument("--schedule", default="2bw")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-all-after", type=int, default=None)
    parser.add_argument("--sigusr1-at", type=int, default=None)
    parser.add_argument("--sigusr1-rank", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    callbacks: list[Callback] = []
    if args.sigusr1_at is not None:
        callbacks.append(Warn(args.sigusr1_at, args.sigusr1_rank))
    if args.kill_all_after is not None:
        callbacks.append(KillAll(args.kill_all_after))
    if args.ckpt_dir is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.ckpt_dir, every_n_train_steps=STEPS_PER_EPOCH, save_last=True
            )
        )
    strategy = Pipe2BWStrategy(
        schedule=args.schedule, microbatches=2, data_parallel=args.data_parallel
    )
    trainer = quiet_trainer(
        devices=args.devices,
        num_nodes=args.nodes,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=callbacks,
        enable_checkpointing=args.ckpt_dir is not None,
    )
    model = Job(args.kill_at, args.sigusr1_at if args.sigusr1_rank is None else None)
    data = loader(8, n=8 * STEPS_PER_EPOCH * args.data_parallel)
    resume = "last" if args.ckpt_dir is not None else None
    trainer.fit(model, data, ckpt_path=resume)
    state = strategy.full_state_dict()  # collective: the whole model on global rank 0
    if trainer.global_rank == 0:
        torch.save(state, args.weights)
    print(f"rank {trainer.global_rank} of {trainer.world_size}: done at step {trainer.global_step}")


if __name__ == "__main__":
    main()
