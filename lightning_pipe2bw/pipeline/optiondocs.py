"""The options' text, rendered from their table (``pipeline/optiontable.py``, where each
option's ``doc`` is written once) for the places that show it: the strategy's docstring
(:func:`docstring`), the options table of ``docs/user-guide.md`` (:func:`keywords_table`) and
the strategy table of ``docs/configuration.md`` (:func:`config_table`).

``make docs`` (:func:`main`) rewrites the two files' generated blocks, between :data:`BEGIN`
and :data:`END`; ``--check`` only says whether they are stale, and ``tests/unit/test_docs.py``
fails when they are.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_pipe2bw.pipeline.optiontable import OPTIONS

__all__ = ["docstring"]

BEGIN = "<!-- options: made from lightning_pipe2bw/pipeline/optiontable.py by `make docs` -->"
END = "<!-- options: end -->"

# a Markdown link or a code span
_MARKUP = re.compile(r"\[(?P<text>[^\]]+)\]\((?P<target>[^)]+)\)|`(?P<code>[^`]+)`")


def as_rst(text: str) -> str:
    """Markdown ``text`` as reStructuredText: code spans doubled, a link as its text in code
    (the options' links name the file they point to)."""

    def convert(match: re.Match[str]) -> str:
        if match.group("code") is not None:
            return f"``{match.group('code')}``"
        return f"``{match.group('text')}``"

    return _MARKUP.sub(convert, text)


def _from_docs(text: str) -> str:
    """Markdown ``text`` (links relative to the repository) for a file in ``docs/``."""
    return text.replace("[docs/", "[").replace("](docs/", "](")


def _cell(text: str) -> str:
    """``text`` made safe inside a Markdown table cell."""
    return text.replace("|", "\\|")


def _python(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def docstring(head: str, tail: str) -> str:
    """The strategy's docstring: ``head``, an ``Args:`` entry per option, then ``tail``."""
    entries = []
    for option in OPTIONS:
        entry = textwrap.fill(
            f"{option.name}: {as_rst(option.doc)}.",
            width=96,
            initial_indent="    ",
            subsequent_indent="        ",
            break_on_hyphens=False,
        )
        entries.append(entry)
    return f"{head.strip()}\n\nArgs:\n" + "\n".join(entries) + f"\n\n{tail.strip()}\n"


def keywords_table() -> str:
    """The options table of ``docs/user-guide.md``: the strategy's keywords."""
    rows = ["| option | default | meaning |", "| --- | --- | --- |"]
    for option in OPTIONS:
        default = option.shown_default or f"`{_python(option.default)}`"
        rows.append(f"| `{option.name}` | {_cell(default)} | {_cell(_from_docs(option.doc))} |")
    return "\n".join(rows)


def config_table() -> str:
    """The strategy table of ``docs/configuration.md``: the Hydra config's keys."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for option in OPTIONS:
        meaning = _from_docs(option.doc)
        if option.config_note:
            meaning += f". In a config: {option.config_note}"
        rows.append(
            f"| `{option.field_name}` | `{_yaml(option.field_default)}` | {_cell(meaning)} |"
        )
    return "\n".join(rows)


# the files with a generated block, relative to the repository, and what goes in it
BLOCKS: dict[str, Callable[[], str]] = {
    "docs/user-guide.md": keywords_table,
    "docs/configuration.md": config_table,
}


def rendered(text: str, block: str, name: str) -> str:
    """``text`` with its generated block replaced by ``block``; ``name``: the file (errors)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(
            f"{name} has no generated options block: put the two lines {BEGIN!r} and {END!r} "
            "where the table goes"
        )
    return text[: start + len(BEGIN)] + "\n" + block + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check``, compare) the generated blocks under ``--root``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository")
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    stale = []
    for name, make in BLOCKS.items():
        path = args.root / name
        text = path.read_text(encoding="utf-8")
        new = rendered(text, make(), name)
        if new != text:
            stale.append(name)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    verb = "stale (run `make docs`)" if args.check else "rewritten"
    for name in stale:
        print(f"{name}: {verb}")
    return 1 if args.check and stale else 0
