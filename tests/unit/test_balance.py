"""Balance modes: the exact partitioner they rest on finds the best contiguous split, and bad
modes are refused. ``balance="params"`` and ``"uniform"`` on real ranks:
``tests/ranks/test_balance.py``."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pipe2bw.partition.balance import balance_by_weights, stage_loads
from lightning_pipe2bw.partition.cost import block_flops, multiplied_parameters
from lightning_pipe2bw.runtime.call import BodyInput
from lightning_pipe2bw.schedule import placement_of


def _brute_force(weights: list[float], stages: int) -> float:
    n, best = len(weights), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_partition_is_optimal_on_random_weights() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        weights = [rng.choice([0, 1, 2, 5, 13]) * rng.random() for _ in range(n)]
        balance = balance_by_weights(weights, stages)
        assert len(balance) == stages and sum(balance) == n and min(balance) >= 1
        bounds = [0, *itertools.accumulate(balance)]
        heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        assert heaviest == pytest.approx(_brute_force(weights, stages)), (weights, stages, balance)


def test_partition_examples() -> None:
    assert balance_by_weights([1] * 8, 2) == (4, 4)
    assert balance_by_weights([1] * 7, 2) == (3, 4)  # the extra block goes to a later stage
    assert balance_by_weights([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == (1, 8)


def test_partition_errors() -> None:
    with pytest.raises(ValueError, match="the body has 2 blocks but the pipeline has 3 stages"):
        balance_by_weights([1, 1], 3)
    with pytest.raises(ValueError, match="block weights must be >= 0"):
        balance_by_weights([1, -1], 2)


def test_unknown_balance_mode_is_refused() -> None:
    from lightning_pipe2bw import Pipe2BWStrategy

    with pytest.raises(ValueError, match="balance='time' is not a balance mode"):
        Pipe2BWStrategy(balance="time")  # type: ignore[arg-type]


# ------------------------------------------------------------------ the default split's costs


def _language_body(blocks: int, width: int = 32, vocab: int = 64, seq: int = 16) -> nn.Sequential:
    """[embedding, N pre-LN blocks, LN + head]: the shape of nearly every language model."""
    from lightning_pipe2bw.recipes.gpt.model import Block, Embeddings, LMHead

    torch.manual_seed(0)
    return nn.Sequential(
        Embeddings(vocab, seq, width), *[Block(width, 2) for _ in range(blocks)],
        LMHead(width, vocab),
    )  # fmt: skip


def test_multiplied_parameters_leave_out_embedding_tables() -> None:
    body = _language_body(2)
    counts = multiplied_parameters(list(body.children()))
    assert counts[0] == 0  # token and position tables are looked up
    block = sum(p.numel() for p in body[1].parameters())
    assert counts[1] == counts[2] == block
    assert counts[3] == sum(p.numel() for p in body[3].parameters())  # norm and projection
    # a head tied to the embedding multiplies the shared table: counted there, once
    emb, head = nn.Embedding(64, 8), nn.Linear(8, 64, bias=False)
    head.weight = emb.weight
    assert multiplied_parameters([emb, nn.Sequential(nn.LayerNorm(8), head)]) == [0, 16 + 512]
    # a table held as a raw parameter of a module that is not an embedding counts
    assert multiplied_parameters([nn.Bilinear(2, 3, 4)]) == [2 * 3 * 4 + 4]


@pytest.mark.parametrize("on_meta", [False, True])
def test_block_flops_count_matrix_products_per_block(on_meta: bool) -> None:
    body = _language_body(3)
    if on_meta:
        body = body.to("meta")
    call = BodyInput((torch.randint(0, 64, (4, 16)),), {})
    flops = block_flops(body, call)
    assert flops is not None and len(flops) == 5
    assert flops[0] == 0.0  # a lookup
    assert flops[1] == flops[2] == flops[3] > 0
    # the head: one (4 x 16, 32) x (32, 64) product
    assert flops[4] == 2 * 4 * 16 * 32 * 64


class _ReadsValues(nn.Module):
    """A block whose forward reads a tensor's value (meta cannot run it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if bool(x.sum() > -1e9) else x


def test_block_flops_run_on_the_own_device_where_meta_cannot() -> None:
    body = nn.Sequential(_ReadsValues(), nn.Linear(8, 16))
    before = [p.clone() for p in body.parameters()]
    flops = block_flops(body, BodyInput((torch.randn(3, 8),), {}))
    assert flops == [2 * 3 * 8 * 8, 2 * 3 * 8 * 16]
    assert all(torch.equal(a, b) for a, b in zip(before, body.parameters(), strict=True))
    # nothing counted (no matrix product) and a forward that fails both ways: None
    assert block_flops(nn.Sequential(nn.ReLU(), nn.Tanh()), BodyInput((torch.randn(2),), {})) is None
    assert block_flops(nn.Sequential(nn.Linear(8, 8)), BodyInput((torch.randn(2, 5),), {})) is None


