"""What indexing a stage's body gives for a block another stage holds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["RemoteBlock"]


class RemoteBlock(nn.Module):
    """What indexing a :class:`StageBody` gives for a block another stage holds: a module
    without parameters or buffers, so that parameter groups built by indexing the body
    (``self.body[-1].parameters()``) are simply empty on the stages that do not hold the block.
    It is not registered anywhere (no state-dict entry); calling it, or reading an attribute the
    real block would have, raises an error naming the stage that holds it."""

    def __init__(self, index: int, stage: int, here: Sequence[int], indices: list[int]) -> None:
        super().__init__()
        self.index, self.stage, self.here, self.here_blocks = index, stage, here, indices

    def _where(self) -> str:
        runs = f"stage {self.here[0]}" if len(self.here) == 1 else f"stages {list(self.here)}"
        return (
            f"block {self.index} of the pipeline body lives on stage {self.stage}; this rank runs "
            f"{runs} and holds blocks {self.here_blocks} only"
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._where()}, so it cannot run it here")

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            raise AttributeError(
                f"{self._where()}: its attribute {name!r} is not here. Indexing the body gives "
                "the stage's own blocks and, for the others, an empty module (its parameters() "
                "are empty), which is what building optimizer parameter groups needs"
            ) from None

    def extra_repr(self) -> str:
        return f"index={self.index}, stage={self.stage}"
