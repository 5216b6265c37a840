"""The main job's model: a small GPT-style, byte-level language model.

The model follows the one rule of ``lightning_pipe2bw``: every layer with parameters is a block of
one ``nn.Sequential`` (``self.body``)::

    body = Sequential(Embeddings, Block, Block, ..., Block, LMHead)

and each step runs the input through the body exactly once (``self(x)``). The loss, the
perplexity and the logging come after the body and hold no parameters, so the same module trains
on one device or split into pipeline stages::

    import lightning as L
    from lightning_pipe2bw import Pipe2BWStrategy
    from lightning_pipe2bw.recipes.gpt import GPT, StdlibTextDataModule

    model = GPT(block_size=128, n_layer=4, n_head=4, n_embd=128, max_steps=300)
    data = StdlibTextDataModule(block_size=128, batch_size=16)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=300,
                        strategy=Pipe2BWStrategy(schedule="2bw", microbatches=4))
    trainer.fit(model, datamodule=data)

The token embedding and the output projection are separate matrices: weight tying would share a
parameter between the first and the last stage, which the strategy refuses.

The data it trains on is in :mod:`lightning_pipe2bw.recipes.gpt.data`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics.functional.text import perplexity

from lightning_pipe2bw.optim import MuonAdamW

__all__ = ["GPT", "Batch"]

# inputs and next-byte targets, (B, T) each
Batch = tuple[Tensor, Tensor]


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


OPTIMIZERS = ("adamw", "muon")


def _block_matrix(name: str, param: Tensor, module: nn.Module) -> bool:
    """Muon's share of the GPT: the matrices of the blocks' attention and MLP."""
    return (
        isinstance(module, nn.Linear)
        and param is module.weight
        and (".attn." in name or ".mlp." in name)
    )


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
        optimizer: ``"adamw"``, or ``"muon"``: :class:`~lightning_pipe2bw.MuonAdamW`, Muon on the
            blocks' attention and MLP matrices (its step scaled to AdamW's RMS, so ``lr`` serves
            both) and AdamW on the embeddings, norms, biases and head.
        adamw_lr: with ``optimizer="muon"``, the peak learning rate of its AdamW part, if not
            ``lr`` (the same warm-up and decay scale both).
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
        optimizer: str = "adamw",
        adamw_lr: float | None = None,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
        if adamw_lr is not None and optimizer != "muon":
            raise ValueError(
                f"adamw_lr={adamw_lr!r} is the learning rate of Muon's AdamW part: set lr "
                f"instead with optimizer={optimizer!r}, or use optimizer='muon'"
            )
        self.save_hyperparameters()
        self.optimizer_name = optimizer
        self.vocab_size = vocab_size
        self.lr = lr
        self.adamw_lr = adamw_lr
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
        optimizer: torch.optim.Optimizer
        if self.optimizer_name == "muon":
            optimizer = MuonAdamW.for_module(
                self,
                lr=self.lr,
                adamw_lr=self.adamw_lr,
                weight_decay=self.weight_decay,
                muon_params=_block_matrix,
            )
        else:
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
