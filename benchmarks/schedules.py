"""Throughput, bubble and memory of the pipeline schedules on CPU, against simple baselines.

One run measures, on the same model (``BLOCKS`` equal residual MLP blocks), the same data and
fp32 with AdamW:

* ``Pipe2BWStrategy`` with each schedule (gpipe, 1f1b, 2bw, pipedream) on p ranks and m
  micro-batches per batch, for every p in ``--ranks`` and m in {p, 4p} (``--mb-factors``). Each
  rank is a process with one intra-op thread that runs a real Lightning ``Trainer`` (the ranks
  look like ``torchrun`` workers, so Lightning launches nothing). A callback times the timed
  steps and reads the engine's counters: compute time (busy), the action timeline, the peak
  bytes saved for backward and the weight buffers.
* baselines: one process training the whole model with one thread (the 1x reference: the
  pipeline's limit is p times its throughput) and with all cores, both with the same micro-batch
  accumulation;
* peers: the same stages under ``torch.distributed.pipelining`` (ScheduleGPipe, Schedule1F1B
  and the multi-stage schedules that work on this machine).

Every run is repeated once per round (``--rounds``), A B A B, in reverse order every other
round; ratios are taken within a round and the table shows their medians, so that the
machine's drift cancels. It prints one table and writes the same data as JSON, every run of
every round included. Run from the repository root::

    python benchmarks/schedules.py                 # defaults: 3 rounds, about 10 minutes
    python benchmarks/schedules.py --ranks 2 --steps 10 --rounds 1 --skip-peer

See ``benchmarks/README.md`` for how to read the table. Nothing here is asserted by tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from machine import cpu_pressure_60s
from ranks import RankPool, TaskError
from torch import Tensor, nn

# --------------------------------------------------------------------------- the workload

BLOCKS = 8
WIDTH = 256
HIDDEN = 1024
LR = 1e-3
SEED = 1234
OUR_SCHEDULES = (
    "gpipe",
    "1f1b",
    "2bw",
    "pipedream",
    "zb-h1",
    "interleaved-1f1b",
    "zb-v",
    "2bw-v",
    "dualpipe-v",
)
DEFAULT_SCHEDULES = OUR_SCHEDULES[:5]  # one stage per rank; the virtual ones on request
TRANSPORTS = ("auto", "shm", "gloo")  # PIPE2BW_TRANSPORT (lightning_pipe2bw.runtime.shm)
# torch.distributed.pipelining classes, without the "Schedule" prefix; the first two run one
# stage per rank, the others two (looped/interleaved: stages r and r + p; "V": r and 2p - 1 - r)
PEER_SCHEDULES = ("GPipe", "1F1B")
PEER_CANDIDATES = (
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
_SINGLE_STAGE_PEERS = {"GPipe", "1F1B"}
_V_SHAPED_PEERS = {"ZBVZeroBubble", "DualPipeV"}
# a peer schedule that deadlocks must not eat the whole time budget
PEER_TIMEOUT_S = 60.0
OURS_TIMEOUT_S = 180.0
PG_TIMEOUT_S = 90.0


# the workload: "mlp" (the default) or "gpt" (--model); ranks started by the pools inherit it
# through the environment, which main() sets before any pool starts
MODEL = os.environ.get("PIPE2BW_BENCH_MODEL", "mlp")
GPT = {"vocab": 256, "seq": 128, "d": 256, "heads": 4, "layers": 8}


class ResidualBlock(nn.Module):
    """x + Linear(HIDDEN -> WIDTH)(GELU(Linear(WIDTH -> HIDDEN)(x)))."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class GPTBlock(nn.Module):
    """Pre-LN: x + attn(LN(x)) with causal ``scaled_dot_product_attention``, then
    x + MLP(LN(x)) with a 4x hidden layer."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class GPTFirst(nn.Module):
    """Token + position embedding, then the first block (so that the model is 8 equal-ish
    blocks, which split into 2 or 4 equal stages for torch's schedules too)."""

    def __init__(self) -> None:
        super().__init__()
        d = GPT["d"]
        self.token = nn.Embedding(GPT["vocab"], d)
        self.position = nn.Embedding(GPT["seq"], d)
        self.block = GPTBlock(d, GPT["heads"])

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.block(self.token(ids) + self.position(positions))  # type: ignore[no-any-return]


class GPTLast(nn.Module):
    """The last block, then the final LayerNorm and the head to the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        d = GPT["d"]
        self.block = GPTBlock(d, GPT["heads"])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, GPT["vocab"])

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.ln(self.block(x)))  # type: ignore[no-any-return]


def make_body(blocks: int = BLOCKS) -> nn.Sequential:
    """The whole model, with the same initial weights in every process."""
    torch.manual_seed(SEED)
    if MODEL == "gpt":
        middle = [GPTBlock(GPT["d"], GPT["heads"]) for _ in range(GPT["layers"] - 2)]
        return nn.Sequential(GPTFirst(), *middle, GPTLast())
    return nn.Sequential(*[ResidualBlock() for _ in range(blocks)])


def make_data(batch_size: int, num_batches: int) -> tuple[Tensor, Tensor]:
    """Inputs and targets for ``num_batches`` batches (the same in every process): regression
    data for the MLP; for the GPT, byte-like token sequences and the next token of each."""
    g = torch.Generator().manual_seed(0)
    n = batch_size * num_batches
    if MODEL == "gpt":
        tokens = torch.randint(0, GPT["vocab"], (n, GPT["seq"] + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    if MODEL == "gpt":
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())
    return nn.functional.mse_loss(output, target)


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _lightning_module(blocks: int = BLOCKS) -> Any:
    """The LightningModule (built lazily: Lightning is imported only where it is used)."""
    from lightning.pytorch import LightningModule

    class BenchModel(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = make_body(blocks)

        def forward(self, x: Tensor) -> Tensor:
            return self.body(x)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            loss = loss_fn(self(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    return BenchModel()


class Batches(torch.utils.data.Dataset[tuple[Tensor, ...]]):
    """Consecutive batches of ``batch_size`` rows of ``tensors``, as slices: the same reads as
    the torch loops' ``x[rows]``. A ``DataLoader`` over the samples would collate 128 of them
    per step (about 0.7 ms here, on a flush schedule's critical path), which the torch loops do
    not pay."""

    def __init__(self, batch_size: int, *tensors: Tensor) -> None:
        self.batch_size = batch_size
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0]) // self.batch_size

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return tuple(t[rows] for t in self.tensors)


def fit_quietly(
    model: Any,
    strategy: Any,
    batch_size: int,
    steps: int,
    callbacks: list[Any],
    logger: Any = False,
    accelerator: str = "cpu",
    num_batches: int | None = None,
    data: tuple[Tensor, Tensor] | None = None,
    **trainer_kwargs: Any,
) -> Any:
    """Fit ``model`` for ``steps`` steps of :func:`make_data` (or of ``data``, inputs and
    targets) on this pool's ranks (one device without a process group), with no progress bar,
    checkpoints, summary or validation (``trainer_kwargs``: more of the Trainer's arguments);
    returns the Trainer. ``num_batches``: the batches of data (default ``steps``; data-parallel
    replicas share them out)."""
    import torch.distributed as dist
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    x, y = data if data is not None else make_data(
        batch_size, steps if num_batches is None else num_batches
    )
    # batch_size=None: the loader hands over each batch as it is, no per-sample collation
    loader = DataLoader(Batches(batch_size, x, y), batch_size=None, shuffle=False)
    trainer = Trainer(
        accelerator=accelerator,
        devices=dist.get_world_size() if dist.is_initialized() else 1,
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        enable_progress_bar=False,
        logger=logger,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **trainer_kwargs,
    )
    trainer.fit(model, loader)
    return trainer


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


# --------------------------------------------------------------------------- rank pool


@contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set environment variables while child processes start (they inherit them)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------- our strategy


def _make_timer(warmup: int, steps: int) -> Any:
    from lightning.pytorch import Callback

    class WindowTimer(Callback):
        """Wall clock and engine counters at the start and end of the timed steps."""

        def __init__(self) -> None:
            self.step_start = 0.0
            self.step_s: list[float] = []
            self.t0 = self.t1 = 0.0
            self.first = 0.0  # the first step's start: the warm-up (and any compiling) to t0
            self.busy0 = self.busy1 = 0.0
            self.loss = float("nan")

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            self.step_start = time.perf_counter()
            if idx == 0:
                self.first = self.step_start
            if idx == warmup:
                self.t0 = self.step_start
                self.busy0 = trainer.strategy.engine.stats.busy_s

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int
        ) -> None:
            now = time.perf_counter()
            if warmup <= idx < warmup + steps:  # not the untimed step a run may end with
                self.step_s.append(now - self.step_start)
            if idx == warmup + steps - 1:
                self.t1 = now
                self.busy1 = trainer.strategy.engine.stats.busy_s
                self.loss = float(trainer.callback_metrics.get("train_loss", float("nan")))

    return WindowTimer()


def _schedule_of(name: str) -> str:
    """Our schedule in a run's name: ``1f1b~late@gloo`` -> ``1f1b``."""
    return name.partition("@")[0].partition("~")[0]


def _timeline_split(timeline: Sequence[Any], t0: float, t1: float) -> dict[str, Any]:
    """Seconds of compute, receive (waiting for a peer) and send actions inside [t0, t1], and
    ``by_kind``: the count and seconds of each action kind on each stage there ("F@0")."""
    out: dict[str, Any] = {"compute_s": 0.0, "recv_s": 0.0, "send_s": 0.0}
    by_kind: dict[str, list[float]] = {}  # action kind: [count, seconds]
    for entry in timeline:
        if entry.start < t0 or entry.end > t1:
            continue
        kind = entry.action.kind.value
        tally = by_kind.setdefault(f"{kind}@{entry.action.stage}", [0, 0.0])
        tally[0] += 1
        tally[1] += entry.end - entry.start
        key = (
            "compute_s"
            if entry.action.is_compute
            else ("recv_s" if kind.startswith("RECV") else "send_s")
        )
        out[key] += entry.end - entry.start
    out["by_kind"] = by_kind
    return out


def _messages(timeline: Sequence[Any], t0: float, t1: float) -> list[tuple[str, int, float, float]]:
    """The sends and receives inside [t0, t1]: (kind, micro-batch, start, end)."""
    return [
        (e.action.kind.value, e.action.microbatch, e.start, e.end)
        for e in timeline
        if not e.action.is_compute and t0 <= e.start and e.end <= t1
    ]


def message_delays(ranks: Sequence[dict[str, Any]]) -> list[float]:
    """Seconds from the end of each send to the end of its receive, or from the start of the
    receive when it began later: the time a message kept its receiver waiting beyond the send.
    Sends and receives are matched by micro-batch, in order, on each channel (stage s to s + 1
    forward, s + 1 to s backward). ``time.perf_counter`` is the same clock in every process of
    a machine."""
    by_stage = {r["stage"]: r["messages"] for r in ranks}
    delays: list[float] = []
    for s in range(len(by_stage) - 1):
        for src, dst, send, recv in (
            (s, s + 1, "SEND_F", "RECV_F"),
            (s + 1, s, "SEND_B", "RECV_B"),
        ):
            sends: dict[int, list[tuple[float, float]]] = {}
            recvs: dict[int, list[tuple[float, float]]] = {}
            for kind, mb, start, end in by_stage[src]:
                if kind == send:
                    sends.setdefault(mb, []).append((start, end))
            for kind, mb, start, end in by_stage[dst]:
                if kind == recv:
                    recvs.setdefault(mb, []).append((start, end))
            for mb, sent in sends.items():
                # a message sent near the end of the timed window may be received after it
                pairs = zip(sent, recvs.get(mb, []), strict=False)
                for (_, sent_end), (recv_start, recv_end) in pairs:
                    delays.append(max(recv_end - max(recv_start, sent_end), 0.0))
    return delays


def run_ours(
    schedule: str,
    m: int,
    batch_size: int,
    warmup: int,
    steps: int,
    memory_dir: str | None = None,
    blocks: int = BLOCKS,
    **strategy_kwargs: Any,
) -> dict[str, Any]:
    """Runs on every rank: fit a Trainer with ``Pipe2BWStrategy`` and read its counters. With
    ``memory_dir``, a ``StageMemoryMonitor`` also logs every step to a CSV logger there.
    ``blocks`` shortens the model (the planner benchmark times the loop with one block);
    ``strategy_kwargs`` go to the strategy (e.g. ``balance_activations=True``). A schedule
    name may end in ``@gloo`` or ``@shm``: the transport (``PIPE2BW_TRANSPORT``) of that run;
    ``~late`` before it runs the flush schedules with ``early_input_grad=False`` (every gradient
    sent after its whole backward, as before that option), ``~compiled`` with
    ``compile_blocks=True`` (torch.compile's defaults: inductor), ``~everycut`` a zero-bubble
    schedule with every cut its list makes (``PIPE2BW_CUT_OVERHEAD=keep``: no
    ``schedule.cuts_that_pay``)."""
    import torch.distributed as dist
    from lightning.pytorch.loggers import CSVLogger

    from lightning_pipe2bw import Pipe2BWStrategy, StageMemoryMonitor

    _quiet()  # Lightning sets its loggers' levels when imported
    schedule, _, transport = schedule.partition("@")
    schedule, _, variant = schedule.partition("~")
    cuts = os.environ.get("PIPE2BW_CUT_OVERHEAD", "")
    if variant == "everycut":
        cuts = "keep"
    elif variant == "late":
        strategy_kwargs["early_input_grad"] = False
    elif variant == "compiled":
        strategy_kwargs["compile_blocks"] = True
    elif variant:
        raise ValueError(
            f"unknown variant ~{variant} of {schedule!r}: the variants are ~late, ~compiled and "
            "~everycut"
        )
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=m, **strategy_kwargs)
    timer = _make_timer(warmup, steps)
    monitor = StageMemoryMonitor(log_every_n_steps=1, plot=False) if memory_dir else None
    model = _lightning_module(blocks)
    transport = transport or os.environ.get("PIPE2BW_TRANSPORT", "auto")
    with _env(PIPE2BW_TRANSPORT=transport, PIPE2BW_CUT_OVERHEAD=cuts):
        # one step after the timed ones: the fit's last step drains a 2BW pipeline (the flush
        # at the end of its epoch), which an epoch of real length spreads over thousands of
        # steps, not over the 10 timed here
        fit_quietly(
            model,
            strategy,
            batch_size,
            warmup + steps + 1,
            [timer, monitor] if monitor else [timer],
            logger=CSVLogger(memory_dir) if memory_dir else False,
        )
    stats = strategy.engine.stats
    driver = strategy.driver
    return {
        "rank": dist.get_rank(),
        "stage": strategy.stage,
        "threads": torch.get_num_threads(),
        "wall_s": timer.t1 - timer.t0,
        "warmup_s": timer.t0 - timer.first,  # the untimed steps, compiling included
        "steps": len(timer.step_s),
        "busy_s": timer.busy1 - timer.busy0,
        **_timeline_split(stats.timeline, timer.t0, timer.t1),
        "messages": _messages(stats.timeline, timer.t0, timer.t1),
        "step_s": timer.step_s,
        # the stage's own parameters (the module holds the whole model again after fit)
        "param_bytes": param_bytes(strategy.engine.body),
        "num_buffers": driver.weight_buffers if driver is not None else 1,
        "peak_activation_bytes": stats.peak_activation_bytes,
        "peak_inflight": stats.peak_inflight,
        "final_loss": timer.loss,
        "memory_peaks": monitor.peaks() if monitor and dist.get_rank() == 0 else None,
        # balance="auto": the step time the plan predicted, and what it chose
        "predicted_step_s": strategy.plan.best.step_time if strategy.plan else None,
        "plan": strategy.plan.best.summary() if strategy.plan else None,
        # the plan's compute and receive time per micro-batch on each rank (balance="auto")
        "predicted_compute_s": list(strategy.plan.best.compute_s) if strategy.plan else None,
        "predicted_comm_s": list(strategy.plan.best.comm_s) if strategy.plan else None,
    }


# --------------------------------------------------------------------------- torch pipelining


def _peer_stage_ids(name: str, rank: int, world: int) -> tuple[list[int], int]:
    """The stage indices this rank holds and the total number of stages."""
    if name in _SINGLE_STAGE_PEERS:
        return [rank], world
    if name in _V_SHAPED_PEERS:
        return [rank, 2 * world - 1 - rank], 2 * world
    return [rank, rank + world], 2 * world


def run_peer(name: str, m: int, batch_size: int, warmup: int, steps: int) -> dict[str, Any]:
    """Runs on every rank: the same model under ``torch.distributed.pipelining``."""
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining

    rank, world = dist.get_rank(), dist.get_world_size()
    ids, num_stages = _peer_stage_ids(name, rank, world)
    blocks = list(make_body())
    if len(blocks) % num_stages:
        raise ValueError(f"{len(blocks)} blocks do not split into {num_stages} equal stages")
    per = len(blocks) // num_stages
    submodules = [nn.Sequential(*blocks[i * per : (i + 1) * per]) for i in ids]
    del blocks
    device = torch.device("cpu")
    stages = [
        pipelining.PipelineStage(sub, i, num_stages, device)
        for sub, i in zip(submodules, ids, strict=True)
    ]
    cls = getattr(pipelining, f"Schedule{name}")
    arg = stages[0] if name in _SINGLE_STAGE_PEERS else stages
    schedule = cls(arg, n_microbatches=m, loss_fn=loss_fn)
    params = [p for sub in submodules for p in sub.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LR)
    has_input, has_target = 0 in ids, num_stages - 1 in ids
    x, y = make_data(batch_size, warmup + steps)
    step_s: list[float] = []
    t0 = 0.0
    losses: list[Tensor] = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        if step == warmup:
            t0 = start
        rows = slice(step * batch_size, (step + 1) * batch_size)
        optimizer.zero_grad()
        args = (x[rows],) if has_input else ()
        losses = []
        kwargs: dict[str, Any] = {"target": y[rows], "losses": losses} if has_target else {}
        schedule.step(*args, **kwargs)
        optimizer.step()
        if step >= warmup:
            step_s.append(time.perf_counter() - start)
    wall = time.perf_counter() - t0
    final_loss = float(torch.stack(losses).mean()) if losses else float("nan")
    return {
        "rank": rank,
        "threads": torch.get_num_threads(),
        "wall_s": wall,
        "steps": len(step_s),
        "step_s": step_s,
        "param_bytes": sum(param_bytes(sub) for sub in submodules),
        "final_loss": final_loss,
    }


# --------------------------------------------------------------------------- single process


def run_single(
    threads: int, m: int, batch_size: int, warmup: int, steps: int, max_s: float = 15.0
) -> dict[str, Any]:
    """One process, the whole model, a plain loop with gradient accumulation over m chunks.

    Cuts the warm-up after ``max_s / 3`` seconds and the timed steps after ``max_s`` (at least
    2): with more threads than free cores, OpenMP's barriers can make a step take seconds."""
    torch.set_num_threads(threads)
    model = make_body()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = make_data(batch_size, warmup + steps)
    step_s: list[float] = []
    begin = time.perf_counter()
    t0 = 0.0
    loss_value = 0.0
    for step in range(warmup + steps):
        start = time.perf_counter()
        timed = step >= warmup or start - begin > max_s / 3
        if timed and not step_s:
            t0 = start
        rows = slice(step * batch_size, (step + 1) * batch_size)
        optimizer.zero_grad()
        loss_value = 0.0
        for xs, ys in zip(x[rows].tensor_split(m), y[rows].tensor_split(m), strict=True):
            loss = loss_fn(model(xs), ys) * (xs.shape[0] / batch_size)
            loss.backward()
            loss_value += float(loss.detach())
        optimizer.step()
        if timed:
            step_s.append(time.perf_counter() - start)
            if len(step_s) == steps or (len(step_s) >= 2 and time.perf_counter() - t0 > max_s):
                break
    return {
        "threads": torch.get_num_threads(),
        "wall_s": time.perf_counter() - t0,
        "steps": len(step_s),
        "step_s": step_s,
        "param_bytes": param_bytes(model),
        "final_loss": loss_value,
    }


def measure_baselines(
    threads: int, ms: Sequence[int], batch_size: int, warmup: int, steps: int
) -> dict[int, dict[str, Any]]:
    """``run_single`` for every m in a fresh process started with ``threads`` OpenMP threads."""
    with _env(OMP_NUM_THREADS=str(threads)):
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            return {
                m: pool.submit(run_single, threads, m, batch_size, warmup, steps).result()
                for m in ms
            }


# --------------------------------------------------------------------------- summaries


@dataclass
class Row:
    """One run (of one round), or one line of the table: the median over the rounds (and one
    record of the JSON)."""

    kind: str  # "single", "ours", "torch"
    name: str
    p: int
    m: int
    samples_per_s: float
    round: int | None = None  # the round of a run; None on a line of the table
    rounds: list[float] | None = None  # on a line: samples/s of each round
    bubble_mean: float | None = None
    bubble_max: float | None = None
    recv_mean: float | None = None  # share of wall time blocked in receives (waiting for a peer)
    # how long a message kept its receiver waiting after its send (median, ms), and the share of
    # messages that did for more than 2 ms
    delay_ms: float | None = None
    delayed_share: float | None = None
    outside_mean: float | None = None  # share spent outside the engine (optimizer, Lightning)
    weight_bytes: list[int] | None = None
    activation_bytes: list[int] | None = None
    # ratios within a round (on a line: their medians over the rounds)
    speedup: float | None = None  # samples/s over the 1-thread process at the same m
    efficiency: float | None = None  # speedup / p
    vs_our_1f1b: float | None = None
    vs_torch_1f1b: float | None = None  # ours over torch's Schedule1F1B
    vs_torch_same: float | None = None  # ours over torch's same schedule (gpipe, 1f1b)
    vs_torch_best: float | None = None  # ours over the fastest torch schedule of the round
    vs_2_threads: float | None = None  # over one process with every core's thread
    ranks: list[dict[str, Any]] | None = None


def _samples_per_s(ranks: Sequence[dict[str, Any]], batch_size: int) -> float:
    """Timed samples over the slowest rank's wall time."""
    return min(r["steps"] * batch_size / r["wall_s"] for r in ranks)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def summarize_ours(name: str, m: int, ranks: list[dict[str, Any]], batch_size: int) -> Row:
    bubbles = [(r["wall_s"] - r["busy_s"]) / r["wall_s"] for r in ranks]
    delays = sorted(message_delays(ranks))
    for r in ranks:
        r.pop("messages")  # summarized here; the JSON keeps the per-step figures
    return Row(
        kind="ours",
        name=name,
        p=len(ranks),
        m=m,
        samples_per_s=_samples_per_s(ranks, batch_size),
        bubble_mean=sum(bubbles) / len(bubbles),
        bubble_max=max(bubbles),
        recv_mean=_mean([r["recv_s"] / r["wall_s"] for r in ranks]),
        outside_mean=_mean(
            [
                (r["wall_s"] - r["compute_s"] - r["recv_s"] - r["send_s"]) / r["wall_s"]
                for r in ranks
            ]
        ),
        delay_ms=1e3 * statistics.median(delays) if delays else None,
        delayed_share=sum(d > 0.002 for d in delays) / len(delays) if delays else None,
        weight_bytes=[r["num_buffers"] * r["param_bytes"] for r in ranks],
        activation_bytes=[r["peak_activation_bytes"] for r in ranks],
        ranks=ranks,
    )


def summarize_peer(name: str, m: int, ranks: list[dict[str, Any]], batch_size: int) -> Row:
    return Row(
        kind="torch",
        name=name,
        p=len(ranks),
        m=m,
        samples_per_s=_samples_per_s(ranks, batch_size),
        weight_bytes=[r["param_bytes"] for r in ranks],
        ranks=ranks,
    )


_TORCH_SAME = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "zb-v": "ZBVZeroBubble",
    "dualpipe-v": "DualPipeV",
}


def add_ratios(rows: list[Row]) -> None:
    """The ratios of one round's runs at one (p, m), to the runs of the same round: speed-up
    over the 1-thread process, efficiency, ours over torch's schedules and over all threads."""
    by_name = {(r.kind, r.name): r.samples_per_s for r in rows}
    reference = by_name.get(("single", "1 thread"))
    all_threads = max(
        (r.samples_per_s for r in rows if r.kind == "single" and r.name != "1 thread"), default=None
    )
    torch_rows = [r.samples_per_s for r in rows if r.kind == "torch"]
    for row in rows:
        if reference:
            row.speedup = row.samples_per_s / reference
            if row.kind != "single":
                row.efficiency = row.speedup / row.p
        if row.kind == "single":
            continue
        if all_threads:
            row.vs_2_threads = row.samples_per_s / all_threads
        base = by_name.get(("ours", "1f1b"))
        if base:
            row.vs_our_1f1b = row.samples_per_s / base
        if row.kind != "ours":
            continue
        peer = by_name.get(("torch", "1F1B"))
        if peer:
            row.vs_torch_1f1b = row.samples_per_s / peer
        same = by_name.get(("torch", _TORCH_SAME.get(_schedule_of(row.name), "")))
        if same:
            row.vs_torch_same = row.samples_per_s / same
        if torch_rows:
            row.vs_torch_best = row.samples_per_s / max(torch_rows)


_MEDIAN_FIELDS = (
    "samples_per_s", "bubble_mean", "bubble_max", "recv_mean", "outside_mean", "delay_ms",
    "delayed_share", "speedup",
    "efficiency", "vs_our_1f1b", "vs_torch_1f1b", "vs_torch_same", "vs_torch_best",
    "vs_2_threads",
)  # fmt: skip


def median_line(runs: list[Row]) -> Row:
    """One line of the table from the runs of one configuration in every round: the median of
    each figure and of each ratio (ratios are taken within a round, so drift cancels)."""
    first = runs[0]
    line = Row(
        kind=first.kind, name=first.name, p=first.p, m=first.m, samples_per_s=0.0,
        rounds=[r.samples_per_s for r in runs], weight_bytes=first.weight_bytes,
        activation_bytes=first.activation_bytes,
    )  # fmt: skip
    for name in _MEDIAN_FIELDS:
        values = [getattr(r, name) for r in runs if getattr(r, name) is not None]
        setattr(line, name, statistics.median(values) if values else None)
    return line


# --------------------------------------------------------------------------- printing


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mib(values: list[int] | None) -> str:
    if not values:
        return "-"
    return " ".join(f"{v / 2**20:.1f}" for v in values)


COLUMNS = (
    "p",
    "m",
    "run",
    "samples/s",
    "rounds min-max",
    "x 1thr",
    "eff",
    "bubble",
    "recv",
    "outside",
    "msg delay ms (>2 ms)",
    "weights MiB/stage",
    "peak act MiB/stage",
    "/ our 1f1b",
    "/ torch 1F1B",
    "/ torch same",
    "/ torch best",
    "/ all threads",
)
_RIGHT = {0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 13, 14, 15, 16, 17}


def _cells(row: Row) -> list[str]:
    label = {"single": "1 process", "ours": "ours", "torch": "torch"}[row.kind]
    spread = f"{min(row.rounds):.0f}-{max(row.rounds):.0f}" if row.rounds else "-"
    return [
        str(row.p),
        str(row.m),
        f"{label} {row.name}",
        f"{row.samples_per_s:.0f}",
        spread,
        _fmt(row.speedup, ".2f"),
        _fmt(row.efficiency, ".2f"),
        _fmt(row.bubble_mean, ".2f"),
        _fmt(row.recv_mean, ".2f"),
        _fmt(row.outside_mean, ".2f"),
        "-" if row.delay_ms is None else f"{row.delay_ms:.2f} ({row.delayed_share:.0%})",
        _mib(row.weight_bytes),
        _mib(row.activation_bytes),
        _fmt(row.vs_our_1f1b, ".2f"),
        _fmt(row.vs_torch_1f1b, ".2f"),
        _fmt(row.vs_torch_same, ".2f"),
        _fmt(row.vs_torch_best, ".2f"),
        _fmt(row.vs_2_threads, ".2f"),
    ]


def print_table(title: str, groups: list[list[Row]], footnotes: list[str]) -> None:
    """A rich table if rich is installed, else plain aligned text."""
    cells = [[_cells(r) for r in group] for group in groups]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        flat = [list(COLUMNS)] + [c for group in cells for c in group]
        widths = [max(len(line[i]) for line in flat) for i in range(len(COLUMNS))]

        def line(values: list[str]) -> str:
            return "  ".join(
                v.rjust(w) if i in _RIGHT else v.ljust(w)
                for i, (v, w) in enumerate(zip(values, widths, strict=True))
            )

        print(title)
        print(line(list(COLUMNS)))
        for group in cells:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))
            for values in group:
                print(line(values))
        for note in footnotes:
            print(note)
        return
    table = Table(title=title, title_justify="left", caption_justify="left")
    for i, col in enumerate(COLUMNS):
        table.add_column(col, justify="right" if i in _RIGHT else "left")
    for group in cells:
        for j, values in enumerate(group):
            table.add_row(*values, end_section=j == len(group) - 1)
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    for note in footnotes:
        console.print(note, highlight=False, soft_wrap=True)


