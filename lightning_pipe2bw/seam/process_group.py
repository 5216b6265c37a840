"""The default process group of a pipe2bw run: its creation (under torchrun's agent store, with
keys of each restart attempt's own), its teardown before the interpreter's, the gloo group of
every rank that a monitored barrier needs, and the strategy's collectives over it.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from lightning_pipe2bw import compat
from lightning_pipe2bw.pipeline.groups import process_group
from lightning_pipe2bw.pipeline.options import DEFAULT_TIMEOUT

__all__ = ["broadcast_object", "connect", "control_group", "is_initialized", "rank_zero_decision"]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def connect(env: ClusterEnvironment, backend: str, timeout: timedelta | None) -> None:
    """Join the default process group (collective), torn down at exit if this call made it.

    ``timeout`` is how long a rank waits for another once they run; joining waits at least
    :data:`DEFAULT_TIMEOUT` for every rank to start (a rank's first seconds import torch and
    Lightning, longer on a busy machine, and a timeout of a few seconds meant to end a hang must
    not end a start; a worker that dies while starting is its launcher's to notice)."""
    created = not is_initialized()
    store = (_elastic_store(timeout) or _joining_store(env, timeout)) if created else {}
    compat.init_dist_connection(env, backend, timeout=timeout, **store)
    if created:
        atexit.register(_destroy_process_group)


def _joining_store(env: ClusterEnvironment, timeout: timedelta | None) -> dict[str, Any]:
    """The rendezvous store torch would make from ``env`` (global rank 0 serves it), with the
    joining wait of :func:`connect`."""
    wait = max(timeout or DEFAULT_TIMEOUT, DEFAULT_TIMEOUT)
    store = TCPStore(
        env.main_address,
        env.main_port,
        env.world_size(),
        is_master=env.global_rank() == 0,
        timeout=wait,
        multi_tenant=True,  # as torch's own: a later group in this process may use the port too
    )
    return {"store": store}


def control_group() -> Any:
    """A gloo group of every rank (``monitored_barrier`` runs on gloo only), made collectively:
    None when the default group is gloo (use that one)."""
    return None if dist.get_backend() == "gloo" else process_group("control", backend="gloo")


def rank_zero_decision(decision: bool, device: torch.device) -> bool:
    """Global rank 0's ``decision``, on every rank (collective)."""
    if not is_initialized():
        return decision
    flag = torch.tensor(int(bool(decision)), device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def broadcast_object(obj: Any, src: int) -> Any:
    """``src``'s ``obj`` on every rank (collective)."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def _elastic_store(timeout: timedelta | None) -> dict[str, Any]:
    """Under torchrun's c10d rendezvous the workers of every attempt meet in the agent's one
    store, where the keys of an attempt that ended (a process's address) are still there: a
    restarted worker may read a dead peer's address and fail to connect. Each attempt gets
    keys of its own (``TORCHELASTIC_RESTART_COUNT``); outside torchrun, nothing changes."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout or DEFAULT_TIMEOUT,
    )
    return {"store": PrefixStore(f"pipe2bw/attempt_{attempt}/", store)}


def _destroy_process_group() -> None:
    """Tear down a process group this strategy created while the interpreter is still intact
    (gloo's threads torn down during interpreter shutdown can abort the process)."""
    if is_initialized():
        dist.destroy_process_group()
