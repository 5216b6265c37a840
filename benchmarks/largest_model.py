"""The widest GPT that trains within a per-rank memory budget, measured and predicted, for each
schedule with each memory lever (nothing, recomputation, ZeRO-1, FSDP), on 4 CPU ranks.

The model is the recipe's (``lightning_pipe2bw.recipes.gpt``): ``[Embeddings, 8 Blocks, LMHead]``,
sequence 128, vocabulary 256, 4 heads, AdamW; only the width varies (multiples of 64). Every
configuration runs on 2 replicas of a 2-stage pipeline (4 processes, one thread each), batch 16 per
replica in 4 micro-batches, so that the sharding options have replicas to shard over and every
configuration the same layout.

* **Measured**: the largest width whose 3 training steps stay within the budget on every rank
  (``memory_prediction.measured_fit``: each rank's resident high-water mark over its training
  above what it held at the first batch, plus its weights then), found by bisection over the
  widths (the peak grows with the width).
* **Predicted**: the largest width the planner's cost model (``CostModel`` on ``profile_blocks``
  of the same blocks at that width, for the split the strategy makes by default) keeps within
  the budget on every stage.

    python benchmarks/largest_model.py                         # 256 MiB a rank: ~20 minutes
    python benchmarks/largest_model.py --budget-mib 192 --schedules 1f1b,2bw --options none

Writes ``benchmarks/results/largest_model.json`` and prints a table. Nothing here is asserted by
tests.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import memory_prediction
import schedules
from ranks import RankPool, TaskError

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = ("gpipe", "1f1b", "2bw", "pipedream")
OPTIONS = ("none", "recompute", "shard_optimizer", "fsdp")
BLOCKS, SEQ, VOCAB, HEADS = 8, 128, 256, 4
REPLICAS, STAGES, MICROBATCHES = 2, 2, 4


def make_body(width: int) -> Any:
    """``[Embeddings, BLOCKS Blocks, LMHead]`` of the recipe at ``width``, the same weights in
    every process."""
    import torch
    from torch import nn

    from lightning_pipe2bw.recipes.gpt.model import Block, Embeddings, LMHead

    torch.manual_seed(0)
    blocks = [Block(width, HEADS) for _ in range(BLOCKS)]
    return nn.Sequential(Embeddings(VOCAB, SEQ, width), *blocks, LMHead(width, VOCAB))


def make_data(batch: int, num_batches: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (batch * num_batches, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def refused(schedule: str, option: str) -> str | None:
    """Why the strategy refuses ``option`` with ``schedule`` (None: it runs)."""
    from lightning_pipe2bw.schedule.registry import schedule_spec

    if option == "fsdp" and not schedule_spec(schedule).flushes:
        return "refused: FSDP with a second weight version"
    return None


def run(schedule: str, option: str, width: int, batch: int, steps: int) -> Any:
    """Runs on every rank: one fit of the recipe's GPT at ``width``; this rank's figures."""
    import torch
    from lightning.pytorch import LightningModule

    from lightning_pipe2bw import Pipe2BWStrategy

    class GPT(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = make_body(width)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            logits = self.body(x)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    kwargs = {} if option == "none" else {option: True}
    strategy = Pipe2BWStrategy(
        schedule=schedule, microbatches=MICROBATCHES, data_parallel=REPLICAS, **kwargs
    )
    data = make_data(batch, REPLICAS * steps)
    return memory_prediction.measured_fit(GPT(), strategy, batch, steps, REPLICAS, data=data)


def predicted_peak(schedule: str, option: str, width: int, batch: int) -> float:
    """The cost model's largest stage memory at ``width`` for the default split."""
    import torch

    from lightning_pipe2bw.partition.balance import balance_by_weights
    from lightning_pipe2bw.partition.cost import multiplied_parameters
    from lightning_pipe2bw.planner.measure import profile_blocks
    from lightning_pipe2bw.schedule.registry import schedule_spec

    torch.set_num_threads(1)
    blocks = list(make_body(width).children())
    x, _ = make_data(batch // MICROBATCHES, 1)
    profile = profile_blocks(blocks, x, warmup=0, repeats=1)
    spec = schedule_spec(schedule)
    balance = balance_by_weights(
        multiplied_parameters(blocks), STAGES * spec.stages_per_rank, spec.placement_for(STAGES)
    )
    return float(max(memory_prediction.stage_memories(
        profile, schedule, option, REPLICAS, MICROBATCHES, list(balance)
    )))  # fmt: skip


def largest(fits: Any, widths: list[int]) -> tuple[int | None, dict[int, Any]]:
    """The largest of ``widths`` (ascending) for which ``fits(width)`` holds, by bisection
    (``fits`` is monotone: true up to a width, false after); the figures of every width tried."""
    tried: dict[int, Any] = {}
    lo, hi = -1, len(widths)  # widths[lo] fits (-1: none known), widths[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok, figures = fits(widths[mid])
        tried[widths[mid]] = figures
        lo, hi = (mid, hi) if ok else (lo, mid)
    return (widths[lo] if lo >= 0 else None), tried


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=float, default=256.0, help="per rank")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--options", default=",".join(OPTIONS))
    parser.add_argument("--widths", default="128,1024", help="the smallest and largest width")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per replica")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/largest_model.json")
    ns = parser.parse_args()
    lo, hi = (int(w) for w in ns.widths.split(","))
    widths = list(range(lo, hi + 1, 64))
    budget = ns.budget_mib * 2**20
    started = time.perf_counter()
    rows = []
    pool = RankPool(REPLICAS * STAGES, run_id="largest", initializer=schedules._quiet)
    try:
        pool.run(run, "1f1b", "none", widths[0], ns.batch_size, 1)  # what every fit reuses
        for schedule in ns.schedules.split(","):
            for option in ns.options.split(","):
                reason = refused(schedule, option)
                if reason is not None:
                    rows.append({"schedule": schedule, "option": option, "refused": reason})
                    continue

                def measured(width: int, schedule: str = schedule, option: str = option) -> Any:
                    try:
                        ranks = pool.run(run, schedule, option, width, ns.batch_size, ns.steps)
                    except TaskError as err:  # out of memory is not expected below the budget
                        return False, {"failed": err.reason}
                    peak = max(r["measured_peak_bytes"] for r in ranks)
                    print(f"  {schedule} {option} width {width}: {peak / 2**20:.1f} MiB", flush=True)
                    return peak <= budget, {"peak_bytes": peak, "ranks": ranks}

                def predicted(width: int, schedule: str = schedule, option: str = option) -> Any:
                    peak = predicted_peak(schedule, option, width, ns.batch_size)
                    return peak <= budget, {"peak_bytes": peak}

                got, tried = largest(measured, widths)
                want, guessed = largest(predicted, widths)
                rows.append({"schedule": schedule, "option": option, "measured_width": got,
                             "predicted_width": want, "tried": tried, "predicted": guessed})  # fmt: skip
                print(f"{schedule} {option}: measured {got}, predicted {want}", flush=True)
    finally:
        pool.close()
    print()
    print(f"| schedule | nothing | recompute | ZeRO-1 | FSDP |  (widest GPT within "
          f"{ns.budget_mib:g} MiB a rank: measured / predicted)")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for schedule in ns.schedules.split(","):
        cells = []
        for option in OPTIONS:
            row = next((r for r in rows if (r["schedule"], r["option"]) == (schedule, option)), None)
            if row is None:
                cells.append("-")
            elif "refused" in row:
                cells.append("refused")
            else:
                cells.append(f"{row['measured_width']} / {row['predicted_width']}")
        print(f"| `{schedule}` | " + " | ".join(cells) + " |")
    note = (f"budget {ns.budget_mib:g} MiB a rank; widths {lo}-{hi} in steps of 64; "
            f"{REPLICAS} replicas x {STAGES} stages, batch {ns.batch_size} a replica, "
            f"{MICROBATCHES} micro-batches, {ns.steps} steps; {time.perf_counter() - started:.0f} s")  # fmt: skip
    print(note)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"note": note, "rows": rows}, indent=1, default=str) + "\n")
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
