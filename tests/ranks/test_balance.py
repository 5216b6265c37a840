"""Balance modes on the pool's ranks: the default evens out modelled cost (a language model's
[embedding, N blocks, head] is cut as torch cuts it; ranks holding several stages are evened
out), ``balance="params"`` evens out parameters, ``"uniform"`` splits evenly, a given list is
kept, and the stage table says which rule split the body. The partitioner they rest on:
``tests/unit/test_balance.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import workers
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe2bw.partition.balance import balance_by_weights
from lightning_pipe2bw.recipes.gpt.model import Block, Embeddings, LMHead

VOCAB, SEQ, WIDTH = 64, 8, 32


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


class TinyLM(LightningModule):
    """[embedding, N pre-LN blocks, LN + head], written for one device."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            Embeddings(VOCAB, SEQ, WIDTH), *[Block(WIDTH, 2) for _ in range(blocks)],
            LMHead(WIDTH, VOCAB),
        )  # fmt: skip
        self.steps_seen = 0

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.steps_seen += 1  # a side effect the set-up must not repeat
        x, y = batch
        return nn.functional.cross_entropy(self.body(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit_lm(schedule: str, blocks: int, **strategy_kwargs: Any) -> dict[str, Any]:
    """Runs on every rank: 2 steps of :class:`TinyLM`, and the split the strategy chose."""
    import torch.distributed as dist
    from helpers.models import quiet_trainer

    from lightning_pipe2bw import Pipe2BWStrategy

    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=4, **strategy_kwargs)
    model = TinyLM(blocks)
    tokens = torch.randint(0, VOCAB, (16, SEQ + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=2)
    trainer.fit(model, data)
    assert strategy.split is not None
    return {
        "balance": strategy.split.balance,
        "rule": strategy.split.rule,
        "line": strategy.split.describe(),
        "loads": strategy.split.loads,
        "steps_seen": model.steps_seen,
        "stage": strategy.stage,
        "blocks": list(strategy.engine.body.indices) if strategy.engine else [],
    }


def test_the_default_split_cuts_a_language_model_as_torch_does(pools) -> None:
    """[embedding, 8 blocks, head] on 4 ranks: 2 blocks a stage, the embedding on the first,
    the head on the last (the old default, even module counts, gave (2, 2, 3, 3)); the same
    on every rank; the stage table's line names the rule; the user's step ran only for the
    micro-batches (nothing at set-up)."""
    results = pools(4).run(_fit_lm, "1f1b", 8)
    assert {r["balance"] for r in results} == {(3, 2, 2, 3)}
    assert all(r["rule"] == "parameters that multiply" for r in results)
    assert results[0]["line"].startswith("split: parameters that multiply; modelled cost")
    assert max(results[0]["loads"]) / min(results[0]["loads"]) <= 1.10
    assert all(r["steps_seen"] == 2 * 4 for r in results if r["stage"] == 3)
    given = pools(4).run(_fit_lm, "1f1b", 8, balance=[3, 3, 2, 2])
    assert {(r["balance"], r["rule"]) for r in given} == {((3, 3, 2, 2), "given (balance)")}


@pytest.mark.parametrize("schedule", ["dualpipe-v", "2bw-v", "interleaved-1f1b"])
def test_the_default_split_evens_out_ranks_holding_two_stages(pools, schedule: str) -> None:
    """[embedding, 6 blocks, head] on 2 ranks of 2 stages each: what each rank runs in all is
    within 10% of the other (even module counts, 2 a stage, gave a V's ranks 2 blocks and 4);
    every rank holds the blocks of its two stages."""
    results = pools(2).run(_fit_lm, schedule, 6)
    loads = results[0]["loads"]
    assert len(loads) == 2 and max(loads) / min(loads) <= 1.10, results[0]["line"]
    assert sorted(b for r in results for b in r["blocks"]) == list(range(8))


def test_balance_flops_counts_on_rank_0_and_tells_every_rank(pools) -> None:
    """``balance="flops"`` runs the step once, on global rank 0 at set-up, to the body, and
    every rank splits by what it counted."""
    results = pools(2).run(_fit_lm, "1f1b", 6, balance="flops")
    assert {(r["balance"], r["rule"]) for r in results} == {
        ((4, 4), "forward FLOPs on the first micro-batch (flops)")
    }
    # global rank 0 holds the last stage: its step ran for the 8 micro-batches and once more
    assert [r["steps_seen"] for r in results if r["stage"] == 1] == [2 * 4 + 1]
