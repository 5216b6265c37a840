"""``StepValues`` travels like the dict it replaced: the channel reaches every tensor in it (to
move a device's tensors to the host before pickling) and its pickler brings them back bitwise."""

from __future__ import annotations

import io
import pickle

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from lightning_pipe2bw.runtime.channel import _Pickler
from lightning_pipe2bw.steps.values import StepValues


def _values() -> StepValues:
    return StepValues(
        loss=torch.tensor(1.5, dtype=torch.float64),
        extra={"acc": torch.arange(3.0)},
        logs=[("train_loss", torch.tensor(2.0, dtype=torch.float64), {"prog_bar": True}, False)],
        appended={("outputs", None): [torch.ones(2)]},
        metrics={},
        batch="fingerprint",
        requeue=7,
    )


def test_the_channel_reaches_every_tensor_of_the_step_values() -> None:
    seen: list[Tensor] = []
    mapped = pytree.tree_map_only(Tensor, lambda t: seen.append(t) or t + 1, _values())
    assert isinstance(mapped, StepValues) and len(seen) == 4
    assert mapped.loss is not None and float(mapped.loss) == 2.5
    assert mapped.batch == "fingerprint" and mapped.requeue == 7 and mapped.output is None


def test_step_values_pickle_bitwise_through_the_channel() -> None:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(_values())
    back = pickle.loads(buffer.getvalue())
    assert isinstance(back, StepValues)
    torch.testing.assert_close(back.extra, _values().extra, rtol=0, atol=0)
    assert (
        back.logs == _values().logs and back.loss is not None and back.loss.dtype == torch.float64
    )
