"""A real 2-process fit (``start_method="popen"``) in which one rank fails on purpose.

    python tests/helpers/jobs/fault_job.py --mode raise --rank 0 --step 2 --token T

``--mode raise`` raises ValueError in that rank's ``training_step`` at that step; ``--mode kill``
sends the rank SIGKILL there; ``--mode kill-after-save`` saves a checkpoint on every rank at the
end of that step, and then the rank SIGKILLs itself (between two steps); ``--mode kill-in-save``
kills the rank in the middle of that checkpoint (outside the schedule, in the save's collectives);
``--mode save-on-rank0`` fits, then calls ``trainer.save_checkpoint`` on global rank 0 only; ``--mode hang`` sleeps there for an hour, so that only the process
group's timeout (``--timeout`` seconds) can stop the run. ``--token`` only tags the command line, so a test can check that
no process of the run is left behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from helpers.models import RegressionModel, loader, quiet_trainer

from lightning_pipe2bw import Pipe2BWStrategy


class FaultyModel(RegressionModel):
    """Fails on one rank at one step: in ``training_step`` (which runs on the first and the last
    stage only), or with ``in_block`` in the forward of the stage's first body block (every stage
    runs one; the middle stages of a longer pipeline run nothing else)."""

    def __init__(self, mode: str, rank: int, step: int, in_block: bool = False) -> None:
        super().__init__()
        self.mode, self.fail_rank, self.fail_step = mode, rank, step
        self.in_block = in_block
        for block in self.body:
            block.register_forward_pre_hook(self._block_hook)

    def _fail_here(self) -> bool:
        return self.global_rank == self.fail_rank and self.trainer.global_step == self.fail_step

    def _fail(self) -> None:
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "hang":
            time.sleep(3600)
        raise ValueError(f"failing on purpose at step {self.fail_step}")

    def _block_hook(self, block: Any, args: Any) -> None:
        if self.in_block and self._fail_here() and self.mode in ("raise", "kill", "hang"):
            self._fail()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if not self.in_block and self._fail_here() and self.mode in ("raise", "kill", "hang"):
            self._fail()
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.mode.startswith("kill-") and self.trainer.global_step == self.fail_step:
            self.trainer.save_checkpoint("after.ckpt")  # every rank: it gathers every stage
            if self.global_rank == self.fail_rank and self.mode == "kill-after-save":
                os.kill(os.getpid(), signal.SIGKILL)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.mode == "kill-in-save" and self.global_rank == self.fail_rank:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--mode",
        choices=["raise", "kill", "hang", "kill-after-save", "kill-in-save", "save-on-rank0"],
        required=True,
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--schedule", default="2bw")
    parser.add_argument("--in-block", action="store_true", help="fail in a body block")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=None, help="seconds")
    parser.add_argument("--token", default="")
    parser.add_argument("--balance-activations", action="store_true", help="BPipe on")
    parser.add_argument(
        "--grace", type=float, default=None, help="seconds the launcher lets workers stop"
    )
    args = parser.parse_args()
    if args.grace is not None:  # the launching process's wait (and its worker watch's, twice it)
        Pipe2BWStrategy.worker_grace_s = args.grace
    timeout = {"timeout": timedelta(seconds=args.timeout)} if args.timeout else {}
    trainer = quiet_trainer(
        devices=args.devices,
        strategy=Pipe2BWStrategy(
            schedule=args.schedule,
            microbatches=args.devices,
            balance_activations=args.balance_activations or None,
            **timeout,
        ),
        max_steps=args.step + 3,
    )
    if args.mode == "save-on-rank0":  # the single-process habit, after a fit that went well
        trainer.fit(FaultyModel(args.mode, args.rank, args.step, args.in_block), loader(8))
        if trainer.global_rank == 0:
            trainer.save_checkpoint("whole.ckpt")
        else:
            time.sleep(10)  # the worker goes on with something else (past the 8 s timeout)
        print("finished without a failure")
        return
    trainer.fit(FaultyModel(args.mode, args.rank, args.step, args.in_block), loader(8))
    print("finished without a failure")


if __name__ == "__main__":
    main()