# --------------------------------------------------------------------------- main


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="every run is repeated once per round, A B A B; the table shows medians",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument(
        "--model",
        choices=("mlp", "gpt"),
        default="mlp",
        help="mlp: 8 residual MLP blocks (the default); gpt: a GPT-like model (embedding, 8 "
        "pre-LN blocks with causal attention, d=256, 4 heads, sequence 128, vocabulary 256, "
        "LN + head; use --batch-size 32)",
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--ranks", default="2,4", help="pipeline sizes p, comma separated")
    parser.add_argument(
        "--mb-factors", default="1,4", help="micro-batches per batch as multiples of p"
    )
    parser.add_argument(
        "--schedules",
        default=",".join(DEFAULT_SCHEDULES),
        help="ours, comma separated; a name may end in @gloo or @shm to pick the transport of "
        "that run (PIPE2BW_TRANSPORT; default: auto, shared memory on one host), gpipe~late "
        "or 1f1b~late runs without early_input_grad, NAME~compiled with compile_blocks=True, "
        "and zb-h1~everycut (or zb-v, dualpipe-v) with every cut its list makes",
    )
    parser.add_argument(
        "--peer-schedules",
        default=",".join(PEER_SCHEDULES),
        help="torch.distributed.pipelining classes (without 'Schedule') always measured",
    )
    parser.add_argument(
        "--peer-candidates",
        default=",".join(PEER_CANDIDATES),
        help="further classes tried for --trial-steps steps; the fastest is measured in full",
    )
    parser.add_argument("--trial-steps", type=int, default=4)
    parser.add_argument(
        "--skip-peer", action="store_true", help="skip torch.distributed.pipelining"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/schedules.json"))
    args = parser.parse_args(argv)
    args.ranks = [int(r) for r in _csv(args.ranks)]
    args.mb_factors = [int(f) for f in _csv(args.mb_factors)]
    args.schedules = _csv(args.schedules)
    args.peer_schedules = [] if args.skip_peer else _csv(args.peer_schedules)
    args.peer_candidates = [] if args.skip_peer else _csv(args.peer_candidates)
    for p in args.ranks:
        for f in args.mb_factors:
            if args.batch_size % (p * f):
                parser.error(f"--batch-size {args.batch_size} is not divisible by m = {p * f}")
    unknown = {n for n in args.schedules if _schedule_of(n) not in OUR_SCHEDULES}
    if unknown:
        parser.error(f"unknown schedules {sorted(unknown)}; choose from {OUR_SCHEDULES}")
    variants = {n.partition("@")[0].partition("~")[2] for n in args.schedules} - {""}
    if (
        variants - {"late", "compiled", "everycut"}
        or any(_schedule_of(n) not in ("gpipe", "1f1b") for n in args.schedules if "~late" in n)
        or any(
            _schedule_of(n) not in ("zb-h1", "zb-v", "dualpipe-v")
            for n in args.schedules
            if "~everycut" in n
        )
    ):
        parser.error(
            "the variants are ~late, of gpipe and 1f1b (early_input_grad=False), ~compiled, "
            "of any schedule (compile_blocks=True), and ~everycut, of zb-h1, zb-v and dualpipe-v "
            "(every cut the schedule lists, PIPE2BW_CUT_OVERHEAD=keep)"
        )
    transports = {n.partition("@")[2] for n in args.schedules} - {"", *TRANSPORTS}
    if transports:
        parser.error(f"unknown transports {sorted(transports)}; choose from {TRANSPORTS}")
    return args


_T0 = time.perf_counter()


def _log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f} s] {message}", file=sys.stderr, flush=True)


