"""Deep pipelines on 2 cores: every schedule at p = 4, 8 and 16 stages, ours against torch's,
with emulated compute.

Each block of a GPT-like body ``[embedding, N pre-LN blocks, LN + head]`` (``recipes.gpt``'s
modules, width 32, sequence 16, vocabulary 64) takes a set time while the CPU stays free: its
forward sleeps ``--forward-ms`` (F), the gradient of its input sleeps ``--input-grad-ms`` (I)
and the gradient of its weights ``--weight-grad-ms`` (W), so that a whole backward takes
B = I + W and a backward cut in two (the zero-bubble schedules) takes I and W apart, each at
its own set time. The sleeps are gradient hooks (``EmulatedBlock``): one on the block's input
(sleeping I), one on a gain the block's output is multiplied by (sleeping W, on the weights'
path only). With ``--set-costs total`` (the default) each sleep is shortened by what its part
computes besides it, measured before the rounds (:func:`calibrate`), so that a part takes its
set time in all, as a device's kernel does while the CPU goes on; ``slept`` sleeps the whole
set time after the arithmetic (the measurements before 2026-12-08). Everything else is real: tensors, Lightning's
loop and optimizer step (AdamW), the strategy, runtime, transport and schedules, and torch's
``torch.distributed.pipelining`` on the same blocks. So 16 stage processes fit on 2 cores, and
what is measured is the orchestration: schedule, engine, messages, the loop and the update.

For every (p, m) with m in ``--mb-factors`` x p, each round runs (A B A B, reversed every other
round, so that the machine's drift falls on both sides of every ratio):

* ours, ``Trainer(strategy=Pipe2BWStrategy(schedule=S, microbatches=m), devices=p)``, with each
  split of ``--splits``: ``default`` (``balance`` left out), ``hand`` (torch's: the N blocks
  cut evenly, the embedding on the first stage and the head on the last) and ``uniform``
  (even module counts, the default before the balanced split);
* torch's schedules on the hand split.

It prints, per configuration, the median ms per step over the rounds, the step the schedule
would take at the set costs with nothing else (``ideal``: our simulator on the action list
that runs, no transfer time; 2BW, 2BW on a V and PipeDream: m (F + B) per rank plus the
measured update), ``ideal / measured``, ours over torch's same schedule and over torch's
fastest flushed schedule, and the default split over the hand split, all ratios taken within
a round before their median. Writes the same as JSON, every run of every round included.

    python benchmarks/depth.py                                # p = 4, 8, 16; m = p, 2p, 4p
    python benchmarks/depth.py --ranks 4 --mb-factors 1 --rounds 1 --steps 4   # a smoke run
    python benchmarks/depth.py --ranks 2 --blocks-per-rank 4 --width 256 --seq 128 \\
        --vocab 256 --forward-ms 0 --input-grad-ms 0 --weight-grad-ms 0 \\
        --schedules 1f1b,2bw,zb-v,dualpipe-v,2bw-v --out benchmarks/results/depth_gpt.json
        # real compute: the 8-block GPT of width 256 at p = 2, no sleeps

With sleeps, the cut backward costs nothing beyond the whole one (I and W sleep apart), so our
zero-bubble schedules keep every cut that shortens the simulated step at that price
(``PIPE2BW_CUT_OVERHEAD=0``); with real compute, the CPU's measured price applies.
See ``benchmarks/README.md``. Nothing here is asserted by tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from ranks import RankPool, TaskError
from schedules import _cpu_model, _env, _log, _make_timer, _quiet, _timeline_split, fit_quietly
from torch import Tensor, nn

from lightning_pipe2bw.partition.balance import balance_by_weights
from lightning_pipe2bw.partition.cost import multiplied_parameters
from lightning_pipe2bw.recipes.gpt.model import Block, Embeddings, LMHead
from lightning_pipe2bw.schedule import REGISTRY, Costs, simulate, training_schedule

SEED = 1234
LR = 1e-3
HEADS = 2
OUR_SCHEDULES = tuple(REGISTRY)
DEFAULT_SCHEDULES = (
    "1f1b", "2bw", "zb-h1", "interleaved-1f1b", "zb-v", "dualpipe-v", "2bw-v",
)  # fmt: skip
# torch.distributed.pipelining classes (without "Schedule"): where their stages sit
TORCH_PLACEMENT = {
    "GPipe": "one",
    "1F1B": "one",
    "Interleaved1F1B": "looped",
    "InterleavedZeroBubble": "looped",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}
DEFAULT_PEERS = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
# ours -> torch's same schedule
TORCH_SAME = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "zb-v": "ZBVZeroBubble",
    "dualpipe-v": "DualPipeV",
}
SPLITS = ("default", "hand", "uniform")
TIMEOUT_S = 900.0


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Workload:
    """The body and its set costs (milliseconds per block and micro-batch)."""

    blocks: int
    width: int = 32
    seq: int = 16
    vocab: int = 64
    forward_ms: float = 10.0
    input_grad_ms: float = 10.0
    weight_grad_ms: float = 10.0
    # what an emulated block computes besides its sleeps: "mlp", x + W2 gelu(W1 x) with a hidden
    # layer 8 times as wide (a fifth of a pre-LN block's CPU time, so that 16 ranks leave 2
    # cores mostly free, as the emulation means; the head is then an eighth of a block by
    # parameters and FLOPs, as in a language model); "gpt", a pre-LN block (the outside
    # measurement's, whose own compute adds about 10% to the set costs)
    block: str = "mlp"
    # what each sleep is shortened by, per micro-batch size: (size, forward, input gradient,
    # weight gradient) in ms, the block's own arithmetic in that part and a sleep's overrun,
    # measured before the rounds on one idle process (:func:`calibrate`), so that each part
    # takes its set time in all, as a device's kernel would while the CPU that launched it
    # goes on; empty: each part sleeps its whole set time after its arithmetic
    absorbed: tuple[tuple[int, float, float, float], ...] = ()

    @property
    def emulated(self) -> bool:
        return self.forward_ms + self.input_grad_ms + self.weight_grad_ms > 0

    def sleeps(self, microbatch_size: int) -> tuple[float, float, float]:
        """Seconds the forward, input-gradient and weight-gradient hooks sleep for a
        micro-batch of ``microbatch_size`` samples."""
        cut = next((a[1:] for a in self.absorbed if a[0] == microbatch_size), (0.0, 0.0, 0.0))
        f, i, w = (
            max(0.0, t - c) / 1e3 if t > 0 else 0.0
            for t, c in zip((self.forward_ms, self.input_grad_ms, self.weight_grad_ms), cut, strict=True)
        )  # fmt: skip
        return f, i, w


def _slept(seconds: float) -> Any:
    """A gradient hook that sleeps ``seconds`` and leaves the gradient as it is."""

    def hook(grad: Tensor) -> Tensor:
        time.sleep(seconds)
        return grad

    return hook


class _MLP(nn.Module):
    """x + W2 gelu(W1 x), the hidden layer 8 times as wide."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 8 * width), nn.Linear(8 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class EmulatedBlock(nn.Module):
    """A pre-LN GPT block whose forward, input gradient and weight gradient take set times:
    its forward sleeps F; a hook on its input sleeps I when the input's gradient is computed;
    a hook on a gain its output is multiplied by (a weight, on the weights' path only) sleeps
    W when the gain's gradient is computed. Tensor hooks, not custom autograd functions: the
    engine cuts a backward in two only where no custom function could compute both halves
    in one call."""

    def __init__(self, work: Workload) -> None:
        super().__init__()
        self.block = Block(work.width, HEADS) if work.block == "gpt" else _MLP(work.width)
        self.gain = nn.Parameter(torch.ones(work.width))
        self.work = work

    def forward(self, x: Tensor) -> Tensor:
        forward_s, input_grad_s, weight_grad_s = self.work.sleeps(x.shape[0])
        if forward_s:
            time.sleep(forward_s)
        gain = self.gain
        # each hook on a view made here: a stage's input may be a buffer its receiver reuses,
        # and the gain the weight version a micro-batch runs (2BW), whose own hooks would pile
        # up or never fire
        if x.requires_grad and input_grad_s:
            x = x.view_as(x)
            x.register_hook(_slept(input_grad_s))
        if gain.requires_grad and weight_grad_s:
            gain = gain.view_as(gain)
            gain.register_hook(_slept(weight_grad_s))
        out: Tensor = self.block(x) * gain
        return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def calibrate(work: Workload, microbatch_sizes: Sequence[int], repeats: int = 40) -> Workload:
    """``work`` with each emulated part's sleep shortened by what the part costs besides it on
    one idle process with one thread: the block's forward, its input path's backward and the
    rest of its backward (each timed without sleeps), and a sleep's overrun (timed at the set
    length). The lower quartile of ``repeats`` runs after 10, so that a part never takes less
    than its set time; where the machine is busy it takes more, and that stays in the
    measurement. Everything else (the embedding, the head, the loss, the engine) keeps its own
    cost."""
    if not work.emulated or work.absorbed:
        return work
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bare = EmulatedBlock(replace(work, forward_ms=0.0, input_grad_ms=0.0, weight_grad_ms=0.0))
        overrun = []
        for length in (work.forward_ms, work.input_grad_ms, work.weight_grad_ms):
            late = []
            for _ in range(10 if length > 0 else 0):
                start = time.perf_counter()
                time.sleep(length / 1e3)
                late.append(time.perf_counter() - start - length / 1e3)
            overrun.append(1e3 * _quantile(late, 0.25) if late else 0.0)
        absorbed = []
        for size in microbatch_sizes:
            x = torch.randn(size, work.seq, work.width, requires_grad=True)
            weights = list(bare.parameters())
            forward, inputs, whole = [], [], []
            for run in range(repeats + 10):
                start = time.perf_counter()
                out = bare(x)
                t1 = time.perf_counter()
                seed = torch.ones_like(out)
                t2 = time.perf_counter()
                torch.autograd.grad(out, [x], seed, retain_graph=True)
                t3 = time.perf_counter()
                torch.autograd.grad(out, [x, *weights], seed)
                t4 = time.perf_counter()
                if run >= 10:
                    forward.append(t1 - start)
                    inputs.append(t3 - t2)
                    whole.append(t4 - t3)
            f, i, b = (1e3 * _quantile(v, 0.25) for v in (forward, inputs, whole))
            absorbed.append((size, f + overrun[0], i + overrun[1], max(b - i, 0.0) + overrun[2]))
    finally:
        torch.set_num_threads(threads)
    return replace(work, absorbed=tuple(absorbed))


