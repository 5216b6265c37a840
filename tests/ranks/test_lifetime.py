"""What training leaves behind: nothing that grows from step to step, and nothing once a Trainer
call has ended (a process that fits again, a notebook or a sweep, gets its memory back).

Two leaks were found on a GPU, where the allocator showed each fit starting higher than the last
(``benchmarks/README.md``, the GPU checklist): the signal handler Lightning restores after a fit
held the strategy, so every finished fit's model and optimizer state; and each backward cut in
two (``early_input_grad``) kept its input path's activations alive through a reference cycle of
saved tensors, a micro-batch's worth per step."""

from __future__ import annotations

import gc
import weakref
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
    def __init__(self) -> None:
        self.after_step: list[int] = []
        self.rings = 0  # the shared-memory mappings during the fit

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.after_step.append(live_tensor_bytes())
        self.rings = shared_memory_mappings()


def shared_memory_mappings() -> int:
    """This process's mappings of the shared-memory transport's rings (their files are unlinked
    as soon as both ends map them, so only a mapping keeps their pages)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if "/dev/shm/pipe2bw-" in line)


def _fit_and_forget(schedule: str) -> dict[str, Any]:
    rings_before = shared_memory_mappings()
    probe = LiveBytes()
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
        growth = r["live"][-1] - r["live"][SETTLED - 1]
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
