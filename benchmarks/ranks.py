"""The test suite's pool of local gloo ranks (``tests/helpers/pool.py``), for the benchmarks.

The pool is test and benchmark infrastructure, not part of the library, so it lives with the
tests; this module puts the tests directory on the path and re-exports it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.pool import RankPool, TaskError

__all__ = ["RankPool", "TaskError"]
