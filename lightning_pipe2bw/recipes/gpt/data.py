"""The main job's data: byte windows of the Python standard library's sources, on every
machine, with no download (``StdlibTextDataModule``).

Importing this module has no side effects (no data is read until ``setup``).
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_pipe2bw.recipes.gpt.model import Batch

__all__ = ["StdlibTextDataModule"]


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The ``*.py`` files under the standard library (``root``), sorted by path, without
    ``site-packages``/``dist-packages`` (third-party code) and ``__pycache__``."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    excluded = {"site-packages", "dist-packages", "__pycache__"}
    found = []
    # os.walk without descending into the excluded folders: site-packages may hold more files
    # than the standard library itself, and every rank reads the list at set-up
    for folder, subfolders, names in os.walk(base):
        subfolders[:] = [d for d in subfolders if d not in excluded]
        for name in names:
            if name.endswith(".py"):
                path = Path(folder, name)
                if path.is_file():
                    found.append(path)
    return sorted(found)


class RandomWindows(Dataset[Batch]):
    """``length`` windows of ``block_size + 1`` bytes at offsets drawn once from a generator
    seeded with ``seed``: item ``i`` is always the same ``(x, y)`` pair, ``y`` shifted by one."""

    def __init__(self, data: Tensor, block_size: int, length: int, seed: int) -> None:
        if data.numel() <= block_size + 1:
            raise ValueError(f"{data.numel()} bytes are too few for block_size={block_size}")
        generator = torch.Generator().manual_seed(seed)
        self.data = data
        self.block_size = block_size
        self.offsets = torch.randint(
            0, data.numel() - block_size - 1, (length,), generator=generator
        )

    def __len__(self) -> int:
        return self.offsets.numel()

    def __getitem__(self, index: int) -> Batch:
        start = int(self.offsets[index])
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class StridedWindows(Dataset[Batch]):
    """Up to ``limit`` evenly spaced, non-overlapping windows over ``data`` (validation)."""

    def __init__(self, data: Tensor, block_size: int, limit: int | None = None) -> None:
        available = (data.numel() - 1) // block_size
        if available < 1:
            raise ValueError(f"{data.numel()} bytes are too few for block_size={block_size}")
        count = available if limit is None else min(limit, available)
        # window j starts at a multiple of block_size, spread over the whole text
        self.starts = [(j * available // count) * block_size for j in range(count)]
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> Batch:
        start = self.starts[index]
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibTextDataModule(LightningDataModule):
    """Byte-level text from the Python standard library's source files.

    The ``*.py`` files under ``root`` (default: ``sysconfig.get_paths()["stdlib"]``) are read in
    path order, skipping unreadable ones, until ``max_bytes`` are collected. Every ``val_every``-th
    file (indices 0, ``val_every``, ``2 * val_every``, ...) goes to validation, the others to
    training, so the split is by file and deterministic. Files are joined with a blank line.

    Training samples are ``train_samples`` windows at random offsets fixed by ``seed`` (the
    loader does not shuffle, so every pipeline stage reads the same batches); validation samples
    are up to ``val_samples`` evenly spaced, non-overlapping windows.

    Args:
        block_size: tokens per sample; ``x`` and ``y`` are ``block_size`` bytes, ``y`` shifted by one.
        batch_size: samples per batch (both loaders).
        max_bytes: stop reading files once this many bytes are collected.
        val_every: every ``val_every``-th file is a validation file.
        train_samples: windows per training epoch.
        val_samples: the most validation windows.
        seed: seed of the training offsets.
        root: the directory to read; the standard library by default.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        max_bytes: int = 6_000_000,
        val_every: int = 10,
        train_samples: int = 16_000,
        val_samples: int | None = 256,
        seed: int = 0,
        root: str | Path | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if val_every < 2:
            raise ValueError(f"val_every must be at least 2, got {val_every}")
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_every = val_every
        self.train_samples = train_samples
        self.val_samples = val_samples
        self.seed = seed
        self.root = Path(root) if root is not None else None
        self.num_workers = num_workers
        self.train_files: list[Path] = []
        self.val_files: list[Path] = []
        self.train_data: Tensor | None = None
        self.val_data: Tensor | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_data is not None:
            return
        texts: list[tuple[Path, bytes]] = []
        total = 0
        for path in stdlib_files(self.root):
            if total >= self.max_bytes:
                break
            try:
                content = path.read_bytes()
            except OSError:
                continue
            texts.append((path, content))
            total += len(content)
        if len(texts) < self.val_every:
            raise RuntimeError(
                f"found only {len(texts)} readable .py files under "
                f"{self.root or sysconfig.get_paths()['stdlib']}; need at least {self.val_every}"
            )
        train = [(p, c) for i, (p, c) in enumerate(texts) if i % self.val_every != 0]
        val = [(p, c) for i, (p, c) in enumerate(texts) if i % self.val_every == 0]
        self.train_files = [p for p, _ in train]
        self.val_files = [p for p, _ in val]
        self.train_data = _to_bytes_tensor(c for _, c in train)
        self.val_data = _to_bytes_tensor(c for _, c in val)

    def train_dataloader(self) -> DataLoader[Batch]:
        assert self.train_data is not None, "call setup() first"
        dataset = RandomWindows(self.train_data, self.block_size, self.train_samples, self.seed)
        return DataLoader(
            dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader[Batch]:
        assert self.val_data is not None, "call setup() first"
        dataset = StridedWindows(self.val_data, self.block_size, self.val_samples)
        return DataLoader(
            dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers
        )


def _to_bytes_tensor(contents: Iterable[bytes]) -> Tensor:
    """Join byte strings with a blank line into a ``uint8`` tensor."""
    joined = b"\n\n".join(contents)
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8)
