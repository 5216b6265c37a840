"""The block profiler: exact byte counts, time ordering, untouched model state, pytrees, errors."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_pipe2bw.planner.measure import NewStorages, profile_blocks, profile_sizes
from lightning_pipe2bw.planner.profile import BlockProfile, Profile, ProfileSet

torch.set_num_threads(1)

F32 = 4  # bytes per float32
B = 8


def mlp_body() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(16, 64),  # saves only its input (excluded) and weight (excluded)
        nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32)),  # saves h (B x 48) once
        nn.Sequential(nn.ReLU(), nn.Linear(32, 24)),  # ReLU saves its result, Linear the same
        nn.Sequential(nn.Linear(24, 40), nn.ReLU()),  # ReLU saves its result: the block output
    )


def linear_bytes(i: int, o: int) -> int:
    return (i * o + o) * F32


def test_bytes_are_exact() -> None:
    p = profile_blocks(mlp_body(), torch.randn(B, 16), warmup=0, repeats=1)
    assert p.microbatch_size == B and p.input_bytes == B * 16 * F32 and p.num_blocks == 4
    assert [b.name for b in p.blocks] == ["0", "1", "2", "3"]
    assert [b.output_bytes for b in p.blocks] == [B * w * F32 for w in (64, 32, 24, 40)]
    assert [b.saved_bytes for b in p.blocks] == [0, B * 48 * F32, B * 32 * F32, B * 40 * F32]
    assert [b.param_bytes for b in p.blocks] == [
        linear_bytes(16, 64),
        linear_bytes(64, 48) + linear_bytes(48, 32),
        linear_bytes(32, 24),
        linear_bytes(24, 40),
    ]
    assert p.device == "cpu" and p.repeats == 1
    assert p.meta["torch"] == torch.__version__ and p.meta["threads"] == torch.get_num_threads()


class Discards(nn.Module):
    """Builds a graph it throws away, then returns a view of a saved tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x: Tensor) -> Tensor:
        torch.exp(x * 3.0).sum()  # exp saves its result, but this graph dies in the forward
        h = torch.relu(self.fc(x))  # relu saves h (B x 32)
        return h[:, :8]


def test_dead_graphs_are_not_counted_and_views_keep_their_storage() -> None:
    p = profile_blocks([Discards()], torch.randn(B, 16), warmup=0, repeats=1)
    (block,) = p.blocks
    assert block.output_bytes == B * 8 * F32
    assert block.saved_bytes == B * 32 * F32  # the whole storage behind the saved h


def test_shared_parameters_count_once_per_block() -> None:
    lin = nn.Linear(20, 20)
    p = profile_blocks([nn.Sequential(lin, nn.Tanh(), lin)], torch.randn(B, 20), repeats=1)
    assert p.blocks[0].param_bytes == linear_bytes(20, 20)
    assert p.blocks[0].saved_bytes == B * 20 * F32  # tanh's result, also the second input


def test_saved_bytes_need_the_graph_even_under_no_grad() -> None:
    with torch.no_grad():
        p = profile_blocks(mlp_body(), torch.randn(B, 16), warmup=0, repeats=1)
    assert p.blocks[1].saved_bytes == B * 48 * F32 and p.blocks[1].backward_s > 0


def test_a_heavier_block_is_slower() -> None:
    width = 64
    light = nn.Linear(width, width)  # 64 * 64 MACs per row
    heavy = nn.Sequential(nn.Linear(width, 2048), nn.Linear(2048, width))  # 64x the MACs
    p = profile_blocks([light, heavy, nn.Linear(width, width)], torch.randn(64, width), repeats=7)
    assert all(b.forward_s > 0 and b.backward_s > 0 for b in p.blocks)
    assert p.blocks[1].forward_s > p.blocks[0].forward_s
    assert p.blocks[1].backward_s > p.blocks[0].backward_s
    assert p.blocks[1].forward_s > p.blocks[2].forward_s


class ModeProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 12)
        self.seen: list[bool] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(self.training)
        return self.fc(x)


def stateful_body() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Dropout(0.5), ModeProbe(), nn.Linear(12, 3)
    )


