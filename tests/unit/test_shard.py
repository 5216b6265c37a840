"""Which replica owns each parameter when the optimizer state is sharded (``shard_optimizer``):
every parameter whole, the shares balanced by size (the collective parts run in
``tests/ranks/test_shard_optimizer.py``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_pipe2bw import MuonAdamW, Pipe2BWStrategy
from lightning_pipe2bw.optim.shard import assign_owners, shard_problem
from lightning_pipe2bw.recipes.gpt import GPT


@given(
    sizes=st.lists(st.integers(min_value=1, max_value=10_000), min_size=1, max_size=60),
    replicas=st.integers(min_value=1, max_value=8),
)
def test_every_parameter_has_one_owner_and_the_shares_are_within_the_largest(
    sizes: list[int], replicas: int
) -> None:
    owner = assign_owners(sizes, replicas)
    assert len(owner) == len(sizes) and all(0 <= r < replicas for r in owner)
    load = [sum(s for s, r in zip(sizes, owner, strict=True) if r == k) for k in range(replicas)]
    assert sum(load) == sum(sizes)
    # largest first to the least loaded: no share exceeds the even share by more than the
    # largest parameter, and none is further apart from another than that
    assert max(load) - min(load) <= max(sizes)
    assert owner == assign_owners(sizes, replicas)  # every rank computes the same


def test_muon_matrices_go_whole_and_balanced_over_the_replicas() -> None:
    """MuonAdamW orthogonalises each matrix whole: a replica owns whole matrices, and over a GPT
    stage's matrices the two shares are within 10% of each other."""
    model = GPT(n_layer=4, n_embd=128, n_head=4, block_size=128)
    optimizer = MuonAdamW.for_module(model.body[1:3], lr=1e-2)  # a stage of two blocks
    params = [p for g in optimizer.param_groups for p in g["params"]]
    owner = assign_owners([p.numel() for p in params], 2)
    muon = {id(p) for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    shares = [0, 0]
    for p, r in zip(params, owner, strict=True):
        if id(p) in muon:
            shares[r] += p.numel()
    assert min(shares) > 0 and max(shares) / min(shares) <= 1.1, shares


def test_an_optimizer_that_spans_its_parameters_is_refused() -> None:
    lbfgs = torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(3))])
    problem = shard_problem(lbfgs)
    assert problem is not None and "LBFGS" in problem and "shard_optimizer=False" in problem
    assert shard_problem(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"shard_optimizer": True},
            "but data_parallel=1 gives each stage one; use data_parallel=2",
        ),
        (
            {"shard_optimizer": True, "data_parallel": 2, "repartition_every": 10},
            "shard_optimizer=True with repartition_every=10",
        ),
    ],
)
def test_sharding_without_replicas_or_with_moving_blocks_is_refused(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Pipe2BWStrategy(**kwargs)  # type: ignore[arg-type]
