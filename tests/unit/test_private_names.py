"""Lightning's private attributes are read through ``compat.py`` only.

``tests/unit/test_layering.py`` checks the imports; this checks attribute reads. Outside
``compat.py``, the package may not read an attribute whose name starts with one underscore off
anything but ``self`` or ``cls`` when Lightning defines that name (a ``self._x =`` assignment,
a ``def _x`` or a ``class _x`` in its source) and this package does not (its own private
attributes are free to use). torch's private attributes that Lightning happens to define too are
listed in ``TORCH``, each read on a torch object.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import lightning
from helpers import ROOT

PACKAGE = ROOT / "lightning_pipe2bw"
LIGHTNING = Path(lightning.__file__).resolve().parent
# torch's, read on torch objects: a tensor's version counter, a module's backward hooks, a
# module's load_state_dict pre-hooks (repartition/travel.py: weight norm's, which no pickle carries)
# and forward hooks (partition/recorded.py: transformers' output-capturing hooks, the same)
TORCH = frozenset(
    {
        "_version", "_backward_hooks", "_backward_pre_hooks", "_load_state_dict_pre_hooks",
        "_forward_hooks",
    }
)  # fmt: skip


def _defined(root: Path) -> set[str]:
    """Every private name ``root``'s source defines: assigned attributes, functions, classes,
    module-level names."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.id
            else:
                continue
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


@cache
def _lightnings() -> frozenset[str]:
    return frozenset(name for sub in ("pytorch", "fabric") for name in _defined(LIGHTNING / sub))


def _reads(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every single-underscore attribute read off something else than
    ``self`` or ``cls``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        out.append((node.lineno, node.attr))
    return out


def test_lightnings_private_attributes_are_read_in_compat_only() -> None:
    ours = _defined(PACKAGE)
    theirs = _lightnings() - ours - TORCH
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} reads .{name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "compat.py"
        for line, name in _reads(path)
        if name in theirs
    ]
    assert not bad, (
        "Lightning's private attributes are read outside compat.py (add a function there, "
        "under a public name, and a check in tests/unit/test_compat.py):\n" + "\n".join(bad)
    )


def test_the_check_sees_a_private_read(tmp_path: Path) -> None:
    """The rule fails on a read like the one ``callbacks/summary.py`` had."""
    sample = tmp_path / "sample.py"
    sample.write_text("def depth(callback):\n    return callback._max_depth\n")
    assert (2, "_max_depth") in _reads(sample)
    assert "_max_depth" in _lightnings() - _defined(PACKAGE)
