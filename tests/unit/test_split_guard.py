"""The intake learns a model's structure from one observed forward, and the guard against a split
that trains silently wrong (``check_split``, on by default):

- at set-up, the split model (its blocks run one after the other in the process) must return
  what the whole model returns on the first micro-batch (rtol 1e-4, atol 1e-5);
- at the first update, every trainable parameter must have a gradient on some stage (on real
  ranks: ``tests/ranks/test_split_guard.py``).

OPT is the case that trained silently wrong before: it registers its final norm before its layer
list, and registration order put that norm on the first stage, where nothing ran it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch
from helpers import hf_models
from torch import Tensor, nn

from lightning_pipe2bw.partition.hf import pipe_model_for
from lightning_pipe2bw.partition.observe import SplitError, evaluating, observe
from lightning_pipe2bw.partition.split import check_split
from lightning_pipe2bw.runtime.call import BodyInput


def _opt_call() -> tuple[nn.Module, BodyInput]:
    torch.manual_seed(0)
    model = hf_models.opt()
    x, y = hf_models.batches("opt", 1)[0]
    return model, BodyInput((), {"input_ids": x[:2], "labels": y[:2]})


def test_the_forward_shows_where_registration_order_misleads() -> None:
    model, call = _opt_call()
    static = pipe_model_for(model)  # no forward watched: registration order
    learnt = pipe_model_for(model, call)
    assert static is not None and learnt is not None
    assert "model.decoder.final_layer_norm" in static.pre
    assert "model.decoder.final_layer_norm" in learnt.post
    assert "model.decoder.final_layer_norm" not in learnt.pre
    check_split(learnt, learnt.body(), call)  # the learnt split computes what the model does


def test_the_set_up_check_catches_a_split_that_computes_something_else() -> None:
    """The guard on the split registration order gives OPT: the final norm sits on the first
    stage, where the forward never reaches it; the last stage's replay of the end of the
    forward reads the norm's output (a blank there), so the loss and the logits change with the
    blank's values, and the norm is named."""
    model, call = _opt_call()
    static = pipe_model_for(model)
    assert static is not None
    with pytest.raises(SplitError) as info:
        check_split(static, static.body(), call)
    message = str(info.value)
    print(f"GUARD set-up: {message[:300]}")
    assert message.startswith(
        "the pipeline split of OPTForCausalLM would compute something else than the whole model "
        "on a micro-batch of new input shapes [[2, 12], [2, 12]]"
    )
    assert "logits: max |difference|" in message and "loss: max |difference|" in message
    assert "it reads what 'model.decoder.final_layer_norm' computes" in message  # named
    assert "check_split=False" in message


class _UsesShared(nn.Module):
    """A layer that calls a module it does not hold (a module shared by layers)."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.own = nn.Linear(4, 4)
        object.__setattr__(self, "other", shared)

    def forward(self, x: Tensor) -> Tensor:
        return self.other(self.own(x))  # type: ignore[no-any-return, operator]


class _Odd(nn.Module):
    """Layers that call a module outside them, a module run between two layers, or a norm run
    before and after the layers."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm(4)
        self.shared = nn.Linear(4, 4)
        if kind == "inside":
            self.layers = nn.ModuleList([_UsesShared(self.shared) for _ in range(3)])
        else:
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.kind == "between" and i == 0:
                x = self.shared(x)
        return self.norm(x) if self.kind == "twice" else self.shared(x)


def test_a_module_without_parameters_may_run_anywhere() -> None:
    """A dropout (or rotary table) without parameters is on every stage: one instance used
    before the layers, between them and after them, or by every layer, is no problem."""

    class _Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.0)
            self.embed = nn.Linear(4, 4)
            self.layers = nn.ModuleList([_UsesShared(self.drop) for _ in range(3)])
            self.head = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            x = self.drop(self.embed(x))
            for i, layer in enumerate(self.layers):
                x = layer(x)
                x = self.drop(x) if i == 0 else x
            return self.head(self.drop(x))  # type: ignore[no-any-return]

    model = _Shared()
    seen = observe(model, "layers", lambda: model(torch.randn(2, 4)))
    assert seen.before == ["drop", "embed"] and seen.after == ["head"], (seen.before, seen.after)


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        (
            "inside",
            "layer 0 of _Odd ('layers') calls 'shared', which is not part of it (and 2 more)",
        ),
        ("between", "'shared' of _Odd runs between two layers and after the layers"),
        ("twice", "'norm' of _Odd runs before the layers and after the layers"),
    ],
)
def test_a_forward_the_split_cannot_carry_is_refused(kind: str, says: str) -> None:
    model = _Odd(kind)
    with pytest.raises(SplitError) as info:
        observe(model, "layers", lambda: model(torch.randn(2, 4)))
    assert str(info.value).startswith(says), str(info.value)
    assert "PipeModel" in str(info.value)


def test_the_intakes_eval_forward_leaves_a_modules_plain_values_as_they_were() -> None:
    """A forward in eval mode may set a value that training then reads (NLLB-MoE's router sets
    its expert capacity from the batch's token count): the intake's forwards put it back."""

    class SetsInEval(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.capacity = 64
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.training:
                self.capacity = x.shape[0]
                self.kind = "full"  # a switch of how it computes, made for good
            return self.lin(x)

    module = SetsInEval()
    with evaluating(module):
        module(torch.zeros(3, 2))
        assert module.capacity == 3
    assert module.capacity == 64 and module.kind == "full" and module.training


def test_a_layer_list_of_lists_is_refused_naming_the_nesting() -> None:
    """Funnel keeps its layers as a list of lists (a block per resolution, pooling between
    them): the refusal says so, not only that the forward did not call the list."""
    transformers = pytest.importorskip("transformers")
    config = transformers.FunnelConfig(
        vocab_size=64, block_sizes=[1, 1], d_model=32, n_head=2, d_head=8, d_inner=64,
        num_labels=3,
    )  # fmt: skip
    model = transformers.FunnelForSequenceClassification(config)
    call = BodyInput((), {"input_ids": torch.randint(2, 64, (2, 8)), "labels": torch.tensor([0, 1])})
    with pytest.raises(SplitError, match=r"'funnel\.encoder\.blocks' holds lists of layers"):
        pipe_model_for(model, call)
