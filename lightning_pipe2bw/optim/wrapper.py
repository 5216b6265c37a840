"""The base of the strategy's optimizer wrappers: what Lightning and the user's code read through
a wrapper (param groups, state, defaults, checkpoints) is the wrapped optimizer's own."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

__all__ = ["WrappedOptimizer", "unwrap_optimizer"]


class WrappedOptimizer(Optimizer):
    """An optimizer that steps ``self.optimizer`` (the user's, or another wrapper) its own way
    and hands everything else to it: a scheduler, Lightning's clipping and the loss scaler work
    on the wrapped optimizer's param groups and state."""

    def __init__(self, optimizer: Optimizer) -> None:
        # no super().__init__: the wrapped optimizer owns the param groups and the state
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The user's optimizer inside any of the strategy's wrappers."""
    while isinstance(optimizer, WrappedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer
