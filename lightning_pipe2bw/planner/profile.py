"""What the planner knows about a model: per-block costs measured at one or more micro-batch sizes.

Plain data (frozen dataclasses with a JSON round-trip), so that a profile can be measured on one
rank, broadcast, saved next to a checkpoint, or written by hand for a model that is not at hand
(the paper-scale figures in ``benchmarks/paper_scale.py`` build one from a FLOP and byte model).
The measuring side lives in :mod:`lightning_pipe2bw.planner.measure`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

__all__ = ["BlockProfile", "Profile", "ProfileSet"]


@dataclass(frozen=True)
class BlockProfile:
    """One block of the body at one micro-batch size. Times in seconds, sizes in bytes."""

    name: str  # the block's index in the body, as in its parameter names ("3" for body.3.*)
    forward_s: float  # median forward time of one micro-batch
    backward_s: float  # median backward time of one micro-batch
    output_bytes: int  # the block's output: what crosses a stage boundary after it
    saved_bytes: int  # tensors autograd saves for the block's backward (activation memory)
    param_bytes: int  # the block's parameters (one weight version)
    update_s: float = 0.0  # the optimizer's update of the block's parameters (once per step)
    # the backward cut in two (zero-bubble schedules' I and W, ``SplitBackward``): the inputs'
    # pass and the weights' pass; together more than ``backward_s`` (each pass walks its part of
    # the graph, and a node on the cut runs twice). Both 0: not measured (see ``split_times``)
    input_grad_s: float = 0.0
    weight_grad_s: float = 0.0
    # what the block's backward allocates beyond what it starts with, the most live at once: the
    # gradients of its activations and the weights' gradients before they are added in (0: not
    # measured)
    backward_bytes: int = 0
    # what its backward cut in two keeps from the inputs' pass to the weights' pass: the
    # gradients flowing into its weights' nodes (0: not measured, or nothing to keep)
    cut_bytes: int = 0

    def __post_init__(self) -> None:
        for label in ("forward_s", "backward_s", "update_s", "input_grad_s", "weight_grad_s"):
            value = getattr(self, label)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"BlockProfile {self.name}: {label} must be >= 0, got {value!r}")
        for label in ("output_bytes", "saved_bytes", "param_bytes", "backward_bytes", "cut_bytes"):
            if getattr(self, label) < 0:
                raise ValueError(f"BlockProfile {self.name}: {label} must be >= 0")

    @property
    def split_times(self) -> tuple[float, float]:
        """(inputs' pass, weights' pass) seconds of the backward cut in two: as measured, or
        where it was not measured, half of ``backward_s`` each."""
        if self.input_grad_s == 0.0 and self.weight_grad_s == 0.0:
            return self.backward_s / 2, self.backward_s / 2
        return self.input_grad_s, self.weight_grad_s


@dataclass(frozen=True)
class Profile:
    """Every block of the body, measured at one micro-batch size on one kind of device."""

    microbatch_size: int
    input_bytes: int  # the body's input for one micro-batch (what the first stage receives)
    blocks: tuple[BlockProfile, ...]
    device: str = "cpu"
    repeats: int = 0  # how many timed repeats each median is over (0: not measured)
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.microbatch_size < 1:
            raise ValueError(f"microbatch_size must be >= 1, got {self.microbatch_size}")
        if not self.blocks:
            raise ValueError("a profile needs at least one block")
        object.__setattr__(self, "blocks", tuple(self.blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        blocks = tuple(BlockProfile(**block) for block in data["blocks"])
        return cls(
            microbatch_size=int(data["microbatch_size"]),
            input_bytes=int(data["input_bytes"]),
            blocks=blocks,
            device=str(data.get("device", "cpu")),
            repeats=int(data.get("repeats", 0)),
            meta=dict(data.get("meta", {})),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        return cls.from_dict(json.loads(text))


def _line(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class ProfileSet:
    """Profiles of one model at several micro-batch sizes; :meth:`at` scales to any other size.

    Between two measured sizes every time and activation size is interpolated linearly; outside
    them it is extrapolated along the nearest two (or, with one size, proportionally to the
    micro-batch size). Parameter bytes do not depend on the size. Values never go below zero.
    """

    profiles: tuple[Profile, ...]

    def __post_init__(self) -> None:
        if not self.profiles:
            raise ValueError("a ProfileSet needs at least one profile")
        ordered = tuple(sorted(self.profiles, key=lambda p: p.microbatch_size))
        sizes = [p.microbatch_size for p in ordered]
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"micro-batch sizes must differ, got {sizes}")
        names = [[b.name for b in p.blocks] for p in ordered]
        if any(n != names[0] for n in names):
            raise ValueError("every profile in a ProfileSet must have the same blocks")
        object.__setattr__(self, "profiles", ordered)

    @classmethod
    def of(cls, profiles: Profile | Sequence[Profile]) -> ProfileSet:
        if isinstance(profiles, Profile):
            return cls((profiles,))
        return cls(tuple(profiles))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(p.microbatch_size for p in self.profiles)

    @property
    def num_blocks(self) -> int:
        return self.profiles[0].num_blocks

    def at(self, microbatch_size: int) -> Profile:
        """The profile at ``microbatch_size`` (measured if it was, else scaled)."""
        if microbatch_size < 1:
            raise ValueError(f"micro-batch size must be >= 1, got {microbatch_size}")
        for profile in self.profiles:
            if profile.microbatch_size == microbatch_size:
                return profile
        b = float(microbatch_size)
        if len(self.profiles) == 1:
            only = self.profiles[0]
            k = b / only.microbatch_size

            def scale(value: float, _: str) -> float:
                return value * k

            return _mapped(only, microbatch_size, scale, scale)
        # the two measured sizes around b, or the nearest two outside the measured range
        pairs = list(zip(self.profiles, self.profiles[1:], strict=False))
        lo, hi = pairs[0] if b < self.profiles[0].microbatch_size else pairs[-1]
        for left, right in pairs:
            if left.microbatch_size <= b <= right.microbatch_size:
                lo, hi = left, right
                break
        x0, x1 = float(lo.microbatch_size), float(hi.microbatch_size)
        blocks = []
        for a, c in zip(lo.blocks, hi.blocks, strict=True):

            def lerp(label: str, a: BlockProfile = a, c: BlockProfile = c) -> float:
                return max(_line(x0, getattr(a, label), x1, getattr(c, label), b), 0.0)

            blocks.append(
                replace(
                    a,
                    forward_s=lerp("forward_s"),
                    backward_s=lerp("backward_s"),
                    input_grad_s=lerp("input_grad_s"),
                    weight_grad_s=lerp("weight_grad_s"),
                    output_bytes=round(lerp("output_bytes")),
                    saved_bytes=round(lerp("saved_bytes")),
                    backward_bytes=round(lerp("backward_bytes")),
                    cut_bytes=round(lerp("cut_bytes")),
                )
            )
        input_bytes = round(max(_line(x0, lo.input_bytes, x1, hi.input_bytes, b), 0.0))
        return replace(
            lo, microbatch_size=microbatch_size, input_bytes=input_bytes, blocks=tuple(blocks)
        )

    def to_json(self) -> str:
        return json.dumps([p.to_dict() for p in self.profiles], indent=1)

    @classmethod
    def from_json(cls, text: str) -> ProfileSet:
        return cls(tuple(Profile.from_dict(item) for item in json.loads(text)))


def _mapped(
    profile: Profile,
    microbatch_size: int,
    time: Any,
    size: Any,
) -> Profile:
    blocks = tuple(
        replace(
            block,
            forward_s=time(block.forward_s, "forward_s"),
            backward_s=time(block.backward_s, "backward_s"),
            input_grad_s=time(block.input_grad_s, "input_grad_s"),
            weight_grad_s=time(block.weight_grad_s, "weight_grad_s"),
            output_bytes=round(size(block.output_bytes, "output_bytes")),
            saved_bytes=round(size(block.saved_bytes, "saved_bytes")),
            backward_bytes=round(size(block.backward_bytes, "backward_bytes")),
            cut_bytes=round(size(block.cut_bytes, "cut_bytes")),
        )
        for block in profile.blocks
    )
    return replace(
        profile,
        microbatch_size=microbatch_size,
        input_bytes=round(size(profile.input_bytes, "input_bytes")),
        blocks=blocks,
    )
