"""``python -m lightning_pipe2bw.train``: the main job (``make train``), kept at this name.

The job is a recipe, not part of the library: everything is in
:mod:`lightning_pipe2bw.recipes.gpt.train` (see its notes for the command line and the outputs),
whose names this module re-exports.
"""

from lightning_pipe2bw.recipes.gpt.train import (
    RESULT_FILE,
    SUMMARY_FILE,
    RunResult,
    StepProgressBar,
    SweepSummary,
    build_callbacks,
    format_table,
    main,
    run,
    summarize_sweep,
)

__all__ = [
    "RESULT_FILE",
    "SUMMARY_FILE",
    "RunResult",
    "StepProgressBar",
    "SweepSummary",
    "build_callbacks",
    "format_table",
    "main",
    "run",
    "summarize_sweep",
]

if __name__ == "__main__":
    main()
