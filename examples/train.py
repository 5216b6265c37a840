"""A small pipeline-parallel training run on 2 CPU processes.

    python examples/train.py                      # 2 stages, 1F1B, 4 micro-batches
    python examples/train.py --schedule gpipe --devices 4 --steps 50

A LightningModule written for one device: ``forward`` runs the ``nn.Sequential`` body, and
``training_step`` computes the loss from ``self(x)``. ``strategy="pipe2bw"`` splits the body into
one stage per process; nothing else in the module changes.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe2bw import Pipe2BWStrategy


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Classifier(LightningModule):
    def __init__(
        self, features: int = 32, width: int = 128, depth: int = 6, classes: int = 10
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # the body: every layer with parameters, in order
        self.body = nn.Sequential(
            nn.Linear(features, width),
            *[ResidualBlock(width) for _ in range(depth)],
            nn.LayerNorm(width),
            nn.Linear(width, classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ReportStages(Callback):
    """Prints what each rank runs: its stage, its blocks and its intra-op threads."""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        body = pl_module.body
        print(
            f"rank {trainer.global_rank}: stage {body.stage} of {body.num_stages}, "
            f"blocks {body.indices}, threads {torch.get_num_threads()}",
            flush=True,
        )


def make_data(n: int, features: int = 32, classes: int = 10, seed: int = 0) -> TensorDataset:
    """A learnable synthetic task: the label is the arg-max of a fixed random projection."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, classes, generator=torch.Generator().manual_seed(1234))
    return TensorDataset(x, (x @ w).argmax(-1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--ckpt", default=None, help="write a consolidated checkpoint here at the end"
    )
    parser.add_argument(
        "--weights", default=None, help="torch.save(model.state_dict()) here at the end (rank 0)"
    )
    args = parser.parse_args()

    seed_everything(0)
    model = Classifier()
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=Pipe2BWStrategy(schedule=args.schedule, microbatches=args.microbatches),
        max_steps=args.steps,
        val_check_interval=50,
        check_val_every_n_epoch=None,
        limit_val_batches=4,
        log_every_n_steps=10,
        logger=False,
        enable_checkpointing=False,
        callbacks=[ReportStages()],
    )
    train = DataLoader(make_data(8192), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(make_data(1024, seed=1), batch_size=args.batch_size)
    trainer.fit(model, train, val)
    metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
    if args.ckpt:
        trainer.save_checkpoint(args.ckpt)
    if args.weights and trainer.is_global_zero:
        # after fit the module holds the whole trained model again, on every rank
        torch.save(model.state_dict(), args.weights)
    if trainer.is_global_zero:
        print(f"final metrics: {metrics}")


if __name__ == "__main__":
    main()
