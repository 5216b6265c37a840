"""The planner at the PipeDream-2BW paper's scale: GPT 1.3B, 2.2B and 3.8B on 8 x 8 V100.

Nothing is measured: each model's profile comes from an analytic FLOP and byte model of its
blocks, the machine is described by a few stated numbers (``ASSUMPTIONS``), and the planner
(:func:`lightning_pipe2bw.planner.planner.plan`) picks the best configuration for GPipe,
PipeDream-Flush (1F1B) and PipeDream-2BW at a small and a large global batch. It prints one
markdown table and writes ``benchmarks/results/paper_scale.json``. Run from the repository root::

    python benchmarks/paper_scale.py            # a few seconds

The model of a transformer layer (hidden h, a heads, sequence s, micro-batch b):

* forward FLOPs 24 b s h^2 + 4 b s^2 h (Narayanan et al., "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", SC 2021, eq. 2 without the logit layer);
  backward 2 x forward;
* activation bytes saved for the backward, mixed precision, no tensor or sequence parallelism:
  s b h (34 + 5 a s / h) = 34 s b h + 5 a s^2 b (Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models", MLSys 2023, eq. 1);
* parameters 12 h^2 + 13 h, stored in fp16 (2 bytes); the gradient is fp16 too (counted by the
  planner as 1 x the parameter bytes); fp32 master weights and Adam's two fp32 moments are 12
  bytes per parameter, i.e. ``optimizer_bytes_per_param_byte = 6.0``. Per parameter that is 16
  bytes with one weight version (GPipe, 1F1B) and 18 with 2BW's two fp16 versions.

The embedding (token and position tables) is the first block and the final layer norm with the
LM head and the loss is the last block (an untied copy of the token table, as Megatron keeps on
the last pipeline stage; the all-reduce that keeps the two copies equal is ignored). The head's
forward is 2 b s h V FLOPs and it saves its input, the fp16 logits and their fp32 softmax
(6 b s V bytes). The embedding's time is its memory traffic at 900 GB/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from lightning_pipe2bw.planner.planner import Cluster, plan
from lightning_pipe2bw.planner.plans import Plan
from lightning_pipe2bw.planner.profile import BlockProfile, Profile, ProfileSet

__all__ = [
    "ASSUMPTIONS",
    "MODELS",
    "VARIANTS",
    "gpt_profile",
    "gpt_profiles",
    "main",
    "v100_cluster",
]

MODELS: dict[str, tuple[int, int]] = {  # name: (layers, hidden)
    "GPT 1.3B": (24, 2048),
    "GPT 2.2B": (32, 2304),
    "GPT 3.8B": (32, 3072),
}
ASSUMPTIONS: dict[str, Any] = {
    "sequence": 512,
    "vocabulary": 50257,
    "head_dim": 128,  # heads = hidden / 128: 16, 18 and 24
    # V100 fp16 tensor cores: 125 TFLOP/s peak. Sustained: 50 TFLOP/s for large products,
    # falling for small micro-batches as tokens / (tokens + 512) (b = 1: 25, b = 8: 44 TFLOP/s)
    "sustained_flops": 50e12,
    "half_efficiency_tokens": 512,
    "hbm_bandwidth": 900e9,
    "devices": 64,
    "devices_per_node": 8,  # AWS p3.16xlarge: 8 x V100 16 GB, NVLink inside a server
    "memory_bytes": 0.9 * 16e9,  # 10% of the 16 GB kept for the CUDA context and workspaces
    "intra_node_bandwidth": 25e9,  # one NVLink 2.0 link, one direction
    "inter_node_bandwidth": 25e9 / 8,  # 25 Gbit/s Ethernet between p3.16xlarge servers
    "latency_s": 20e-6,
    "bytes_per_param": 2,  # fp16 weights
    "optimizer_bytes_per_param_byte": 6.0,  # fp32 master (4) + Adam m, v (8) per 2 fp16 bytes
    "batch_sizes": (64, 512),
    "microbatch_sizes": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
}
# (label, schedule, recompute): the three schedules with the planner's full search, and GPipe
# with recomputation on every stage, as the GPipe paper runs it
VARIANTS = (
    ("gpipe", "gpipe", "search"),
    ("1f1b", "1f1b", "search"),
    ("2bw", "2bw", "search"),
    ("gpipe_rc", "gpipe", "on"),
)


def _seconds(flops: float, tokens: int) -> float:
    k = ASSUMPTIONS["half_efficiency_tokens"]
    return flops / (ASSUMPTIONS["sustained_flops"] * tokens / (tokens + k))


def gpt_profile(layers: int, hidden: int, microbatch_size: int) -> Profile:
    """The analytic profile of a GPT body at micro-batch size b (see the module docstring)."""
    s, v, h, b = ASSUMPTIONS["sequence"], ASSUMPTIONS["vocabulary"], hidden, microbatch_size
    a = hidden // ASSUMPTIONS["head_dim"]
    tokens, wb = b * s, ASSUMPTIONS["bytes_per_param"]
    hidden_bytes = 2 * tokens * h  # one fp16 activation of the residual stream
    embed_params = (v + s) * h
    embed_time = (2 * tokens * h + 8 * tokens) / ASSUMPTIONS["hbm_bandwidth"]
    blocks = [
        BlockProfile(
            "embed", embed_time, 2 * embed_time, hidden_bytes, 8 * tokens, wb * embed_params
        )
    ]
    layer_flops = 24 * tokens * h * h + 4 * b * s * s * h
    for i in range(layers):
        blocks.append(
            BlockProfile(
                str(i),
                forward_s=_seconds(layer_flops, tokens),
                backward_s=_seconds(2 * layer_flops, tokens),
                output_bytes=hidden_bytes,
                saved_bytes=34 * tokens * h + 5 * a * s * s * b,
                param_bytes=wb * (12 * h * h + 13 * h),
            )
        )
    head_flops = 2 * tokens * h * v
    blocks.append(
        BlockProfile(
            "head",
            forward_s=_seconds(head_flops, tokens),
            backward_s=_seconds(2 * head_flops, tokens),
            output_bytes=4,
            saved_bytes=hidden_bytes + 6 * tokens * v,
            param_bytes=wb * (v * h + 2 * h),
        )
    )
    return Profile(b, 8 * tokens, tuple(blocks), device="V100 (analytic)")


def gpt_profiles(layers: int, hidden: int) -> ProfileSet:
    """Profiles at every micro-batch size the search can ask for (no interpolation)."""
    sizes = ASSUMPTIONS["microbatch_sizes"]
    return ProfileSet(tuple(gpt_profile(layers, hidden, b) for b in sizes))


def v100_cluster() -> Cluster:
    a = ASSUMPTIONS
    return Cluster(
        num_devices=a["devices"],
        devices_per_node=a["devices_per_node"],
        memory_bytes=a["memory_bytes"],
        intra_node_bandwidth=a["intra_node_bandwidth"],
        inter_node_bandwidth=a["inter_node_bandwidth"],
        latency_s=a["latency_s"],
    )


def _cell(p: Plan | None) -> str:
    if p is None:
        return "does not fit"
    return (
        f"w={p.data_parallel} d={p.depth} b={p.microbatch_size} m={p.num_microbatches} "
        f"rc={p.recompute_label}: {p.throughput:.1f}"
    )


def _ratio(row: dict[str, Any], other: str) -> float | None:
    a, b = row["best"]["2bw"], row["best"][other]
    return None if a is None or b is None else a.throughput / b.throughput


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "paper_scale.json"
    )
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=0.9,
        help="share of the 16 GB a stage may use (default 0.9)",
    )
    args = parser.parse_args(argv)
    if not 0 < args.memory_fraction <= 1:
        parser.error(f"--memory-fraction must be in (0, 1], got {args.memory_fraction}")
    ASSUMPTIONS["memory_bytes"] = args.memory_fraction * 16e9
    cluster = v100_cluster()
    ratio = ASSUMPTIONS["optimizer_bytes_per_param_byte"]
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name, (layers, hidden) in MODELS.items():
        profiles = gpt_profiles(layers, hidden)
        blocks = profiles.profiles[0].blocks
        params = sum(blk.param_bytes for blk in blocks) // ASSUMPTIONS["bytes_per_param"]
        for batch in ASSUMPTIONS["batch_sizes"]:
            best: dict[str, Plan | None] = {}
            errors: dict[str, str] = {}
            for label, schedule, recompute in VARIANTS:
                try:
                    result = plan(
                        profiles,
                        cluster,
                        batch,
                        schedule,
                        recompute=recompute,
                        optimizer_bytes_per_param_byte=ratio,
                    )
                    best[label] = result.best
                except ValueError as error:
                    best[label], errors[label] = None, str(error)
            rows.append(
                {"model": name, "params": params, "batch": batch, "best": best, "errors": errors}
            )
    elapsed = time.perf_counter() - started

    print(
        f"Planner picks on {cluster.num_devices} V100 16 GB ({cluster.num_nodes} servers x "
        f"{cluster.devices_per_node}), {cluster.memory_bytes / 1e9:.1f} GB usable per GPU, "
        f"sequence {ASSUMPTIONS['sequence']}; cells: w, d, b, m, recompute: predicted samples/s\n"
    )
    print(
        "| model | batch | GPipe | PipeDream-Flush (1F1B) | PipeDream-2BW | 2BW / GPipe "
        "| 2BW / 1F1B | 2BW / GPipe (recompute always) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        cells = " | ".join(_cell(row["best"][k]) for k in ("gpipe", "1f1b", "2bw"))
        print(
            f"| {row['model']} | {row['batch']} | {cells} | {_x(_ratio(row, 'gpipe'))} | "
            f"{_x(_ratio(row, '1f1b'))} | {_x(_ratio(row, 'gpipe_rc'))} |"
        )
    print(f"\n{len(rows) * len(VARIANTS)} planner calls in {elapsed:.2f} s", file=sys.stderr)

    out = {
        "assumptions": ASSUMPTIONS,
        "cluster": cluster.to_dict(),
        "planner_seconds": elapsed,
        "results": [
            {
                "model": row["model"],
                "params": row["params"],
                "global_batch_size": row["batch"],
                "plans": {k: (None if p is None else p.to_dict()) for k, p in row["best"].items()},
                "errors": row["errors"],
                "2bw_over_gpipe": _ratio(row, "gpipe"),
                "2bw_over_1f1b": _ratio(row, "1f1b"),
                "2bw_over_gpipe_recompute": _ratio(row, "gpipe_rc"),
            }
            for row in rows
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
