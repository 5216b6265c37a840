"""What the split guard costs on a run whose batches change shape, and what learning every
layer's arguments costs per micro-batch.

    python benchmarks/shape_guard.py [--rounds 3] [--out benchmarks/results/shape_guard.json]

A Hugging Face Gemma 2 (sliding-window and full-attention layers: 6 layers, width 256, 4 heads
of 64, vocabulary 512, window 64), batch 16 in 4 micro-batches, trained on 2 CPU ranks (gloo, one
thread each) with ``1f1b`` for 24 steps whose sequence length cycles through 8 values (48, 64,
..., 160 tokens): each length is new to the guard once (its probe runs on the first stage's
first block and on the last stage's replay, ``partition.guard``), then seen 2 more times. The
same run with ``check_split=False`` (no set-up check, no guard) gives the base. Interleaved
rounds (on, off, on, off, ...); the table gives medians and the extra seconds per new shape.

Second table, one process: the first block's time per micro-batch (the model's forward up to
its layers, run with a stand-in per layer that records the layer's call) against the whole
model's forward on the same micro-batch, at 64 and 160 tokens.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_pressure_60s
from ranks import RankPool

RESULTS = Path(__file__).resolve().parent / "results"
LENGTHS = tuple(range(48, 161, 16))  # 8 lengths
CYCLES, BATCH, M = 3, 16, 4


def _model() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=512, sliding_window=64,
        max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.Gemma2ForCausalLM(config)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(CYCLES):
        for n in LENGTHS:
            ids = torch.randint(1, 512, (BATCH, n), generator=g)
            out.append((ids, ids))
    return out


def _fit(check: bool) -> dict[str, Any]:
    """One timed run on this rank of the pool: each step's seconds."""
    import torch.distributed as dist
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch.utils.data import DataLoader

    from lightning_pipe2bw import Pipe2BWStrategy

    torch.set_num_threads(1)

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return self.model(input_ids=x, labels=y).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    marks: list[float] = []

    class Clock(Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            if not marks:
                marks.append(time.perf_counter())

        def on_train_batch_end(self, *args: Any) -> None:
            marks.append(time.perf_counter())

    batches = _batches()
    trainer = Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=Pipe2BWStrategy(schedule="1f1b", microbatches=M, check_split=check),
        max_steps=len(batches),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Clock()],
    )
    start = time.perf_counter()
    trainer.fit(Module(), DataLoader(batches, batch_size=None))  # type: ignore[arg-type]
    return {
        "fit_s": time.perf_counter() - start,
        "steps_s": [b - a for a, b in itertools.pairwise(marks)],
    }


def _first_block_cost(repeats: int = 20) -> list[dict[str, Any]]:
    """Seconds per micro-batch of the first block (capture of every layer's call) and of the
    whole model's forward, one process."""
    from lightning_pipe2bw.partition.hf import pipe_model_for
    from lightning_pipe2bw.runtime.call import BodyInput

    torch.set_num_threads(1)
    model = _model().train()
    rows = []
    for n in (64, 160):
        ids = torch.randint(1, 512, (BATCH // M, n))
        call = BodyInput((), {"input_ids": ids, "labels": ids})
        spec = pipe_model_for(model, call)
        assert spec is not None
        first = spec.body(check=False)[0]

        def timed(fn: Any) -> float:
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return statistics.median(times[2:])

        with torch.no_grad():
            capture = timed(lambda call=call, first=first: first(call))
            whole = timed(lambda ids=ids: model(input_ids=ids, labels=ids))
        rows.append({"tokens": n, "first_block_s": capture, "whole_forward_s": whole})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "shape_guard.json"))
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    pressure = cpu_pressure_60s()
    pool = RankPool(2)
    runs: dict[str, list[dict[str, Any]]] = {"guard on": [], "guard off": []}
    try:
        pool.run(_fit, False, timeout=900)  # warm-up: imports, allocator
        for _ in range(args.rounds):
            for label, check in (("guard on", True), ("guard off", False)):
                runs[label].append(pool.run(_fit, check, timeout=900)[0])
    finally:
        pool.close()
    shapes = len(LENGTHS)
    on = [sum(r["steps_s"]) for r in runs["guard on"]]
    off = [sum(r["steps_s"]) for r in runs["guard off"]]
    extra = [a - b for a, b in zip(on, off, strict=True)]
    first_cycle = [sum(r["steps_s"][:shapes]) for r in runs["guard on"]]
    first_cycle_off = [sum(r["steps_s"][:shapes]) for r in runs["guard off"]]
    later = {
        label: statistics.median(statistics.median(r["steps_s"][shapes:]) for r in runs[label])
        for label in runs
    }
    print(
        f"\nGemma 2 (6 x 256), 2 ranks x 1 thread, 1f1b, batch {BATCH} in {M}, {len(LENGTHS) * CYCLES} "
        f"steps over {shapes} lengths {LENGTHS[0]}..{LENGTHS[-1]}, {args.rounds} rounds "
        f"(CPU pressure before: {pressure})"
    )
    print("| | guard on | guard off | extra | per new shape | share of the run |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    med_on, med_off, med_extra = (statistics.median(v) for v in (on, off, extra))
    print(
        f"| training steps (s) | {med_on:.2f} | {med_off:.2f} | {med_extra:+.2f} | "
        f"{med_extra / shapes:+.3f} | {med_extra / med_off:+.1%} |"
    )
    fc_on, fc_off = statistics.median(first_cycle), statistics.median(first_cycle_off)
    print(
        f"| first cycle, every shape new (s) | {fc_on:.2f} | {fc_off:.2f} | {fc_on - fc_off:+.2f} "
        f"| {(fc_on - fc_off) / shapes:+.3f} | |"
    )
    print(
        f"| a step once every shape is known (median s) | {later['guard on']:.3f} | "
        f"{later['guard off']:.3f} | {later['guard on'] - later['guard off']:+.3f} | | |"
    )
    first = _first_block_cost()
    print("\nfirst block per micro-batch (every layer's call recorded), one process, no gradient")
    print("| tokens | first block (ms) | whole model's forward (ms) | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    for row in first:
        print(
            f"| {row['tokens']} | {row['first_block_s'] * 1e3:.2f} | "
            f"{row['whole_forward_s'] * 1e3:.2f} | {row['first_block_s'] / row['whole_forward_s']:.3f} |"
        )
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "lengths": LENGTHS,
                "pressure": pressure,
                "runs": runs,
                "first_block": first,
            },
            indent=2,
        )
    )
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
