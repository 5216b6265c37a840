"""Unit tests: one process, no pool of ranks, nothing launched (``pytest tests/unit``, under a
minute)."""