def test_model_state_is_untouched() -> None:
    body = stateful_body()
    body.eval()
    body[2].train()  # a mixed state must come back as it was
    grad = torch.full_like(body[0].weight, 0.25)
    body[0].weight.grad = grad
    before = {k: v.clone() for k, v in body.state_dict().items()}
    modes = [m.training for m in body.modules()]
    sample = torch.randn(B, 6)
    rng = torch.get_rng_state()
    p = profile_blocks(body, sample, warmup=1, repeats=2)
    assert body[3].seen and all(body[3].seen)  # measured in train mode
    assert [m.training for m in body.modules()] == modes
    for k, v in body.state_dict().items():  # parameters and batch-norm running statistics
        assert torch.equal(v, before[k]), k
    assert body[0].weight.grad is grad and torch.equal(grad, torch.full_like(grad, 0.25))
    assert all(q.grad is None for name, q in body.named_parameters() if name != "0.weight")
    assert torch.equal(torch.get_rng_state(), rng)
    assert p.blocks[1].param_bytes == 2 * 12 * F32  # affine weight and bias, not the buffers


def test_json_round_trip() -> None:
    p = profile_blocks(mlp_body(), torch.randn(B, 16), repeats=2)
    q = Profile.from_json(p.to_json())
    assert q == p and q.meta == p.meta


