"""Figures the docs quote in more than one place come from their results files
(``benchmarks/figures.py``; ``make docs`` rewrites them): none is stale, every marker names a
figure, and a quote that its results file contradicts is found."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import figures
from lightning_pipe2bw.planner.target import STEP_MULTIPLIERS


def test_every_marked_figure_is_what_its_results_file_says() -> None:
    quoted = figures.quotes(list(figures.pages()))
    assert len({q.name for q in quoted}) >= 8, [q.name for q in quoted]  # the markers are there
    stale = [str(q) for q in quoted if q.stale]
    assert not stale, "run `make docs`:\n" + "\n".join(stale)


def test_every_figure_and_table_is_quoted_somewhere() -> None:
    names = {q.name for q in figures.quotes(list(figures.pages()))}
    assert set(figures.FIGURES) | {f"table {t}" for t in figures.TABLES} <= names


def test_a_contradicted_or_unknown_figure_is_found_and_rewritten(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "2BW needs 1.99<!-- figure: step_multiplier.1200 -->x the steps; "
        "7<!-- figure: no.such.figure -->\n"
        "<!-- table: planner_accuracy -->\n| an old table |\n<!-- /table -->\n"
    )
    found = {q.name: q for q in figures.quotes([page])}
    assert found["step_multiplier.1200"].stale and found["step_multiplier.1200"].quoted == "1.99"
    assert found["no.such.figure"].value is None and "no figure or table" in str(
        found["no.such.figure"]
    )
    assert found["table planner_accuracy"].stale
    with pytest.raises(KeyError, match=r"no\.such\.figure"):
        figures.rewrite(page)
    page.write_text(page.read_text().replace("; 7<!-- figure: no.such.figure -->", ""))
    assert figures.rewrite(page)
    assert not any(q.stale for q in figures.quotes([page]))
    assert figures.FIGURES["step_multiplier.1200"]() + "<!-- figure" in page.read_text()


def test_the_planner_takes_the_measured_step_multiplier() -> None:
    assert STEP_MULTIPLIERS["step"] == float(figures.FIGURES["step_multiplier.1200"]())
