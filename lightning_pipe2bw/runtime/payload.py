"""What travels between stages, and what a backward needs of it: the tensors that take a
gradient, the gradients to send, the hand-over between two stages of one rank, the loss of a
step's output, and whether a backward graph can be cut in two."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.utils import _pytree as pytree

from lightning_pipe2bw.runtime.inplace import Alias

__all__ = [
    "StepFn",
    "batch_signature",
    "custom_functions",
    "detach_all",
    "filled",
    "global_backward_hooks",
    "grad_leaves",
    "handed_over",
    "is_compiled_function",
    "loss_of",
    "received_grads",
    "step_loss",
]

# the user's step (training_step & co.) applied to one micro-batch
StepFn = Callable[[Any], Any]


def grad_leaves(payload: Any) -> list[Tensor]:
    return [x for x in pytree.tree_leaves(payload) if isinstance(x, Tensor) and x.requires_grad]


def batch_signature(microbatch: Any) -> tuple[tuple[int, ...], ...]:
    """The shapes of a micro-batch's tensors: what every stage must agree on."""
    return tuple(tuple(t.shape) for t in pytree.tree_leaves(microbatch) if isinstance(t, Tensor))


def loss_of(result: Any, microbatch: int) -> Tensor:
    loss = step_loss(result, microbatch)
    if not loss.requires_grad:
        raise ValueError(
            f"the loss of micro-batch {microbatch} does not require grad: compute it from the output "
            "of the pipeline body (self.body(x) / self(x)) without detaching it"
        )
    return loss


def step_loss(result: Any, microbatch: int) -> Tensor:
    """The loss in a training step's output: the tensor itself or its ``"loss"`` entry."""
    loss = result.get("loss") if isinstance(result, dict) else result
    if not isinstance(loss, Tensor):
        raise TypeError(
            "with pipe2bw, training_step must return the loss tensor (or a dict with a 'loss' tensor) "
            f"for every micro-batch; micro-batch {microbatch} returned {type(result).__name__}"
        )
    return loss


def received_grads(outputs: Any, grads_in: Any) -> tuple[list[Tensor], list[Tensor]]:
    """A stage before the last: its outputs that require grad and the gradients the next stage
    sent for them (an output without one, which did not reach the loss, is left out)."""
    pairs = [
        (o, g) for o, g in zip(grad_leaves(outputs), grads_in, strict=True)
        if g is not None
    ]  # fmt: skip
    return [o for o, _ in pairs], [g for _, g in pairs]


def filled(grads: Sequence[Tensor | None], leaves: Sequence[Tensor]) -> list[Tensor]:
    """The gradients of the stage's inputs to send, zeros where an input got none."""
    return [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, leaves, strict=True)]


def global_backward_hooks() -> bool:
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks)


def custom_functions(roots: Sequence[Tensor]) -> list[type]:
    """The Python ``autograd.Function`` classes in the backward graph under ``roots``, other
    than the engine's own alias of a received activation (whose backward only passes the
    gradient on)."""
    found: list[type] = []
    seen: set[Any] = set()
    todo = [t.grad_fn for t in roots if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if isinstance(node, BackwardCFunction) and node._forward_cls is not Alias:  # type: ignore[attr-defined]
            found.append(node._forward_cls)  # type: ignore[attr-defined]
        todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return found


def is_compiled_function(cls: type) -> bool:
    """Whether ``cls`` is the function of a ``torch.compile``d region (AOTAutograd's
    ``CompiledFunction``: one node that computes every gradient of the region in one call)."""
    return cls.__name__ == "CompiledFunction" and cls.__module__.startswith("torch._functorch")


def handed_over(payload: Any) -> Any:
    """What the next stage on the same rank receives: what a transport would deliver (a copy,
    whose tensors that required grad are leaves that require grad), so that each stage's
    backward stops at its inputs as it does across ranks, and the next stage may modify its
    input in place without touching what this stage saved."""

    def copy(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        return x.detach().clone().requires_grad_(x.requires_grad)

    return pytree.tree_map(copy, payload)


def detach_all(payload: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, payload)
