"""Pipeline schedule actions and their compact, round-trippable text form."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "Action",
    "ActionKind",
    "format_actions",
    "parse_action",
    "parse_actions",
    "parse_stages",
    "partner",
]


class ActionKind(str, Enum):
    """What a stage does in one schedule slot."""

    FORWARD = "F"
    BACKWARD = "B"  # the whole backward: the inputs' gradient and the weights'
    # a backward in two actions (zero-bubble schedules): the gradient of the stage's inputs
    # (what SEND_B sends), then, later, the weights' gradients (accumulated into .grad)
    INPUT_GRAD = "I"
    WEIGHT_GRAD = "W"
    SEND_F = "SEND_F"  # activations, stage s -> s+1
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"  # gradients, stage s -> s-1
    RECV_B = "RECV_B"
    # Activation offload (BPipe) between stage s and its partner p - 1 - s, for s < p - 1 - s:
    EVICT = "EVICT"  # on s after F(i): send part of i's saved activations to the partner
    RETURN = "RETURN"  # on the partner: wait for i's evicted activations, then send them back
    LOAD = "LOAD"  # on s before B(i): receive i's activations back from the partner


_COMPUTE = frozenset(
    {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.INPUT_GRAD, ActionKind.WEIGHT_GRAD}
)
# the action that starts a micro-batch's backward (its gradient arrives before it, and the
# inputs' gradient leaves after it) and the one that ends it (its activations are released)
_STARTS_BACKWARD = frozenset({ActionKind.BACKWARD, ActionKind.INPUT_GRAD})
_ENDS_BACKWARD = frozenset({ActionKind.BACKWARD, ActionKind.WEIGHT_GRAD})
_OFFLOAD = frozenset({ActionKind.EVICT, ActionKind.RETURN, ActionKind.LOAD})


def partner(stage: int, num_stages: int) -> int:
    """The stage that holds ``stage``'s evicted activations: ``num_stages - 1 - stage``.

    Pairs are (0, p - 1), (1, p - 2), ...; the earlier stage of a pair (``stage < partner``)
    evicts, the later one holds and returns. The middle stage of an odd ``num_stages`` is its
    own partner and takes part in no offload.
    """
    return num_stages - 1 - stage


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one stage: compute (F/B) or communication for a micro-batch.

    Communication is point-to-point between neighbours (SEND_*/RECV_*) or activation offload
    between a stage and its :func:`partner` (EVICT/RETURN/LOAD).

    ``version`` is the weight version the action runs with (weight-stashing schedules such as
    PipeDream-2BW); it is ``None`` for flush schedules (GPipe, 1F1B).
    """

    stage: int
    kind: ActionKind
    microbatch: int
    version: int | None = None

    def __post_init__(self) -> None:
        # Accept the plain string value ("F", "SEND_B", ...) and store the enum member.
        if not isinstance(self.kind, ActionKind):
            valid = ", ".join(k.value for k in ActionKind)
            try:
                kind = ActionKind(self.kind)
            except ValueError:
                raise ValueError(f"unknown action kind {self.kind!r}; use one of {valid}") from None
            object.__setattr__(self, "kind", kind)

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{self.microbatch}"
        return text if self.version is None else f"{text}v{self.version}"

    @property
    def is_compute(self) -> bool:
        """True for forward and backward actions (B, I, W)."""
        return self.kind in _COMPUTE

    @property
    def starts_backward(self) -> bool:
        """True for B and I: the action that needs the gradient from the next stage and
        produces the one for the previous stage."""
        return self.kind in _STARTS_BACKWARD

    @property
    def ends_backward(self) -> bool:
        """True for B and W: after it, the micro-batch's weights' gradients are accumulated and
        its activations are released."""
        return self.kind in _ENDS_BACKWARD

    @property
    def is_comm(self) -> bool:
        """True for send and receive actions, including the offload actions."""
        return self.kind not in _COMPUTE

    @property
    def is_offload(self) -> bool:
        """True for the activation offload actions EVICT, RETURN and LOAD."""
        return self.kind in _OFFLOAD


# Longer kinds first so that e.g. "SEND_F" is never read as a bare "F".
_KINDS = "|".join(
    re.escape(k.value) for k in sorted(ActionKind, key=lambda k: len(k.value), reverse=True)
)
_ACTION_RE = re.compile(rf"(-?\d+)({_KINDS})(-?\d+)(?:v(-?\d+))?")


def parse_action(text: str) -> Action:
    """Parse the compact form produced by ``str(action)``, e.g. ``"2F0"`` or ``"1F5v2"``."""
    match = _ACTION_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"malformed action {text!r}; expected <stage><kind><microbatch>[v<version>] with "
            f"kind one of {', '.join(k.value for k in ActionKind)}, e.g. '2F0', '1SEND_B3', "
            "'1F5v2', '0EVICT3', '1I2', '1W2'"
        )
    stage, kind, microbatch, version = match.groups()
    return Action(
        int(stage), ActionKind(kind), int(microbatch), None if version is None else int(version)
    )


def format_actions(actions: Iterable[Action]) -> str:
    """Space-separated compact forms of ``actions``."""
    return " ".join(str(action) for action in actions)


def parse_actions(text: str) -> list[Action]:
    """Inverse of :func:`format_actions`: parse whitespace-separated compact actions."""
    return [parse_action(token) for token in text.split()]


def parse_stages(text: str) -> tuple[tuple[Action, ...], ...]:
    """Parse one line of actions per stage; blank lines are ignored, so aligned literals work."""
    return tuple(tuple(parse_actions(line)) for line in text.splitlines() if line.strip())
