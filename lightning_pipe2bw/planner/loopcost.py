"""What a training step costs besides its blocks' compute, for ``balance="auto"``'s cost model:
the training loop's fixed cost per step and the engine's cost per compute action.

Neither can be timed by profiling the blocks, and the loop cannot be timed before it runs. So
they are measured by tiny runs in child processes: ``Pipe2BWStrategy`` with one small linear
block per stage, a quiet ``Trainer`` (no logger, checkpoints or progress bar), once at 1
micro-batch per step and once at :data:`MICROBATCHES`; first on one rank, then as a pipeline of
two ranks. On one rank a step of m micro-batches takes ``loop + 2 m action`` (a forward and a
backward per micro-batch, the block's own compute a few microseconds of it); the two medians
give both:

- ``loop_s``: Lightning's loop (its hooks, the optimizer's wrappers, the step's bookkeeping)
  and the strategy's own per-step work (splitting the batch, the driver, the step's values);
- ``action_s``: what the engine adds to each compute action beyond the blocks (its dispatch,
  the activation stash's hooks, a micro-batch's slot, the user's ``training_step`` around the
  body): the cluster's ``action_s``.

A pipeline's step costs more than one rank's: the last stage's values (the loss, what
``training_step`` logged) cross to the other ranks, and every rank waits on its neighbours'
messages. On two ranks a 1F1B step of m micro-batches takes ``loop + (m + 1) slot`` (the fill
and drain add one slot to the m), so the two medians give

- ``pipeline_loop_s``: the loop's fixed cost per step in a pipeline: the cluster's
  ``step_overhead_s`` when the run has more than one rank (``loop_s`` when it has one).

The children run with the parent's interpreter and library versions but none of its process
group (a fresh group on a free port), so nothing of the user's run (its RNG, its process group,
its signal handlers) is touched. The figures are kept in a cache file (see :func:`cache_path`),
keyed by the machine, the interpreter and the library versions, so a machine pays the runs (a
few seconds each, mostly imports) once. A user's own ``training_step`` and callbacks (logging
every step, say) cost more than the tiny runs': a lower bound.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["loop_costs"]

log = logging.getLogger(__name__)

MICROBATCHES = 8  # the second run's micro-batches per step
_STEPS, _WARMUP = 40, 10  # timed steps of each run, after the warm-up
_TIMEOUT_S = 300.0


class LoopCosts(NamedTuple):
    """Seconds: the loop's fixed cost per step on one rank, the engine's per compute action, and
    the loop's fixed cost per step in a pipeline of two ranks."""

    loop_s: float
    action_s: float
    pipeline_loop_s: float


def cache_path() -> Path:
    """Where the measured figures are kept: ``$PIPE2BW_CACHE_DIR/loop_costs.json``, else under
    ``$XDG_CACHE_HOME`` (default ``~/.cache``) in ``lightning_pipe2bw/``."""
    base = os.environ.get("PIPE2BW_CACHE_DIR")
    if base:
        return Path(base) / "loop_costs.json"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "lightning_pipe2bw" / "loop_costs.json"


