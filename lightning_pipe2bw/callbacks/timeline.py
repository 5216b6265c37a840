"""A run's timeline as data and pictures: each rank's timed actions, how a rank spent its wall
time, the steady-state window to show, a Chrome trace, the timeline and loss-curve PNGs."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "Lane",
    "StepWindow",
    "TimedAction",
    "chrome_trace",
    "in_window",
    "loss_curve_png",
    "steady_window",
    "timed_actions",
    "timeline_png",
    "timeline_shares",
]

# One action as it ran: (ActionKind value such as "F" or "RECV_B", micro-batch, start, end), times
# in time.perf_counter() seconds of the rank that ran it. Plain data, so it pickles cheaply.
TimedAction = tuple[str, int, float, float]

_COMPUTE = frozenset({"F", "B", "I", "W"})
_RECV = frozenset({"RECV_F", "RECV_B"})
_NAMES = {
    "F": "forward",
    "B": "backward",
    "I": "input gradient",
    "W": "weight gradient",
    "SEND_F": "send activations",
    "RECV_F": "recv activations",
    "SEND_B": "send gradients",
    "RECV_B": "recv gradients",
    "EVICT": "evict activations",
    "RETURN": "return activations",
    "LOAD": "load activations",
}
_COLORS = {
    "F": "#4c72b0",
    "B": "#dd8452",
    "I": "#c44e52",
    "W": "#e5ae38",
    "SEND_F": "#7f7f7f",
    "SEND_B": "#7f7f7f",
    "RECV_F": "#c7c7c7",
    "RECV_B": "#c7c7c7",
    "EVICT": "#8172b3",
    "RETURN": "#8172b3",
    "LOAD": "#8172b3",
}


class Lane(NamedTuple):
    """One process's actions: its pipeline stage, its global rank, and what it ran."""

    stage: int
    rank: int
    actions: Sequence[TimedAction]


@dataclass(frozen=True)
class TimelineShares:
    """How a rank spent the wall time of its recorded timeline.

    ``wall_s`` runs from the first recorded action's start to the last one's end. Everything in it
    that is not a forward or a backward is idle: blocked in receives, sending, and the time
    between actions (optimizer step, Lightning's loop, validation outside the engine).
    """

    wall_s: float
    compute_s: float
    recv_s: float

    @property
    def idle(self) -> float:
        """1 - compute / wall; 0.0 for an empty timeline."""
        return min(max(1.0 - self.compute_s / self.wall_s, 0.0), 1.0) if self.wall_s > 0 else 0.0

    @property
    def recv(self) -> float:
        """Time in RECV_F / RECV_B actions (waiting for a peer, plus the transfer) / wall."""
        return min(self.recv_s / self.wall_s, 1.0) if self.wall_s > 0 else 0.0


def timed_actions(timeline: Iterable[Any], limit: int | None = None) -> list[TimedAction]:
    """The engine's ``ActionTiming`` entries as plain tuples; the last ``limit`` only if given."""
    out = [(e.action.kind.value, int(e.action.microbatch), e.start, e.end) for e in timeline]
    return out if limit is None else out[max(len(out) - limit, 0) :]


def timeline_shares(actions: Iterable[TimedAction]) -> TimelineShares:
    """Wall, compute and receive seconds of one rank's actions (see :class:`TimelineShares`)."""
    first, last, compute, recv = math.inf, -math.inf, 0.0, 0.0
    for kind, _, start, end in actions:
        first, last = min(first, start), max(last, end)
        if kind in _COMPUTE:
            compute += end - start
        elif kind in _RECV:
            recv += end - start
    return TimelineShares(max(last - first, 0.0) if first <= last else 0.0, compute, recv)


class StepWindow(NamedTuple):
    """A span of the run to show: from ``start`` to ``end`` (``time.perf_counter`` seconds),
    the training steps ``first`` to ``last`` (global steps, counted after each step)."""

    start: float
    end: float
    first: int
    last: int

    def label(self) -> str:
        return f"training steps {self.first}-{self.last}"


def steady_window(
    steps: Sequence[tuple[int, float, float]],
    validations: Sequence[tuple[float, float]],
    count: int,
) -> StepWindow | None:
    """The last ``count`` consecutive training steps in steady state: of the latest run of
    steps that no validation interrupts, leaving out the run's first step (a 2BW pipeline
    fills again after each flush) and the first two steps of fit. ``steps`` holds (global
    step, start, end) per training step, ``validations`` (start, end); None if no run is long
    enough (then use the whole run)."""
    runs: list[list[tuple[int, float, float]]] = []
    for step in steps:
        if runs and not any(runs[-1][-1][2] <= v0 <= step[1] for v0, _ in validations):
            runs[-1].append(step)
        else:
            runs.append([step])
    if runs:
        runs[0] = runs[0][2:]
    for run in reversed(runs):
        steady = run[1:]
        if len(steady) >= count:
            window = steady[-count:]
            return StepWindow(window[0][1], window[-1][2], window[0][0], window[-1][0])
    return None


def in_window(lanes: Sequence[Lane], window: StepWindow | None) -> list[Lane]:
    if window is None:
        return list(lanes)
    return [
        lane._replace(
            actions=[a for a in lane.actions if a[3] >= window.start and a[2] <= window.end]
        )
        for lane in lanes
    ]