def _machine_load() -> dict[str, float | None]:
    """1-minute load average and the share of time some task waited for a CPU (PSI, 60 s)."""
    return {"loadavg_1m": os.getloadavg()[0], "cpu_pressure_60s": cpu_pressure_60s()}


def _load_note(before: dict[str, float | None]) -> str:
    """One line on the load before the run (during it, this run's own ranks add to it)."""
    psi = before["cpu_pressure_60s"]
    note = f"load average before the run {before['loadavg_1m']:.2f}"
    if psi is not None:
        note += f", CPU pressure {psi:.0%}"
    if (before["loadavg_1m"] or 0.0) > 0.5:
        note += ": other processes were competing for the cores, so the figures are noisy"
    return note + "."


@dataclass
class Bench:
    """What every measurement shares, and the runs of every round."""

    batch_size: int
    warmup: int
    steps: int
    rows: list[Row]
    failures: list[dict[str, Any]]
    trials: list[dict[str, Any]]
    round: int = 0
    best_peer: dict[tuple[int, int], str | None] = field(default_factory=dict)

    def fail(self, kind: str, name: str, p: int, m: int, err: TaskError) -> None:
        _log(f"  failed: {err.reason}")
        self.failures.append(
            dict(kind=kind, name=name, p=p, m=m, round=self.round, reason=err.reason)
        )


