"""Losses normalised by the whole batch's items (issue 60, item 2): a token-mean loss on a batch
whose micro-batches hold different numbers of valid labels trains, logs and validates as
Lightning on one device does on the whole batch, with ``loss_normalization="batch"`` (the
default); ``"microbatch"`` is Lightning's gradient accumulation over the micro-batches.

- A Hugging Face Llama called with -100 labels of varying lengths (zero pipe2bw lines: the
  model's loss takes ``num_items_in_batch``);
- the user's own loss, a sum over tokens divided by ``items_in_batch(batch, count)``.

Tolerance: max abs difference <= 1e-5 after 4 AdamW steps (weights, logged losses)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import hf_models
from helpers.models import max_abs_diff, quiet_trainer
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe2bw import Pipe2BWStrategy, items_in_batch

STEPS, M, BATCH, SEQ, VOCAB = 4, 4, 8, 12, hf_models.VOCAB
TOL = 1e-5


def _data(seed: int = 0) -> TensorDataset:
    """Batches of 8 sequences whose labels end in 0 to 10 ignored (-100) tokens, drawn so that
    the 4 micro-batches of 2 hold different numbers of valid labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (STEPS * BATCH, SEQ), generator=g)
    valid = torch.randint(1, SEQ + 1, (STEPS * BATCH,), generator=g)
    keep = torch.arange(SEQ)[None, :] < valid[:, None]
    labels = ids.masked_fill(~keep, -100)
    return TensorDataset(ids, keep.long(), labels)


def _loader() -> DataLoader[Any]:
    return DataLoader(_data(), batch_size=BATCH)


def _valid_per_microbatch() -> list[list[int]]:
    _, _, labels = _data().tensors
    return [
        [int(part[:, 1:].ne(-100).sum()) for part in torch.tensor_split(batch, M)]
        for batch in labels.split(BATCH)
    ]


class LlamaModule(LightningModule):
    """A user's module: the model as it comes, its own loss, no pipe2bw line."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = hf_models.llama()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, mask, labels = batch
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        self.log("train_loss", loss)
        return loss  # type: ignore[no-any-return]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, mask, labels = batch
        self.log("val_loss", self.model(input_ids=ids, attention_mask=mask, labels=labels).loss)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class OwnLossModule(LightningModule):
    """The user's own token-mean loss: a sum over the valid tokens divided by
    ``items_in_batch``, which on one device is the batch's count."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Embedding(VOCAB, 16),
            *[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)],
            nn.Linear(16, VOCAB),
        )

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, _, labels = batch
        logits = self.body(ids)
        total = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        loss = total / items_in_batch(batch, lambda b: b[2].ne(-100).sum())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


MODULES = {"llama": LlamaModule, "own": OwnLossModule}


def _state(module: LightningModule) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fit(kind: str, schedule: str, normalization: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = MODULES[kind]()
    strategy = Pipe2BWStrategy(
        schedule=schedule, microbatches=M, loss_normalization=normalization
    )
    trainer = quiet_trainer(
        devices=dist.get_world_size(), strategy=strategy, max_steps=STEPS, limit_val_batches=None
    )
    trainer.fit(module, _loader())
    logged = float(trainer.callback_metrics["train_loss"])
    validated = trainer.validate(module, _loader(), verbose=False) if kind == "llama" else None
    state = strategy.full_state_dict()  # collective
    return {
        "state": state if dist.get_rank() == 0 else None,
        "train_loss": logged,
        "val_loss": validated[0]["val_loss"] if validated else None,
    }


def _one_device(kind: str, accumulate: int = 1) -> dict[str, Any]:
    """Lightning on one device: the whole batch in one step, or (``accumulate``) its
    micro-batches' gradients accumulated."""
    torch.set_num_threads(1)
    module = MODULES[kind]()
    batch = BATCH // accumulate
    trainer = quiet_trainer(
        devices=1, max_steps=STEPS, accumulate_grad_batches=accumulate, limit_val_batches=None
    )
    trainer.fit(module, DataLoader(_data(), batch_size=batch))
    out: dict[str, Any] = {"state": _state(module)}
    out["train_loss"] = float(trainer.callback_metrics["train_loss"])
    if kind == "llama":
        out["val_loss"] = trainer.validate(module, _loader(), verbose=False)[0]["val_loss"]
    return out


def test_the_micro_batches_hold_different_numbers_of_valid_labels() -> None:
    """The case is one where the two normalisations differ (else the tests below could not
    fail)."""
    counts = _valid_per_microbatch()
    assert all(len(set(c)) > 1 for c in counts), counts
    whole, accumulated = _one_device("llama"), _one_device("llama", accumulate=M)
    assert max_abs_diff(whole["state"], accumulated["state"]) > 100 * TOL


@pytest.mark.parametrize(
    ("kind", "schedule"),
    [
        ("llama", "1f1b"), ("llama", "zb-h1"), ("llama", "interleaved-1f1b"), ("llama", "zb-v"),
        ("own", "1f1b"),
    ],
)
def test_a_token_mean_loss_trains_as_one_device_on_the_whole_batch(
    pools: Any, kind: str, schedule: str
) -> None:
    results = pools(2).run(_fit, kind, schedule, "batch")
    ref = _one_device(kind)
    diff = max_abs_diff(results[0]["state"], ref["state"])
    print(f"{kind} {schedule}: max|dW| vs one device on the whole batch {diff:.3e}")
    assert diff <= TOL
    for r in results:  # what every rank logs: the batch's token mean, as one device logs it
        assert abs(r["train_loss"] - ref["train_loss"]) <= TOL
        if kind == "llama":
            assert abs(r["val_loss"] - ref["val_loss"]) <= TOL


def test_2bw_trains_the_whole_batch_token_mean_with_its_delay(pools: Any) -> None:
    """2BW's delayed rule on the whole batch's token mean: its one-process reference with one
    micro-batch per batch (the whole batch's loss), W(t+1) = W(t) - step(grad f(W(t-1)))."""
    results = pools(2).run(_fit, "llama", "2bw", "batch")
    ids, _, labels = _data().tensors

    def build() -> nn.Module:
        torch.manual_seed(0)
        return hf_models.llama()

    def loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:  # the step's call (mask from y)
        return model(input_ids=x, attention_mask=y.ne(-100).long(), labels=y).loss  # type: ignore[no-any-return]

    batches = list(zip(ids.split(BATCH), labels.split(BATCH), strict=True))
    ref = hf_models.train_reference(build, batches, 1, loss, delayed=True)
    diff = max_abs_diff(results[0]["state"], {f"model.{k}": v for k, v in ref.items()})
    print(f"2bw: max|dW| vs the delayed whole-batch reference {diff:.3e}")
    assert diff <= TOL


def test_microbatch_normalization_is_lightnings_gradient_accumulation(pools: Any) -> None:
    results = pools(2).run(_fit, "llama", "1f1b", "microbatch")
    ref = _one_device("llama", accumulate=M)
    diff = max_abs_diff(results[0]["state"], ref["state"])
    print(f"microbatch: max|dW| vs one device accumulating the micro-batches {diff:.3e}")
    assert diff <= TOL
