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
from lightning_pipe2bw.pipeline.options import DEFAULT_TIMEOUT

__all__ = ["broadcast_object", "connect", "control_group", "is_initialized", "rank_zero_decision"]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def connect(env: ClusterEnvironment, backend: str, timeout: timedelta | None) -> None:
    """Join the default process group (collective), torn down at exit if this call made it."""
    created = not is_initialized()
    compat.init_dist_connection(env, backend, timeout=timeout, **_elastic_store(timeout))
    if created:
        atexit.register(_destroy_process_group)


def control_group() -> Any:
    """A gloo group of every rank (``monitored_barrier`` runs on gloo only), made collectively:
    None when the default group is gloo (use that one)."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


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