class Tag(nn.Module):
    """Returns a dict with a float tensor and an integer mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 10)

    def forward(self, xs: tuple[Tensor, Tensor]) -> dict[str, Any]:
        x, scale = xs
        h = self.fc(x) * scale
        return {"h": h, "mask": (h > 0).long(), "note": "plain values pass through"}


class Untag(nn.Module):
    def forward(self, d: dict[str, Any]) -> Tensor:
        return d["h"] * d["mask"]  # saves only the mask (its input): the mask needs no grad


def test_pytree_inputs_and_outputs() -> None:
    sample = (torch.randn(B, 10), torch.randn(B, 1))
    p = profile_blocks([Tag(), Untag()], sample, names=["tag", "untag"], repeats=2)
    assert p.microbatch_size == B and p.input_bytes == B * 10 * F32 + B * F32
    tag, untag = p.blocks
    assert (tag.name, untag.name) == ("tag", "untag")
    assert tag.output_bytes == B * 10 * F32 + B * 10 * 8  # float32 h and int64 mask
    assert tag.saved_bytes == B * 10 * F32  # fc's output, saved by the mul with scale
    assert untag.saved_bytes == 0 and untag.output_bytes == B * 10 * F32
    assert untag.backward_s > 0


class Bucket(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return (x > 0).long() + (x > 1).long()


def test_integer_outputs_get_no_backward() -> None:
    body = nn.Sequential(Bucket(), nn.Embedding(3, 16), nn.Linear(16, 4))
    p = profile_blocks(body, torch.randn(B, 5), repeats=2)
    bucket, embed, lin = p.blocks
    assert bucket.backward_s == 0 and bucket.output_bytes == B * 5 * 8 and bucket.saved_bytes == 0
    assert embed.backward_s > 0 and embed.saved_bytes == 0  # only its (integer) input is saved
    assert embed.output_bytes == B * 5 * 16 * F32 and embed.param_bytes == 3 * 16 * F32
    assert lin.backward_s > 0 and body[1].weight.grad is None


def test_profile_sizes_scale_linearly() -> None:
    body = mlp_body()
    ps = profile_sizes(body, lambda b: torch.randn(b, 16), [8, 2, 4], repeats=2)
    assert isinstance(ps, ProfileSet) and ps.sizes == (2, 4, 8)
    small, large = ps.at(2), ps.at(8)
    assert ps.at(4) is ps.profiles[1]
    assert large.input_bytes == 4 * small.input_bytes
    for s, g in zip(small.blocks, large.blocks, strict=True):
        assert g.output_bytes == 4 * s.output_bytes and g.saved_bytes == 4 * s.saved_bytes
        assert g.param_bytes == s.param_bytes
    mid = ps.at(6)
    assert mid.microbatch_size == 6 and mid.blocks[1].saved_bytes == 6 * 48 * F32
    assert ProfileSet.from_json(ps.to_json()) == ps


def test_names_follow_the_sequential() -> None:
    body = nn.Sequential(OrderedDict(inp=nn.Linear(4, 4), out=nn.Linear(4, 2)))
    p = profile_blocks(body, torch.randn(3, 4), warmup=0, repeats=1)
    assert [b.name for b in p.blocks] == ["inp", "out"]


def test_clear_errors() -> None:
    body = mlp_body()
    with pytest.raises(TypeError, match="sample"):
        profile_blocks(body, "not a tensor")
    with pytest.raises(TypeError, match="sample"):
        profile_blocks(body, {"a": 1, "b": [2.0]})
    with pytest.raises(TypeError, match="sample"):
        profile_blocks(body, torch.tensor(1.0))  # no micro-batch dimension
    with pytest.raises(TypeError, match="block 1"):
        profile_blocks([nn.Linear(16, 4), "relu"], torch.randn(B, 16))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="names"):
        profile_blocks(body, torch.randn(B, 16), names=["a", "b"])
    with pytest.raises(ValueError, match="repeats"):
        profile_blocks(body, torch.randn(B, 16), repeats=0)
    with pytest.raises(ValueError, match="at least one"):
        profile_blocks([], torch.randn(B, 16))
    with pytest.raises(ValueError, match="block 0 has tensors on the meta device"):
        profile_blocks([nn.Linear(4, 4, device="meta")], torch.randn(2, 4), device="cpu")
    with pytest.raises(ValueError, match="make_sample"):
        profile_sizes(body, lambda b: torch.randn(2 * b, 16), [2])


def test_a_failing_block_names_its_index_and_restores_the_model() -> None:
    body = nn.Sequential(nn.Linear(16, 8), nn.Linear(9, 4))  # block 1 cannot take block 0's output
    body.eval()
    body[0].weight.grad = None
    with pytest.raises(ValueError, match=r"block 1 \('1'\) failed") as info:
        profile_blocks(body, torch.randn(B, 16))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not any(m.training for m in body.modules())
    assert all(q.grad is None for q in body.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profiles_a_cpu_model_and_moves_it_back() -> None:
    body = mlp_body()
    before = {k: v.clone() for k, v in body.state_dict().items()}
    p = profile_blocks(body, torch.randn(B, 16), device="cuda", repeats=2)
    assert p.device == "cuda" and "device_name" in p.meta
    assert [b.saved_bytes for b in p.blocks] == [0, B * 48 * F32, B * 32 * F32, B * 40 * F32]
    assert all(q.device.type == "cpu" and q.grad is None for q in body.parameters())
    for k, v in body.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_update_times_leave_the_blocks_alone_and_scale_with_parameters() -> None:
    """The update is timed on copies: the blocks' weights and ``.grad`` stay as they were; a
    block 64x larger takes longer; a block without parameters costs nothing."""
    from lightning_pipe2bw.planner.measure import update_times

    torch.manual_seed(0)
    small, large, empty = nn.Linear(16, 16), nn.Linear(512, 512), nn.ReLU()
    before = {k: v.clone() for k, v in large.state_dict().items()}
    times = update_times(
        [small, large, empty], lambda ps: torch.optim.AdamW(ps, lr=0.1), warmup=2, repeats=9
    )
    assert times[2] == 0.0
    assert times[1] > times[0] > 0.0
    assert all(torch.equal(v, large.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in large.parameters())


def test_profile_sizes_records_the_update_in_every_size() -> None:
    body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    profiles = profile_sizes(
        body, lambda b: torch.randn(b, 8), [2, 4], optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)
    )
    for profile in profiles.profiles:
        assert profile.blocks[0].update_s > 0 and profile.blocks[1].update_s == 0.0
    assert profiles.at(3).blocks[0].update_s == profiles.profiles[0].blocks[0].update_s


class AddOne(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        x += 1.0
        return x


class InputRecorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.seen: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(x.detach().clone())
        return self.fc(x)


def test_in_place_blocks_are_profiled_on_copies() -> None:
    """Blocks that modify their input in place (a received activation is a leaf that requires
    grad) are profiled, forward and backward, on copies: the sample and every later block's
    input are the same in every run."""
    body = nn.Sequential(
        nn.ReLU(inplace=True), AddOne(), InputRecorder(), nn.ReLU(inplace=True), nn.Linear(6, 3)
    )
    sample = torch.randn(B, 6)
    kept = sample.clone()
    p = profile_blocks(body, sample, warmup=1, repeats=2)
    assert torch.equal(sample, kept)
    expected = kept.relu() + 1.0
    # measuring bytes (a forward, and one more for what the cut backward keeps), then warm-up
    # and timed runs with one backward and with the cut one
    assert len(body[2].seen) == 2 + 2 * (1 + 2)
    assert all(torch.equal(x, expected) for x in body[2].seen)
    assert p.blocks[0].saved_bytes == 0  # the in-place ReLU saves its input's storage
    assert p.blocks[4].backward_s > 0


class Twice(nn.Module):
    """A layer applied to its own output: its weight's gradient has two owners on the input
    path, which the split of a backward refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.fc(x))


class Counted(nn.Linear):
    calls = 0

    def forward(self, x: Tensor) -> Tensor:
        Counted.calls += 1
        return super().forward(x)


