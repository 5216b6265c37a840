"""SLURM's requeue warning, answered at a step boundary that every rank agrees on.

With ``auto_requeue`` (the default of Lightning's ``SLURMEnvironment``), Lightning answers
SLURM's warning before a job's time runs out (``--signal=USR1@T``) with a handler that writes an
HPC checkpoint (``hpc_ckpt_N.ckpt`` in ``default_root_dir``) and asks SLURM to requeue the job.
The handler runs wherever the signal lands. A checkpoint is a collective of every rank, and a
pipeline's ranks are never at the same point of a step, so the ranks that entered the save
waited for ranks still inside a step (waiting, in turn, on them) until the process group's timeout.

:class:`RequeueRelay` takes the signal over during ``fit`` and runs Lightning's handler, unchanged,
on every rank at one step boundary:

1. the signal only counts: each rank that receives it adds one to a counter in the process
   group's store (SLURM signals every task, but one task is enough);
2. the last stage reads the counter when it builds a training step's values, and a new count
   goes into those values as a request (with data parallelism, the last stages of the replicas
   agree first, so every pipeline carries the same decision in the same step);
3. the request names the training batch at whose start every rank has received those values
   (the next one; under 2BW, whose other ranks receive a step's values one step late, the one
   after), and every rank runs the handler there, or at the fit's end if that comes first.

A signal that arrives after the fit's last step was delivered is not answered: the fit is
complete and needs no requeue. Outside ``fit`` (``validate``, ``test``, ``predict``) the signal is
reported and left alone: those runs have nothing to resume.
"""

from __future__ import annotations

import signal
import threading
import weakref
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info

from lightning_pipe2bw.failures.record import say
from lightning_pipe2bw.steps.values import StepValues

__all__ = ["RequeueRelay"]

_active: weakref.ReferenceType[RequeueRelay] | None = None  # the relay in charge, if any


def _dispatch(signum: int, frame: FrameType | None) -> None:
    """The handler the process holds: the relay in charge counts the signal. Module level, so
    that a handler Lightning leaves installed after a fit holds no Trainer (see failures.signals)."""
    relay = _active() if _active is not None else None
    if relay is not None:
        relay._received(signum)


class RequeueRelay:
    """Lightning's requeue handler, deferred to a step boundary (see the module's docstring).

    Args:
        describe: who this process is, for the messages (``"rank 1 (stage 0)"``).
    """

    def __init__(self, describe: Any) -> None:
        self.describe = describe
        self.signum: signal.Signals | None = None  # the signal taken over (None: not active)
        self.due: int | None = None  # every rank: the batch at whose start a request is answered
        self.batch = -1  # training batches started in this fit
        self.fitting = False
        self._lightning: Any = None  # Lightning's handler, run at the boundary
        self._store: Any = None
        self._key = ""
        self._runs = 0  # Trainer calls so far: each counts in a key of its own
        self._seen = 0  # last stage: the count answered so far
        self._asked = False  # last stage: a request is on its way to its save

    @property
    def active(self) -> bool:
        return self.signum is not None

    def install(self, environment: ClusterEnvironment | None, fitting: bool) -> None:
        """Take the requeue signal from Lightning's handler, if Lightning set one (SLURM with
        ``auto_requeue``). Every rank calls this at the start of a Trainer call's stage; again
        after Lightning registered its handlers is a no-op."""
        global _active
        if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
            return
        signum = environment.requeue_signal
        if signum is None or not dist.is_initialized():
            return
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be set from the main thread (Lightning set none either)
        current = signal.getsignal(signum)
        if current is _dispatch or not callable(current):
            return  # ours already, or Lightning registered none (yet)
        self._runs += 1
        self.signum, self._lightning, self.fitting = signal.Signals(signum), current, fitting
        self.due, self.batch, self._asked, self._seen = None, -1, False, 0
        self._store = dist.distributed_c10d._get_default_store()
        self._key = f"pipe2bw/requeue/{self._runs}"
        _active = weakref.ref(self)
        signal.signal(signum, _dispatch)

    def uninstall(self) -> None:
        """Give the signal back to Lightning's handler (Lightning restores its own at the end of
        the Trainer call)."""
        global _active
        if self.signum is not None and signal.getsignal(self.signum) is _dispatch:
            signal.signal(self.signum, self._lightning)
        if _active is not None and _active() is self:
            _active = None
        self.signum, self._lightning, self._store, self.due = None, None, None, None

    def _received(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if not self.fitting:
            say(
                f"pipe2bw: {self.describe()} received {name} (SLURM's requeue warning) outside "
                "fit: no HPC checkpoint is written and the job is not requeued (only fit resumes)"
            )
            return
        say(
            f"pipe2bw: {self.describe()} received {name} (SLURM's requeue warning): every rank "
            "writes the HPC checkpoint at the next step boundary"
        )
        self._store.add(self._key, 1)

    # ------------------------------------------------------------------ the decision
    def decide(
        self, replicas: Any, data_parallel: int, device: torch.device, lag: int
    ) -> int | None:
        """On the last stage, once per training step: the batch (counted from the fit's start)
        at whose start every rank answers a request, or None. ``lag``: the driver's
        ``values_lag``. With data parallelism every replica's last stage calls this in the same
        step (a collective among them), and they return the same answer."""
        asked = False
        if not self._asked:
            asked = int(self._store.add(self._key, 0)) > self._seen
        if data_parallel > 1:
            flag = torch.tensor([float(asked)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=replicas)
            asked = bool(flag.item())
        if not asked:
            return None
        self._asked = True
        return self.batch + lag + 1  # every rank has this step's values by then

    def note(self, values: StepValues) -> None:
        """A step's values, delivered to this rank: the request they carry, if any."""
        due = values.requeue
        if due is not None:
            self.due = int(due)

    def start_batch(self) -> None:
        """At the start of every training batch, on every rank: a request due now is answered."""
        self.batch += 1
        if self.due is not None and self.batch >= self.due:
            self.answer()

    def answer(self) -> None:
        """On every rank at the same boundary (a batch's start, or the fit's end, where every
        step's values have arrived): Lightning's handler, which writes the HPC checkpoint (a
        collective of every rank) and then asks SLURM for the requeue from global rank 0."""
        if self.due is None or self.signum is None:
            return
        self.due = None
        rank_zero_info(
            f"pipe2bw: answering {self.signum.name} (SLURM's requeue warning) at the start of "
            f"training batch {self.batch} of this fit"
        )
        self._lightning(int(self.signum), None)
        # every rank took part in the save: every rank's count of this signal is in by now
        self._seen, self._asked = int(self._store.add(self._key, 0)), False
