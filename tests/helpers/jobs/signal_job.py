"""A real 2-process fit (``start_method="popen"``) that a test stops with a signal.

    python tests/helpers/jobs/signal_job.py --schedule 2bw --token T

Every rank prints ``training rank R pid P`` once training runs, then trains slowly (a few
hundred steps of 20 ms), so that the test can send SIGTERM or SIGINT to the launching process,
to the whole process group or to the worker while steps are being run. ``--token`` only tags the
command line, so that the test can check that no process is left behind.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from helpers.models import RegressionModel, loader, quiet_trainer
from lightning.pytorch import Callback

from lightning_pipe2bw import Pipe2BWStrategy


class Ready(Callback):
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        print(f"training rank {trainer.global_rank} pid {os.getpid()}", flush=True)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="2bw")
    parser.add_argument("--token", default="")
    args = parser.parse_args()
    trainer = quiet_trainer(
        devices=2,
        strategy=Pipe2BWStrategy(schedule=args.schedule, microbatches=2),
        max_steps=2000,
        max_epochs=-1,
        callbacks=[Ready()],
    )
    trainer.fit(RegressionModel(), loader(8))
    print("finished without a signal")


if __name__ == "__main__":
    main()
