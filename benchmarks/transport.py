"""What a message costs a computing rank: the pipeline's two transports between two CPU ranks.

Two ranks (one intra-op thread each) exchange a message per iteration the way neighbouring
stages do: each computes (``--work`` matrix products of a (16, 256) by (256, 1024), about
0.13 ms each here), sends a (16, 256) float32 tensor (16 KiB, one micro-batch's activation in
``schedules.py`` at m = 8) to the other, and receives the other's. Measured per exchange: the
wall time and the CPU time of the rank (every thread of its process), for

* ``compute only``: the products without any message (the floor);
* ``gloo``: ``P2PTransport`` over the gloo process group (receives posted before computing,
  as the engine posts them);
* ``shm``: ``SharedMemoryTransport`` (a ring in ``/dev/shm`` per direction, a datagram to
  wake the receiver).

Each round runs every transport in turn (in reverse order every other round); the table shows
the median over the rounds of the per-round medians, and each transport's overhead over the
floor of the same round. Writes ``benchmarks/results/transport.json``::

    python benchmarks/transport.py            # about 30 s on 2 quiet cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from machine import cpu_pressure_60s
from ranks import RankPool

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ("compute only", "gloo", "shm")


def _exchange(kind: str, work: int, iterations: int) -> dict[str, float]:
    """Runs on both ranks: ``iterations`` exchanges; per-exchange wall and CPU seconds."""
    from lightning_pipe2bw.runtime.shm import SharedMemoryTransport
    from lightning_pipe2bw.runtime.transport import P2PTransport

    torch.set_num_threads(1)
    rank = dist.get_rank()
    peer = 1 - rank
    transport: Any = None
    if kind == "gloo":
        transport = P2PTransport(None, torch.device("cpu"))
    elif kind == "shm":
        token = [os.urandom(8).hex()]
        dist.broadcast_object_list(token, src=0)
        transport = SharedMemoryTransport(torch.device("cpu"), token[0], [peer])
    g = torch.Generator().manual_seed(rank)
    a, b = torch.randn(256, 1024, generator=g), torch.randn(16, 256, generator=g)
    message = torch.randn(16, 256, generator=g)
    for _ in range(5):  # the first messages carry the header
        if transport is not None:
            transport.send(message, peer)
            transport.recv(peer)
    dist.barrier()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(iterations):
        if transport is not None:
            transport.post(peer)
        for _ in range(work):
            b @ a
        if transport is not None:
            transport.send(message, peer)
            transport.recv(peer)
            transport.reap()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    if transport is not None:
        transport.wait_sends()
        if kind == "shm":
            transport.close()
    dist.barrier()
    return {"wall_ms": 1e3 * wall / iterations, "cpu_ms": 1e3 * cpu / iterations}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=int, default=20, help="matrix products per exchange")
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "transport.json"))
    args = parser.parse_args(argv)
    pressure = cpu_pressure_60s()
    pool = RankPool(2, run_id="bench-transport")
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    try:
        for r in range(args.rounds):
            for kind in reversed(KINDS) if r % 2 else KINDS:
                ranks = pool.run(_exchange, kind, args.work, args.iterations, timeout=300)
                runs[kind].append(
                    {k: statistics.median(x[k] for x in ranks) for k in ("wall_ms", "cpu_ms")}
                )
    finally:
        pool.close()
    print(
        f"2 ranks, 1 thread each; per exchange: {args.work} products of (16, 256) x (256, 1024), "
        f"a 16 KiB message each way; {args.iterations} exchanges, {args.rounds} interleaved "
        f"rounds (CPU pressure before: {pressure})"
    )
    print(
        f"{'transport':<14} {'wall ms':>8} {'cpu ms':>8} {'wall over floor':>16} {'cpu over floor':>15}"
    )
    table = []
    floor = runs[KINDS[0]]
    for kind in KINDS:
        over_wall = [x["wall_ms"] - f["wall_ms"] for x, f in zip(runs[kind], floor, strict=True)]
        over_cpu = [x["cpu_ms"] - f["cpu_ms"] for x, f in zip(runs[kind], floor, strict=True)]
        row = {
            "transport": kind,
            "rounds": runs[kind],
            "wall_ms": statistics.median(x["wall_ms"] for x in runs[kind]),
            "cpu_ms": statistics.median(x["cpu_ms"] for x in runs[kind]),
            "wall_over_floor_ms": statistics.median(over_wall),
            "cpu_over_floor_ms": statistics.median(over_cpu),
        }
        table.append(row)
        print(
            f"{kind:<14} {row['wall_ms']:>8.3f} {row['cpu_ms']:>8.3f} "
            f"{row['wall_over_floor_ms']:>16.3f} {row['cpu_over_floor_ms']:>15.3f}"
        )
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": table}, indent=2))
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
