"""Figures the docs quote in more than one place, each read from its results file.

A quoted figure carries a marker right after it, invisible on the rendered page::

    2BW needs 1.27<!-- figure: step_multiplier.1200 --> times the flushed run's steps

``python benchmarks/figures.py`` (``make docs``) rewrites each marked value from
``benchmarks/results/*.json``; ``--check`` only lists the values their results file contradicts,
and ``tests/unit/test_figures.py`` fails on any. A figure quoted once is written once and linked
instead: only repeated ones need a name here.

A table drawn from a results file sits between ``<!-- table: NAME -->`` and ``<!-- /table -->``
and is rewritten whole, the same way.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = ("README.md", "docs", "benchmarks/README.md", "configs")

# a number (a percentage too), then its marker: "1.27<!-- figure: NAME -->x"
MARKER = re.compile(r"(?P<value>\d[\d.,]*%?)<!-- figure: (?P<name>[\w.-]+) -->")
TABLE = re.compile(
    r"(?P<open><!-- table: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(?P<close><!-- /table -->)", re.S
)


@cache
def _results(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def _multiplier(horizon: int, sync: float) -> str:
    """2BW's step multiplier at ``horizon`` as it runs by default (error feedback), with a
    synchronous start of ``sync`` of the steps: the smallest over the recipes measured."""
    rows = _results(f"step_multiplier_{horizon}.json")["rows"]
    best = min(
        r["multiplier"]
        for r in rows
        if r["sync"] == sync and r["recipe"].startswith("2bw-error_feedback")
    )
    return f"{best:.2f}"


def _depth_line(name: str, p: int, m: int) -> dict[str, Any]:
    for line in _results("depth.json")["lines"]:
        if (line["kind"], line["name"], line["split"], line["p"], line["m"]) == (
            "ours", name, "default", p, m,
        ):  # fmt: skip
            return dict(line)
    raise KeyError(f"depth.json has no line for ours {name} p={p} m={m}")


def _over_torch_best(p: int) -> str:
    """Our 2BW's step over torch's fastest flushed schedule at m = p."""
    return f"{_depth_line('2bw', p, p)['vs_torch_best']:.2f}"


def _planner_error() -> str:
    return f"{100 * _results('planner_accuracy.json')['median_abs_error']:.0f}%"


def _planner_plans() -> str:
    return str(sum(not r["cores_shared"] for r in _results("planner_accuracy.json")["rows"]))


def _planner_table() -> str:
    """Each plan of ``planner_accuracy.py``: predicted and measured step, and rank 0's split."""
    lines = [
        "| schedule | d | m | b | predicted ms | measured ms | error | last stage: predicted "
        "compute + update ms | measured compute / recv wait / send / other ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in _results("planner_accuracy.json")["rows"]:
        split = r["measured_split"]
        parts = " / ".join(
            f"{1e3 * split[k]:.1f}" for k in ("compute_s", "recv_s", "send_s", "other_s")
        )
        error = f"{100 * r['error']:+.0f}%" + (" (cores shared)" if r["cores_shared"] else "")
        lines.append(
            f"| {r['schedule']} | {r['depth']} | {r['microbatches']} | {r['microbatch_size']} "
            f"| {1e3 * r['predicted_step_s']:.2f} | {1e3 * r['measured_step_s']:.2f} | {error} "
            f"| {1e3 * r['predicted_compute_s']:.1f} + {1e3 * r['predicted_update_s']:.1f} | {parts} |"
        )
    return "\n".join(lines) + "\n"


FIGURES: dict[str, Callable[[], str]] = {
    "step_multiplier.1200": lambda: _multiplier(1200, 0.0),
    "step_multiplier.1200.sync10": lambda: _multiplier(1200, 0.1),
    "step_multiplier.1200.sync30": lambda: _multiplier(1200, 0.3),
    "step_multiplier.300": lambda: _multiplier(300, 0.0),
    "step_multiplier.300.sync10": lambda: _multiplier(300, 0.1),
    "depth.2bw_over_torch_best.p4": lambda: _over_torch_best(4),
    "depth.2bw_over_torch_best.p8": lambda: _over_torch_best(8),
    "depth.2bw_over_torch_best.p16": lambda: _over_torch_best(16),
    "planner_accuracy.median_error": _planner_error,
    "planner_accuracy.plans": _planner_plans,
}

TABLES: dict[str, Callable[[], str]] = {"planner_accuracy": _planner_table}


@dataclass(frozen=True)
class Quote:
    """A marked figure: where it is, what it says, and what its results file says."""

    path: Path
    line: int
    name: str
    quoted: str
    value: str | None  # None: no figure of that name

    @property
    def stale(self) -> bool:
        return self.value != self.quoted

    def __str__(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        where = f"{path}:{self.line}"
        if self.value is None:
            return f"{where}: no figure or table named {self.name!r} (benchmarks/figures.py)"
        if self.name.startswith("table "):
            return f"{where}: {self.name} differs from its results file (make docs rewrites it)"
        return (
            f"{where}: {self.name} is quoted as {self.quoted}, its results file gives {self.value}"
        )


def pages(root: Path = ROOT) -> Iterator[Path]:
    for entry in PAGES:
        path = root / entry
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from sorted(p for p in path.rglob("*") if p.suffix in (".md", ".yaml"))


def quotes(paths: Sequence[Path]) -> list[Quote]:
    """Every marked figure and table of ``paths``."""
    found = []
    for path in paths:
        text = path.read_text()
        for number, line in enumerate(text.splitlines(), 1):
            for match in MARKER.finditer(line):
                name = match["name"]
                value = FIGURES[name]() if name in FIGURES else None
                found.append(Quote(path, number, name, match["value"], value))
        for match in TABLE.finditer(text):
            name, number = match["name"], text.count("\n", 0, match.start()) + 1
            value = TABLES[name]() if name in TABLES else None
            found.append(Quote(path, number, f"table {name}", match["body"], value))
    return found


def rewrite(path: Path) -> bool:
    """Write each marked value of ``path`` from its results file; True if anything changed."""
    text = path.read_text()

    def fresh(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in FIGURES:
            raise KeyError(f"{path}: no figure named {name!r} (benchmarks/figures.py FIGURES)")
        return f"{FIGURES[name]()}<!-- figure: {name} -->"

    def fresh_table(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in TABLES:
            raise KeyError(f"{path}: no table named {name!r} (benchmarks/figures.py TABLES)")
        return f"{match['open']}{TABLES[name]()}{match['close']}"

    new = TABLE.sub(fresh_table, MARKER.sub(fresh, text))
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="list stale figures, change nothing")
    args = parser.parse_args(argv)
    paths = list(pages())
    if args.check:
        stale = [q for q in quotes(paths) if q.stale]
        for quote in stale:
            print(quote)
        return 1 if stale else 0
    changed = [p.relative_to(ROOT) for p in paths if rewrite(p)]
    print(
        f"figures: {len(quotes(paths))} quoted; rewritten in {', '.join(map(str, changed)) or 'none'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
