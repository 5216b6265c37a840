"""The test suite's pool of local gloo ranks (``tests/helpers/pool.py``), for the benchmarks.

The pool is test and benchmark infrastructure, not part of the library, so it lives with the
tests; this module puts the tests directory on the path and re-exports it.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
# after this directory, not before it: the tests hold a package named ``ranks`` (tests/ranks), and
# the pool's workers start with this sys.path and run the benchmark's imports again, so they
# must find this module under that name
_at = next(
    (i + 1 for i, p in enumerate(sys.path) if Path(p).resolve() == BENCHMARKS), len(sys.path)
)
sys.path.insert(_at, str(BENCHMARKS.parent / "tests"))

from helpers.pool import RankPool, TaskError  # noqa: E402

__all__ = ["RankPool", "TaskError"]
