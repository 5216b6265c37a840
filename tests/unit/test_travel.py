"""A block travels between processes pickled: a parametrized one (weight norm) as a copy without
its parametrizations beside their modules and originals (``repartition.travel``)."""

from __future__ import annotations

import pickle

import torch
from torch import nn

from lightning_pipe2bw.repartition.travel import packed, unpacked


def _block() -> nn.Module:
    torch.manual_seed(0)
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3), name="weight", dim=2)
    with torch.no_grad():
        conv.parametrizations.weight.original0.mul_(1.7)  # not what right_inverse would give
    block = nn.Sequential(nn.Linear(5, 5), conv)
    block[0] = nn.utils.parametrizations.orthogonal(block[0])
    return block


def test_a_parametrized_block_arrives_the_same_to_the_bit() -> None:
    block = _block()
    before = {k: v.clone() for k, v in block.state_dict().items()}
    arrived = unpacked(pickle.loads(pickle.dumps(packed(block))))
    x = torch.randn(2, 4, 5)
    assert torch.equal(arrived[1](x), block[1](x)) and torch.equal(arrived[0](x), block[0](x))
    assert list(arrived.state_dict()) == list(block.state_dict())
    assert all(
        torch.equal(a, b)
        for a, b in zip(arrived.state_dict().values(), before.values(), strict=True)
    )
    # weight_norm's hook for loading weight_g/weight_v state dicts came back with it
    assert len(arrived[1]._load_state_dict_pre_hooks) == len(block[1]._load_state_dict_pre_hooks)
    # and the block that stayed is untouched (the copy shares torch's class for it): its
    # forward above still read its weight, and its state is as it was
    assert all(
        torch.equal(a, b) for a, b in zip(block.state_dict().values(), before.values(), strict=True)
    )


def test_a_plain_block_travels_as_itself() -> None:
    block = nn.Linear(2, 2)
    assert packed(block) is block and unpacked(block) is block
