"""Each layer gets its own arguments, and the guard proves a split exact on every new shape, in
one process (the split's blocks run one after the other; on real ranks:
``tests/ranks/test_real_models.py``, ``tests/ranks/test_split_guard.py``).

- the carry between stages holds every layer's call, each distinct tensor once, drops a tensor
  after its last use, fills a value a layer passes on from that layer's output, and stays a
  tree of plain values around its tensors (what the transports compare without pickling);
- the first stage learns each layer's arguments from the model's own forward: by the layer's
  index, by an attribute of the layer the forward reads, and a value a layer returns for the
  next;
- the guard refuses, naming why, a forward whose layers' arguments depend on what the layers
  compute, one that changes the hidden state between two layers, and an end of the forward
  that reads a part of the first stage; and it runs once per shape.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_pipe2bw import PipeModel
from lightning_pipe2bw.partition.carry import KEEP, Pending, advance, call_of, pack
from lightning_pipe2bw.partition.observe import SplitError
from lightning_pipe2bw.partition.pipemodel import Released, release
from lightning_pipe2bw.partition.replay import ReadsBlanks, ReplayHead
from lightning_pipe2bw.runtime.call import BodyInput
from lightning_pipe2bw.runtime.wire import Channel, encode


def test_the_carry_holds_each_tensor_once_and_drops_it_after_its_last_use() -> None:
    mask_a, mask_b, rope = torch.ones(2, 2), torch.zeros(2, 2), torch.arange(4.0)
    calls = {
        0: ((), {"mask": mask_a, "rope": rope}, None),
        1: ((), {"mask": mask_b, "rope": rope}, None),
        2: ((), {"mask": mask_a, "rope": rope, "bias": Pending(1, 1)}, None),
    }
    carry = pack(torch.randn(2, 3), calls)
    assert len(carry["shared"]) == 4  # mask_a, rope, mask_b, and a place for layer 1's output
    assert carry["last"] == (2, 2, 1, 2)
    assert carry["fills"] == {1: ((1, (), 3),)}  # layer 1's output [1], whole, fills place 3
    assert call_of(carry, 1)[1]["mask"] is mask_b
    after0 = advance(carry, 0, 0, torch.randn(2, 3))
    assert after0["shared"][:3] == carry["shared"][:3]  # nothing is last used by layer 0
    bias = torch.randn(2)
    after1 = advance(after0, 1, 0, (torch.randn(2, 3), bias))
    assert after1["shared"][2] is None  # mask_b: no later layer takes it
    assert after1["shared"][3] is bias and call_of(after1, 2)[1]["bias"] is bias
    assert after1["forms"] == {0: 2}
    assert 0 not in after1["calls"] and 1 not in after1["calls"]
    assert carry["calls"].keys() == {0, 1, 2}  # the carry a stage received is left as it was
    after2 = advance(after1, 2, 0, torch.randn(2, 3))
    assert all(t is None for t in after2["shared"])


def test_items_of_a_layers_output_travel_to_the_layer_that_takes_them() -> None:
    """Swinv2 passes the next layer ``(dims[-2], dims[-1])``, items of a layer's output
    ``(hidden, before, dims)``: each item is a place the layer's run fills."""
    dims = Pending(0, 2)
    calls = {1: ((), {"input_dimensions": (dims[-2], dims[-1])}, None)}
    carry = pack(torch.randn(2, 3), calls)
    assert carry["fills"] == {0: ((2, (-2,), 0), (2, (-1,), 1))}
    after = advance(carry, 0, 0, (torch.randn(2, 3), None, (8, 8, 4, 6)))
    assert call_of(after, 1)[1]["input_dimensions"] == (4, 6)
    with pytest.raises(TypeError, match="unpacked"):
        tuple(dims)
    with pytest.raises(TypeError, match="by an int or str key only"):
        dims[1:]


def test_a_value_a_later_stage_replays_is_kept_to_the_end() -> None:
    norm_out, mask = torch.randn(2, 3), torch.ones(2)
    carry = pack(torch.randn(2, 3), {0: ((), {"mask": mask}, None)}, {"norm": (norm_out, True)})
    assert carry["last"][-1] == KEEP
    done = advance(carry, 0, 0, torch.randn(2, 3))
    assert done["shared"][0] is None and done["shared"][1] is norm_out


def test_the_carry_is_a_plain_header_around_its_tensors() -> None:
    """The transports keep a channel's header while it stays the same, comparing plain values
    instead of pickling: the carry's references are part of its structure, not objects."""
    channel = Channel()
    calls = {i: ((), {"mask": torch.ones(2), "flag": True}, None) for i in range(3)}
    _, _, header, same = encode(channel, pack(torch.randn(2, 3), calls))
    assert header is not None and not same
    channel.advance(header, same)
    assert channel.plain
    tensors, _, header, same = encode(channel, pack(torch.randn(2, 3), calls))
    assert header is None and same  # the next micro-batch's header is known without pickling
    assert len(tensors) == 4  # the hidden state and three masks (distinct tensors)


