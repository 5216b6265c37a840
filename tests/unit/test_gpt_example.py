"""The main job's GPT (``lightning_pipe2bw.recipes.gpt``): data split, shapes, causality, and that it learns."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything

from lightning_pipe2bw.recipes.gpt.data import StdlibTextDataModule
from lightning_pipe2bw.recipes.gpt.model import GPT, Block, Embeddings, LMHead, warmup_cosine

SMALL_BYTES = 300_000


def tiny_gpt(**kwargs: Any) -> GPT:
    config: dict[str, Any] = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}
    config.update(kwargs)
    return GPT(**config)


def small_data(**kwargs: Any) -> StdlibTextDataModule:
    config: dict[str, Any] = {
        "block_size": 32,
        "batch_size": 8,
        "max_bytes": SMALL_BYTES,
        "train_samples": 160,
        "val_samples": 16,
    }
    config.update(kwargs)
    data = StdlibTextDataModule(**config)
    data.setup("fit")
    return data


def test_split_is_deterministic_and_disjoint() -> None:
    a, b = small_data(), small_data()
    assert a.train_files and a.val_files
    assert a.train_files == b.train_files and a.val_files == b.val_files
    assert not set(a.train_files) & set(a.val_files)
    files = sorted([*a.train_files, *a.val_files])
    assert files[:: a.val_every] == a.val_files  # every 10th file, in path order
    assert a.train_data is not None and b.train_data is not None
    assert torch.equal(a.train_data, b.train_data)
    assert a.val_data is not None and 0 < a.val_data.numel() < a.train_data.numel()

    # the same seed gives the same batches, and y is x shifted by one
    (xa, ya), (xb, yb) = next(iter(a.train_dataloader())), next(iter(b.train_dataloader()))
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert xa.shape == ya.shape == (8, 32) and xa.dtype == torch.long
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    (xc, _) = next(iter(small_data(seed=1).train_dataloader()))
    assert not torch.equal(xa, xc)
    assert len(a.train_dataloader().dataset) == 160  # type: ignore[arg-type]
    assert len(a.val_dataloader().dataset) == 16  # type: ignore[arg-type]


def test_the_body_holds_every_parameter_and_the_shapes() -> None:
    model = tiny_gpt()
    body = list(model.body)
    assert isinstance(body[0], Embeddings) and isinstance(body[-1], LMHead)
    assert all(isinstance(block, Block) for block in body[1:-1]) and len(body) == 4
    assert all(name.startswith("body.") for name, _ in model.named_parameters())
    assert body[0].token.weight is not body[-1].proj.weight  # untied
    for length in (32, 7):
        logits = model(torch.randint(0, 256, (3, length)))
        assert logits.shape == (3, length, 256)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.randint(0, 256, (1, 33)))


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = tiny_gpt().eval()
    x = torch.randint(0, 256, (2, 32))
    changed = x.clone()
    k = 20
    changed[:, k] = (x[:, k] + 1) % 256
    with torch.no_grad():
        before, after = model(x), model(changed)
    torch.testing.assert_close(before[:, :k], after[:, :k], rtol=0, atol=1e-6)
    assert (before[:, k:] - after[:, k:]).abs().amax() > 1e-4


def test_learning_rate_schedule() -> None:
    assert warmup_cosine(0, 10, 100) == pytest.approx(0.1)
    assert warmup_cosine(9, 10, 100) == pytest.approx(1.0)
    assert warmup_cosine(10, 10, 100) == pytest.approx(1.0)
    assert warmup_cosine(55, 10, 100) == pytest.approx(0.55)
    assert warmup_cosine(100, 10, 100) == pytest.approx(0.1)
    assert warmup_cosine(500, 10, 100, min_ratio=0.0) == 0.0


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))


def test_loss_decreases_on_one_device() -> None:
    seed_everything(0)
    model = tiny_gpt(lr=3e-3, warmup_steps=5, max_steps=20)
    record = _Losses()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=20,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(model, datamodule=small_data())
    losses = record.losses
    assert len(losses) == 20
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)  # uniform over bytes at the start
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.5, losses
    metrics = trainer.callback_metrics
    val_loss, val_ppl = float(metrics["val_loss"]), float(metrics["val_ppl"])
    assert val_loss < losses[0]
    # the mean of per-batch perplexities is at least exp(mean loss), and close to it
    assert math.exp(val_loss) * (1 - 1e-4) <= val_ppl <= math.exp(val_loss) * 1.1
