"""``__all__`` holds the public API only.

A name in a module's ``__all__`` is what the rest of the package (or a user) may import from it.
So every such name must be imported by another module of the package, re-exported by a package's
``__init__``, or be documented for users: imported in a code example of ``README.md`` or
``docs/`` from that very module. Names only a module itself, or only the tests, use stay out of
``__all__`` (tests import them from their modules all the same).
"""

from __future__ import annotations

import ast
import re

from helpers import ROOT

from unit.test_layering import ALL, PACKAGE, module_name


def _all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            assert isinstance(node, ast.Assign) and isinstance(node.value, (ast.List, ast.Tuple))
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return []


def _documented() -> set[tuple[str, str]]:
    """(module, name) of every ``from lightning_pipe2bw... import ...`` in the docs' examples."""
    out = set()
    texts = [
        (ROOT / "README.md").read_text(),
        *(p.read_text() for p in (ROOT / "docs").glob("*.md")),
    ]
    pattern = re.compile(r"from (lightning_pipe2bw[\w.]*) import (?:\(([\w,\s]*)\)|([\w, ]+))")
    for text in texts:
        for match in pattern.finditer(text):
            names = (match.group(2) or match.group(3)).split(",")
            out.update((match.group(1), n.strip()) for n in names if n.strip())
    return out


def test_every_name_in_all_is_used_by_another_module_or_documented() -> None:
    paths = sorted(PACKAGE.rglob("*.py"))
    trees = {module_name(p): ast.parse(p.read_text()) for p in paths}
    packages = {module_name(p) for p in paths if p.name == "__init__.py"}
    # every ``from module import name`` of the package, relative ones resolved (test_layering)
    imported = {(i.target, name) for i in ALL for name in i.names}
    documented = _documented()
    unused = [
        f"{module}.{name}"
        for module, tree in trees.items()
        # the package root's modules are the face; a package's __init__ re-exports
        if module.count(".") > 1 and module not in packages
        for name in _all(tree)
        if (module, name) not in imported and (module, name) not in documented
    ]
    assert not unused, (
        "names in __all__ that no other module of the package imports and no doc example "
        "imports from that module (drop them from __all__; tests import them from their "
        f"module): {unused}"
    )
