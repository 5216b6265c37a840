"""The package's layers (``docs/design.md``), checked on the source: a module imports only from its
own layer or lower ones, nothing below the Lightning seam imports Lightning, Lightning's private
names are reached through ``compat`` only, and the library never imports its recipe.

The rules read every ``import`` statement with ``ast`` (function-level imports included), so a
violation fails here with the file, the line and the rule it breaks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import ROOT

PACKAGE = ROOT / "lightning_pipe2bw"

# lowest first; a module may import from its own layer and the ones before it
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("optim", ("lightning_pipe2bw.optim",)),
    ("schedule", ("lightning_pipe2bw.schedule",)),
    (
        "runtime",
        (
            "lightning_pipe2bw.runtime",
            "lightning_pipe2bw.failures.record",  # the error the runtime raises
            "lightning_pipe2bw.steps.values",  # what the runtime's drivers build
        ),
    ),
    ("partition", ("lightning_pipe2bw.partition", "lightning_pipe2bw.planner")),
    (
        "pipeline",
        (
            "lightning_pipe2bw.pipeline",
            # an idea's folder holds its modules of every layer; each is placed by its name
            "lightning_pipe2bw.checkpoint",
            "lightning_pipe2bw.repartition",
            "lightning_pipe2bw.failures",
            "lightning_pipe2bw.planner.autoplan",
        ),
    ),
    (
        "seam",
        (
            "lightning_pipe2bw.strategy",
            "lightning_pipe2bw.compat",
            "lightning_pipe2bw.seam",  # the strategy's helpers
            "lightning_pipe2bw.checkpoint.hooks",
            "lightning_pipe2bw.repartition.hooks",
            "lightning_pipe2bw.failures.hooks",
            "lightning_pipe2bw.steps",
            "lightning_pipe2bw.planner.hooks",
            "lightning_pipe2bw.planner.loopcost",
            "lightning_pipe2bw.callbacks",
            "lightning_pipe2bw.config",
            "lightning_pipe2bw.cli",
            "lightning_pipe2bw",  # the package's __init__: the public names
        ),
    ),
    ("recipe", ("lightning_pipe2bw.recipes", "lightning_pipe2bw.train")),
)
SEAM = [name for name, _ in LAYERS].index("seam")


def layer_of(module: str) -> int:
    """The layer of a dotted module name of the package (the longest matching prefix wins)."""
    best, length = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = index, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} belongs to no layer; add it to LAYERS and docs/design.md")
    return best


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    path: Path
    line: int
    target: str  # the imported module, absolute
    names: tuple[str, ...]  # the names taken from it (``from x import a, b``)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[Import]:
    source = module_name(path)
    package = source if path.name == "__init__.py" else source.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [Import(source, path, node.lineno, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, target] if target else base)
            # ``from package import submodule`` imports the submodule
            modules = [a.name for a in node.names if _is_module(f"{target}.{a.name}")]
            names = tuple(a.name for a in node.names if a.name not in modules)
            found += [Import(source, path, node.lineno, f"{target}.{m}", ()) for m in modules]
            if names or not modules:
                found.append(Import(source, path, node.lineno, target, names))
    return found


def _is_module(name: str) -> bool:
    rel = PACKAGE.parent / Path(*name.split("."))
    return rel.with_suffix(".py").exists() or (rel / "__init__.py").exists()


ALL = [i for path in sorted(PACKAGE.rglob("*.py")) for i in imports(path)]


def where(i: Import) -> str:
    return f"{i.path.relative_to(PACKAGE.parent)}:{i.line} imports {i.target}"


def test_every_module_has_a_layer() -> None:
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path))


def test_the_package_root_keeps_only_the_face() -> None:
    """The strategy, its options' config and CLI, Lightning's private API and the recipe's
    entry point; every helper lives in a folder by idea (``seam/`` for the strategy's)."""
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert root == ["__init__.py", "cli.py", "compat.py", "config.py", "strategy.py", "train.py"]


# the most lines a module may hold: one idea that reads in one sitting; the strategy is the seam
# of every Lightning hook, and the stage body holds blocks and runs them, nothing else
MAX_LINES = 600
LIMITS = {PACKAGE / "strategy.py": 900, PACKAGE / "runtime" / "stage.py": 450}


def test_no_module_is_too_long_to_read() -> None:
    long = {}
    for path in PACKAGE.rglob("*.py"):
        lines = len(path.read_text().splitlines())
        if lines > LIMITS.get(path, MAX_LINES):
            long[str(path.relative_to(ROOT))] = lines
    assert not long, f"modules over {MAX_LINES} lines (or their own limit, {LIMITS}): {long}"


def test_no_layer_imports_a_higher_one() -> None:
    bad = []
    for i in ALL:
        if not i.target.startswith("lightning_pipe2bw"):
            continue
        src, dst = layer_of(i.source), layer_of(i.target)
        if dst > src:
            bad.append(f"{where(i)} ({LAYERS[src][0]} -> {LAYERS[dst][0]})")
    assert not bad, "a lower layer imports a higher one:\n" + "\n".join(bad)


def test_nothing_below_the_seam_imports_lightning() -> None:
    bad = [
        where(i)
        for i in ALL
        if layer_of(i.source) < SEAM
        and (
            i.target == "lightning" or i.target.split(".")[0] in ("lightning", "pytorch_lightning")
        )
    ]
    assert not bad, "below the Lightning seam, a module imports Lightning:\n" + "\n".join(bad)


def test_private_lightning_names_only_in_compat() -> None:
    bad = []
    for i in ALL:
        if i.source == "lightning_pipe2bw.compat" or i.target.split(".")[0] != "lightning":
            continue
        private = [p for p in i.target.split(".") if p.startswith("_")]
        private += [n for n in i.names if n.startswith("_") and not n.startswith("__")]
        if private:
            bad.append(f"{where(i)} {private}")
    assert not bad, "Lightning's private API outside lightning_pipe2bw.compat:\n" + "\n".join(bad)


def test_private_lightning_attributes_only_in_compat() -> None:
    """Attributes Lightning keeps private, read off its objects (``trainer.fit_loop._data_source``,
    ``call._call_callback_hooks``): only ``compat`` may touch them."""
    watched = {
        "_data_source",
        "_call_callback_hooks",
        "_call_lightning_module_hook",
        "_per_optimizer_states",
        "_broadcast_sigterm_tensor",
    }
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if module_name(path) == "lightning_pipe2bw.compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in watched:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} .{node.attr}")
    assert not bad, "Lightning's private attributes outside compat:\n" + "\n".join(bad)