class _Layer(nn.Module):
    """Adds a linear map of its input, masked by the mask it is given; ``kind`` is what the
    model's forward reads to choose the mask."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor, mask: Tensor, scale: float = 1.0) -> Tensor:
        return x + scale * torch.tanh(self.linear(x)) * mask


class _Model(nn.Module):
    """Layers of two kinds, each called with its kind's mask (read from the layer) and a scale
    by its index; ``between`` changes the hidden state between two layers, ``chained`` makes a
    layer's mask depend on the hidden state, ``post_reads`` adds the embedding's output to the
    head's input, ``long`` does the first only for sequences longer than 4."""

    def __init__(self, flaw: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.flaw = flaw
        self.embed = nn.Linear(3, 4)
        self.layers = nn.ModuleList([_Layer("local" if i % 2 else "global") for i in range(4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = e = self.embed(x)
        masks = {
            "global": torch.ones_like(h),
            "local": (torch.arange(h.shape[1]) < 2).float()[:, None],
        }
        for i, layer in enumerate(self.layers):
            mask = masks[layer.kind]
            if self.flaw == "chained":  # a mask computed from the hidden state
                mask = mask * torch.sigmoid(h.detach().mean(-1, keepdim=True))
            h = layer(h, mask, scale=1.0 + i)
            if self.flaw == "between" or (self.flaw == "long" and x.shape[1] > 4):
                h = h * 1.5
        if self.flaw == "post_reads":
            h = h + e
        return self.head(h)


def _spec(model: nn.Module) -> PipeModel:
    return PipeModel(model, blocks="layers", pre=["embed"], post=["head"], head=ReplayHead())


def test_each_layer_gets_the_arguments_the_forward_gives_it() -> None:
    """Layers told apart by an attribute the forward reads (their kind) and by their index get
    their own masks and scales: the split computes what the whole model does."""
    model = _Model()
    x = torch.randn(2, 6, 3)
    with torch.no_grad():
        whole = model(x)
        carry = _spec(model).body()[0](BodyInput((x,), {}))
        split = _spec(model).body()(x)
    masks = [call_of(carry, i)[0][0] for i in range(4)]
    assert torch.equal(masks[0], masks[2]) and not torch.equal(masks[0], masks[1])
    assert [call_of(carry, i)[1]["scale"] for i in range(4)] == [1.0, 2.0, 3.0, 4.0]
    assert len([t for t in carry["shared"] if t is not None]) == 2  # two masks, once each
    torch.testing.assert_close(split, whole, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("flaw", "says"),
    [
        ("chained", "layer 1's argument 1 changes with what the layers before it compute"),
        ("between", "the forward changes the hidden state between layer 0 and layer 1"),
        ("post_reads", "it reads what 'embed' computes, which only earlier stages have"),
    ],
)
def test_the_guard_refuses_a_split_that_is_not_exact(flaw: str, says: str) -> None:
    with torch.no_grad(), pytest.raises(SplitError) as info:
        _spec(_Model(flaw)).body()(torch.randn(2, 6, 3))
    message = str(info.value)
    print(f"GUARD {flaw}: {message[:240]}")
    assert message.startswith(
        "the pipeline split of _Model would compute something else than the whole model on a "
        "micro-batch of new input shapes [[2, 6, 3]]"
    ), message
    assert says in message, message
    assert "check_split=False" in message
    if flaw == "post_reads":
        assert isinstance(info.value, ReadsBlanks) and info.value.paths == ["embed"]


def test_the_guard_proves_each_new_shape_once_and_catches_a_later_divergence() -> None:
    """A forward that is exact on short inputs and not on long ones trains on the short ones
    and stops at the first long one; a shape it proved is not proved again (the probe runs
    once per shape), and with the check off nothing is proved."""
    body = _spec(_Model("long")).body()
    runs = []
    first = body[0]
    original = first._run
    first._run = lambda *a, **k: runs.append(a[1]) or original(*a, **k)  # type: ignore[method-assign]
    with torch.no_grad():
        body(torch.randn(2, 4, 3))
        body(torch.randn(2, 4, 3))
        assert runs == ["capture", "probe", "capture"]
        with pytest.raises(
            SplitError, match=r"new input shapes \[\[2, 6, 3\]\]: the forward changes"
        ):
            body(torch.randn(2, 6, 3))
        model = _Model("long")
        x = torch.randn(2, 6, 3)
        split = _spec(model).body(check=False)(x)  # runs on, silently wrong: what the guard stops
        assert not torch.allclose(split, model(x))


class _Bias(nn.Module):
    """A layer that returns (hidden, bias): the first computes the bias, the others pass on the
    one they are given (as T5's layers do with their position bias)."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.table = nn.Parameter(torch.randn(4)) if first else None

    def forward(self, x: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if self.table is not None:
            bias = self.table * 0.5
        assert bias is not None
        return x + torch.tanh(self.linear(x) + bias), bias


class _Passes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, 4)
        self.layers = nn.ModuleList([_Bias(i == 0) for i in range(4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h, bias = self.embed(x), None
        for layer in self.layers:
            h, bias = layer(h, bias)
        return self.head(h)


def test_a_value_a_layer_passes_to_the_next_travels_with_the_hidden_state() -> None:
    """Watched once (the layers return a bias the forward passes on), the split carries each
    layer's bias to the next, with its gradient: forward and gradients equal the whole model's."""
    from lightning_pipe2bw.partition.observe import observe

    model = _Passes()
    x = torch.randn(2, 5, 3)
    spec = _spec(model)
    spec.observed = observe(model, "layers", lambda: model(x))
    assert spec.observed.forms == {0: 2} and spec.observed.markers == {0: (1,)}
    body = spec.body()
    reference = _Passes()
    reference(x).sum().backward()
    body(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-7, msg=name)


def test_what_a_released_part_keeps_is_its_attributes() -> None:
    """The model object of a stage keeps, for another stage's layer, a stand-in that raises
    when called and answers what the forward reads of the layer (its kind, its weight's dtype)
    from a meta-device skeleton."""
    model = _Model()
    body = _spec(model).body()
    release(model, [body[2]])  # layer 1's block
    kept = model.layers[1]
    assert isinstance(kept, Released)
    assert kept.kind == "local" and kept.linear.weight.dtype == torch.float32
    assert kept.linear.weight.is_meta
    with pytest.raises(RuntimeError, match="runs on another pipeline stage"):
        kept(torch.randn(1, 4))
