"""``Problem``: one bad option, collected with the others, and :func:`raise_problems`, which raises
them all at once (one error listing every message)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Problem", "raise_problems"]


@dataclass(frozen=True)
class Problem:
    """One bad option: its name, the value given, and a message that names both and the fix.

    ``choices`` lists the valid names when the value is an unknown name (a front end may word
    that case itself); ``kind`` is the exception it raises alone (``TypeError`` for a value of
    the wrong type, ``ValueError`` otherwise)."""

    option: str
    value: Any
    message: str
    kind: type[Exception] = ValueError
    choices: tuple[str, ...] = ()


def raise_problems(problems: Sequence[Problem], title: str = "invalid pipe2bw options") -> None:
    """Raise nothing for no problem, the problem's own error for one, and one error listing
    every message for several (a ``TypeError`` only if every problem is one)."""
    if not problems:
        return
    if len(problems) == 1:
        raise problems[0].kind(problems[0].message)
    kind = TypeError if all(p.kind is TypeError for p in problems) else ValueError
    raise kind(f"{title}:\n  - " + "\n  - ".join(p.message for p in problems))
