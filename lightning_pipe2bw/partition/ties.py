"""Parameters shared by several blocks (an embedding tied to the output head)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from lightning_pipe2bw.partition.split import Partition

__all__ = ["Tie", "find_ties", "share_parameter"]


@dataclass(frozen=True)
class Tie:
    """One parameter that several blocks use: ``uses`` are ``(block index, name within the
    block)``, in block order. The first use is the *primary*: its name is the one gradients are
    counted under (clipping) and weights are copied from."""

    uses: tuple[tuple[int, str], ...]

    @property
    def primary(self) -> tuple[int, str]:
        return self.uses[0]

    def stages(self, partition: Partition) -> tuple[int, ...]:
        """The stages holding a copy, in order (one: the tie stays within a stage)."""
        return tuple(sorted({partition.stage_of(block) for block, _ in self.uses}))

    def describe(self, body: str = "") -> str:
        prefix = f"{body}." if body else ""
        return " = ".join(f"{prefix}{block}.{name}" for block, name in self.uses)


def find_ties(blocks: Sequence[nn.Module]) -> list[Tie]:
    """The parameters that more than one block holds, with every use."""
    uses: dict[int, list[tuple[int, str]]] = {}
    for index, block in enumerate(blocks):
        for name, param in block.named_parameters(remove_duplicate=False):
            found = uses.setdefault(id(param), [])
            if not found or found[-1][0] != index:
                found.append((index, name))
    return [Tie(tuple(u)) for u in uses.values() if len(u) > 1]


def share_parameter(root: nn.Module, keep: str, paths: Sequence[str]) -> None:
    """Make the parameters at ``paths`` (dotted, within ``root``) the one at ``keep``: the
    copies of a tie become one parameter again."""
    first = root.get_parameter(keep)
    for path in paths:
        if path != keep:
            owner_path, _, name = path.rpartition(".")
            owner = root.get_submodule(owner_path) if owner_path else root
            owner._parameters[name] = first