def test_the_library_never_imports_its_recipe() -> None:
    recipe = layer_of("lightning_pipe2bw.recipes")
    bad = [
        where(i)
        for i in ALL
        if layer_of(i.source) < recipe
        and i.target.startswith("lightning_pipe2bw")
        and layer_of(i.target) == recipe
    ]
    assert not bad, "the library imports the recipe:\n" + "\n".join(bad)


def test_the_launcher_and_the_strategy_do_not_import_each_other_both_ways() -> None:
    bad = [
        where(i)
        for i in ALL
        if i.source == "lightning_pipe2bw.seam.launcher"
        and i.target == "lightning_pipe2bw.strategy"
    ]
    assert not bad, "the launcher imports the strategy:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "target", "allowed"),
    [
        ("lightning_pipe2bw.runtime.engine", "lightning_pipe2bw.schedule", True),
        ("lightning_pipe2bw.schedule.offload", "lightning_pipe2bw.runtime.stash", False),
        ("lightning_pipe2bw.pipeline.assembly", "lightning_pipe2bw.strategy", False),
        ("lightning_pipe2bw.strategy", "lightning_pipe2bw.recipes.gpt.model", False),
        ("lightning_pipe2bw.recipes.gpt.train", "lightning_pipe2bw.config", True),
    ],
)
def test_the_layer_rule_itself(source: str, target: str, allowed: bool) -> None:
    """The rule the checks above apply, on imports that would break it (so the checks can
    fail): a module may import its own layer and lower ones only."""
    assert (layer_of(target) <= layer_of(source)) is allowed
