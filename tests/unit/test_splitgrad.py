"""``SplitBackward``: a backward cut into the inputs' pass and the weights' pass must give bitwise
the gradients of one backward (inputs' and weights', with the same layout), accumulate nothing
before the weights' pass, compute no matrix product twice, and refuse the graphs where the order
of additions could change."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_pipe2bw.runtime.splitgrad import SplitBackward


class Attention(nn.Module):
    """A pre-LN transformer block with causal attention and a learned position table."""

    def __init__(self, d: int = 16, n: int = 8) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(n, d))
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.pos[: x.shape[1]]
        q, k, v = self.qkv(self.ln1(x)).unsqueeze(1).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Residual(nn.Module):
    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.fc(x))


class TwoHeads(nn.Module):
    """Two outputs (a middle stage sending a pair), one of them also fed by a weight alone."""

    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.offset = nn.Parameter(torch.randn(d))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.a(x)
        return torch.relu(h), self.b(h) * 2.0 + self.offset.exp()


class WeightOutput(nn.Module):
    """Outputs computed from a weight alone: roots off the input path (``twice``: the same
    tensor twice, so that both gradients meet on its node)."""

    def __init__(self, d: int = 12, twice: bool = False) -> None:
        super().__init__()
        self.twice = twice
        self.fc = nn.Linear(d, d)
        self.table = nn.Parameter(torch.randn(3, d))

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        t = self.table.sin() * 2.0
        return (torch.tanh(self.fc(x)), t, t) if self.twice else (torch.tanh(self.fc(x)), t)


def _conv() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "residual-mlp": (lambda: nn.Sequential(*[Residual() for _ in range(4)]), (5, 12)),
    "attention": (lambda: nn.Sequential(Attention(), Attention()), (3, 8, 16)),
    "conv-batchnorm": (_conv, (4, 3, 6, 6)),
    "two-outputs": (TwoHeads, (5, 12)),
    "weight-only-output": (WeightOutput, (5, 12)),
}


def _roots(out: Any, last: bool, seed: int = 3) -> tuple[list[Tensor], list[Tensor | None]]:
    """The last stage's scalar loss (seeded by autograd's implicit 1), or a middle stage's
    outputs with the gradients the next stage would send."""
    outs = list(out) if isinstance(out, tuple) else [out]
    if last:
        return [sum((o.float() ** 2).mean() for o in outs) * 0.25], [None]  # type: ignore[list-item]
    g = torch.Generator().manual_seed(seed)
    return outs, [torch.randn(o.shape, generator=g) for o in outs]


def _backward(model: nn.Module, x0: Tensor, last: bool, split: bool) -> dict[str, Tensor]:
    model = copy.deepcopy(model)
    x = x0.clone().requires_grad_(True)
    roots, seeds = _roots(model(x), last)
    if not split:
        torch.autograd.backward(roots, seeds)
        return {"input": x.grad, **{n: p.grad for n, p in model.named_parameters()}}
    plan = SplitBackward.plan(roots, seeds, [x])
    assert plan is not None
    (grad,) = plan.inputs_pass()
    assert x.grad is None
    assert all(p.grad is None for p in model.parameters())  # nothing accumulated yet
    plan.weights_pass()
    return {"input": grad, **{n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("last", [True, False], ids=["loss", "received-gradients"])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_split_is_bitwise_one_backward(name: str, last: bool) -> None:
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model, x0 = make(), torch.randn(*shape)
    whole, split = _backward(model, x0, last, False), _backward(model, x0, last, True)
    assert whole.keys() == split.keys()
    for key in whole:
        a, b = whole[key], split[key]
        assert a is not None and b is not None, key
        assert torch.equal(a, b), key  # bitwise
        assert a.stride() == b.stride(), key  # the layout a whole backward gives .grad


def test_roots_off_the_input_path_add_up_as_in_one_backward() -> None:
    torch.manual_seed(0)
    model, x0 = WeightOutput(twice=True), torch.randn(5, 12)
    whole = _backward(model, x0, last=False, split=False)
    split = _backward(model, x0, last=False, split=True)
    for key in whole:
        assert torch.equal(whole[key], split[key]), key


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _ops(model: nn.Module, x0: Tensor, split: bool) -> tuple[Counter[str], Counter[str]]:
    """The operators of the backward: (all of it) or (inputs' pass, weights' pass)."""
    x = x0.clone().requires_grad_(True)
    roots, seeds = _roots(model(x), last=True)
    first, second = _CountOps(), _CountOps()
    if not split:
        with first:
            torch.autograd.backward(roots, seeds)
        return first.ops, second.ops
    plan = SplitBackward.plan(roots, seeds, [x])
    assert plan is not None
    with first:
        plan.inputs_pass()
    with second:
        plan.weights_pass()
    return first.ops, second.ops


def test_no_work_is_done_twice() -> None:
    torch.manual_seed(0)
    make, shape = MODELS["attention"]
    model, x0 = make(), torch.randn(*shape)
    whole, _ = _ops(copy.deepcopy(model), x0, split=False)
    inputs_pass, weights_pass = _ops(copy.deepcopy(model), x0, split=True)
    # every matrix product once: the inputs' in the first pass, the weights' (2 blocks x 4
    # linear layers) in the second; attention (no weights) in the first only
    assert whole["aten.mm"] == 16
    assert (inputs_pass["aten.mm"], weights_pass["aten.mm"]) == (8, 8)
    attention = "aten._scaled_dot_product_flash_attention_for_cpu_backward"
    assert (whole[attention], inputs_pass[attention], weights_pass[attention]) == (2, 2, 0)


def test_accumulation_hooks_run_once_in_the_weights_pass() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Residual(), Residual())
    seen: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: seen.append(name))
    x = torch.randn(4, 12, requires_grad=True)
    plan = SplitBackward.plan(*_roots(model(x), last=True), [x])
    assert plan is not None
    plan.inputs_pass()
    assert seen == []
    plan.weights_pass()
    assert sorted(seen) == sorted(n for n, _ in model.named_parameters())


class _Nested(nn.Module):
    """A LayerNorm applied to its own output: its weight's accumulator is fed by two input-path
    nodes, one below the other, so re-running the outer one for its weight's share would run the
    inner one again."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(12)

    def forward(self, x: Tensor) -> Tensor:
        return self.ln(torch.tanh(self.ln(x)))


