"""A small GPT-style, byte-level language model and a data module over the Python standard library.

The model follows the one rule of ``lightning_pipe2bw``: every layer with parameters is a block of
one ``nn.Sequential`` (``self.body``)::

    body = Sequential(Embeddings, Block, Block, ..., Block, LMHead)

and each step runs the input through the body exactly once (``self(x)``). The loss, the
perplexity and the logging come after the body and hold no parameters, so the same module trains
on one device or split into pipeline stages::

    import lightning as L
    from lightning_pipe2bw import Pipe2BWStrategy
    from lightning_pipe2bw.gpt import GPT, StdlibTextDataModule

    model = GPT(block_size=128, n_layer=4, n_head=4, n_embd=128, max_steps=300)
    data = StdlibTextDataModule(block_size=128, batch_size=16)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=300,
                        strategy=Pipe2BWStrategy(schedule="2bw", microbatches=4))
    trainer.fit(model, datamodule=data)

The token embedding and the output projection are separate matrices: weight tying would share a
parameter between the first and the last stage, which the strategy refuses.

Importing this module has no side effects (no data is read until ``setup``).
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.functional.text import perplexity

__all__ = [
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "Embeddings",
    "LMHead",
    "RandomWindows",
    "StdlibTextDataModule",
    "StridedWindows",
    "stdlib_files",
    "warmup_cosine",
]

Batch = tuple[Tensor, Tensor]


# ----------------------------------------------------------------------------------------- model
class Embeddings(nn.Module):
    """Token plus learned position embeddings: ``(B, T)`` byte ids -> ``(B, T, C)``."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.block_size = block_size
        self.token = nn.Embedding(vocab_size, n_embd)
        self.position = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.size(1)
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        out: Tensor = self.drop(self.token(idx) + self.position(pos))
        return out


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask (``scaled_dot_product_attention``)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        out: Tensor = self.resid_drop(self.proj(y))
        return out


class MLP(nn.Module):
    """The position-wise feed-forward network: ``C -> 4C -> C`` with GELU."""

    def __init__(self, n_embd: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.drop(self.proj(F.gelu(self.fc(x))))
        return out


class Block(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        out: Tensor = x + self.mlp(self.ln_2(x))
        return out


class LMHead(nn.Module):
    """The final LayerNorm and the (untied) projection to the vocabulary: ``(B, T, C) -> (B, T, V)``."""

    def __init__(self, n_embd: int, vocab_size: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd)
        self.proj = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.proj(self.ln_f(x))
        return out


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_ratio: float = 0.1) -> float:
    """LR multiplier: linear warm-up to 1 over ``warmup_steps``, then cosine decay to
    ``min_ratio`` at ``max_steps`` (and ``min_ratio`` after it)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= max_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))


class GPT(LightningModule):
    """A GPT-style decoder over bytes (``vocab_size=256``), trained with next-token cross-entropy.

    Args:
        vocab_size: number of token ids (256 for bytes).
        block_size: the longest sequence (the size of the position table).
        n_layer: transformer blocks.
        n_head: attention heads per block.
        n_embd: model width.
        dropout: dropout on embeddings, attention weights and residual branches.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay, applied to weight matrices and embeddings (tensors of
            two or more dimensions) only, not to biases or LayerNorm parameters.
        warmup_steps: linear warm-up steps of the learning rate.
        max_steps: steps of the cosine decay; ``None`` uses ``trainer.estimated_stepping_batches``.
        min_lr_ratio: the learning rate at the end of the decay, relative to ``lr``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        lr: float = 2e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 30,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.vocab_size = vocab_size
        self.lr = lr
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps
        self.min_lr_ratio = min_lr_ratio
        # the pipeline body: every layer with parameters, in order
        self.body = nn.Sequential(
            Embeddings(vocab_size, block_size, n_embd, dropout),
            *[Block(n_embd, n_head, dropout) for _ in range(n_layer)],
            LMHead(n_embd, vocab_size),
        )
        self._init_weights(n_layer)

    def _init_weights(self, n_layer: int) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases, and the residual output
        projections scaled down by ``sqrt(2 * n_layer)``."""
        for module in self.body.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.body:
            if isinstance(block, Block):
                for proj in (block.attn.proj, block.mlp.proj):
                    nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: Tensor) -> Tensor:
        """``(B, T)`` token ids -> ``(B, T, vocab_size)`` logits."""
        logits: Tensor = self.body(idx)
        return logits

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x, y = batch
        loss = self._loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = self._loss(logits, y)
        self.log("val_loss", loss, prog_bar=True)
        # a value, not a Metric object: under pipe2bw the logits exist on the last stage only
        self.log("val_ppl", perplexity(logits.detach().float(), y))
        return loss

    def configure_optimizers(self) -> Any:
        # under a pipeline strategy this sees only the parameters of this rank's stage
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=self.lr, betas=(0.9, 0.95)
        )
        steps = self.max_steps
        total = int(steps if steps is not None else self.trainer.estimated_stepping_batches)
        warmup, ratio = self.warmup_steps, self.min_lr_ratio
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, warmup, total, ratio)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }


# ------------------------------------------------------------------------------------------ data
def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The ``*.py`` files under the standard library (``root``), sorted by path, without
    ``site-packages``/``dist-packages`` (third-party code) and ``__pycache__``."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    excluded = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(
        path
        for path in base.rglob("*.py")
        if not excluded.intersection(path.relative_to(base).parts) and path.is_file()
    )


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