def measure_ours(pool: RankPool, bench: Bench, name: str, m: int) -> None:
    """Our strategy with one schedule on the pool's ranks."""
    _log(f"ours {name} p={pool.world_size} m={m}")
    try:
        ranks = pool.run(
            run_ours, name, m, bench.batch_size, bench.warmup, bench.steps, timeout=OURS_TIMEOUT_S
        )
    except TaskError as err:
        bench.fail("ours", name, pool.world_size, m, err)
        _log(str(err))
        return
    row = summarize_ours(name, m, ranks, bench.batch_size)
    row.round = bench.round
    bench.rows.append(row)


def measure_peer(pool: RankPool, bench: Bench, name: str, m: int, steps: int) -> Row | None:
    """One torch.distributed.pipelining schedule; None (and a recorded failure) if it fails."""
    _log(f"torch {name} p={pool.world_size} m={m}" + (" (trial)" if steps < bench.steps else ""))
    warmup = bench.warmup if steps == bench.steps else 1
    try:
        ranks = pool.run(run_peer, name, m, bench.batch_size, warmup, steps, timeout=PEER_TIMEOUT_S)
    except TaskError as err:
        bench.fail("torch", name, pool.world_size, m, err)
        return None
    row = summarize_peer(name, m, ranks, bench.batch_size)
    row.round = bench.round
    return row