def make_body(work: Workload) -> nn.Sequential:
    """``[embedding, N blocks, head]``, the same weights in every process."""
    torch.manual_seed(SEED)
    blocks = [
        EmulatedBlock(work) if work.emulated else Block(work.width, HEADS)
        for _ in range(work.blocks)
    ]
    return nn.Sequential(
        Embeddings(work.vocab, work.seq, work.width), *blocks, LMHead(work.width, work.vocab)
    )


def make_data(work: Workload, batch_size: int, steps: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, work.vocab, (batch_size * steps, work.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _lightning_module(work: Workload) -> Any:
    from lightning.pytorch import LightningModule

    class DepthModel(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = make_body(work)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            loss = loss_fn(self.body(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    return DepthModel()


def default_split(work: Workload, schedule: str, p: int) -> tuple[int, ...]:
    """The split ``balance`` left out gives this body (``partition.cost``'s multiplied
    parameters evened out, per rank where a rank holds two stages), computed here as the
    strategy computes it, so that a hand split equal to it is not run twice."""
    spec = REGISTRY[schedule]
    weights = multiplied_parameters(list(make_body(work).children()))
    return balance_by_weights(weights, p * spec.stages_per_rank, spec.placement_for(p))


def hand_split(work: Workload, stages: int) -> tuple[int, ...]:
    """torch's split in module counts: the blocks evenly, the embedding with the first stage's
    and the head with the last's."""
    per, extra = divmod(work.blocks, stages)
    if extra:
        raise ValueError(f"{work.blocks} blocks do not split evenly into {stages} stages")
    counts = [per] * stages
    counts[0] += 1
    counts[-1] += 1
    return tuple(counts)


# --------------------------------------------------------------------------- runs on every rank


def time_update(params: list[nn.Parameter], repeats: int = 7) -> float:
    """What AdamW's step takes on ``params`` (a stage's), timed apart: the update a schedule
    adds after its batch's last backward at best (median of ``repeats`` after one)."""
    params = [nn.Parameter(p.detach().clone()) for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=LR)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def run_ours(
    work: Workload, schedule: str, m: int, split: str, batch_size: int, warmup: int, steps: int
) -> dict[str, Any]:
    """Fit our strategy with ``schedule`` on this pool's ranks; the step times and the split."""
    import torch.distributed as dist

    from lightning_pipe2bw import Pipe2BWStrategy

    _quiet()
    p = dist.get_world_size()
    spec = REGISTRY[schedule]
    balance: Any = None
    if split == "hand":
        balance = hand_split(work, p * spec.stages_per_rank)
    elif split == "uniform":
        balance = "uniform"
    strategy = Pipe2BWStrategy(schedule=schedule, microbatches=m, balance=balance)
    timer = _make_timer(warmup, steps)
    cut = "0" if work.emulated else os.environ.get("PIPE2BW_CUT_OVERHEAD", "")
    with _env(PIPE2BW_CUT_OVERHEAD=cut):
        # one untimed step after the timed ones: the fit's last step drains a 2BW pipeline
        fit_quietly(
            _lightning_module(work), strategy, batch_size, warmup + steps + 1, [timer],
            data=make_data(work, batch_size, warmup + steps + 1),
        )  # fmt: skip
    return {
        "rank": dist.get_rank(),
        "stage": strategy.stage,
        "wall_s": timer.t1 - timer.t0,
        "steps": len(timer.step_s),
        "step_s": timer.step_s,
        "update_ms": time_update(list(strategy.engine.body.parameters())) if strategy.engine else 0.0,
        # the engine's actions inside the timed steps: compute, receive and send seconds, and
        # the count and seconds of each kind on each stage ("F@0")
        **_timeline_split(strategy.engine.stats.timeline, timer.t0, timer.t1),
        "balance": list(strategy.split.balance) if strategy.split else None,
        "split": strategy.split.describe() if strategy.split else "",
        "final_loss": timer.loss,
    }


def _torch_stage_ids(name: str, rank: int, world: int) -> tuple[list[int], int]:
    placement = TORCH_PLACEMENT[name]
    if placement == "one":
        return [rank], world
    if placement == "v":
        return [rank, 2 * world - 1 - rank], 2 * world
    return [rank, rank + world], 2 * world


def run_torch(
    work: Workload, name: str, m: int, batch_size: int, warmup: int, steps: int
) -> dict[str, Any]:
    """The same body under ``torch.distributed.pipelining``, cut as :func:`hand_split`."""
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining

    rank, world = dist.get_rank(), dist.get_world_size()
    ids, num_stages = _torch_stage_ids(name, rank, world)
    modules = list(make_body(work))
    bounds = [0]
    for count in hand_split(work, num_stages):
        bounds.append(bounds[-1] + count)
    submodules = [nn.Sequential(*modules[bounds[i] : bounds[i + 1]]) for i in ids]
    del modules
    device = torch.device("cpu")
    stages = [
        pipelining.PipelineStage(sub, i, num_stages, device)
        for sub, i in zip(submodules, ids, strict=True)
    ]
    cls = getattr(pipelining, f"Schedule{name}")
    schedule = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=m, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW([p for sub in submodules for p in sub.parameters()], lr=LR)
    has_input, has_target = 0 in ids, num_stages - 1 in ids
    x, y = make_data(work, batch_size, warmup + steps)
    step_s: list[float] = []
    t0 = 0.0
    for step in range(warmup + steps):
        start = time.perf_counter()
        if step == warmup:
            t0 = start
        rows = slice(step * batch_size, (step + 1) * batch_size)
        optimizer.zero_grad()
        args = (x[rows],) if has_input else ()
        kwargs: dict[str, Any] = {"target": y[rows]} if has_target else {}
        schedule.step(*args, **kwargs)
        optimizer.step()
        if step >= warmup:
            step_s.append(time.perf_counter() - start)
    return {"rank": rank, "wall_s": time.perf_counter() - t0, "steps": len(step_s), "step_s": step_s}


# --------------------------------------------------------------------------- ideals


def ideal_ms(
    work: Workload, schedule: str, p: int, m: int, update_ms: float = 0.0, early: bool = True
) -> float | None:
    """The step at the set costs with nothing else, plus ``update_ms``: our simulator on the
    action list the strategy runs (flushed schedules; the first stage's input gradient is not
    computed, its W is the whole backward, as the engine runs it); for the schedules without a
    flush, the steady batch of their stream (10 batches less 5, over 5), which is m (F + B)
    per rank for 2BW and PipeDream (:func:`no_bubble_ms`) and more where the stream's own
    order leaves gaps (2BW on a V). None without set costs (real compute)."""
    if not work.emulated:
        return None
    spec = REGISTRY[schedule]
    stages = p * spec.stages_per_rank
    per = work.blocks / stages
    f, i, w = (per * t for t in (work.forward_ms, work.input_grad_ms, work.weight_grad_ms))
    rest = stages - 1
    costs = Costs(
        forward=f, backward=i + w, input_grad=(0.0,) + (i,) * rest,
        weight_grad=(i + w,) + (w,) * rest,
    )  # fmt: skip
    if spec.asynchronous:
        five, ten = (simulate(spec.build(p, m, n), costs).step_time for n in (5, 10))
        return (ten - five) / 5 + update_ms
    built = training_schedule(schedule, p, m, early_input_grad=early, cut_overhead=0.0)
    return simulate(built, costs).step_time + update_ms


def no_bubble_ms(work: Workload, p: int, m: int, update_ms: float = 0.0) -> float:
    """m (F + B) per rank at the set costs, plus ``update_ms``: a step with no bubble (the
    same for every schedule of the body on p ranks)."""
    per_rank = work.blocks / p * (work.forward_ms + work.input_grad_ms + work.weight_grad_ms)
    return m * per_rank + update_ms


def torch_ideal_ms(work: Workload, name: str, p: int, m: int) -> float | None:
    """torch's schedule at the set costs: ours of the same shape, without our early inputs'
    gradients (torch's backwards are whole unless the schedule cuts them), None where there
    is none."""
    ours = {v: k for k, v in TORCH_SAME.items()}.get(name)
    if ours is None or REGISTRY[ours].microbatch_problem(m, p) is not None:
        return None
    return ideal_ms(work, ours, p, m, early=REGISTRY[ours].cut_backward)


# --------------------------------------------------------------------------- rounds and table


@dataclass
class Run:
    """One run of one round."""

    kind: str  # "ours" or "torch"
    name: str
    split: str  # ours: default, hand or uniform; torch: hand
    p: int
    m: int
    round: int
    step_ms: float
    # the machine's busy share over the run (set-up included): near 1, the CPU, not the
    # schedule, set the pace
    cpu_busy: float = 0.0
    update_ms: float = 0.0
    balance: list[int] | None = None
    split_rule: str = ""
    ranks: list[dict[str, Any]] = field(default_factory=list)


def _cpu_times() -> tuple[int, int]:
    """The machine's CPU time so far, all and idle (``/proc/stat``, in clock ticks)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values), values[3] + values[4]


def _step_ms(ranks: Sequence[dict[str, Any]]) -> float:
    """The slowest rank's mean step over the timed steps."""
    return 1e3 * max(r["wall_s"] / r["steps"] for r in ranks)


def measure(pool: RankPool, args: argparse.Namespace, work: Workload, run: tuple[str, str, str],
            m: int, round_: int, runs: list[Run], failures: list[dict[str, Any]]) -> None:  # fmt: skip
    kind, name, split = run
    p = pool.world_size
    _log(f"{kind} {name} ({split}) p={p} m={m}")
    total0, idle0 = _cpu_times()
    try:
        if kind == "ours":
            ranks = pool.run(run_ours, work, name, m, split, args.batch_size, args.warmup,
                             args.steps, timeout=TIMEOUT_S)  # fmt: skip
        else:
            ranks = pool.run(run_torch, work, name, m, args.batch_size, args.warmup, args.steps,
                             timeout=TIMEOUT_S)  # fmt: skip
    except TaskError as err:
        _log(f"  failed: {err.reason}")
        failures.append(dict(kind=kind, name=name, split=split, p=p, m=m, round=round_,
                             reason=err.reason))  # fmt: skip
        return
    total1, idle1 = _cpu_times()
    first = min(ranks, key=lambda r: r["rank"])
    runs.append(Run(
        kind, name, split, p, m, round_, _step_ms(ranks),
        cpu_busy=1 - (idle1 - idle0) / max(total1 - total0, 1),
        update_ms=max(r.get("update_ms", 0.0) for r in ranks),
        balance=first.get("balance"), split_rule=first.get("split", ""), ranks=ranks,
    ))  # fmt: skip
    _log(f"  {runs[-1].step_ms:.0f} ms per step, CPU {runs[-1].cpu_busy:.0%} busy")


def runnable(kind: str, name: str, p: int, m: int, work: Workload) -> bool:
    """Whether the run's schedule takes m micro-batches on p ranks of this body."""
    if kind == "torch":
        stages = p if TORCH_PLACEMENT[name] == "one" else 2 * p
        if work.blocks % stages:
            return False
        if name == "DualPipeV":
            return m >= 2 * p
        return name != "Interleaved1F1B" or m % p == 0
    spec = REGISTRY[name]
    return (
        spec.microbatch_problem(m, p) is None
        and work.blocks + 2 >= p * spec.stages_per_rank
        and work.blocks % (p * spec.stages_per_rank) == 0
    )


@dataclass
class Line:
    """One line of the table: the medians over the rounds."""

    kind: str
    name: str
    split: str
    p: int
    m: int
    step_ms: float
    rounds_ms: list[float]
    ideal_ms: float | None
    of_ideal: float | None  # ideal / measured
    of_no_bubble: float | None  # no bubble (m (F + B) per rank, the update) / measured
    vs_torch_same: float | None  # ours' speed over torch's same schedule's
    vs_torch_best: float | None  # over torch's fastest flushed schedule of the round
    vs_hand: float | None  # the split's speed over the hand split's, same schedule
    balance: list[int] | None
    split_rule: str
    cpu_busy: float
    # ours: where a step's time went, ms, the mean over ranks and the median over rounds
    breakdown: dict[str, float] | None = None


def breakdown(run: Run, work: Workload) -> dict[str, float] | None:
    """Where a step's time went on our ranks (ms, mean over ranks), from each rank's action
    timeline: its compute at the set costs, the compute beyond them (the blocks' own
    arithmetic, the engine's and autograd's work in an action, a sleep's wake-up on a busy
    machine), waiting in receives, sending, and the rest (between actions: Lightning's loop,
    the update, the engine between actions)."""
    if run.kind != "ours" or not work.emulated:
        return None
    spec = REGISTRY[run.name]
    per = work.blocks / (run.p * spec.stages_per_rank)
    f, i, w = (per * t for t in (work.forward_ms, work.input_grad_ms, work.weight_grad_ms))
    cost = {"F": f, "B": i + w, "I": i, "W": w}
    parts: dict[str, list[float]] = {}
    for rank in run.ranks:
        n = rank["steps"]
        set_ms = 0.0
        for key, (count, _) in rank["by_kind"].items():
            kind, _, stage = key.partition("@")
            if kind in cost:
                first = int(stage) == 0  # its I is free, its W the whole backward
                unit = (0.0 if kind == "I" else i + w if kind == "W" else cost[kind]) if first \
                    else cost[kind]  # fmt: skip
                set_ms += count * unit
        wall, compute = 1e3 * rank["wall_s"] / n, 1e3 * rank["compute_s"] / n
        recv, send = 1e3 * rank["recv_s"] / n, 1e3 * rank["send_s"] / n
        for label, value in (
            ("set costs", set_ms / n), ("beyond set costs", compute - set_ms / n),
            ("receive", recv), ("send", send), ("between actions", wall - compute - recv - send),
        ):  # fmt: skip
            parts.setdefault(label, []).append(value)
    return {label: sum(values) / len(values) for label, values in parts.items()}


def summarize(runs: Sequence[Run], work: Workload) -> list[Line]:
    lines: list[Line] = []
    keys = list(dict.fromkeys((r.p, r.m, r.kind, r.name, r.split) for r in runs))
    for p, m, kind, name, split in keys:
        mine = [r for r in runs if (r.p, r.m, r.kind, r.name, r.split) == (p, m, kind, name, split)]
        same, best, hand, of_ideal, of_none = [], [], [], [], []
        for run in mine:
            others = [r for r in runs if (r.p, r.m, r.round) == (p, m, run.round)]
            torch_runs = [r for r in others if r.kind == "torch"]
            peer = next((r for r in torch_runs if r.name == TORCH_SAME.get(name)), None)
            if kind == "ours" and peer is not None:
                same.append(peer.step_ms / run.step_ms)
            if kind == "ours" and torch_runs:
                best.append(min(r.step_ms for r in torch_runs) / run.step_ms)
            twin = next((r for r in others if (r.kind, r.name, r.split) == ("ours", name, "hand")),
                        None)  # fmt: skip
            if kind == "ours" and split != "hand" and twin is not None:
                hand.append(twin.step_ms / run.step_ms)
            elif kind == "ours" and run.balance == list(
                hand_split(work, p * REGISTRY[name].stages_per_rank)
            ):
                hand.append(1.0)  # the hand split itself
            ideal = (ideal_ms(work, name, p, m, run.update_ms) if kind == "ours"
                     else torch_ideal_ms(work, name, p, m))  # fmt: skip
            if ideal is not None:
                of_ideal.append(ideal / run.step_ms)
            if work.emulated and kind == "ours":
                of_none.append(no_bubble_ms(work, p, m, run.update_ms) / run.step_ms)
        update = statistics.median(r.update_ms for r in mine)
        lines.append(Line(
            kind, name, split, p, m, statistics.median(r.step_ms for r in mine),
            [round(r.step_ms, 1) for r in mine],
            ideal_ms(work, name, p, m, update) if kind == "ours"
            else torch_ideal_ms(work, name, p, m),
            statistics.median(of_ideal) if of_ideal else None,
            statistics.median(of_none) if of_none else None,
            statistics.median(same) if same else None,
            statistics.median(best) if best else None,
            statistics.median(hand) if hand else None,
            mine[0].balance, mine[0].split_rule,
            statistics.median(r.cpu_busy for r in mine),
            _median_parts([breakdown(r, work) for r in mine]),
        ))  # fmt: skip
    return lines


def _median_parts(parts: list[dict[str, float] | None]) -> dict[str, float] | None:
    found = [p for p in parts if p is not None]
    if not found:
        return None
    return {key: statistics.median(p[key] for p in found) for key in found[0]}


def print_breakdown(lines: Sequence[Line]) -> None:
    """Where our steps' time went (ms per step, mean over ranks, median over rounds)."""
    from rich.console import Console
    from rich.table import Table

    rows = [line for line in lines if line.breakdown]
    if not rows:
        return
    labels = list(rows[0].breakdown or {})
    table = Table(title="Where our step's time goes: ms per step, mean over ranks (set costs = "
                  "the actions at the sleeps' set times)", title_justify="left")  # fmt: skip
    for col in ("p", "m", "run", "ms/step", *labels):
        table.add_column(col, justify="left" if col == "run" else "right")
    for line in rows:
        parts = line.breakdown or {}
        table.add_row(str(line.p), str(line.m), f"{line.name} ({line.split})",
                      f"{line.step_ms:.0f}", *(f"{parts[k]:.1f}" for k in labels))  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


COLUMNS = ("p", "m", "run", "split", "ms/step", "rounds", "ideal ms", "ideal/meas",
           "no bubble/meas", "/ torch same", "/ torch best", "/ hand split", "CPU busy",
           "blocks per stage")  # fmt: skip


def print_table(title: str, lines: Sequence[Line], notes: Sequence[str]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, col in enumerate(COLUMNS):
        table.add_column(col, justify="left" if i in (2, 3, 13) else "right")
    previous = None
    for line in lines:
        if previous is not None and (line.p, line.m) != previous:
            table.add_section()
        previous = (line.p, line.m)
        table.add_row(
            str(line.p), str(line.m), f"{line.kind} {line.name}", line.split,
            f"{line.step_ms:.0f}",
            f"{min(line.rounds_ms):.0f}-{max(line.rounds_ms):.0f}",
            _fmt(line.ideal_ms, ".0f"), _fmt(line.of_ideal, ".2f"), _fmt(line.of_no_bubble, ".2f"),
            _fmt(line.vs_torch_same, ".2f"), _fmt(line.vs_torch_best, ".2f"),
            _fmt(line.vs_hand, ".2f"), f"{line.cpu_busy:.0%}",
            " ".join(map(str, line.balance)) if line.balance else "-",
        )  # fmt: skip
    console = Console(width=None if sys.stdout.isatty() else 200)
    table.title = escape(title)
    console.print(table)
    for note in notes:
        console.print(escape(note), highlight=False, soft_wrap=True)


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="4,8,16", help="pipeline depths p")
    parser.add_argument("--mb-factors", default="1,2,4", help="micro-batches as multiples of p")
    parser.add_argument("--blocks-per-rank", type=int, default=2,
                        help="N = this x p blocks between the embedding and the head")  # fmt: skip
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--input-grad-ms", type=float, default=10.0)
    parser.add_argument("--weight-grad-ms", type=float, default=10.0)
    parser.add_argument("--block", choices=("mlp", "gpt"), default="mlp",
                        help="what an emulated block computes besides its sleeps: a residual "
                        "MLP (little CPU) or a pre-LN block (the outside measurement's)")  # fmt: skip
    parser.add_argument("--set-costs", choices=("total", "slept"), default="total",
                        help="total: each emulated part takes its set time in all, its sleep "
                        "shortened by the block's own arithmetic and the sleep's overrun "
                        "(measured before the rounds); slept: each part sleeps its set time "
                        "after its arithmetic (the measurements before 2026-12-08)")  # fmt: skip
    parser.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES))
    parser.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                        help="torch.distributed.pipelining classes, without 'Schedule'")  # fmt: skip
    parser.add_argument("--splits", default="default,hand",
                        help=f"our splits, of {', '.join(SPLITS)}")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/depth.json"))
    args = parser.parse_args(argv)
    args.ranks = [int(p) for p in _csv(args.ranks)]
    args.mb_factors = [int(f) for f in _csv(args.mb_factors)]
    args.schedules, args.peers, args.splits = (
        _csv(args.schedules), _csv(args.peers), _csv(args.splits),
    )  # fmt: skip
    bad = ([s for s in args.schedules if s not in OUR_SCHEDULES]
           + [s for s in args.peers if s not in TORCH_PLACEMENT]
           + [s for s in args.splits if s not in SPLITS])  # fmt: skip
    if bad:
        parser.error(f"unknown {bad}: schedules {OUR_SCHEDULES}, peers {tuple(TORCH_PLACEMENT)}, "
                     f"splits {SPLITS}")  # fmt: skip
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    runs: list[Run] = []
    failures: list[dict[str, Any]] = []
    configs = [(p, f * p) for p in args.ranks for f in args.mb_factors]
    args.absorbed = ()
    if args.set_costs == "total":
        sizes = sorted({args.batch_size // m for _, m in configs})
        args.absorbed = calibrate(_workload(args, 1), sizes).absorbed
        _log("each part's sleep shortened by (micro-batch size, F, I, W ms): "
             + ", ".join(f"({n}, {f:.2f}, {i:.2f}, {w:.2f})" for n, f, i, w in args.absorbed))  # fmt: skip
    pools: dict[int, RankPool] = {}
    try:
        for round_ in range(args.rounds):
            _log(f"round {round_ + 1} of {args.rounds}")
            order = configs if round_ % 2 == 0 else configs[::-1]
            for p, m in order:
                work = _workload(args, p)
                plan = [("ours", s, split) for s in args.schedules for split in args.splits]
                plan += [("torch", name, "hand") for name in args.peers]
                plan = [r for r in plan if runnable(r[0], r[1], p, m, work)]
                # a hand split that is the default one is the same run: measured once
                plan = [r for r in plan if r[0] != "ours" or r[2] != "hand"
                        or "default" not in args.splits
                        or default_split(work, r[1], p) != hand_split(work, p * REGISTRY[r[1]].stages_per_rank)]  # fmt: skip
                if p not in pools:
                    for other in list(pools):  # one pool at a time: 16 ranks are enough
                        pools.pop(other).close()
                    pools[p] = RankPool(p, run_id="depth", pg_timeout_s=120, initializer=_quiet)
                for run in plan if round_ % 2 == 0 else plan[::-1]:
                    measure(pools[p], args, work, run, m, round_, runs, failures)
    finally:
        for pool in pools.values():
            pool.close()
    lines = [line for p in args.ranks for line in summarize(
        [r for r in runs if r.p == p], _workload(args, p))]  # fmt: skip
    work = _workload(args, args.ranks[0])
    title = (
        f"{len(os.sched_getaffinity(0))} cores ({_cpu_model()}), torch {torch.__version__}; "
        f"[embedding, {args.blocks_per_rank}p {'pre-LN' if work.block == 'gpt' else 'MLP'} "
        f"blocks, head], width {work.width}, sequence "
        f"{work.seq}, vocabulary {work.vocab}, batch {args.batch_size}, AdamW, 1 thread per rank"
        + (f"; each block F {work.forward_ms:g} ms, I {work.input_grad_ms:g} ms, W "
           f"{work.weight_grad_ms:g} ms per micro-batch ("
           + ("in all: arithmetic and sleep" if work.absorbed else "slept, after the arithmetic")
           + ")" if work.emulated
           else "; real compute")
    )
    notes = [
        f"Medians over {args.rounds} rounds of {args.steps} timed steps after {args.warmup} "
        "(A B A B, reversed every other round); ms/step = the slowest rank's mean step; "
        "ratios within a round, then their median (> 1: faster than the other).",
        "ideal = the action list that runs, simulated at the set costs with no transfer time "
        "(2BW, 2BW on a V, PipeDream: the steady batch of their stream), plus the update "
        "(AdamW's step on "
        "the slowest rank's stage, timed apart); torch's rows: the same bound for its "
        "schedule's shape. / torch same: over torch's same schedule; / torch best: over "
        "torch's fastest schedule of the round; / hand split: our split over the hand split "
        "(torch's), same schedule (1.00 where they are the same split, run once). no bubble = m (F + B) per rank plus the update: the bound "
        "of every schedule at this (p, m). CPU busy: the machine's busy share over the run, "
        "set-up included (near 100%, the CPU and not the schedule set the pace).",
    ]
    for f in failures:
        notes.append(f"FAILED {f['kind']} {f['name']} ({f['split']}) p={f['p']} m={f['m']} "
                     f"round {f['round']}: {f['reason']}")  # fmt: skip
    runtime = time.perf_counter() - started
    notes.append(f"total runtime {runtime:.0f} s; JSON: {args.out}")
    print_table(title, lines, notes)
    print_breakdown(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "meta": {
            "title": title, "command": " ".join([sys.executable, *sys.argv]),
            "cpu": _cpu_model(), "cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "runtime_s": runtime, "rounds": args.rounds, "steps": args.steps,
            "warmup": args.warmup, "batch_size": args.batch_size,
            "workload": asdict(work), "blocks_per_rank": args.blocks_per_rank,
        },
        "lines": [asdict(line) for line in lines],
        "runs": [asdict(r) for r in runs],
        "failures": failures,
    }  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=1, default=str) + "\n")


def _workload(args: argparse.Namespace, p: int) -> Workload:
    return Workload(
        blocks=args.blocks_per_rank * p, width=args.width, seq=args.seq, vocab=args.vocab,
        forward_ms=args.forward_ms, input_grad_ms=args.input_grad_ms,
        weight_grad_ms=args.weight_grad_ms, block=args.block,
        absorbed=getattr(args, "absorbed", ()),
    )  # fmt: skip


if __name__ == "__main__":
    main()
