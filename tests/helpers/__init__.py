"""What the tests share: small models and their single-device references (``models``,
``hf_models``), functions the ranks of a pool run (``workers``, ``repartition_workers``), the
pool of ranks itself (``pool``), and scripts the launch tests start as processes (``jobs/``).

The tests directory is on ``sys.path`` (pytest's ``pythonpath`` in pyproject.toml; a job
script puts it there itself), so these import as ``helpers.<module>`` in the test process, in the pool's ranks and
in launched processes alike: a function a rank unpickles is found by that name.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["JOBS", "ROOT"]

JOBS = Path(__file__).resolve().parent / "jobs"  # scripts the launch tests run as files
ROOT = Path(__file__).resolve().parents[2]  # the repository