def _rank_max(weights: list[float], balance: tuple[int, ...], placement: tuple[int, ...]) -> float:
    return max(stage_loads(weights, balance, placement))


def _brute_rank_max(weights: list[float], stages: int, placement: tuple[int, ...]) -> float:
    n, best = len(weights), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        balance = tuple(b - a for a, b in itertools.pairwise((0, *cuts, n)))
        best = min(best, _rank_max(weights, balance, placement))
    return best


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_ranks_holding_several_stages_are_evened_out(schedule: str, ranks: int) -> None:
    """[embedding, N equal blocks, head] with several stages per rank: the heaviest rank is as
    light as any contiguous split makes it (brute force), for every N the stages fit."""
    placement = placement_of(schedule, ranks)
    assert placement is not None
    for n in range(2 * ranks, 2 * ranks + 7):
        weights = [0.0] + [1.0] * n + [0.17]
        balance = balance_by_weights(weights, 2 * ranks, placement)
        assert sum(balance) == n + 2 and min(balance) >= 1
        assert _rank_max(weights, balance, placement) == pytest.approx(
            _brute_rank_max(weights, 2 * ranks, placement)
        ), (n, balance)


def test_several_stages_per_rank_never_worse_than_the_per_stage_split() -> None:
    rng = random.Random(1)
    for _ in range(200):
        ranks = rng.randint(2, 3)
        n = rng.randint(2 * ranks, 9)
        weights = [rng.choice([0, 1, 2, 5]) * rng.random() for _ in range(n)]
        placement = placement_of(rng.choice(["zb-v", "interleaved-1f1b"]), ranks)
        assert placement is not None
        per_stage = balance_by_weights(weights, 2 * ranks)
        balance = balance_by_weights(weights, 2 * ranks, placement)
        assert sum(balance) == n and min(balance) >= 1
        assert _rank_max(weights, balance, placement) <= _rank_max(weights, per_stage, placement)


def _split(body: nn.Module, schedule: str, ranks: int, call: BodyInput | None = None, **options: Any) -> Any:
    from lightning_pipe2bw import Pipe2BWStrategy
    from lightning_pipe2bw.partition.split import BodyRef
    from lightning_pipe2bw.pipeline.assembly import resolve_split
    from lightning_pipe2bw.pipeline.topology import Topology

    holder = nn.Module()
    holder.body = body
    strategy = Pipe2BWStrategy(schedule=schedule, **options)
    topology = Topology.for_schedule(ranks, 1, 0, schedule)
    return resolve_split(strategy.options, BodyRef(holder, "body", "body", call), topology, None, None)


@pytest.mark.parametrize("schedule", ["1f1b", "2bw", "interleaved-1f1b", "zb-v", "dualpipe-v"])
@pytest.mark.parametrize("ranks", [2, 4, 8, 16])
def test_the_default_split_evens_out_a_language_model(schedule: str, ranks: int) -> None:
    """The default cuts [embedding, N blocks, head] as torch and Megatron do where N divides
    evenly (the N blocks evenly, the embedding on the first stage, the head on the last) and
    keeps every rank within 10% of the others' modelled cost from 2 blocks a stage on (the head
    here costs a sixth of a block: a head that costs more keeps its stage heavier in any
    contiguous split, and the split found is then the least heavy one, as the tests above
    show)."""
    stages = ranks * (1 if schedule in ("1f1b", "2bw") else 2)
    for per_stage in (1, 2, 3):
        body = _language_body(per_stage * stages)
        split = _split(body, schedule, ranks)
        hand = [per_stage] * stages
        hand[0], hand[-1] = hand[0] + 1, hand[-1] + 1
        assert split.balance == tuple(hand)
        assert split.rule == "parameters that multiply"
        if per_stage >= 2:
            assert max(split.loads) / min(split.loads) <= 1.10, split.describe()
        # the old default (even module counts) gave one stage an extra block
        if stages > 2:
            even = _split(body, schedule, ranks, balance="uniform")
            assert even.balance != split.balance and "uniform" in even.rule


def test_the_default_split_is_the_given_one_when_given_and_says_its_rule() -> None:
    body = _language_body(8)
    given = _split(body, "1f1b", 4, balance=[4, 2, 2, 2])
    assert given.balance == (4, 2, 2, 2) and given.rule == "given (balance)"
    assert given.describe() == "split: given (balance)"
    params = _split(body, "1f1b", 4, balance="params")
    assert params.rule == "parameter counts (params)"
    default = _split(body, "1f1b", 4)
    assert default.describe().startswith("split: parameters that multiply; modelled cost of each")
    # with the body's call at hand (a model learnt from its forward), FLOPs
    call = BodyInput((torch.randint(0, 64, (2, 16)),), {})
    counted = _split(body, "1f1b", 4, call)
    assert counted.rule == "forward FLOPs on the first micro-batch"
    assert counted.balance == (3, 2, 2, 3)
