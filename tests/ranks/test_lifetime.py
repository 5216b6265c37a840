"""What training leaves behind: nothing that grows from step to step, and nothing once a Trainer
call has ended (a process that fits again, a notebook or a sweep, gets its memory back).

Two leaks were found on a GPU, where the allocator showed each fit starting higher than the last
(``benchmarks/README.md``, the GPU checklist): the signal handler Lightning restores after a fit
held the strategy, so every finished fit's model and optimizer state; and each backward cut in
two (``early_input_grad``) kept its input path's activations alive through a reference cycle of
saved tensors, a micro-batch's worth per step.

A third was found by the test suite's own pools, whose ranks run hundreds of Trainer calls: every
call made new process groups (a pipeline's, a stage's replicas', 2BW's clipping norms', ...),
which torch keeps until the process ends. Each gloo group keeps threads that wake every few
milliseconds; after a few hundred calls an idle rank burned a quarter of a core, and the suite
ran a third slower. Now each group is made once per process and serves every call."""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.models import IN, OUT, Block, RegressionModel, loader, quiet_trainer
from lightning.pytorch import Callback
from torch import nn

from lightning_pipe2bw import Pipe2BWStrategy

STEPS = 14
SETTLED = 9  # the step values' channel keeps the sends of its last 8 reports: full by now


class Wider(RegressionModel):
    """Micro-batches of 16 x 256 floats: a leaked micro-batch is kilobytes per step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.body = nn.Sequential(
            nn.Linear(IN, 256), *[Block(256) for _ in range(6)], nn.Linear(256, OUT)
        )


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the collector can reach."""
    gc.collect()
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


class LiveBytes(Callback):
    """The live tensor bytes after the steps the test compares (a walk of every object the
    collector knows: once a step would be most of the test's time), and the shared-memory
    mappings during the fit."""

    def __init__(self, at_steps: tuple[int, ...]) -> None:
        self.at_steps = at_steps
        self.after_step: dict[int, int] = {}
        self.rings = 0

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step in self.at_steps:
            self.after_step[trainer.global_step] = live_tensor_bytes()
        self.rings = shared_memory_mappings()


def shared_memory_mappings() -> int:
    """This process's mappings of the shared-memory transport's rings (their files are unlinked
    as soon as both ends map them, so only a mapping keeps their pages)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if "/dev/shm/pipe2bw-" in line)


def _fit_and_forget(schedule: str) -> dict[str, Any]:
    rings_before = shared_memory_mappings()
    probe = LiveBytes(at_steps=(SETTLED, STEPS))
    model = Wider()
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=4)
    trainer = quiet_trainer(
        devices=dist.get_world_size(), strategy=strategy, max_steps=STEPS, callbacks=[probe]
    )
    trainer.fit(model, loader(64, n=64 * STEPS))
    # given back when the fit ends, not when the collector finds the Trainer
    rings_after_fit = shared_memory_mappings()
    refs = [weakref.ref(model), weakref.ref(strategy), weakref.ref(trainer)]
    live, rings_in_fit = probe.after_step, probe.rings
    # Lightning gives every callback the module's bound ``log``: the probe holds the model
    # (on one device too), so it goes as well
    del model, strategy, trainer, probe
    gc.collect()
    return {
        "alive": [r() is not None for r in refs],
        "live": live,
        "rings": (rings_before, rings_in_fit, rings_after_fit),
    }


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_training_leaves_nothing_behind(pools: Any, schedule: str) -> None:
    results = pools(2).run(_fit_and_forget, schedule)
    for rank, r in enumerate(results):
        assert sorted(r["live"]) == [SETTLED, STEPS], r["live"]
        growth = r["live"][STEPS] - r["live"][SETTLED]
        print(
            f"LIFETIME {schedule} rank {rank}: live tensor bytes grew {growth} over steps {SETTLED}-{STEPS}"
        )
        assert growth <= 1024, (rank, r["live"])
        # the model, the strategy and the Trainer went with the last reference to them
        assert r["alive"] == [False, False, False], rank
        # the transport's shared-memory rings (8 MiB a channel) went at the end of the fit,
        # while the Trainer and its strategy were still held
        before, during, after = r["rings"]
        assert during > before and after == before, (rank, r["rings"])


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fit(strategy: Pipe2BWStrategy) -> Any:
    trainer = quiet_trainer(
        devices=dist.get_world_size(), strategy=strategy, max_steps=2, gradient_clip_val=1.0
    )
    trainer.fit(RegressionModel(), loader(8, n=32))
    return trainer


def _fit_four_times(folder: str) -> dict[str, Any]:
    """Four fits of two replicas of a 2BW pipeline clipping by the norm (every kind of group
    the mesh makes at set-up and on first use), the first Trainer kept; then it saves a
    checkpoint (whose optimizer state is gathered along its pipeline's group)."""
    threads, trainers = [], []
    for _ in range(4):
        trainers.append(_fit(Pipe2BWStrategy(schedule="2bw", microbatches=2, data_parallel=2)))
        threads.append(_threads())
    trainers[0].save_checkpoint(os.path.join(folder, "first.ckpt"))
    return {"threads": threads}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_trainer_calls_share_their_process_groups(pools: Any, tmp_path: Path) -> None:
    results = pools(4).run(_fit_four_times, str(tmp_path))
    for rank, r in enumerate(results):
        print(f"LIFETIME rank {rank}: threads after each of four fits {r['threads']}")
        # the first fit made the groups; the later ones add no thread
        assert r["threads"][1:] == r["threads"][:1] * 3, (rank, r["threads"])
    # and an earlier Trainer still has what it needs after later calls
    assert (tmp_path / "first.ckpt").is_file()