class _Fanned(nn.Module):
    """A weight-only result used three ways and summed: its node's input gathers three
    gradients (all in one owner's part of the weights' pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(12, 12))

    def forward(self, x: Tensor) -> Tensor:
        w2 = self.w * 2.0
        return x @ (w2.exp() + w2.sin() + w2.cos()).t()


@pytest.mark.parametrize("module", [_Nested, _Fanned])
def test_graphs_that_could_add_in_another_order_are_refused(module: type[nn.Module]) -> None:
    x = torch.randn(4, 12, requires_grad=True)
    assert SplitBackward.plan(*_roots(module()(x), last=True), [x]) is None


def test_roots_without_a_graph_and_unreached_inputs_are_refused() -> None:
    x = torch.randn(4, 12, requires_grad=True)
    leaf = torch.randn(3, requires_grad=True)
    assert SplitBackward.plan([leaf], [torch.ones(3)], [x]) is None  # a leaf root
    other = torch.randn(4, 12, requires_grad=True)
    y = Residual()(other)
    assert SplitBackward.plan([y.sum()], [None], [x]) is None  # the input is not reached


def test_the_weights_pass_needs_the_inputs_pass() -> None:
    x = torch.randn(4, 12, requires_grad=True)
    plan = SplitBackward.plan([Residual()(x).sum()], [None], [x])
    assert plan is not None
    with pytest.raises(RuntimeError, match="weights_pass runs after inputs_pass"):
        plan.weights_pass()


class _SavesItsOutput(torch.autograd.Function):
    """tanh that saves its own output for the backward (as torch.tanh does), in Python so that
    a test can hold a weak reference to its node."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


def test_a_split_backward_under_the_stash_hooks_frees_its_graph() -> None:
    """The stage records every forward through the stash's saved-tensor hooks. A hook that kept
    a saved output as it is (with its grad_fn) made a cycle through autograd's nodes that only
    a backward without ``retain_graph`` breaks: the inputs' pass keeps the graph, so every split
    backward leaked its input path's activations (a micro-batch's worth per step)."""
    import gc
    import weakref

    from lightning_pipe2bw.runtime.stash import ActivationStash

    fc = nn.Linear(12, 12)
    x = torch.randn(4, 12, requires_grad=True)
    stash = ActivationStash(torch.device("cpu"))
    with stash.recording(0, fc.parameters()):
        hidden = _SavesItsOutput.apply(fc(x))
        out = x + hidden
    node = weakref.ref(hidden.grad_fn)
    split = SplitBackward.plan([out], [torch.ones_like(out)], [x])
    assert split is not None
    split.inputs_pass()
    split.weights_pass()
    stash.release(0)
    del out, hidden, split
    gc.collect()
    assert node() is None  # the graph went with its roots
    assert fc.weight.grad is not None