def choose_peer(
    pool: RankPool, bench: Bench, candidates: Sequence[str], m: int, trial_steps: int
) -> str | None:
    """The fastest of ``candidates`` in a short trial (once per (p, m), in the first round)."""
    key = (pool.world_size, m)
    if key not in bench.best_peer:
        trials = [measure_peer(pool, bench, name, m, trial_steps) for name in candidates]
        done = [row for row in trials if row is not None]
        for row in done:
            bench.trials.append(
                dict(
                    name=row.name, p=row.p, m=m, steps=trial_steps, samples_per_s=row.samples_per_s
                )
            )
        best = max(done, key=lambda row: row.samples_per_s) if done else None
        bench.best_peer[key] = best.name if best else None
    return bench.best_peer[key]


def measure_config(
    pool: RankPool, bench: Bench, args: argparse.Namespace, m: int, reverse: bool
) -> None:
    """Every run of one (p, m) in this round: ours with each schedule, then torch's (the listed
    ones and the fastest candidate), or the other way round when ``reverse``."""
    best = choose_peer(pool, bench, args.peer_candidates, m, args.trial_steps)
    peers = list(args.peer_schedules) + ([best] if best and best not in args.peer_schedules else [])
    runs: list[tuple[str, str]] = [("ours", n) for n in args.schedules]
    runs += [("torch", n) for n in peers]
    for kind, name in reversed(runs) if reverse else runs:
        if kind == "ours":
            measure_ours(pool, bench, name, m)
        else:
            row = measure_peer(pool, bench, name, m, bench.steps)
            if row is not None:
                bench.rows.append(row)


