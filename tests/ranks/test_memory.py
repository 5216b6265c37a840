"""Each rank materialises only its own stage's parameters."""

from __future__ import annotations

import torch
from helpers import workers


def test_configure_model_materialises_only_the_owned_blocks(pools) -> None:
    width, num_blocks = 2048, 8
    block_bytes = (width * width + width) * 4
    share = block_bytes * num_blocks // 2
    results = pools(2).run(workers.fit_late_built, width, num_blocks)
    for rank, r in enumerate(results):
        assert r["built_on_meta"] is True, rank
        assert r["meta_left"] is False, rank
        assert r["param_bytes"] == share, rank
        # building the whole body would add 2 * share; allow the share plus a quarter of it for
        # the rest of set-up (gradients come later, at the first backward)
        increase = r["peak_increase_bytes"]
        print(
            f"rank {rank}: peak RSS increase during set-up {increase / 2**20:.1f} MiB, share {share / 2**20:.1f} MiB"
        )
        assert increase < share * 1.25, (rank, increase, share)
    # a block's initial weights depend on the seed and its index only, not on the partition:
    # block i is initialised by reset_parameters() under seed (42 + i)
    seen = []
    for r in results:
        for i in r["blocks"]:
            torch.manual_seed(42 + i)
            ref = torch.nn.Linear(width, width, device="meta").to_empty(device="cpu")
            ref.reset_parameters()
            torch.testing.assert_close(
                r["initial_state"][f"body.{i}.weight"], ref.weight, rtol=0, atol=0
            )
            torch.testing.assert_close(
                r["initial_state"][f"body.{i}.bias"], ref.bias, rtol=0, atol=0
            )
            seen.append(i)
    assert sorted(seen) == list(range(num_blocks))
