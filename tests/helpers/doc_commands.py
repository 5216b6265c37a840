"""The commands the README and docs/ tell a user to type, as the shell would hand them over.

Every fenced ``bash``/``sh``/``shell`` block of ``README.md`` and ``docs/**/*.md`` is read line
by line (a trailing backslash joins the next line, ``#`` starts a comment, quotes are the
shell's); a line is a :class:`DocCommand` when it runs the main job
(``python -m lightning_pipe2bw.train``, alone or under ``srun``/``torchrun``) or ``make``.
``tests/unit/test_doc_commands.py`` checks the GPU and multi-node ones for the configuration
they build and every ``make`` target; ``tests/launch/test_doc_commands.py`` runs the rest as
written, with a few steps.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from helpers import ROOT

__all__ = ["DocCommand", "doc_commands", "fast_overrides", "overrides_with"]

MAIN_JOB = "lightning_pipe2bw.train"
SHELL_FENCES = {"bash", "sh", "shell"}
# a few steps on a slice of the data, no checkpoints or plots: what makes a documented run short
FAST = {
    "trainer.max_steps": "3",
    "trainer.val_check_interval": "3",
    "trainer.num_sanity_val_steps": "0",
    "trainer.enable_checkpointing": "false",
    "trainer.enable_progress_bar": "false",
    "data.max_bytes": "200000",
    "data.val_samples": "8",
    "report": "false",
}


@dataclass(frozen=True)
class DocCommand:
    """One documented command line: where it is, its words, and what kind of run it asks for."""

    where: str  # file:line
    argv: tuple[str, ...]  # as the shell splits it, comments dropped

    @property
    def is_make(self) -> bool:
        return self.argv[0] == "make"

    @property
    def overrides(self) -> list[str]:
        """The main job's command-line arguments (Hydra overrides and flags), launcher dropped;
        a ``make`` line's targets."""
        if self.is_make:
            return list(self.argv[1:])
        return list(self.argv[self.argv.index(MAIN_JOB) + 1 :])

    @property
    def launcher(self) -> str | None:
        """``srun`` or ``torchrun`` where one starts the job, else None."""
        return self.argv[0] if self.argv[0] in ("srun", "torchrun") else None

    @property
    def needs_hardware(self) -> str | None:
        """Why this command cannot run here (a GPU, a second machine), or None."""
        words = set(self.overrides)
        if "trainer=gpu" in words:
            return "a GPU"
        if "trainer=multinode" in words or self.launcher == "srun":
            return "several machines"
        if self.launcher == "torchrun" and any(
            a.startswith("--nnodes") and not a.endswith("=1") for a in self.argv
        ):
            return "several machines"
        return None

    @property
    def is_sweep(self) -> bool:
        return "-m" in self.overrides or "--multirun" in self.overrides

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def _logical_lines(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """A block's lines with backslash continuations joined, each with its first line's number."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, text in block:
        start, sofar = pending if pending is not None else (number, "")
        if text.rstrip().endswith("\\"):
            pending = (start, sofar + text.rstrip()[:-1] + " ")
            continue
        pending = None
        out.append((start, sofar + text))
    if pending is not None:
        out.append(pending)
    return out


def _words(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value prefix
        words.pop(0)
    return words


def _is_command(words: list[str]) -> bool:
    if not words:
        return False
    if words[0] == "make":
        return True
    return MAIN_JOB in words and "-m" in words[: words.index(MAIN_JOB)]


def doc_commands(root: Path = ROOT) -> list[DocCommand]:
    """Every documented main-job and ``make`` command, in README.md and docs/, in page order."""
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    found: list[DocCommand] = []
    for page in pages:
        fence: str | None = None
        block: list[tuple[int, str]] = []
        for number, text in enumerate(page.read_text().splitlines(), start=1):
            stripped = text.strip()
            if fence is None:
                if stripped.startswith("```"):
                    fence = stripped[3:].strip() or "text"
                    block = []
                continue
            if stripped.startswith("```"):
                if fence in SHELL_FENCES:
                    for start, line in _logical_lines(block):
                        words = _words(line)
                        if _is_command(words):
                            where = f"{page.relative_to(root)}:{start}"
                            found.append(DocCommand(where, tuple(words)))
                fence = None
                continue
            block.append((number, text))
    return found


def overrides_with(overrides: list[str], settings: dict[str, str]) -> list[str]:
    """``overrides`` with each key of ``settings`` set to its value: in place where the command
    sets it already (Hydra refuses a key given twice), appended where it does not."""
    out, seen = [], set()
    for word in overrides:
        key = word.split("=", 1)[0].lstrip("+~")
        if "=" in word and key in settings:
            out.append(f"{key}={settings[key]}")
            seen.add(key)
        else:
            out.append(word)
    out += [f"{k}={v}" for k, v in settings.items() if k not in seen]
    return out


def fast_overrides(command: DocCommand, out_dir: Path) -> list[str]:
    """The command's own overrides, made short (:data:`FAST`) and writing under ``out_dir``."""
    if "--cfg" in command.overrides or "-c" in command.overrides:
        return command.overrides  # prints the composed config and trains nothing
    dirs = {"hydra.run.dir": str(out_dir / "run"), "hydra.sweep.dir": str(out_dir / "multirun")}
    return overrides_with(command.overrides, {**FAST, **dirs})