def chrome_trace(lanes: Sequence[Lane]) -> dict[str, Any]:
    """A Chrome / Perfetto trace (open it in ``chrome://tracing`` or ui.perfetto.dev): one
    process per lane (pid = global rank, named "stage s (rank r)", sorted by stage) and one
    complete ("X") event per action, timestamps in microseconds from the earliest start.

    Times of different lanes are comparable only if their clocks share a base: true for
    ``time.perf_counter`` (CLOCK_MONOTONIC) of processes on one Linux host, not across hosts.
    """
    starts = [a[2] for lane in lanes for a in lane.actions]
    t0 = min(starts) if starts else 0.0
    events: list[dict[str, Any]] = []
    for lane in lanes:
        pid = lane.rank
        meta = {"ph": "M", "pid": pid, "tid": 0}
        label = f"stage {lane.stage} (rank {lane.rank})"
        events.append({**meta, "name": "process_name", "args": {"name": label}})
        events.append({**meta, "name": "process_sort_index", "args": {"sort_index": lane.stage}})
        events.append({**meta, "name": "thread_name", "args": {"name": "actions"}})
        for kind, microbatch, start, end in lane.actions:
            events.append(
                {
                    "name": _NAMES.get(kind, kind),
                    "cat": "compute" if kind in _COMPUTE else "comm",
                    "ph": "X",
                    "ts": round((start - t0) * 1e6, 3),
                    "dur": round((end - start) * 1e6, 3),
                    "pid": pid,
                    "tid": 0,
                    "args": {"microbatch": microbatch, "kind": kind, "stage": lane.stage},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _window(lanes: Sequence[Lane], window_s: float, max_actions: int) -> float:
    """Start of the plotted window: the last ``window_s`` seconds, shortened so that no lane
    shows more than its last ``max_actions`` actions (no such cap if ``max_actions <= 0``)."""
    end = max(a[3] for lane in lanes for a in lane.actions)
    start = end - window_s
    for lane in lanes:
        if max_actions > 0 and len(lane.actions) > max_actions:
            start = max(start, lane.actions[-max_actions][2])
    return start


def timeline_png(
    lanes: Sequence[Lane],
    out_png: str | Path,
    *,
    window_s: float = 2.0,
    max_actions: int = 200,
    window: StepWindow | None = None,
) -> Path:
    """Draw the schedule as it ran: one row per lane (stage 0 on top), forwards and backwards as
    tall bars colored by kind (labelled with the micro-batch when there is room), sends and
    receives as thin grey bars, idle time left white. With ``window`` (steady-state training
    steps, see :func:`steady_window`) that span is drawn, and named in the title; otherwise the
    last ``window_s`` seconds (see :func:`_window`). The x axis is milliseconds from the drawn
    span's earliest start. The same clock caveat as :func:`chrome_trace` applies."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    out = Path(out_png)
    lanes = sorted(lanes, key=lambda lane: (lane.stage, lane.rank))
    fig = Figure(figsize=(12, 1.2 + 0.7 * len(lanes)), layout="constrained")
    FigureCanvasAgg(fig)  # render with Agg, whatever the process's pyplot backend is
    ax = fig.add_subplot()
    if window is not None:
        lanes = in_window(lanes, window)
    if any(lane.actions for lane in lanes):
        start = _window(lanes, window_s, max_actions) if window is None else window.start
        shown = [[a for a in lane.actions if a[3] >= start] for lane in lanes]
        t0 = min((a[2] for row in shown for a in row), default=start)
        span_ms = max((a[3] for row in shown for a in row), default=t0) - t0
        span_ms *= 1e3
        for y, row in enumerate(shown):
            for kind, microbatch, s, e in row:
                x, w = (s - t0) * 1e3, (e - s) * 1e3
                compute = kind in _COMPUTE
                bottom, height = (y - 0.35, 0.7) if compute else (y + 0.2, 0.15)
                ax.broken_barh([(x, w)], (bottom, height), facecolors=_COLORS.get(kind, "black"))
                if compute and span_ms > 0 and w > 0.015 * span_ms:
                    ax.text(x + w / 2, y, str(microbatch), ha="center", va="center", fontsize=7)
        what = window.label() if window is not None else "the end of the run"
        ax.set_title(f"schedule as run: {what} ({span_ms:.0f} ms)")
    ax.set_yticks(range(len(lanes)), [f"stage {lane.stage}\n(rank {lane.rank})" for lane in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlabel("time (ms)")
    legend = [
        Patch(color=_COLORS[kind], label=label)
        for kind, label in (
            ("F", "forward"),
            ("B", "backward"),
            ("I", "input gradient"),
            ("W", "weight gradient"),
            ("SEND_F", "send"),
            ("RECV_F", "recv"),
        )
        if kind not in "IW" or any(k == kind for lane in lanes for k, *_ in lane.actions)
    ]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.savefig(out, dpi=110)
    return out


def loss_curve_png(
    metrics_csv: str | Path, out_png: str | Path, columns: Sequence[str] | None = None
) -> Path:
    """Plot loss against step from a Lightning ``CSVLogger`` metrics.csv (sparse: each row has
    the values logged at one point, the other cells empty). ``columns`` defaults to every column
    with "loss" in its name (``train_loss``, ``val_loss``, ...). Raises ``ValueError`` when the
    file has no ``step`` column or none of the columns has a value."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with open(metrics_csv, newline="") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        rows = list(reader)
    if "step" not in header:
        raise ValueError(f"{metrics_csv} has no 'step' column (columns: {header})")
    names = list(columns) if columns is not None else [c for c in header if "loss" in c]
    series: dict[str, tuple[list[float], list[float]]] = {}
    for name in names:
        points = [(float(r["step"]), float(r[name])) for r in rows if r.get(name) and r["step"]]
        if points:
            series[name] = ([p[0] for p in points], [p[1] for p in points])
    if not series:
        raise ValueError(
            f"no values for {names} in {metrics_csv} (columns: {header}); log a loss with "
            "self.log('train_loss', ...) and set Trainer(log_every_n_steps=...) to see it"
        )
    fig = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, (steps, values) in series.items():
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    out = Path(out_png)
    fig.savefig(out, dpi=110)
    return out
