"""What the strategy's checkpoint hooks do besides the format (``checkpoint.format``): the barrier
``trainer.save_checkpoint`` starts with, which every rank must reach, the consolidated file's
write under a temporary name, and the loader's ``weights_only`` first attempt.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn

from lightning_pipe2bw.failures.record import StageFailure
from lightning_pipe2bw.pipeline.options import DEFAULT_TIMEOUT
from lightning_pipe2bw.seam.process_group import is_initialized

__all__ = ["checkpoint_barrier", "load_trusting", "write_replacing"]

# how long trainer.save_checkpoint waits for every rank to reach it (or the process-group
# timeout, if shorter)
SAVE_WAIT = timedelta(seconds=60)


def checkpoint_barrier(
    group: Any,
    timeout: timedelta | None,
    world_size: int,
    where: str,
    lost_rank: Callable[[BaseException, str], StageFailure | None],
) -> None:
    """The barrier ``trainer.save_checkpoint`` starts and ends with: every rank must be
    there, since the save gathers every stage's part. A rank that does not come within
    ``SAVE_WAIT`` (or the process-group ``timeout``, if shorter), or whose process is gone
    (``lost_rank``), is an error that says so (a save under ``if trainer.global_rank == 0`` is
    the usual cause), instead of the collectives' timeout and gloo's words. ``group``: a gloo
    group of every rank (None: the default group, when it is gloo); ``where``: this rank and
    its stage, for the error."""
    if not is_initialized() or world_size == 1:
        return
    wait = min(timeout or DEFAULT_TIMEOUT, SAVE_WAIT)
    try:
        dist.monitored_barrier(group=group, timeout=wait, wait_all_ranks=True)
    except RuntimeError as err:
        lost = lost_rank(err, "trainer.save_checkpoint")
        seen = f"{lost}" if lost is not None else f"{type(err).__name__}: {err}"
        raise RuntimeError(
            f"trainer.save_checkpoint on {where}: not "
            f"every rank took part ({seen}; the wait is at most "
            f"{wait.total_seconds():.0f} s). With "
            "pipe2bw each rank holds a part of the model, so trainer.save_checkpoint(path) "
            "gathers every part and must be called on every rank, as Lightning documents "
            "for distributed strategies: call it outside `if trainer.global_rank == 0:` (the "
            "file is written once, by global rank 0)"
        ) from err


def write_replacing(
    checkpoint: dict[str, Any],
    filepath: Any,
    write: Callable[[dict[str, Any], Any], None],
    is_global_zero: bool,
) -> None:
    """``write`` the consolidated ``checkpoint`` to a temporary name, then rename it (global
    rank 0): a crash mid-write leaves no file that looks complete under the checkpoint's name.
    A remote file system (``://``) keeps its own write semantics."""
    path = str(filepath)
    if "://" in path:
        write(checkpoint, filepath)
        return
    tmp = f"{path}.tmp"
    write(checkpoint, tmp)
    if is_global_zero:
        os.replace(tmp, path)


def load_trusting(checkpoint_path: Any, weights_only: bool | None, load: Callable[..., Any]) -> Any:
    """``load`` (Lightning's loader) with ``weights_only=True`` unless the caller chose: a
    checkpoint that needs arbitrary unpickling is loaded with ``weights_only=False`` after a
    warning."""
    if weights_only is not None:
        return load(checkpoint_path, weights_only=weights_only)
    try:
        return load(checkpoint_path, weights_only=True)
    except pickle.UnpicklingError as err:
        rank_zero_warn(
            f"{checkpoint_path} cannot be loaded with weights_only=True ({err}); loading it "
            "with weights_only=False, which runs arbitrary code from the file: only do this "
            "with files you trust"
        )
        return load(checkpoint_path, weights_only=False)
