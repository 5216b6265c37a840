"""What the intake's observed forward and the set-up check (``check_split``) cost, against one
training step of the whole model on one process.

    python benchmarks/guard_cost.py [--rounds 3] [--out benchmarks/results/guard_cost.json]

For Hugging Face GPT-2 at two sizes and BERT (sequence classification), on one micro-batch:
- ``static``: the split from registration order (no forward run: what a model built on the meta
  device gets);
- ``observed``: one forward with module hooks (the intake), then the split;
- ``observed + check``: the same, plus the split run block after block and compared with the
  whole model's output (``check_split=True``, the default);
- ``step``: one forward and backward of the whole model on the same micro-batch, for scale.
Rounds are interleaved (static, observed, checked, step, static, ...); the table gives medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from lightning_pipe2bw.partition.hf import pipe_model_for
from lightning_pipe2bw.partition.split import check_split
from lightning_pipe2bw.runtime.call import BodyInput

transformers.logging.set_verbosity_error()


def gpt2(layers: int, width: int) -> nn.Module:
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64)
    return transformers.GPT2LMHeadModel(config)


def bert() -> nn.Module:
    return transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=3))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], BodyInput]]] = {
    "gpt2 6x384": (
        lambda: gpt2(6, 384),
        lambda: BodyInput(
            (), {"input_ids": (ids := torch.randint(0, 50257, (4, 128))), "labels": ids}
        ),
    ),
    "gpt2 12x768": (
        lambda: gpt2(12, 768),
        lambda: BodyInput(
            (), {"input_ids": (ids := torch.randint(0, 50257, (4, 128))), "labels": ids}
        ),
    ),
    "bert-base cls": (
        bert,
        lambda: BodyInput(
            (),
            {"input_ids": torch.randint(0, 30522, (4, 128)), "labels": torch.randint(0, 3, (4,))},
        ),
    ),
}


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(model: nn.Module, call: BodyInput, rounds: int) -> dict[str, float]:
    """Median seconds of each way, over interleaved rounds."""

    def static() -> None:
        spec = pipe_model_for(model)
        assert spec is not None
        spec.body()

    def observed() -> None:
        spec = pipe_model_for(model, call)
        assert spec is not None
        spec.body()

    def checked() -> None:
        spec = pipe_model_for(model, call)
        assert spec is not None
        check_split(spec, spec.body(), call)

    def step() -> None:
        model.zero_grad()
        model(*call.args, **call.kwargs).loss.backward()

    ways = {"static": static, "observed": observed, "checked": checked, "step": step}
    times: dict[str, list[float]] = {k: [] for k in ways}
    step()  # warm-up
    for _ in range(rounds):
        for key, fn in ways.items():
            times[key].append(_timed(fn))
    return {f"{k}_s": statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/guard_cost.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, (build, make_call) in MODELS.items():
        model = build()
        params = sum(p.numel() for p in model.parameters())
        rows.append(
            {"model": name, "params_m": params / 1e6, **measure(model, make_call(), args.rounds)}
        )
        print(f"done {name}", flush=True)
    print(
        f"\nset-up cost of the intake and the check, one micro-batch of 4 x 128, {torch.get_num_threads()} threads"
    )
    print(
        "| model | params (M) | static (s) | observed (s) | observed + check (s) | one step (s) | check / step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['model']} | {r['params_m']:.0f} | {r['static_s']:.3f} | {r['observed_s']:.3f} | "
            f"{r['checked_s']:.3f} | {r['step_s']:.3f} | {r['checked_s'] / r['step_s']:.2f}x |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