def measure_single(bench: Bench, ms: Sequence[int]) -> None:
    """The single-process baselines (1 thread and every core's thread) at every m."""
    _log(f"baselines: 1 process, m in {list(ms)}")
    for threads in (1, len(os.sched_getaffinity(0))):
        runs = measure_baselines(threads, ms, bench.batch_size, bench.warmup, bench.steps)
        for m, run in runs.items():
            bench.rows.append(
                Row(
                    kind="single",
                    name=f"{threads} thread{'s' if threads > 1 else ''}",
                    p=1,
                    m=m,
                    samples_per_s=_samples_per_s([run], bench.batch_size),
                    round=bench.round,
                    weight_bytes=[run["param_bytes"]],
                    ranks=[run],
                )
            )


def main(argv: Sequence[str] | None = None) -> None:
    global MODEL
    args = parse_args(argv)
    MODEL = os.environ["PIPE2BW_BENCH_MODEL"] = args.model  # the ranks inherit it
    started = time.perf_counter()
    load_before = _machine_load()
    configs = [(p, f * p) for p in args.ranks for f in args.mb_factors]
    ms = sorted({m for _, m in configs})
    bench = Bench(args.batch_size, args.warmup, args.steps, rows=[], failures=[], trials=[])
    pools = {
        p: RankPool(p, run_id="bench", pg_timeout_s=PG_TIMEOUT_S, initializer=_quiet)
        for p in args.ranks
    }
    try:
        # A B A B: every configuration once per round, in reverse order every other round, so
        # that the machine's drift falls on both sides of every ratio
        for bench.round in range(args.rounds):
            _log(f"round {bench.round + 1} of {args.rounds}")
            reverse = bench.round % 2 == 1
            order: list[tuple[int, int] | None] = [None, *configs]  # None: the baselines
            for config in reversed(order) if reverse else order:
                if config is None:
                    measure_single(bench, ms)
                else:
                    measure_config(pools[config[0]], bench, args, config[1], reverse)
    finally:
        for pool in pools.values():
            pool.close()
    runtime = time.perf_counter() - started
    load_after = _machine_load()

    groups = build_groups(configs, bench, args.rounds)
    title = header(args)
    notes = footnotes(args, bench)
    notes.append(_load_note(load_before))
    notes.append(f"total runtime {runtime:.0f} s; JSON: {args.out}")
    print_table(title, groups, notes)
    write_json(args.out, title, groups, bench, runtime, load_before, load_after)


