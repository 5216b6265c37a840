"""``balance="auto"``'s predicted step time against the measured one, on the configurations of
``schedules.py``: both models (the residual MLP and the GPT-like model), p = 2, m = p, 2p and 4p,
every schedule asked for (``--schedules``; DualPipeV from m = 2p), ``--rounds`` times A B A B
(each configuration's median ratio over the rounds). The strategy profiles, plans and runs as a user's
run does (the micro-batch count given, so that the plan is for the measured configuration);
the prediction is the plan's ``step_time`` and the measurement rank 0's median step after the
warm-up. Prints measured / predicted per configuration and writes
``benchmarks/results/auto_accuracy.json``::

    python benchmarks/auto_accuracy.py            # a round: about 1 minute (MLP), 10 (GPT)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _one_model(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ranks import RankPool
    from schedules import _env, run_ours

    rows: list[dict[str, Any]] = []
    configs = [
        (factor * args.ranks, schedule)
        for factor in args.mb_factors
        for schedule in args.schedules
        if not (schedule == "dualpipe-v" and factor < 2)  # DualPipeV needs m >= 2p
    ]
    with _env(OMP_NUM_THREADS="1"):
        pool = RankPool(args.ranks)
        try:
            for round_ in range(args.rounds):
                # A B A B: every other round in reverse, so that the machine's drift evens out
                for m, schedule in configs if round_ % 2 == 0 else configs[::-1]:
                    ranks = pool.run(
                        run_ours, schedule, m, args.batch_size, args.warmup, args.steps,
                        timeout=900, balance="auto",
                    )  # fmt: skip
                    rank0 = next(r for r in ranks if r["rank"] == 0)
                    measured = statistics.median(rank0["step_s"])
                    predicted = rank0["predicted_step_s"]
                    rows.append(
                        {
                            "model": os.environ["PIPE2BW_BENCH_MODEL"],
                            "round": round_,
                            "schedule": schedule,
                            "p": args.ranks,
                            "m": m,
                            "plan": rank0["plan"],
                            "predicted_step_s": predicted,
                            "measured_step_s": measured,
                            "measured_over_predicted": measured / predicted,
                            "predicted_compute_s": rank0["predicted_compute_s"],
                            "predicted_comm_s": rank0["predicted_comm_s"],
                            # where each rank's time went: seconds per step by action kind
                            "ranks": [_per_step(r) for r in sorted(ranks, key=lambda r: r["rank"])],
                        }
                    )
                    print(
                        f"{rows[-1]['model']:>4} {schedule:>16} p={args.ranks} m={m:<3} predicted "
                        f"{predicted * 1e3:8.2f} ms  measured {measured * 1e3:8.2f} ms  "
                        f"measured/predicted {measured / predicted:5.2f}",
                        flush=True,
                    )
        finally:
            pool.close()
    return rows


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each configuration's median measured/predicted ratio over its rounds (each round's ratio
    pairs that run's own prediction, from its own profile, with its own measurement)."""
    by: dict[tuple[str, str, int], list[float]] = {}
    for r in rows:
        by.setdefault((r["model"], r["schedule"], r["m"]), []).append(r["measured_over_predicted"])
    return [
        {
            "model": model,
            "schedule": schedule,
            "m": m,
            "rounds": len(ratios),
            "measured_over_predicted": statistics.median(ratios),
        }
        for (model, schedule, m), ratios in by.items()
    ]


def _per_step(rank: dict[str, Any]) -> dict[str, Any]:
    """One rank's timed steps, per step: wall, and the count and seconds of each action kind."""
    n = rank["steps"]
    return {
        "rank": rank["rank"],
        "wall_s": rank["wall_s"] / n,
        "by_kind": {k: [c / n, s / n] for k, (c, s) in rank["by_kind"].items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument(
        "--schedules", default="1f1b,2bw,zb-h1,interleaved-1f1b,zb-v,2bw-v,dualpipe-v"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="every configuration once per round (A B A B); "
        "the summary takes each configuration's median over the rounds",
    )  # fmt: skip
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mb-factors", default="1,2,4")
    parser.add_argument("--batch-size", type=int, default=0, help="0: 128 (mlp), 32 (gpt)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "auto_accuracy.json"))
    args = parser.parse_args(argv)
    args.schedules = args.schedules.split(",")
    args.mb_factors = [int(f) for f in str(args.mb_factors).split(",")]
    if args.child:  # one model per process: schedules.py reads the model at import
        rows = _one_model(args)
        sys.stdout.write("ROWS " + json.dumps(rows) + "\n")
        return
    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        batch = args.batch_size or (32 if model == "gpt" else 128)
        command = [
            sys.executable, __file__, "--child", "--schedules", ",".join(args.schedules),
            "--ranks", str(args.ranks), "--mb-factors", ",".join(map(str, args.mb_factors)),
            "--batch-size", str(batch), "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--rounds", str(args.rounds),
        ]  # fmt: skip
        env = {**os.environ, "PIPE2BW_BENCH_MODEL": model}
        out = subprocess.run(command, env=env, capture_output=True, text=True, cwd=HERE)
        lines = [line for line in out.stdout.splitlines() if not line.startswith("ROWS ")]
        print("\n".join(lines), flush=True)
        found = [line for line in out.stdout.splitlines() if line.startswith("ROWS ")]
        if not found:
            print(out.stderr[-3000:])
            raise SystemExit(f"the {model} runs failed")
        rows.extend(json.loads(found[0][5:]))
    summary = _summary(rows)
    ratios = [r["measured_over_predicted"] for r in summary]
    within = sum(1 for x in ratios if abs(x - 1) <= 0.2)
    if args.rounds > 1:
        print(f"\nmedians over {args.rounds} rounds:")
        for r in summary:
            print(
                f"{r['model']:>4} {r['schedule']:>16} m={r['m']:<3} {r['measured_over_predicted']:5.2f}"
            )
    print(
        f"\nmeasured/predicted: median {statistics.median(ratios):.2f}, range "
        f"{min(ratios):.2f}-{max(ratios):.2f}; {within} of {len(ratios)} within 20%"
    )
    RESULTS.mkdir(exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "summary": summary, "rows": rows}, indent=2)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
