"""A real 2-process fit (``start_method="popen"``) in which one rank fails on purpose.

    python tests/jobs/fault_job.py --mode raise --rank 0 --step 2 --token T

``--mode raise`` raises ValueError in that rank's ``training_step`` at that step; ``--mode kill``
sends the rank SIGKILL there. ``--token`` only tags the command line, so a test can check that
no process of the run is left behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import RegressionModel, loader, quiet_trainer

from lightning_pipe2bw import Pipe2BWStrategy


class FaultyModel(RegressionModel):
    def __init__(self, mode: str, rank: int, step: int) -> None:
        super().__init__()
        self.mode, self.fail_rank, self.fail_step = mode, rank, step

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_rank == self.fail_rank and self.trainer.global_step == self.fail_step:
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"failing on purpose at step {self.fail_step}")
        return super().training_step(batch, batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["raise", "kill"], required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--schedule", default="2bw")
    parser.add_argument("--token", default="")
    args = parser.parse_args()
    trainer = quiet_trainer(
        devices=2,
        strategy=Pipe2BWStrategy(schedule=args.schedule, microbatches=2),
        max_steps=args.step + 3,
    )
    trainer.fit(FaultyModel(args.mode, args.rank, args.step), loader(8))
    print("finished without a failure")


if __name__ == "__main__":
    main()