def build_groups(configs: Sequence[tuple[int, int]], bench: Bench, rounds: int) -> list[list[Row]]:
    """One group of lines per (p, m): the single-process baselines, ours, then torch's; each
    line the medians over the rounds of its runs and of their ratios within each round."""
    groups: list[list[Row]] = []
    kinds = {"single": 0, "ours": 1, "torch": 2}
    for p, m in configs:
        mine = [
            r for r in bench.rows
            if (r.kind == "single" and r.m == m) or (r.kind != "single" and (r.p, r.m) == (p, m))
        ]  # fmt: skip
        for i in range(rounds):
            add_ratios([r for r in mine if r.round == i])
        by_run: dict[tuple[str, str], list[Row]] = {}
        for r in mine:
            by_run.setdefault((r.kind, r.name), []).append(r)
        lines = [median_line(runs) for runs in by_run.values()]
        groups.append(sorted(lines, key=lambda line: kinds[line.kind]))
    return groups


def header(args: argparse.Namespace) -> str:
    import lightning

    model = (
        f"GPT-like (embedding, {GPT['layers']} pre-LN blocks with causal SDPA and a 4x MLP, "
        f"d={GPT['d']}, {GPT['heads']} heads, sequence {GPT['seq']}, vocabulary {GPT['vocab']}, "
        "LN + head; the embedding and the head share a block with the first and last block)"
        if MODEL == "gpt"
        else f"{BLOCKS} x [Linear({WIDTH},{HIDDEN}) GELU Linear({HIDDEN},{WIDTH}) + residual]"
    )
    return (
        f"{len(os.sched_getaffinity(0))} cores ({platform.machine()}, {_cpu_model()}), "
        f"torch {torch.__version__}, lightning {lightning.__version__}, 1 intra-op thread per "
        f"rank; model {model} fp32 AdamW, batch {args.batch_size}, {args.warmup} warm-up + "
        f"{args.steps} timed steps"
    )


