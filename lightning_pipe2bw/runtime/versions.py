"""PipeDream-2BW's double-buffered weights, and the optimizer wrapper that applies delayed updates."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["TwoBWOptimizer", "WeightVersions"]


class WeightVersions:
    """A stage's weight versions in two buffers, and the tensors autograd sees per batch.

    Version v is the weights after v updates. Batch t runs its forwards and backwards with
    version ``max(t - 1, 0)``. The module's parameters (the ones the user's optimizer holds)
    always alias the *newest* version's buffer; in-flight micro-batches never see the
    parameters themselves but per-batch leaf tensors that alias their version's buffer, so:

    * an update is applied in place to the parameters only after they are re-pointed to the
      buffer that no in-flight batch uses (copy newest -> free buffer, then step it), and the
      graphs of in-flight micro-batches keep reading the buffer they started with;
    * every batch accumulates its gradient into its own leaves, even when two batches share a
      version (batches 0 and 1 both run with version 0).

    Memory: two copies of the stage's weights, never more (:meth:`advance` checks it).
    """

    def __init__(self, named_parameters: list[tuple[str, nn.Parameter]]) -> None:
        self.names = [name for name, _ in named_parameters]
        self.params = [param for _, param in named_parameters]
        self._buffers: list[list[Tensor]] = [[p.data for p in self.params]]
        self._buffer_of: dict[int, int] = {0: 0}  # version -> buffer index
        self.newest = 0
        self._leaves: dict[int, dict[str, Tensor]] = {}  # batch -> leaves

    @staticmethod
    def version_for(batch: int) -> int:
        return max(batch - 1, 0)

    def weights_for(self, batch: int) -> dict[str, Tensor]:
        """The leaf tensors batch ``batch`` computes with (created on first use)."""
        leaves = self._leaves.get(batch)
        if leaves is None:
            version = self.version_for(batch)
            if version not in self._buffer_of:
                raise RuntimeError(
                    f"batch {batch} needs weight version {version}, but this stage holds versions "
                    f"{sorted(self._buffer_of)}: updates were applied out of order"
                )
            buffer = self._buffers[self._buffer_of[version]]
            leaves = {
                name: t.detach().requires_grad_(p.requires_grad)
                for name, t, p in zip(self.names, buffer, self.params, strict=True)
            }
            self._leaves[batch] = leaves
        return leaves

    def grads_of(self, batch: int) -> list[Tensor | None]:
        leaves = self._leaves.get(batch, {})
        return [leaves[name].grad if name in leaves else None for name in self.names]

    def release(self, batch: int) -> None:
        """Batch ``batch`` has finished every backward on this stage."""
        self._leaves.pop(batch, None)

    def live_versions(self) -> set[int]:
        """Versions some in-flight batch still needs, plus the newest."""
        return {self.version_for(b) for b in self._leaves} | {self.newest}

    def advance(self) -> None:
        """Make room for version ``newest + 1``: copy the newest weights into the other buffer
        and point the parameters at it, so the optimizer's in-place step leaves every version an
        in-flight batch uses untouched."""
        current = self._buffer_of[self.newest]
        free = 1 - current
        busy = {self._buffer_of[v] for v in self.live_versions() if v in self._buffer_of}
        if free in busy:
            raise RuntimeError(
                "2BW would need a third weight version: an update was applied while two batches "
                f"with different versions were in flight (live versions {sorted(self.live_versions())})"
            )
        if len(self._buffers) == 1:
            self._buffers.append([torch.empty_like(t) for t in self._buffers[0]])
        with torch.no_grad():
            for dst, src in zip(self._buffers[free], self._buffers[current], strict=True):
                dst.copy_(src)
        for param, t in zip(self.params, self._buffers[free], strict=True):
            param.data = t
        self._buffer_of = {self.newest: current, self.newest + 1: free}
        self.newest += 1

    def state(self) -> dict[str, Any]:
        """Plain data for checkpoints: the previous version's weights (the newest are the
        parameters), by parameter name."""
        previous = self.newest - 1
        if previous not in self._buffer_of:
            return {"newest": self.newest, "previous": None}
        buf = self._buffers[self._buffer_of[previous]]
        return {"newest": self.newest, "previous": dict(zip(self.names, buf, strict=True))}


class TwoBWOptimizer(Optimizer):
    """Wraps the user's optimizer for PipeDream-2BW; Lightning steps it once per batch.

    In the step for batch t, the gradient in the parameters' ``.grad`` is batch t-1's (the
    strategy puts it there: it is complete on every stage at the end of call t), and it is
    applied with the hyper-parameters (learning rate, weight decay, ...) the param groups had
    when Lightning stepped for batch t-1, so a scheduler gives every update the value a
    single-device run uses for it although the update lands one step later.
    """

    def __init__(self, optimizer: Optimizer, versions: WeightVersions) -> None:
        # no super().__init__: the wrapped optimizer owns the param groups and the state
        self.optimizer = optimizer
        self.versions = versions
        self.due: int | None = None  # batch whose gradient the next step applies
        self._hyper: dict[int, list[dict[str, Any]]] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def _snapshot(self) -> list[dict[str, Any]]:
        return [
            {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            for group in self.param_groups
        ]

    def record_hyperparameters(self, batch: int) -> None:
        """Remember the param groups' values (lr, weight decay, ...) for batch ``batch``'s update;
        called when Lightning runs that batch, before its scheduler steps."""
        self._hyper[batch] = self._snapshot()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        if self.due is not None:
            self.apply(self.due)
        return loss

    def apply(self, batch: int) -> None:
        """Apply batch ``batch``'s gradient (in ``.grad``) to the newest weights."""
        hyper = self._hyper.pop(batch)
        for stale in [b for b in self._hyper if b < batch]:  # updates skipped (inf/NaN)
            del self._hyper[stale]
        current = self._snapshot()
        for group, values in zip(self.param_groups, hyper, strict=True):
            group.update(values)
        self.versions.advance()
        self.optimizer.step()
        for group, values in zip(self.param_groups, current, strict=True):
            group.update(values)
        self.due = None

    def finish_step(self) -> None:
        """Close the step: if the update that was due did not run (the loss scaler skipped it for
        inf/NaN, on every stage alike), the next version is the current weights unchanged, so
        that version numbers keep meaning "after t updates"."""
        if self.due is None:
            return
        self._hyper.pop(self.due, None)
        self.versions.advance()
        self.due = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"TwoBWOptimizer({self.optimizer!r})"