def test_the_backward_cut_in_two_is_timed_per_block() -> None:
    """``input_grad_s`` and ``weight_grad_s`` time the inputs' and the weights' pass of each
    block's backward cut in two. A block on token ids (no input gradient) has only the weights'
    pass, its whole backward; a block the cut refuses runs whole in its inputs' pass."""
    body = nn.Sequential(
        nn.Embedding(32, 16), nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)),
        Twice(),
    )  # fmt: skip
    p = profile_blocks(body, torch.randint(0, 32, (B, 4)), warmup=1, repeats=3)
    embed, mlp, twice = p.blocks
    assert embed.input_grad_s == 0.0 and embed.weight_grad_s == embed.backward_s > 0
    assert mlp.input_grad_s > 0 and mlp.weight_grad_s > 0
    assert twice.input_grad_s > 0 and twice.weight_grad_s == 0.0
    assert mlp.split_times == (mlp.input_grad_s, mlp.weight_grad_s)
    # kept through JSON, scaled with the micro-batch size; unmeasured: halves of the backward
    again = Profile.from_json(p.to_json())
    assert again.blocks[1].split_times == mlp.split_times
    doubled = ProfileSet.of(p).at(2 * B).blocks[1]
    assert doubled.input_grad_s == pytest.approx(2 * mlp.input_grad_s)
    legacy = BlockProfile("x", 1.0, 3.0, 0, 0, 0)
    assert legacy.split_times == (1.5, 1.5)
    with pytest.raises(ValueError, match="input_grad_s must be >= 0"):
        BlockProfile("x", 1.0, 3.0, 0, 0, 0, input_grad_s=-1.0)


def test_small_blocks_are_timed_for_at_least_min_time_s() -> None:
    """``min_time_s`` adds timed runs (up to 10 x ``repeats``) while the runs have taken less."""
    Counted.calls = 0
    profile_blocks([Counted(4, 4)], torch.randn(B, 4), warmup=0, repeats=2)
    few = Counted.calls  # measuring bytes (two forwards), then 2 runs whole and 2 cut
    Counted.calls = 0
    profile_blocks([Counted(4, 4)], torch.randn(B, 4), warmup=0, repeats=2, min_time_s=60.0)
    assert (few, Counted.calls) == (2 + 2 + 2, 2 + 20 + 20)
    with pytest.raises(ValueError, match="min_time_s must be a number of seconds >= 0"):
        profile_blocks([Counted(4, 4)], torch.randn(B, 4), min_time_s=-1.0)


def test_new_storages_counts_what_operators_create_and_keep() -> None:
    """Each storage an operator creates counts while it lives; a view or an in-place result
    of an input's storage does not count again; ``peak`` is the most at once."""
    before = torch.ones(256)  # made outside: never counted
    with NewStorages() as new:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # 8000 live
        view = b.view(-1)
        b.add_(1)  # in place: nothing new
        before.mul_(2)
        del a
        c = torch.ones(500)  # a freed: 4000 + 2000
    assert (new.now, new.peak) == (6000, 8000)
    assert view.numel() == c.numel() * 2


def test_a_blocks_backward_and_cut_bytes_are_measured() -> None:
    """``backward_bytes``: what a block's backward allocates and holds at once (at least the
    gradient of its input, at most that and its weights' gradients before they are added in);
    ``cut_bytes``: what its backward cut in two keeps between the passes (the gradient flowing
    into the linear layer's node), 0 for a block whose input needs no gradient (nothing to
    cut: an embedding); both scale with the micro-batch and survive JSON."""
    body = nn.Sequential(nn.Embedding(32, 6), nn.Linear(6, 6), nn.Linear(6, 3))
    p = profile_blocks(body, torch.randint(0, 32, (B, 4)), warmup=0, repeats=1)
    embed, middle, last = p.blocks
    grad_input = B * 4 * 6 * 4
    assert grad_input <= middle.backward_bytes <= grad_input + (36 + 6) * 4
    assert middle.cut_bytes == B * 4 * 6 * 4  # the gradient of its output, kept for W
    assert last.cut_bytes == B * 4 * 3 * 4
    assert embed.cut_bytes == 0 and embed.backward_bytes > 0  # its weight's gradient
    again = Profile.from_json(p.to_json())
    assert again.blocks[1].backward_bytes == middle.backward_bytes
    doubled = ProfileSet.of(p).at(2 * B).blocks[1]
    assert (doubled.backward_bytes, doubled.cut_bytes) == (2 * middle.backward_bytes, 2 * middle.cut_bytes)