def _key() -> str:
    """What the figures depend on: the machine, the interpreter and the library versions."""
    import lightning
    import torch

    from lightning_pipe2bw import __version__

    return json.dumps(
        {
            "host": platform.node(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "pipe2bw": __version__,
        },
        sort_keys=True,
    )


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measured again and written anew
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    """Write atomically (a temporary file renamed over the old one): a reader never sees half a
    file, and two writers leave one whole file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".loop_costs.")
        with os.fdopen(fd, "w") as out:
            json.dump(data, out, indent=1)
        os.replace(tmp, path)
    except OSError as err:  # a read-only home: the figures are measured again next time
        log.warning("pipe2bw: could not keep the measured loop costs in %s (%s)", path, err)
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)


def loop_costs() -> LoopCosts:
    """The cached figures for this machine and these versions, else measured (and cached)."""
    path, key = cache_path(), _key()
    entry = _read_cache(path).get(key)
    if isinstance(entry, dict):
        with contextlib.suppress(KeyError, TypeError, ValueError):  # (an older entry: again)
            return LoopCosts(*(float(entry[field]) for field in LoopCosts._fields))
    costs = measure_loop_costs()
    data = _read_cache(path)  # again: another process may have written meanwhile
    data[key] = {**costs._asdict(), "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
    _write_cache(path, data)
    return costs


def measure_loop_costs(timeout_s: float = _TIMEOUT_S) -> LoopCosts:
    """Run the tiny child runs (see the module notes) and return their figures. Raises
    RuntimeError, with the failing child's output, if one fails."""
    one, many = _run(1, timeout_s)
    action = max((many - one) / (2 * (MICROBATCHES - 1)), 0.0)
    one_pipe, many_pipe = _run(2, timeout_s)
    slot = max((many_pipe - one_pipe) / (MICROBATCHES - 1), 0.0)
    return LoopCosts(
        loop_s=max(one - 2 * action, 0.0),
        action_s=action,
        pipeline_loop_s=max(one_pipe - 2 * slot, 0.0),
    )


def _run(world_size: int, timeout_s: float) -> list[float]:
    """The tiny run on ``world_size`` child processes (one rank each): rank 0's median step
    seconds at 1 and at :data:`MICROBATCHES` micro-batches."""
    from lightning_pipe2bw.seam.launcher import _free_port, torchrun_environment

    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHELASTIC_", "SLURM_", "PMI_", "OMPI_", "LSB_", "PIPE2BW_"))
        and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                      "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")
    }  # fmt: skip
    base["CUDA_VISIBLE_DEVICES"] = ""  # the loop's own cost, on the host
    port = _free_port()
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "lightning_pipe2bw.planner.loopcost"],
            env={**base, **torchrun_environment(rank, world_size, port, "pipe2bw-loop-costs")},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    texts = []
    try:
        for child in children:
            try:
                texts.append(child.communicate(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                texts.append(("", f"no result in {timeout_s:.0f} s"))
    finally:
        for child in children:  # a rank that failed leaves its peer waiting: stop it
            if child.poll() is None:
                child.kill()
                child.wait()
    outputs = [(c.returncode, out, err) for c, (out, err) in zip(children, texts, strict=True)]
    code, out, err = outputs[0]
    lines = [line for line in out.splitlines() if line.startswith("LOOP_COSTS ")]
    failed = [(c, o, e) for c, o, e in outputs if c != 0]
    if failed or not lines:
        code, out, err = failed[0] if failed else (code, out, err)
        raise RuntimeError(
            f"pipe2bw: the {world_size}-rank run that measures the training loop's cost failed "
            f"(exit {code}):\n{(out + err)[-3000:]}"
        )
    medians: list[float] = json.loads(lines[-1][len("LOOP_COSTS ") :])
    return medians


def _child() -> None:  # pragma: no cover - runs in the child process of measure_loop_costs
    """The tiny run: median step seconds at 1 and at MICROBATCHES micro-batches, printed."""
    import warnings

    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe2bw import Pipe2BWStrategy

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_pipe2bw"):
        logging.getLogger(name).setLevel(logging.ERROR)

    world_size = int(os.environ.get("WORLD_SIZE", "1"))

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(*(nn.Linear(4, 4) for _ in range(world_size)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.body(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Steps(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.starts.append(time.perf_counter())

    medians = []
    torch.manual_seed(0)  # the same samples on every rank (the strategy checks that they are)
    for m in (1, MICROBATCHES):
        n = (_WARMUP + _STEPS + 1) * MICROBATCHES  # one epoch: no epoch ends among the steps
        loader = DataLoader(
            TensorDataset(torch.randn(n, 4), torch.randn(n, 4)), batch_size=MICROBATCHES
        )
        steps = Steps()
        trainer = L.Trainer(
            strategy=Pipe2BWStrategy(schedule="1f1b", microbatches=m),
            accelerator="cpu",
            devices=world_size,
            max_steps=_WARMUP + _STEPS + 1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[steps],
        )
        trainer.fit(Tiny(), loader)
        starts = steps.starts[_WARMUP:]
        medians.append(statistics.median(b - a for a, b in itertools.pairwise(starts)))
    if int(os.environ.get("RANK", "0")) == 0:
        print("LOOP_COSTS " + json.dumps(medians), flush=True)


if __name__ == "__main__":  # pragma: no cover
    _child()