def footnotes(args: argparse.Namespace, bench: Bench) -> list[str]:
    cores = len(os.sched_getaffinity(0))
    notes = [
        f"Medians over {args.rounds} rounds; every run once per round, in reverse order every "
        "other round (A B A B), and every ratio taken within a round before its median, so the "
        "machine's drift cancels. rounds min-max = the samples/s of the fastest and slowest round.",
        "x 1thr = samples/s / (1-thread process, same m); eff = x 1thr / p: the pipeline's limit "
        "here is p times one single-threaded process. bubble = (wall - compute) / wall per rank "
        "over the timed steps; recv = blocked in receives, outside = outside the engine "
        "(optimizer, Lightning), both shares of wall time, means over ranks. msg delay = how "
        "long a message kept its receiver waiting after its send ended (median over the "
        "messages, from the action timelines), with the share of messages over 2 ms. "
        "weights = weight buffers x stage parameter bytes. / torch 1F1B, same (GPipe for gpipe, "
        "1F1B for 1f1b), best (the fastest torch schedule of the round): ours over torch's; "
        "/ all threads: over one process with a thread per core.",
    ]
    if max(args.ranks) > cores:
        notes.append(
            f"Note: {max(args.ranks)} ranks on {cores} cores are oversubscribed, so figures "
            f"with p > {cores} measure scheduling overhead more than speed-up."
        )
    if bench.trials:
        by_config: dict[tuple[int, int], list[str]] = {}
        for t in bench.trials:
            by_config.setdefault((t["p"], t["m"]), []).append(
                f"{t['name']} {t['samples_per_s']:.0f}"
            )
        notes.append(
            f"torch candidates ({args.trial_steps}-step trial, samples/s; the fastest is "
            "measured in full): "
            + "; ".join(f"p={p} m={m}: " + ", ".join(v) for (p, m), v in by_config.items())
        )
    for kind, label in (("torch", "torch schedules that failed"), ("ours", "OUR RUNS FAILED")):
        failed = [f for f in bench.failures if f["kind"] == kind]
        if failed:
            notes.append(
                f"{label}: "
                + "; ".join(f"{f['name']} (p={f['p']}, m={f['m']}): {f['reason']}" for f in failed)
            )
    return notes


def write_json(
    out: Path,
    title: str,
    groups: list[list[Row]],
    bench: Bench,
    runtime: float,
    load_before: dict[str, float | None],
    load_after: dict[str, float | None],
) -> None:
    import lightning

    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "meta": {
            "title": title,
            "cores": len(os.sched_getaffinity(0)),
            "cpu": _cpu_model(),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "python": platform.python_version(),
            "threads_per_rank": 1,
            "model": (
                {"name": "gpt", **GPT, "dtype": "float32"}
                if MODEL == "gpt"
                else {
                    "name": "mlp",
                    "blocks": BLOCKS,
                    "width": WIDTH,
                    "hidden": HIDDEN,
                    "dtype": "float32",
                }
            ),
            "optimizer": f"AdamW(lr={LR})",
            "batch_size": bench.batch_size,
            "warmup": bench.warmup,
            "steps": bench.steps,
            "rounds": bench.round + 1,
            "runtime_s": runtime,
            "load_before": load_before,
            "load_after": load_after,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "runs": [asdict(r) for r in bench.rows],
        "groups": [[asdict(r) for r in group] for group in groups],
        "failures": bench.failures,
        "peer_trials": bench.trials,
    }
    out.write_text(json.dumps(payload, indent=1, default=str) + "\n")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
