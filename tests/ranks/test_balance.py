"""Balance modes on the pool's ranks: ``balance="params"`` evens out parameters, ``"uniform"``
splits evenly. The partitioner they rest on: ``tests/unit/test_balance.py``."""

from __future__ import annotations

from helpers import workers

from lightning_pipe2bw.partition.balance import balance_by_weights


def test_balance_params_splits_by_parameter_count(pools) -> None:
    """The test body's first and last blocks are small (input and output projections), the
    middle blocks equal: by parameters, 3 stages take (3, 2, 3) blocks; evenly, (2, 3, 3)."""
    from helpers.models import RegressionModel

    body = RegressionModel().body
    counts = [sum(p.numel() for p in b.parameters()) for b in body]
    expected = balance_by_weights(counts, 3)
    assert expected == (3, 2, 3)
    results = pools(3).run(workers.fit, "1f1b", 4, 1, balance="params")
    got = tuple(len(r["blocks"]) for r in sorted(results, key=lambda r: r["stage"]))
    assert got == expected
    uniform = pools(3).run(workers.fit, "1f1b", 4, 1, balance="uniform")
    assert tuple(len(r["blocks"]) for r in sorted(uniform, key=lambda r: r["stage"])) == (2, 3, 3)
