"""How a Hugging Face model's loss counts a call's items (``partition.hf.item_count``), the check
that its loss divides by ``num_items_in_batch``, and ``items_in_batch`` outside and inside a
pipelined step (``runtime.items``)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from helpers import hf_models
from torch import Tensor, nn

from lightning_pipe2bw import items_in_batch
from lightning_pipe2bw.partition.hf import _divides_by, item_count, pipe_model_for
from lightning_pipe2bw.runtime.call import BodyInput
from lightning_pipe2bw.runtime.items import amended_call, batch_items

LABELS = torch.tensor([[5, 6, 7, -100], [-100, 8, 9, 10]])


def test_a_causal_models_loss_counts_the_labels_after_its_shift() -> None:
    count = item_count(hf_models.llama())
    assert count is not None
    # position 0 of each row is never a target: [6, 7, -100] and [8, 9, 10]
    assert int(count(BodyInput((), {"labels": LABELS}))) == 5
    # the call's own shifted labels are counted as they are
    assert int(count(BodyInput((), {"labels": LABELS, "shift_labels": LABELS}))) == 6
    # labels given positionally (LlamaForCausalLM.forward's sixth parameter)
    args = (None, None, None, None, None, LABELS)
    assert int(count(BodyInput(args, {}))) == 5


def test_a_masked_models_and_a_classifiers_loss_count_every_label() -> None:
    for family, labels, expected in (
        ("bert_mlm", LABELS, 6),
        ("bert_cls", torch.tensor([0, 2, 1]), 3),
    ):
        count = item_count(hf_models.FAMILIES[family]())
        assert count is not None
        assert int(count(BodyInput((), {"labels": labels}))) == expected


def test_no_count_where_the_call_or_the_model_gives_none() -> None:
    count = item_count(hf_models.llama())
    assert count is not None
    assert count(BodyInput((), {})) is None  # no labels
    assert count(BodyInput((), {"labels": LABELS, "num_items_in_batch": 3})) is None
    assert count(BodyInput((), {"labels": LABELS.float()})) is None  # regression targets

    class Plain(nn.Module):  # a forward without loss keywords
        def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor:
            return input_ids

    assert item_count(Plain()) is None


class _OwnMeanLoss(nn.Module):
    """A model that takes ``**kwargs`` but computes its loss as its own mean: it ignores
    ``num_items_in_batch``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = hf_models.llama()

    def forward(self, input_ids: Tensor, labels: Tensor, **kwargs: Any) -> Any:
        out = self.inner(input_ids=input_ids)
        logits = out.logits[:, :-1].flatten(0, 1)
        out.loss = nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100)
        return out


def test_the_check_finds_whether_the_loss_divides_by_the_count() -> None:
    ids = torch.randint(2, hf_models.VOCAB, (2, 4))
    call = BodyInput((), {"input_ids": ids, "labels": LABELS})
    llama = hf_models.llama()
    count = item_count(llama)
    assert count is not None and _divides_by(llama, call, count)
    own = _OwnMeanLoss()
    own_count = item_count(own)
    assert own_count is not None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not _divides_by(own, call, own_count)
    assert any("does not divide by `num_items_in_batch`" in str(w.message) for w in seen)
    # the intake keeps the count only for the model whose loss divides by it
    assert pipe_model_for(llama, call).count_items is not None  # type: ignore[union-attr]


def test_items_in_batch_outside_and_inside_a_pipelined_step() -> None:
    batch = {"labels": torch.tensor([[1, -100], [2, 3], [-100, -100], [4, 5]])}

    def count(b: Any) -> Tensor:
        return b["labels"].ne(-100).sum()

    assert int(items_in_batch(batch, count)) == 5  # one device: the batch's own count
    parts = [{"labels": t} for t in torch.tensor_split(batch["labels"], 2)]
    with batch_items(batch, parts, [0.5, 0.5]):
        # each micro-batch: the batch's count times its share, so that the weighted sum of
        # sum_i / (N w_i) is the batch's sum / N
        assert [float(items_in_batch(p, count)) for p in parts] == [2.5, 2.5]
        with pytest.raises(ValueError, match="pass the step's own `batch` argument"):
            items_in_batch({"labels": batch["labels"]}, count)
    assert int(items_in_batch(parts[0], count)) == 3  # after the step: its own count again


def test_the_model_call_on_the_last_stage_takes_the_batch_count_times_its_share() -> None:
    parts = [object(), object()]
    call = BodyInput((1,), {"labels": LABELS})
    assert amended_call(call, parts[0]) is call  # no pipelined step running
    with batch_items("batch", parts, [0.25, 0.75], {"num_items_in_batch": torch.tensor(8)}):
        amended = amended_call(call, parts[1])
        assert amended.args == (1,) and float(amended.kwargs["num_items_in_batch"]) == 6.0
        given = BodyInput((), {"num_items_in_batch": 3})  # the step counts itself: kept
        assert amended_call(given, parts[0]).kwargs["num_items_in_batch"] == 3


def test_a_forward_whose_kwargs_refuse_the_count_keeps_its_own_means() -> None:
    """A forward with ``**kwargs`` that hands them to a module without such a keyword: the
    intake's check finds it cannot take the count (no error at set-up)."""

    class Strict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = hf_models.llama()

        def forward(self, input_ids: Tensor, labels: Tensor, **kwargs: Any) -> Any:
            return self.run(input_ids, labels, **kwargs)

        def run(self, input_ids: Tensor, labels: Tensor) -> Any:
            return self.inner(input_ids=input_ids, labels=labels)

    model = Strict()
    count = item_count(model)
    assert count is not None
    call = BodyInput((), {"input_ids": torch.randint(2, hf_models.VOCAB, (2, 4)), "labels": LABELS})
    assert not _divides_by(model, call, count)
