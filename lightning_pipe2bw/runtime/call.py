"""The arguments of a body call that takes any (a model's body: ``partition.pipemodel``), and
how a block that takes them (a model's head) gets them for one call."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["BodyInput", "call_input"]


@dataclass(frozen=True)
class BodyInput:
    """The arguments the user's step passed to a body that takes any call
    (``self.model(input_ids, labels=y)``, see ``partition.pipemodel``)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _unflatten_body_input(children: Iterable[Any], _: Any) -> BodyInput:
    args, kwargs = children
    return BodyInput(tuple(args), dict(kwargs))


# a pytree node: its tensors are found, copied and moved like those of a tuple or dict
pytree.register_pytree_node(
    BodyInput,
    lambda b: ([b.args, b.kwargs], None),
    _unflatten_body_input,
    serialized_type_name="lightning_pipe2bw.BodyInput",
)


@contextmanager
def call_input(block: nn.Module, call: Any) -> Iterator[None]:
    """Give a block that takes them (``takes_call_input``: a model's last block, its head) the
    step's own arguments for one call: on the last stage the body's input is the received
    activation, while the head needs the step's labels."""
    if not getattr(block, "takes_call_input", False):
        yield
        return
    previous = block.__dict__.get("call_input")
    block.__dict__["call_input"] = call if isinstance(call, BodyInput) else None
    try:
        yield
    finally:
        block.__dict__["call_input"] = previous
